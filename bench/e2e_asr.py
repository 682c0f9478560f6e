"""Parakeet TDT 0.6B v3 and Qwen3-ASR 0.6B in the end-to-end benchmark: 5 s and 30 s of audio, ours
against transformers (NeMo's and qwen-asr's own engines are not installed on the GPU host, and
nothing can be fetched there).

Weights: transformers' random init of the real shapes (bench/families.py's configs and their
sources), read by our loaders from the peer's in-memory state dict (`reading`). The same work on both
sides: Parakeet's joint head biased as in bench/families.py (the token logits lifted over the
durations, duration 0 ruled out: every frame emits one token and advances, so both greedy loops take
the same steps); Qwen3-ASR decodes the task's token budget (our stop ids emptied, the peer's
min_new_tokens), its speech gate off (random audio would be judged by a gate the peer lacks).
Concurrency c: our `batch` (one encoder pass over the clips, rows decoding together); the peer's
generate over the c clips at once.
"""
from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

import e2e_inputs
from e2e_family import Family, Task, hf_random
from families import hf_state, reading
from e2e_phases import by_length

SECONDS = {"5 s": 5.0, "30 s": 30.0}
FRONT_END = {"feature_size": 128, "sampling_rate": 16000, "padding_value": 0.0, "padding_side": "right",
             "return_attention_mask": True, "hop_length": 160, "n_fft": 512, "win_length": 400,
             "preemphasis": 0.97, "feature_extractor_type": "ParakeetFeatureExtractor"}


class Parakeet(Family):
    name = "parakeet-tdt-0.6b"
    kind = "speech"
    peer_label = "transformers"

    @classmethod
    def tasks(cls) -> list[Task]:
        # No budget to set: greedy TDT emits as the frames go (12.5 a second, a token every 1-4
        # frames with duration 0 ruled out); `tokens` is the frames' count, for the plan.
        return [Task("transcribe", label, int(s * 12.5)) for label, s in SECONDS.items()]

    def setup(self) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import ParakeetFeatureExtractor, ParakeetForTDT, ParakeetTDTConfig

        from photon_core.models.parakeet import checkpoint as pckpt
        from photon_core.models.parakeet import load_parakeet
        enc: dict[str, Any] = dict(num_mel_bins=128)
        if self.tiny:
            enc.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                       subsampling_conv_channels=16)
        cfg = ParakeetTDTConfig(encoder_config=enc)
        self.hf = hf = hf_random(ParakeetForTDT, cfg, self.dtype, self.device)
        V = cfg.vocab_size
        with torch.no_grad():
            hf.joint.head.bias[:V] += 1000.0
            hf.joint.head.bias[V] -= 1000.0
        hf.generation_config.decoder_start_token_id = cfg.blank_token_id
        folder = Path(tempfile.mkdtemp(prefix="e2e-parakeet-"))
        cfg.save_pretrained(folder)
        (folder / "model.safetensors").write_bytes(b"")
        # The front end's settings as transformers' ParakeetFeatureExtractor saves them (its
        # defaults, written here: under transformers 5.17, the GPU host's, that class needs librosa,
        # which the host lacks, and then the peer cannot run, but ours can).
        (folder / "preprocessor_config.json").write_text(json.dumps(FRONT_END))
        try:
            self.fe = ParakeetFeatureExtractor(**{k: v for k, v in FRONT_END.items() if k != "feature_extractor_type"})
        except ImportError as e:
            self.skip_peer(f"transformers' ParakeetFeatureExtractor cannot be built here ({str(e).strip()[:90]})")
        pieces = ["<unk>", "\u2581"] + [f"\u2581w{i}" for i in range(V - 3)]
        tok = Tokenizer(models.Unigram([(p, -float(i)) for i, p in enumerate(pieces)], unk_id=0))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        tok.save(str(folder / "tokenizer.json"))
        with reading(pckpt, hf_state(hf)):
            self.model = load_parakeet(folder, device=str(self.device), dtype=self.dtype, backend=self.backend_name)
        c = self.sides["ours"].clock
        c.add(type(self.model.mel), "__call__", "preprocess")   # the LogMel front end, called per clip
        c.add(self.model.model, "encode", "encoder")
        c.add(self.model.model, "project_encoder", "encoder")
        p = self.sides["peer"].clock
        p.add(hf.encoder, None, "encoder")

    def inputs(self, task: Task, n: int) -> list[Any]:
        return e2e_inputs.clips(SECONDS[task.input] / (10 if self.tiny else 1), n)   # dry run: a tenth

    def ours(self, task: Task, inputs: list[Any]) -> list[int | None]:
        from photon_core.runtime.requests import TranscribeRequest
        out = self.model.batch([TranscribeRequest(pcm, e2e_inputs.SAMPLE_RATE) for pcm in inputs])
        return [len(r.get("tokens", [])) or None for r in out]

    def peer(self, task: Task, inputs: list[Any]) -> list[int | None]:
        c = self.sides["peer"].clock
        with c.phase("preprocess"):
            feats = self.fe(inputs, sampling_rate=e2e_inputs.SAMPLE_RATE, return_tensors="pt")
        feats = {k: v.to(self.device) for k, v in feats.items()}
        feats["input_features"] = feats["input_features"].to(self.dtype)
        with torch.inference_mode():
            out = self.hf.generate(**feats)
        seq = out.sequences[:, 1:] if hasattr(out, "sequences") else out[:, 1:]
        cfg = self.hf.config
        return [int(((s != cfg.blank_token_id) & (s != cfg.pad_token_id)).sum()) for s in seq]


