"""CPU speed of the new families against transformers, on random weights of the real shapes.

    python bench/families.py [--only NAME] [--repeats N] [--write]

NAME: qwen3_5-0.8b, parakeet, qwen3_asr, moondream3, qwen3_5-2b, gemma4-e2b (default: all, in that
order; with --write the section is rewritten after each case, so a cut-off run leaves its figures). Every case runs in its own process (so the memory of one is freed before the next), with
torch.set_num_threads(2). Inside a case, ours (the reference backend) and transformers 5.24 run on
the SAME weights (our loader reads transformers' in-memory state dict through its own renaming and
checks; nothing is written to disk except configs and tokenizers), their repeats interleaved
(ours, peer, peer, ours, ...) after one untimed warm-up each; medians are reported. Random weights
decode garbage and may stop at once: both sides are made to decode the same number of tokens (end
of sequence ignored: our stop ids emptied, transformers' min_new_tokens = max_new_tokens); the
token counts are printed with each figure.

Cases (real shapes; sources of each config are printed with its figure):
- Qwen 3.5 0.8B / 2B: caption of a 640x480 image, 32 tokens, float32; ours `caption()` (image
  preprocessing included) vs the Qwen2-VL image processor + `generate()`.
- Gemma 4 E2B: the same task in bfloat16 on both sides (float32 weights, 4.6 B parameters without
  the audio tower, would take 18 GB of the machine's 23 GB).
- Parakeet TDT 0.6B v3: 5 s and 60 s of espeak-ng speech (repeated to 60 s), `transcribe()` vs
  the feature extractor + `generate()` (TDT greedy: the token count follows the frames, not a
  budget, and is printed for both); encoder time per second of audio.
- Qwen3-ASR 0.6B: the same audio, 32 (5 s) and 96 (60 s) forced tokens, `transcribe()` vs the
  processor + `generate()`; encoder time per second of audio.
- Moondream 3.1 9B-A2B (no transformers peer): our decode time per token with random FP8 experts
  (dequantized by our loader's FP8 path) at the real layer shapes but 5 layers (1 dense + 4 MoE,
  ~7 GB in float32 instead of 37 GB); per-layer times scaled to the real 4 dense + 20 MoE layers.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "test"))
sys.path.insert(0, str(ROOT / "bench"))

THREADS = 2
FIRST: dict = {}
# Timed repeats per case unless --repeats says otherwise: the 2B-class cases take minutes a call here.
REPEATS = {"qwen3_5-2b": 2, "gemma4-e2b": 2}
# the 2B-class cases last: a run cut short still leaves the others
CASES = ["qwen3_5-0.8b", "parakeet", "qwen3_asr", "moondream3", "qwen3_5-2b", "gemma4-e2b"]


# ----------------------------------------------------------------------------------------- common


def scratch(prefix: str) -> Path:
    """A temporary folder (configs, tokenizers, the speech checkpoints), removed at exit."""
    import atexit
    import shutil

    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def available_gib() -> float:
    return int(re.search(r"MemAvailable:\s*(\d+)", Path("/proc/meminfo").read_text()).group(1)) / 2**20


def interleaved(ours, peer, repeats: int, warm: bool = True) -> tuple[list[float], list[float]]:
    """Seconds per call of each, after one untimed warm-up each (warm) or none (calls of a minute
    or more on this machine: the median absorbs first-call costs); repeats alternate which goes
    first. The first timed call's results are kept in FIRST["ours"] / FIRST["peer"]."""
    if warm:
        ours()
        if peer is not None:
            peer()
    a, b = [], []
    FIRST.clear()
    for r in range(repeats):
        order = [(ours, a), (peer, b)] if r % 2 == 0 else [(peer, b), (ours, a)]
        for fn, out in order:
            if fn is None:
                continue
            t = time.perf_counter()
            result = fn()
            out.append(time.perf_counter() - t)
            FIRST.setdefault("ours" if fn is ours else "peer", result)
        print(f"    repeat {r + 1}/{repeats}: ours {a[-1]:.2f} s" + (f", transformers {b[-1]:.2f} s" if b else ""),
              flush=True)
    return a, b


def row(model: str, task: str, ours: list[float], peer: list[float] | None, note: str, unit: str = "s") -> dict:
    """One table row: medians, and every repeat in the note (the machine is noisy: the spread says
    how far to trust a ratio)."""
    if len(ours) > 1:
        each = ", ".join(f"{x:.3g}" for x in ours)
        note += f"; each repeat, ours {each}" + (f" / transformers {', '.join(f'{x:.3g}' for x in peer)}" if peer else "")
    return {"model": model, "task": task, "ours": statistics.median(ours), "peer": statistics.median(peer) if peer else None,
            "n": len(ours), "note": note, "unit": unit}


