"""Moondream 2 and 3.1 in the end-to-end benchmark: detect, point, caption (normal) and query on a
756x756 image and a 1920x1080 frame, ours against the public Moondream reference (Moondream 2; there
is no runnable public reference of Moondream 3: the makers' engine, kestrel, is not at hand).

Weights: random, of the real shapes (MoondreamConfig / Moondream3Config defaults; tiny ones for the
dry run: test/moondream_fixtures' small config, whose 27 vision layers the reference's crop grid
needs), the same tensors on both sides (the reference loads our state dict by its own names). The
end-of-text token's LM bias is pushed to -1e4 on both sides, so every caption and query decodes its
full budget and every detect and point its max_objects: random weights would stop anywhere
otherwise. Greedy on both sides (temperature 0).

The reference (moondream/torch of github.com/vikhyat/moondream, from --moondream-ref or
MOONDREAM_REF_SRC) is used as its users run it: PIL image in, encode_image, then the skill on the
encoded image, one request at a time, in the model's dtype, eager (its `compile()`, which its own
benchmark script calls, is the `moondream-ref+compile` peer, run when the plan has time for it).
Two pins, as test/test_moondream_reference.py: its tokenizer (a download) is ours, and its crops are
made with PIL (pyvips' bytes differ), so both sides encode the same crops.
"""
from __future__ import annotations

import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import torch

import e2e_inputs
from e2e_family import Family, Task
from e2e_phases import by_length

SIZES = {"756x756": (756, 756), "1920x1080": (1080, 1920)}
SKILLS = (("detect", 4), ("point", 4), ("caption", 32), ("query", 16))
QUESTION = "what is the robot holding"
OBJECT = "cup"
EOS_BIAS = -1e4
# The megakernel's tiles for the dry run's tiny shapes under Triton's interpreter (whose cost is per
# task): test_moondream_fast's.
DRY_TILING = dict(block_n=64, block_k=128, block_t=32, self_splits=2)


def tasks() -> list[Task]:
    # The goal's case first (detect on the 756x756 image), the 1080p frame after the 756 image.
    return [Task(skill, size, n) for size in SIZES for skill, n in SKILLS]


def tokenizer_folder() -> Path:
    """A folder holding the tests' tokenizer.json (real vocabulary size, the template ids valid)."""
    import moondream_fixtures as mf
    folder = Path(tempfile.mkdtemp(prefix="e2e-moondream-tok-"))
    mf.build_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


