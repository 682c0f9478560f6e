"""Moondream 3's text decoder against plain PyTorch statements of its equations (there is no runnable
public reference): the whole decoder (tau attention, partial rotary, the prefix-bidirectional mask,
dense and MoE layers) written out from the facts, token by token for the experts; tau against its
formula; MoE against a loop over experts; and the all-dense, tau-free configuration against
Moondream 2's decoder (proven against the public reference in test_moondream_reference.py).

Tau's GELU is the tanh approximation, the makers' engine's (m87-labs/kestrel PR #162, "Fix Moondream
tau GELU semantics"), not the exact erf of vLLM and the 3-preview code: TAU_GELU below, and
test_tau_gelu_is_the_makers_tanh_approximation shows the choice is visible in the output."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import moondream_fixtures as mf
import test_moondream3_checkpoints as ck
from photon_core.backends import reference as ref_ops
from photon_core.models.moondream import text as md2_text
from photon_core.models.moondream.config import MoondreamConfig
from photon_core.models.moondream3 import text as md3_text
from photon_core.models.moondream3.config import Moondream3Config, TextConfig

PREFIX = 730
TAU_GELU = "tanh"   # F.gelu's `approximate` for tau (module docstring)


def plain_moe(h: torch.Tensor, rw, rb, gate_up, down, top_k: int) -> torch.Tensor:
    """Softmax over all experts, per token the top_k, their probabilities renormalised; then a loop
    over experts, each a gated GELU gelu(G h) * (U h + 1) followed by D on the tokens that chose it."""
    probs = torch.softmax(h @ rw.T + rb, dim=-1)
    top = torch.topk(probs, top_k, dim=-1)
    weight = top.values / top.values.sum(-1, keepdim=True)
    inner = down.shape[-1]
    out = torch.zeros_like(h)
    for e in range(rw.shape[0]):
        tokens, slot = (top.indices == e).nonzero(as_tuple=True)
        if len(tokens) == 0:
            continue
        x = h[tokens]
        y = (F.gelu(x @ gate_up[e, :inner].T) * (x @ gate_up[e, inner:].T + 1.0)) @ down[e].T
        out.index_add_(0, tokens, weight[tokens, slot][:, None] * y)
    return out


def plain_decoder(sd: dict, cfg: dict, x: torch.Tensor, tau_gelu: str = TAU_GELU) -> torch.Tensor:
    """[T, dim] input embeddings at positions 0..T-1 -> hidden states before post_ln, [T, dim];
    tau_gelu: F.gelu's `approximate` in tau ("none": the exact erf, for contrast)."""
    t = cfg["text"]
    d, nh = t["dim"], t["n_heads"]
    hd, n = d // t["n_heads"], x.shape[0]
    rot = hd // 2
    pos = torch.arange(n, dtype=torch.float64)
    # Rotary angles in float32, as the public reference computes them (at position ~700 a float64
    # angle differs by ~1e-4 rad, visible at 1e-4 tolerance).
    inv = 1.0 / (t["rope_theta"] ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    angle = (torch.arange(n, dtype=torch.float32)[:, None] * inv).double()
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]   # [T, 1, rot/2]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    allowed = (j <= i) | ((i < t["prefix_attn"]) & (j < t["prefix_attn"]))

    def rotate(z):   # [T, H, hd]: pairs (a_k, b_k) = (z_k, z_{k + rot/2}) rotated by angle_k
        a, b = z[..., :rot // 2], z[..., rot // 2:rot]
        return torch.cat([a * cos - b * sin, a * sin + b * cos, z[..., rot:]], dim=-1)

    x = x.double()
    for layer in range(t["n_layers"]):
        p = f"text.blocks.{layer}."
        w = {k[len(p):]: v.double() for k, v in sd.items() if k.startswith(p)}
        h = F.layer_norm(x, (d,), w["ln.weight"], w["ln.bias"])
        qkv = h @ w["attn.qkv.weight"].T + w["attn.qkv.bias"]
        q, k, v = (z.reshape(n, nh, hd) for z in qkv.split(d, dim=-1))
        if t.get("tau_attn"):
            tok = torch.tanh(F.gelu(qkv, approximate=tau_gelu) @ w["tau_wqwv"].T)
            where = torch.sigmoid(w["tau_alpha"][None] * torch.log(pos[:, None] + 1)) + 0.5
            q = q * (tok[:, :nh] + where)[..., None]
            v = v * (tok[:, nh:] + where)[..., None]
        q, k = rotate(q), rotate(k)
        scores = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(hd)
        attn = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        a = torch.einsum("hij,jhd->ihd", attn, v).reshape(n, d)
        a = a @ w["attn.proj.weight"].T + w["attn.proj.bias"]
        if "router.weight" in w:
            mlp = plain_moe(h, w["router.weight"], w["router.bias"], w["experts_gate_up"], w["experts_down"],
                            t["moe"]["experts_per_token"])
        else:
            mlp = F.gelu(h @ w["mlp.fc1.weight"].T + w["mlp.fc1.bias"], approximate="tanh") \
                @ w["mlp.fc2.weight"].T + w["mlp.fc2.bias"]
        x = x + a + mlp
    return x


@pytest.fixture(scope="module")
def tiny():
    cfg = ck.md3_config(text_layers=3, start_layer=1)
    sd = ck.random_md3_state(cfg, seed=5, object_bias=False)
    config = Moondream3Config.from_dict(cfg)
    return cfg, sd, config, md3_text.TextWeights.from_state(sd, config.text)


def test_decoder_matches_its_equations_in_prefill_and_decode(tiny):
    # float64 weights: in float32 both sides drift ~1e-3 from exact on these activations (~40),
    # which would hide small errors. (The reference ops.moe computes in float32: ~4e-5.)
    cfg, sd, config, _ = tiny
    w = md3_text.TextWeights.from_state({k: v.double() for k, v in sd.items()}, config.text)
    g = torch.Generator().manual_seed(0)
    n_prompt, n_steps = 4, 3
    x = torch.randn(PREFIX + n_prompt + n_steps, cfg["text"]["dim"], generator=g, dtype=torch.float64)
    want = plain_decoder(sd, cfg, x)
    cache = md3_text.KVCache(config.text, x.shape[0], torch.float64, "cpu")
    first = PREFIX + n_prompt
    got = md3_text.forward(x[None, :first], 0, w, config.text, cache, ref_ops)[0]
    torch.testing.assert_close(got, want[:first], rtol=1e-4, atol=1e-4)
    for s in range(n_steps):   # one token at a time, the ragged (per-row position) decode path
        p = first + s
        out = md3_text.forward(x[None, p:p + 1], torch.tensor([p]), w, config.text, cache, ref_ops)[0, 0]
        torch.testing.assert_close(out, want[p], rtol=1e-4, atol=1e-4)
    logits = md3_text.lm_logits(got[-1:], w, ref_ops)
    plain_logits = F.layer_norm(want[first - 1], (cfg["text"]["dim"],), sd["text.post_ln.weight"].double(),
                                sd["text.post_ln.bias"].double()) @ sd["text.lm_head.weight"].double().T \
        + sd["text.lm_head.bias"].double()
    torch.testing.assert_close(logits[0], plain_logits.float(), rtol=1e-4, atol=1e-4)


def test_the_layers_really_differ(tiny):
    """The test above would be weak if tau or the MoE did nothing: switching either off changes the output."""
    cfg, sd, config, w = tiny
    x = torch.randn(40, cfg["text"]["dim"], generator=torch.Generator().manual_seed(1))
    base = plain_decoder(sd, cfg, x)
    no_tau = dict(cfg, text=dict(cfg["text"], tau_attn=False))
    assert (plain_decoder(sd, no_tau, x) - base).abs().max() > 1e-2
    sd2 = dict(sd)
    sd2["text.blocks.2.experts_down"] = torch.zeros_like(sd["text.blocks.2.experts_down"])
    assert (plain_decoder(sd2, cfg, x) - base).abs().max() > 1e-2


def test_tau_gelu_is_the_makers_tanh_approximation(tiny):
    """The decoder follows the tanh-GELU equations within the tolerance above (the reference MoE
    computes in float32: its rounding, ~1e-4 on these activations of ~15, is the CPU's vector
    code's); with tau's exact erf GELU instead they move by far more, so reverting the choice fails
    these tests."""
    cfg, sd, config, _ = tiny
    w = md3_text.TextWeights.from_state({k: v.double() for k, v in sd.items()}, config.text)
    x = torch.randn(PREFIX + 4, cfg["text"]["dim"], generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    cache = md3_text.KVCache(config.text, x.shape[0], torch.float64, "cpu")
    got = md3_text.forward(x[None], 0, w, config.text, cache, ref_ops)[0]
    tanh, erf = plain_decoder(sd, cfg, x), plain_decoder(sd, cfg, x, tau_gelu="none")
    torch.testing.assert_close(got, tanh, rtol=1e-4, atol=1e-4)
    assert (got - tanh).abs().max() < 1e-3 < 1e-2 < (got - erf).abs().max()


def test_tau_position_is_the_formula():
    alpha = torch.tensor([-2.0, 0.0, 0.5, 3.0])
    positions = torch.tensor([0, 1, 7, 49, 32767])
    got = md3_text.tau_position(alpha, positions)
    for i, p in enumerate(positions.tolist()):
        for h in range(4):
            want = 1 / (1 + math.exp(-alpha[h].item() * math.log(p + 1))) + 0.5
            assert abs(got[i, h].item() - want) < 1e-6
    assert torch.all(got[0] == 1.0)   # BOS (position 0): log 1 = 0, sigmoid 0.5 -> no scaling


def test_tau_scale_is_the_formula(tiny):
    cfg, sd, config, w = tiny
    b, nh = w.blocks[0], config.text.n_heads
    qkv = torch.randn(2, 3, 3 * config.text.dim, generator=torch.Generator().manual_seed(2))
    q, k, v = qkv.split(config.text.dim, dim=-1)
    got_q, got_v = md3_text.tau_scale(qkv, q, v, b, 10, nh, nh, ref_ops)
    hd = config.text.dim // nh
    for bb in range(2):
        for t in range(3):
            for h in range(nh):
                z = F.gelu(qkv[bb, t], approximate=TAU_GELU)
                where = 1 / (1 + math.exp(-float(b.tau_alpha[h]) * math.log(10 + t + 1))) + 0.5
                tq = math.tanh(float(z @ b.tau_wqwv[h])) + where
                tv = math.tanh(float(z @ b.tau_wqwv[nh + h])) + where
                sl = slice(h * hd, (h + 1) * hd)
                torch.testing.assert_close(got_q[bb, t, sl], q[bb, t, sl] * tq, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(got_v[bb, t, sl], v[bb, t, sl] * tv, rtol=1e-5, atol=1e-6)
    # one token per row at its own position (the batched decode step): row 0 at 10, row 1 at 12
    rows = torch.stack([qkv[0, 0], qkv[1, 2]])[:, None]
    rq, rk, rv = rows.split(config.text.dim, dim=-1)
    ragged_q, ragged_v = md3_text.tau_scale(rows, rq, rv, b, torch.tensor([10, 12]), nh, nh, ref_ops)
    torch.testing.assert_close(ragged_q[:, 0], torch.stack([got_q[0, 0], got_q[1, 2]]))
    torch.testing.assert_close(ragged_v[:, 0], torch.stack([got_v[0, 0], got_v[1, 2]]))


def test_moe_layer_matches_a_loop_over_experts(tiny):
    cfg, sd, config, w = tiny
    b = w.blocks[1]
    h = torch.randn(6, config.text.dim, generator=torch.Generator().manual_seed(3))
    got = ref_ops.moe(h, b.router[0], b.router[1], b.experts_gate_up, b.experts_down, ck.TOPK,
                      activation="gelu", up_offset=1.0, renormalize=True)
    want = plain_moe(h.double(), *(t.double() for t in (b.router[0], b.router[1], b.experts_gate_up,
                                                         b.experts_down)), ck.TOPK)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


def test_all_dense_without_tau_is_moondream2():
    """Same weights, Moondream 3's decoder configured dense and tau-free == Moondream 2's decoder."""
    cfg2 = mf.small_config(text_layers=3)
    sd = mf.random_state(cfg2, seed=7, object_bias=False)
    c2 = MoondreamConfig.from_dict(cfg2).text
    c3 = TextConfig(**{**cfg2["text"], "moe": None, "tau_attn": False, "rope_theta": c2.rope_theta})
    w2, w3 = md2_text.TextWeights.from_state(sd, c2), md3_text.TextWeights.from_state(sd, c3)
    x = torch.randn(1, PREFIX + 3, c2.dim, generator=torch.Generator().manual_seed(4))
    k2, k3 = (md2_text.KVCache(c2, PREFIX + 5, torch.float32, "cpu") for _ in range(2))
    h2 = md2_text.forward(x, 0, w2, c2, k2, ref_ops)
    h3 = md3_text.forward(x, 0, w3, c3, k3, ref_ops)
    assert torch.equal(md2_text.lm_logits(h2, w2, ref_ops), md3_text.lm_logits(h3, w3, ref_ops))
    step = torch.randn(1, 1, c2.dim, generator=torch.Generator().manual_seed(5))
    pos = torch.tensor([PREFIX + 3])
    assert torch.equal(md2_text.lm_logits(md2_text.forward(step, pos, w2, c2, k2, ref_ops), w2, ref_ops),
                       md3_text.lm_logits(md3_text.forward(step, pos, w3, c3, k3, ref_ops), w3, ref_ops))