@contextlib.contextmanager
def reading(module, state: dict):
    """Our loader's `read_folder` answering with an in-memory state dict (transformers' tensors):
    the rest of the loader (renaming, checks, casts, fusions) runs as on a checkpoint folder, and
    tensors it does not change are shared with the peer instead of held twice."""
    real = module.read_folder
    module.read_folder = lambda folder, *a, **k: dict(state)
    try:
        yield
    finally:
        module.read_folder = real


def hf_state(model) -> dict:
    """What save_pretrained would write: the state dict without the tied copies."""
    sd = model.state_dict()
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(model.config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    return sd


def image_640x480() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=(480, 640, 3), dtype=np.uint8)


def hf_random(cls, cfg, dtype=torch.float32):
    """transformers' model with its own random init, in `dtype` from the start (no float32 copy)."""
    torch.manual_seed(0)
    t = time.perf_counter()
    model = cls._from_config(cfg, dtype=dtype).eval()
    n = sum(p.numel() for p in model.parameters())
    print(f"  built {cls.__name__} ({n / 1e9:.2f} B parameters, {dtype}) in {time.perf_counter() - t:.0f} s",
          flush=True)
    return model, n


# ----------------------------------------------------------------------------------------- Qwen 3.5

# Published Qwen/Qwen3.5-0.8B and -2B configs (no hub access here): text sizes of the 0.8B as in
# THUDM/slime scripts/models/qwen3.5-0.8B.sh (24 layers, 1024, ffn 3584, 8 heads / 2 KV of 256,
# rotary 25%, theta 1e7, tied); the 2B's hidden size 2048 as public notes give it; the rest (2B ffn
# 6144, linear-attention heads 16 x 128 keys / 16 x 128 values, vision towers) as published to our
# best knowledge; the layer pattern 3 DeltaNet : 1 attention and the mrope section [11, 11, 10] as in
# the larger Qwen 3.5 configs; vocab 248320 (transformers' Qwen3_5TextConfig default).
QWEN = {
    "qwen3_5-0.8b": dict(text=dict(hidden_size=1024, intermediate_size=3584, linear_num_value_heads=16),
                         vision=dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12)),
    "qwen3_5-2b": dict(text=dict(hidden_size=2048, intermediate_size=6144, linear_num_value_heads=16),
                       vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16)),
}


def qwen3_5(name: str, repeats: int, smoke: bool) -> list[dict]:
    from transformers import Qwen2VLImageProcessorPil, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    import test_qwen3_5_fixtures as fx
    from photon_core.models.qwen3_5 import generate, load_qwen3_5, prompt
    from photon_core.models.qwen3_5 import weights as qweights

    spec = QWEN[name]
    folder = scratch(f"bench-{name}-")
    ids = fx.build_tokenizer(folder)
    layers = 4 if smoke else 24
    text = dict(vocab_size=248320, num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_conv_kernel_dim=4, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
                rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                     mrope_section=[11, 11, 10], mrope_interleaved=True),
                max_position_embeddings=262144, eos_token_id=ids["<|im_end|>"], tie_word_embeddings=True,
                **spec["text"])
    vision = dict(patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=text["hidden_size"],
                  num_position_embeddings=2304, **spec["vision"])
    if smoke:
        text.update(hidden_size=256, intermediate_size=512, vocab_size=4096)
        vision.update(depth=2, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=256)
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)
    hf, n_params = hf_random(Qwen3_5ForConditionalGeneration, cfg)
    cfg.save_pretrained(folder)
    size = {"shortest_edge": 65536, "longest_edge": 16777216}
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "size": size}))
    with reading(qweights, hf_state(hf)):
        ours = load_qwen3_5(folder)
    ours.prompts.stop_ids = frozenset()          # decode the full budget, as min_new_tokens does
    img = image_640x480()
    question = prompt.CAPTION_PROMPTS["normal"]
    n_tok = 8 if smoke else 32
    processor = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2,
                                         image_mean=[0.5] * 3, image_std=[0.5] * 3, size=size)

    def peer_ids():
        inputs = processor(images=[img], return_tensors="pt")
        count = int(inputs["image_grid_thw"][0].prod()) // 4
        pids = torch.tensor([prompt.expand_images(ours.prompts.chat_ids(question, with_image=True),
                                                  cfg.image_token_id, [count])])
        with torch.no_grad():
            out = hf.generate(input_ids=pids, pixel_values=inputs["pixel_values"],
                              image_grid_thw=inputs["image_grid_thw"],
                              mm_token_type_ids=(pids == cfg.image_token_id).int(), max_new_tokens=n_tok,
                              min_new_tokens=n_tok, do_sample=False, pad_token_id=ids["<|endoftext|>"])
        return out[0, pids.shape[1]:].tolist(), pids.shape[1]

    def ours_ids():
        # what caption() runs: preprocess + vision + prefill, greedy tokens, text
        state, logits = ours.prefill(img, question, n_tok)
        toks = list(generate.tokens(ours, state, logits, generate.Sampling(n_tok)))
        ours.prompts.decode(toks)
        return toks

    a, b = interleaved(ours_ids, peer_ids, repeats, warm=False)
    our_toks, (peer_toks, prompt_len) = FIRST["ours"], FIRST["peer"]
    same = next((i for i, (x, y) in enumerate(zip(our_toks, peer_toks)) if x != y), min(len(our_toks), len(peer_toks)))
    print(f"  prompt {prompt_len} tokens; tokens ours {len(our_toks)}, transformers {len(peer_toks)}, "
          f"identical for the first {same}", flush=True)
    note = (f"{n_params / 1e9:.2f} B params fp32; prompt {prompt_len} tokens (image 640x480); "
            f"{len(our_toks)} / {len(peer_toks)} tokens decoded, greedy, identical for the first {same}")
    return [row(f"Qwen 3.5 {name.split('-')[1].upper()}", f"caption 640x480, {n_tok} tokens", a, b, note)]


