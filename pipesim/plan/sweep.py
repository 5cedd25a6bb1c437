"""Sweeps: the same cluster and costs across schedules and microbatch counts.

Each point is a full simulation (same path as ``pipesim simulate``); rows are plain
dicts so they go to CSV, JSON and the sweep chart unchanged.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

from pipesim.cluster.topology import Topology
from pipesim.model.costs import Costs
from pipesim.sim.parallel import ParallelConfig
from pipesim.sim.stash_budget import MemoryBudget, build_within
from pipesim.sim.step import run_simulation
from pipesim.sim.variability import Variability
from pipesim.sim.whatif import sample_steps
from schedules.generators import (
    COST_AWARE,
    DEFAULT_MAX_ACTIONS,
    GROUPED,
    MULTI_CHUNK,
    ScheduleUnavailableError,
    generate,
    require_within_limit,
)
from schedules.generators.adaptive import ADAPTABLE
from schedules.schedule import Schedule
from schedules.units import duration, percent, time_unit

# with what-if flags: the sampled step time's mean and quantiles (``pipesim.sim.whatif``)
WHATIF_FIELDS = ("step_time_mean", "step_time_p50", "step_time_p90", "step_time_p99")
ROW_FIELDS = (
    "schedule", "pp", "microbatches", "virtual_stages", "microbatch_group", "makespan", "bubble_fraction",
    "idle_fraction", "peak_inflight_microbatches", "bubble", "exposed_comm", "peak_memory_bytes", "oom",
    "actions", "note", "capacity_bytes",
)


@dataclass(frozen=True)
class SweepPoint:
    schedule: str
    pp: int
    microbatches: int
    virtual_stages: int
    microbatch_group: int | None = None  # interleaved-1f1b's N; None: its default


def sweep_points(schedules: Iterable[str], pps: Iterable[int], microbatch_counts: Iterable[int],
                 virtual_stages: int, microbatch_groups: Iterable[int | None] = (None,)) -> list[SweepPoint]:
    """Every combination; ``virtual_stages`` applies to the multi-chunk schedules only,
    ``microbatch_groups`` to the schedules that group microbatches (``GROUPED``)."""
    return [
        SweepPoint(name, pp, count, virtual_stages if name in MULTI_CHUNK else 1, group)
        for name in schedules
        for pp in pps
        for count in microbatch_counts
        for group in (microbatch_groups if name in GROUPED else (None,))
    ]


def run_sweep(
    points: list[SweepPoint],
    costs_for: Callable[[Schedule], Costs],
    topology: Topology,
    progress: bool = True,
    parallel: ParallelConfig | None = None,
    max_actions: int | None = DEFAULT_MAX_ACTIONS,
    memory_limit: float | MemoryBudget | None = None,
    p2p: str | None = None,
    schedules: dict[SweepPoint, Schedule] | None = None,
    variability: Variability | None = None,
) -> list[dict]:
    """Simulate every point; a point whose schedule does not exist becomes a row with a
    ``note`` instead of stopping the sweep. ``costs_for(schedule)`` builds its costs;
    cost-aware schedules (zb-auto) are built from those costs, ``memory_limit`` stashes (or
    as many as a memory budget allows: ``pipesim.sim.stash_budget``).
    ``schedules`` gives the schedule of points that are not generated (read from a file).
    A generated point over ``max_actions`` refuses the whole sweep before anything runs.
    With ``variability`` each point's step is also sampled (``WHATIF_FIELDS``)."""
    for point in points:
        if point not in (schedules or {}):
            require_within_limit(point.schedule, point.pp, point.microbatches, point.virtual_stages, max_actions)
    rows = []
    for index, point in enumerate(points, 1):
        label = f"{point.schedule} pp={point.pp} m={point.microbatches} v={point.virtual_stages}" + (
            f" N={point.microbatch_group}" if point.microbatch_group else "")
        try:
            schedule = (schedules or {}).get(point) or _build(point, costs_for, topology, parallel, memory_limit,
                                                              max_actions)
        except ScheduleUnavailableError as error:
            rows.append({**point.__dict__, "note": str(error)})
            if progress:
                print(f"[{index}/{len(points)}] {label}: skipped ({error})", file=sys.stderr)
            continue
        result = run_simulation(schedule, costs_for(schedule), topology, parallel=parallel, p2p=p2p)
        metrics = result.metrics
        row = {
            **point.__dict__,
            "makespan": metrics.makespan,
            "bubble_fraction": metrics.bubble_fraction,
            "idle_fraction": metrics.idle_fraction,
            "peak_inflight_microbatches": max(rank.peak_inflight_microbatches for rank in metrics.ranks),
            "bubble": sum(rank.bubble for rank in metrics.ranks),
            "exposed_comm": sum(rank.exposed_comm for rank in metrics.ranks),
            "peak_memory_bytes": max((rank.peak_bytes for rank in result.memory), default=None),
            "oom": result.oom,
            "capacity_bytes": _capacity(result),
            "usable_bytes": min((rank.usable_bytes for rank in result.memory), default=None),
            "actions": result.schedule.num_actions,
            "note": "",
        }
        if variability is not None:
            whatif = sample_steps(result, variability)
            row["step_time_mean"] = whatif.mean
            row.update({f"step_time_{name}": value for name, value in whatif.quantiles.items()})
        rows.append(row)
        if progress:
            print(
                f"[{index}/{len(points)}] {label}: step {metrics.makespan:.6g} s, "
                f"bubble {metrics.bubble_fraction:.1%}",
                file=sys.stderr,
            )
    return rows


