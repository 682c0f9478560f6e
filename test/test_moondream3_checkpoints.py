"""Moondream 3 checkpoints: tiny random ones with the real tensor names in both shipped formats
(3.1's model.safetensors, 3-preview's model_fp8.pt), and what reading them must give: the names, the
FP8 e4m3 dequantization (against a hand decoding of the e4m3 bits), tau_wq + tau_wv fusion, the
8-row gate/up interleave, clear errors, and the registry's family choice.

The builders here are imported by the other test_moondream3_* modules."""
from __future__ import annotations

import copy
import functools
import json
import math
import shutil
import tempfile
import atexit
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import moondream_fixtures as mf
from photon_core import registry
from photon_core.models.moondream3 import weights as w3
from photon_core.models.moondream3.config import Moondream3Config

FP8_MAX = 448.0
E, I, TOPK = 4, 16, 2


def md3_config(text_layers: int = 3, start_layer: int = 1) -> dict:
    cfg = mf.small_config(vision_layers=1, text_layers=text_layers)
    cfg["text"].update(rope_theta=1_500_000.0, max_context=1024, tau_attn=True,
                       moe={"num_experts": E, "start_layer": start_layer, "experts_per_token": TOPK,
                            "expert_inner_dim": I})
    del cfg["region"]["inner_dim"]
    return cfg


def random_md3_state(cfg: dict, seed: int = 0, object_bias: bool = True) -> dict[str, torch.Tensor]:
    """Reference-named float32 tensors (what the loader must produce)."""
    md2_cfg = copy.deepcopy(cfg)
    md2_cfg["region"]["inner_dim"] = 8
    sd = mf.random_state(md2_cfg, seed, object_bias)
    g = torch.Generator().manual_seed(seed + 1000)
    t, r = cfg["text"], cfg["region"]
    d, h = t["dim"], t["n_heads"]
    for k in [k for k in sd if k.startswith(("region.coord_decoder", "region.size_decoder"))]:
        del sd[k]
    for i in range(t["n_layers"]):
        p = f"text.blocks.{i}."
        if i >= t["moe"]["start_layer"]:
            for k in ("mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias"):
                del sd[p + k]
            sd[p + "router.weight"] = torch.randn(E, d, generator=g) * 0.5
            sd[p + "router.bias"] = torch.randn(E, generator=g) * 0.5
            sd[p + "experts_gate_up"] = torch.randn(E, 2 * I, d, generator=g) * 0.2
            sd[p + "experts_down"] = torch.randn(E, d, I, generator=g) * 0.2
        sd[p + "tau_wqwv"] = torch.randn(2 * h, 3 * d, generator=g) * 0.1
        sd[p + "tau_alpha"] = torch.randn(h, generator=g)
    sd["region.ln.weight"] = 1 + 0.1 * torch.randn(d, generator=g)
    sd["region.ln.bias"] = 0.1 * torch.randn(d, generator=g)
    sd["region.coord_head.weight"] = torch.randn(r["coord_out_dim"], d, generator=g) * 0.5
    sd["region.coord_head.bias"] = torch.randn(r["coord_out_dim"], generator=g) * 0.1
    sd["region.size_head.weight"] = torch.randn(r["size_out_dim"], d, generator=g) * 0.5
    sd["region.size_head.bias"] = torch.randn(r["size_out_dim"], generator=g) * 0.1
    return sd


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 e4m3: (fp8 weight, scale [E, rows]) with w ~ fp8 * scale."""
    scale = w.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    return (w / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantized(sd: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(state with the experts replaced by their FP8 round trip, {name: (fp8, scale)})."""
    sd, q = dict(sd), {}
    for k in [k for k in sd if k.endswith(("experts_gate_up", "experts_down"))]:
        q[k] = quantize_rows(sd[k])
        sd[k] = q[k][0].float() * q[k][1][..., None]
    return sd, q


