"""Step time as a distribution: many steps of one layout, each with its own draws.

The deterministic step is simulated first (``run_simulation``: validation, lowering, the
collectives' plan). Then the program is compiled once and each sample runs the same
compiled walk on the same inputs times its draws (``pipesim.sim.variability``): its
compute rows' seconds, and where transfers vary, one wire per transfer with its
occupancy and latency scaled. The step's tail (dp reductions, optimizer) follows each
sample's pipeline as it follows the deterministic one, so a CV of 0 and factors of 1
give the deterministic step time exactly.

Quantiles are order statistics (numpy's ``inverted_cdf``): each is the step time of an
actual sample, so the Gantt of "the p99 step" is that sample's, drawn again alone.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from pipesim.sim.critical_path import critical_owners, path_links
from pipesim.sim.engine import held_parts, pipeline_columns, price_step, step_trace
from pipesim.sim.parallel import CommPlan, embedding_sum_seconds, reduction_columns, step_tail_columns
from pipesim.sim.step import SimulationResult, comm_plan_of
from pipesim.sim.step import _time_unit as time_unit  # the summary's units, as simulate prints them
from pipesim.sim.variability import PerTransferWires, Sampler, Variability, crossed_links
from schedules import engine
from schedules.action import KINDS
from schedules.trace import Trace, TraceColumns

QUANTILES = {"p50": 0.50, "p90": 0.90, "p99": 0.99}
CHUNK = 64  # samples whose moments are kept at once for the critical-path walk


def step_quantiles(step_times) -> dict[str, float]:
    """p50, p90 and p99 of ``step_times`` as order statistics: each one of the times."""
    return {name: float(np.quantile(step_times, q, method="inverted_cdf")) for name, q in QUANTILES.items()}


@dataclass
class WhatIfResult:
    """``samples`` steps of one layout: their step times, per sample the rank owning the
    critical path and the action stretched most on it (``pipesim.sim.critical_path``),
    and the deterministic step they vary around."""

    deterministic: SimulationResult
    variability: Variability
    step_times: np.ndarray
    owner_rank: np.ndarray
    stretched_action: list[str | None]
    _stepper: SampleStepper = field(repr=False)

    @property
    def mean(self) -> float:
        return float(self.step_times.mean())

    @cached_property
    def quantiles(self) -> dict[str, float]:
        """p50, p90, p99 of the step time, each an actual sample's (see the module)."""
        return step_quantiles(self.step_times)

    def sample_at(self, name: str) -> int:
        """The sample whose step time is quantile ``name`` (``p50``, ``p90``, ``p99``)."""
        return int(np.flatnonzero(self.step_times == self.quantiles[name])[0])

    def trace(self, sample: int) -> Trace:
        """The Trace of sample ``sample``, drawn and run again."""
        return self._stepper.trace(sample)

    @cached_property
    def owner_shares(self) -> list[tuple[int, float]]:
        """``(rank, share of samples)`` whose critical path the rank owned, most first."""
        counts = Counter(self.owner_rank.tolist())
        return [(rank, count / len(self.owner_rank)) for rank, count in counts.most_common()]

    @cached_property
    def stretched_shares(self) -> list[tuple[str, float]]:
        """``(action, share of samples)`` stretched most on the critical path, most first
        (samples where no action ran over its cost are left out)."""
        counts = Counter(action for action in self.stretched_action if action is not None)
        return [(action, count / len(self.stretched_action)) for action, count in counts.most_common()]

    def to_dict(self) -> dict:
        """The ``--json`` fields of the distribution."""
        variability = self.variability
        return {
            "samples": len(self.step_times),
            "seed": variability.seed,
            "variability": {
                "jitter": dict(variability.jitter),
                "stragglers": {str(rank): factor for rank, factor in variability.stragglers.items()},
                "straggler_share": list(variability.straggler_share) if variability.straggler_share else None,
                "slow_links": {f"{a}-{b}": factor for (a, b), factor in variability.slow_links.items()},
            },
            "deterministic_step_time": self.deterministic.metrics.makespan,
            "step_time_mean": self.mean,
            "step_time_quantiles": self.quantiles,
            "critical_path_owner": [{"rank": rank, "share": share} for rank, share in self.owner_shares[:5]],
            "stretched_action": [{"action": action, "share": share} for action, share in self.stretched_shares[:5]],
        }

    def summary(self) -> str:
        """The terminal lines of the distribution."""
        deterministic = self.deterministic.metrics.makespan
        unit, scale = time_unit(deterministic)
        quantiles = ", ".join(f"{name} {value * scale:.4g}" for name, value in self.quantiles.items())
        lines = [f"  what-if          {len(self.step_times)} samples (seed {self.variability.seed}): mean "
                 f"{self.mean * scale:.4g} {unit}; {quantiles} {unit}; "
                 f"deterministic {deterministic * scale:.4g} {unit}"]
        owners = ", ".join(f"rank {rank} {share:.0%}" for rank, share in self.owner_shares[:3])
        lines.append(f"  critical path    owned by {owners} of samples")
        if self.stretched_shares:
            stretched = ", ".join(f"{action} {share:.0%}" for action, share in self.stretched_shares[:3])
            lines.append(f"  stretched most   {stretched} of samples (the critical path's action that ran "
                         "longest over its cost)")
        return "\n".join(lines)