# ----------------------------------------------------------------------------------------- Gemma 4

def gemma4(repeats: int, smoke: bool) -> list[dict]:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    import test_gemma4_fixtures as fx
    from photon_core.models.gemma4 import load_gemma4
    from photon_core.models.gemma4 import weights as gweights
    from photon_core.models.gemma4.model import caption_question

    # google/gemma-4-E2B-it as its config.json is copied in public third-party test fixtures
    # (text 35 layers x 1536, 8 heads / 1 KV of 256, global heads 512, 4 sliding : 1 full, window
    # 512, 20 KV-shared layers with double-wide MLPs, per-layer inputs 256, softcap 30; vision 16 x
    # 768, patch 16, pooling 3). The audio tower is left out (not used for captions).
    layers = 10 if smoke else 35
    text = dict(vocab_size=262144, hidden_size=1536, intermediate_size=6144, num_hidden_layers=layers,
                num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
                sliding_window=512, layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * (layers // 5),
                vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256,
                num_kv_shared_layers=5 if smoke else 20, use_double_wide_mlp=True, final_logit_softcapping=30.0,
                max_position_embeddings=131072, rope_parameters={
                    "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
                    "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
                pad_token_id=fx.PAD, eos_token_id=fx.EOS, bos_token_id=fx.BOS, tie_word_embeddings=True)
    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                  num_key_value_heads=12, head_dim=64, patch_size=16, pooling_kernel_size=3,
                  position_embedding_size=10240, use_clipped_linears=True, standardize=False)
    if smoke:
        text.update(vocab_size=4096, vocab_size_per_layer_input=4096, hidden_size=256, intermediate_size=512)
        vision.update(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                      num_key_value_heads=2)
    cfg = Gemma4Config(text_config=text, vision_config=vision, audio_config=None, image_token_id=fx.IMAGE,
                       boi_token_id=fx.BOI, eoi_token_id=fx.EOI, video_token_id=fx.VIDEO, audio_token_id=fx.AUDIO,
                       boa_token_id=fx.BOA, eoa_token_index=fx.EOA, tie_word_embeddings=True)
    need = 14 if not smoke else 1
    if available_gib() < need:
        raise MemoryError(f"Gemma 4 E2B in bf16 needs about {need} GiB free here (peer + our fused copies); "
                          f"{available_gib():.1f} GiB available")
    dtype = torch.bfloat16
    hf, n_params = hf_random(Gemma4ForConditionalGeneration, cfg, dtype)
    folder = scratch("bench-gemma4-")
    cfg.save_pretrained(folder)
    fx.write_tokenizer(folder)
    soft = 280
    (folder / "processor_config.json").write_text(json.dumps(
        {"image_processor": {"max_soft_tokens": soft, "patch_size": 16, "pooling_kernel_size": 3}}))
    with reading(gweights, hf_state(hf)):
        ours = load_gemma4(folder, dtype=dtype)
    ours.eos_ids = ()                             # decode the full budget, as min_new_tokens does
    img = image_640x480()
    n_tok = 8 if smoke else 32
    question = caption_question("normal")
    proc = Gemma4ImageProcessorPil(patch_size=16, max_soft_tokens=soft, pooling_kernel_size=3)

    def peer():
        px = proc(images=[img], return_tensors="pt")
        n_soft = int(px["num_soft_tokens_per_image"][0])
        pids = torch.tensor([ours.prompter.prompt_ids(question, n_soft)])
        with torch.no_grad():
            out = hf.generate(input_ids=pids, pixel_values=px["pixel_values"].to(dtype),
                              image_position_ids=px["image_position_ids"], max_new_tokens=n_tok,
                              min_new_tokens=n_tok, do_sample=False, pad_token_id=fx.PAD)
        return out[0, pids.shape[1]:].tolist(), pids.shape[1]

    a, b = interleaved(lambda: ours.caption(img, settings={"temperature": 0, "max_tokens": n_tok}), peer, repeats,
                       warm=False)
    peer_toks, prompt_len = FIRST["peer"]
    print(f"  prompt {prompt_len} tokens; transformers decoded {len(peer_toks)} tokens", flush=True)
    note = (f"{n_params / 1e9:.2f} B params bf16 (no audio tower) on both sides; prompt {prompt_len} tokens "
            f"({soft} soft image tokens); {n_tok} tokens decoded by each, greedy, end of sequence ignored")
    return [row("Gemma 4 E2B", f"caption 640x480, {n_tok} tokens", a, b, note)]


# ----------------------------------------------------------------------------------------- speech

def speech_audio(seconds: float) -> np.ndarray:
    """16 kHz float32 espeak-ng speech, sentences concatenated (with 0.3 s gaps) up to `seconds`."""
    from photon_core.models.parakeet.frontend import prepare_audio
    from speech_audio import espeak_pcm

    sentences = ["Turn on the kitchen lights and move the robot arm to the left.",
                 "The quick brown fox jumps over the lazy dog near the river bank.",
                 "Please bring me the red cup from the table in the living room."]
    parts, total, i = [], 0, 0
    while total < seconds * 16000:
        pcm, rate = espeak_pcm(sentences[i % len(sentences)])
        pcm = prepare_audio(pcm, rate, 16000)
        parts += [pcm, np.zeros(4800, np.float32)]
        total += len(pcm) + 4800
        i += 1
    return np.concatenate(parts)[:int(seconds * 16000)].astype(np.float32)


def parakeet(repeats: int, smoke: bool) -> list[dict]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import ParakeetFeatureExtractor, ParakeetForTDT, ParakeetTDTConfig

    from photon_core.models.parakeet import load_parakeet

    # nvidia/parakeet-tdt-0.6b-v3: transformers' ParakeetEncoderConfig / ParakeetTDTConfig defaults
    # (24 x 1024 FastConformer, 8 heads, ffn 4096, kernel 9, 8x subsampling with 256 channels;
    # LSTM 2 x 640; 8192 tokens + blank; durations 0-4), with v3's 128 mel bins.
    enc = dict(num_mel_bins=128)
    if smoke:
        enc.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                   subsampling_conv_channels=16)
    cfg = ParakeetTDTConfig(encoder_config=enc)
    hf, n_params = hf_random(ParakeetForTDT, cfg)
    V = cfg.vocab_size
    with torch.no_grad():
        # transformers' generate picks the token by argmax over tokens AND durations; lifting the
        # token logits makes both sides read the same token (no argmax within a part changes).
        hf.joint.head.bias[:V] += 1000.0
        # Random weights often pick duration 0 for a token, and the two greedy loops bound runs of
        # such emissions differently (transformers ran to its 10-symbols-per-frame limit where we
        # stopped): duration 0 is ruled out, so every step advances and both do the same steps.
        hf.joint.head.bias[V] -= 1000.0
    hf.generation_config.decoder_start_token_id = cfg.blank_token_id
    folder = scratch("bench-parakeet-")
    hf.save_pretrained(folder)                    # 2.4 GB; the .safetensors is read back memory-mapped
    fe = ParakeetFeatureExtractor(feature_size=128)
    fe.save_pretrained(folder)
    pieces = ["<unk>", "\u2581"] + [f"\u2581w{i}" for i in range(V - 3)]
    tok = Tokenizer(models.Unigram([(p, -float(i)) for i, p in enumerate(pieces)], unk_id=0))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.save(str(folder / "tokenizer.json"))
    ours = load_parakeet(folder, backend="reference")
    rows = []
    for seconds in ((2, 4) if smoke else (5, 60)):
        pcm = speech_audio(seconds)

        def peer():
            feats = fe(pcm, sampling_rate=16000, return_tensors="pt")
            with torch.no_grad():
                return hf.generate(**feats)

        def ours_steps():
            with torch.inference_mode():      # what transcribe() runs on a chunk: front end, encoder, TDT
                return ours._decode_chunk(pcm, None)[0]

        a, b = interleaved(ours_steps, peer, repeats, warm=seconds < 30)
        seq = FIRST["peer"].sequences[0, 1:]
        peer_n = int(((seq != cfg.blank_token_id) & (seq != cfg.pad_token_id)).sum())
        our_n = sum(t != ours.cfg.blank_id for t in FIRST["ours"].tokens)
        print(f"  {seconds} s: tokens ours {our_n}, transformers {peer_n}", flush=True)
        rows.append(row("Parakeet TDT 0.6B v3", f"transcribe {seconds} s", a, b,
                        f"{n_params / 1e9:.2f} B params fp32; greedy TDT, {our_n} / {peer_n} tokens emitted "
                        f"(ours / transformers); ours: front end + encoder + TDT loop"))
        mel = ours.mel(pcm)
        feats = fe(pcm, sampling_rate=16000, return_tensors="pt")

        def peer_enc():
            with torch.no_grad():
                hf.get_audio_features(**feats)

        def our_enc():
            with torch.inference_mode():
                ours.model.encode(mel[None])

        a, b = interleaved(our_enc, peer_enc, repeats)
        rows.append(row("Parakeet TDT 0.6B v3", f"encoder, {seconds} s audio (ms per audio s)",
                        [1000 * x / seconds for x in a], [1000 * x / seconds for x in b],
                        "log-mel given; transformers get_audio_features (encoder)", unit="ms"))
    return rows


