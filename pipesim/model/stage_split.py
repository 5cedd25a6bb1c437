"""How a model's layers are split over pipeline stages (model chunks).

By default the split balances each stage's compute, the embedding on the first stage
and the output layer on the last included: no stage may take longer than it must, since
the slowest stage sets the pipeline's pace. Layers are counted at their mean time (a
model whose layers differ, a mixture of experts after a few dense layers, is balanced by
count of mean layers), the first and last stage at their layers' plus the embedding's
and the output layer's time, in layers. Among the splits that reach the least possible
slowest stage, layers are taken off the heaviest stages first and, among equals, off the
outermost: the first and last stage end up with fewer layers, as Meta did for Llama 3
405B ("we reduce one Transformer layer each from the first and the last stages",
Dubey et al. 2024, section 3.3.2): 126 layers on 16 stages give 7, 8, ..., 8, 7, and on
128 stages (16 ranks of 8 chunks) 0, 1, ..., 1, 0 — a first chunk holding only the
embedding and a last one only the output layer.

The search is over the slowest stage's time, not over splits: that time is a whole number
of layers plus the first or last stage's extra, and the number of layers each stage can
take under it follows, so the split costs a binary search over a few hundred candidate
times, whatever the stages.

Where one rank holds both ends of the model (a V-shaped placement, zbv's and dualpipev's:
rank 0 runs the first and the last of ``2 pp`` chunks; DualPipe's two copies: rank 0 runs
copy 0's first stage and copy 1's last), what sets the pace is each rank's stages
together, and balancing stage by stage misjudges that rank: it fills the embedding's
stage like any other beside the output layer's (Gemma 3 1B, whose output layer and loss
outweigh several layers, zbv at pp 4: rank 0 over-full), or takes layers off both ends
and gives the middle ranks the surplus (32 layers, the output layer worth 3: a middle
rank holds 10 where 9 would do). There the split balances each rank's stages together
(``ranks``): the same search over the slowest rank's time, each rank's layers then shared
among its stages so that their times are as even as they can be (the later stage first
among equals).

Given by hand (``--layers-per-stage``), a stage may hold no layer only if it is the first
(the embedding alone) or the last (the output layer alone).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from pipesim.model.errors import ModelSpecError


def split_layers(layers: int, num_stages: int, layers_per_stage: list[int] | None = None,
                 first_extra: float = 0.0, last_extra: float = 0.0,
                 ranks: Sequence[int] | None = None) -> list[int]:
    """Layers on each of ``num_stages`` stages: as given (checked), or balanced with the
    first stage carrying ``first_extra`` and the last ``last_extra`` more than its layers,
    both in units of one mean layer's time, stage by stage or, given ``ranks`` (the rank
    each stage's work falls on: ``ends_on_one_rank``), rank by rank (see the module)."""
    if layers_per_stage is not None:
        return check_layers_per_stage(layers_per_stage, layers, num_stages)
    if num_stages == 1:
        return [layers]
    if layers < num_stages - 2:
        raise ModelSpecError(
            f"the model has {layers} layers, too few for {num_stages} stages (pp x virtual stages): at most "
            f"{layers + 2}, the first and last holding only the embedding and the output layer")
    extras = [max(first_extra, 0.0)] + [0.0] * (num_stages - 2) + [max(last_extra, 0.0)]
    return _split_by_rank(layers, extras, tuple(range(num_stages)) if ranks is None else ranks)


def check_layers_per_stage(counts: list[int], layers: int, num_stages: int) -> list[int]:
    """``--layers-per-stage`` if it describes the schedule's stages and the model's
    layers, a one-line error naming what is wrong otherwise."""
    given = ",".join(map(str, counts))
    if len(counts) != num_stages:
        raise ModelSpecError(f"--layers-per-stage lists {len(counts)} stages but the schedule has {num_stages} "
                             "(pp x virtual stages)")
    if any(count < 0 for count in counts):
        raise ModelSpecError(f"--layers-per-stage {given}: a stage holds 0 layers or more")
    empty = [stage for stage, count in enumerate(counts) if count == 0 and 0 < stage < num_stages - 1]
    if empty:
        raise ModelSpecError(f"--layers-per-stage {given}: stage {empty[0]} holds no layer; only the first stage "
                             "(the embedding alone) or the last (the output layer alone) may")
    if sum(counts) != layers:
        raise ModelSpecError(f"--layers-per-stage {given} sums to {sum(counts)} but the model has {layers} layers")
    return list(counts)


