"""The ``pipesim`` command line.

Each subcommand lives in its own module under ``pipesim.cli`` and registers
itself with ``register(subparsers)``; heavy dependencies (torch, plotly) are imported
inside the command that needs them, so ``pipesim simulate`` never loads torch.

``main`` is the one error boundary: whatever a command raises becomes one line on
stderr naming the command, with exit status 2 for a bad input (a flag, a file) and 1
for anything else; ``--verbose`` shows the traceback instead. Output paths are
checked before the command starts (``pipesim.cli.files``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from pipesim.cli.files import PLOTLY_MODES, check_outputs

# Subcommand modules, in the order ``pipesim --help`` lists them.
COMMAND_MODULES = (
    "demo",
    "simulate",
    "sweep",
    "plan",
    "models",
    "show",
    "export",
    "draw",
    "topology",
    "run",
    "profile",
    "bench_comm",
    "compare",
)

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_BROKEN_PIPE = 141  # what a shell reports for a command killed by SIGPIPE


class CommandError(Exception):
    """An error in what the user asked for: printed as one line, exit status 2."""


def version() -> str:
    """The installed distribution's version (the source tree's when run uninstalled)."""
    from importlib.metadata import PackageNotFoundError  # noqa: PLC0415
    from importlib.metadata import version as distribution_version  # noqa: PLC0415

    try:
        return distribution_version("pipesim")
    except PackageNotFoundError:
        return "unknown (not installed)"


class VersionAction(argparse.Action):
    """``--version``: the version looked up only when asked for (reading the installed
    distribution's metadata costs every other command a few hundredths of a second)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str = "show program's version number and exit") -> None:
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        parser._print_message(f"pipesim {version()}\n", sys.stdout)
        parser.exit()


def subparsers_of(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every parser below ``parser`` (``topology show`` included), depth first."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                found += [child, *subparsers_of(child)]
    return found


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    """What every subcommand takes: ``--verbose``, and ``--plotly`` where it draws charts.

    Added here, once, so a command (or a flag added to one later) cannot miss them;
    abbreviations are switched off so ``--dtype`` never silently means ``--dtype-bytes``.
    """
    parser.allow_abbrev = False
    options = parser._option_string_actions
    if "--verbose" not in options:
        # SUPPRESS: a subcommand's default must not overwrite ``pipesim --verbose CMD``.
        parser.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                            help="show the Python traceback when the command fails")
    if "--html" in options and "--plotly" not in options:
        parser.add_argument("--plotly", choices=PLOTLY_MODES, default="inline",
                            help="charts embed plotly.js (inline, ~4.8 MB, opens offline; default) "
                                 "or load it from the plotly CDN (cdn, small files, needs the network)")


NO_VALUE_ACTIONS = (argparse._HelpAction, argparse._VersionAction, argparse._StoreTrueAction,
                    argparse._StoreFalseAction, argparse._CountAction, argparse._StoreConstAction)


def state_defaults(parser: argparse.ArgumentParser) -> None:
    """Every listed flag that takes a value says its default in ``--help``: where its
    own help does not, ``(default: X)`` is added, ``none`` for a flag that is off
    unless given (an output path, an optional input)."""
    for action in parser._actions:
        if (not action.option_strings or action.required or action.help == argparse.SUPPRESS
                or isinstance(action, NO_VALUE_ACTIONS) or "default" in (action.help or "")):
            continue
        default = action.default
        if default is None or default == [] or default is argparse.SUPPRESS:
            stated = "none"
        else:
            stated = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        stated = stated.replace("%", "%%")
        action.help = f"{action.help} (default: {stated})" if action.help else f"default: {stated}"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser, with every subcommand that is installed; with ``command``, with
    that subcommand alone (what parsing its command line needs: the other commands'
    modules and their imports are not loaded)."""
    parser = argparse.ArgumentParser(
        prog="pipesim",
        description="Simulate, run and compare pipeline-parallel training schedules.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action=VersionAction)
    parser.add_argument("--verbose", action="store_true", help="show the Python traceback when a command fails")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES if command is None else (command,):
        try:
            module = importlib.import_module(f"pipesim.cli.{name}")
        except ModuleNotFoundError as error:
            if error.name == f"pipesim.cli.{name}":
                continue  # that command is not part of this build
            raise
        module.register(subparsers)
    for child in subparsers_of(parser):
        add_common_flags(child)
        state_defaults(child)
    return parser


def command_of(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is no flag: the top-level flags
    take no value), or None if that is no subcommand (then the full parser answers)."""
    word = next((arg for arg in argv if not arg.startswith("-")), None)
    return word if word in COMMAND_MODULES else None


def error_line(command: str, error: BaseException) -> tuple[str, int]:
    """The one line printed for ``error``, and the exit status."""
    prefix = f"pipesim {command}: error:"
    if isinstance(error, OSError) and error.filename is not None:
        reason = "no such file" if isinstance(error, FileNotFoundError) else (error.strerror or str(error)).lower()
        message, status = f"{reason}: {error.filename}", EXIT_BAD_INPUT
    elif isinstance(error, (CommandError, ValueError, OSError)):
        message, status = str(error), EXIT_BAD_INPUT
    else:
        message = f"internal error: {type(error).__name__}: {error} (run with --verbose for the traceback)"
        status = EXIT_FAILED
    return f"{prefix} {' '.join(message.split())}", status


def silence_stdout() -> None:
    """After the reader of our stdout went away (``pipesim show | head``), point stdout
    at /dev/null so the interpreter's final flush does not fail a second time."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass  # stdout is not a real file (a test's capture): nothing to flush at exit
    finally:
        os.close(devnull)


NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$", re.IGNORECASE)


def negative_values_joined(argv: list[str]) -> list[str]:
    """``--bwd -2e-3`` as ``--bwd=-2e-3``: argparse takes ``-2e-3`` for a flag (it knows
    ``-2`` and ``-2.5`` as numbers, not the exponent form) and prints the whole usage;
    joined, the value reaches the flag's own check, whose error names it."""
    joined: list[str] = []
    for token in argv:
        previous = joined[-1] if joined else ""
        if NEGATIVE_NUMBER.match(token) and previous.startswith("-") and not NEGATIVE_NUMBER.match(previous) \
                and "=" not in previous and previous != "--":
            joined[-1] = f"{previous}={token}" if previous.startswith("--") else previous + token
        else:
            joined.append(token)
    return joined


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pipesim`` console script."""
    argv = negative_values_joined(sys.argv[1:] if argv is None else [str(arg) for arg in argv])
    parser = build_parser(command_of(argv))
    if not argv:
        parser.print_help()
        return 0
    args, leftovers = parser.parse_known_args(argv)
    if leftovers and getattr(args, "command", None):  # a flag the command lacks: one line saying what instead
        from pipesim.cli.unknown_flags import unknown_arguments_line  # noqa: PLC0415

        print(unknown_arguments_line(args.command, leftovers, build_parser()), file=sys.stderr)
        return EXIT_BAD_INPUT
    if leftovers:
        parser.parse_args(argv)  # argparse's own answer to a top-level flag it does not know
    if args.command is None:  # only top-level flags, e.g. ``pipesim --verbose``
        parser.print_help()
        return 0
    try:
        check_outputs(args)
        status = int(args.handler(args) or 0)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if getattr(args, "verbose", False):
            raise
        line, status = error_line(args.command, error)
        print(line, file=sys.stderr)
        return status


def entry() -> None:
    """The ``pipesim`` console script: ``main``, then the process ends at once. A large
    simulated step leaves a million objects behind; the interpreter's own shutdown would
    collect and free them one by one (a fifth of a second for p=64, m=512) only for the
    process to end. Everything written was written and closed by then; the streams are
    flushed here."""
    status = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # the reader went away, or the stream is closed
            pass
    os._exit(status)


if __name__ == "__main__":
    entry()