def qwen3_asr_parts(smoke: bool) -> tuple:
    """(transformers config, processor) of Qwen3-ASR 0.6B (smoke: tiny sizes), with the test
    tokenizer's special ids; what this benchmark and bench/e2e_asr.py build their models on."""
    from transformers import PreTrainedTokenizerFast, Qwen3ASRConfig, Qwen3ASRFeatureExtractor, Qwen3ASRProcessor

    import test_qwen3_asr_reference as ref

    # Qwen/Qwen3-ASR-0.6B as published to our best knowledge (no hub access here): audio encoder 18
    # x 896, 14 heads, ffn 3584, output 1024 (other encoder fields: transformers' defaults); decoder
    # Qwen3-0.6B: 28 x 1024, 16 heads / 8 KV of 128, ffn 3072, vocab 151936, tied embeddings.
    tok = ref._tokenizer()
    ids = {s: tok.token_to_id(s) for s in ref.SPECIALS}
    audio = dict(num_mel_bins=128, encoder_layers=18, encoder_attention_heads=14, encoder_ffn_dim=3584,
                 d_model=896, output_dim=1024, n_window=50, n_window_infer=800, downsample_hidden_size=480)
    text = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=65536,
                tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if smoke:
        audio.update(encoder_layers=2, d_model=64, encoder_attention_heads=2, encoder_ffn_dim=128, output_dim=64)
        text.update(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    cfg = Qwen3ASRConfig(audio_config=audio, text_config=text, audio_token_id=ids["<|audio_pad|>"],
                         pad_token_id=ids["<|endoftext|>"], eos_token_id=[ids["<|endoftext|>"], ids["<|im_end|>"]],
                         tie_word_embeddings=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens={"audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>",
                              "audio_eos_token": "<|audio_end|>"})
    processor = Qwen3ASRProcessor(feature_extractor=Qwen3ASRFeatureExtractor(), tokenizer=fast,
                                  chat_template=ref.TEMPLATE)
    return cfg, processor


def qwen3_asr(repeats: int, smoke: bool) -> list[dict]:
    from transformers import Qwen3ASRForConditionalGeneration

    from photon_core.models.qwen3_asr import load_qwen3_asr

    cfg, processor = qwen3_asr_parts(smoke)
    hf, n_params = hf_random(Qwen3ASRForConditionalGeneration, cfg)
    folder = scratch("bench-qwen3-asr-")
    hf.save_pretrained(folder)
    processor.save_pretrained(folder)
    ours = load_qwen3_asr(folder, backend="reference", dtype=torch.float32)
    # decode the full budget, as min_new_tokens does: a stop id no token has
    ours.config = dataclasses.replace(ours.config, eos_token_ids=(-1,))
    rows = []
    for seconds, n_tok in (((2, 8), (4, 8)) if smoke else ((5, 32), (60, 96))):
        pcm = speech_audio(seconds)

        def peer():
            inputs = processor.apply_transcription_request(audio=pcm, language="en")
            with torch.no_grad():
                out = hf.generate(**inputs, max_new_tokens=n_tok, min_new_tokens=n_tok, do_sample=False)
            return out[0, inputs["input_ids"].shape[1]:].tolist()

        def our_ids():
            mel, frames = ours.features(pcm)
            a = ours.encode(mel, frames)
            return ours.generate([ours.prompt_embeds(ours.prompt_ids(a.shape[0], "en", None), a)], n_tok)[0]

        a, b = interleaved(our_ids, peer, repeats, warm=seconds < 30)
        ot, pt = FIRST["ours"], FIRST["peer"]
        same = next((i for i, (x, y) in enumerate(zip(ot, pt)) if x != y), min(len(ot), len(pt)))
        print(f"  {seconds} s: tokens ours {len(ot)}, transformers {len(pt)}, identical for the first {same}",
              flush=True)
        rows.append(row("Qwen3-ASR 0.6B", f"transcribe {seconds} s, {n_tok} tokens", a, b,
                        f"{n_params / 1e9:.2f} B params fp32; {len(ot)} / {len(pt)} tokens (ours / transformers), "
                        f"greedy, end of sequence ignored, identical for the first {same}; ours: log-mel + "
                        f"encoder + prompt + generate (transcribe() without its speech gate and text parsing)"))
        inputs = processor.apply_transcription_request(audio=pcm, language="en")
        mel, frames = ours.features(pcm)

        def peer_enc():
            with torch.no_grad():
                hf.get_audio_features(inputs["input_features"], inputs["input_features_mask"])

        a, b = interleaved(lambda: ours.encode(mel, frames), peer_enc, repeats)
        rows.append(row("Qwen3-ASR 0.6B", f"encoder, {seconds} s audio (ms per audio s)",
                        [1000 * x / seconds for x in a], [1000 * x / seconds for x in b],
                        "log-mel given; transformers get_audio_features (encoder + projector)", unit="ms"))
    return rows


# ----------------------------------------------------------------------------------------- Moondream 3

def moondream3(repeats: int, smoke: bool) -> list[dict]:
    from dataclasses import replace

    from photon_core.backends import reference as ops
    from photon_core.models.moondream3 import text
    from photon_core.models.moondream3.config import MoeConfig, TextConfig
    from photon_core.models.moondream3.weights import FP8, dequantize_fp8

    full = TextConfig()                      # the real 9B-A2B text decoder (config.py defaults)
    dense, moe_layers = 1, 4
    cfg = replace(full, n_layers=dense + moe_layers, moe=replace(full.moe, start_layer=dense))
    if smoke:
        cfg = replace(cfg, dim=256, ff_dim=1024, n_heads=4, n_kv_heads=4, vocab_size=2048, max_context=2048,
                      moe=MoeConfig(num_experts=8, start_layer=dense, experts_per_token=2, expert_inner_dim=128))
    d, E, I, h = cfg.dim, cfg.moe.num_experts, cfg.moe.expert_inner_dim, cfg.n_heads
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=0.02):
        return torch.randn(*shape, generator=g) * scale

    def fp8_experts(rows: int, cols: int) -> torch.Tensor:
        """Random FP8 e4m3 weights with per-row scales, dequantized by our loader's function."""
        w = (torch.randn(E, rows, cols, generator=g) * 64).clamp(-448, 448).to(FP8)
        return dequantize_fp8(w, torch.full((E, rows), 0.02 / 64), "experts")

    t0 = time.perf_counter()
    sd = {"text.wte": rnd(cfg.vocab_size, d), "text.post_ln.weight": torch.ones(d), "text.post_ln.bias": torch.zeros(d),
          "text.lm_head.weight": rnd(cfg.vocab_size, d), "text.lm_head.bias": torch.zeros(cfg.vocab_size)}
    for i in range(cfg.n_layers):
        p = f"text.blocks.{i}."
        sd.update({p + "ln.weight": torch.ones(d), p + "ln.bias": torch.zeros(d),
                   p + "attn.qkv.weight": rnd(3 * d, d), p + "attn.qkv.bias": torch.zeros(3 * d),
                   p + "attn.proj.weight": rnd(d, d), p + "attn.proj.bias": torch.zeros(d),
                   p + "tau_wqwv": rnd(2 * h, 3 * d), p + "tau_alpha": rnd(h, scale=1.0)})
        if i < dense:
            sd.update({p + "mlp.fc1.weight": rnd(cfg.ff_dim, d), p + "mlp.fc1.bias": torch.zeros(cfg.ff_dim),
                       p + "mlp.fc2.weight": rnd(d, cfg.ff_dim), p + "mlp.fc2.bias": torch.zeros(d)})
        else:
            sd.update({p + "router.weight": rnd(E, d, scale=0.5), p + "router.bias": torch.zeros(E),
                       p + "experts_gate_up": fp8_experts(2 * I, d), p + "experts_down": fp8_experts(d, I)})
    w = text.TextWeights.from_state(sd, cfg)
    n_params = sum(t.numel() for t in sd.values())
    print(f"  built {cfg.n_layers} layers ({n_params / 1e9:.2f} B parameters, float32) in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    context = 64 if smoke else 800          # 730 image tokens + a prompt + some answer
    cache = text.KVCache(cfg, context + 64, torch.float32, "cpu")
    x = torch.randn(1, context, d, generator=g) * 0.1
    with torch.inference_mode():
        text.forward(x, 0, w, cfg, cache, ops)      # prefill: the cache holds a real context

    def step(blocks: list):
        ww = replace(w, blocks=blocks)
        tok = torch.tensor([[17]])

        def run():
            with torch.inference_mode():
                for k in range(8):
                    hidden = text.forward(text.embed(tok, ww), context + k, ww, cfg, cache, ops)
                    text.lm_logits(hidden[:, -1], ww, ops).argmax()
        return run

    runs = {"head": step([]), "dense": step(w.blocks[:dense]), "all": step(w.blocks)}
    times = {k: [] for k in runs}
    for fn in runs.values():
        fn()
    for r in range(repeats * 3):
        for k, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - t) / 8)
    med = {k: statistics.median(v) for k, v in times.items()}
    t_dense = med["dense"] - med["head"]
    t_moe = (med["all"] - med["dense"]) / moe_layers
    per_token = med["head"] + full.moe.start_layer * t_dense + (full.n_layers - full.moe.start_layer) * t_moe
    print(f"  per token: embed+head {med['head'] * 1e3:.1f} ms, dense layer {t_dense * 1e3:.1f} ms, "
          f"MoE layer {t_moe * 1e3:.1f} ms -> 24 layers {per_token * 1e3:.0f} ms", flush=True)
    note = (f"measured on {cfg.n_layers} layers of the real shapes (1 dense + 4 MoE, {n_params / 1e9:.2f} B params "
            f"fp32, experts random FP8 e4m3 dequantized at load), decode at context {context}; "
            f"embed+head {med['head'] * 1e3:.1f} ms, dense layer {t_dense * 1e3:.1f} ms, MoE layer "
            f"{t_moe * 1e3:.1f} ms (medians of {repeats * 3} x 8 steps); scaled: head + 4 dense + 20 MoE")
    return [row("Moondream 3.1 9B-A2B", "decode, per token (scaled to 24 layers)", [per_token], None, note)
            | {"n": repeats * 3},
            row("Moondream 3.1 9B-A2B", f"decode, per token ({cfg.n_layers} layers, measured)", [med["all"]], None,
                "the 5-layer model as timed") | {"n": repeats * 3}]


