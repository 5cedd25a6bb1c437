"""One line for a flag the command does not take, saying what to type instead.

argparse answers ``pipesim simulate --gpus 16`` with the top-level usage and
"pipesim: error: unrecognized arguments", which names neither the command nor what it
takes instead. A user moving between commands (plan's ``--gpus`` to simulate, run's
``--batch-size`` to simulate) or mistyping a flag (``--microbatch``) should hear, in one
line: which other command has that flag, the nearest flags this command has, and where
the two commands differ in how they size a job, how to say the same thing here.
"""

from __future__ import annotations

import argparse
import difflib

# What a command takes instead of another command's flag, where the two size a job in
# different terms: (command, flag) -> the sentence
INSTEAD = {
    ("simulate", "--gpus"): "simulate runs one layout, whose GPUs are its ranks: --pp x --dp x --tp x --cp "
                            "(--ep folds into them); --topology ib or ethernet takes --nodes",
    ("sweep", "--gpus"): "sweep's GPUs are its layout's ranks: --pp x --dp x --tp x --cp; --topology ib or "
                         "ethernet takes --nodes",
    ("simulate", "--global-batch"): "simulate's global batch is --dp x --microbatches x --microbatch-size",
    ("simulate", "--batch-size"): "simulate's global batch is --dp x --microbatches x --microbatch-size",
    ("plan", "--pp"): "plan searches pp itself; --schedules, --virtual-stages, --cp, --ep and --zero narrow its "
                      "search, or simulate the layout you have in mind",
    ("plan", "--tp"): "plan searches tp itself (within --gpus-per-node); simulate the layout you have in mind",
    ("plan", "--dp"): "plan's dp is what --gpus leaves after tp x pp x cp; simulate the layout you have in mind",
    ("plan", "--schedule"): "plan takes --schedules, a comma-separated list",
    ("plan", "--microbatches"): "plan derives the microbatches from --global-batch, dp and --microbatch-sizes",
}


NEAR = 0.75  # difflib's ratio for "did you mean": --microbatch for --microbatches, not --foo for --fwd
NEAR_SPREAD = 0.05  # ... and of those, the ones about as near as the nearest


def flag_of(token: str) -> str | None:
    """The flag a leftover command-line word names (``--gpus=16`` names ``--gpus``), or
    None for a value."""
    return token.split("=", 1)[0] if token.startswith("-") and len(token) > 1 else None


def commands_of(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands' parsers of ``parser`` (the full one), by name."""
    return next(action.choices for action in parser._actions if isinstance(action, argparse._SubParsersAction))


def own_flags(command: argparse.ArgumentParser) -> list[str]:
    """The flags a command's parser lists (``run``'s hidden stand-ins for the flags it
    refuses are not its own)."""
    return [flag for action in command._actions if action.help != argparse.SUPPRESS for flag in action.option_strings]


def nearest(flag: str, flags: list[str]) -> list[str]:
    """The flags nearest ``flag`` by difflib's ratio: those within ``NEAR_SPREAD`` of the
    best, if the best reaches ``NEAR`` (``--microbatch``: ``--microbatches`` alone, not
    ``--microbatch-size`` beside it; ``--dtyp``: ``--dtype``, not ``--tp``)."""
    scored = sorted(((difflib.SequenceMatcher(None, flag, other).ratio(), other) for other in flags), reverse=True)
    if not scored or scored[0][0] < NEAR:
        return []
    return [other for ratio, other in scored[:3] if ratio >= scored[0][0] - NEAR_SPREAD]


def unknown_arguments_line(command: str, leftovers: list[str], full_parser: argparse.ArgumentParser) -> str:
    """The one-line error for ``leftovers`` that ``command`` did not take: for the first
    flag among them, the other commands that have it, the nearest of this command's own
    flags, and how to say it here (``INSTEAD``); for words that are no flag, the words."""
    flags = [flag for flag in map(flag_of, leftovers) if flag]
    if not flags:
        return f"pipesim {command}: error: unexpected argument(s) {' '.join(leftovers)}"
    flag = flags[0]
    commands = commands_of(full_parser)
    owners = [name for name, parser in commands.items() if name != command and flag in own_flags(parser)]
    line = f"pipesim {command}: error: {command} has no {flag}"
    if owners:
        named = ", ".join(owners[:3]) + (f" and {len(owners) - 3} more" if len(owners) > 3 else "")
        line += f" (a flag of {named})"
    sentence = INSTEAD.get((command, flag))
    near = [] if sentence else nearest(flag, own_flags(commands[command]))
    if sentence:
        line += f"; {sentence}"
    elif near:
        line += f"; did you mean {' or '.join(near)}?"
    if len(flags) > 1:
        line += f"; also unknown here: {' '.join(flags[1:])}"
    return f"{line}; see pipesim {command} --help"
