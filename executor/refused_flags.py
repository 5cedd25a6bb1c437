"""Flags the executor does not take but another pipesim command does, refused in one
line that says which command takes them.

A user who moves a command line from ``pipesim simulate`` (or a plan row) to ``python -m
executor`` under torchrun should hear "``--topology`` is simulate-only", not argparse's
"unrecognized arguments"; one who moves it from ``pipesim run`` should hear that
``--html`` is run's. ``pipesim run`` refuses the simulator's flags it lacks with the same
action and sentence, reading them from simulate's and plan's own parsers
(``pipesim.cli.refused``); ``python -m executor`` may not import the command line, so it
keeps them here (``REFUSED_FLAGS``), and ``tests/test_executor_refused_flags.py`` fails
when this table drifts from those parsers and the executor's own: a flag added to
``simulate`` is refused here until it is added to this table or to the executor.
"""

from __future__ import annotations

import argparse

from executor.refused_values import only

# How many values a flag takes, as argparse's nargs: a refused flag must consume its value,
# or the value would be read as a positional and the refusal would be argparse's.
ONE, SWITCH, OPTIONAL = None, 0, "?"

SIMULATE, PLAN, BOTH = ("simulate",), ("plan",), ("simulate", "plan")


def by_owners(owners: tuple[str, ...], nargs: int | str | None, *names: str) -> dict:
    """``{flag: (nargs, owners)}`` for ``names``."""
    return {name: (nargs, owners) for name in names}


# flag -> (nargs, the commands that take it): every flag of simulate and plan
# (pipesim.cli.refused.other_flags) and of run that the executor's parser lacks.
REFUSED_FLAGS: dict[str, tuple[int | str | None, tuple[str, ...]]] = {
    **by_owners(SIMULATE, ONE, "--act-bytes", "--attention-flops", "--bwd", "--bytes-per-param", "--chrome-trace",
            "--collective", "--costs", "--dtype-bytes", "--fwd", "--microbatch-size",
            "--nodes", "--optimizer-moments", "--overlap-slowdown", "--param-bytes", "--rank-order", "--stash-bytes",
            "--wgrad", "--wgrad-stash-share", "--zero3-collectives"),
    **by_owners(SIMULATE, SWITCH, "--delay-wgrad", "--fail-on-oom", "--no-dp-overlap", "--no-flash-attention",
            "--no-param-gather-overlap", "--no-tp-overlap"),
    **by_owners(BOTH, ONE, "--comm-sms", "--compute-model", "--cross-entropy", "--ep-dispatch", "--ep-dispatcher",
            "--gpu", "--jitter", "--max-actions", "--memory-headroom", "--memory-limit", "--mfu", "--samples",
            "--slow-link", "--straggler", "--stragglers", "--topology"),
    **by_owners(BOTH, OPTIONAL, "--fp8"),
    **by_owners(PLAN, ONE, "--constraint", "--csv", "--global-batch", "--gpus", "--gpus-per-node", "--microbatch-sizes",
            "--objective", "--schedules", "--top", "--torchtitan", "--workers"),
    **by_owners(PLAN, SWITCH, "--fsdp"),
    # pipesim run's own (it draws, keeps logs, reads plans), some shared with simulate or plan
    **by_owners(("run", "simulate", "plan"), ONE, "--html"),
    **by_owners(("run", "plan"), SWITCH, "--quiet"),
    **by_owners(("run",), ONE, "--log-dir", "--plan", "--plotly", "--row"),
}


class RefusedFlag(argparse.Action):
    """Parses like the flag it stands for, and remembers that it was given."""

    def __init__(self, option_strings: list[str], dest: str, owners: tuple[str, ...] = (), **kwargs) -> None:
        self.owners = owners
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        given = getattr(namespace, self.dest, None) or []
        setattr(namespace, self.dest, [*given, (option_string, self.owners)])


def add_refused_flags(parser: argparse.ArgumentParser,
                      others: dict[str, tuple[int | str | None, tuple[str, ...]]]) -> list[str]:
    """Add to ``parser`` each flag of ``others`` (flag -> nargs, owning commands) it
    lacks, hidden from ``--help``'s option list, as a ``RefusedFlag``; return them."""
    taken = set(parser._option_string_actions)
    refused = [flag for flag in others if flag not in taken]
    for flag in refused:
        nargs, owners = others[flag]
        parser.add_argument(flag, action=RefusedFlag, dest="refused_flags", owners=owners, nargs=nargs,
                            default=None, help=argparse.SUPPRESS)
    return refused


def flag_refusal(args: argparse.Namespace, program: str, runner: str) -> str | None:
    """The one-line refusal of the first ``RefusedFlag`` given, else None. ``program`` is
    the command that refuses (``pipesim run``), ``runner`` how the line names what it
    executes (``run``)."""
    given = getattr(args, "refused_flags", None)
    if not given:
        return None
    flag, owners = given[0]
    if "run" in owners:
        return (f"{flag} is a flag of pipesim run, not of {program}: drop it, or start the ranks with pipesim run "
                f"(torchrun ... -m pipesim run ...), which takes it")
    return (f"{flag} is {only(owners)}: {program} does not execute it (it is a flag of pipesim "
            f"{' and '.join(owners)}); drop it to run, or see docs/executor.md for what {runner} executes")
