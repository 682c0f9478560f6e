"""Parakeet TDT against transformers' ParakeetForTDT on the same tiny random weights.

* front end: our log-mel equals ParakeetFeatureExtractor's on espeak-ng speech;
* encoder: equals transformers' encoder output within fp32 tolerance; its relative-position
  attention runs as ops.attention with the position term as the bias, its depthwise conv as
  ops.causal_conv1d;
* greedy TDT: every step's token (blanks included) AND duration identical to transformers'
  greedy `generate` on real espeak-ng speech;
* a .nemo built from the same weights under NeMo's names (with model_config.yaml and a
  SentencePiece model) loads to the same encoder output, tokens, durations and text;
* transcribe: text, words and segments from the durations, resampling, long audio in chunks,
  Whisper-only options ignored, silence / noise give no text, bad input gives clear errors;
* registry, photon_core.load and the `python -m photon_core transcribe` command serve it.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import parakeet_fixtures as pf
from photon_core.audio_io import write_wav
from photon_core.models.parakeet import ParakeetSpeech, load_parakeet
from photon_core.models.parakeet.frontend import prepare_audio
from photon_core.models.parakeet.tdt import greedy_tdt


@pytest.fixture(scope="module")
def hf():
    return pf.hf_model()


@pytest.fixture(scope="module")
def pcm():
    return pf.speech()


@pytest.fixture(scope="module")
def features(pcm):
    from transformers import ParakeetFeatureExtractor

    fe = ParakeetFeatureExtractor.from_pretrained(pf.hf_checkpoint())
    return fe(pcm, sampling_rate=16000, return_tensors="pt")


@pytest.fixture(scope="module")
def reference_steps(hf, features):
    with torch.no_grad():
        out = hf.generate(**features)
    # generate prepends the decoder start token (with a duration of 0)
    return out.sequences[0, 1:].tolist(), out.durations[0, 1:].tolist()


@pytest.fixture(scope="module")
def ours():
    return load_parakeet(pf.hf_checkpoint())


@pytest.fixture(scope="module")
def ours_nemo():
    return load_parakeet(pf.nemo_checkpoint())


def _steps(speech: ParakeetSpeech, pcm: np.ndarray):
    with torch.inference_mode():
        mel = speech.mel(pcm)
        enc = speech.model.encode(mel[None])
        steps, _ = greedy_tdt(speech.model, speech.model.project_encoder(enc)[0], max_symbols=None)
    return enc, steps


def test_frontend_matches_feature_extractor(ours, pcm, features):
    mel = ours.mel(pcm)
    n = int(features.attention_mask.sum())
    assert mel.shape == (n, pf.N_MELS)
    torch.testing.assert_close(mel, features.input_features[0, :n], atol=1e-4, rtol=1e-4)


def test_encoder_matches_transformers(ours, hf, pcm, features):
    with torch.no_grad():
        out = hf.encoder(**features)
    # the feature extractor's last (masked) mel frame may add a masked encoder frame
    valid = int(out.attention_mask.sum())
    enc, _ = _steps(ours, pcm)
    assert enc.shape == (1, valid, ours.cfg.hidden_size)
    torch.testing.assert_close(enc, out.last_hidden_state[:, :valid], atol=1e-4, rtol=1e-4)


def test_encoder_attention_and_depthwise_conv_run_on_the_ops_contract(ours, pcm, monkeypatch):
    """The relative-position attention is ops.attention with the position term as `bias`, and the
    conformer's depthwise conv is ops.causal_conv1d: a backend's kernels serve the whole encoder."""
    from types import SimpleNamespace

    from photon_core.backends import contract
    from photon_core.backends import reference as ref

    calls = []

    def record(name):
        def op(*args, **kwargs):
            calls.append((name, kwargs.get("bias")))
            return getattr(ref, name)(*args, **kwargs)
        return op

    ops = SimpleNamespace(**{n: getattr(ref, n) for n in contract.OP_NAMES})
    ops.attention, ops.causal_conv1d = record("attention"), record("causal_conv1d")
    monkeypatch.setattr(ours.model, "ops", ops)
    with torch.inference_mode():
        ours.model.encode(ours.mel(pcm[:8000])[None])
    layers = ours.cfg.num_layers
    attn = [b for n, b in calls if n == "attention"]
    assert len(attn) == layers and sum(n == "causal_conv1d" for n, _ in calls) == layers
    t = attn[0].shape[-1]
    assert attn[0].shape == (1, ours.cfg.num_heads, t, t) and attn[0].abs().max() > 0


def test_greedy_tdt_tokens_and_durations_match_generate(ours, pcm, reference_steps):
    tokens, durations = reference_steps
    blank = ours.cfg.blank_id
    # the weights make decoding non-trivial: blanks and tokens, zero and longer durations
    assert blank in tokens and any(t != blank for t in tokens)
    assert 0 in durations and len(set(durations)) >= 3
    _, steps = _steps(ours, pcm)
    assert steps.tokens == tokens
    assert steps.durations == durations
    # each step is read at the frame the durations before it lead to
    assert steps.frames == [0] + np.cumsum(durations)[:-1].tolist()


def test_nemo_checkpoint_gives_the_same_outputs(ours, ours_nemo, pcm, reference_steps):
    from photon_core import registry

    assert registry.recognise(pf.nemo_checkpoint()).family.name == "parakeet"
    assert ours_nemo.cfg == ours.cfg
    enc_hf, steps_hf = _steps(ours, pcm)
    enc_nemo, steps_nemo = _steps(ours_nemo, pcm)
    # the .nemo ships its filterbank; the folder's is computed here: equal up to rounding
    torch.testing.assert_close(enc_nemo, enc_hf, atol=1e-5, rtol=1e-5)
    assert (steps_nemo.tokens, steps_nemo.durations) == reference_steps
    a, b = ours.transcribe(pcm, 16000), ours_nemo.transcribe(pcm, 16000)
    assert a["text"] and a["text"] == b["text"] and a["words"] == b["words"]


def test_transcribe_text_words_and_segments_follow_the_steps(ours, pcm, reference_steps):
    tokens, durations = reference_steps
    blank, fs = ours.cfg.blank_id, ours.cfg.frame_seconds
    result = ours.transcribe(pcm, 16000, language="en", initial_prompt="ignored", temperature=0.0,
                             timestamps=True, beam_size=1, condition_on_previous_text=False)
    emitted = [t for t in tokens if t != blank]
    assert result["tokens"] == emitted
    assert result["text"] == ours.vocab.decode(emitted) and result["text"]
    assert result["language"] == "en" and result["model_id"] == "parakeet-tdt-tiny"
    assert result["duration"] == pytest.approx(len(pcm) / 16000)
    # token times from the durations: a token read at frame f spans [f, f + max(d, 1)) * 80 ms,
    # a punctuation mark after the first token [e, e) where e is the end of the token before it
    # (NeMo's _refine_timestamps_tdt); a word runs from its first token's start to its last
    # token's end, and a mark never starts one
    frames = np.cumsum([0] + durations[:-1])
    spans: list[tuple] = []
    for t, f, d in zip(tokens, frames, durations):
        if t != blank:
            marked = bool(spans) and ours.vocab.decode([t]) in (".", ",", "?")
            spans.append((t, spans[-1][2], spans[-1][2]) if marked else (t, f * fs, (f + max(d, 1)) * fs))
    words: list[list] = []
    for span in spans:
        if not words or (ours.vocab.starts_word(span[0]) and ours.vocab.decode([span[0]]) not in (".", ",", "?")):
            words.append([])
        words[-1].append(span)
    expected = [{"start": round(w[0][1], 3), "end": round(w[-1][2], 3),
                 "word": ours.vocab.decode([x[0] for x in w])} for w in words]
    assert result["words"] == [w for w in expected if w["word"]]
    segs = result["segments"]
    assert segs and " ".join(s["text"] for s in segs).split() == result["text"].split()
    assert segs[0]["start"] == result["words"][0]["start"] and segs[-1]["end"] == result["words"][-1]["end"]
    with pytest.raises(TypeError, match="unexpected options"):
        ours.transcribe(pcm, 16000, tempreature=0.0)


def test_words_and_segments_from_timed_tokens(ours):
    piece = {p: i for i, p in enumerate(pf.PIECES)}
    timed = [(piece["\u2581the"], 0.0, 0.08, 0), (piece["a"], 0.16, 0.24, 0), (piece["."], 0.24, 0.32, 0),
             (piece["\u2581is"], 0.4, 0.48, 0), (piece["\u2581it"], 2.0, 2.08, 0), (piece["a"], 2.08, 2.4, 0),
             (piece["\u2581to"], 3.0, 3.08, 1)]
    out = ours._assemble(timed)
    assert out["text"] == "thea. is ita to"
    # the "." takes the end of the "a" before it (NeMo's TDT timestamp refinement)
    assert out["words"] == [{"start": 0.0, "end": 0.24, "word": "thea."}, {"start": 0.4, "end": 0.48, "word": "is"},
                            {"start": 2.0, "end": 2.4, "word": "ita"}, {"start": 3.0, "end": 3.08, "word": "to"}]
    # a segment ends at sentence punctuation, at a pause over a second, and at a chunk boundary
    assert out["segments"] == [{"start": 0.0, "end": 0.24, "text": "thea."}, {"start": 0.4, "end": 0.48, "text": "is"},
                               {"start": 2.0, "end": 2.4, "text": "ita"}, {"start": 3.0, "end": 3.08, "text": "to"}]


def test_punctuation_takes_the_end_of_the_token_before_it(ours, monkeypatch):
    """NeMo's TDT timestamps (rnnt_decoding._refine_timestamps_tdt, and transformers'
    ParakeetProcessor._refine_timestamps): a mark emitted after a pause starts and ends where the
    token before it ends, so the word and segment it closes end there too; a mark piece with "▁"
    joins the word before it (timestamp_utils.get_words_offsets), and the first token keeps its
    own times."""
    from photon_core.models.parakeet.tokenizer import Vocabulary

    pieces = list(pf.PIECES) + ["\u2581?"]
    monkeypatch.setattr(ours, "vocab", Vocabulary(pieces))
    piece = {p: i for i, p in enumerate(pieces)}
    timed = [(piece[","], 0.0, 0.08, 0), (piece["\u2581it"], 0.16, 0.32, 0), (piece["."], 1.2, 1.52, 0),
             (piece["\u2581is"], 2.0, 2.08, 0), (piece["\u2581?"], 2.8, 2.96, 0), (piece[","], 3.0, 3.08, 0)]
    out = ours._assemble(timed)
    assert out["words"] == [{"start": 0.0, "end": 0.08, "word": ","}, {"start": 0.16, "end": 0.32, "word": "it."},
                            {"start": 2.0, "end": 2.08, "word": "is ?,"}]
    assert out["segments"] == [{"start": 0.0, "end": 0.32, "text": ", it."}, {"start": 2.0, "end": 2.08, "text": "is ?,"}]


def test_other_sample_rates_and_int_pcm_are_converted(ours, pcm):
    from scipy.signal import resample_poly

    at_48k = resample_poly(pcm, 3, 1).astype(np.float32)
    direct = ours.transcribe(prepare_audio(at_48k, 48000, 16000), 16000)
    assert ours.transcribe(at_48k, 48000)["text"] == direct["text"]
    int16 = np.clip(pcm * 32767, -32768, 32767).astype(np.int16)
    stereo = np.stack([int16, int16], axis=1)
    assert ours.transcribe(stereo, 16000)["text"] == ours.transcribe(int16, 16000)["text"]


def test_long_audio_is_decoded_in_chunks(pcm):
    speech = load_parakeet(pf.hf_checkpoint(), chunk_seconds=1.5)
    noise = np.random.default_rng(3).normal(0, 0.05, 4 * 16000).astype(np.float32)
    long_pcm = np.concatenate([pcm, noise, pcm])
    result = speech.transcribe(long_pcm, 16000)
    noise_span = (len(pcm) / 16000, (len(pcm) + len(noise)) / 16000)
    from photon_core.runtime.audio_chunks import chunk_bounds   # the chunks transcribe cuts

    bounds = chunk_bounds(long_pcm, 16000, 1.5)
    assert len(bounds) >= 5 and bounds[0][0] == 0 and bounds[-1][1] == len(long_pcm)
    assert all(b - a <= 1.5 * 16000 for a, b in bounds)
    assert all(b0[1] == b1[0] for b0, b1 in zip(bounds, bounds[1:]))
    starts = [w["start"] for w in result["words"]]
    assert result["text"] and starts == sorted(starts)
    assert result["words"][-1]["end"] <= len(long_pcm) / 16000 + speech.cfg.frame_seconds * 4
    assert len(result["segments"]) >= len({round(w["start"] // 1.5) for w in result["words"]}) // 2
    # chunks wholly inside the noise are skipped by the gate: no word starts there
    inside = [(a / 16000, b / 16000) for a, b in bounds
              if a / 16000 >= noise_span[0] and b / 16000 <= noise_span[1]]
    assert inside and not [w for w in result["words"] for a, b in inside if a <= w["start"] < b]
    assert any(w["start"] < noise_span[0] for w in result["words"])
    # the speech after the noise is transcribed too (this random model writes no "▁", so its
    # tokens there continue the last word, as they do in the text: a chunk change alone starts none)
    assert any(w["end"] > noise_span[1] for w in result["words"])


def _colored_noise(alpha: float, n: int, seed: int = 0) -> np.ndarray:
    """Noise with a 1/f^alpha power spectrum (0 white, 1 pink, 2 brown), RMS 0.1."""
    rng = np.random.default_rng(seed)
    spec = np.fft.rfft(rng.normal(size=n))
    f = np.arange(len(spec))
    f[0] = 1
    x = np.fft.irfft(spec / f ** (alpha / 2), n)
    return (0.1 * x / x.std()).astype(np.float32)


@pytest.mark.parametrize("name", ["zeros", "quiet_noise", "noise", "loud_noise", "pink", "brown", "hum",
                                  "zeros_70s"])
def test_silence_and_noise_give_empty_text(ours, name):
    rng = np.random.default_rng(0)
    audio = {"zeros": lambda: np.zeros(32000, np.float32),
             "quiet_noise": lambda: rng.normal(0, 0.001, 32000).astype(np.float32),
             "noise": lambda: rng.normal(0, 0.05, 3 * 16000).astype(np.float32),
             "loud_noise": lambda: (rng.uniform(-1, 1, 5 * 16000) * 32767).astype(np.int16),
             "pink": lambda: _colored_noise(1, 3 * 16000),
             "brown": lambda: _colored_noise(2, 3 * 16000),
             "hum": lambda: (0.3 * np.sin(2 * np.pi * 50 * np.arange(48000) / 16000)).astype(np.float32),
             "zeros_70s": lambda: np.zeros(70 * 16000, np.float32)}[name]()
    result = ours.transcribe(audio, 16000)
    assert result["text"] == "" and result["segments"] == [] and result["words"] == []


def test_speech_in_noise_and_short_words_pass_the_gate():
    from photon_core.models.parakeet import speech_gate

    yes = pf.speech("yes")
    voiced = np.nonzero(np.abs(yes) > 1e-3)[0]
    assert speech_gate.has_speech(yes[voiced[0]:voiced[-1]], 16000)   # no pause around it at all
    noisy = pf.speech() + 0.3 * _colored_noise(2, len(pf.speech()))
    assert speech_gate.has_speech(noisy, 16000)


def test_the_gate_does_not_depend_on_the_weights(pcm):
    from photon_core.models.parakeet import speech_gate

    assert speech_gate.has_speech(pcm, 16000)
    assert not speech_gate.has_speech(np.zeros(16000, np.float32), 16000)
    assert not speech_gate.has_speech(np.random.default_rng(1).normal(0, 0.2, 16000).astype(np.float32), 16000)


@pytest.mark.parametrize("audio, rate, message", [
    (np.array([0.1, np.nan] * 8000, np.float32), 16000, "NaN"),
    (np.array([0.1, np.inf] * 8000, np.float32), 16000, "NaN or infinite"),
    (np.zeros(0, np.float32), 16000, "empty"),
    (np.zeros((10, 2, 2), np.float32), 16000, "samples"),
    (np.zeros(16000, np.float32), 0, "sample_rate"),
    (np.zeros(16000, np.float32), -8000, "sample_rate"),
    (np.zeros(16000, np.float32), 22050.5, "sample_rate"),
    (np.zeros(16000, np.float32), "16000", "sample_rate"),
])
def test_bad_input_gives_clear_errors(ours, audio, rate, message):
    with pytest.raises(ValueError, match=message):
        ours.transcribe(audio, rate)


@pytest.mark.parametrize("options, message", [({"task": "translate"}, "transcribes only"),
                                              ({"beam_size": 5}, "beam search")])
def test_a_translation_or_beam_search_is_refused_not_answered_with_greedy_text(ours, pcm, options, message):
    """Whisper's options Parakeet ignores are those that change nothing; a translation asked for
    must not come back as a transcript in the spoken language (nor a beam search as greedy text)."""
    with pytest.raises(NotImplementedError, match=message):
        ours.transcribe(pcm, 16000, **options)
    with pytest.raises(NotImplementedError, match=message):
        ours.batch([{"audio": pcm, **options}])
    assert ours.transcribe(pcm, 16000, task="transcribe", beam_size=1)["text"]


def test_too_short_speech_is_a_clear_error_not_a_crash(ours):
    with pytest.raises(ValueError, match="too short"):
        ours.mel(np.zeros(100, np.float32))


def test_warmup_and_interface(ours):
    ours.warmup(language=None, initial_prompt=None)
    ours.warmup(language="de", initial_prompt="Hallo")
    assert isinstance(ours.model_id, str)


def test_registry_load_and_cli(tmp_path, pcm):
    import photon_core
    from photon_core import registry

    assert registry.recognise(pf.hf_checkpoint()).family.name == "parakeet"
    model = photon_core.load(pf.hf_checkpoint(), skills=("transcribe",))
    assert isinstance(model, ParakeetSpeech)
    with pytest.raises(registry.MissingSkills):
        photon_core.load(pf.hf_checkpoint(), skills=("detect",))
    wav = tmp_path / "speech.wav"
    write_wav(wav, np.clip(pcm * 32767, -32768, 32767).astype(np.int16), 16000)
    for model_path in (pf.hf_checkpoint(), pf.nemo_checkpoint()):
        run = subprocess.run([sys.executable, "-m", "photon_core", "transcribe", str(wav), "--model",
                              str(model_path), "--no-timestamps"], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout)
        assert out["text"] == model.transcribe(pcm, 16000)["text"] and out["segments"]


def test_other_parakeet_heads_are_refused(tmp_path):
    from photon_core import registry

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "parakeet_ctc"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(NotImplementedError, match="only Parakeet TDT"):
        registry.recognise(tmp_path)


def test_max_symbols_guard_bounds_zero_duration_emissions(pcm):
    """Weights that always say "token, duration 0": NeMo's guard moves on after max_symbols."""
    from photon_core.models.parakeet.checkpoint import load as load_checkpoint

    ckpt = load_checkpoint(pf.hf_checkpoint())
    V = ckpt.config.vocab_size
    bias = ckpt.tensors["joint.head.bias"].clone()
    bias[V - 1] -= 1e4    # never blank
    bias[V] += 1e4        # always duration 0
    ckpt.tensors = {**ckpt.tensors, "joint.head.bias": bias}
    speech = ParakeetSpeech(ckpt, "guard")
    with torch.inference_mode():
        enc = speech.model.encode(speech.mel(pcm[:16000])[None])
        steps, _ = greedy_tdt(speech.model, speech.model.project_encoder(enc)[0], max_symbols=4, block=5)
    T = enc.shape[1]
    assert steps.frames == [f for f in range(T) for _ in range(4)]
    assert steps.durations == [0, 0, 0, 1] * T
    assert ckpt.config.blank_id not in steps.tokens


