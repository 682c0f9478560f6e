"""Command line: `python -m photon_core {transcribe,detect,point,caption,query} ...`, results as JSON.

Each model family registers its own subcommands (models/<family>/cli.py: `add_commands(subparsers)`,
each subcommand setting `run=` to a function of the parsed args that returns an exit code).
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = ("photon_core.models.whisper.cli", "photon_core.models.moondream.cli")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m photon_core", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_commands(sub)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