class Qwen3ASR(Family):
    name = "qwen3-asr-0.6b"
    kind = "speech"
    peer_label = "transformers"

    @classmethod
    def tasks(cls) -> list[Task]:
        return [Task("transcribe", "5 s", 32), Task("transcribe", "30 s", 96)]

    def setup(self) -> None:
        from transformers import Qwen3ASRForConditionalGeneration

        from families import qwen3_asr_parts
        from photon_core.models.qwen3_asr import checkpoint as qckpt
        from photon_core.models.qwen3_asr import decoder as qdecoder
        from photon_core.models.qwen3_asr import load_qwen3_asr
        # bench/families.py's Qwen3-ASR 0.6B (its sources there); tiny: its smoke sizes
        cfg, self.processor = qwen3_asr_parts(smoke=self.tiny)
        self.hf = hf = hf_random(Qwen3ASRForConditionalGeneration, cfg, self.dtype, self.device)
        folder = Path(tempfile.mkdtemp(prefix="e2e-qwen3-asr-"))
        cfg.save_pretrained(folder)
        self.processor.save_pretrained(folder)
        with reading(qckpt, hf_state(hf)):
            self.model = load_qwen3_asr(folder, device=str(self.device), dtype=self.dtype, backend=self.backend_name)
        self.model.config = dataclasses.replace(self.model.config, eos_token_ids=(-1,))   # the full budget
        c = self.sides["ours"].clock
        c.add(self.model, "features", "preprocess")
        c.add(self.model.encoder, "encode_many", "encoder")
        c.add(qdecoder.TextDecoder, "prefill", "prefill")
        p = self.sides["peer"].clock
        for name in ("audio_tower", "multi_modal_projector"):
            m = getattr(hf.model, name, None) or getattr(hf, name, None)
            if m is not None:
                p.add(m, None, "encoder")
        lm = getattr(hf.model, "language_model", None)
        if lm is not None:
            p.add(lm, None, classify=by_length("prefill", None, key="inputs_embeds"))

    def inputs(self, task: Task, n: int) -> list[Any]:
        return e2e_inputs.clips(SECONDS[task.input] / (10 if self.tiny else 1), n)   # dry run: a tenth

    def ours(self, task: Task, inputs: list[Any]) -> list[int | None]:
        from photon_core.runtime.requests import TranscribeRequest
        opts = {"max_new_tokens": task.tokens, "speech_gate": False}
        self.model.batch([TranscribeRequest(pcm, e2e_inputs.SAMPLE_RATE, "en", None, opts) for pcm in inputs])
        return [None] * len(inputs)

    def peer(self, task: Task, inputs: list[Any]) -> list[int | None]:
        c = self.sides["peer"].clock
        with c.phase("preprocess"):
            batch = self.processor.apply_transcription_request(audio=list(inputs), language=["en"] * len(inputs))
        batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        if "input_features" in batch:
            batch["input_features"] = batch["input_features"].to(self.dtype)
        n = batch["input_ids"].shape[1]
        with torch.inference_mode():
            out = self.hf.generate(**batch, max_new_tokens=task.tokens, min_new_tokens=task.tokens, do_sample=False)
        return [int(x) for x in torch.full((out.shape[0],), out.shape[1] - n)]
