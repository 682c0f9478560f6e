"""Choosing a backend: "reference" (PyTorch), "triton" (per-op kernels) or "megakernel".

"auto" picks reference on CPU and the megakernel on CUDA, where a model loaded through
photon_core.load runs each compiled decode step on the faster of the megakernel and the per-op
engine on that GPU (megakernel/engine_choice.py; "megakernel" named: the megakernel alone). Where
the kernels cannot run on that GPU (no Triton, as on many Jetson installs; a Triton before 3.3; a
GPU before sm_80), "auto" runs the reference backend there, PyTorch on the GPU, and logs why once;
"triton" or "megakernel" named there is refused with the same reason. Triton code on a CPU device runs only under
Triton's interpreter (TRITON_INTERPRET=1, set before triton is first imported): that is a test mode,
hundreds of times slower than PyTorch, so it is never chosen implicitly.
"""
from __future__ import annotations

import importlib
import logging
import os
import re
from types import ModuleType

import torch

BACKENDS = ("reference", "triton", "megakernel")
# What the kernels are built and checked for (README "Supported versions"): Triton 3.3 (torch 2.7)
# on; bf16 and the loads they issue need an Ampere or newer GPU.
MIN_TRITON = (3, 3)
MIN_CAPABILITY = (8, 0)

_log = logging.getLogger("photon_core")
_told: set[tuple[str, str]] = set()   # (device, reason) already logged: loads call get_backend twice


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def fallbacks() -> dict[str, str]:
    """Per CUDA device where `auto` ran the reference backend in this process: why."""
    return {device: why for device, why in sorted(_told)}


def triton_unusable(device: torch.device) -> str:
    """Why our Triton kernels cannot run on the CUDA `device`, or "" when they can."""
    try:
        import triton
    except ModuleNotFoundError as err:
        if err.name != "triton":   # triton is there, a module it imports is not: a broken install
            return f"Triton cannot be imported ({type(err).__name__}: {err}); reinstall it (3.3 or newer)"
        return (f"Triton is not installed ({err}); it comes with PyPI's CUDA torch builds, or `pip install "
                f"triton` (3.3 or newer) where one is built for this platform")
    except Exception as err:  # noqa: BLE001 - a broken install (a library it loads, its backends) is no Triton either
        return f"Triton cannot be imported ({type(err).__name__}: {err}); reinstall it (3.3 or newer)"
    # A folder left by an uninstall imports as a namespace package, without a version.
    found = str(getattr(triton, "__version__", ""))
    version = tuple(int(n) for n in re.findall(r"\d+", found)[:2])
    if not version:
        return (f"the Triton found ({getattr(triton, '__path__', None) or triton!r}) has no version: a broken "
                "or partly removed install; reinstall it (3.3 or newer)")
    if version < MIN_TRITON:
        return f"Triton {found} is older than 3.3, the oldest the kernels are built for"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < MIN_CAPABILITY:
            return (f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}; the kernels need sm_80 (Ampere) "
                    "or newer")
    return ""


def _check_triton_device(name: str, device: torch.device) -> None:
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"backend {name!r} on {device}: CUDA is not available in this PyTorch build")
        if why := triton_unusable(device):
            raise RuntimeError(f"backend {name!r} on {device}: {why}. Backend 'reference' (or 'auto') runs "
                               "PyTorch on the GPU")
        return
    if device.type != "cpu":
        raise RuntimeError(f"backend {name!r}: Triton kernels run on CUDA devices, not {device.type!r}")
    if not interpreter_enabled():
        raise RuntimeError(
            f"backend {name!r} on CPU needs Triton's interpreter: Triton compiles for GPUs only. For tests, "
            "set TRITON_INTERPRET=1 in the environment before Python imports triton (e.g. "
            "`TRITON_INTERPRET=1 python -m pytest ...`); for real CPU inference use backend 'reference'.")
    # triton.jit picks interpreter or compiler when a kernel is DEFINED: kernels imported before the
    # variable was set stay compiled and would fail on CPU tensors deep inside a launch.
    from photon_core.kernels import linear as _probe
    if type(_probe._linear_gemv_kernel).__name__ != "InterpretedFunction":
        raise RuntimeError(f"backend {name!r}: TRITON_INTERPRET=1 was set after photon_core.kernels was "
                           "imported; set it before the first import")


def get_backend(name: str = "auto", device: torch.device | str = "cpu") -> ModuleType:
    """The ops module for `name` on `device`. The megakernel module exposes the per-op functions too
    (prefill and anything outside a decode graph runs per-op) plus the graph builders."""
    device = torch.device(device)
    if name == "auto":
        name = "megakernel" if device.type == "cuda" else "reference"
        if name == "megakernel" and torch.cuda.is_available() and (why := triton_unusable(device)):
            if (str(device), why) not in _told:
                _told.add((str(device), why))
                _log.warning(f"backend auto on {device}: {why}; running the reference backend (PyTorch) on the GPU")
            name = "reference"
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS} or 'auto'")
    if name == "reference":
        return importlib.import_module("photon_core.backends.reference")
    _check_triton_device(name, device)
    if name == "triton":
        return importlib.import_module("photon_core.backends.triton")
    return importlib.import_module("photon_core.megakernel")
