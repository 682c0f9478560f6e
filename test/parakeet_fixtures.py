"""Tiny random Parakeet TDT checkpoints for tests, in both formats, from the same weights.

`hf_checkpoint()`: transformers' ParakeetForTDT with a tiny config, save_pretrained (config.json,
model.safetensors with the real tensor names, generation_config.json with the blank as decoder
start), the ParakeetFeatureExtractor's preprocessor_config.json and a tokenizer.json built with the
`tokenizers` library. `nemo_checkpoint()`: the same tensors under NeMo's names (written out here by
hand from NeMo's module layout, independently of the loader's rules), a model_config.yaml and a
SentencePiece model protobuf, tarred as a .nemo. Random weights are scaled up where a default init
would make every step emit the same token, so decoding exercises blanks, tokens and durations.
"""
from __future__ import annotations

import functools
import io
import struct
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import torch
import yaml

PIECES = (["<unk>", "\u2581"] + [f"\u2581{w}" for w in ("the", "a", "is", "to", "and", "of", "it", "in")]
          + list("abcdefghijklmnopqrstuvwxyz") + [".", ",", "?"])
N_MELS = 16
_DIR = Path(tempfile.mkdtemp(prefix="photon-parakeet-"))


def _config():
    from transformers import ParakeetTDTConfig

    return ParakeetTDTConfig(
        vocab_size=len(PIECES) + 1, blank_token_id=len(PIECES), pad_token_id=0,
        decoder_hidden_size=24, num_decoder_layers=2, max_symbols_per_step=10, durations=[0, 1, 2, 3, 4],
        encoder_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                            conv_kernel_size=9, subsampling_conv_channels=8, num_mel_bins=N_MELS))


def _tokenizer_json(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.Unigram([(p, -float(i)) for i, p in enumerate(PIECES)], unk_id=0))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.save(str(path))


CALIBRATION_TEXT = "the quick brown fox jumps over the lazy dog. is it a test?"


def speech(text: str = CALIBRATION_TEXT) -> "np.ndarray":
    """16 kHz float32 espeak-ng speech."""
    from photon_core.models.parakeet.frontend import prepare_audio
    from speech_audio import espeak_pcm

    pcm, rate = espeak_pcm(text)
    return prepare_audio(pcm, rate, 16000)


SEED, ZERO_DURATION_QUANTILE = 0, 0.85


@functools.lru_cache(maxsize=None)
def hf_checkpoint() -> Path:
    folder = _DIR / "parakeet-tdt-tiny"
    build_hf(folder, SEED, ZERO_DURATION_QUANTILE)
    return folder


def build_hf(folder: Path, seed: int, zero_quantile: float) -> None:
    from transformers import ParakeetFeatureExtractor, ParakeetForTDT

    cfg = _config()
    cfg.initializer_range = cfg.encoder_config.initializer_range = 0.3   # frames that differ
    torch.manual_seed(seed)
    model = ParakeetForTDT(cfg).eval()
    V = cfg.vocab_size
    with torch.no_grad():
        for layer in model.encoder.layers:   # BatchNorm statistics that are not the identity
            layer.conv.norm.running_mean.uniform_(-0.5, 0.5)
            layer.conv.norm.running_var.uniform_(0.5, 2.0)
            layer.conv.norm.weight.uniform_(0.5, 1.5)
            layer.conv.norm.bias.uniform_(-0.2, 0.2)
        # a prediction network strong enough that an emitted token changes the next choice
        model.decoder.decoder_projector.weight.mul_(10.0)
        # Biases set from the joint's logits over a calibration utterance, so that decoding
        # meets blanks and tokens, and every duration including 0 (rarely: a token repeated at
        # one frame forever is what a random model would otherwise do).
        feats = ParakeetFeatureExtractor(feature_size=N_MELS)(speech(), sampling_rate=16000, return_tensors="pt")
        enc = model.get_audio_features(**feats).pooler_output[0]
        start = model.decoder(torch.tensor([[cfg.blank_token_id]]))[0, -1]
        logits = model.joint.head(torch.relu(enc + start))
        bias = model.joint.head.bias
        bias[V:] -= logits[:, V:].median(0).values
        bias[V] -= (logits[:, V] - logits[:, V + 1:].max(-1).values).quantile(zero_quantile)
        bias[V - 1] += (logits[:, :V - 1].max(-1).values - logits[:, V - 1]).median()
        # transformers' generate picks the emitted token by argmax over the whole joint output,
        # durations included (its frame pointer uses the token part only): lift the token logits
        # above the duration logits so both read the same token; neither argmax changes.
        bias[:V] += 1000.0
    model.generation_config.decoder_start_token_id = model.config.blank_token_id
    model.save_pretrained(folder)
    ParakeetFeatureExtractor(feature_size=N_MELS).save_pretrained(folder)
    _tokenizer_json(folder / "tokenizer.json")


def hf_model():
    from transformers import ParakeetForTDT

    model = ParakeetForTDT.from_pretrained(hf_checkpoint()).eval()
    model.generation_config.decoder_start_token_id = model.config.blank_token_id
    return model


