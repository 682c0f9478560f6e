"""Qwen 3.5 0.8B and Gemma 4 E2B in the end-to-end benchmark: caption (normal) and query on the 756x756
image and the 1920x1080 frame, ours against transformers' `generate`.

Weights: transformers' own random init of the real shapes (bench/families.py's configs: published
sizes, sources there), read by our loader through its renaming and checks from the peer's in-memory
state dict (`reading`), so both sides hold the same values. Ours decodes the full budget (its stop
ids emptied), the peer the same (min_new_tokens = max_new_tokens), greedy. The peer gets the same
prompt ids ours builds (our chat template and image-token expansion) and its own image processor.

Peer settings: a static KV cache (cache_implementation="static") without torch.compile
(disable_compile: generate would otherwise compile the step on CUDA, minutes a shape); the
`+compile` peer leaves generate's own compilation on. A model whose cache cannot be static (Qwen
3.5's DeltaNet layers keep a recurrent state) runs the default cache, and the note says so.
Concurrency c: one `generate` over the c requests (same-size images: same prompt lengths, no padding).
"""
from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from abc import abstractmethod
from typing import Any

import torch

import e2e_inputs
from e2e_family import Family, Task, hf_random
from e2e_moondream import SIZES
from e2e_phases import by_length
from families import hf_state, reading

SKILLS = (("caption", 32), ("query", 16))
QUESTION = "What is the robot holding?"


def tasks() -> list[Task]:
    return [Task(skill, size, n) for size in SIZES for skill, n in SKILLS]


class HFVision(Family):
    """What Qwen 3.5 and Gemma 4 share: the HF peer's batched generate and hooks."""
    kind = "vision"
    peer_label = "transformers"
    hf: Any

    @classmethod
    def tasks(cls) -> list[Task]:
        return tasks()

    def inputs(self, task: Task, n: int) -> list[bytes]:
        h, w = SIZES[task.input] if not self.tiny else (96, 96) if task.input == "756x756" else (72, 128)
        return e2e_inputs.frames(h, w, n)

    def hook_peer(self, vision_modules: list[Any]) -> None:
        c = self.sides["peer"].clock
        for m in vision_modules:
            c.add(m, None, "encoder")
        # the decoder stack: its first (long) call is the prefill; single-token calls are decode
        c.add(self.hf.model.language_model, None, classify=by_length("prefill", None, key="inputs_embeds"))

    def generate(self, kwargs: dict, n_tok: int) -> Any:
        gen = dict(max_new_tokens=n_tok, min_new_tokens=n_tok, do_sample=False)
        if self.static_cache:
            gen["cache_implementation"] = "static"
        if not self.peer_compiled:
            gen["disable_compile"] = True
        with torch.inference_mode():
            return self.hf.generate(**kwargs, **gen)

    def try_static(self, kwargs: dict) -> None:
        """Whether generate takes a static cache for this model (one short call); else the default
        cache, noted."""
        self.static_cache = True
        try:
            self.generate(kwargs, 2)
        except Exception as e:  # noqa: BLE001  transformers refuses in several ways
            self.static_cache = False
            self.sides["peer"].notes.append(f"default cache: a static cache was refused "
                                            f"({type(e).__name__}: {str(e)[:120]})")

    def ours(self, task: Task, inputs: list[bytes]) -> list[int]:
        from photon_core.runtime.requests import Request
        c = self.sides["ours"].clock
        with c.phase("decode_image"):
            rgbs = [e2e_inputs.decode_jpeg(b) for b in inputs]
        arg = "normal" if task.skill == "caption" else QUESTION
        reqs = [Request(task.skill, rgb, arg, max_tokens=task.tokens, temperature=0.0) for rgb in rgbs]
        return [self.count(r["caption" if task.skill == "caption" else "answer"]) for r in self.model.batch(reqs)]

    def peer(self, task: Task, inputs: list[bytes]) -> list[int]:
        kwargs, n = self.peer_inputs(task, inputs)
        out = self.generate(kwargs, task.tokens)
        return [int(x) for x in (out[:, n:] != -1).sum(1)]

    def pixels(self, inputs: list[bytes]) -> Any:
        """The peer's side of an image: JPEG decoded, then its processor, each phase on its clock."""
        c = self.sides["peer"].clock
        with c.phase("decode_image"):
            rgbs = [e2e_inputs.decode_jpeg(b) for b in inputs]
        with c.phase("preprocess"):
            return self.processor(images=rgbs, return_tensors="pt")

    @abstractmethod
    def peer_inputs(self, task: Task, inputs: list[bytes]) -> tuple[dict, int]:
        """generate's keyword arguments for the requests, and the prompt's length."""

    @abstractmethod
    def count(self, text: str) -> int:
        """Tokens of an answer, by our tokenizer."""