def to_checkpoint_names(sd: dict[str, torch.Tensor], fp8: dict | None, fused_tau: bool,
                        orig_mod: bool = False) -> dict[str, torch.Tensor]:
    """Moondream 3's checkpoint naming, written out by hand."""
    shared, out = {}, {}
    for k, t in sd.items():
        parts = k.split(".")
        if k.startswith("text.blocks.") and parts[3] in ("router", "experts_gate_up", "experts_down",
                                                         "tau_wqwv", "tau_alpha"):
            h = f"text_model.transformer.h.{parts[2]}."
            if parts[3] == "router":
                out[h + "gate." + parts[4]] = t
            elif parts[3] in ("experts_gate_up", "experts_down"):
                name = h + ("mlp.experts.weight" if parts[3] == "experts_gate_up" else "mlp.output_experts.weight")
                if fp8 is not None:
                    out[name] = fp8[k][0]
                    out[h + "moe_quant." + ("up_scale" if parts[3] == "experts_gate_up" else "down_scale")] = fp8[k][1]
                else:
                    out[name] = t
            elif parts[3] == "tau_wqwv" and not fused_tau:
                out[h + "tau_wq"], out[h + "tau_wv"] = t.chunk(2, dim=0)
            else:
                out[h + parts[3]] = t
        elif k.startswith("region.") and parts[1] in ("ln", "coord_head", "size_head"):
            out["region_model." + {"ln": "ln", "coord_head": "coordinate_head",
                                   "size_head": "size_head"}[parts[1]] + "." + parts[2]] = t
        else:
            shared[k] = t
    out.update(mf.to_old_names(shared))
    if orig_mod:   # torch.compile'd training leaves this in some names
        out = {k.replace("text_model.transformer", "text_model._orig_mod.transformer"): v for k, v in out.items()}
    return {k: v.contiguous() for k, v in out.items()}


def md3_tokenizer():
    """Moondream 2's test tokenizer with SVG path words at ids 21.. (commands, '-', numbers 0..960)."""
    tok = mf.build_tokenizer()
    vocab = tok.get_vocab()
    path_words = list("MLHVCSQTAZmlz") + ["-"] + [str(n) for n in range(0, 961)]
    by_id = {i: w for w, i in vocab.items()}
    for j, word in enumerate(path_words):
        by_id[21 + j] = word
    from tokenizers import Tokenizer, models, pre_tokenizers
    new = Tokenizer(models.WordLevel({w: i for i, w in by_id.items()}, unk_token="<unk>"))
    new.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return new


def write_checkpoint(folder: Path, fmt: str, seed: int = 0, object_bias: bool = True,
                     config: dict | None = None, wrapped_config: bool = False) -> tuple[Path, dict]:
    """fmt: "safetensors" (FP8 experts + scales, fused tau), "safetensors-float" (float experts),
    "pt" (model_fp8.pt: FP8 experts + scales, separate tau_wq/tau_wv, ._orig_mod names).
    Returns (folder, the reference-named state the loader must give)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = config or md3_config()
    sd = random_md3_state(cfg, seed, object_bias)
    if fmt == "safetensors-float":
        save_file(to_checkpoint_names(sd, None, True), str(folder / "model.safetensors"))
    else:
        sd, q = quantized(sd)
        names = to_checkpoint_names(sd, q, fused_tau=fmt == "safetensors", orig_mod=fmt == "pt")
        if fmt == "safetensors":
            save_file(names, str(folder / "model.safetensors"))
        elif fmt == "pt":
            torch.save(names, folder / "model_fp8.pt")
        else:
            raise ValueError(fmt)
    body = {"model_type": "moondream3", "config": cfg} if wrapped_config else cfg
    (folder / "config.json").write_text(json.dumps(body))
    md3_tokenizer().save(str(folder / "tokenizer.json"))
    return folder, sd


_ROOT = Path(tempfile.mkdtemp(prefix="photon_md3_test_"))
atexit.register(shutil.rmtree, _ROOT, True)


@functools.lru_cache(maxsize=None)
def checkpoint(fmt: str = "safetensors", seed: int = 0, object_bias: bool = True) -> tuple[Path, dict]:
    return write_checkpoint(_ROOT / f"{fmt}_{seed}_{int(object_bias)}", fmt, seed, object_bias)


@functools.lru_cache(maxsize=None)
def model(fmt: str = "safetensors", seed: int = 0, object_bias: bool = True):
    from photon_core.models.moondream3 import load_moondream3
    return load_moondream3(checkpoint(fmt, seed, object_bias)[0])


# ------------------------------------------------------------------------------------------- tests

def _e4m3_by_hand(byte: int) -> float:
    """OCP FP8 e4m3 (fn): 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities,
    S.1111.111 is NaN; exponent 0 is subnormal (2^-6 * m/8)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * 2.0 ** -6 * man / 8
    return sign * 2.0 ** (exp - 7) * (1 + man / 8)