def _to_nemo_name(name: str) -> str:
    """transformers name -> NeMo name, following NeMo's module layout."""
    simple = {
        "encoder.subsampling.linear": "encoder.pre_encode.out", "encoder.subsampling.layers": "encoder.pre_encode.conv",
        "decoder.embedding": "decoder.prediction.embed", "decoder.lstm": "decoder.prediction.dec_rnn.lstm",
        "decoder.decoder_projector": "joint.pred", "encoder_projector": "joint.enc", "joint.head": "joint.joint_net.2",
        "self_attn.q_proj": "self_attn.linear_q", "self_attn.k_proj": "self_attn.linear_k",
        "self_attn.v_proj": "self_attn.linear_v", "self_attn.o_proj": "self_attn.linear_out",
        "self_attn.relative_k_proj": "self_attn.linear_pos", "self_attn.bias_u": "self_attn.pos_bias_u",
        "self_attn.bias_v": "self_attn.pos_bias_v", "conv.norm": "conv.batch_norm",
    }
    for old, new in simple.items():
        if old in name:
            return name.replace(old, new)
    return name


def _sentencepiece_model() -> bytes:
    """A SentencePiece ModelProto holding just the pieces (field 1: {1: piece, 2: score, 3: type})."""
    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(out)

    def field(number: int, wire: int, payload: bytes) -> bytes:
        return varint(number << 3 | wire) + (varint(len(payload)) + payload if wire == 2 else payload)

    out = b""
    for i, p in enumerate(PIECES):
        kind = 2 if p == "<unk>" else 1
        msg = field(1, 2, p.encode()) + field(2, 5, struct.pack("<f", -float(i))) + field(3, 0, varint(kind))
        out += field(1, 2, msg)
    return out + field(2, 2, b"")   # trainer spec (empty): a field the reader must skip


def nemo_config() -> dict:
    cfg = _config()
    enc = cfg.encoder_config
    return {
        "target": "nemo.collections.asr.models.rnnt_bpe_models.EncDecRNNTBPEModel",
        "preprocessor": {"sample_rate": 16000, "normalize": "per_feature", "window_size": 0.025,
                         "window_stride": 0.01, "window": "hann", "features": N_MELS, "n_fft": 512,
                         "log": True, "frame_splicing": 1, "dither": 1e-5, "pad_to": 0},
        "encoder": {"feat_in": N_MELS, "n_layers": enc.num_hidden_layers, "d_model": enc.hidden_size,
                    "subsampling": "dw_striding", "subsampling_factor": 8,
                    "subsampling_conv_channels": enc.subsampling_conv_channels,
                    "ff_expansion_factor": enc.intermediate_size // enc.hidden_size,
                    "self_attention_model": "rel_pos", "n_heads": enc.num_attention_heads,
                    "att_context_size": [-1, -1], "xscaling": True, "untie_biases": True,
                    "conv_kernel_size": enc.conv_kernel_size, "conv_norm_type": "batch_norm"},
        "decoder": {"vocab_size": len(PIECES), "blank_as_pad": True,
                    "prednet": {"pred_hidden": cfg.decoder_hidden_size, "pred_rnn_layers": cfg.num_decoder_layers}},
        "joint": {"num_classes": len(PIECES), "num_extra_outputs": 5,
                  "jointnet": {"joint_hidden": cfg.decoder_hidden_size, "activation": "relu"}},
        "model_defaults": {"tdt_durations": [0, 1, 2, 3, 4]},
        "decoding": {"strategy": "greedy_batch", "model_type": "tdt", "durations": [0, 1, 2, 3, 4],
                     "greedy": {"max_symbols": 10}},
        "tokenizer": {"dir": None, "type": "bpe", "model_path": "nemo:abc123_tokenizer.model"},
    }


@functools.lru_cache(maxsize=None)
def nemo_checkpoint() -> Path:
    path = _DIR / "parakeet_tdt_tiny.nemo"
    write_nemo(path, nemo_config())
    return path


def write_nemo(path: Path, config: dict, with_tokenizer: bool = True) -> None:
    from safetensors.torch import load_file
    from transformers import ParakeetFeatureExtractor

    state = {_to_nemo_name(k): v for k, v in load_file(str(hf_checkpoint() / "model.safetensors")).items()}
    for i in range(_config().encoder_config.num_hidden_layers):
        state[f"encoder.layers.{i}.conv.batch_norm.num_batches_tracked"] = torch.tensor(0)
    fe = ParakeetFeatureExtractor(feature_size=N_MELS)
    state["preprocessor.featurizer.fb"] = fe.mel_filters[None].clone()   # [1, n_mels, n_freq]
    state["preprocessor.featurizer.window"] = torch.hann_window(400, periodic=False)
    weights = io.BytesIO()
    torch.save(state, weights)
    members = [("./model_config.yaml", yaml.safe_dump(config).encode()), ("./model_weights.ckpt", weights.getvalue())]
    if with_tokenizer:
        members.append(("./abc123_tokenizer.model", _sentencepiece_model()))
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
