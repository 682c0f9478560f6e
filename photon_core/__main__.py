"""Command line: `python -m photon_core COMMAND ...` (transcribe, detect, ...), results as JSON.

The commands come from the model families in photon_core.registry: each family names its CLI
module (models/<family>/cli.py: `add_commands(subparsers)`, each subcommand setting `run=` to a
function of the parsed args that returns an exit code). A command offered by several families is
registered once, by the first; it loads whatever `--model` names, and the checkpoint decides the
family.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable

from photon_core import registry


class _FirstOneWins:
    """The subparsers, but a command name already taken gets a parser nobody will call: the
    command registered first already serves every family with that skill."""

    def __init__(self, subparsers: argparse._SubParsersAction) -> None:
        self.subparsers = subparsers
        self.taken: set[str] = set()

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        if name in self.taken:
            return argparse.ArgumentParser(prog=name, add_help=False)
        self.taken.add(name)
        return self.subparsers.add_parser(name, **kwargs)


def build_parser(families: Iterable[registry.Family] | None = None) -> argparse.ArgumentParser:
    families = list(registry.families() if families is None else families)
    parser = argparse.ArgumentParser(
        prog="python -m photon_core", description=__doc__.splitlines()[0],
        epilog="model families (recognised from the checkpoint given with --model): "
               + "; ".join(f.describe() for f in families))
    sub = parser.add_subparsers(dest="command", required=True)
    commands = _FirstOneWins(sub)
    for module in dict.fromkeys(f.cli for f in families if f.cli):
        importlib.import_module(module).add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
