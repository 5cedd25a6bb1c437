"""Schedule generators, by the names users type on the command line.

A generator computes each rank's compute-only order and returns a ``Schedule``; it
does no lowering, validation or timing (those are passes that treat every schedule
alike)."""

from __future__ import annotations

from collections.abc import Callable

from schedules.collector import without_collector
from schedules.generators.common import ScheduleUnavailableError, require_positive
from schedules.generators.dualpipe import dualpipe
from schedules.generators.dualpipev import dualpipev
from schedules.generators.gpipe import gpipe
from schedules.generators.interleaved import interleaved_1f1b
from schedules.generators.interleaved_auto import interleaved_auto
from schedules.generators.interleaved_zb import interleaved_zb
from schedules.generators.looped_bfs import looped_bfs
from schedules.generators.one_f_one_b import one_f_one_b
from schedules.generators.zb_auto import zb_auto
from schedules.generators.zb_h1 import zb_h1
from schedules.generators.zb_h2 import zb_h2
from schedules.generators.zbv import zbv
from schedules.generators.zbv_auto import zbv_auto
from schedules.schedule import Schedule, looped_placement, v_shape_placement

Generator = Callable[[int, int, int], Schedule]

GENERATORS: dict[str, Generator] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "zbv": zbv,
    "interleaved-zb": interleaved_zb,
    "looped-bfs": looped_bfs,
    "dualpipev": dualpipev,
    "dualpipe": dualpipe,
}

# Schedules that place several stages on a rank and therefore use ``virtual_stages``.
MULTI_CHUNK = frozenset({"interleaved-1f1b", "zbv", "interleaved-zb", "looped-bfs", "dualpipev", "dualpipe",
                         "zbv-auto", "interleaved-auto"})

# Schedules whose chunks take microbatches in groups of a size the user may set
# (Megatron's ``--microbatch-group-size-per-virtual-pipeline-stage``, Meta's N).
GROUPED = frozenset({"interleaved-1f1b"})

# Schedules whose order depends on the stage costs and a memory limit: they cannot be
# built from sizes alone, so they have their own signature (see ``zb_auto``,
# ``zbv_auto`` and ``interleaved_auto``) and the command line builds them from the costs
# it already has (``build_cost_aware``).
COST_AWARE = frozenset({"zb-auto", "zbv-auto", "interleaved-auto"})
# Schedules that place stage s and 2p - 1 - s on one rank (the V; dualpipe's two copies
# of the model sit so); the others loop.
V_SHAPED = frozenset({"zbv", "dualpipev", "dualpipe", "zbv-auto"})
# Schedules whose order splits each backward into its input half I and its weight half W
# (the zero-bubble family, the V-shaped ones, DualPipe); the others run whole backwards B.
SPLIT_BACKWARD = frozenset({"zb-h1", "zb-h2", "zbv", "interleaved-zb", "dualpipev", "dualpipe", "zb-auto", "zbv-auto"})
# The signature of each cost-aware generator, for the error that points to it.
COST_AWARE_CALLS = {
    "zb-auto": "schedules.generators.zb_auto(pp, m, forward, backward_input, backward_weight, comm, memory_limit)",
    "zbv-auto": "schedules.generators.zbv_auto(pp, m, forward, backward_input, backward_weight, comm, memory_limit)",
    "interleaved-auto": "schedules.generators.interleaved_auto(pp, m, v, forward, backward, comm, memory_limit)",
}

SCHEDULE_NAMES = (*GENERATORS, *sorted(COST_AWARE))
# What ``pipesim plan`` searches: every schedule but dualpipe, whose two copies of the model
# change each stage's costs (a whole 1/pp of the model per stage), where the planner keys
# stage costs by the placement alone, which dualpipe shares with zbv and dualpipev; and but
# interleaved-auto, which is interleaved-1f1b's order wherever that fits and searches
# seconds per layout where it does not (a plan names it with --schedules).
PLANNED_SCHEDULES = tuple(name for name in SCHEDULE_NAMES if name not in ("dualpipe", "interleaved-auto"))
# What ``pipesim plan --schedules`` accepts: the default search and interleaved-auto.
PLANNABLE_SCHEDULES = tuple(name for name in SCHEDULE_NAMES if name != "dualpipe")


# Compute actions per (stage, microbatch): F and B, or F, I and W for the schedules that
# split the backward. A name not listed (a new generator) is counted with three, the most.
COMPUTE_PASSES: dict[str, int] = {
    "gpipe": 2, "1f1b": 2, "interleaved-1f1b": 2, "looped-bfs": 2, "interleaved-auto": 2,
    "zb-h1": 3, "zb-h2": 3, "zbv": 3, "interleaved-zb": 3, "zb-auto": 3, "dualpipev": 3, "dualpipe": 3, "zbv-auto": 3,
}