# ----------------------------------------------------------------------------------------- driver

def run_case(name: str, repeats: int | None, smoke: bool) -> list[dict]:
    torch.set_num_threads(THREADS)
    repeats = repeats or REPEATS.get(name, 3)
    if name.startswith("qwen3_5-"):
        return qwen3_5(name, repeats, smoke)
    return {"gemma4-e2b": gemma4, "parakeet": parakeet, "qwen3_asr": qwen3_asr,
            "moondream3": moondream3}[name](repeats, smoke)


def fmt(x: float | None, unit: str) -> str:
    if x is None:
        return "—"
    return f"{x:.0f}" if unit == "ms" else f"{x:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=CASES, help="run one case (with --write: its rows of the section "
                    "are replaced, each noting its own date, machine and load)")
    ap.add_argument("--repeats", type=int, help="timed repeats per side, interleaved (default 3; 2 for "
                    "qwen3_5-2b and gemma4-e2b)")
    ap.add_argument("--write", action="store_true", help="replace this benchmark's section of bench/RESULTS.md")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the machinery (never written)")
    ap.add_argument("--case", help=argparse.SUPPRESS)      # the worker process
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        rows = run_case(args.case, args.repeats, args.smoke)
        Path(args.out).write_text(json.dumps(rows))
        return
    if args.write and args.smoke:
        ap.error("--write takes real shapes only (not --smoke)")
    from report import publish

    cases = [args.only] if args.only else CASES
    rows, failed = [], []
    start = time.perf_counter()
    for i, name in enumerate(cases):
        print(f"== {name}", flush=True)
        out = Path(tempfile.mkstemp(suffix=".json")[1])
        t = time.perf_counter()
        cmd = [sys.executable, __file__, "--case", name, "--out", str(out)]
        cmd += ["--repeats", str(args.repeats)] if args.repeats else []
        code = subprocess.run(cmd + (["--smoke"] if args.smoke else [])).returncode
        if code == 0:
            rows += json.loads(out.read_text())
        else:
            failed.append(f"{name} (exit {code})")
        out.unlink(missing_ok=True)
        print(f"   {name}: {time.perf_counter() - t:.0f} s", flush=True)
        if args.write and i + 1 < len(cases):   # the section so far, so that a cut-off run leaves figures
            RESULTS_LINES[:] = section(rows, failed, start, cases[i + 1:])
            from report import RESULTS, replace_section
            RESULTS.write_text(replace_section(RESULTS.read_text(), "\n".join(RESULTS_LINES) + "\n"))
    if args.only:
        print("\n".join(section(rows, failed, start, [])), flush=True)
        if args.write and rows:
            from report import RESULTS
            RESULTS.write_text(replace_rows(RESULTS.read_text(), rows))
        return
    publish(section(rows, failed, start, []), args.write)


