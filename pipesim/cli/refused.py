"""The flags of ``pipesim simulate`` and ``pipesim plan`` that ``pipesim run`` does not
execute, refused in one line that says so.

A user who moves a command line from ``simulate`` to ``run`` (or a plan row to a run)
should hear "``--cp`` is simulate-only", not argparse's "unrecognized arguments", and
never have a flag silently dropped. The list is read from the other commands' own
parsers when ``run``'s parser is built, so a flag added to ``simulate`` or ``plan``
later is refused by ``run`` until ``run`` learns it. The same holds for the values of a
flag both take: ``simulate --p2p torch-runtime`` (torch's pipelining runtime's rule) is
refused by ``run`` as simulate-only, naming what ``run`` executes, not as argparse's
"invalid choice". The stand-in flags and the sentences are the executor's
(``executor.refused_flags``, ``executor.refused_values``), which ``python -m executor``
uses with a table of its own.
"""

from __future__ import annotations

import argparse
import importlib

from executor import refused_flags
from executor.refused_values import admit_refused_values, value_refusal

SOURCES = ("simulate", "plan")  # the commands whose flags run mirrors


def other_flags() -> dict[str, tuple[argparse.Action, tuple[str, ...]]]:
    """Every option string of the source commands: its action and the commands that take it."""
    flags: dict[str, tuple[argparse.Action, tuple[str, ...]]] = {}
    for name in SOURCES:
        holder = argparse.ArgumentParser(add_help=False)
        importlib.import_module(f"pipesim.cli.{name}").register(holder.add_subparsers(dest="command"))
        (parser,) = holder._subparsers._group_actions[0].choices.values()
        for action in parser._actions:
            for flag in action.option_strings:
                owners = flags[flag][1] + (name,) if flag in flags else (name,)
                flags[flag] = (flags.get(flag, (action,))[0], owners)
    return flags


def add_refused_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Add to ``parser`` (run's) every flag of simulate and plan it lacks, hidden from
    the option list, parsed with the same number of values, and let its own flags parse
    the values only those commands take (``add_refused_values``); return the refused
    flags and values (``--flag value``), sorted."""
    others = other_flags()
    return sorted(add_missing_flags(parser, others)) + add_refused_values(parser, others)


def add_missing_flags(parser: argparse.ArgumentParser,
                      others: dict[str, tuple[argparse.Action, tuple[str, ...]]]) -> list[str]:
    """The flags of ``others`` that ``parser`` lacks, added as refused flags
    (``executor.refused_flags``, which ``python -m executor`` uses too), each parsing as
    many values as the flag it stands for."""
    taken = {flag: (values_taken(action), owners) for flag, (action, owners) in others.items()}
    return refused_flags.add_refused_flags(parser, taken)


def values_taken(action: argparse.Action) -> int | str | None:
    """How many values ``action``'s flag takes, as argparse's nargs (0 for a switch)."""
    return 0 if action.nargs == 0 or isinstance(action, argparse._StoreTrueAction) else action.nargs


def add_refused_values(parser: argparse.ArgumentParser,
                       others: dict[str, tuple[argparse.Action, tuple[str, ...]]]) -> list[str]:
    """For each flag of ``parser`` with choices, accept the choices the same flag of
    simulate or plan has beyond them (``executor.refused_values``, which ``python -m
    executor`` uses too), so ``refusal`` can name them. Returns ``--flag value`` for each,
    sorted."""
    return admit_refused_values(parser, {flag: (action.choices, owners) for flag, (action, owners) in others.items()})


def refusal(args: argparse.Namespace) -> str | None:
    """The one-line refusal for the first such flag given, else for a value only simulate
    or plan takes, or None."""
    return refused_flags.flag_refusal(args, "pipesim run", "run") or value_refusal(args, "pipesim run", "run")
