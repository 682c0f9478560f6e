"""`python -m photon_core {detect,point,caption,query,segment} IMAGE ... --model PATH_OR_ID`, results as JSON.

The vision commands of every family: each loads whatever `--model` names through the registry
(photon_core.load(path, skills=(command,))), so any family with the skill serves it (Moondream 2
and 3 detect and point, Gemma 4 and Qwen 3.5 caption and answer too, Moondream 3 segments)."""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def _read_image(path: str) -> np.ndarray:
    from PIL import Image
    try:
        with Image.open(path) as im:
            return np.asarray(im.convert("RGB"))
    except (OSError, ValueError) as e:
        raise SystemExit(f"cannot read image {path}: {e}")


def draw(image: np.ndarray, result: dict, label: str, out_path: str) -> None:
    """Boxes and points (normalised coordinates), or a segment's mask, drawn on the RGB image,
    written to out_path."""
    import cv2

    from photon_core.draw import draw_results
    segments = {label: result} if "path" in result else {}
    canvas = draw_results(image, {label: result.get("objects", [])}, {label: result.get("points", [])}, segments)
    if not cv2.imwrite(out_path, cv2.cvtColor(canvas, cv2.COLOR_RGB2BGR)):
        raise SystemExit(f"cannot write {out_path}")


def _run(args: argparse.Namespace) -> int:
    import photon_core
    image = _read_image(args.image)
    t0 = time.perf_counter()
    try:
        # Any family with this skill: the checkpoint given with --model decides which.
        model = photon_core.load(args.model, device=args.device, dtype=args.dtype,
                                 backend="reference", skills=(args.command,))
    except (FileNotFoundError, NotImplementedError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t1 = time.perf_counter()
    if args.command in ("detect", "point"):
        result = getattr(model, args.command)(image, args.object, max_objects=args.max_objects)
    elif args.command == "segment":
        result = model.segment(image, args.object, max_tokens=args.max_tokens)
    elif args.command == "caption":
        result = model.caption(image, length=args.length, max_tokens=args.max_tokens,
                               temperature=args.temperature, top_p=args.top_p)
    else:
        result = model.query(image, args.question, max_tokens=args.max_tokens,
                             temperature=args.temperature, top_p=args.top_p)
    t2 = time.perf_counter()
    if args.draw:
        draw(image, result, args.object, args.draw)
    result = {**result, "model": model.model_id, "load_s": round(t1 - t0, 3), "infer_s": round(t2 - t1, 3)}
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


def add_commands(subparsers) -> None:
    def common(p: argparse.ArgumentParser, model: str = "moondream2") -> None:
        p.add_argument("image", help="image file (any format PIL reads)")
        p.add_argument("--model", default=model,
                       help=f"checkpoint folder or file, or a model id in the Hugging Face cache (default {model})")
        p.add_argument("--device", default="cpu")
        p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                       help="default: bfloat16 on a GPU, float32 on the CPU")
        p.set_defaults(run=_run)

    # The families with each skill are listed under the commands (--help's epilog).
    for name, what in (("detect", "bounding boxes"), ("point", "points")):
        p = subparsers.add_parser(name, help=f"{what} of an object, as JSON")
        common(p)
        p.add_argument("object", help='what to look for, e.g. "cup"')
        p.add_argument("--max-objects", type=int, default=50)
        p.add_argument("--draw", metavar="OUT.png", help="also write the image with the results drawn")
    p = subparsers.add_parser("segment", help="outline of an object (SVG path in its box's unit square, "
                                              "and the box), as JSON")
    common(p, model="moondream3.1-9B-A2B")
    p.add_argument("object", help='what to outline, e.g. "cup"')
    p.add_argument("--max-tokens", type=int, default=768)
    p.add_argument("--draw", metavar="OUT.png",
                   help="also write the image with the mask filled (semi-transparent) and its border drawn")
    for name in ("caption", "query"):
        p = subparsers.add_parser(name, help=f"{name} an image, as JSON")
        common(p)
        if name == "query":
            p.add_argument("question")
        else:
            p.add_argument("--length", default="normal", choices=["short", "normal", "long"])
        p.add_argument("--max-tokens", type=int, default=768)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.set_defaults(draw=None)