def _least_layers(stage: int, num_stages: int) -> int:
    """A middle stage holds a layer at least; the first and last may hold none."""
    return 0 if stage in (0, num_stages - 1) else 1


def _capacity(slowest: float, extra: float) -> int:
    """Layers a stage with ``extra`` fits under ``slowest`` (a little slack for rounding)."""
    return max(0, math.floor(slowest - extra + 1e-9))


def _least_holding_time(extras: Iterable[float], holds: Callable[[float], bool], layers: int) -> float:
    """The least ``count + extra`` over the distinct ``extras`` (each the time of a rank
    that carries it, in layers) for which ``holds``, each found by a binary search over
    ``count`` (every layer on one rank always fits)."""
    best = math.inf
    for extra in set(extras):
        low, high = 0, layers + 1
        while low < high:
            middle = (low + high) // 2
            if holds(middle + extra):
                high = middle
            else:
                low = middle + 1
        if holds(low + extra):
            best = min(best, low + extra)
    return best


def ends_on_one_rank(placement: Sequence[int], copies: int = 1) -> tuple[int, ...] | None:
    """For the split of one copy's stages: the rank whose load each stage counts toward
    where one rank holds both ends of the model (see the module), else None. With
    ``copies`` of the model (DualPipe's two, each split alike) rank ``r`` holds copy 0's
    stage ``r`` and copy 1's stage ``pp - 1 - r``, so stages ``s`` and ``pp - 1 - s`` of
    one copy weigh on the same two ranks; with one copy, the placement's own ranks."""
    if copies > 1:
        return folded_ranks(len(placement) // copies)
    if len(placement) > 1 and placement[0] == placement[-1]:
        return tuple(placement)
    return None


def folded_ranks(num_stages: int) -> tuple[int, ...]:
    """Stage ``s`` and stage ``num_stages - 1 - s`` on one rank: a V placement's chunks
    (``2 pp`` of them), or one DualPipe copy's ``pp`` stages as the two copies load the
    ranks (``ends_on_one_rank``)."""
    return tuple(min(stage, num_stages - 1 - stage) for stage in range(num_stages))


def _split_by_rank(layers: int, extras: list[float], ranks: Sequence[int]) -> list[int]:
    """``split_layers`` rank by rank (stage by stage where each stage is a rank of its
    own): each rank's stages one super-stage of their extras added up (the least slowest
    rank, then the surplus taken off the heaviest ranks, among equals the one holding the
    outermost stage first), then each rank's layers spread over its stages, every stage to
    its least first and then one layer at a time to the stage whose time is least (the
    later stage among equals)."""
    num_stages = len(extras)
    if len(ranks) != num_stages:
        raise ValueError(f"ranks names {len(ranks)} stages' ranks, not {num_stages}")
    stages_of: dict[int, list[int]] = {}
    for stage, rank in enumerate(ranks):
        stages_of.setdefault(rank, []).append(stage)
    groups = list(stages_of.values())
    extra = [sum(extras[stage] for stage in group) for group in groups]
    least = [sum(_least_layers(stage, num_stages) for stage in group) for group in groups]

    alike = Counter(zip(extra, least, strict=True))  # ranks alike in extra and least layers: one check each

    def holds(slowest: float) -> bool:
        return (all(_capacity(slowest, carried) >= need for carried, need in alike)
                and sum(count * _capacity(slowest, carried) for (carried, _), count in alike.items()) >= layers)

    slowest = _least_holding_time(extra, holds, layers)
    totals = [_capacity(slowest, carried) for carried in extra]
    surplus = sum(totals) - layers
    outside_in = sorted(range(num_stages), key=lambda stage: min(stage, num_stages - 1 - stage))
    position = {stage: place for place, stage in enumerate(outside_in)}
    heap = [(-(totals[index] + extra[index]), min(position[stage] for stage in groups[index]), index)
            for index in range(len(groups))]
    heapq.heapify(heap)
    while surplus > 0:
        _, first, index = heapq.heappop(heap)
        if totals[index] <= least[index]:
            continue
        totals[index] -= 1
        surplus -= 1
        heapq.heappush(heap, (-(totals[index] + extra[index]), first, index))
    counts = [0] * num_stages
    for group, total in zip(groups, totals, strict=True):
        for stage in group:
            counts[stage] = _least_layers(stage, num_stages)
        for _ in range(total - sum(counts[stage] for stage in group)):
            stage = min(group, key=lambda member: (counts[member] + extras[member], -member))
            counts[stage] += 1
    return counts