def replace_rows(text: str, rows: list[dict]) -> str:
    """The families section of RESULTS.md with every row of the rerun models replaced by `rows`
    (at the place of the first old one, else at the table's end); each new row says when, where
    and under what load it ran, since the section's heading speaks for the full run."""
    from report import machine

    title = "### New families on CPU vs transformers"
    if title not in text:
        raise SystemExit("bench/RESULTS.md has no families section yet: run the full benchmark with --write")
    models = {r["model"] for r in rows}
    when = (f"rerun {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} alone (`--only`), {machine()}, "
            f"1-minute load {os.getloadavg()[0]:.1f} at its end")
    new = [table_row({**r, "note": f"{r['note']}; {when}"}) for r in rows]
    lines, out, placed, inside = text.split("\n"), [], False, False
    for line in lines:
        if line.startswith("### "):
            if inside and not placed:
                while out and not out[-1].strip():
                    out.pop()
                out += new + [""]
                placed = True
            inside = line.startswith(title)
        if inside and line.startswith("| ") and line.split(" | ")[0][2:] in models:
            if not placed:
                out += new
                placed = True
            continue
        out.append(line)
    if inside and not placed:
        out += new
    return "\n".join(out)


def table_row(r: dict) -> str:
    u = " ms" if r["unit"] == "ms" else " s"
    speed = f"{r['peer'] / r['ours']:.2f}x" if r["peer"] else "—"
    return (f"| {r['model']} | {r['task']} | {fmt(r['ours'], r['unit'])}{u} | "
            f"{fmt(r['peer'], r['unit'])}{u if r['peer'] else ''} | {speed} | {r['n']} | {r['note']} |")


