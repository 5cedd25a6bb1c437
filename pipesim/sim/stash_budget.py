"""A memory budget turned into the activation stashes a cost-aware schedule may hold.

zb-auto and zbv-auto trade memory for bubble: the more microbatches' activations a rank
may keep between a forward and its weight gradient, the more of the bubble its ``W``
passes fill (Qi et al. 2024: ZB-1p at 1F1B's ``p`` stashes, ZB-2p at ``2p - 1``). Their
``--memory-limit`` counts those stashes, in microbatches of a rank's share of the model;
a user planning a job thinks in gigabytes. ``--memory-limit 60GB`` (decimal gigabytes,
as every memory figure pipesim prints; ``GiB`` for binary ones) or ``--memory-limit
device`` (each rank's usable memory: its device's capacity less the headroom rule of
``pipesim.sim.headroom``) becomes the most stashes each rank can hold within it:

    stashes = floor((budget - static - buffers) / stash)      per rank

``static`` and ``buffers`` are what the rank holds whatever the order
(``pipesim.sim.memory.rank_bases``: parameters, gradients and optimizer state as sharded,
its pipeline and data-parallel buffers), ``stash`` one microbatch's activations on it:
zb-auto's one stage's ``stash_bytes``; zbv-auto's larger chunk's, counted in halves as
zbv-auto counts a chunk's stash. The ranks differ (the last holds the output layer and
its logits, the first the embedding; in zbv-auto's V, rank 0 holds both), and both
schedules take a count per rank, so a rank with room to spare is not held to the
fullest rank's count: one limit for all would leave zb-auto slower than 1F1B within a
budget 1F1B fits, since 1F1B's last rank holds one stash. No more than the step's
microbatches are ever held, so a count stops there.

The budget is a peak as ``simulate`` reports it (what PyTorch allocates; the headroom
rule then says whether the device holds it), so an order built under the limit
simulates to a peak within the budget on every rank: the schedules count a stash from
its forward to its last backward piece, as the memory report counts it, and never less
than it holds (both round the share still held between ``I`` and ``W`` up,
``pipesim.sim.cost_aware.planned_share``; zbv-auto counts a chunk's stash at its rank's
larger chunk's size).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipesim.model.costs import Costs
from pipesim.sim.cost_aware import build_cost_aware, cost_shell, order_step, planning_inputs
from pipesim.sim.headroom import pipeline_net_channels
from pipesim.sim.memory import memory_report, program_order_trace, rank_bases, rank_communicators
from schedules.generators import V_SHAPED
from schedules.generators.common import ScheduleUnavailableError
from schedules.schedule import Schedule

GB = 1e9
GIB = 2.0**30
# schedules whose limit is in bytes underneath (interleaved-auto counts each stage's stash at
# its size): a budget gives them the fraction of a microbatch it has room for too
FRACTIONAL = frozenset({"interleaved-auto"})
DEVICE = "device"
_UNITS = (("gib", GIB), ("gb", GB))  # longest suffix first


@dataclass(frozen=True)
class MemoryBudget:
    """``--memory-limit`` as bytes per GPU (``bytes``), or, ``bytes`` None, each rank's
    usable device memory; ``text`` as the user wrote it, for messages."""

    bytes: float | None
    text: str


def parse_memory_limit(text: str) -> int | float | MemoryBudget:
    """``--memory-limit``: a number of microbatches' stashes (whole, or halves where a
    schedule counts them), a size per GPU (``60GB``, ``60 GiB``) or ``device``; a
    ``ValueError`` naming the value otherwise."""
    cleaned = str(text).strip().lower().replace(" ", "")
    if cleaned == DEVICE:
        return MemoryBudget(None, DEVICE)
    for suffix, unit in _UNITS:
        if cleaned.endswith(suffix):
            value = _finite(cleaned[: -len(suffix)])
            if value is None or value <= 0:
                raise ValueError(f"a size must be a positive number of gigabytes, e.g. 60GB, got {text!r}")
            return MemoryBudget(value * unit, str(text).strip())
    value = _finite(cleaned)
    if value is None:
        raise ValueError(f"must be a number of microbatches, a size per GPU such as 60GB, or {DEVICE!r}, "
                         f"got {text!r}")
    return int(value) if value.is_integer() else value


def is_budget(memory_limit) -> bool:
    """Whether ``memory_limit`` (as a job holds it: a count, a budget, or the flag's text) is a
    budget in bytes or ``device``, whose stash counts depend on what else each rank holds."""
    if isinstance(memory_limit, str):
        memory_limit = parse_memory_limit(memory_limit)
    return isinstance(memory_limit, MemoryBudget)


def _finite(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class StashLimit:
    """What a budget allows each rank: ``stashes`` microbatches (in halves for zbv-auto),
    each rank holding ``base_bytes`` whatever the order and ``stash_bytes`` per microbatch
    as the limit counts it (zbv-auto: twice its larger chunk's) within its
    ``budget_bytes``; ``tightest`` names the rank with the fewest stashes and, of equals,
    the least room left."""

    budget: MemoryBudget
    stashes: tuple[float, ...]
    budget_bytes: tuple[float, ...]
    base_bytes: tuple[float, ...]
    stash_bytes: tuple[float, ...]
    tightest: int

    @property
    def limit(self) -> tuple[float, ...]:
        """The ``memory_limit`` the schedule takes, one count per rank (whole where whole)."""
        return tuple(int(count) if count.is_integer() else count for count in self.stashes)

    def note(self, schedule: str) -> str:
        """One line for the user: the budget, the counts it gives and the tightest rank."""
        rank = self.tightest
        count = self.stashes[rank]
        within = "its usable memory" if self.budget.bytes is None else "the limit"
        counts = ", ".join(f"{value:.4g}" for value in self.stashes)
        return (f"note: --memory-limit {self.budget.text}: {schedule} may hold {counts} microbatches' activations "
                f"on ranks 0 to {len(self.stashes) - 1}; rank {rank}: {self.base_bytes[rank] / GB:.2f} GB of "
                f"parameters, gradients, optimizer state and buffers + {count:.4g} x "
                f"{self.stash_bytes[rank] / GB:.3f} GB within {within}, {self.budget_bytes[rank] / GB:.2f} GB")


def stash_limit(budget: MemoryBudget, schedule: str, microbatches: int, costs: Costs, placement: Sequence[int],
                devices: Sequence[str], topology, parallel) -> StashLimit:
    """The stashes ``budget`` allows ``schedule`` on each rank (zb-auto; zbv-auto counting
    halves) on the pipeline of ``placement`` over
    ``devices`` of ``topology``, its state sharded as ``parallel`` (a ``ParallelConfig``)
    says; a one-line ``ValueError`` where the costs say nothing about memory, the devices'
    memory is unknown, or a rank cannot hold one microbatch within the budget."""
    flag = f"--memory-limit {budget.text}"
    if not costs.memory_known:
        raise ValueError(f"{flag} needs each stage's memory: give --model, --stash-bytes and --param-bytes, or a "
                         f"costs file that has them (or give the limit in microbatches)")
    num_ranks = max(placement) + 1
    holders = parallel.dp * parallel.cp  # zb-auto and zbv-auto run one copy of the model
    static, buffers = rank_bases(costs, placement, num_ranks, parallel.bytes_per_param, holders,
                                 parallel.bucket_bytes, parallel.zero, parallel.expert_holders(holders))
    budgets = _rank_budgets(budget, placement, devices, topology, parallel, holders, flag)
    halves = schedule in V_SHAPED
    bases, units, counts, room = [], [], [], []
    for rank in range(num_ranks):
        stashes = [costs.stages[stage].stash_bytes for stage, owner in enumerate(placement) if owner == rank]
        unit = max(stashes) if halves else sum(stashes)  # zbv-auto counts a chunk's stash as half a microbatch
        bases.append(static[rank] + buffers[rank])
        units.append(2 * unit if halves else unit)  # one microbatch's activations on the rank, as the limit counts
        room.append(math.inf if unit <= 0 else (budgets[rank] - bases[rank]) / unit)
        fitting = (room[rank] if schedule in FRACTIONAL else math.floor(room[rank] + 1e-9)) if unit > 0 else math.inf
        counts.append(min(fitting / 2 if halves else fitting, microbatches))  # never more than the step holds
    rank = min(range(num_ranks), key=lambda index: (counts[index], room[index], index))  # the tightest
    if counts[rank] < 1:  # this size of the schedule does not exist within the budget (a sweep skips the point)
        raise ScheduleUnavailableError(
            f"{flag}: rank {rank} holds {bases[rank] / GB:.2f} GB of parameters, gradients, optimizer state and "
            f"buffers and {units[rank] / GB:.3f} GB per microbatch's activations, "
            f"{(bases[rank] + units[rank]) / GB:.2f} GB with the one microbatch {schedule} needs at least, over its "
            f"{budgets[rank] / GB:.2f} GB: raise the limit, or shard more (pp, tp, --zero) or recompute")
    return StashLimit(budget, tuple(float(count) for count in counts), tuple(budgets), tuple(bases), tuple(units),
                      tightest=rank)


def _rank_budgets(budget: MemoryBudget, placement: Sequence[int], devices: Sequence[str], topology, parallel,
                  holders: int, flag: str) -> list[float]:
    """Each rank's bytes: the budget as given, or its device's capacity less the headroom
    of the communicators it joins (as ``simulate`` reports ``usable``)."""
    num_ranks = max(placement) + 1
    if budget.bytes is not None:
        return [budget.bytes] * num_ranks
    capacities = [topology.device_memory(device) for device in devices]
    if not all(math.isfinite(capacity) for capacity in capacities):
        raise ValueError(f"{flag}: the topology gives no device memory; give --gpu (with a preset topology) or a "
                         f"topology file with each device's memory, or give the limit in GB")
    communicators = rank_communicators(placement, num_ranks, parallel.tp, holders, parallel.cp, parallel.ep,
                                       parallel.expert_holders(holders), pipeline_net_channels(topology, devices))
    return [capacity - parallel.memory_headroom.of(capacity, group)
            for capacity, group in zip(capacities, communicators, strict=True)]


def resolve_memory_limit(memory_limit: float | str | MemoryBudget | None, schedule: str, microbatches: int,
                         costs: Costs, placement: Sequence[int], devices: Sequence[str], topology, parallel
                         ) -> tuple[float | tuple[float, ...] | None, StashLimit | None]:
    """``memory_limit`` as the stash count (or counts) a cost-aware schedule takes, and the
    ``StashLimit`` behind it where it was a budget (None where it was already a count); a
    string is read as the flag reads it (``"60GB"``, as the Python API may give it)."""
    if isinstance(memory_limit, str):
        memory_limit = parse_memory_limit(memory_limit)
    if not isinstance(memory_limit, MemoryBudget):
        return memory_limit, None
    limit = stash_limit(memory_limit, schedule, microbatches, costs, placement, devices, topology, parallel)
    return limit.limit, limit


def build_within(memory_limit: float | str | MemoryBudget | None, schedule: str, pp: int, microbatches: int,
                 costs: Costs, topology, devices: Sequence[str], parallel, search_seconds: float | None = None
                 ) -> tuple[Schedule, StashLimit | None, bool]:
    """The cost-aware ``schedule`` built within ``memory_limit`` (a count, or a budget turned
    into each rank's count), the ``StashLimit`` behind a budget, and whether zbv's own
    memory was taken instead. zbv-auto counts each chunk's stash at its rank's larger
    chunk's size and the share kept between I and W rounded up, so a budget's counts are
    safe but can fall short of what fits: where they are below zbv's ``p`` on some rank,
    the order built at ``p`` is also tried and taken when its peak, counted in program
    order as the memory report counts it, fits every rank's budget and its step is
    shorter."""
    chunks = costs.num_stages // pp if schedule in FRACTIONAL else None
    limit, budget = resolve_memory_limit(memory_limit, schedule, microbatches, costs,
                                         cost_shell(schedule, pp, microbatches, chunks).placement, devices, topology,
                                         parallel)
    inputs = planning_inputs(schedule, pp, microbatches, costs, topology, devices)
    built = build_cost_aware(schedule, pp, microbatches, costs, topology, limit, devices, search_seconds, inputs)
    if budget is None or schedule not in V_SHAPED or min(budget.stashes) >= pp:
        return built, budget, False
    wider = build_cost_aware(schedule, pp, microbatches, costs, topology, None, devices, search_seconds, inputs)
    cost = order_step(schedule, pp, microbatches, inputs)
    if cost(wider.programs)[::-1] < cost(built.programs)[::-1] and _within(wider, costs, parallel, budget):
        return wider, budget, True
    return built, budget, False


def _within(order: Schedule, costs: Costs, parallel, budget: StashLimit) -> bool:
    """Whether ``order``'s peak on every rank, its stashes counted in program order
    (``pipesim.sim.memory.program_order_trace``), is within that rank's budget."""
    holders = parallel.dp * parallel.cp
    report = memory_report(program_order_trace(order), costs, order.placement, ["gpu"] * order.pp,
                           [math.inf] * order.pp, parallel.bytes_per_param, holders, parallel.bucket_bytes,
                           parallel.zero, parallel.expert_holders(holders), timelines=False)
    return all(rank.peak_bytes <= most for rank, most in zip(report, budget.budget_bytes, strict=True))
