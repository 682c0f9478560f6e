"""What the end-to-end benchmark asks of each family: its tasks, its inputs, our model and the peer
on the same random weights, and how to run a concurrency level of requests on each side.

A family module (e2e_moondream, e2e_vlm, e2e_whisper, e2e_asr) defines a Family subclass per model.
`setup()` builds both sides (real shapes, or tiny ones for the CPU dry run); `ours(task, inputs)`
runs len(inputs) requests as our engine serves concurrent ones (one `batch` call: its requests
share every decode step), `peer(task, inputs)` as the peer would (transformers: one batched
`generate`; the public Moondream reference, which has no batch: one request after another, and
then `peer_serial` is True). Both return per-request token counts where they can, so the table
can show that both sides did the same work.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from e2e_phases import Clock


@dataclass(frozen=True)
class Task:
    """One task of a family: a skill on one input (an image size or an audio length)."""
    skill: str        # detect, point, caption, query, transcribe
    input: str        # "756x756", "1920x1080", "5 s", "30 s"
    tokens: int       # decode budget: max_tokens, objects (detect/point), or forced transcript tokens

    @property
    def name(self) -> str:
        return f"{self.skill} {self.input}"


@dataclass
class Side:
    """One side of a comparison: its label and its phase clock."""
    label: str
    clock: Clock
    serial: bool = False          # serves one request at a time (no batching)
    skip: str | None = None       # why this side does not run here (None: it runs)
    notes: list[str] = field(default_factory=list)


class Family(ABC):
    """Base of a family's benchmark; subclasses fill in the rest."""
    name = "?"
    kind = "vision"       # "vision" or "speech"
    peer_label = "?"
    with_peer = True      # False: setup builds ours only (a prewarm child)
    peer_compiled = False

    def __init__(self, device: Any, dtype: Any, tiny: bool, backend: str, ref_src: str | None) -> None:
        import torch

        from e2e_phases import cuda_sync, no_sync
        self.device, self.dtype, self.tiny, self.backend_name = torch.device(device), dtype, tiny, backend
        self.ref_src = ref_src
        sync = cuda_sync if self.device.type == "cuda" else no_sync
        self.sides = {"ours": Side("photon", Clock(sync)), "peer": Side(self.peer_label, Clock(sync))}
        self.notes: list[str] = []

    # -- what a family provides -----------------------------------------------------------------
    # (abstract: a family class that leaves one out cannot be made)
    @classmethod
    @abstractmethod
    def tasks(cls) -> list[Task]:
        """Its tasks, in the order a run takes them (known without building anything)."""

    @abstractmethod
    def setup(self) -> None:
        """Build our model and the peer on the same weights, and put their hooks on the clocks."""

    @abstractmethod
    def inputs(self, task: Task, n: int) -> list[Any]:
        """n requests' raw inputs (JPEG bytes or 16 kHz PCM), one per camera or microphone."""

    @abstractmethod
    def ours(self, task: Task, inputs: list[Any]) -> list[int]:
        """Our engine on the requests at once; tokens decoded per request."""

    @abstractmethod
    def peer(self, task: Task, inputs: list[Any]) -> list[int]:
        """The peer on the requests (batched, or one after another when serial); tokens per request."""

    def warm_bucket(self, batch: int) -> dict:
        """Build (or read from the build cache) our compiled step of one bucket with what is built
        with it (its device rounds): the prewarm children call this so that the measuring process
        finds every bucket built. The family's runtime.decode.CompiledSteps is `model.decode` (or
        `model.megakernel`: Qwen3-ASR)."""
        steps = getattr(self.model, "decode", None) or getattr(self.model, "megakernel", None)
        if steps is None or not hasattr(steps, "decoder"):
            return {"skipped": "no compiled steps on this backend"}
        steps.decoder(batch)
        return {"built": batch}

    @classmethod
    def cpu_refusal(cls) -> str | None:
        """Why this family's real shapes cannot run on this machine's CPU (None: they can)."""
        return None

    @classmethod
    def cpu_dtype(cls) -> str | None:
        """The dtype its real shapes take on the CPU when not the run's (None: the run's)."""
        return None

    def compile_peer(self) -> None:
        """The peer with torch.compile from now on (transformers: generate's own compilation of
        its step on a static cache)."""
        self.peer_compiled = True

    # -- shared helpers -------------------------------------------------------------------------
    def ops(self) -> Any:
        from photon_core.backends.select import get_backend
        return get_backend(self.backend_name, self.device)

    def compiled(self) -> bool:
        return bool(getattr(self.ops(), "COMPILES_STEPS", False))

    def skip_peer(self, reason: str) -> None:
        self.sides["peer"].skip = reason


def hf_random(cls: Any, cfg: Any, dtype: Any, device: Any, seed: int = 0) -> Any:
    """transformers' model with its own random init, built on `device` in `dtype`."""
    import torch
    torch.manual_seed(seed)
    with torch.device(device):
        return cls._from_config(cfg, dtype=dtype).eval()