class SampleStepper:
    """One layout compiled once, run on one sample's draws at a time."""

    def __init__(self, result: SimulationResult, variability: Variability) -> None:
        schedule, costs, topology = result.schedule, result.costs, result.topology
        self.result, self.variability = result, variability
        self.p2p = result.trace.meta["p2p"]
        self.plan: CommPlan | None = comm_plan_of(schedule, costs, topology, result.mapping, result.parallel)
        self.program = engine.compile_program(schedule, self.p2p)
        self.priced = price_step(schedule, costs, topology, result.devices, self.plan)
        timing = self.priced.timing
        inputs = engine.step_inputs(self.program, timing)
        self.seconds, self.hold, self.wires, self.channels = inputs.seconds, inputs.hold, inputs.wires, inputs.channels
        self.comm_overhead = timing.comm_overhead
        variability.check_layout(schedule.pp, crossed_links(self.program))
        self.sampler = Sampler(self.program, variability, result.parallel.tp)
        # one wire per transfer where transfers vary, so each can be scaled alone
        self.per_transfer = dataclasses.replace(self.program,
                                                transfer_wire=np.arange(self.program.arrays.transfers))
        self.transfer_wires = PerTransferWires(self.program, self.wires) if (
            self.sampler.comm_sigma > 0 or self.sampler.link_factor is not None) else None
        self.embedding_sums = embedding_sum_seconds(schedule, costs, result.topology, result.devices)
        self.tail = (self.plan is not None or costs.step_overhead > 0 or bool(self.embedding_sums)
                     or costs.grad_norm_overhead > 0)
        shape = engine.empty_run(self.program)  # what holds each row has depends on the program alone
        self.held = held_parts(shape, self.priced) if self.tail else None

    def run(self, sample: int) -> tuple[engine.StepRun, np.ndarray]:
        """Sample ``sample``'s step and its compute rows' seconds."""
        draws = self.sampler.draw(sample)
        seconds = self.seconds * draws.compute
        if draws.transfer is None:
            inputs = engine.StepInputs(seconds, self.hold, self.wires, self.comm_overhead, self.channels)
            step = engine.run_inputs(self.program, inputs)
        else:
            inputs = engine.StepInputs(seconds, self.hold, self.transfer_wires.scaled(draws.transfer),
                                       self.comm_overhead, self.channels)
            step = engine.run_inputs(self.per_transfer, inputs)
            step.program = self.program
        if step.stuck:  # the order finishes deterministically; a draw cannot make it deadlock
            raise engine.EngineError(f"sample {sample} did not finish: ranks {step.stuck} stuck")
        return step, seconds

    def step_time(self, step: engine.StepRun) -> float:
        """The step time of a sample's pipeline with the step's tail after it, measured as
        ``schedules.metrics.makespan`` measures the deterministic Trace."""
        if not self.tail:
            return step.makespan
        pipeline = pipeline_columns(step, self.held)
        tail = step_tail_columns(pipeline, self.program.ranks, self.plan, self.result.costs.step_overhead,
                                 reduction_columns(step, self.plan), self.embedding_sums,
                                 self.result.costs.grad_norm_overhead)
        columns = TraceColumns.concatenate([pipeline, tail]) if tail is not None else pipeline
        return float(columns.end.max() - columns.start.min())

    def trace(self, sample: int) -> Trace:
        """The Trace of sample ``sample``."""
        step, _ = self.run(sample)
        result = self.result
        trace = step_trace(step, result.costs, result.topology, result.devices, self.plan, self.p2p, self.priced)
        for key, value in result.trace.meta.items():  # the layout's (dp, tp, ...); the sample's own moments kept
            trace.meta.setdefault(key, value)
        trace.meta.update(sample=sample, seed=self.variability.seed)
        return trace


def sample_steps(result: SimulationResult, variability: Variability) -> WhatIfResult:
    """``variability.samples`` steps of the layout ``result`` simulated, each with its
    own draws (see the module)."""
    stepper = SampleStepper(result, variability)
    program = stepper.program
    links = path_links(program)
    samples = variability.samples
    step_times = np.empty(samples)
    owner_rank = np.empty(samples, dtype=np.int64)
    stretched_row = np.empty(samples, dtype=np.int64)
    for first in range(0, samples, CHUNK):
        chunk = range(first, min(first + CHUNK, samples))
        moments = np.empty((4, len(chunk), program.computes))
        for index, sample in enumerate(chunk):
            step, seconds = stepper.run(sample)
            step_times[sample] = stepper.step_time(step)
            moments[:, index] = step.start, step.end, step.ready, seconds
        owners = critical_owners(program, links, moments[0], moments[1], moments[2], stepper.hold, moments[3],
                                 stepper.seconds)
        owner_rank[chunk.start:chunk.stop] = owners.rank
        stretched_row[chunk.start:chunk.stop] = owners.stretched
    names = [None if row < 0 else
             f"{program.compute_stage[row]}{KINDS[program.compute_kind[row]]}{program.compute_microbatch[row]}"
             for row in stretched_row.tolist()]
    return WhatIfResult(result, variability, step_times, owner_rank, names, stepper)
