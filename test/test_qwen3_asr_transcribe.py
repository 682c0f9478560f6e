"""Qwen3-ASR behind Whisper's face: transcribe()/warmup()/model_id, resampling, Whisper-only
options, the weight-independent no-speech gate, clear errors, the registry, photon_core.load,
the `transcribe` command line, the original (thinker.*) checkpoint layout and the speech node."""
from __future__ import annotations

import io
import json
import shutil
from contextlib import redirect_stdout

import numpy as np
import pytest

from speech_audio import espeak_pcm
from test_qwen3_asr_reference import ours, speech, tiny_checkpoint

from photon_core.audio_io import write_wav

KEYS = {"text", "segments", "language", "duration", "processing_time", "no_speech_prob", "model_id"}


def _greedy_text(model, pcm: np.ndarray, language: str | None) -> tuple[str, str | None]:
    mel, frames = model.features(pcm)
    audio = model.encode(mel, frames)
    ids = model.prompt_ids(audio.shape[0], language, None)
    budget = max(32, int(12 * len(pcm) / 16000))
    return model.prompt.parse(model.generate([model.prompt_embeds(ids, audio)], budget)[0], language)


def test_transcribe_result_is_whispers_shape_and_the_greedy_text():
    model = ours()
    pcm = speech()
    result = model.transcribe(pcm, 16000, language="en")
    assert set(result) == KEYS
    text, _ = _greedy_text(model, pcm, "en")
    assert result["text"] == text and text
    assert result["language"] == "en" and result["no_speech_prob"] == 0.0
    assert result["segments"] == [{"start": 0.0, "end": round(len(pcm) / 16000, 3), "text": text}]
    assert result["duration"] == pytest.approx(len(pcm) / 16000)
    assert result["model_id"] == model.model_id and model.model_id


def test_transcribe_batch_equals_one_at_a_time():
    """Concurrent utterances (one silent) in one call: each result as if transcribed alone."""
    model = ours()
    clips = [(speech(), 16000), (np.zeros(16000, np.float32), 16000),
             espeak_pcm("Stop."), (speech("Pick up the red cup."), 16000)]
    together = model.transcribe_batch(clips, language="en", max_new_tokens=10)
    alone = [model.transcribe(a, r, language="en", max_new_tokens=10) for a, r in clips]
    assert [r["text"] for r in together] == [r["text"] for r in alone]
    assert together[1]["text"] == "" and all(r["text"] for i, r in enumerate(together) if i != 1)


def test_language_names_and_codes_and_detection_parse():
    model = ours()
    assert model.transcribe(speech(), 16000, language="English")["language"] == "en"
    # Detection: the model's own "language <Name><asr_text>" prefix gives the language and is cut
    ids = model.prompt.encode("language German<asr_text> the robot arm")
    assert model.prompt.parse(ids, None) == ("the robot arm", "de")
    assert model.prompt.parse(model.prompt.encode("language None<asr_text>"), None) == ("", None)
    assert model.prompt.parse(model.prompt.encode("the robot"), None) == ("the robot", None)
    with pytest.raises(ValueError, match="unknown language 'xx'"):
        model.transcribe(speech(), 16000, language="xx")


def test_other_sample_rates_are_resampled():
    """espeak-ng's 22050 Hz as given equals the same audio resampled to 16 kHz first; stereo int16
    is mixed down."""
    model = ours()
    pcm, rate = espeak_pcm("Turn on the kitchen lights, then move the robot arm.")
    assert rate != 16000
    direct = model.transcribe(pcm, rate, language="en")
    assert direct["text"] == model.transcribe(speech(), 16000, language="en")["text"]
    stereo = (np.stack([pcm, pcm], axis=1) * 32767).astype(np.int16)
    assert model.transcribe(stereo, rate, language="en")["text"] == direct["text"]


def test_whisper_only_options_are_accepted_and_ignored():
    model = ours()
    base = model.transcribe(speech(), 16000, language="en")["text"]
    same = model.transcribe(speech(), 16000, language="en", timestamps=False, temperature=0.0,
                            condition_on_previous_text=False, beam_size=1)
    assert same["text"] == base
    with pytest.raises(NotImplementedError, match="beam search"):
        model.transcribe(speech(), 16000, beam_size=5)
    with pytest.raises(TypeError, match="unexpected options"):
        model.transcribe(speech(), 16000, best_of=3)


