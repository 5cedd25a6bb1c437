"""One simulated step, end to end: lower, validate, simulate, score.

This is the function the command line, the sweeps and the benchmarks call, so that
"what ``pipesim simulate`` does" has one definition.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from pipesim.cluster.mapping import RankMapping, map_ranks
from pipesim.cluster.topology import Topology
from pipesim.model.costs import Costs
from pipesim.sim.engine import lower_for, price_step, run_step, step_trace
from pipesim.sim.headroom import pipeline_net_channels
from pipesim.sim.memory import RankMemory, memory_report
from pipesim.sim.parallel import CommPlan, ParallelConfig, comm_plan
from schedules.collector import without_collector
from schedules.generators import COST_AWARE
from schedules.metrics import StepMetrics, comm_by_kind, step_metrics
from schedules.p2p import default_semantics
from schedules.schedule import Schedule
from schedules.trace import Trace
from schedules.units import number, size, time_unit
from schedules.validate import explain_stuck
from schedules.validate import validate as validate_schedule

# For a schedule whose fixed order does not fit, the cost-aware one of the same placement
# that builds its order within a memory limit (what simulate's out-of-memory lines point to)
ORDER_WITHIN_MEMORY = {"interleaved-1f1b": "interleaved-auto", "zb-h1": "zb-auto", "zb-h2": "zb-auto",
                       "zbv": "zbv-auto"}


@dataclass
class SimulationResult:
    """A simulated step: the schedule that ran, its Trace and the metrics of that Trace.
    Memory and communication by kind are computed on first use (sweeps and benchmarks
    that only want the step time do not pay for them)."""

    schedule: Schedule
    topology: Topology
    trace: Trace
    metrics: StepMetrics
    costs: Costs | None = None
    devices: list[str] = field(default_factory=list)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    mapping: RankMapping | None = None

    @cached_property
    def memory(self) -> list[RankMemory]:
        """Per rank: static, buffer and stash bytes, peak and timeline."""
        if self.costs is None:
            return []
        devices = self.devices or [f"gpu{rank}" for rank in range(self.schedule.pp)]
        parallel = self.parallel
        # ZeRO shards a stage's state over the ranks that reduce its gradients: its dp (x cp)
        # replicas and, with copies of the model (DualPipe), each copy's (pipesim.sim.parallel)
        holders = parallel.dp * parallel.cp * self.schedule.copies
        return memory_report(
            self.trace, self.costs, self.schedule.placement, devices,
            [self.topology.device_memory(device) for device in devices],
            parallel.bytes_per_param, holders, parallel.bucket_bytes, parallel.zero,
            parallel.expert_holders(holders), headroom=parallel.memory_headroom, tp=parallel.tp,
            cp=parallel.cp, ep=parallel.ep, pp_net_channels=pipeline_net_channels(self.topology, devices),
        )

    @cached_property
    def comm(self) -> list[dict[str, dict[str, float]]]:
        """Per rank: ``{"p2p"|"dp"|"tp"|"ep"|"cp": {"total": s, "exposed": s}}`` (ep and cp
        where the step has them)."""
        return comm_by_kind(self.trace, [rank.time() for rank in self.metrics.ranks])

    @property
    def oom(self) -> bool:
        return any(rank.oom for rank in self.memory)

    def _stash_limits(self) -> list[float] | None:
        """Per rank, the stashes a cost-aware order was built to hold (None where unknown)."""
        held = self.schedule.meta.get("memory_microbatches")
        if held is None:
            return None
        return list(held) if isinstance(held, (list, tuple)) else [held] * self.schedule.pp

    def to_dict(self) -> dict:
        """The ``--json`` document."""
        metrics = self.metrics
        return {
            "schedule": self.schedule.name,
            "pp": self.schedule.pp,
            "microbatches": self.schedule.step_microbatches,
            "virtual_stages": self.schedule.virtual_stages,
            "microbatch_group": self.schedule.meta.get("microbatch_group"),
            # zb-auto's and zbv-auto's most stashes on each rank, as their order was built for
            # (--memory-limit's count, or what a budget gave each rank: pipesim.sim.stash_budget)
            **({"stash_limits": self._stash_limits()} if self.schedule.name in COST_AWARE else {}),
            "ep_overlap": bool(self.schedule.meta.get("combined_1f1b")),  # schedules.generators.combined
            "delay_wgrad": bool(self.costs and self.costs.delayed_wgrad),  # pipesim.sim.overlap
            "topology": self.topology.name,
            "dp": self.parallel.dp,
            "tp": self.parallel.tp,
            "cp": self.parallel.cp,
            "ep": self.parallel.ep,
            "etp": self.parallel.etp or self.parallel.tp,  # the routed experts' tensor parallelism
            "cp_comm": self.parallel.cp_comm if self.parallel.cp > 1 else None,
            "zero": self.parallel.zero,
            "zero3_collectives": self.parallel.zero3_collectives if self.parallel.zero == 3 else None,
            "dp_overlap": self.parallel.overlap_dp,
            "tp_overlap": self.parallel.overlap_tp,
            "param_gather_overlap": self.parallel.overlap_param_gather,
            "overlap_slowdown": self.parallel.overlap_slowdown,
            "rank_order": "-".join(axis for axis in self.mapping.order if axis != "cp" or self.parallel.cp > 1)
            if self.mapping else None,
            "p2p": self.trace.meta.get("p2p"),
            "devices": list(self.devices),
            "makespan": metrics.makespan,
            "bubble_fraction": metrics.bubble_fraction,
            "idle_fraction": metrics.idle_fraction,
            "actions": self.schedule.num_actions,
            "ranks": [
                {
                    "rank": rank.rank,
                    "busy": rank.busy,
                    "idle": rank.idle,
                    "comm": rank.comm,
                    "bubble": rank.bubble,
                    "exposed_comm": rank.exposed_comm,
                    "tp": rank.tp,
                    "ep": rank.ep,
                    "cp": rank.cp,
                    "dp": rank.dp,
                    "optimizer": rank.optimizer,
                    "overhead": rank.overhead,
                    "peak_inflight_microbatches": rank.peak_inflight_microbatches,
                    **self._memory_fields(rank.rank),
                }
                for rank in metrics.ranks
            ],
            "comm": self.comm,
            "oom": self.oom,
        }

    def _memory_fields(self, rank: int) -> dict:
        if rank >= len(self.memory):
            return {"peak_memory_bytes": None}
        memory = self.memory[rank]
        capacity = memory.capacity_bytes
        return {
            "peak_memory_bytes": memory.peak_bytes,
            "memory": {
                "static_bytes": memory.static_bytes,
                "buffer_bytes": memory.buffer_bytes,
                "workspace_bytes": memory.workspace_bytes,
                "peak_stash_bytes": memory.peak_stash_bytes,
                "capacity_bytes": capacity if capacity != float("inf") else None,
                "headroom_bytes": memory.headroom_bytes,
                "usable_bytes": memory.usable_bytes if capacity != float("inf") else None,
                "headroom": self._headroom_fields(memory),
                "oom": memory.oom,
            },
        }

    @staticmethod
    def _headroom_fields(memory) -> dict:
        """The headroom rule's parts for one rank (``pipesim.sim.headroom``): the CUDA
        context, NCCL's buffers by communicator, the fragmentation at the peak and what the
        device then holds; only the setting when a number overrides the rule."""
        parts = memory.headroom_parts
        if not parts:
            return {"rule": "fixed"}
        return {"rule": "auto", "cuda_context_bytes": parts["cuda_context_bytes"], "nccl_bytes": parts["nccl_bytes"],
                "fragmentation_share": parts["fragmentation_share"],
                "fragmentation_bytes": memory.fragmentation_bytes, "device_bytes": memory.device_bytes}

    def summary(self) -> str:
        """A readable report for the terminal. Differences of equal sums (a wait of
        1e-16 s) print as 0."""
        schedule, metrics = self.schedule, self.metrics
        unit, scale = _time_unit(metrics.makespan)
        dust = _ROUNDING * metrics.makespan

        def shown(seconds: float, width: int = 10) -> str:
            return f"{number((0.0 if abs(seconds) < dust else seconds) * scale):>{width}}"

        comm = self.comm
        exposed = sum(rank.exposed_comm for rank in metrics.ranks)
        waiting = sum(rank.bubble for rank in metrics.ranks)
        wire = [rank["p2p"]["wire"] for rank in comm]
        sent = sum(rank["p2p"]["bytes"] or 0.0 for rank in comm)
        named = [(name, title) for name, title in (("tp", "tp"), ("ep", "ep"), ("cp", "cp"), ("dp", "dp"),
                                                   ("optimizer", "optim"), ("overhead", "overhead"))
                 if any(getattr(rank, name) for rank in metrics.ranks)]
        order = f" (order: {schedule.meta['order']})" if "order" in schedule.meta else ""  # adapted zb-h1/zb-h2
        order += " (combined 1F1B)" if schedule.meta.get("combined_1f1b") else ""  # --ep-overlap's pairs
        each_way = f" ({schedule.microbatches} each way)" if schedule.copies == 2 else ""
        group = schedule.meta.get("microbatch_group")  # interleaved-1f1b's N, where the user set it
        group = f" (microbatch group {group})" if group else ""
        lines = [
            f"{schedule.name}{order}: pp={schedule.pp}, microbatches={schedule.step_microbatches}{each_way}, "
            f"virtual stages={schedule.virtual_stages}{group}, topology={self.topology.name}, "
            f"p2p={self.trace.meta.get('p2p')}, {schedule.num_actions} actions",
            f"  step time        {number(metrics.makespan * scale)} {unit}",
            f"  bubble fraction  {metrics.bubble_fraction:.2%} (pipeline bubble over ranks x step time)",
            f"  idle fraction    {metrics.idle_fraction:.2%} (not computing: bubble, exposed communication, "
            "tp, ep, cp, dp, optimizer)",
            f"  bubble           {shown(waiting, 0)} {unit} (waiting for a peer, fill and drain), summed over ranks",
            f"  p2p              {shown(exposed, 0)} {unit} blocked on data in flight (exposed); "
            f"{shown(sum(value or 0.0 for value in wire), 0)} {unit} on the wire; {size(sent)} sent; "
            "summed over ranks",
            f"  {'rank':>4}  {'busy':>10}  {'bubble':>10}  {'bubble %':>8}  {'exposed':>10}  "
            + "".join(f"{title:>10}  " for _, title in named) + f"{'on wire':>10}  peak in-flight",
        ]
        for rank in metrics.ranks:
            bubble_share = rank.bubble / metrics.makespan if metrics.makespan else 0.0
            on_wire = shown(wire[rank.rank]) if wire[rank.rank] is not None else f"{'n/a':>10}"
            lines.append(
                f"  {rank.rank:>4}  {shown(rank.busy)}  {shown(rank.bubble)}  {bubble_share:>8.1%}  "
                f"{shown(rank.exposed_comm)}  " + "".join(f"{shown(getattr(rank, name))}  " for name, _ in named)
                + f"{on_wire}  {rank.peak_inflight_microbatches:g}"
            )
        lines.append(f"  (busy + bubble + exposed{''.join(' + ' + title for _, title in named)} = step time on "
                     f"every rank; on wire: its sends' time on the links, from leaving to arriving)")
        lines.append(f"  (times in {unit}; peak in-flight in microbatches of the rank's whole share of the model)")
        lines += self._comm_and_memory_lines(unit, scale, shown)
        return "\n".join(lines)

    def _comm_and_memory_lines(self, unit: str, scale: float, shown) -> list[str]:
        # a column only for collectives the step has, the table only if it says something
        kinds = [kind for kind in ("tp", "ep", "cp", "dp") if all(kind in comm for comm in self.comm)
                 and any(comm[kind]["total"] for comm in self.comm)]
        if not kinds and not self.memory:
            return ["  memory           n/a (the costs do not size it: give --stash-bytes and --param-bytes, "
                    "or --model)"]
        lines = [f"  collectives (total / exposed, {unit}); memory (GB)" if kinds else "  memory (GB)"]
        header = "".join(f"{kind:>19}  " for kind in kinds)
        lines.append(f"  {'rank':>4}  {header}{'peak mem':>9}  {'capacity':>9}")
        for rank, comm in enumerate(self.comm):
            cells = [f"{shown(comm[kind]['total'], 9)}/{shown(comm[kind]['exposed'], 0):<9}" for kind in kinds]
            memory = self.memory[rank] if rank < len(self.memory) else None
            peak = f"{memory.peak_bytes / 1e9:>9.2f}" if memory else f"{'n/a':>9}"
            bounded = memory is not None and memory.capacity_bytes != float("inf")
            capacity = f"{memory.capacity_bytes / 1e9:>9.2f}" if bounded else f"{'-':>9}"
            flag = "  OOM" if memory and memory.oom else ""
            lines.append(f"  {rank:>4}  {''.join(cell + '  ' for cell in cells)}{peak}  {capacity}{flag}")
        lines += self._headroom_lines()
        for memory in self.memory:
            if memory.oom:
                lines.append(
                    f"  warning: rank {memory.rank} on {memory.device} needs {memory.peak_bytes / 1e9:.2f} GB "
                    f"but the device holds {memory.capacity_bytes / 1e9:.2f} GB, {memory.usable_bytes / 1e9:.2f} GB "
                    "of it usable (out of memory)"
                )
        within = ORDER_WITHIN_MEMORY.get(self.schedule.name)
        if within and any(memory.oom for memory in self.memory):
            lines.append(f"  hint: {within} keeps {self.schedule.name}'s placement and builds its order within each "
                         f"device's memory: --schedule {within} --memory-limit device (docs/schedules.md)")
        return lines


    def _headroom_lines(self) -> list[str]:
        """What each rank may use and why: by the rule, a row per rank with its parts (CUDA
        context, NCCL's buffers by communicator, fragmentation at the peak); else the one
        number ``--memory-headroom`` gave."""
        bounded = [memory for memory in self.memory if memory.capacity_bytes != float("inf")]
        text = self.parallel.memory_headroom.text
        if not bounded or not any(memory.headroom_bytes for memory in bounded):
            return []
        if not bounded[0].headroom_parts:
            headroom = max(memory.headroom_bytes for memory in bounded)
            return [f"  (a rank may use its capacity less {headroom / 1e9:.2f} GB of headroom: "
                    f"--memory-headroom {text})"]
        share = bounded[0].headroom_parts["fragmentation_share"]
        lines = [f"  headroom (GB, --memory-headroom {text}): CUDA context, NCCL buffers, fragmentation ({share:.0%} "
                 "of the peak); in all: the peak with them; usable: the most a peak may be",
                 f"  {'rank':>4}  {'context':>8}  {'nccl':>6}  {'(by communicator)':<34}  {'fragm.':>6}  "
                 f"{'in all':>9}  {'usable':>7}"]
        for memory in bounded:
            parts = memory.headroom_parts
            nccl = parts["nccl_bytes"]
            kinds = ", ".join(f"{kind} {value / 1e9:.2f}" for kind, value in nccl.items()) or "-"
            lines.append(f"  {memory.rank:>4}  {parts['cuda_context_bytes'] / 1e9:>8.2f}  "
                         f"{sum(nccl.values()) / 1e9:>6.2f}  {kinds:<34}  {memory.fragmentation_bytes / 1e9:>6.2f}  "
                         f"{memory.device_bytes / 1e9:>9.2f}  {memory.usable_bytes / 1e9:>7.2f}")
        return lines


_ROUNDING = 1e-12  # of the step: below it a printed time is float rounding, shown as 0


def _time_unit(seconds: float) -> tuple[str, float]:
    return time_unit(seconds)  # the one rule: ms below 10 s


def predicted_semantics(topology: Topology) -> str:
    """The P2P semantics of the backend a topology describes: NCCL (rendezvous) for GPU
    clusters, the measuring backend's for ``bench-comm`` files."""
    return default_semantics(topology.backend or "nccl")


def comm_plan_of(lowered: Schedule, costs: Costs, topology: Topology, mapping: RankMapping | None,
                 parallel: ParallelConfig) -> CommPlan | None:
    """The step's tp/dp/ep/cp collectives for this layout; None for a lone pipeline (or
    devices given by hand, without a mapping to place the other replicas). A pipeline holding
    copies of the model (DualPipe) sums each stage's gradients across its copies even alone."""
    if mapping is None or (parallel.gpus <= 1 and lowered.copies == 1):
        return None
    return comm_plan(lowered, costs, topology, mapping, parallel.bucket_bytes, parallel.overlap_dp,
                     parallel.algorithm, parallel.zero, parallel.cp_comm, parallel.overlap_tp,
                     parallel.overlap_param_gather, parallel.overlap_slowdown, parallel.zero3_collectives)


@without_collector
def run_simulation(
    schedule: Schedule,
    costs: Costs,
    topology: Topology,
    rank_devices: Sequence[str] | None = None,
    validate: bool = True,
    parallel: ParallelConfig | None = None,
    p2p: str | None = None,
) -> SimulationResult:
    """Map ranks onto devices, lower, validate (naming any bad action), simulate and
    compute metrics. With ``parallel`` (dp, tp > 1) the pipeline simulated is replica 0's
    and its ranks also pay their tp and dp collectives. ``p2p`` is the point-to-point
    semantics (``schedules.p2p``); by default the one of the backend predicted: gloo's
    for links measured on gloo, NCCL's rendezvous otherwise.

    What costs nothing is checked first (the cluster holds the layout, the costs describe
    the schedule's stages), then the programs' structure; whether they can finish is the
    engine's verdict on the step itself, so a schedule is not run twice."""
    parallel = parallel or ParallelConfig()
    p2p = p2p or predicted_semantics(topology)
    if costs.num_stages != schedule.num_stages:
        raise ValueError(f"costs describe {costs.num_stages} stages but the schedule has {schedule.num_stages}")
    mapping = None
    if rank_devices is None:
        mapping = map_ranks(topology, parallel.dp, schedule.pp, parallel.tp, parallel.rank_order, parallel.cp,
                            parallel.ep, parallel.etp)
        rank_devices = mapping.pipeline()
    unplanned = price_step(schedule, costs, topology, rank_devices)  # what lowering plans with
    lowered = lower_for(schedule, costs, topology, rank_devices, timing=unplanned.timing)
    if validate:
        validate_schedule(lowered, p2p, finishes=False)
    plan = comm_plan_of(lowered, costs, topology, mapping, parallel)
    # without a plan the step costs what lowering planned with: priced once
    priced = unplanned if plan is None else price_step(lowered, costs, topology, rank_devices, plan)
    step = run_step(lowered, costs, topology, rank_devices, plan, p2p, priced)
    if step.stuck:
        explain_stuck(step)
    trace = step_trace(step, costs, topology, rank_devices, plan, p2p, priced)
    trace.meta.update(dp=parallel.dp, tp=parallel.tp)  # charts and reports name the whole layout
    trace.meta.update({axis: size for axis, size in (("cp", parallel.cp), ("ep", parallel.ep)) if size > 1})
    if parallel.etp and parallel.etp != parallel.tp:
        trace.meta["etp"] = parallel.etp
    metrics = step_metrics(trace, lowered.virtual_stages)
    return SimulationResult(lowered, topology, trace, metrics, costs, list(rank_devices), parallel, mapping)
