"""Vision benchmark: Moondream preprocessing per image size and per-skill latency.

    python bench/vision.py                     # CPU, the small random checkpoint the tests use
    python bench/vision.py --model PATH_OR_ID  # real weights, where they exist
    python bench/vision.py --write             # also append the table to bench/RESULTS.md

On a GPU machine, `--device cuda --real-size` builds random weights of the real Moondream 2 shapes
(no files needed) and times vision encode, prefill and per-token decode. The last table times N
detect requests decoded as one batch against the same requests one after another.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "test"))
sys.path.insert(0, str(ROOT / "bench"))
from report import heading, publish  # noqa: E402

SIZES = {"640x480": (480, 640), "1920x1080": (1080, 1920), "4000x3000": (3000, 4000)}


def timed(fn, repeats: int) -> tuple[float, float]:
    """Median and best wall time of fn() over `repeats` runs, after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def real_size_model(device: str, dtype: str):
    """Moondream 2 at its published sizes with random weights, built in memory (no files)."""
    import tempfile

    import moondream_fixtures
    from photon_core.backends import reference
    from photon_core.models.moondream.config import MoondreamConfig
    from photon_core.models.moondream.model import MoondreamModel, expected_shapes
    from photon_core.models.moondream.tokenizer import MoondreamTokenizer
    from photon_core.models.moondream.weights import parse_dtype

    config = MoondreamConfig.from_dict({})
    torch_dtype = parse_dtype(dtype)
    state = {name: torch.randn(shape, device=device, dtype=torch_dtype) * 0.02
             for name, shape in expected_shapes(config).items()}
    tokenizer_path = Path(tempfile.mkdtemp()) / "tokenizer.json"
    moondream_fixtures.build_tokenizer().save(str(tokenizer_path))
    return MoondreamModel(config, state, MoondreamTokenizer(tokenizer_path), reference,
                          torch.device(device), torch_dtype)


def bench_batched_decode(model, args, rng) -> list[tuple[int, float, float]]:
    """(N, batched seconds, sequential seconds): the decode steps only, images encoded beforehand."""
    from photon_core.models.moondream import Request

    frames = [rng.integers(0, 256, (480, 640, 3), dtype=np.uint8) for _ in range(8)]
    encoded = model.encode_images(frames)
    out = []
    for n in (1, 2, 4, 8):
        requests = [Request("detect", enc, "cup", max_objects=3) for enc in encoded[:n]]

        def batched():
            model.batch(requests)
            synchronize(args.device)

        def one_at_a_time():
            for r in requests:
                model.batch([r])
            synchronize(args.device)

        out.append((n, timed(batched, args.repeats)[0], timed(one_at_a_time, args.repeats)[0]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="weights; default: the small random test checkpoint")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--real-size", action="store_true", help="random weights of the real shapes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)

    from photon_core.models.moondream import load_moondream
    import moondream_fixtures

    if args.real_size:
        model, label = real_size_model(args.device, args.dtype), "Moondream 2 shapes, random weights"
    else:
        model_path = args.model or moondream_fixtures.checkpoint()
        label = args.model or "small random checkpoint (tests)"
        model = load_moondream(model_path, device=args.device, dtype=args.dtype)
    rng = np.random.default_rng(0)
    rows = []
    images = {name: rng.integers(0, 256, (*hw, 3), dtype=np.uint8) for name, hw in SIZES.items()}
    for name, image in images.items():
        med, best = timed(lambda: model.preprocess(image), args.repeats)
        rows.append((f"preprocess {name}", med, best))
    image = images["640x480"]

    def encode():
        enc = model.encode_image(image)
        synchronize(args.device)
        return enc

    med, best = timed(encode, args.repeats)
    rows.append(("encode_image 640x480 (vision + prefill)", med, best))
    enc = encode()
    for skill, call in [("detect (max 5)", lambda: model.detect(enc, "cup", settings={"max_objects": 5})),
                        ("point (max 5)", lambda: model.point(enc, "cup", settings={"max_objects": 5})),
                        ("caption (16 tokens)", lambda: model.caption(enc, settings={"temperature": 0, "max_tokens": 16})),
                        ("query (16 tokens)", lambda: model.query(enc, "what is this?", settings={"temperature": 0, "max_tokens": 16}))]:
        def run(call=call):
            call()
            synchronize(args.device)
        med, best = timed(run, args.repeats)
        rows.append((skill, med, best))

    batch_rows = bench_batched_decode(model, args, rng)

    lines = heading(f"Vision ({label}, {args.device}, {args.dtype})")
    lines += ["| step | median ms | best ms |", "|---|---:|---:|"]
    lines += [f"| {name} | {med * 1000:.1f} | {best * 1000:.1f} |" for name, med, best in rows]
    lines += ["", "N detect requests (max 3 objects) on N already-encoded frames: decoded as one batch vs "
              "one after another (median ms):", "",
              "| N | batched | one at a time | speedup |", "|---:|---:|---:|---:|"]
    lines += [f"| {n} | {b * 1000:.1f} | {one * 1000:.1f} | {one / b:.2f}x |" for n, b, one in batch_rows]
    publish(lines, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