def test_decode_reads_the_device_once_per_block(ours, pcm, monkeypatch):
    """No host sync per step: only the end-of-block check converts a tensor to a Python value."""
    with torch.inference_mode():
        enc = ours.model.encode(ours.mel(pcm)[None])
        proj = ours.model.project_encoder(enc)[0]
    reads = []
    for name in ("__bool__", "item", "tolist", "__int__", "__index__", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, _name=name, **k):
            reads.append(_name)
            return _original(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    with torch.inference_mode():
        steps, _ = greedy_tdt(ours.model, proj, max_symbols=None, block=4)
    monkeypatch.undo()
    blocks = -(-len(steps.tokens) // 4)
    # one bool per block, plus the final transfer of the records (3 tolist calls)
    assert reads.count("__bool__") <= blocks + 1
    assert len(reads) - reads.count("__bool__") <= 3


def test_shared_engine_serves_parakeet():
    from photon_core.runtime.shared_models import release, shared_engine

    engine = shared_engine(str(pf.hf_checkpoint()), skills=("transcribe",))
    try:
        assert engine.family.name == "parakeet"
        result = engine.model.transcribe(pf.speech(), 16000, language=None, initial_prompt=None)
        assert set(result) >= {"text", "segments", "language"}
    finally:
        release(engine)


@pytest.mark.parametrize("section, key, value, message", [
    ("encoder", "att_context_size", [70, 13], "limited attention context"),
    ("encoder", "subsampling", "striding", "subsampling 'striding'"),
    ("encoder", "self_attention_model", "abs_pos", "self_attention_model 'abs_pos'"),
    ("encoder", "conv_norm_type", "layer_norm", "conv_norm_type"),
    ("model_defaults", "tdt_durations", None, "plain RNN-T"),
    # NeMo front-end settings other than its defaults (which every released Parakeet uses)
    ("preprocessor", "exact_pad", True, "exact_pad"),
    ("preprocessor", "mag_power", 1.0, "mag_power 1.0"),
    ("preprocessor", "log_zero_guard_type", "clamp", "log_zero_guard_type 'clamp'"),
    ("preprocessor", "log_zero_guard_value", 1e-5, "log_zero_guard_value 1e-05"),
])
def test_unsupported_nemo_configs_are_refused_plainly(tmp_path, section, key, value, message):
    config = pf.nemo_config()
    config[section][key] = value
    if key == "tdt_durations":
        config["decoding"].pop("durations")
    path = tmp_path / "variant.nemo"
    pf.write_nemo(path, config)
    with pytest.raises(NotImplementedError, match=message):
        load_parakeet(path)


def test_nemo_without_tokenizer_or_encoder_is_a_clear_error(tmp_path):
    path = tmp_path / "no-tokenizer.nemo"
    pf.write_nemo(path, pf.nemo_config(), with_tokenizer=False)
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        load_parakeet(path)
    config = pf.nemo_config()
    del config["encoder"]["d_model"]
    pf.write_nemo(path, config)
    with pytest.raises(ValueError, match="d_model"):
        load_parakeet(path)


def test_nan_joint_logits_refuse_the_request(pcm):
    """A joint whose logits turn NaN chose token and duration by a NaN's argmax: refused instead."""
    from photon_core.runtime.sampling import NonFiniteLogits
    model = load_parakeet(pf.hf_checkpoint())
    model.model.head_b[3] = float("nan")
    with pytest.raises(NonFiniteLogits):
        model.transcribe(pcm, 16000)
