"""The flags of ``pipesim simulate`` and ``pipesim plan`` that ``pipesim run`` does not
execute, refused in one line that says so.

A user who moves a command line from ``simulate`` to ``run`` (or a plan row to a run)
should hear "``--cp`` is simulate-only", not argparse's "unrecognized arguments", and
never have a flag silently dropped. The list is read from the other commands' own
parsers when ``run``'s parser is built, so a flag added to ``simulate`` or ``plan``
later is refused by ``run`` until ``run`` learns it. The same holds for the values of a
flag both take: ``simulate --recompute norm-mla-up`` (DeepSeek-V3's recomputation) is
refused by ``run`` as simulate-only, naming what ``run`` executes, not as argparse's
"invalid choice".
"""

from __future__ import annotations

import argparse
import importlib

SOURCES = ("simulate", "plan")  # the commands whose flags run mirrors


class RefusedFlag(argparse.Action):
    """Parses like the flag it stands for, and remembers that it was given."""

    def __init__(self, option_strings: list[str], dest: str, owners: tuple[str, ...] = (), **kwargs) -> None:
        self.owners = owners
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        given = getattr(namespace, self.dest, None) or []
        setattr(namespace, self.dest, [*given, (option_string, self.owners)])


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


class ChoicesAndRefused(tuple):
    """A flag's own choices (what ``--help`` and argparse's errors list) that also admits
    ``refused``, the values only simulate or plan take, so they reach ``refusal``."""

    def __new__(cls, own: tuple, refused: tuple) -> ChoicesAndRefused:
        choices = super().__new__(cls, own)
        choices.refused = refused
        return choices

    def __contains__(self, value: object) -> bool:
        return tuple.__contains__(self, value) or value in self.refused


def add_refused_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Add to ``parser`` (run's) every flag of simulate and plan it lacks, hidden from
    the option list, parsed with the same number of values, and let its own flags parse
    the values only those commands take (``add_refused_values``); return the refused
    flags and values (``--flag value``), sorted."""
    others = other_flags()
    return sorted(add_missing_flags(parser, others)) + add_refused_values(parser, others)


def add_missing_flags(parser: argparse.ArgumentParser,
                      others: dict[str, tuple[argparse.Action, tuple[str, ...]]]) -> list[str]:
    """The flags of ``others`` that ``parser`` lacks, added as ``RefusedFlag``s."""
    taken = set(parser._option_string_actions)
    refused = []
    for flag, (action, owners) in others.items():
        if flag in taken:
            continue
        nargs = 0 if action.nargs == 0 or isinstance(action, argparse._StoreTrueAction) else action.nargs
        parser.add_argument(flag, action=RefusedFlag, dest="refused_flags", owners=owners, nargs=nargs,
                            default=None, help=argparse.SUPPRESS)
        refused.append(flag)
    return refused


def add_refused_values(parser: argparse.ArgumentParser,
                       others: dict[str, tuple[argparse.Action, tuple[str, ...]]]) -> list[str]:
    """For each flag of ``parser`` with choices, accept the choices the same flag of
    simulate or plan has beyond them, so ``refusal`` can name them; ``--help`` and
    argparse's "invalid choice" still list the flag's own. Returns ``--flag value`` for
    each, sorted."""
    refused_values: dict[str, tuple[str, tuple, tuple[str, ...]]] = {}  # dest -> flag, run's choices, owners
    listed = []
    for flag, action in parser._option_string_actions.items():
        if flag not in others or action.choices is None or action.dest in refused_values:
            continue
        other, owners = others[flag]
        extra = tuple(value for value in other.choices or () if value not in action.choices)
        if not extra:
            continue
        own = tuple(action.choices)
        action.choices = ChoicesAndRefused(own, extra)
        refused_values[action.dest] = (flag, own, owners)
        listed += [f"{flag} {value}" for value in extra]
    parser.set_defaults(refused_values=refused_values)
    return sorted(listed)


def refusal(args: argparse.Namespace) -> str | None:
    """The one-line refusal for the first such flag given, else for a value only simulate
    or plan takes, or None."""
    given = getattr(args, "refused_flags", None)
    if given:
        flag, owners = given[0]
        return (f"{flag} is {_only(owners)}: pipesim run does not execute it (it is a flag of pipesim "
                f"{' and '.join(owners)}); drop it to run, or see docs/executor.md for what run executes")
    for dest, (flag, own, owners) in (getattr(args, "refused_values", None) or {}).items():
        value = getattr(args, dest, None)
        if value is not None and value not in own:
            return (f"{flag} {value} is {_only(owners)}: pipesim run does not execute it (run executes {flag} "
                    f"{', '.join(map(str, own))}); see docs/executor.md for what run executes")
    return None


def _only(owners: tuple[str, ...]) -> str:
    """``simulate-only`` where simulate takes it, else the one command that does."""
    return "simulate-only" if "simulate" in owners else f"{owners[0]}-only"