RESULTS_LINES: list[str] = []


def section(rows: list[dict], failed: list[str], start: float, pending: list[str]) -> list[str]:
    from report import heading
    import transformers

    lines = heading("New families on CPU vs transformers (random weights, real shapes)") + [
        f"torch {torch.__version__}, {THREADS} threads; transformers "
        f"{transformers.__version__}. Total {time.perf_counter() - start:.0f} s.", "",
        "Ours: the reference backend (PyTorch ops). Each case in its own process; ours and transformers "
        "on the same weights in the same process, repeats interleaved (ours, peer, peer, ours, ...); "
        "one untimed warm-up each only for calls under a minute (the 640x480 captions and 60 s audio "
        "have none: their median absorbs first-call costs); medians of the repeats column (Moondream: "
        "of that many x 8 decode steps). Speedup = transformers / ours. The machine is shared with "
        f"other jobs (1-minute load average {os.getloadavg()[0]:.1f} on its 2 cores at the end of this "
        "run): compare within a row.", "",
        "| model | task | ours | transformers | speedup | repeats | notes |",
        "|---|---|---:|---:|---:|---:|---|"]
    lines += [table_row(r) for r in rows]
    if failed:
        lines += ["", f"Failed (no figures): {', '.join(failed)}."]
    if pending:
        lines += ["", f"Run in progress; not yet measured: {', '.join(pending)}."]
    return lines


if __name__ == "__main__":
    main()
