"""Model families, and which one a checkpoint belongs to, judged from its files alone.

A family lives in `photon_core/models/<family>/` and declares itself there with a module-level
`FAMILY = Family(...)`: the skills it offers, a probe over the checkpoint's files, its load entry
and its command-line module. The registry finds families by importing every package under
`photon_core.models`, so adding a family means adding its folder and nothing else. Packages
named in $PHOTON_EXTRA_FAMILIES (comma-separated module names) are asked too: families that must
not ship, such as the test suite's toy family.

A model name is first resolved to files (photon_core.weights.resolve); then every family's probe
looks at those files (config.json, CTranslate2 header, tensor names; never a full weight load,
never pickled code) and exactly one must claim them. Words in the path play no part.
"""
from __future__ import annotations

import functools
import importlib
import os
import pkgutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from photon_core.contracts import Model
from photon_core.weights.checkpoint_files import CheckpointFiles
from photon_core.weights.resolve import Resolved, resolve as resolve_files

# Every skill a family may offer; the nodes and the command line speak in these names.
SKILLS = ("transcribe", "detect", "point", "caption", "query", "segment")


def _never(files: CheckpointFiles) -> str | None:
    return None


def _nowhere(name: str) -> Sequence[str | Path]:
    return ()


@dataclass(frozen=True)
class Family:
    name: str
    skills: frozenset[str]
    looks_for: str                                   # what `recognise` checks, said in errors
    recognise: Callable[[CheckpointFiles], bool]
    # (checkpoint, device, dtype, backend) -> model, meeting photon_core.contracts
    load: Callable[[Resolved, str, Any, str], Model]
    cli: str | None = None                           # module with add_commands(subparsers)
    # A checkpoint this family recognises but cannot run yet, and why (e.g. Moondream 3).
    refuse: Callable[[CheckpointFiles], str | None] = _never
    # Places a short name of this family may be: package folders, Hugging Face ids.
    places: Callable[[str], Sequence[str | Path]] = _nowhere
    hints: tuple[str, ...] = ()                      # how to get weights, for "not found" errors
    # device -> the dtype `load` picks for dtype=None, where None means that dtype and nothing more:
    # shared engines then key the two alike. None where None means more (Whisper's CPU defaults).
    auto_dtype: Callable[[str], Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "skills", frozenset(self.skills))
        unknown = self.skills - set(SKILLS)
        if unknown:
            raise ValueError(f"family {self.name!r}: unknown skills {sorted(unknown)}; known: {SKILLS}")

    def describe(self) -> str:
        return f"{self.name} ({', '.join(sorted(self.skills))})"


@dataclass(frozen=True)
class NotSupportedYet:
    """A checkpoint kind we can name but no family runs yet: better said plainly than "unknown"."""
    name: str
    recognise: Callable[[CheckpointFiles], bool]
    message: str


NOT_SUPPORTED_YET: tuple[NotSupportedYet, ...] = ()


class UnknownModelFamily(ValueError):
    pass


class MissingSkills(ValueError):
    pass


class BadCheckpointConfig(ValueError):
    """A checkpoint's config.json that cannot be what a config is; the message names the file."""


def check_config(files: CheckpointFiles) -> None:
    """BadCheckpointConfig when the checkpoint's config.json is there but not a JSON object. Checked
    here, before any family's probe reads it, so that the Python API, the nodes and the command line
    all refuse it with the same message (a probe would otherwise see "no config")."""
    if files.config_error is not None:
        raise BadCheckpointConfig(files.config_error)


def _asking(family: Family, files: CheckpointFiles, question: Callable[[CheckpointFiles], Any]) -> Any:
    """A family's probe or refusal on `files`. Probes read config.json's sections as the format
    defines them; one of the wrong type (`"text_config": 5`) makes them fail, and that is the
    config's fault, said naming the file rather than raised from inside the probe."""
    try:
        return question(files)
    except (AttributeError, TypeError, KeyError, ValueError) as err:
        if files.config is None:
            raise
        raise BadCheckpointConfig(f"{files.folder / 'config.json'}: not a {family.name} config as its "
                                  f"format defines one ({type(err).__name__}: {err})") from err


@dataclass(frozen=True)
class Recognised:
    family: Family
    checkpoint: Resolved
    files: CheckpointFiles

    def load(self, device: str, dtype: Any, backend: str) -> Model:
        """The family's model on these files, checked against photon_core.contracts (the protocol
        of every skill the family declares): the one place the API, the CLI and the nodes load."""
        from photon_core.contracts import check_model
        from photon_core.runtime.decode import engine_policy
        # "auto" on CUDA: each compiled decode step runs on the faster of the megakernel and the
        # per-op engine on this GPU (megakernel/engine_choice.py); "megakernel" asks for it alone.
        with engine_policy("auto" if backend == "auto" else "megakernel"):
            return check_model(self.family.load(self.checkpoint, device, dtype, backend), self.family.skills)


