"""The megakernel's per-Triton tile budgets (kernel.LINEAR_TILE, WEIGHT_TILE, ATTN_TILE): where a
tile would pass them, a linear task takes shorter K steps and an attention task fewer keys a step,
and the step still equals the eager graph. Compiled builds get them from triton_versions (they bind
at batch 8 and on 256-512-wide heads); the interpreter leaves tiles as tiled, so here they are set
small enough to bind on the toy step (K step 32 -> 16, 8 keys -> 2 a step)."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import pytest  # noqa: E402
import triton.language as tl  # noqa: E402
from test_megakernel_compiler import test_compiled_step_equals_the_eager_graph as step_equals_eager  # noqa: E402

from photon_core.megakernel import Tiling  # noqa: E402
from photon_core.megakernel import kernel as mk  # noqa: E402


def test_the_interpreter_leaves_tiles_as_tiled():
    # Its budgets bind nowhere (no register file): the other interpreter tests run their own tiling.
    assert min(mk.LINEAR_TILE.value, mk.WEIGHT_TILE.value, mk.ATTN_TILE.value) >= 1 << 30


@pytest.mark.parametrize("batch,rotary,tiling,norm", [
    (1, True, Tiling(16, 32, 8, 2, 3), "rms"),
    (2, False, Tiling(16, 32, 8, 3, 2), "layer"),
    # split-K: K slices (the MLP's down projection in 2) walked in the shorter steps
    (2, False, Tiling(16, 32, 8, 2, 2, min_tasks=40, min_block_n=8, max_split_k=3), "layer"),
])
def test_a_step_within_small_tile_budgets_equals_the_eager_graph(monkeypatch, batch, rotary, tiling, norm):
    # Toy head 16 (BLOCK_D 16), 16-column tiles: a [16, 32] weight tile passes 128 elements, so the
    # K step falls to its floor of 16; an [8, 16] K / V tile passes 32, so keys go 2 a step.
    monkeypatch.setattr(mk, "LINEAR_TILE", tl.constexpr(128))
    monkeypatch.setattr(mk, "WEIGHT_TILE", tl.constexpr(128))
    monkeypatch.setattr(mk, "ATTN_TILE", tl.constexpr(32))
    step_equals_eager(batch, rotary, tiling, norm)
