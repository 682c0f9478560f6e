"""A small random Moondream 2 checkpoint (real tensor names, tiny dims) and a tiny tokenizer, for tests.

Real vocabulary size (51200) so the published prompt-template ids are valid; text head_dim stays 64
and the crop grid 27x27 (729 image tokens) as in the real model; everything else is small.
"""
from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 51200
COORD_ID, SIZE_ID, EOS_ID, ANSWER_ID = 5, 6, 0, 3
WORDS = ["cup", "dog", "person", "what", "is", "this", "?", "a", "the", "robot"]


def small_config(vision_layers: int = 2, text_layers: int = 2) -> dict:
    return {
        "text": {"dim": 128, "ff_dim": 256, "n_layers": text_layers, "vocab_size": VOCAB, "max_context": 2048,
                 "n_heads": 2, "n_kv_heads": 2, "prefix_attn": 730},
        "vision": {"enc_dim": 32, "enc_patch_size": 14, "enc_n_layers": vision_layers, "enc_ff_dim": 64,
                   "enc_n_heads": 2, "proj_out_dim": 128, "crop_size": 378, "in_channels": 3,
                   "max_crops": 12, "overlap_margin": 4, "proj_inner_dim": 64},
        "region": {"dim": 128, "coord_feat_dim": 256, "coord_out_dim": 1024, "size_feat_dim": 512,
                   "size_out_dim": 2048, "inner_dim": 64},
    }