class Qwen35(HFVision):
    name = "qwen3.5-0.8b"

    def setup(self) -> None:
        from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

        import test_qwen3_5_fixtures as fx
        from photon_core.models.qwen3_5 import load_qwen3_5
        from photon_core.models.qwen3_5 import weights as qweights
        folder = Path(tempfile.mkdtemp(prefix="e2e-qwen35-"))
        ids = fx.build_tokenizer(folder)
        # bench/families.py's Qwen 3.5 0.8B (its sources there); tiny: its smoke sizes, 4 layers
        layers = 4 if self.tiny else 24
        text = dict(vocab_size=248320, num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                    head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                    linear_conv_kernel_dim=4,
                    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
                    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                         mrope_section=[11, 11, 10], mrope_interleaved=True),
                    max_position_embeddings=262144, eos_token_id=ids["<|im_end|>"], tie_word_embeddings=True,
                    hidden_size=1024, intermediate_size=3584, linear_num_value_heads=16)
        vision = dict(patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=1024,
                      num_position_embeddings=2304, depth=12, hidden_size=768, intermediate_size=3072, num_heads=12)
        if self.tiny:
            text.update(hidden_size=128, intermediate_size=256, vocab_size=fx.VOCAB, head_dim=32,
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16)
            vision.update(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128)
        cfg = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                            video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                            vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)
        self.cfg, self.ids = cfg, ids
        self.hf = hf_random(Qwen3_5ForConditionalGeneration, cfg, self.dtype, self.device)
        cfg.save_pretrained(folder)
        size = {"shortest_edge": 65536, "longest_edge": 16777216}
        (folder / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "temporal_patch_size": 2,
            "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "size": size}))
        with reading(qweights, hf_state(self.hf)):
            self.model = load_qwen3_5(folder, device=self.device, dtype=self.dtype, backend=self.ops())
        self.model.prompts.stop_ids = frozenset()      # the full budget, as min_new_tokens
        from transformers import Qwen2VLImageProcessorPil
        self.processor = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2,
                                                  image_mean=[0.5] * 3, image_std=[0.5] * 3, size=size)
        from photon_core.models.qwen3_5 import text as qtext
        from photon_core.models.qwen3_5 import vision as qvision
        c = self.sides["ours"].clock
        c.add(qvision, "preprocess", "preprocess")
        c.add(self.model, "_positions", "encoder")
        c.add(self.model, "encode_patches", "encoder")   # eager or replayed (runtime/shape_graphs)
        c.add(qtext, "prefill", "prefill")
        if self.with_peer:
            self.hook_peer([self.hf.model.visual])
            self.try_static(self.peer_inputs(Task("caption", "756x756", 2), e2e_inputs.frames(64, 64, 1))[0])

    def peer_inputs(self, task: Task, inputs: list[bytes]) -> tuple[dict, int]:
        from photon_core.models.qwen3_5 import prompt
        px = self.pixels(inputs)
        count = int(px["image_grid_thw"][0].prod()) // 4
        q = prompt.CAPTION_PROMPTS["normal"] if task.skill == "caption" else QUESTION
        one = prompt.expand_images(self.model.prompts.chat_ids(q, with_image=True), self.cfg.image_token_id, [count])
        ids = torch.tensor([one] * len(inputs), device=self.device)
        kwargs = dict(input_ids=ids, pixel_values=px["pixel_values"].to(self.device, self.dtype),
                      image_grid_thw=px["image_grid_thw"].to(self.device),
                      pad_token_id=self.ids["<|endoftext|>"])
        if _takes(self.hf, "mm_token_type_ids"):
            kwargs["mm_token_type_ids"] = (ids == self.cfg.image_token_id).int()
        return kwargs, ids.shape[1]

    def count(self, text: str) -> int:
        return len(self.model.prompts.tokenizer.encode(text, add_special_tokens=False).ids)


