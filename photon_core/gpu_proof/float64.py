"""The step's reference (eager.run_reference) run in float64: the truth the megakernel and the
fp32 reference are both judged against (checks.judge_profile).

run_reference and the reference ops it calls are written for fp32: they cast weights, caches and
inputs with `.float()` and make fp32 buffers. Rather than a second copy of every op's reference,
the same code runs under a torch function mode that turns each cast to fp32 into a cast to
float64, makes factories default to float64, and lifts the other operand of an op that does not
promote mixed dtypes (F.linear, matmul, layer_norm, ...) to float64. Weights stay as the arena
holds them (bf16 or fp32: both exact in float64) and are widened per use, so no float64 copy of
a 9B-parameter arena is ever made; a bf16 cast stays bf16 (it models storage, not arithmetic).
`reference64` checks that every value it returns is float64, so a cast the mode missed shows as
an error, not as a silently fp32 "truth".
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

_NARROW = (torch.float32, torch.float16, torch.bfloat16)
# Tensor methods whose dtype argument reinterprets bits (view) or that write into their first
# argument: neither may be widened.
_KEEP_DTYPE = {torch.Tensor.view}


def _in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return name.endswith("_") or name in ("__setitem__",) or (name.startswith("__i") and name.endswith("__"))


class Float64(TorchFunctionMode):
    """Inside this mode fp32 arithmetic written as fp32 runs in float64 (see the module's text)."""

    def __enter__(self) -> Float64:
        self._default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.set_default_dtype(self._default)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            return args[0].double()
        if func not in _KEEP_DTYPE:
            args, kwargs = tree_map(lambda v: torch.float64 if v is torch.float32 else v, (args, kwargs))
        wide = any(isinstance(v, torch.Tensor) and v.dtype == torch.float64 for v in _flat(args, kwargs))
        if wide:
            inplace = _in_place(func)

            def lift(v: Any) -> Any:
                return v.double() if isinstance(v, torch.Tensor) and v.dtype in _NARROW else v
            first, rest = (args[0], args[1:]) if inplace and args else (None, args)
            args, kwargs = tree_map(lift, (rest, kwargs))
            if inplace and first is not None:
                args = (first, *args)
        return func(*args, **kwargs)


def _flat(args: tuple, kwargs: dict) -> list:
    out: list = []
    tree_map(out.append, (args, kwargs))
    return out


def reference64(graph: Any, weights: Mapping[str, torch.Tensor], caches64: Mapping[str, torch.Tensor],
                tokens: list[int], positions: list[int], cross_len: list[int] | None = None,
                inputs: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """run_reference in float64. `caches64`: float64 copies of the history (updated in place, as
    run_reference updates its caches); weights and inputs as the fp32 reference gets them."""
    from photon_core.megakernel.eager import run_reference
    for name, t in caches64.items():
        if t.dtype != torch.float64:
            raise ValueError(f"reference64: cache {name!r} is {t.dtype}; pass float64 copies")
    with Float64():
        out = run_reference(graph, weights, caches64, tokens, positions, cross_len, inputs)
    narrow = [k for k, v in out.items() if isinstance(v, torch.Tensor) and v.is_floating_point()
              and v.dtype != torch.float64]
    if narrow:
        raise RuntimeError(f"reference64: values {narrow[:5]} came out in fp32: a cast the float64 mode missed")
    return out


def widened(caches: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """float64 copies of a reference's caches and states (exact: they hold fp32 or bf16)."""
    return {k: v.double() for k, v in caches.items()}