EXTRA_FAMILIES = "PHOTON_EXTRA_FAMILIES"


def families() -> tuple[Family, ...]:
    """Every family declared under photon_core.models, in package-name order, then those of the
    packages named in $PHOTON_EXTRA_FAMILIES, in the order named."""
    extra = os.environ.get(EXTRA_FAMILIES, "")
    return _families(tuple(name.strip() for name in extra.split(",") if name.strip()))


@functools.cache
def _families(extra: tuple[str, ...]) -> tuple[Family, ...]:
    import photon_core.models as models

    found: dict[str, Family] = {}
    ours = [info.name for info in pkgutil.iter_modules(models.__path__, models.__name__ + ".") if info.ispkg]
    for name in ours + list(extra):
        family = getattr(importlib.import_module(name), "FAMILY", None)
        if not isinstance(family, Family):
            if name in extra:   # named on purpose: a typo must not pass as "no such family"
                raise ValueError(f"${EXTRA_FAMILIES}: package {name!r} declares no FAMILY = Family(...)")
            continue
        if family.name in found:
            raise ValueError(f"two packages declare the model family {family.name!r}")
        found[family.name] = family
    return tuple(found.values())


def families_with(skill: str) -> list[Family]:
    _check_skill_names([skill])
    return [f for f in families() if skill in f.skills]


def _check_skill_names(skills: Iterable[str]) -> None:
    unknown = sorted(set(skills) - set(SKILLS))
    if unknown:
        raise ValueError(f"unknown skills {unknown}; known: {', '.join(SKILLS)}")


def require_skills(family: Family, skills: Iterable[str]) -> None:
    """MissingSkills naming what `family` lacks and which families have it."""
    skills = list(skills)
    _check_skill_names(skills)
    missing = sorted(set(skills) - family.skills)
    if missing:
        able = [f.name for f in families() if set(missing) <= f.skills]
        raise MissingSkills(
            f"a {family.name} model cannot {', '.join(missing)} (it offers "
            f"{', '.join(sorted(family.skills))}); families that can: {', '.join(able) or 'none yet'}")


def resolve(name: str | Path, skills: Iterable[str] = ()) -> Resolved:
    """The files `name` stands for; ModelNotFound (a FileNotFoundError) says where it looked and how
    to get weights: the hints of the families that offer every one of `skills` (of all families
    when none is asked for), so that a detect command is not told to download a speech model."""
    text = str(name)
    skills = set(skills)
    _check_skill_names(skills)
    # A generator: families are asked about places only when `name` is not a local path.
    places = (place for family in families() for place in family.places(text))
    hints = [hint for family in families() if skills <= family.skills for hint in family.hints]
    return resolve_files(name, places, hints)


def recognise(name: str | Path, skills: Iterable[str] = ()) -> Recognised:
    """Resolve `name` and find its family from the files. ModelNotFound hints at models of the
    families offering `skills` (whether the family found has them is require_skills' question);
    UnknownModelFamily lists what was found and what each family looks for; BadCheckpointConfig
    names a config.json that is not one; NotImplementedError for checkpoints known but not runnable."""
    checkpoint = resolve(name, skills)
    files = CheckpointFiles(checkpoint.path)
    check_config(files)
    claims = [family for family in families() if _asking(family, files, family.recognise)]
    if len(claims) > 1:   # a probe too loose: better loud than the first one silently winning
        raise UnknownModelFamily(f"{checkpoint.path}: claimed by several families "
                                 f"({', '.join(f.name for f in claims)}); found {files.describe()}")
    if claims:
        reason = _asking(claims[0], files, claims[0].refuse)
        if reason:
            raise NotImplementedError(f"{checkpoint.path}: {reason}")
        return Recognised(claims[0], checkpoint, files)
    for kind in NOT_SUPPORTED_YET:
        if kind.recognise(files):
            raise NotImplementedError(f"{checkpoint.path}: {kind.message} (supported: "
                                      f"{', '.join(f.describe() for f in families())})")
    looked = "; ".join(f"{f.describe()}: {f.looks_for}" for f in families())
    raise UnknownModelFamily(f"cannot tell which model family {str(name)!r} ({checkpoint.path}) is: "
                             f"found {files.describe()}. Supported families and what identifies "
                             f"them: {looked}")