def _capacity(result) -> float | None:
    """The smallest device memory among the pipeline's ranks, or None when unbounded."""
    # a fact of the devices, known even when the costs say nothing about memory
    capacity = min((result.topology.device_memory(device) for device in result.devices), default=float("inf"))
    return capacity if capacity != float("inf") else None


def _build(point: SweepPoint, costs_for: Callable[[Schedule], Costs], topology: Topology,
           parallel: ParallelConfig | None, memory_limit: float | MemoryBudget | None,
           max_actions: int | None = DEFAULT_MAX_ACTIONS) -> Schedule:
    """The point's schedule as ``pipesim simulate`` builds it: zb-auto and zbv-auto from the costs,
    zb-h1 and zb-h2 in the order fastest on them, the others as generated."""
    if point.schedule not in COST_AWARE and point.schedule not in ADAPTABLE:
        return generate(point.schedule, point.pp, point.microbatches, point.virtual_stages, max_actions,
                        microbatch_group=point.microbatch_group)
    from pipesim.cluster.mapping import map_ranks
    from pipesim.sim.cost_aware import adapt_to_costs, cost_shell

    parallel = parallel or ParallelConfig()
    devices = map_ranks(topology, parallel.dp, point.pp, parallel.tp, parallel.rank_order, parallel.cp,
                        parallel.ep, parallel.etp).pipeline()
    if point.schedule in ADAPTABLE:
        schedule = generate(point.schedule, point.pp, point.microbatches, point.virtual_stages, max_actions)
        return adapt_to_costs(schedule, costs_for(schedule), topology, devices)
    template = cost_shell(point.schedule, point.pp, point.microbatches, point.virtual_stages)  # stages, placement
    return build_within(memory_limit, point.schedule, point.pp, point.microbatches, costs_for(template), topology,
                        devices, parallel)[0]


def format_table(rows: list[dict]) -> str:
    """A fixed-width table of the sweep for the terminal, its times in one unit
    (``schedules.units``: ms below 10 s, s from there), the bubble a percentage; a point
    that could not be simulated keeps its whole reason, on the lines below its row."""
    sampled = any(row.get("step_time_p99") is not None for row in rows)
    grouped = any(row.get("microbatch_group") for row in rows)  # a column for N only where one was asked for
    simulated = [row for row in rows if not row.get("note")]
    longest = max((max(row["makespan"], row.get("step_time_p99") or 0.0) for row in simulated), default=0.0)
    unit, _ = time_unit(longest)
    header = (f"{'schedule':<18} {'pp':>4} {'m':>5} {'v':>3} " + (f"{'N':>4} " if grouped else "")
              + f"{f'step time ({unit})':>15} "
              + (f"{f'p99 ({unit})':>12} " if sampled else "") + f"{'bubble':>8} {'peak in-flight':>15} "
              f"{'peak mem GB':>12}")
    lines = [header, "-" * len(header)]
    for row in rows:
        point = f"{row['schedule']:<18} {row['pp']:>4} {row['microbatches']:>5} {row['virtual_stages']:>3}" + (
            f" {row.get('microbatch_group') or '':>4}" if grouped else "")
        if row.get("note"):
            reason = textwrap.wrap(f"n/a: {row['note']}", width=max(40, len(header) - len(point) - 2))
            lines.append(f"{point}  {reason[0]}")
            lines += [f"{'':<{len(point)}}  {line}" for line in reason[1:]]
            continue
        in_unit = partial(_in_unit, unit=unit)
        lines.append(
            f"{point} {in_unit(row['makespan']):>15} " + (f"{in_unit(row['step_time_p99']):>12} " if sampled else "")
            + f"{percent(row['bubble_fraction']):>8} {row['peak_inflight_microbatches']:>15g} "
            f"{_gigabytes(row['peak_memory_bytes']):>12}{'  OOM' if row['oom'] else ''}"
        )
    return "\n".join(lines)


def _in_unit(seconds: float, unit: str) -> str:
    """``seconds`` as a number of the column's ``unit`` (``duration`` without the unit)."""
    return duration(seconds, unit).rsplit(" ", 1)[0]


def _gigabytes(num_bytes: float | None) -> str:
    """GB with two decimals, or n/a when the costs said nothing about memory."""
    return "n/a" if num_bytes is None else f"{num_bytes / 1e9:.2f}"