class Gemma4(HFVision):
    name = "gemma4-e2b"

    @classmethod
    def cpu_dtype(cls) -> str | None:
        # 4.6 B parameters without the audio tower: in float32 both sides' copies would not fit a
        # 24 GB machine (bench/families.py measures it in bfloat16 too).
        return "bf16"

    def setup(self) -> None:
        from transformers import Gemma4Config, Gemma4ForConditionalGeneration
        from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

        import test_gemma4_fixtures as fx
        from photon_core.models.gemma4 import load_gemma4
        from photon_core.models.gemma4 import text as gtext
        from photon_core.models.gemma4 import vision as gvision
        from photon_core.models.gemma4 import weights as gweights
        # bench/families.py's Gemma 4 E2B (google/gemma-4-E2B-it's config; sources there), no audio
        # tower; tiny: its smoke sizes
        layers = 10 if self.tiny else 35
        text = dict(vocab_size=262144, hidden_size=1536, intermediate_size=6144, num_hidden_layers=layers,
                    num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
                    sliding_window=512, layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * (layers // 5),
                    vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256,
                    num_kv_shared_layers=5 if self.tiny else 20, use_double_wide_mlp=True,
                    final_logit_softcapping=30.0, max_position_embeddings=131072, rope_parameters={
                        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6,
                                           "rope_type": "proportional"},
                        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
                    pad_token_id=fx.PAD, eos_token_id=fx.EOS, bos_token_id=fx.BOS, tie_word_embeddings=True)
        vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                      num_key_value_heads=12, head_dim=64, patch_size=16, pooling_kernel_size=3,
                      position_embedding_size=10240, use_clipped_linears=True, standardize=False)
        if self.tiny:
            text.update(vocab_size=4096, vocab_size_per_layer_input=4096, hidden_size=128, intermediate_size=256,
                        head_dim=32, global_head_dim=64, hidden_size_per_layer_input=32)
            vision.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                          num_key_value_heads=2, head_dim=32)
        cfg = Gemma4Config(text_config=text, vision_config=vision, audio_config=None, image_token_id=fx.IMAGE,
                           boi_token_id=fx.BOI, eoi_token_id=fx.EOI, video_token_id=fx.VIDEO,
                           audio_token_id=fx.AUDIO, boa_token_id=fx.BOA, eoa_token_index=fx.EOA,
                           tie_word_embeddings=True)
        self.pad = fx.PAD
        self.hf = hf_random(Gemma4ForConditionalGeneration, cfg, self.dtype, self.device)
        folder = Path(tempfile.mkdtemp(prefix="e2e-gemma4-"))
        cfg.save_pretrained(folder)
        fx.write_tokenizer(folder)
        soft = 280
        (folder / "processor_config.json").write_text(json.dumps(
            {"image_processor": {"max_soft_tokens": soft, "patch_size": 16, "pooling_kernel_size": 3}}))
        with reading(gweights, hf_state(self.hf)):
            self.model = load_gemma4(folder, device=self.device, dtype=self.dtype, backend=self.ops())
        self.model.eos_ids = frozenset()           # the full budget, as min_new_tokens
        self.processor = Gemma4ImageProcessorPil(patch_size=16, max_soft_tokens=soft, pooling_kernel_size=3)
        c = self.sides["ours"].clock
        c.add(gvision, "patchify", "preprocess")
        c.add(gvision, "pool_groups", "encoder")
        c.add(self.model, "encode_patches", "encoder")   # eager or replayed (runtime/shape_graphs)
        c.add(gvision, "project", "encoder")
        c.add(gtext, "prefill", "prefill")
        if self.with_peer:
            m = self.hf.model
            self.hook_peer([x for x in (getattr(m, "vision_tower", None), getattr(m, "embed_vision", None))
                            if x is not None])
            self.try_static(self.peer_inputs(Task("caption", "756x756", 2), e2e_inputs.frames(64, 64, 1))[0])

    def peer_inputs(self, task: Task, inputs: list[bytes]) -> tuple[dict, int]:
        from photon_core.models.gemma4.model import caption_question
        px = self.pixels(inputs)
        n_soft = int(px["num_soft_tokens_per_image"][0])
        q = caption_question("normal") if task.skill == "caption" else QUESTION
        ids = torch.tensor([self.model.prompter.prompt_ids(q, n_soft)] * len(inputs), device=self.device)
        kwargs = dict(input_ids=ids, pixel_values=px["pixel_values"].to(self.device, self.dtype),
                      image_position_ids=px["image_position_ids"].to(self.device), pad_token_id=self.pad)
        return kwargs, ids.shape[1]

    def count(self, text: str) -> int:
        return len(self.model.prompter.encode(text))


def _takes(model: Any, name: str) -> bool:
    """Whether the model's forward names this argument (transformers versions differ)."""
    import inspect
    return name in inspect.signature(model.forward).parameters
