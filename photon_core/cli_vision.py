"""`python -m photon_core {detect,point,caption,query,segment} IMAGE ... --model PATH_OR_ID`, results as JSON.

The vision commands, shared by every vision family (each names this module as its `cli`): each loads whatever `--model` names through the registry
(photon_core.load(path, skills=(command,))), so any family with the skill serves it (Moondream 2
and 3 detect and point, Gemma 4 and Qwen 3.5 caption and answer too, Moondream 3 segments)."""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from photon_core import cli_checks
from photon_core.contracts import VisionModel
from photon_core.cli_checks import UserError
from photon_core.image_io import ImageFileError, read_image

# The argument holding each command's text, which the model may refuse (too long for its context).
_TEXT_ARG = {"detect": "object", "point": "object", "segment": "object", "query": "question"}


def draw(image: np.ndarray, result: dict, label: str, out_path: str) -> None:
    """Boxes and points (normalised coordinates), or a segment's mask, drawn on the RGB image,
    written to out_path."""
    import cv2

    from photon_core.draw import draw_results
    segments = {label: result} if "path" in result else {}
    canvas = draw_results(image, {label: result.get("objects", [])}, {label: result.get("points", [])}, segments)
    try:
        written = cv2.imwrite(out_path, cv2.cvtColor(canvas, cv2.COLOR_RGB2BGR))
    except cv2.error as err:
        raise ImageFileError(f"--draw {out_path}: cannot write it ({' '.join(str(err).split())})") from None
    if not written:
        raise ImageFileError(f"--draw {out_path}: cannot write it")


def _infer(model: VisionModel, args: argparse.Namespace, image: np.ndarray) -> dict:
    # The skill's method by the command's name: photon_core.load checked that the model offers it.
    skill = getattr(model, args.command)
    # Every family takes the reference's `settings` dict (photon_core.contracts).
    if args.command in ("detect", "point"):
        return skill(image, args.object, settings={"max_objects": args.max_objects})
    if args.command == "segment":
        return skill(image, args.object, settings={"max_tokens": args.max_tokens})
    # temperature/top_p: the CLI's own options (default greedy: deterministic runs)
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p}
    if args.command == "caption":
        return skill(image, length=args.length, settings=sampling)
    return skill(image, args.question, settings=sampling)


def _run(args: argparse.Namespace) -> int:
    image = read_image(args.image, keep_alpha=True)   # transparency: each family treats it as its reference does
    t0 = time.perf_counter()
    # Any family with this skill: the checkpoint given with --model decides which.
    model = cli_checks.load_model(args.model, args.device, args.dtype, (args.command,), backend="reference")
    assert isinstance(model, VisionModel)   # a family with a vision skill: this tells the type checker
    t1 = time.perf_counter()
    try:
        result = _infer(model, args, image)
    except ValueError as err:   # the model's own checks of what it was asked
        arg = _TEXT_ARG.get(args.command)
        what = f" the {arg} {cli_checks.shorten(getattr(args, arg))}" if arg else ""
        raise UserError(f"{args.command}{what} on {args.image}: {err}") from err
    t2 = time.perf_counter()
    result = {**result, "model": model.model_id, "load_s": round(t1 - t0, 3), "infer_s": round(t2 - t1, 3)}
    # The result goes out first: a drawing that fails after all cannot lose it.
    sys.stdout.write(cli_checks.json_text(result) + "\n")
    sys.stdout.flush()
    if args.draw:
        draw(np.ascontiguousarray(image[..., :3]), result, args.object, args.draw)
    return 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    def common(p: argparse.ArgumentParser, model: str = "moondream2") -> None:
        p.add_argument("image", help="image file (any format PIL reads)")
        p.add_argument("--model", default=model, type=cli_checks.non_empty,   # "" would be the current folder
                       help=f"checkpoint folder or file, or a model id in the Hugging Face cache (default {model})")
        p.add_argument("--device", default="cpu", type=cli_checks.device, help="cpu, cuda or cuda:N")
        p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                       help="default: bfloat16 on a GPU, float32 on the CPU")
        p.set_defaults(run=_run)

    # The families with each skill are listed under the commands (--help's epilog).
    for name, what in (("detect", "bounding boxes"), ("point", "points")):
        p = subparsers.add_parser(name, help=f"{what} of an object, as JSON")
        common(p)
        p.add_argument("object", type=cli_checks.non_empty, help='what to look for, e.g. "cup"')
        p.add_argument("--max-objects", type=cli_checks.int_at_least(0), default=50)
        # Checked when the command line is read: a bad path is refused before the work.
        p.add_argument("--draw", metavar="OUT.png", type=cli_checks.image_out_path,
                       help="also write the image with the results drawn")
    p = subparsers.add_parser("segment", help="outline of an object (SVG path in its box's unit square, "
                                              "and the box), as JSON")
    common(p, model="moondream3.1-9B-A2B")
    p.add_argument("object", type=cli_checks.non_empty, help='what to outline, e.g. "cup"')
    p.add_argument("--max-tokens", type=cli_checks.int_at_least(1), default=768)
    p.add_argument("--draw", metavar="OUT.png", type=cli_checks.image_out_path,
                   help="also write the image with the mask filled (semi-transparent) and its border drawn")
    for name in ("caption", "query"):
        p = subparsers.add_parser(name, help=f"{name} an image, as JSON")
        common(p)
        if name == "query":
            p.add_argument("question", type=cli_checks.non_empty)
        else:
            p.add_argument("--length", default="normal", choices=["short", "normal", "long"])
        p.add_argument("--max-tokens", type=cli_checks.int_at_least(1), default=768)
        p.add_argument("--temperature", type=cli_checks.non_negative_float, default=0.0)
        p.add_argument("--top-p", type=cli_checks.top_p, default=1.0, help="above 0, at most 1")
        p.set_defaults(draw=None)
