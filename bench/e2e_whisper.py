"""Whisper large-v3-turbo and tiny.en in the end-to-end benchmark: 5 s and 30 s of audio transcribed
(English, greedy, with timestamp tokens as the speech node's final transcripts are decoded, no
temperature fallback), ours against transformers' `generate` (return_timestamps=True).
Ours runs as load_whisper loads it, in the benchmark's dtype on a GPU; on the CPU with its CPU
defaults (dtype None: the encoder's context fitted to the clip, int8 decoder linears on AVX-512 VNNI
CPUs), the peer in float32 there.

Weights: transformers' random init of the real shapes (large-v3-turbo: 128 mels, encoder 32 x 1280,
decoder 4 x 1280, 20 heads, vocabulary 51866; tiny.en: 80 mels, 4 + 4 x 384, 6 heads, 51864),
read by our loader (load_whisper on a folder, its Hugging Face renaming) from the peer's in-memory
state dict. The tokenizer is made here (tokenizer_json): byte-level, no merges, Whisper's special
tokens at their real ids, so every prompt and rule id is the real one (the text is nonsense).
End of text is made unreachable on both sides (its embedding row, which is also its LM head row, is
zero: its logit 0 while the largest of 51k random logits is well above), and both decode exactly the
task's token budget: ours with DecodeOptions.sample_len set to it (the one thing the benchmark
changes inside our decode), the peer with min_new_tokens = max_new_tokens.

Concurrency c: our `batch` (one encoder pass, rows decoding together); the peer's generate on the c
clips' features at once. Phases: log-mel, encoder; prefill: ours the cross-attention K/V and the
prompt's pass, the peer its first decoder call (which computes the cross K/V); decode the rest.
"""
from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import torch

import e2e_inputs
from e2e_family import Family, Task, hf_random
from e2e_phases import by_length, first_call
from families import hf_state, reading

AUDIO = (("5 s", 5.0, 16), ("30 s", 30.0, 96))    # input, seconds, transcript tokens
LANGUAGES = ("en zh de es ru ko fr ja pt tr pl ca nl ar sv it id hi fi vi he uk el ms cs ro da hu ta no th ur hr "
             "bg lt la mi ml cy sk te fa lv bn sr az sl kn et mk br eu is hy ne mn bs kk sq sw gl mr pa si km "
             "sn yo so af oc ka be tg sd gu am yi lo uz fo ht ps tk nn mt sa lb my bo tl mg as tt haw ln ha "
             "ba jw su").split()
SHAPES = {   # d_model, encoder layers, decoder layers, heads, mels, vocab
    "whisper-large-v3-turbo": (1280, 32, 4, 20, 128, 51866),
    "whisper-tiny.en": (384, 4, 4, 6, 80, 51864),
}


