"""What differs between the Triton versions the kernels support, in one place, keyed on triton.__version__.

Users run the Triton their platform's torch brings (torch 2.7 -> Triton 3.3 ... torch 2.10 / 2.11 ->
3.6); the project pins a newer one. Supported: OLDEST through PINNED (README "Supported versions").

* The megakernel's tuning (MegakernelTuning): its warps, its register ceiling and the register
  budget of its largest tiles. The one kernel holds every task type, so its registers are the most
  any task needs, and older Tritons allocate more for the same code: what keeps every value in
  registers differs per version (ptxas -v per version and variant: bench/triton_versions.py,
  bench/RESULTS.md).
* The interpreter fix: Triton's CPU interpreter before 3.7 turns a scalar into a Python int with
  int() of a one-element array, which NumPy 2.4 refuses (TypeError); every loop whose bound is a
  loaded scalar (most of the megakernel's) hits it. Applied under TRITON_INTERPRET=1 only, with
  3.7's own rule (take the 0-d value first).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import triton

# The oldest version every kernel compiles under (torch 2.7's), and the pinned one (requirements.txt).
OLDEST = (3, 3)
PINNED = (3, 9)


def version(text: str | None = None) -> tuple[int, int]:
    """(major, minor) of a Triton version string (default: the imported one's)."""
    parts = (text or triton.__version__).split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ValueError(f"unrecognised Triton version {text or triton.__version__!r}") from None


def check_supported(text: str | None = None) -> tuple[int, int]:
    """The version, or a clear error for one older than the kernels are built for."""
    v = version(text)
    if v < OLDEST:
        raise RuntimeError(f"Triton {text or triton.__version__} is older than the oldest supported, "
                           f"{OLDEST[0]}.{OLDEST[1]} (torch 2.7's): install torch >= 2.7 and the Triton it brings")
    return v


@dataclass(frozen=True)
class MegakernelTuning:
    """How the megakernel is built under a range of Triton versions."""
    num_warps: int = 4
    # Programs one SM holds at once: 64K registers / (num_warps * 32 threads * registers a thread).
    programs_per_sm: int = 2
    # The register ceiling ptxas is given (.maxnreg). Without one ptxas picks its own, and for some
    # variants it aims at three programs an SM (168 registers) and spills rather than use more
    # (ptxas 12.9, Tiling() at batch 1: head 64 on sm_80 28 B, head 256 on sm_90 36 B); 255 lets it
    # use what the programs_per_sm above leave, which those builds fit in (206 registers, no spill).
    maxnreg: int = 255
    # The most elements of a linear task's [rows, columns, K step] product and of its [columns, K
    # step] weight tile (the K step shrinks to fit both), and of an attention task's [keys, head]
    # K / V tile (fewer keys a step).
    linear_tile: int = 8192
    weight_tile: int = 8192
    attn_tile: int = 4096
    # An FP8 expert task's weight tile (bytes = elements), held as bytes and decoded floats at once:
    # half of weight_tile at 4 warps (8192 whole spilled at batch 1). Under 8 warps it stays 4096, not
    # half of theirs: 2048 bytes over 256 threads loaded 8 bytes a thread (no 128-bit load, PTX 3.6).
    fp8_weight_tile: int = 4096
    # Bytes of an expert's weight row an expert task's K loop streams a step in the streaming
    # builds (aligned variants), at batch 1, 2, 4 and 8, for 16-bit experts and for FP8 ones (0:
    # the plain loop; kernel.expert_loop). At 32 columns 512 bytes a row is 16 KB a program a trip.
    # Measured per version with ptxas and the K loops' SASS (bench/k_loops.py): the widest step with
    # no spill inside any K loop, dense or expert (3.9: FP8 512 at batch 4-8 spilled in the dense
    # loop, 80-184 B; 3.6: 512 clean at every batch, no stack above batch 1; 3.3.1: 512 leaves
    # 16-240 B of stack, none in a loop, where FP8 256 at batch 4-8 spilled 1.6-1.9 KB in the loops).
    expert_bytes: tuple[int, int, int, int] = (512, 512, 256, 512)
    fp8_expert_bytes: tuple[int, int, int, int] = (512, 512, 256, 256)


# (oldest version a row applies to, its tuning), newest first. Measured with ptxas -v; the
# budgets keep the roofline tiling (64 columns, K step 128 / batch, 64 keys) as it is, and bound
# Tiling() at batch 8 (32 x 64 per row: 16K products, which spilled 112 B even under 3.9) and
# heads of 256-512 (512 x 32 keys spilled 1 KB under 3.9).
_MEGAKERNEL: tuple[tuple[tuple[int, int], MegakernelTuning], ...] = (
    # 4 warps: <= 255 registers a thread, no spill; two programs an SM.
    ((3, 8), MegakernelTuning()),
    # 3.4-3.7 spill at 4 warps (3.6: 664 B at batch 1, 412 B at batch 8; 3.7.1: 756 / 312 B): 8 warps
    # halve each thread's share of a tile. ~255 registers x 256 threads then fill the register file:
    # one program an SM, the same 8 warps an SM as two programs of 4. At 8 warps the batch-1 weight
    # tile of the roofline tiling (64 x 128) still spilled on sm_87 (bf16 16 B, FP8 experts 72 B):
    # 64 x 64 fits. (3.4 and 3.5 not measured.)
    ((3, 4), MegakernelTuning(num_warps=8, programs_per_sm=1, weight_tile=4096, expert_bytes=(512,) * 4,
                               fp8_expert_bytes=(512,) * 4)),
    # 3.3 as 3.4-3.7 (there the 64 x 128 weight tile spilled on sm_90 too: fp32 ~290 B, bf16 160 B,
    # FP8 experts 520 B; a 4K-element product at batch 8 instead of 8K spilled 4-40 B), and 64 keys
    # x 64 left bf16 at batch 1 on the edge (0 or 8 B, by what the process compiled before): 32 keys
    # leave room. The roofline tiling at batch 8 still spills (fp32: 80 B). The FP8 weight tile of
    # 4096 leaves 16 B of stack on sm_90 outside any K loop, none on sm_87.
    (OLDEST, MegakernelTuning(num_warps=8, programs_per_sm=1, weight_tile=4096, attn_tile=2048,
                              expert_bytes=(512,) * 4, fp8_expert_bytes=(512,) * 4)),
)


def megakernel_tuning(text: str | None = None) -> MegakernelTuning:
    """The megakernel's tuning under this Triton (default: the imported one); a version older than
    OLDEST gets the oldest row (building a kernel then raises: check_supported)."""
    v = version(text)
    return next((t for since, t in _MEGAKERNEL if v >= since), _MEGAKERNEL[-1][1])


def megakernel_options(text: str | None = None) -> dict[str, int]:
    """The megakernel's triton.compile / launch options under this Triton."""
    t = megakernel_tuning(text)
    return dict(num_warps=t.num_warps, maxnreg=t.maxnreg)


def _fix_interpreter_index() -> None:
    """Before 3.7 the interpreter's tensor.__index__ is int(data) on a one-element array, a
    TypeError under NumPy >= 2.4: take the 0-d value first, as 3.7 does. The interpreter sets
    __index__ anew at every launch (3.6 restores the compiled one after), so the fix wraps that setter."""
    from triton.runtime import interpreter
    patch = interpreter._patch_lang_tensor
    if getattr(patch, "photon_index_fix", False):
        return

    def patch_with_index_fix(tensor, *scope):
        patch(tensor, *scope)
        # Set after the interpreter's own: 3.6's scope has already saved the compiled __index__ to restore.
        tensor.__index__ = lambda self: int(self.handle.data.squeeze())

    setattr(patch_with_index_fix, "photon_index_fix", True)   # read above: patch once
    interpreter._patch_lang_tensor = patch_with_index_fix


def interpreting() -> bool:
    """Whether kernels run on Triton's CPU interpreter (TRITON_INTERPRET=1, read when they are defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if interpreting() and version() < (3, 7):
    _fix_interpreter_index()