def random_state(cfg: dict, seed: int = 0, object_bias: bool = True) -> dict[str, torch.Tensor]:
    """Reference-named tensors (no `model.` prefix). object_bias makes the LM head prefer `coord` over
    everything (including eos), so detect/point keep producing objects until max_objects."""
    g = torch.Generator().manual_seed(seed)
    t, v, r = cfg["text"], cfg["vision"], cfg["region"]
    sd: dict[str, torch.Tensor] = {}

    def lin(name, n_in, n_out, std=0.05):
        sd[name + ".weight"] = torch.randn(n_out, n_in, generator=g) * std
        sd[name + ".bias"] = torch.randn(n_out, generator=g) * std

    def ln(name, d):
        sd[name + ".weight"] = 1 + 0.1 * torch.randn(d, generator=g)
        sd[name + ".bias"] = 0.1 * torch.randn(d, generator=g)

    grid = v["crop_size"] // v["enc_patch_size"]
    lin("vision.patch_emb", 3 * v["enc_patch_size"] ** 2, v["enc_dim"])
    sd["vision.pos_emb"] = torch.randn(1, grid * grid, v["enc_dim"], generator=g) * 0.5
    for i in range(v["enc_n_layers"]):
        p = f"vision.blocks.{i}."
        ln(p + "ln1", v["enc_dim"]), ln(p + "ln2", v["enc_dim"])
        lin(p + "attn.qkv", v["enc_dim"], 3 * v["enc_dim"], 0.3), lin(p + "attn.proj", v["enc_dim"], v["enc_dim"], 0.2)
        lin(p + "mlp.fc1", v["enc_dim"], v["enc_ff_dim"], 0.2), lin(p + "mlp.fc2", v["enc_ff_dim"], v["enc_dim"], 0.2)
    ln("vision.post_ln", v["enc_dim"])
    lin("vision.proj_mlp.fc1", 2 * v["enc_dim"], v["proj_inner_dim"], 0.3)
    lin("vision.proj_mlp.fc2", v["proj_inner_dim"], v["proj_out_dim"], 0.3)
    sd["text.wte"] = torch.randn(t["vocab_size"], t["dim"], generator=g)
    for i in range(t["n_layers"]):
        p = f"text.blocks.{i}."
        ln(p + "ln", t["dim"])
        lin(p + "attn.qkv", t["dim"], 3 * t["dim"], 0.2), lin(p + "attn.proj", t["dim"], t["dim"], 0.1)
        lin(p + "mlp.fc1", t["dim"], t["ff_dim"], 0.1), lin(p + "mlp.fc2", t["ff_dim"], t["dim"], 0.1)
    ln("text.post_ln", t["dim"])
    lin("text.lm_head", t["dim"], t["vocab_size"], 0.1)
    if object_bias:
        sd["text.lm_head.bias"][COORD_ID] += 100.0
    sd["region.coord_features"] = torch.randn(1, r["coord_feat_dim"] // 2, generator=g)
    sd["region.size_features"] = torch.randn(2, r["size_feat_dim"] // 2, generator=g)
    lin("region.coord_encoder", r["coord_feat_dim"], r["dim"], 0.1)
    lin("region.coord_decoder.fc1", r["dim"], r["inner_dim"], 0.2)
    lin("region.coord_decoder.fc2", r["inner_dim"], r["coord_out_dim"], 0.5)
    lin("region.size_encoder", r["size_feat_dim"], r["dim"], 0.1)
    lin("region.size_decoder.fc1", r["dim"], r["inner_dim"], 0.2)
    lin("region.size_decoder.fc2", r["inner_dim"], r["size_out_dim"], 0.5)
    return sd


def to_old_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The older moondream2 naming, written out by hand (independent of the loader's mapping)."""
    out = {}
    vis = "vision_encoder.encoder.model.visual."
    for k, t in sd.items():
        parts = k.split(".")
        if k == "vision.pos_emb":
            n = vis + "pos_embed"
        elif k.startswith("vision.patch_emb."):
            n = vis + "patch_embed.linear." + parts[-1]
        elif k.startswith("vision.post_ln."):
            n = vis + "norm." + parts[-1]
        elif k.startswith("vision.blocks."):
            rest = ".".join(parts[3:]).replace("ln1.", "norm1.").replace("ln2.", "norm2.")
            n = vis + f"blocks.{parts[2]}." + rest
        elif k.startswith("vision.proj_mlp."):
            n = "vision_encoder.projection.mlp." + ".".join(parts[2:])
        elif k == "text.wte":
            n = "text_model.transformer.embd.wte.weight"
        elif k.startswith("text.blocks."):
            rest = ".".join(parts[3:]).replace("attn.qkv.", "mixer.Wqkv.").replace("attn.proj.", "mixer.out_proj.")
            n = f"text_model.transformer.h.{parts[2]}." + rest
        elif k.startswith("text.post_ln."):
            n = "text_model.lm_head.ln." + parts[-1]
        elif k.startswith("text.lm_head."):
            n = "text_model.lm_head.linear." + parts[-1]
        elif k == "region.coord_features":
            n, t = "region_model.coordinate_features.weight", t.T
        elif k == "region.size_features":
            n, t = "region_model.size_features.weight", t.T
        elif k.startswith("region."):
            n = "region_model." + ".".join(parts[1:]).replace("coord_encoder", "coordinate_encoder") \
                .replace("coord_decoder", "coordinate_decoder")
        else:
            raise KeyError(k)
        out[n] = t.contiguous()
    return out


def build_tokenizer() -> Tokenizer:
    """WordLevel over whitespace words: the specials at ids 0..9, a few real words, filler up to VOCAB
    so every id the model can emit decodes to something."""
    vocab = {"<|endoftext|>": 0}
    for i in range(1, 10):
        vocab[f"<|special{i}|>"] = i
    vocab["<unk>"] = 10
    for w in WORDS:
        vocab[w] = len(vocab)
    while len(vocab) < VOCAB:
        vocab[f"w{len(vocab)}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def write_checkpoint(folder: Path, naming: str = "new", seed: int = 0, object_bias: bool = True,
                     vision_layers: int = 2, text_layers: int = 2, config: dict | None = None) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = config or small_config(vision_layers, text_layers)
    sd = random_state(cfg, seed, object_bias)
    if naming == "new":
        sd = {"model." + k: v.contiguous() for k, v in sd.items()}
    elif naming == "old":
        sd = to_old_names(sd)
    else:
        raise ValueError(naming)
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    build_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


_ROOT = Path(tempfile.mkdtemp(prefix="photon_md_test_"))
atexit.register(shutil.rmtree, _ROOT, True)


@functools.lru_cache(maxsize=None)
def checkpoint(naming: str = "new", seed: int = 0, object_bias: bool = True, vision_layers: int = 2) -> Path:
    """Written once per test process and reused by every test module."""
    name = f"{naming}_{seed}_{int(object_bias)}_{vision_layers}"
    return write_checkpoint(_ROOT / name, naming, seed, object_bias, vision_layers)


@functools.lru_cache(maxsize=None)
def model(naming: str = "new", seed: int = 0, object_bias: bool = True, vision_layers: int = 2):
    from photon_core.models.moondream import load_moondream
    return load_moondream(checkpoint(naming, seed, object_bias, vision_layers))


def split_scores(results: list[dict]) -> tuple[list[dict], list[list[float]]]:
    """Results without their objects' scores, and the scores (per result, per object)."""
    plain, scores = [], []
    for r in results:
        key = "objects" if "objects" in r else "points" if "points" in r else None
        if key is None:
            plain.append(r)
            scores.append([])
            continue
        plain.append({**r, key: [{k: v for k, v in o.items() if k != "score"} for o in r[key]]})
        scores.append([o["score"] for o in r[key]])
    return plain, scores


def assert_same_results(got: list[dict], want: list[dict], score_atol: float) -> list[list[float]]:
    """Equal results (boxes, points, text exactly) with every object's score within `score_atol`
    of the wanted one; returns the wanted scores."""
    got_plain, got_scores = split_scores(got)
    want_plain, want_scores = split_scores(want)
    assert got_plain == want_plain
    for g, w in zip(got_scores, want_scores):
        assert g == pytest.approx(w, abs=score_atol, rel=0)
    return want_scores


# The training code's module names (as in a Moondream final.pt); lora.py and the reference rename them.
TRAINED_NAMES = {"attn.qkv": "mixer.Wqkv", "attn.proj": "mixer.out_proj", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}


def lora_adapter(cfg, rank: int = 4, seed: int = 0, zero_b: bool = False, trained_names: bool = True) -> dict:
    """A random adapter for the text config `cfg` (config.TextConfig)."""
    g = torch.Generator().manual_seed(seed)
    hd = cfg.dim // cfg.n_heads
    dims = {"attn.qkv": (cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd), "attn.proj": (cfg.dim, cfg.dim),
            "mlp.fc1": (cfg.dim, cfg.ff_dim), "mlp.fc2": (cfg.ff_dim, cfg.dim)}
    sd = {}
    for i in range(cfg.n_layers):
        for lin, (n_in, n_out) in dims.items():
            key = (f"text_model.transformer.h.{i}.{TRAINED_NAMES[lin]}.parametrizations.weight.0" if trained_names
                   else f"text.blocks.{i}.{lin}")
            sd[key + ".A"] = torch.randn(rank, n_in, generator=g) * 0.2
            sd[key + ".B"] = torch.zeros(n_out, rank) if zero_b else torch.randn(n_out, rank, generator=g) * 0.1
    return sd
