"""One simulated step, end to end: lower, validate, simulate, score.

This is the function the command line, the sweeps and the benchmarks call, so that
"what ``pipesim simulate`` does" has one definition.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipesim.costs import Costs
from pipesim.engine import simulate
from pipesim.topology import Topology
from schedules.lowering import lower
from schedules.metrics import StepMetrics, step_metrics
from schedules.schedule import Schedule
from schedules.trace import Trace


@dataclass
class SimulationResult:
    """A simulated step: the schedule that ran, its Trace and the metrics of that Trace."""

    schedule: Schedule
    topology: Topology
    trace: Trace
    metrics: StepMetrics

    def to_dict(self) -> dict:
        """The ``--json`` document."""
        metrics = self.metrics
        return {
            "schedule": self.schedule.name,
            "pp": self.schedule.pp,
            "microbatches": self.schedule.microbatches,
            "virtual_stages": self.schedule.virtual_stages,
            "topology": self.topology.name,
            "makespan": metrics.makespan,
            "bubble_fraction": metrics.bubble_fraction,
            "actions": self.schedule.num_actions,
            "ranks": [
                {
                    "rank": rank.rank,
                    "busy": rank.busy,
                    "idle": rank.idle,
                    "comm": rank.comm,
                    "exposed_comm": rank.exposed_comm,
                    "peak_inflight_microbatches": rank.peak_inflight_microbatches,
                }
                for rank in metrics.ranks
            ],
        }

    def summary(self) -> str:
        """A readable report for the terminal."""
        schedule, metrics = self.schedule, self.metrics
        unit, scale = _time_unit(metrics.makespan)
        total_comm = sum(rank.comm for rank in metrics.ranks)
        exposed = sum(rank.exposed_comm for rank in metrics.ranks)
        lines = [
            f"{schedule.name}: pp={schedule.pp}, microbatches={schedule.microbatches}, "
            f"virtual stages={schedule.virtual_stages}, topology={self.topology.name}, "
            f"{schedule.num_actions} actions",
            f"  step time        {metrics.makespan * scale:.4g} {unit}",
            f"  bubble fraction  {metrics.bubble_fraction:.2%}",
            f"  communication    {total_comm * scale:.4g} {unit} on the wire, "
            f"{exposed * scale:.4g} {unit} exposed (ranks blocked on receives), summed over ranks",
            f"  {'rank':>4}  {'busy':>10}  {'idle':>10}  {'idle %':>7}  {'comm':>10}  {'exposed':>10}  peak in-flight",
        ]
        for rank in metrics.ranks:
            idle_share = rank.idle / metrics.makespan if metrics.makespan else 0.0
            lines.append(
                f"  {rank.rank:>4}  {rank.busy * scale:>10.4g}  {rank.idle * scale:>10.4g}  {idle_share:>7.1%}  "
                f"{rank.comm * scale:>10.4g}  {rank.exposed_comm * scale:>10.4g}  "
                f"{rank.peak_inflight_microbatches:g}"
            )
        lines.append(f"  (times in {unit}; peak in-flight in microbatches of the rank's whole share of the model)")
        return "\n".join(lines)


def _time_unit(seconds: float) -> tuple[str, float]:
    if seconds >= 1:
        return "s", 1.0
    if seconds >= 1e-3:
        return "ms", 1e3
    return "us", 1e6


def run_simulation(
    schedule: Schedule,
    costs: Costs,
    topology: Topology,
    rank_devices: Sequence[str] | None = None,
    validate: bool = True,
) -> SimulationResult:
    """Lower, validate (naming any bad action), simulate and compute metrics."""
    lowered = lower(schedule)
    if validate:
        from schedules.validate import validate as validate_schedule

        validate_schedule(lowered)
    trace = simulate(lowered, costs, topology, rank_devices)
    return SimulationResult(lowered, topology, trace, step_metrics(trace, lowered.virtual_stages))