@pytest.mark.parametrize("name", ["zeros", "noise", "loud_noise", "hum", "zeros_40s"])
def test_silence_and_noise_give_empty_text_with_random_weights(name):
    """The gate needs no weights: this random model writes text for speech, none for these."""
    rng = np.random.default_rng(0)
    t = np.arange(3 * 16000) / 16000
    audio = {"zeros": np.zeros(3 * 16000, np.float32),
             "noise": rng.normal(0, 0.05, 3 * 16000).astype(np.float32),
             "loud_noise": (rng.uniform(-1, 1, 5 * 16000) * 32767).astype(np.int16),
             "hum": (0.3 * np.sin(2 * np.pi * 100 * t)).astype(np.float32),
             "zeros_40s": np.zeros(40 * 16000, np.float32)}[name]
    model = ours()
    result = model.transcribe(audio, 16000)
    assert result["text"] == "" and result["segments"] == [] and result["no_speech_prob"] == 1.0
    assert set(result) == KEYS
    # with the gate off the same random model does write something: the gate did the work
    assert model.transcribe(audio[:16000], 16000, speech_gate=False, max_new_tokens=4)["text"] != ""


@pytest.mark.parametrize("audio,rate,message", [
    (np.array([0.1, np.nan, 0.2] * 1000, np.float32), 16000, "NaN"),
    (np.zeros(0, np.float32), 16000, "empty"),
    (np.zeros(16000, np.float32), 0, "sample_rate"),
    (np.zeros(16000, np.float32), 16000.5, "sample_rate"),
    (np.zeros(16000, np.float32), True, "sample_rate"),
    (np.zeros((2, 2, 2), np.float32), 16000, "shape"),
])
def test_bad_input_is_a_clear_error(audio, rate, message):
    with pytest.raises(ValueError, match=message):
        ours().transcribe(audio, rate)


@pytest.mark.parametrize("max_new_tokens", [0, -3, 2.5, True, "16"])
def test_bad_max_new_tokens_is_refused_before_any_model_work(max_new_tokens, monkeypatch):
    """0 used to mean the default budget (a long transcript for a request of none), a negative
    budget failed after the encoder as a cache overflow, a fractional one inside torch."""
    model = ours()
    monkeypatch.setattr(model.encoder, "encode_many", lambda *a: pytest.fail("the encoder ran"))
    with pytest.raises(ValueError, match="max_new_tokens must be a whole number"):
        model.transcribe(speech(), 16000, language="en", max_new_tokens=max_new_tokens)


def test_a_numpy_integer_max_new_tokens_is_taken_as_an_int():
    model = ours()
    assert model.transcribe(speech(), 16000, language="en", max_new_tokens=np.int64(1))["text"] == \
        model.transcribe(speech(), 16000, language="en", max_new_tokens=1)["text"]


def test_warmup_runs_and_leaves_results_unchanged():
    model = ours()
    before = model.transcribe(speech(), 16000, language="en")["text"]
    model.warmup(language="en", initial_prompt="robot")
    model.warmup()
    assert model.transcribe(speech(), 16000, language="en")["text"] == before


def test_initial_prompt_is_the_system_context():
    model = ours()
    with_context = model.prompt.render("en", "kitchen robot")
    assert with_context.startswith("<|im_start|>system\nkitchen robot<|im_end|>\n")
    result = model.transcribe(speech(), 16000, language="en", initial_prompt="kitchen robot")
    assert set(result) == KEYS


