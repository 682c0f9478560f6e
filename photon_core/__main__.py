"""Command line: `python -m photon_core COMMAND ...` (transcribe, detect, ...), results as JSON.

The commands come from the model families in photon_core.registry: each family names its CLI
module (models/<family>/cli.py: `add_commands(subparsers)`, each subcommand setting `run=` to a
function of the parsed args that returns an exit code). A command offered by several families is
registered once, by the first; it loads whatever `--model` names, and the checkpoint decides the
family.

A mistake in what the user gave (a file, an option, a prompt the model refuses) is one line on
stderr and exit status 2; an internal failure is one line and status 1. `--debug` shows the
traceback instead.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable

from photon_core import registry
from photon_core.cli_checks import UserError

PROG = "python -m photon_core"


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (the usage text is one --help away)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_debug(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument("--debug", action="store_true", default=default,
                        help="on an error, show the traceback rather than one line")


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
        parser = self.subparsers.add_parser(name, **kwargs)
        # SUPPRESS: a subcommand's default must not undo `--debug` given before the command.
        _add_debug(parser, argparse.SUPPRESS)
        return parser


def build_parser(families: Iterable[registry.Family] | None = None) -> argparse.ArgumentParser:
    families = list(registry.families() if families is None else families)
    parser = OneLineParser(
        prog=PROG, description=__doc__.splitlines()[0],
        epilog="model families (recognised from the checkpoint given with --model): "
               + "; ".join(f.describe() for f in families))
    _add_debug(parser, False)
    sub = parser.add_subparsers(dest="command", required=True)
    commands = _FirstOneWins(sub)
    for module in dict.fromkeys(f.cli for f in families if f.cli):
        importlib.import_module(module).add_commands(commands)
    return parser


def one_line(err: BaseException) -> str:
    """The exception's message on one line (the type's name when it has none)."""
    return " ".join(str(err).split()) or type(err).__name__


# What a user's input can raise, from argument checks, file readers, the registry and the models'
# own argument checks; anything else is a fault of ours.
USER_ERRORS = (UserError, ValueError, OSError, NotImplementedError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as err:
        if args.debug:
            raise
        print(f"{PROG} {args.command}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - one line instead of a traceback, unless --debug
        if args.debug:
            raise
        print(f"{PROG} {args.command}: internal error: {type(err).__name__}: {one_line(err)} "
              f"(run again with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