def placement_of(name: str, pp: int, virtual_stages: int) -> tuple[int, ...]:
    """The rank of every stage under the named schedule, without generating it."""
    if name in V_SHAPED:
        return v_shape_placement(pp, virtual_stages)
    return looped_placement(pp, virtual_stages)


def splits_backward(name: str) -> bool:
    """Whether the named schedule runs the backward as I and W (the weight gradient may
    then come last on a rank, after the input gradient has moved on)."""
    return COMPUTE_PASSES.get(name, 3) == 3

DEFAULT_MAX_ACTIONS = 5_000_000
"""Lowered actions built without being asked twice. The simulator holds ~350 bytes and
spends ~5 us per lowered action (p=64, m=512, v=2: 391,168 actions, ~140 MB), so the
limit is ~2 GB and tens of seconds; ``--pp 100000 --microbatches 100000`` (~6e10 actions)
would otherwise grow until memory runs out."""


class UnknownScheduleError(ValueError):
    """The schedule name is not one this tool can generate."""


class ScheduleTooLargeError(ValueError):
    """The schedule would hold more actions than the limit the user allowed."""


def action_bound(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> int:
    """Actions of the lowered schedule, known before building it: every stage runs each
    compute pass of every microbatch, and each of the ``stages - 1`` boundaries carries
    a SEND and a RECV forward and backward per microbatch. An upper bound: exact for
    looped placements; V-shaped ones keep some boundaries on one rank, and dualpipev runs
    some backwards whole instead of split."""
    stages = pp * virtual_stages
    boundaries = stages - 1 if pp > 1 else 0
    return COMPUTE_PASSES.get(name, 3) * microbatches * stages + 4 * microbatches * boundaries


def require_within_limit(name: str, pp: int, microbatches: int, virtual_stages: int,
                         max_actions: int | None, flag: str = "--max-actions") -> None:
    """Refuse, before any work, a schedule larger than ``max_actions`` (None: no limit)."""
    if max_actions is None:
        return
    count = action_bound(name, pp, microbatches, virtual_stages)
    if count > max_actions:
        raise ScheduleTooLargeError(
            f"{name} with pp={pp}, microbatches={microbatches}, virtual stages={virtual_stages} has "
            f"{count:,} actions once lowered, over the limit of {max_actions:,} (about 350 bytes each to "
            f"simulate); raise it with {flag} {count} if you mean it"
        )


@without_collector
def generate(name: str, pp: int, microbatches: int, virtual_stages: int = 1,
             max_actions: int | None = DEFAULT_MAX_ACTIONS, microbatch_group: int | None = None) -> Schedule:
    """Build the named schedule; errors name the bad value and list what is valid.
    Schedules over ``max_actions`` lowered actions are refused before they are built.
    ``microbatch_group`` (interleaved-1f1b only): Megatron's microbatches per chunk visit,
    ``N`` (see ``schedules.generators.interleaved``); None keeps the schedule's own."""
    generator = GENERATORS.get(name)
    if name in COST_AWARE:
        raise UnknownScheduleError(
            f"{name} builds its order from stage costs and a memory limit; call {COST_AWARE_CALLS[name]}"
        )
    if generator is None:
        raise UnknownScheduleError(
            f"unknown schedule {name!r}; available: {', '.join(sorted(SCHEDULE_NAMES))}"
        )
    require_positive(name, pp, microbatches, virtual_stages)
    require_within_limit(name, pp, microbatches, virtual_stages, max_actions)
    if microbatch_group is not None:
        if name not in GROUPED:
            raise ScheduleUnavailableError(
                f"a microbatch group of {microbatch_group} applies to {', '.join(sorted(GROUPED))} only; "
                f"{name} fixes its own order")
        return generator(pp, microbatches, virtual_stages, microbatch_group=microbatch_group)
    return generator(pp, microbatches, virtual_stages)


__all__ = [
    "COST_AWARE",
    "COST_AWARE_CALLS",
    "DEFAULT_MAX_ACTIONS",
    "GENERATORS",
    "GROUPED",
    "MULTI_CHUNK",
    "PLANNABLE_SCHEDULES",
    "PLANNED_SCHEDULES",
    "V_SHAPED",
    "placement_of",
    "splits_backward",
    "SCHEDULE_NAMES",
    "ScheduleTooLargeError",
    "ScheduleUnavailableError",
    "UnknownScheduleError",
    "action_bound",
    "dualpipe",
    "dualpipev",
    "generate",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_auto",
    "interleaved_zb",
    "looped_bfs",
    "one_f_one_b",
    "require_within_limit",
    "zb_auto",
    "zb_h1",
    "zb_h2",
    "zbv",
    "zbv_auto",
]