def test_fp8_dequant_matches_float_math():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, 7, generator=g) * 3
    q, scale = quantize_rows(w)
    got = w3.dequantize_fp8(q, scale, "x")
    bits = q.view(torch.uint8)
    want = torch.tensor([_e4m3_by_hand(int(b)) for b in bits.flatten()]).view(q.shape) * scale[..., None]
    assert torch.equal(got, want)
    assert (got - w).abs().max() <= w.abs().max() / 8       # 3 mantissa bits: a coarse but close copy
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).view(1, 1, 256)
    hand = torch.tensor([_e4m3_by_hand(b) for b in range(256)])
    ours = w3.dequantize_fp8(every, torch.ones(1, 1), "all")[0, 0]
    assert torch.equal(ours.isnan(), hand.isnan()) and torch.equal(ours[~hand.isnan()], hand[~hand.isnan()])
    with pytest.raises(ValueError, match="scale shape"):
        w3.dequantize_fp8(q, scale[:, :2], "x")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        w3.dequantize_fp8(w, scale, "x")


@pytest.mark.parametrize("fmt", ["safetensors", "pt", "safetensors-float"])
def test_both_formats_read_to_the_reference_names(fmt):
    folder, sd = checkpoint(fmt)
    path = folder / ("model_fp8.pt" if fmt == "pt" else "model.safetensors")
    got = w3.load_tensors(path, torch.float32)
    assert set(got) == set(sd)
    for k in sd:
        assert got[k].dtype == torch.float32 and torch.equal(got[k], sd[k]), k
    half = w3.load_tensors(path, torch.bfloat16)
    assert all(half[k].dtype == torch.bfloat16 and torch.equal(half[k], sd[k].bfloat16()) for k in sd)


def test_fp8_files_hold_fp8_and_scales():
    from safetensors import safe_open
    folder, _ = checkpoint("safetensors")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert f.get_tensor("text_model.transformer.h.1.mlp.experts.weight").dtype == torch.float8_e4m3fn
        assert tuple(f.get_tensor("text_model.transformer.h.1.moe_quant.up_scale").shape) == (E, 2 * I)
        assert tuple(f.get_tensor("text_model.transformer.h.2.moe_quant.down_scale").shape) == (E, 128)
    pt = torch.load(checkpoint("pt")[0] / "model_fp8.pt", weights_only=True)
    assert "text_model._orig_mod.transformer.h.0.tau_wq" in pt and "text_model._orig_mod.transformer.h.0.tau_wv" in pt


def test_interleaved_gate_up_is_undone():
    g = torch.Generator().manual_seed(1)
    halves = torch.randn(3, 2 * 24, 5, generator=g)
    gate, up = halves[:, :24], halves[:, 24:]
    rows = []   # written out row by row: gate[0:8], up[0:8], gate[8:16], ...
    for blk in range(3):
        rows += [gate[:, blk * 8 + r] for r in range(8)] + [up[:, blk * 8 + r] for r in range(8)]
    shipped = torch.stack(rows, dim=1)
    assert torch.equal(w3.deinterleave_rows8(shipped), halves)


def test_bad_checkpoints_are_named(tmp_path):
    folder, sd = checkpoint("safetensors")
    names = to_checkpoint_names(*quantized(sd), fused_tau=True)
    del names["text_model.transformer.h.1.moe_quant.up_scale"]
    with pytest.raises(ValueError, match="FP8 tensors without their moe_quant scales"):
        w3.normalize_names(names)
    names = to_checkpoint_names(sd, None, True)
    names["text_model.transformer.h.0.something_new"] = torch.zeros(1)
    from photon_core.models.moondream3.model import check_state
    with pytest.raises(ValueError, match="unexpected .*something_new"):
        check_state(w3.normalize_names(names), Moondream3Config.from_dict(md3_config()), "x")
    from photon_core.models.moondream3 import load_moondream3
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = md3_config()
    cfg["text"]["moe"]["expert_inner_dim"] = 32
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="experts_gate_up"):
        load_moondream3(bad)
    with pytest.raises(FileNotFoundError, match="`hf download moondream/moondream3.1"):
        load_moondream3(tmp_path / "nothing")


