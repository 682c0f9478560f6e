"""Qwen3-ASR against transformers' Qwen3ASRForConditionalGeneration on the same tiny random
checkpoint (real tensor names, saved by save_pretrained): front end vs its feature extractor,
prompt vs its processor, encoder outputs, prefill/decode logits, greedy tokens vs generate()."""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from speech_audio import espeak_pcm

TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'audio' -%}{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>",
            "<|audio_pad|>"]
SEED = 7   # chosen so greedy decoding of the test speech varies (>= 7 distinct tokens)
CORPUS = ["language English language Chinese language German language None",
          "system user assistant the quick brown fox jumps over the lazy dog",
          "turn on the kitchen lights please move the robot arm to the left"] * 4


def _tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.add_tokens([AddedToken("<asr_text>", special=False, normalized=False)])
    return tok


@functools.lru_cache(maxsize=None)
def tiny_checkpoint(tied: bool = False) -> Path:
    """A seeded tiny Qwen3-ASR folder: config.json, model.safetensors, tokenizer + processor files.
    Untied by default: a random model whose LM head is its embedding repeats the token it was
    fed, which would make greedy comparisons trivial (the real 0.6B/1.7B tie them: `tied`)."""
    from transformers import (PreTrainedTokenizerFast, Qwen3ASRConfig, Qwen3ASRFeatureExtractor,
                              Qwen3ASRForConditionalGeneration, Qwen3ASRProcessor)

    folder = Path(tempfile.mkdtemp(prefix="qwen3-asr-tiny-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    tok = _tokenizer()
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    vocab = tok.get_vocab_size() + 3
    torch.manual_seed(0)
    cfg = Qwen3ASRConfig(
        audio_config=dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2,
                          encoder_ffn_dim=64, d_model=32, output_dim=48, n_window=50,
                          n_window_infer=200, downsample_hidden_size=8, initializer_range=0.2),
        text_config=dict(vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=4096, tie_word_embeddings=tied,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         initializer_range=0.2),
        audio_token_id=ids["<|audio_pad|>"], pad_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|endoftext|>"], ids["<|im_end|>"]], initializer_range=0.2,
        tie_word_embeddings=tied)
    model = Qwen3ASRForConditionalGeneration(cfg).eval()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():   # norms away from 1 and weights large enough for varied greedy tokens
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 2:   # unit-variance outputs: logits that differ from step to step
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    model.save_pretrained(folder)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens={"audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>",
                              "audio_eos_token": "<|audio_end|>"})
    processor = Qwen3ASRProcessor(feature_extractor=Qwen3ASRFeatureExtractor(), tokenizer=fast,
                                  chat_template=TEMPLATE)
    processor.save_pretrained(folder)
    return folder


@functools.lru_cache(maxsize=None)
def hf_pair(tied: bool = False):
    from transformers import Qwen3ASRForConditionalGeneration, Qwen3ASRProcessor

    folder = tiny_checkpoint(tied)
    model = Qwen3ASRForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return model, Qwen3ASRProcessor.from_pretrained(folder)


@functools.lru_cache(maxsize=None)
def ours(backend: str = "reference", tied: bool = False):
    from photon_core.models.qwen3_asr import load_qwen3_asr
    return load_qwen3_asr(tiny_checkpoint(tied), backend=backend)


@functools.lru_cache(maxsize=None)
def speech(text: str = "Turn on the kitchen lights, then move the robot arm.") -> np.ndarray:
    """espeak-ng speech at 16 kHz (the processor's rate), float32."""
    from photon_core.models.qwen3_asr.frontend import prepare_audio
    pcm, rate = espeak_pcm(text)
    return prepare_audio(pcm, rate)


def _processor_inputs(pcm: np.ndarray, language: str | None, prompt: str | None = None, tied: bool = False):
    _, processor = hf_pair(tied)
    return processor.apply_transcription_request(audio=pcm, language=language, prompt=prompt)


