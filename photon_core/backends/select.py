"""Choosing a backend: "reference" (PyTorch), "triton" (per-op kernels) or "megakernel".

"auto" picks reference on CPU and the megakernel on CUDA, where a model loaded through
photon_core.load runs each compiled decode step on the faster of the megakernel and the per-op
engine on that GPU (megakernel/engine_choice.py; "megakernel" named: the megakernel alone). Triton code on a CPU device runs only under
Triton's interpreter (TRITON_INTERPRET=1, set before triton is first imported): that is a test mode,
hundreds of times slower than PyTorch, so it is never chosen implicitly.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

BACKENDS = ("reference", "triton", "megakernel")


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_triton_device(name: str, device: torch.device) -> None:
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"backend {name!r} on {device}: CUDA is not available in this PyTorch build")
        return
    if device.type != "cpu":
        raise RuntimeError(f"backend {name!r}: Triton kernels run on CUDA devices, not {device.type!r}")
    if not interpreter_enabled():
        raise RuntimeError(
            f"backend {name!r} on CPU needs Triton's interpreter: Triton compiles for GPUs only. For tests, "
            "set TRITON_INTERPRET=1 in the environment before Python imports triton (e.g. "
            "`TRITON_INTERPRET=1 python -m pytest ...`); for real CPU inference use backend 'reference'.")
    # triton.jit picks interpreter or compiler when a kernel is DEFINED: kernels imported before the
    # variable was set stay compiled and would fail on CPU tensors deep inside a launch.
    from photon_core.kernels import linear as _probe
    if type(_probe._linear_gemv_kernel).__name__ != "InterpretedFunction":
        raise RuntimeError(f"backend {name!r}: TRITON_INTERPRET=1 was set after photon_core.kernels was "
                           "imported; set it before the first import")


def get_backend(name: str = "auto", device: torch.device | str = "cpu") -> ModuleType:
    """The ops module for `name` on `device`. The megakernel module exposes the per-op functions too
    (prefill and anything outside a decode graph runs per-op) plus the graph builders."""
    device = torch.device(device)
    if name == "auto":
        name = "megakernel" if device.type == "cuda" else "reference"
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS} or 'auto'")
    if name == "reference":
        return importlib.import_module("photon_core.backends.reference")
    _check_triton_device(name, device)
    if name == "triton":
        return importlib.import_module("photon_core.backends.triton")
    return importlib.import_module("photon_core.megakernel")
