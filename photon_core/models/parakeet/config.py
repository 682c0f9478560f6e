"""Parakeet TDT dimensions and front-end settings, read from either checkpoint format.

A transformers folder states them in config.json (`parakeet_tdt`, encoder under `encoder_config`)
and preprocessor_config.json / processor_config.json; a NeMo checkpoint in model_config.yaml
(encoder / decoder / joint / preprocessor / decoding sections). Both end in the same two
dataclasses, so the model code never asks which format it came from.
"""
from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from photon_core.weights.config_values import config_float, config_int


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
    max_symbols_per_step: int | None   # at most MAX_SYMBOLS_PER_STEP (checked at parse time)
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


# Bounds on the config's numbers, checked at parse time: each sizes an allocation (filterbank,
# STFT, layers) or a loop (decoding steps) before any tensor is read, so a crafted config could
# otherwise ask for gigabytes or hours. Real Parakeet TDT checkpoints (0.6B v2/v3, 1.1B): d_model
# 1024, 24-42 layers, 8 heads, ff 4096, conv kernel 9, subsampling 8x with 256 channels, kernel 3,
# stride 2, 80-128 mel bins, 1025-8193 classes, durations 0-4, prediction net 640 x 1-2 layers,
# n_fft 512, window 400, hop 160 at 16 kHz, max_symbols 10.
MAX_SYMBOLS_PER_STEP = 100     # NeMo's default guard is 10; past this a stuck model decodes for hours
LIMITS: dict[str, tuple[int, int]] = {
    "hidden_size": (1, 16384), "num_layers": (1, 256), "num_heads": (1, 256), "intermediate_size": (1, 65536),
    "conv_kernel_size": (1, 255), "subsampling_channels": (1, 8192), "subsampling_kernel": (1, 15),
    "subsampling_stride": (1, 8), "num_mel_bins": (1, 1024), "vocab_size": (2, 1 << 20),
    "decoder_hidden": (1, 16384), "decoder_layers": (1, 16), "max_symbols_per_step": (1, MAX_SYMBOLS_PER_STEP),
    "sample_rate": (1000, 192000), "n_mels": (1, 1024), "n_fft": (8, 1 << 15), "win_length": (1, 1 << 15),
    "hop_length": (1, 1 << 15), "subsampling_factor": (2, 64), "token_id": (0, 1 << 20),
}


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise NotImplementedError(f"Parakeet: {message} is not supported yet")


def _int(section: dict, key: str, default: Any, source: str, name: str | None = None, where: str = "") -> int:
    """section[key] (or `default`) as an int within LIMITS[name] (name defaults to key);
    ValueError naming `source` and the field (`where`.key) otherwise."""
    low, high = LIMITS[name or key]
    return config_int(section.get(key, default), source, f"{where}.{key}" if where else key, low, high)


def _section(parent: dict, key: str, source: str) -> dict:
    value = parent.get(key) or {}
    if not isinstance(value, dict):
        raise ValueError(f"{source}: {key} must be a mapping")
    return value


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: unreadable ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    return data