def test_front_end_matches_feature_extractor():
    """Our log-mel (and valid-frame count) equals Qwen3ASRFeatureExtractor's through the
    processor, for a clip, a clip under the 0.5 s minimum, and one ending mid-hop."""
    model = ours()
    for pcm in (speech(), speech()[:5000], speech()[:16_037]):
        inputs = _processor_inputs(pcm, "en")
        mel, frames = model.features(pcm)
        assert frames == int(inputs["input_features_mask"].sum())
        assert mel.shape == inputs["input_features"][0].shape
        torch.testing.assert_close(mel, inputs["input_features"][0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("language,context", [("en", None), (None, None), ("German", "robot arm")])
def test_prompt_ids_match_processor(language, context):
    """The chat template rendered as the processor's transcription request renders it: system
    context, audio pads (one per audio token), language prefix or none (detection)."""
    model, pcm = ours(), speech()
    inputs = _processor_inputs(pcm, language, context)
    mel, frames = model.features(pcm)
    n_audio = model.encode(mel, frames).shape[0]
    assert model.prompt_ids(n_audio, language, context) == inputs["input_ids"][0].tolist()


@pytest.mark.parametrize("repeat", [1, 3])
def test_encoder_matches_transformers(repeat):
    """Conv stem per 100-frame chunk, kept positions, windowed attention (4 chunks: two windows,
    a partial chunk; 11 chunks: more than one group through the stem), ln_post, projector:
    within fp32 tolerance of get_audio_features."""
    hf, _ = hf_pair()
    model, pcm = ours(), np.tile(speech(), repeat)
    inputs = _processor_inputs(pcm, "en")
    mel, frames = model.features(pcm)
    assert frames > model.config.audio.n_window_infer   # more than one attention window
    with torch.no_grad():
        want = hf.get_audio_features(inputs["input_features"], inputs["input_features_mask"]).pooler_output
    got = model.encode(mel, frames)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("tied", [False, True])
def test_prefill_and_decode_logits_match(tied):
    """Logits of every prompt position, then of 5 decode steps fed transformers' own greedy
    tokens, against transformers' forward with its cache: fp32 tolerance. Tied and untied heads."""
    hf, _ = hf_pair(tied)
    model, pcm = ours(tied=tied), speech()
    inputs = _processor_inputs(pcm, None, tied=tied)
    mel, frames = model.features(pcm)
    audio = model.encode(mel, frames)
    ids = inputs["input_ids"][0].tolist()
    dec = model.decoder
    cache = dec.new_cache(1, len(ids) + 8)
    hidden = dec.prefill(model.prompt_embeds(ids, audio), cache, 0)
    with torch.no_grad():
        out = hf(**inputs, use_cache=True)
        torch.testing.assert_close(dec.logits(hidden)[None], out.logits, atol=1e-4, rtol=1e-4)
        hf_cache, token = out.cache, out.logits[0, -1].argmax()
        for step in range(5):
            got = dec.step(token.view(1), cache)
            out = hf(input_ids=token.view(1, 1), cache=hf_cache, use_cache=True,
                     position_ids=torch.tensor([[len(ids) + step]]))
            torch.testing.assert_close(got, out.logits[:, -1], atol=1e-4, rtol=1e-4)
            hf_cache, token = out.cache, out.logits[0, -1].argmax()


@pytest.mark.parametrize("language", ["en", None])
def test_greedy_tokens_match_generate(language):
    """24 greedy tokens on espeak-ng speech identical to transformers' generate (do_sample off),
    with the language forced and detected; the sequence is not a trivial repetition."""
    hf, _ = hf_pair()
    model, pcm = ours(), speech()
    inputs = _processor_inputs(pcm, language)
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=24, do_sample=False)
    want = out[0, inputs["input_ids"].shape[1]:].tolist()
    mel, frames = model.features(pcm)
    audio = model.encode(mel, frames)
    ids = model.prompt_ids(audio.shape[0], language, None)
    got = model.generate([model.prompt_embeds(ids, audio)], 24)[0]
    stop_at = next((i for i, t in enumerate(want) if t in model.config.eos_token_ids), len(want))
    assert got == want[:stop_at]   # ours leaves the stop token out
    assert len(set(got)) >= 5


def test_batched_decode_equals_one_at_a_time():
    """Three utterances of different lengths decoded together (one step per token for all)
    give each one's tokens alone."""
    model = ours()
    clips = [speech(), speech("Stop."), speech("Pick up the red cup and place it in the sink.")]
    prompts = []
    for pcm in clips:
        mel, frames = model.features(pcm)
        audio = model.encode(mel, frames)
        prompts.append(model.prompt_embeds(model.prompt_ids(audio.shape[0], "en", None), audio))
    together = model.generate(prompts, 12)
    assert together == [model.generate([p], 12)[0] for p in prompts]


@pytest.mark.parametrize("language", ["en", None])
def test_text_and_language_match_the_processors_parsed_output(language):
    """transcribe()'s text is the processor's parsed transcription of the same greedy ids."""
    _, processor = hf_pair()
    model, pcm = ours(), speech()
    mel, frames = model.features(pcm)
    audio = model.encode(mel, frames)
    ids = model.generate([model.prompt_embeds(model.prompt_ids(audio.shape[0], language, None), audio)],
                         max(32, int(12 * len(pcm) / 16000)))[0]
    parsed = processor.decode(ids, return_format="parsed")
    result = model.transcribe(pcm, 16000, language=language)
    assert result["text"] == parsed["transcription"] and result["text"]
    if language is None:
        from photon_core.models.qwen3_asr.prompt import language_code
        assert result["language"] == (language_code(parsed["language"]) if parsed["language"] else None)


def test_repetition_guard_matches_the_processors():
    from transformers.models.qwen3_asr.processing_qwen3_asr import _detect_and_fix_repetitions
    from photon_core.models.qwen3_asr.prompt import collapse_repetitions

    rng = np.random.default_rng(0)
    texts = ["a" * 30, "ab" * 25, "go " + "xy" * 30 + " now" + "z" * 22, "abc" * 19, "q" * 21, ""]
    for _ in range(100):
        texts.append("".join(str(rng.choice(["a", "ab", "abc", "x y ", "hello"])) * int(rng.integers(1, 45))
                             for _ in range(int(rng.integers(1, 4)))))
    for text in texts:
        assert collapse_repetitions(text) == _detect_and_fix_repetitions(text), text
