"""Parakeet checkpoints on disk -> (config, tensors under transformers' names, vocabulary).

Two formats: a transformers folder (config.json `parakeet_tdt`, model.safetensors, tokenizer.json)
and NVIDIA's `.nemo` (a tar of model_config.yaml, model_weights.ckpt — a plain state dict read with
torch.load(weights_only=True) — and the SentencePiece tokenizer files). NeMo's tensor names are
mapped onto transformers' by the rules below, so one model class serves both.
"""
from __future__ import annotations

import tarfile
from dataclasses import dataclass
from pathlib import Path

import torch

from photon_core.weights.tensor_files import read_folder, read_nemo, rename

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
    tok = folder / "tokenizer.json"
    if not tok.is_file():
        raise FileNotFoundError(f"{folder}: no tokenizer.json next to the weights (Parakeet's tokenizer "
                                "comes from its checkpoint)")
    return ParakeetCheckpoint(config, tensors, from_tokenizer_json(tok), folder)


def _nemo_vocabulary(path: Path, yaml_cfg: dict) -> Vocabulary:
    """The tokenizer files the .nemo carries, preferring the SentencePiece model itself."""
    tok_cfg = yaml_cfg.get("tokenizer") or {}
    wanted = {key: Path(str(tok_cfg.get(key, "")).removeprefix("nemo:")).name
              for key in ("model_path", "spe_tokenizer_vocab", "vocab_path")}
    with tarfile.open(path) as tar:
        members = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}

        def read(name: str) -> bytes | None:
            data = tar.extractfile(members[name]) if name in members else None   # members are files
            return None if data is None else data.read()

        def by_suffix(suffix: str) -> str:
            return next((n for n in sorted(members) if n.endswith(suffix)), "")

        data = read(wanted["model_path"] or by_suffix("tokenizer.model"))
        if data is not None:
            return from_sentencepiece_model(data)
        data = read(wanted["spe_tokenizer_vocab"] or by_suffix("tokenizer.vocab"))
        if data is not None:
            return from_vocab_listing(data.decode("utf-8"), nemo_vocab_txt=False)
        data = read(wanted["vocab_path"] or by_suffix("vocab.txt"))
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
    config = cfg.from_nemo(yaml_cfg)
    filters = state.get("preprocessor.featurizer.fb")
    window = state.get("preprocessor.featurizer.window")
    tensors = rename(state, NEMO_RULES, drop=NEMO_DROP)
    vocab = _nemo_vocabulary(path, yaml_cfg)
    return ParakeetCheckpoint(config, tensors, vocab, path,
                              mel_filters=None if filters is None else filters.reshape(filters.shape[-2:]).float(),
                              window=None if window is None else window.float())