def random_state(shapes: dict[str, tuple[int, ...]], device: Any, dtype: Any, eos_id: int, seed: int = 0,
                 fp8: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Reference-named tensors of `shapes`: N(0, 0.02) weights (norm weights 1), on the device;
    tensors named in `fp8` as FP8 e4m3 with row scales (Moondream 3's experts, as its checkpoints)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name in fp8:
            w = (torch.randn(*shape, generator=g, device=device) * 64).clamp(-448, 448)
            out[name] = w.to(torch.float8_e4m3fn)
            out[name + "_scale"] = torch.full(shape[:2], 0.02 / 64, device=device)
            continue
        w = torch.randn(*shape, generator=g, device=device) * 0.02
        if name.endswith(("ln.weight", "ln1.weight", "ln2.weight", "post_ln.weight")):
            w = w + 1.0
        out[name] = w.to(dtype)
    out["text.lm_head.bias"][eos_id] = EOS_BIAS
    return out


class Moondream2(Family):
    name = "moondream2"
    peer_label = "moondream reference"

    @classmethod
    def tasks(cls) -> list[Task]:
        return tasks()

    def config(self) -> Any:
        from photon_core.models.moondream.config import MoondreamConfig
        if not self.tiny:
            return MoondreamConfig()
        if self.compiled():   # Triton's interpreter: the tests' fast config (126-px crops, vocab 1024)
            import moondream_fast_fixtures as ff
            return MoondreamConfig.from_dict(ff.fast_config())
        import moondream_fixtures as mf
        return MoondreamConfig.from_dict(mf.small_config(vision_layers=27))

    def build_ours(self) -> None:
        from photon_core.megakernel.compiler import Tiling
        from photon_core.models.moondream.model import MoondreamModel, expected_shapes
        from photon_core.models.moondream.tokenizer import MoondreamTokenizer
        cfg = self.cfg = self.config()
        self.state = random_state(expected_shapes(cfg), self.device, self.dtype, cfg.tokenizer.eos_id)
        self.tok_folder = tokenizer_folder()
        tiling = Tiling(**DRY_TILING) if self.tiny and self.compiled() else None
        self.model = MoondreamModel(cfg, self.state, MoondreamTokenizer(self.tok_folder / "tokenizer.json"),
                                    self.ops(), self.device, self.dtype, tiling=tiling)

    def setup(self) -> None:
        self.build_ours()
        self.hook_ours()
        if self.with_peer:
            self.build_peer()

    def hook_ours(self) -> None:
        from photon_core.models.moondream import image_crops, skills, vision
        c = self.sides["ours"].clock
        c.add(image_crops, "make_crops", "preprocess")
        for fn in ("normalize", "project"):
            c.add(vision, fn, "encoder")
        c.add(self.model, "encode_crops", "encoder")   # eager or replayed (runtime/shape_graphs)
        c.add(self.model, "prefill_images", "prefill")
        c.add(skills, "forward", classify=by_length("prefill", None, arg=1))
        if self.model.decode is not None:
            # On the megakernel the prompt's last token is the first decode step: its end is the
            # first token.
            c.add(self.model.decode.step_class, "step", first_token=True)

    def build_peer(self) -> None:
        src = self.ref_src
        if self.cfg.vision.grid != self.cfg.vision.enc_n_layers:
            v = self.cfg.vision
            self.skip_peer(f"the reference reads its crop grid off its vision layer count ({v.enc_n_layers}); "
                           f"these crops have a {v.grid} x {v.grid} grid")
            return
        if not src or not (Path(src) / "moondream" / "torch" / "moondream.py").is_file():
            self.skip_peer(f"no reference source: --moondream-ref / MOONDREAM_REF_SRC "
                           f"({src or 'unset'}) holds no moondream/torch/moondream.py")
            return
        self.ref_mod = mods = reference_modules(src)
        tok = __import__("tokenizers").Tokenizer.from_file(str(self.tok_folder / "tokenizer.json"))
        mods.moondream.Tokenizer = types.SimpleNamespace(from_pretrained=lambda name: tok)
        mods.image_crops.HAS_VIPS = False
        from PIL import Image
        mods.image_crops.Image = Image
        ref_prepare, dtype = mods.moondream.prepare_crops, self.dtype

        def prepare_crops(image: Any, config: Any, device: Any) -> Any:
            crops, tiling = ref_prepare(image, config, device)   # bfloat16, as the reference makes them
            return crops.to(dtype), tiling
        mods.moondream.prepare_crops = prepare_crops
        with torch.device(self.device):
            ref = mods.moondream.MoondreamModel(mods.Config.from_dict(_as_dict(self.cfg)), dtype=self.dtype)
        missing, unexpected = ref.load_state_dict(self.state, strict=False)
        missing = [k for k in missing if ".kv_cache." not in k]   # its caches are buffers, not weights
        if missing or unexpected:
            raise RuntimeError(f"the reference did not take our weights: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")
        self.ref = ref.eval()
        del self.state     # the reference holds its own copy
        c = self.sides["peer"].clock
        c.add(mods.moondream, "prepare_crops", "preprocess")
        c.add(ref, "_vis_enc", "encoder")
        c.add(ref, "_vis_proj", "encoder")
        c.add(ref, "_prefill", "prefill")
        self.sides["peer"].serial = True

    def compile_peer(self) -> None:
        """The reference's own `compile()` (torch.compile of its encoder, prefill and decode step),
        as its benchmark script runs it on a GPU."""
        self.ref.compile()
        self.peer_compiled = True

    def inputs(self, task: Task, n: int) -> list[bytes]:
        h, w = SIZES[task.input] if not self.tiny else _tiny_size(task.input, self.cfg.vision.crop_size)
        return e2e_inputs.frames(h, w, n)

    def ours(self, task: Task, inputs: list[bytes]) -> list[int]:
        from photon_core.runtime.requests import Request
        c = self.sides["ours"].clock
        with c.phase("decode_image"):
            rgbs = [e2e_inputs.decode_jpeg(b) for b in inputs]
        arg = {"detect": OBJECT, "point": OBJECT, "caption": "normal", "query": QUESTION}[task.skill]
        reqs = [Request(task.skill, rgb, arg, max_objects=task.tokens, max_tokens=task.tokens, temperature=0.0)
                for rgb in rgbs]
        return [self._count(task, r) for r in self.model.batch(reqs)]

    def peer(self, task: Task, inputs: list[bytes]) -> list[int]:
        c, ref, out = self.sides["peer"].clock, self.ref, []
        for data in inputs:
            with c.phase("decode_image"):
                pil = e2e_inputs.decode_jpeg_pil(data)
            enc = ref.encode_image(pil)
            if task.skill in ("detect", "point"):
                r = getattr(ref, task.skill)(enc, OBJECT, settings={"max_objects": task.tokens})
            elif task.skill == "caption":
                r = ref.caption(enc, "normal", settings={"max_tokens": task.tokens, "temperature": 0})
            else:
                r = ref.query(enc, QUESTION, settings={"max_tokens": task.tokens, "temperature": 0})
            out.append(self._count(task, r))
        return out

    def _count(self, task: Task, r: dict) -> int:
        """Objects (detect, point) or the answer's words (caption, query: one token each with the
        benchmark's word-level tokenizer)."""
        if task.skill == "detect":
            return len(r["objects"])
        if task.skill == "point":
            return len(r["points"])
        return len(r["caption" if task.skill == "caption" else "answer"].split())



class Moondream3(Moondream2):
    name = "moondream3"
    peer_label = "none"

    def config(self) -> Any:
        from photon_core.models.moondream3.config import Moondream3Config
        if not self.tiny:
            return Moondream3Config()
        import test_moondream3_checkpoints as ck
        return Moondream3Config.from_dict(ck.md3_config())

    def build_ours(self) -> None:
        from photon_core.megakernel.compiler import Tiling
        from photon_core.models.moondream.tokenizer import MoondreamTokenizer
        from photon_core.models.moondream3.model import Moondream3Model, expected_shapes
        cfg = self.cfg = self.config()
        shapes = expected_shapes(cfg)
        # FP8 experts as the 3.1 checkpoint ships them, kept FP8 by the megakernel (dequantized on
        # the per-op paths, as load_moondream3 does).
        fp8 = frozenset(k for k in shapes if k.endswith(("experts_gate_up", "experts_down")))
        state = random_state(shapes, self.device, self.dtype, cfg.tokenizer.eos_id, fp8=fp8)
        if not self.compiled():
            from photon_core.models.moondream3.weights import dequantize_fp8
            for k in fp8:
                state[k] = dequantize_fp8(state[k], state.pop(k + "_scale"), k).to(self.dtype)
        self.tok_folder = tokenizer_folder()
        tiling = Tiling(**DRY_TILING) if self.tiny and self.compiled() else None
        self.model = Moondream3Model(cfg, state, MoondreamTokenizer(self.tok_folder / "tokenizer.json"),
                                     self.ops(), self.device, self.dtype, tiling=tiling)

    @classmethod
    def cpu_refusal(cls) -> str | None:
        import os
        need = 9.3e9 * 4 + 4e9    # 9.3 B parameters in float32 (the per-op paths dequantize the FP8 experts)
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return None if have > need else (f"9.3 B parameters in float32 ({need / 2**30:.0f} GiB with the rest) do "
                                         f"not fit this machine's {have / 2**30:.0f} GiB")

    def build_peer(self) -> None:
        self.skip_peer("no runnable public reference of Moondream 3 (the public torch code is Moondream 2's; "
                       "the makers' engine, kestrel, is not at hand)")


def reference_modules(src: str) -> types.SimpleNamespace:
    """moondream/torch/* of the reference checkout at `src`, imported without its package's
    __init__ (which pulls in its cloud client); any moondream modules imported before are replaced."""
    for k in [k for k in sys.modules if k == "moondream" or k.startswith("moondream.")]:
        del sys.modules[k]
    pkg = types.ModuleType("moondream")
    pkg.__path__ = [str(Path(src) / "moondream")]
    sys.modules["moondream"] = pkg
    import moondream.torch.image_crops as ric
    import moondream.torch.moondream as rmd
    from moondream.torch.config import MoondreamConfig as RConfig
    return types.SimpleNamespace(image_crops=ric, moondream=rmd, Config=RConfig)


def _as_dict(cfg: Any) -> dict:
    """Our Moondream 2 config in the reference's layout (the sections it knows)."""
    import dataclasses
    t, v, r = (dataclasses.asdict(x) for x in (cfg.text, cfg.vision, cfg.region))
    t.pop("rope_theta", None)
    return {"text": t, "vision": v, "region": r}


def _tiny_size(name: str, crop: int) -> tuple[int, int]:
    """The dry run's images: the same aspects, smaller (about one and two local crops' worth)."""
    side = crop * 300 // 378
    return {"756x756": (side, side), "1920x1080": (side, side * 16 // 9)}[name]
