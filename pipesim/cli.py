"""The ``pipesim`` command line.

Each subcommand lives in its own module under ``pipesim.commands`` and registers
itself with ``register(subparsers)``; heavy dependencies (torch, plotly) are imported
inside the command that needs them, so ``pipesim simulate`` never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order ``pipesim --help`` lists them.
COMMAND_MODULES = (
    "demo",
    "simulate",
    "sweep",
    "plan",
    "show",
    "export",
    "topology",
    "run",
    "profile",
    "bench_comm",
    "compare",
)


class CommandError(Exception):
    """An error in what the user asked for: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    """The full parser, with every subcommand that is installed."""
    parser = argparse.ArgumentParser(
        prog="pipesim",
        description="Simulate, run and compare pipeline-parallel training schedules.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"pipesim.commands.{name}")
        except ModuleNotFoundError as error:
            if error.name == f"pipesim.commands.{name}":
                continue  # that command is not part of this build
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pipesim`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (CommandError, ValueError, FileNotFoundError) as error:
        print(f"pipesim {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
