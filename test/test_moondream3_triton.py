"""Moondream 3's text decoder (tau attention, dense and MoE layers, the region head) on the per-op
Triton backend, under the CPU interpreter, against the reference backend on the same small weights:
a prefill with a bidirectional prefix, then batched decode steps of two rows at different positions;
the prefill also against the decoder's equations (test_moondream3_text.plain_decoder, tau's tanh GELU).
Coordinate bins on both host backends: Moondream 3.1's bin / 1023, Moondream 2's bin / 1024."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import dataclasses  # noqa: E402

import torch  # noqa: E402

import moondream_fixtures as mf  # noqa: E402
import test_moondream3_checkpoints as ck  # noqa: E402
from test_moondream3_text import plain_decoder  # noqa: E402
from photon_core.models.moondream import region as md2_region  # noqa: E402
from photon_core.backends import reference as ref  # noqa: E402
from photon_core.backends.select import get_backend  # noqa: E402
from photon_core.models.moondream3 import region as md3_region  # noqa: E402
from photon_core.models.moondream3 import text as md3_text  # noqa: E402
from photon_core.models.moondream3.config import Moondream3Config  # noqa: E402


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all() and a.shape == b.shape
    return ((a - b).abs().max() / b.abs().max()).item()


def test_decoder_on_triton_matches_reference():
    cfg = ck.md3_config(text_layers=2, start_layer=1)
    cfg["text"]["vocab_size"] = 256
    sd = ck.random_md3_state(cfg, seed=11, object_bias=False)
    # A short bidirectional prefix (4 instead of 730) keeps the interpreter fast; the config
    # check that ties it to the image grid is for whole models, not this decoder-only case.
    text_cfg = dataclasses.replace(Moondream3Config.from_dict(cfg).text, prefix_attn=4, max_context=64)
    w = md3_text.TextWeights.from_state(sd, text_cfg)
    rw = md3_region.RegionWeights.from_state(sd)
    tri = get_backend("triton", "cpu")
    x = torch.randn(2, 6, text_cfg.dim, generator=torch.Generator().manual_seed(0))
    steps = torch.randn(2, 2, text_cfg.dim, generator=torch.Generator().manual_seed(1))
    outs = []
    for ops in (ref, tri):
        cache = md3_text.KVCache(text_cfg, 10, torch.float32, "cpu", batch=2)
        h = [md3_text.forward(x, 0, w, text_cfg, cache, ops)]
        h.append(md3_text.forward(steps[1:, :2] * 0.5, 6, w, text_cfg, cache.row(1), ops))  # row 1 runs ahead
        for s in range(2):   # row 0 at positions 6, 7; row 1 at 8, 9 (ragged decode)
            pos = torch.tensor([6 + s, 8 + s])
            h.append(md3_text.forward(steps[:, s:s + 1], pos, w, text_cfg, cache, ops))
        last = h[-1][:, -1]
        outs.append((torch.cat([t.reshape(-1, text_cfg.dim) for t in h]), md3_text.lm_logits(last, w, ops),
                     md3_region.decode_coords(last, rw, ops), md3_region.decode_sizes(last, rw, ops),
                     cache.k.clone()))
    (h_ref, l_ref, c_ref, s_ref, k_ref), (h_tri, l_tri, c_tri, s_tri, k_tri) = outs
    assert rel_err(h_tri, h_ref) < 1e-4
    assert rel_err(l_tri, l_ref) < 1e-4
    assert rel_err(k_tri[:, :1, :, :8], k_ref[:, :1, :, :8]) < 1e-4 and rel_err(k_tri[:, 1:], k_ref[:, 1:]) < 1e-4
    assert torch.equal(l_tri.argmax(-1), l_ref.argmax(-1))
    assert c_tri == c_ref and s_tri == s_ref
    # Each row's prefill (positions 0..5) against the equations in float64: close with tau's tanh
    # GELU, far from them with the exact erf one.
    plain_cfg = dict(cfg, text=dict(cfg["text"], prefix_attn=4))
    got = h_tri[:12].double()
    tanh, erf = (torch.cat([plain_decoder(sd, plain_cfg, xr, tau_gelu=a) for xr in x]) for a in ("tanh", "none"))
    assert rel_err(got, tanh) < 1e-5 < 1e-4 < rel_err(got, erf)       # measured 5e-7 and 3e-4


def test_coordinate_bins_decode_by_each_model_rule():
    """The host region heads on both backends: Moondream 3.1's bin / 1023, the last bin exactly 1.0
    (the makers' engine: m87-labs/kestrel, kestrel/models/moondream/region.py, linspace(0, 1, 1024));
    Moondream 2's bin / 1024 (its public code). The bins are forced by the heads' biases."""
    cfg = ck.md3_config(text_layers=1, start_layer=1)
    sd3 = ck.random_md3_state(cfg, seed=12, object_bias=False)
    sd2 = mf.random_state(mf.small_config(text_layers=1), seed=12, object_bias=False)
    hidden = torch.randn(2, cfg["text"]["dim"], generator=torch.Generator().manual_seed(2))
    want = {3: {1023: 1.0, 512: 512 / 1023}, 2: {1023: 1023 / 1024, 512: 0.5}}
    for ops in (ref, get_backend("triton", "cpu")):
        for b in (1023, 512):
            sd3["region.coord_head.bias"] = torch.zeros(1024).index_fill_(0, torch.tensor([b]), 1e4)
            sd2["region.coord_decoder.fc2.bias"] = torch.zeros(1024).index_fill_(0, torch.tensor([b]), 1e4)
            assert md3_region.decode_coords(hidden, md3_region.RegionWeights.from_state(sd3), ops) == [want[3][b]] * 2
            assert md2_region.decode_coords(hidden, md2_region.RegionWeights.from_state(sd2), ops) == [want[2][b]] * 2