def test_registry_claims_qwen3_asr_only(tmp_path):
    from photon_core import registry
    from photon_core.models.qwen3_asr import FAMILY, Qwen3ASRSpeech
    from photon_core.weights.checkpoint_files import CheckpointFiles
    import photon_core

    folder = tiny_checkpoint()
    assert registry.recognise(folder).family.name == "qwen3_asr"
    loaded = photon_core.load(folder, skills=("transcribe",))
    assert isinstance(loaded, Qwen3ASRSpeech) and loaded.model_id == folder.name
    for model_type in ("qwen3_5", "whisper", "qwen3", "qwen3_omni_moe"):
        other = tmp_path / model_type
        other.mkdir()
        (other / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert not FAMILY.recognise(CheckpointFiles(other))
    aligner = tmp_path / "aligner"
    shutil.copytree(folder, aligner)
    cfg = json.loads((aligner / "config.json").read_text())
    cfg["architectures"] = ["Qwen3ASRForTokenClassification"]
    (aligner / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NotImplementedError, match="forced aligner"):
        registry.recognise(aligner)


def test_original_thinker_layout_loads_the_same_model(tmp_path):
    """Qwen/Qwen3-ASR-* (thinker_config, thinker.* names, projector as audio_tower.proj1/2)."""
    from safetensors.torch import load_file, save_file
    from photon_core import registry
    from photon_core.models.qwen3_asr import load_qwen3_asr

    src = tiny_checkpoint()
    dst = tmp_path / "original"
    shutil.copytree(src, dst)
    hf = load_file(src / "model.safetensors")
    renames = [("model.multi_modal_projector.linear_1.", "thinker.audio_tower.proj1."),
               ("model.multi_modal_projector.linear_2.", "thinker.audio_tower.proj2."),
               ("model.audio_tower.", "thinker.audio_tower."),
               ("model.language_model.", "thinker.model."), ("lm_head.", "thinker.lm_head.")]
    out = {}
    for name, t in hf.items():
        for a, b in renames:
            if name.startswith(a):
                name = b + name[len(a):]
                break
        out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    thinker = {k: cfg.pop(k) for k in ("audio_config", "text_config", "audio_token_id")}
    cfg["thinker_config"] = thinker
    cfg["architectures"] = ["Qwen3ASRForConditionalGeneration"]
    (dst / "config.json").write_text(json.dumps(cfg))
    assert registry.recognise(dst).family.name == "qwen3_asr"
    original = load_qwen3_asr(dst)
    assert original.config.original_layout
    assert original.transcribe(speech(), 16000, language="en")["text"] == \
        ours().transcribe(speech(), 16000, language="en")["text"]


def test_transcribe_command_line_serves_qwen3_asr(tmp_path):
    from photon_core.__main__ import main

    folder = tiny_checkpoint()
    pcm, rate = espeak_pcm("Stop the robot.")
    for name, audio in (("speech.wav", pcm), ("silence.wav", np.zeros(rate, np.float32))):
        write_wav(tmp_path / name, audio, rate)
        out = io.StringIO()
        with redirect_stdout(out):
            assert main(["transcribe", str(tmp_path / name), "--model", str(folder),
                         "--language", "en", "--no-timestamps"]) == 0
        result = json.loads(out.getvalue())
        assert set(result) == KEYS and result["language"] == "en"
        assert (result["text"] == "") == (name == "silence.wav")


def test_vocab_and_merges_tokenizer_equals_transformers_qwen2(tmp_path):
    """Checkpoints with vocab.json + merges.txt (no tokenizer.json): our Qwen2 BPE encodes and
    decodes as transformers' Qwen2Tokenizer built from the same files."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    from photon_core.models.qwen3_asr.prompt import load_tokenizer

    src = Tokenizer.from_file(str(tiny_checkpoint() / "tokenizer.json"))
    src.model.save(str(tmp_path))                      # vocab.json, merges.txt
    added = {str(t_id): {"content": tok.content, "special": tok.special, "normalized": False,
                         "lstrip": False, "rstrip": False, "single_word": False}
             for t_id, tok in src.get_added_tokens_decoder().items()}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": added,
         "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    ours_tok, theirs = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    model = ours()
    texts = [model.prompt.render("en", "robot arm"), model.prompt.render(None, None),
             "language English<asr_text>Turn on the kitchen lights, then move 3 robots!",
             "Ünïcödé  spaces\n\nnew lines  "]
    for text in texts:
        ids = ours_tok.encode(text, add_special_tokens=False).ids
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours_tok.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
