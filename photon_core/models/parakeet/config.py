"""Parakeet TDT dimensions and front-end settings, read from either checkpoint format.

A transformers folder states them in config.json (`parakeet_tdt`, encoder under `encoder_config`)
and preprocessor_config.json / processor_config.json; a NeMo checkpoint in model_config.yaml
(encoder / decoder / joint / preprocessor / decoding sections). Both end in the same two
dataclasses, so the model code never asks which format it came from.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class FrontendConfig:
    """Log-mel settings (NeMo's AudioToMelSpectrogramPreprocessor, transformers' ParakeetFeatureExtractor)."""
    sample_rate: int = 16000
    n_mels: int = 128
    n_fft: int = 512
    win_length: int = 400
    hop_length: int = 160
    preemphasis: float | None = 0.97
    normalize: str | None = "per_feature"   # per-feature mean/std over the utterance's frames
    log_guard: float = 2.0 ** -24           # log(mel + guard)
    std_eps: float = 1e-5


@dataclass(frozen=True)
class ParakeetConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    conv_kernel_size: int
    subsampling_factor: int
    subsampling_channels: int
    subsampling_kernel: int
    subsampling_stride: int
    num_mel_bins: int
    scale_input: bool
    vocab_size: int                 # tokens including blank (the joint's token logits)
    blank_id: int
    durations: tuple[int, ...]
    decoder_hidden: int
    decoder_layers: int
    max_symbols_per_step: int | None
    start_token_id: int             # what the prediction network is fed before the first token
    encoder_act: str = "silu"
    joint_act: str = "relu"
    frontend: FrontendConfig = field(default_factory=FrontendConfig)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def frame_seconds(self) -> float:
        """Seconds per encoder frame (one TDT duration unit)."""
        return self.subsampling_factor * self.frontend.hop_length / self.frontend.sample_rate


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise NotImplementedError(f"Parakeet: {message} is not supported yet")


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def frontend_from_hf(folder: Path, n_mels: int) -> FrontendConfig:
    pre = _read_json(folder / "preprocessor_config.json")
    if pre is None:
        proc = _read_json(folder / "processor_config.json") or {}
        pre = proc.get("feature_extractor") or {}
    fc = FrontendConfig()
    return FrontendConfig(
        sample_rate=int(pre.get("sampling_rate", fc.sample_rate)),
        n_mels=int(pre.get("feature_size", n_mels)),
        n_fft=int(pre.get("n_fft", fc.n_fft)),
        win_length=int(pre.get("win_length", fc.win_length)),
        hop_length=int(pre.get("hop_length", fc.hop_length)),
        preemphasis=pre.get("preemphasis", fc.preemphasis),
    )


def from_hf(folder: Path) -> ParakeetConfig:
    """config.json (+ generation_config.json, preprocessor config) of a transformers folder."""
    cfg = _read_json(folder / "config.json")
    if cfg is None:
        raise FileNotFoundError(f"{folder}: no config.json")
    if cfg.get("model_type") != "parakeet_tdt":
        raise NotImplementedError(f"{folder}: model_type {cfg.get('model_type')!r}: only Parakeet TDT "
                                  "(parakeet_tdt) is supported; CTC and RNN-T heads are not supported yet")
    enc = cfg.get("encoder_config") or {}
    gen = _read_json(folder / "generation_config.json") or {}
    blank = int(cfg.get("blank_token_id", 8192))
    start = gen.get("decoder_start_token_id")
    n_mels = int(enc.get("num_mel_bins", 80))
    frontend = frontend_from_hf(folder, n_mels)
    if frontend.n_mels != n_mels:
        raise ValueError(f"{folder}: the feature extractor gives {frontend.n_mels} mel bins, the encoder "
                         f"takes {n_mels}")
    hidden = int(enc.get("hidden_size", 1024))
    return ParakeetConfig(
        hidden_size=hidden, num_layers=int(enc.get("num_hidden_layers", 24)),
        num_heads=int(enc.get("num_attention_heads", 8)),
        intermediate_size=int(enc.get("intermediate_size", 4 * hidden)),
        conv_kernel_size=int(enc.get("conv_kernel_size", 9)),
        subsampling_factor=int(enc.get("subsampling_factor", 8)),
        subsampling_channels=int(enc.get("subsampling_conv_channels", 256)),
        subsampling_kernel=int(enc.get("subsampling_conv_kernel_size", 3)),
        subsampling_stride=int(enc.get("subsampling_conv_stride", 2)),
        num_mel_bins=n_mels, scale_input=bool(enc.get("scale_input", True)),
        vocab_size=int(cfg.get("vocab_size", 8193)), blank_id=blank,
        durations=tuple(int(d) for d in cfg.get("durations", (0, 1, 2, 3, 4))),
        decoder_hidden=int(cfg.get("decoder_hidden_size", 640)),
        decoder_layers=int(cfg.get("num_decoder_layers", 2)),
        max_symbols_per_step=cfg.get("max_symbols_per_step", 10),
        start_token_id=int(start) if start is not None else blank,
        encoder_act=str(enc.get("hidden_act", "silu")), joint_act=str(cfg.get("hidden_act", "relu")),
        frontend=frontend,
    )


def from_nemo(yaml_cfg: dict[str, Any]) -> ParakeetConfig:
    """model_config.yaml of a NeMo EncDecRNNTBPEModel with a TDT loss/decoder."""
    enc = yaml_cfg.get("encoder") or {}
    missing = [k for k in ("d_model", "n_layers", "n_heads") if k not in enc]
    if missing:
        raise ValueError(f"model_config.yaml: encoder lacks {missing} (not a NeMo FastConformer transducer?)")
    dec = yaml_cfg.get("decoder") or {}
    joint = yaml_cfg.get("joint") or {}
    pre = yaml_cfg.get("preprocessor") or {}
    decoding = yaml_cfg.get("decoding") or {}
    durations = (decoding.get("durations") or (yaml_cfg.get("model_defaults") or {}).get("tdt_durations")
                 or ((yaml_cfg.get("loss") or {}).get("tdt_kwargs") or {}).get("durations"))
    _check(bool(durations), "a NeMo transducer without TDT durations (plain RNN-T)")
    _check(enc.get("self_attention_model", "rel_pos") == "rel_pos",
           f"encoder self_attention_model {enc.get('self_attention_model')!r}")
    _check(enc.get("subsampling", "dw_striding") == "dw_striding", f"subsampling {enc.get('subsampling')!r}")
    _check(enc.get("conv_norm_type", "batch_norm") == "batch_norm", f"conv_norm_type {enc.get('conv_norm_type')!r}")
    context = enc.get("att_context_size") or [-1, -1]
    _check(list(context)[:2] == [-1, -1], f"limited attention context {context}")
    _check(enc.get("untie_biases", True), "tied pos_bias_u/v across layers")
    _check(int(pre.get("frame_splicing", 1)) == 1, "frame_splicing")
    _check(pre.get("window", "hann") == "hann", f"window {pre.get('window')!r}")
    _check(pre.get("log", True), "a linear (non-log) mel")
    sr = int(pre.get("sample_rate", 16000))
    d_model = int(enc["d_model"])
    classes = joint.get("num_classes", dec.get("vocab_size"))
    if classes is None:
        raise ValueError("model_config.yaml: neither joint.num_classes nor decoder.vocab_size (the vocabulary size)")
    n_classes = int(classes)
    normalize = pre.get("normalize", "per_feature")
    _check(normalize in ("per_feature", None, "None"), f"preprocessor normalize {normalize!r}")
    frontend = FrontendConfig(
        sample_rate=sr, n_mels=int(pre.get("features", 128)),
        n_fft=int(pre.get("n_fft") or 2 ** (int(pre.get("window_size", 0.025) * sr) - 1).bit_length()),
        win_length=int(round(float(pre.get("window_size", 0.025)) * sr)),
        hop_length=int(round(float(pre.get("window_stride", 0.01)) * sr)),
        preemphasis=pre.get("preemph", 0.97),
        normalize=normalize if normalize == "per_feature" else None,
    )
    channels = int(enc.get("subsampling_conv_channels", -1))
    greedy = decoding.get("greedy") or {}
    return ParakeetConfig(
        hidden_size=d_model, num_layers=int(enc["n_layers"]), num_heads=int(enc["n_heads"]),
        intermediate_size=int(d_model * float(enc.get("ff_expansion_factor", 4))),
        conv_kernel_size=int(enc.get("conv_kernel_size", 31)),
        subsampling_factor=int(enc.get("subsampling_factor", 8)),
        subsampling_channels=channels if channels > 0 else d_model,
        subsampling_kernel=int(enc.get("subsampling_conv_kernel_size", 3)),
        subsampling_stride=int(enc.get("subsampling_conv_stride", 2)),
        num_mel_bins=int(enc.get("feat_in", frontend.n_mels)), scale_input=bool(enc.get("xscaling", True)),
        vocab_size=n_classes + 1, blank_id=n_classes,
        durations=tuple(int(d) for d in durations or ()),   # never empty: checked above
        decoder_hidden=int((dec.get("prednet") or {}).get("pred_hidden", 640)),
        decoder_layers=int((dec.get("prednet") or {}).get("pred_rnn_layers", 1)),
        max_symbols_per_step=greedy.get("max_symbols", 10),
        start_token_id=n_classes,   # NeMo feeds the blank (a zero row: blank_as_pad) as start
        joint_act=str((joint.get("jointnet") or {}).get("activation", "relu")),
        frontend=frontend,
    )