def _durations(value: Any, source: str, field: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not 1 <= len(value) <= 64:
        raise ValueError(f"{source}: {field} must be a list of 1 to 64 durations, got {reprlib.repr(value)}")
    return tuple(config_int(d, source, field, 0, 1024) for d in value)


def _preemphasis(value: Any, source: str) -> float | None:
    return None if value is None else config_float(value, source, "preemphasis", 0.0, 1.0)


def validate(c: ParakeetConfig, source: str) -> ParakeetConfig:
    """The checks between fields (each field's own range was checked as it was read)."""
    f = c.frontend
    problems = [
        (c.hidden_size % c.num_heads != 0, f"the attention heads ({c.num_heads}) must divide the hidden size "
                                           f"({c.hidden_size})"),
        (c.subsampling_factor not in (2, 4, 8, 16, 32, 64),
         f"subsampling_factor ({c.subsampling_factor}) must be a power of 2 from 2 to 64"),
        (not 0 <= c.blank_id < c.vocab_size, f"the blank id ({c.blank_id}) must be below vocab_size ({c.vocab_size})"),
        (not 0 <= c.start_token_id < c.vocab_size,
         f"decoder_start_token_id ({c.start_token_id}) must be below vocab_size ({c.vocab_size})"),
        (f.win_length > f.n_fft, f"win_length ({f.win_length}) must not exceed n_fft ({f.n_fft})"),
        (f.n_mels != c.num_mel_bins, f"the feature extractor gives {f.n_mels} mel bins, the encoder takes "
                                     f"{c.num_mel_bins}"),
    ]
    for bad, message in problems:
        if bad:
            raise ValueError(f"{source}: {message}")
    return c


def frontend_from_hf(folder: Path, n_mels: int) -> FrontendConfig:
    pre = _read_json(folder / "preprocessor_config.json")
    source = str(folder / "preprocessor_config.json")
    if pre is None:
        source = str(folder / "processor_config.json")
        proc = _read_json(folder / "processor_config.json") or {}
        pre = _section(proc, "feature_extractor", source)
    fc = FrontendConfig()
    return FrontendConfig(
        sample_rate=_int(pre, "sampling_rate", fc.sample_rate, source, "sample_rate"),
        n_mels=_int(pre, "feature_size", n_mels, source, "n_mels"),
        n_fft=_int(pre, "n_fft", fc.n_fft, source),
        win_length=_int(pre, "win_length", fc.win_length, source),
        hop_length=_int(pre, "hop_length", fc.hop_length, source),
        preemphasis=_preemphasis(pre.get("preemphasis", fc.preemphasis), source),
    )


def from_hf(folder: Path) -> ParakeetConfig:
    """config.json (+ generation_config.json, preprocessor config) of a transformers folder."""
    cfg = _read_json(folder / "config.json")
    if cfg is None:
        raise FileNotFoundError(f"{folder}: no config.json")
    if cfg.get("model_type") != "parakeet_tdt":
        raise NotImplementedError(f"{folder}: model_type {cfg.get('model_type')!r}: only Parakeet TDT "
                                  "(parakeet_tdt) is supported; CTC and RNN-T heads are not supported yet")
    src = str(folder / "config.json")
    enc = _section(cfg, "encoder_config", src)
    gen = _read_json(folder / "generation_config.json") or {}
    vocab = _int(cfg, "vocab_size", 8193, src)
    blank = _int(cfg, "blank_token_id", 8192, src, "token_id")
    start = gen.get("decoder_start_token_id")
    n_mels = _int(enc, "num_mel_bins", 80, src, where="encoder_config")
    hidden = _int(enc, "hidden_size", 1024, src, where="encoder_config")
    max_symbols = cfg.get("max_symbols_per_step", 10)
    return validate(ParakeetConfig(
        hidden_size=hidden, num_layers=_int(enc, "num_hidden_layers", 24, src, "num_layers", where="encoder_config"),
        num_heads=_int(enc, "num_attention_heads", 8, src, "num_heads", where="encoder_config"),
        intermediate_size=_int(enc, "intermediate_size", 4 * hidden, src, where="encoder_config"),
        conv_kernel_size=_int(enc, "conv_kernel_size", 9, src, where="encoder_config"),
        subsampling_factor=_int(enc, "subsampling_factor", 8, src, where="encoder_config"),
        subsampling_channels=_int(enc, "subsampling_conv_channels", 256, src, "subsampling_channels",
                                  where="encoder_config"),
        subsampling_kernel=_int(enc, "subsampling_conv_kernel_size", 3, src, "subsampling_kernel",
                                where="encoder_config"),
        subsampling_stride=_int(enc, "subsampling_conv_stride", 2, src, "subsampling_stride",
                                where="encoder_config"),
        num_mel_bins=n_mels, scale_input=bool(enc.get("scale_input", True)),
        vocab_size=vocab, blank_id=blank,
        durations=_durations(cfg.get("durations", (0, 1, 2, 3, 4)), src, "durations"),
        decoder_hidden=_int(cfg, "decoder_hidden_size", 640, src, "decoder_hidden"),
        decoder_layers=_int(cfg, "num_decoder_layers", 2, src, "decoder_layers"),
        # null (NeMo: no guard) would let a model stuck on zero-duration tokens run frames x 10 x
        # frames steps: the default guard applies instead
        max_symbols_per_step=10 if max_symbols is None else _int(cfg, "max_symbols_per_step", 10, src),
        start_token_id=blank if start is None else config_int(
            start, folder / "generation_config.json", "decoder_start_token_id", *LIMITS["token_id"]),
        encoder_act=str(enc.get("hidden_act", "silu")), joint_act=str(cfg.get("hidden_act", "relu")),
        frontend=frontend_from_hf(folder, n_mels),
    ), src)


def from_nemo(yaml_cfg: dict[str, Any], source: str = "model_config.yaml") -> ParakeetConfig:
    """model_config.yaml of a NeMo EncDecRNNTBPEModel with a TDT loss/decoder. Error messages are
    built only on failure (and cut short): a crafted config's values can be large structures."""
    src = source
    enc = _section(yaml_cfg, "encoder", src)
    missing = [k for k in ("d_model", "n_layers", "n_heads") if k not in enc]
    if missing:
        raise ValueError(f"{src}: encoder lacks {missing} (not a NeMo FastConformer transducer?)")
    dec = _section(yaml_cfg, "decoder", src)
    joint = _section(yaml_cfg, "joint", src)
    pre = _section(yaml_cfg, "preprocessor", src)
    decoding = _section(yaml_cfg, "decoding", src)
    durations = (decoding.get("durations") or _section(yaml_cfg, "model_defaults", src).get("tdt_durations")
                 or _section(_section(yaml_cfg, "loss", src), "tdt_kwargs", src).get("durations"))
    _check(bool(durations), "a NeMo transducer without TDT durations (plain RNN-T)")
    r = reprlib.repr
    if enc.get("self_attention_model", "rel_pos") != "rel_pos":
        _check(False, f"encoder self_attention_model {r(enc.get('self_attention_model'))}")
    if enc.get("subsampling", "dw_striding") != "dw_striding":
        _check(False, f"subsampling {r(enc.get('subsampling'))}")
    if enc.get("conv_norm_type", "batch_norm") != "batch_norm":
        _check(False, f"conv_norm_type {r(enc.get('conv_norm_type'))}")
    context = enc.get("att_context_size") or [-1, -1]
    if not isinstance(context, (list, tuple)) or list(context[:2]) != [-1, -1]:
        _check(False, f"limited attention context {r(context)}")
    _check(bool(enc.get("untie_biases", True)), "tied pos_bias_u/v across layers")
    _check(pre.get("frame_splicing", 1) in (1, None), "frame_splicing")
    if pre.get("window", "hann") != "hann":
        _check(False, f"window {r(pre.get('window'))}")
    _check(bool(pre.get("log", True)), "a linear (non-log) mel")
    # the front end is NeMo's defaults for these (every released Parakeet): centred STFT, power
    # spectrum, log(mel + 2^-24); another value would give other features without a word
    _check(not pre.get("exact_pad", False), "exact_pad (an uncentred STFT)")
    if pre.get("mag_power", 2.0) != 2.0:
        _check(False, f"mag_power {r(pre.get('mag_power'))}")
    if pre.get("log_zero_guard_type", "add") != "add":
        _check(False, f"log_zero_guard_type {r(pre.get('log_zero_guard_type'))}")
    if pre.get("log_zero_guard_value", 2 ** -24) != 2 ** -24:
        _check(False, f"log_zero_guard_value {r(pre.get('log_zero_guard_value'))}")
    sr = _int(pre, "sample_rate", 16000, src, where="preprocessor")
    d_model = _int(enc, "d_model", None, src, "hidden_size", where="encoder")
    classes = joint.get("num_classes", dec.get("vocab_size"))
    if classes is None:
        raise ValueError(f"{src}: neither joint.num_classes nor decoder.vocab_size (the vocabulary size)")
    n_classes = config_int(classes, src, "joint.num_classes", 1, LIMITS["vocab_size"][1] - 1)
    normalize = pre.get("normalize", "per_feature")
    if normalize not in ("per_feature", None, "None"):
        _check(False, f"preprocessor normalize {r(normalize)}")
    window_size = config_float(pre.get("window_size", 0.025), src, "preprocessor.window_size", 1e-4, 1.0)
    window_stride = config_float(pre.get("window_stride", 0.01), src, "preprocessor.window_stride", 1e-4, 1.0)
    win = int(round(window_size * sr))
    frontend = FrontendConfig(
        sample_rate=sr, n_mels=_int(pre, "features", 128, src, "n_mels", where="preprocessor"),
        # NeMo's rule: the next power of 2 above the window
        n_fft=(_int(pre, "n_fft", None, src, where="preprocessor") if pre.get("n_fft")
               else 2 ** (int(window_size * sr) - 1).bit_length()),
        win_length=config_int(win, src, "preprocessor.window_size x sample_rate", *LIMITS["win_length"]),
        hop_length=config_int(int(round(window_stride * sr)), src, "preprocessor.window_stride x sample_rate",
                              *LIMITS["hop_length"]),
        preemphasis=_preemphasis(pre.get("preemph", 0.97), src),
        normalize=normalize if normalize == "per_feature" else None,
    )
    config_int(frontend.n_fft, src, "preprocessor.n_fft", *LIMITS["n_fft"])
    channels = enc.get("subsampling_conv_channels", -1)
    greedy = _section(decoding, "greedy", src)
    prednet = _section(dec, "prednet", src)
    max_symbols = greedy.get("max_symbols", 10)
    expansion = config_float(enc.get("ff_expansion_factor", 4), src, "encoder.ff_expansion_factor", 0.01, 64)
    return validate(ParakeetConfig(
        hidden_size=d_model, num_layers=_int(enc, "n_layers", None, src, "num_layers", where="encoder"),
        num_heads=_int(enc, "n_heads", None, src, "num_heads", where="encoder"),
        intermediate_size=config_int(int(d_model * expansion), src, "encoder.ff_expansion_factor x d_model",
                                     *LIMITS["intermediate_size"]),
        conv_kernel_size=_int(enc, "conv_kernel_size", 31, src, where="encoder"),
        subsampling_factor=_int(enc, "subsampling_factor", 8, src, where="encoder"),
        subsampling_channels=d_model if channels in (-1, None) else _int(
            enc, "subsampling_conv_channels", None, src, "subsampling_channels", where="encoder"),
        subsampling_kernel=_int(enc, "subsampling_conv_kernel_size", 3, src, "subsampling_kernel", where="encoder"),
        subsampling_stride=_int(enc, "subsampling_conv_stride", 2, src, "subsampling_stride", where="encoder"),
        num_mel_bins=_int(enc, "feat_in", frontend.n_mels, src, "num_mel_bins", where="encoder"),
        scale_input=bool(enc.get("xscaling", True)),
        vocab_size=n_classes + 1, blank_id=n_classes,
        durations=_durations(durations, src, "durations"),
        decoder_hidden=_int(prednet, "pred_hidden", 640, src, "decoder_hidden", where="decoder.prednet"),
        decoder_layers=_int(prednet, "pred_rnn_layers", 1, src, "decoder_layers", where="decoder.prednet"),
        # null (no guard) would let a stuck model run frames x 10 x frames steps: NeMo's default
        max_symbols_per_step=10 if max_symbols is None else _int(
            greedy, "max_symbols", 10, src, "max_symbols_per_step", where="decoding.greedy"),
        start_token_id=n_classes,   # NeMo feeds the blank (a zero row: blank_as_pad) as start
        joint_act=str(_section(joint, "jointnet", src).get("activation", "relu")),
        frontend=frontend,
    ), src)