def tokenizer_json(folder: Path, n_vocab: int) -> dict[str, int]:
    """A Whisper tokenizer.json whose special tokens sit at the real ids for `n_vocab` (51864:
    English-only; more: multilingual, with yue), over a byte-level vocabulary without merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    multilingual = n_vocab > 51864
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    eot = 50257 if multilingual else 50256
    while len(vocab) < eot:
        vocab[f"Ġw{len(vocab)}"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    langs = LANGUAGES + (["yue"] if multilingual else [])
    specials = (["<|endoftext|>", "<|startoftranscript|>"] + [f"<|{code}|>" for code in langs]
                + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>",
                   "<|nospeech|>" if multilingual else "<|nocaptions|>", "<|notimestamps|>"]
                + [f"<|{i * 0.02:.2f}|>" for i in range(1501)])
    tok.add_special_tokens(specials)
    assert tok.get_vocab_size() == n_vocab, (tok.get_vocab_size(), n_vocab)
    tok.save(str(folder / "tokenizer.json"))
    return {s: tok.token_to_id(s) for s in specials[:2 + len(langs) + 6]}


class Whisper(Family):
    kind = "speech"
    peer_label = "transformers"

    @classmethod
    def tasks(cls) -> list[Task]:
        return [Task("transcribe", label, n) for label, _, n in AUDIO]

    def setup(self) -> None:
        from transformers import (GenerationConfig, WhisperConfig, WhisperFeatureExtractor,
                                  WhisperForConditionalGeneration)

        from photon_core.models.whisper import checkpoint as wckpt
        from photon_core.models.whisper import load_whisper
        d, enc, dec, heads, mels, vocab = SHAPES[self.name]
        if self.tiny:
            d, enc, dec, heads = 64, 2, 2, 2
        folder = Path(tempfile.mkdtemp(prefix=f"e2e-{self.name}-"))
        ids = tokenizer_json(folder, vocab)
        eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
        cfg = WhisperConfig(vocab_size=vocab, num_mel_bins=mels, d_model=d, encoder_layers=enc, decoder_layers=dec,
                            encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=4 * d,
                            decoder_ffn_dim=4 * d, max_source_positions=1500, max_target_positions=448,
                            pad_token_id=eot, bos_token_id=eot, eos_token_id=eot, decoder_start_token_id=sot)
        self.hf = hf = hf_random(WhisperForConditionalGeneration, cfg, self.dtype, self.device)
        with torch.no_grad():   # end of text unreachable (module docstring); its LM head row is this row
            hf.model.decoder.embed_tokens.weight[eot] = 0
        self.multilingual = vocab > 51864
        gc = GenerationConfig(decoder_start_token_id=sot, eos_token_id=eot, pad_token_id=eot, bos_token_id=eot,
                              no_timestamps_token_id=ids["<|notimestamps|>"], is_multilingual=self.multilingual,
                              task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
                              lang_to_id={f"<|{c}|>": ids[f"<|{c}|>"] for c in LANGUAGES},
                              suppress_tokens=[], begin_suppress_tokens=[], max_initial_timestamp_index=50,
                              max_length=448)
        hf.generation_config = gc
        cfg.save_pretrained(folder)
        (folder / "model.safetensors").write_bytes(b"")   # the format's marker; read_folder answers below
        with reading(wckpt, hf_state(hf)):
            # on the CPU its defaults (module docstring); an explicit dtype would be the exact path
            self.model = load_whisper(folder, device=str(self.device), backend=self.backend_name,
                                      dtype=None if self.device.type == "cpu" else self.dtype)
        if self.device.type == "cpu":
            self.notes.append(f"ours with its CPU defaults (context {self.model.audio_context}, "
                              f"quantize {self.model.quantize})")
        self.features = WhisperFeatureExtractor(feature_size=mels)
        self.sample_len = 0
        self._force_sample_len()
        c = self.sides["ours"].clock
        from photon_core.models.whisper import transcribe as wt
        c.add(wt, "log_mel_content", "preprocess")
        c.add(self.model, "encode", "encoder")
        c.add(self.model.net, "cross_kv", "prefill")
        c.add(self.model.net, "decode", classify=by_length("prefill", None, arg=0))
        p = self.sides["peer"].clock
        p.add(hf.model.encoder, None, "encoder")
        p.add(hf.model.decoder, None, classify=first_call("prefill", None))

    def _force_sample_len(self) -> None:
        """Our window decodes take `sample_len` tokens (the task's budget; see the module docstring)."""
        dec = self.model.decoder
        real_one, real_many = dec.decode, dec.decode_greedy_batch
        bench = self

        def one(features: Any, options: Any, cross: Any = None) -> Any:
            return real_one(features, dataclasses.replace(options, sample_len=bench.sample_len), cross)

        def many(cross: Any, options: Any) -> Any:
            return real_many(cross, dataclasses.replace(options, sample_len=bench.sample_len))
        dec.decode, dec.decode_greedy_batch = one, many

    def inputs(self, task: Task, n: int) -> list[Any]:
        seconds = dict((label, s) for label, s, _ in AUDIO)[task.input]
        return e2e_inputs.clips(seconds / 10 if self.tiny else seconds, n)   # dry run: a tenth

    def ours(self, task: Task, inputs: list[Any]) -> list[int | None]:
        from photon_core.runtime.requests import TranscribeRequest
        self.sample_len = task.tokens
        reqs = [TranscribeRequest(pcm, e2e_inputs.SAMPLE_RATE, "en", None,
                                  {"timestamps": True, "temperature": 0.0}) for pcm in inputs]
        self.model.batch(reqs)
        return [None] * len(inputs)

    def peer(self, task: Task, inputs: list[Any]) -> list[int | None]:
        c = self.sides["peer"].clock
        with c.phase("preprocess"):
            feats = self.features(inputs, sampling_rate=e2e_inputs.SAMPLE_RATE, return_tensors="pt")
        x = feats["input_features"].to(self.device, self.dtype)
        lang = dict(language="en", task="transcribe") if self.multilingual else {}
        with torch.inference_mode():   # exactly the budget: min_new_tokens = max_new_tokens
            self.hf.generate(x, max_new_tokens=task.tokens, min_new_tokens=task.tokens,
                             return_timestamps=True, do_sample=False, **lang)
        return [None] * len(inputs)

    def warm_bucket(self, batch: int) -> dict:
        steps = self.model.decoder.steps
        if steps is None or not hasattr(steps, "prepare"):
            return {"skipped": "no compiled steps on this backend"}
        steps.prepare(self.model.decoder, batch)
        return {"built": batch}


class WhisperTurbo(Whisper):
    name = "whisper-large-v3-turbo"


class WhisperTiny(Whisper):
    name = "whisper-tiny.en"
