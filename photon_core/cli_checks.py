"""Checks of command-line input for `python -m photon_core`, so that a user's mistake is refused
before any work, in one line naming the option or file at fault.

Argument types (`type=` of argparse) check values when the command line is parsed; `load_model`
names the checkpoint in a loader's failure.
"""
from __future__ import annotations

import argparse
import json
import math
from typing import TYPE_CHECKING, Any, Callable, Iterable

if TYPE_CHECKING:
    from photon_core.contracts import Model


class UserError(Exception):
    """A mistake in what the user gave (a file, an option); the message is the whole story."""


def int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    parse.__name__ = "int"   # argparse names the type in its own messages
    return parse


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value:g}")
    return value


def top_p(text: str) -> float:
    """Nucleus sampling's probability mass: 0 < p <= 1."""
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1, got {value:g}")
    return value


def non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def device(text: str) -> str:
    """cpu, cuda or cuda:N, where that device exists on this machine."""
    import torch

    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return text
    if dev.type != "cuda":
        raise argparse.ArgumentTypeError(f"{text!r}: only cpu and cuda devices are supported")
    if not torch.cuda.is_available():
        why = "this PyTorch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available here ({why}); use --device cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    return text


def image_out_path(text: str) -> str:
    """A path an image can be written to (a known extension, an existing folder)."""
    from photon_core.image_io import ImageFileError, check_writable_image

    try:
        check_writable_image(text)
    except ImageFileError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def json_text(result: Any, **options: Any) -> str:
    """`result` as JSON text (json.dumps' `options`), made whole before a byte of it is written, so
    that a failure leaves no partial output. Array scalars and arrays (NumPy, torch) are written as
    their values; NaN or infinity, which JSON has no way to write (json's "NaN" is not JSON: a
    consumer's parser refuses the whole line), is a RuntimeError, the model's fault."""
    def plain(value: Any) -> Any:
        tolist = getattr(value, "tolist", None)
        if callable(tolist):
            return tolist()
        raise TypeError(f"a {type(value).__name__} is not JSON serializable")
    try:
        return json.dumps(result, allow_nan=False, default=plain, **options)
    except (TypeError, ValueError) as err:
        raise RuntimeError(f"the result cannot be written as JSON: {err}") from None


def shorten(text: str, width: int = 40) -> str:
    """`text` quoted, cut to `width` characters with its length said when longer."""
    return repr(text) if len(text) <= width else f"{text[:width]!r}... ({len(text)} characters)"


def load_model(model: str, device: str, dtype: Any, skills: Iterable[str],
               backend: str = "auto") -> Model:
    """photon_core.load (the registry refuses a config.json that is not one, naming it); any other
    failure of a loader is put down to the checkpoint, naming it (--debug shows where it happened)."""
    import photon_core
    from photon_core import registry
    from photon_core.contracts import ContractError

    skills = tuple(skills)
    # ModelNotFound says where it looked, and hints only at models of families offering `skills`
    checkpoint = registry.resolve(model, skills)
    try:
        return photon_core.load(model, device=device, dtype=dtype, backend=backend, skills=skills)
    except (FileNotFoundError, NotImplementedError, ValueError, ContractError):
        raise   # the registry's and loaders' own messages name the checkpoint and the reason; a
        # model short of its family's contract is the family's fault, not the checkpoint's
    except Exception as err:  # noqa: BLE001 - a malformed checkpoint can fail anywhere in a loader
        raise UserError(f"cannot load the model {model!r} ({checkpoint.path}): "
                        f"{type(err).__name__}: {err}") from err
