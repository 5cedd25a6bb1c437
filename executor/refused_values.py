"""Values of a run flag that only the simulator takes, refused in one line that names
what the executor runs instead.

``pipesim simulate --p2p torch-runtime`` (torch's pipelining runtime's rule) is
modelled, not executed; ``--recompute`` is listed too, so a recompute mode the simulator
learns before the executor does is refused the same way. A
user who moves such a command line to ``pipesim run`` or ``python -m executor`` should
hear that the value is simulate-only and what is executed, not argparse's "invalid
choice". Both entry points use this module: ``pipesim run`` hands it the choices of
simulate's and plan's own parsers (``pipesim.cli.refused``), ``python -m executor``,
which may not import the command line, the same tuples those parsers are built from
(``SIMULATOR_CHOICES``); a test holds the two lists equal.
"""

from __future__ import annotations

import argparse

from pipesim.model.spec import RECOMPUTE
from schedules.p2p import P2P_SEMANTICS

# flag -> (every value the simulator's commands take, those commands): the tuples
# pipesim.cli.options builds simulate's and plan's choices from.
SIMULATOR_CHOICES: dict[str, tuple[tuple, tuple[str, ...]]] = {
    "--recompute": (RECOMPUTE, ("simulate", "plan")),
    "--p2p": (P2P_SEMANTICS, ("simulate",)),
}


class ChoicesAndRefused(tuple):
    """A flag's own choices (what ``--help`` and argparse's errors list) that also admits
    ``refused``, the values only simulate or plan take, so they reach ``value_refusal``."""

    def __new__(cls, own: tuple, refused: tuple) -> ChoicesAndRefused:
        choices = super().__new__(cls, own)
        choices.refused = refused
        return choices

    def __contains__(self, value: object) -> bool:
        return tuple.__contains__(self, value) or value in self.refused


def admit_refused_values(parser: argparse.ArgumentParser,
                         others: dict[str, tuple[tuple, tuple[str, ...]]]) -> list[str]:
    """For each flag of ``parser`` with choices, accept the values ``others`` (flag ->
    the simulator's choices, the commands that take them) has beyond them, so
    ``value_refusal`` can name them; ``--help`` and argparse's "invalid choice" still list
    the flag's own. Returns ``--flag value`` for each, sorted."""
    refused_values: dict[str, tuple[str, tuple, tuple[str, ...]]] = {}  # dest -> flag, own choices, owners
    listed = []
    for flag, action in parser._option_string_actions.items():
        if flag not in others or action.choices is None or action.dest in refused_values:
            continue
        choices, owners = others[flag]
        extra = tuple(value for value in choices or () if value not in action.choices)
        if not extra:
            continue
        own = tuple(action.choices)
        action.choices = ChoicesAndRefused(own, extra)
        refused_values[action.dest] = (flag, own, owners)
        listed += [f"{flag} {value}" for value in extra]
    parser.set_defaults(refused_values=refused_values)
    return sorted(listed)


def value_refusal(args: argparse.Namespace, program: str, runner: str) -> str | None:
    """The one-line refusal of the first value given that only simulate or plan take,
    else None. ``program`` is the command that refuses (``pipesim run``), ``runner`` how
    the line names what it executes (``run``)."""
    for dest, (flag, own, owners) in (getattr(args, "refused_values", None) or {}).items():
        value = getattr(args, dest, None)
        if value is not None and value not in own:
            return (f"{flag} {value} is {only(owners)}: {program} does not execute it ({runner} executes {flag} "
                    f"{', '.join(map(str, own))}); see docs/executor.md for what {runner} executes")
    return None


def only(owners: tuple[str, ...]) -> str:
    """``simulate-only`` where simulate takes it, else the one command that does."""
    return "simulate-only" if "simulate" in owners else f"{owners[0]}-only"
