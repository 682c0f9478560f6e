"""Parakeet checkpoints on disk -> (config, tensors under transformers' names, vocabulary).

Two formats: a transformers folder (config.json `parakeet_tdt`, model.safetensors, tokenizer.json)
and NVIDIA's `.nemo` (a tar of model_config.yaml, model_weights.ckpt — a plain state dict read with
torch.load(weights_only=True) — and the SentencePiece tokenizer files). NeMo's tensor names are
mapped onto transformers' by the rules below, so one model class serves both.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from photon_core.weights.tensor_files import NEMO_MAX_SMALL_BYTES, read_folder, read_nemo, read_nemo_members, rename
from photon_core.weights.tensor_checks import listed, tensor_problems

from . import config as cfg
from .tokenizer import Vocabulary, from_sentencepiece_model, from_tokenizer_json, from_vocab_listing

_L = r"encoder\.layers\.(\d+)\."
# NeMo EncDecRNNTBPEModel names -> transformers ParakeetForTDT names.
NEMO_RULES: list[tuple[str, str]] = [
    (r"encoder\.pre_encode\.conv\.(\d+)\.(weight|bias)", r"encoder.subsampling.layers.\1.\2"),
    (r"encoder\.pre_encode\.out\.(weight|bias)", r"encoder.subsampling.linear.\1"),
    (_L + r"self_attn\.linear_q\.(weight|bias)", r"encoder.layers.\1.self_attn.q_proj.\2"),
    (_L + r"self_attn\.linear_k\.(weight|bias)", r"encoder.layers.\1.self_attn.k_proj.\2"),
    (_L + r"self_attn\.linear_v\.(weight|bias)", r"encoder.layers.\1.self_attn.v_proj.\2"),
    (_L + r"self_attn\.linear_out\.(weight|bias)", r"encoder.layers.\1.self_attn.o_proj.\2"),
    (_L + r"self_attn\.linear_pos\.weight", r"encoder.layers.\1.self_attn.relative_k_proj.weight"),
    (_L + r"self_attn\.pos_bias_u", r"encoder.layers.\1.self_attn.bias_u"),
    (_L + r"self_attn\.pos_bias_v", r"encoder.layers.\1.self_attn.bias_v"),
    (_L + r"conv\.batch_norm\.(weight|bias|running_mean|running_var)", r"encoder.layers.\1.conv.norm.\2"),
    (_L + r"((?:feed_forward[12]\.linear[12]|conv\.pointwise_conv[12]|conv\.depthwise_conv|"
          r"norm_feed_forward[12]|norm_self_att|norm_conv|norm_out)\.(?:weight|bias))",
     r"encoder.layers.\1.\2"),
    (r"decoder\.prediction\.embed\.weight", r"decoder.embedding.weight"),
    (r"decoder\.prediction\.dec_rnn\.lstm\.((?:weight|bias)_(?:ih|hh)_l\d+)", r"decoder.lstm.\1"),
    (r"joint\.pred\.(weight|bias)", r"decoder.decoder_projector.\1"),
    (r"joint\.enc\.(weight|bias)", r"encoder_projector.\1"),
    # joint_net is Sequential(activation, [Dropout if dropout > 0], Linear): the Linear's index varies
    (r"joint\.joint_net\.\d+\.(weight|bias)", r"joint.head.\1"),
]
NEMO_DROP = [r".*num_batches_tracked", r"encoder\.pos_enc\.pe", r"preprocessor\..*"]

# transformers' own names, accepted as they are (anything else means another model).
HF_KEEP = [
    r"encoder\.subsampling\.(layers\.\d+|linear)\.(weight|bias)",
    _L + r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)",
    _L + r"self_attn\.(relative_k_proj\.weight|bias_u|bias_v)",
    _L + r"conv\.norm\.(weight|bias|running_mean|running_var)",
    _L + r"(feed_forward[12]\.linear[12]|conv\.pointwise_conv[12]|conv\.depthwise_conv|"
         r"norm_feed_forward[12]|norm_self_att|norm_conv|norm_out)\.(weight|bias)",
    r"decoder\.embedding\.weight", r"decoder\.lstm\.(weight|bias)_(ih|hh)_l\d+",
    r"decoder\.decoder_projector\.(weight|bias)", r"encoder_projector\.(weight|bias)", r"joint\.head\.(weight|bias)",
]
HF_DROP = [r".*num_batches_tracked", r".*inv_freq"]


@dataclass
class ParakeetCheckpoint:
    config: cfg.ParakeetConfig
    tensors: dict[str, torch.Tensor]        # transformers names
    vocab: Vocabulary
    source: Path
    mel_filters: torch.Tensor | None = None  # [n_mels, n_fft/2+1] when the checkpoint ships its bank
    window: torch.Tensor | None = None


def expected_shapes(c: cfg.ParakeetConfig, joint_hidden: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    """name -> (shape, required) of every tensor ParakeetModel reads, as the config implies (biases
    the model treats as optional are checked only when present)."""
    h, ch, k, dh = c.hidden_size, c.subsampling_channels, c.subsampling_kernel, c.decoder_hidden
    s: dict[str, tuple[tuple[int, ...], bool]] = {}

    def put(name: str, shape: tuple[int, ...], required: bool = True) -> None:
        s[name] = (shape, required)

    sub = "encoder.subsampling."
    put(sub + "layers.0.weight", (ch, 1, k, k))
    put(sub + "layers.0.bias", (ch,))
    n_stages, freq, pad = c.subsampling_factor.bit_length() - 1, c.num_mel_bins, (k - 1) // 2
    for stage in range(n_stages):
        freq = (freq + 2 * pad - k) // c.subsampling_stride + 1   # the mel axis through each conv
        if stage:
            put(sub + f"layers.{3 * stage - 1}.weight", (ch, 1, k, k))
            put(sub + f"layers.{3 * stage - 1}.bias", (ch,))
            put(sub + f"layers.{3 * stage}.weight", (ch, ch, 1, 1))
            put(sub + f"layers.{3 * stage}.bias", (ch,))
    # the stem's output width ties the mel bins to this weight
    put(sub + "linear.weight", (h, ch * freq))
    put(sub + "linear.bias", (h,))
    for i in range(c.num_layers):
        p = f"encoder.layers.{i}."
        for n in ("feed_forward1", "self_att", "conv", "feed_forward2", "out"):
            put(p + f"norm_{n}.weight", (h,))
            put(p + f"norm_{n}.bias", (h,))
        for ff in ("feed_forward1", "feed_forward2"):
            put(p + f"{ff}.linear1.weight", (c.intermediate_size, h))
            put(p + f"{ff}.linear1.bias", (c.intermediate_size,), False)
            put(p + f"{ff}.linear2.weight", (h, c.intermediate_size))
            put(p + f"{ff}.linear2.bias", (h,), False)
        for n in ("q", "k", "v", "o"):
            put(p + f"self_attn.{n}_proj.weight", (h, h))
            put(p + f"self_attn.{n}_proj.bias", (h,), False)
        put(p + "self_attn.relative_k_proj.weight", (h, h))
        put(p + "self_attn.bias_u", (c.num_heads, c.head_dim))
        put(p + "self_attn.bias_v", (c.num_heads, c.head_dim))
        put(p + "conv.pointwise_conv1.weight", (2 * h, h, 1))
        put(p + "conv.pointwise_conv1.bias", (2 * h,), False)
        put(p + "conv.pointwise_conv2.weight", (h, h, 1))
        put(p + "conv.pointwise_conv2.bias", (h,), False)
        put(p + "conv.depthwise_conv.weight", (h, 1, c.conv_kernel_size))
        put(p + "conv.depthwise_conv.bias", (h,), False)
        for n in ("weight", "bias", "running_mean", "running_var"):
            put(p + f"conv.norm.{n}", (h,))
    put("encoder_projector.weight", (joint_hidden, h))
    put("encoder_projector.bias", (joint_hidden,), False)
    for i in range(c.decoder_layers):
        for n in ("ih", "hh"):
            put(f"decoder.lstm.weight_{n}_l{i}", (4 * dh, dh))
            put(f"decoder.lstm.bias_{n}_l{i}", (4 * dh,), False)
    put("decoder.decoder_projector.weight", (joint_hidden, dh))
    put("decoder.decoder_projector.bias", (joint_hidden,), False)
    put("joint.head.weight", (c.vocab_size + len(c.durations), joint_hidden))
    put("joint.head.bias", (c.vocab_size + len(c.durations),), False)
    return s


def check_tensors(tensors: dict[str, torch.Tensor], c: cfg.ParakeetConfig, source: object) -> None:
    """Every tensor the config implies is there with its shape and a float dtype: a ValueError
    naming the checkpoint and the field, instead of a KeyError or a shape error mid-transcription."""
    proj = tensors.get("encoder_projector.weight")
    problems = tensor_problems(tensors, expected_shapes(c, proj.shape[0] if proj is not None and proj.dim() == 2 else -1))
    missing, wrong = problems.setdefault("missing", []), problems.setdefault("wrong shapes", [])
    emb = tensors.get("decoder.embedding.weight")
    if emb is None:
        missing.append("decoder.embedding.weight")
    elif emb.dim() != 2 or emb.shape[0] < c.vocab_size or emb.shape[1] != c.decoder_hidden:
        wrong.append(f"decoder.embedding.weight {tuple(emb.shape)} != (>= {c.vocab_size}, {c.decoder_hidden})")
    if "encoder.layers.0.self_attn.q_proj.bias" in tensors:   # q/k/v are fused: all three biases or none
        missing += [n for i in range(c.num_layers) for x in "qkv"
                    if (n := f"encoder.layers.{i}.self_attn.{x}_proj.bias") not in tensors]
    problems["not floating point"] = [n for n, t in tensors.items() if not t.is_floating_point()]
    if listed(problems):
        raise ValueError(f"{source}: the tensors do not match the config (hidden size, heads, layers, mel bins, "
                         f"vocabulary): {listed(problems)}")


def nemo_file(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".nemo":
        return path
    if path.is_dir():
        found = sorted(path.glob("*.nemo"))
        if len(found) > 1:
            raise ValueError(f"{path}: several .nemo files ({[p.name for p in found]}); name one")
        return found[0] if found else None
    return None


def load(path: str | Path) -> ParakeetCheckpoint:
    path = Path(path)
    nemo = nemo_file(path)
    if nemo is not None:
        return load_nemo(nemo)
    folder = path if path.is_dir() else path.parent
    return load_hf(folder)


def load_hf(folder: Path) -> ParakeetCheckpoint:
    config = cfg.from_hf(folder)
    tensors = rename(read_folder(folder), [], keep=HF_KEEP, drop=HF_DROP)
    check_tensors(tensors, config, folder)
    tok = folder / "tokenizer.json"
    if not tok.is_file():
        raise FileNotFoundError(f"{folder}: no tokenizer.json next to the weights (Parakeet's tokenizer "
                                "comes from its checkpoint)")
    return ParakeetCheckpoint(config, tensors, from_tokenizer_json(tok), folder)


def _nemo_vocabulary(path: Path, yaml_cfg: dict) -> Vocabulary:
    """The tokenizer files the .nemo carries, preferring the SentencePiece model itself (read through
    read_nemo_members' bounds: a tokenizer file over NEMO_MAX_SMALL_BYTES is refused)."""
    tok_cfg = yaml_cfg.get("tokenizer") or {}
    if not isinstance(tok_cfg, dict):
        raise ValueError(f"{path}: model_config.yaml: tokenizer must be a mapping")
    wanted = {key: Path(str(tok_cfg.get(key, "")).removeprefix("nemo:")).name
              for key in ("model_path", "spe_tokenizer_vocab", "vocab_path")}
    suffixes = ("tokenizer.model", "tokenizer.vocab", "vocab.txt")
    members = read_nemo_members(path, lambda name: NEMO_MAX_SMALL_BYTES if (
        name in wanted.values() or name.endswith(suffixes)) else None)

    def by_suffix(suffix: str) -> str:
        return next((n for n in sorted(members) if n.endswith(suffix)), "")

    data = members.get(wanted["model_path"] or by_suffix("tokenizer.model"))
    if data is not None:
        return from_sentencepiece_model(data)
    data = members.get(wanted["spe_tokenizer_vocab"] or by_suffix("tokenizer.vocab"))
    if data is not None:
        return from_vocab_listing(data.decode("utf-8"), nemo_vocab_txt=False)
    data = members.get(wanted["vocab_path"] or by_suffix("vocab.txt"))
    if data is not None:
        return from_vocab_listing(data.decode("utf-8"), nemo_vocab_txt=True)
    raise FileNotFoundError(f"{path}: the .nemo holds no tokenizer (tokenizer.model, tokenizer.vocab or "
                            "vocab.txt)")


def load_nemo(path: Path) -> ParakeetCheckpoint:
    try:
        yaml_cfg, state = read_nemo(path)
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - a truncated tar, a refused or corrupt pickle
        raise ValueError(f"{path}: cannot read the .nemo's model_config.yaml / model_weights.ckpt "
                         f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from err
    if not isinstance(yaml_cfg, dict) or not isinstance(state, dict):
        raise ValueError(f"{path}: model_config.yaml must be a mapping and model_weights.ckpt a state dict")
    config = cfg.from_nemo(yaml_cfg, f"{path}: model_config.yaml")
    filters = state.get("preprocessor.featurizer.fb")
    window = state.get("preprocessor.featurizer.window")
    tensors = rename(state, NEMO_RULES, drop=NEMO_DROP)
    check_tensors(tensors, config, f"{path}: model_weights.ckpt")
    fc = config.frontend
    if filters is not None and (filters.numel() != fc.n_mels * (fc.n_fft // 2 + 1) or filters.dim() < 2):
        raise ValueError(f"{path}: preprocessor.featurizer.fb {tuple(filters.shape)} is not the config's "
                         f"{fc.n_mels} mel bins x {fc.n_fft // 2 + 1} frequencies")
    if window is not None and tuple(window.shape) != (fc.win_length,):
        raise ValueError(f"{path}: preprocessor.featurizer.window {tuple(window.shape)} is not the config's "
                         f"window of {fc.win_length} samples")
    vocab = _nemo_vocabulary(path, yaml_cfg)
    return ParakeetCheckpoint(config, tensors, vocab, path,
                              mel_filters=None if filters is None else filters.reshape(filters.shape[-2:]).float(),
                              window=None if window is None else window.float())