def test_config_defaults_are_moondream3_1():
    c = Moondream3Config.from_dict(None)
    assert (c.text.dim, c.text.n_layers, c.text.n_heads, c.text.vocab_size, c.text.max_context) == (2048, 24, 32, 51200, 32768)
    assert c.text.rope_theta == 1_500_000.0 and c.text.tau_attn
    assert (c.text.moe.num_experts, c.text.moe.start_layer, c.text.moe.experts_per_token,
            c.text.moe.expert_inner_dim) == (64, 4, 8, 1024)
    assert [c.is_moe_layer(i) for i in (3, 4, 23)] == [False, True, True]
    assert c.tokenizer.templates["segment"] == {"prefix": [1, 17374, 2], "suffix": [3]}
    wrapped = Moondream3Config.from_dict({"model_type": "moondream3", "config": md3_config()})
    assert wrapped.text.moe.num_experts == E and wrapped.text.n_layers == 3
    with pytest.raises(ValueError, match="unknown keys"):
        Moondream3Config.from_dict({"text": {"moe": {"experts": 3}}})
    with pytest.raises(NotImplementedError, match="not supported yet"):
        Moondream3Config.from_dict({"text": {"group_size": 128}})


def test_registry_gives_moondream3_its_checkpoints(tmp_path, monkeypatch):
    for fmt in ("safetensors", "pt"):
        rec = registry.recognise(checkpoint(fmt)[0])
        assert rec.family.name == "moondream3" and "segment" in rec.family.skills
    folder, _ = write_checkpoint(tmp_path / "wrapped", "safetensors", wrapped_config=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "moondream3"}))   # HF wrapper, sizes default
    assert registry.recognise(folder).family.name == "moondream3"
    assert registry.recognise(mf.checkpoint()).family.name == "moondream"
    import photon_core
    import photon_core.models.moondream3 as md3
    from photon_core import contracts
    seen = []
    monkeypatch.setattr(md3, "load_moondream3", lambda path, **kw: seen.append(path) or "md3-model")
    # The stand-in loader's result is no model: which loader ran is the point here (the contract
    # check photon_core.load makes is test_model_contract's).
    monkeypatch.setattr(contracts, "check_model", lambda model, skills: model)
    assert photon_core.load(checkpoint("pt")[0], skills=["segment"]) == "md3-model" and seen
    with pytest.raises(registry.MissingSkills, match="cannot segment"):
        photon_core.load(mf.checkpoint(), skills=["segment"])


def test_interleaved_checkpoint_loads_to_the_same_weights(tmp_path):
    from safetensors.torch import load_file
    folder, sd = checkpoint("safetensors-float")
    names = load_file(str(folder / "model.safetensors"))
    for k in [k for k in names if k.endswith("mlp.experts.weight")]:
        e, two_i, d = names[k].shape
        gate, up = names[k][:, :two_i // 2], names[k][:, two_i // 2:]
        names[k] = torch.stack([gate.reshape(e, -1, 8, d), up.reshape(e, -1, 8, d)], dim=2).reshape(e, two_i, d)
    out = tmp_path / "interleaved"
    shutil.copytree(folder, out)
    save_file({k: v.contiguous() for k, v in names.items()}, str(out / "model.safetensors"))
    cfg = md3_config()
    cfg["text"]["moe"]["gate_up_layout"] = "interleaved8"
    (out / "config.json").write_text(json.dumps(cfg))
    got = w3.load_tensors(out / "model.safetensors", torch.float32, gate_up_layout="interleaved8")
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    from photon_core.models.moondream3 import load_moondream3
    m = load_moondream3(out)
    assert torch.equal(m.text_w.blocks[1].experts_gate_up, sd["text.blocks.1.experts_gate_up"])
