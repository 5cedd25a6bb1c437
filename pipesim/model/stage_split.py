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

Given by hand (``--layers-per-stage``), a stage may hold no layer only if it is the first
(the embedding alone) or the last (the output layer alone).
"""

from __future__ import annotations

import heapq
import math

from pipesim.model.errors import ModelSpecError


def split_layers(layers: int, num_stages: int, layers_per_stage: list[int] | None = None,
                 first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Layers on each of ``num_stages`` stages: as given (checked), or balanced with the
    first stage carrying ``first_extra`` and the last ``last_extra`` more than its layers,
    both in units of one mean layer's time (see the module)."""
    if layers_per_stage is not None:
        return check_layers_per_stage(layers_per_stage, layers, num_stages)
    if num_stages == 1:
        return [layers]
    if layers < num_stages - 2:
        raise ModelSpecError(
            f"the model has {layers} layers, too few for {num_stages} stages (pp x virtual stages): at most "
            f"{layers + 2}, the first and last holding only the embedding and the output layer")
    extras = [max(first_extra, 0.0)] + [0.0] * (num_stages - 2) + [max(last_extra, 0.0)]
    slowest = _least_slowest_stage(layers, extras)
    counts = [_capacity(slowest, extra) for extra in extras]
    surplus = sum(counts) - layers
    # take the surplus off the heaviest stages, among equals the outermost first
    outside_in = sorted(range(num_stages), key=lambda stage: min(stage, num_stages - 1 - stage))
    rank = {stage: position for position, stage in enumerate(outside_in)}
    heap = [(-(counts[stage] + extras[stage]), rank[stage], stage) for stage in range(num_stages)]
    heapq.heapify(heap)
    while surplus > 0:
        _, position, stage = heapq.heappop(heap)
        if counts[stage] <= _least_layers(stage, num_stages):
            continue  # cannot give up a layer: no longer a candidate
        counts[stage] -= 1
        surplus -= 1
        heapq.heappush(heap, (-(counts[stage] + extras[stage]), position, stage))
    return counts


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


def _least_slowest_stage(layers: int, extras: list[float]) -> float:
    """The least slowest-stage time (in layers) under which the stages hold every layer,
    each middle stage at least one: the least ``count + extra`` (a candidate per distinct
    extra) that holds them, each found by a binary search over ``count``."""
    floor = max(1.0, *extras)  # a middle stage holds a layer; an end stage its extra
    stages_of = {extra: extras.count(extra) for extra in set(extras)}

    def holds(slowest: float) -> bool:
        return sum(count * _capacity(slowest, extra) for extra, count in stages_of.items()) >= layers

    best = math.inf
    for extra in stages_of:
        low = max(0, math.ceil(floor - extra - 1e-12))
        high = layers + 1  # every layer on one stage fits
        while low < high:
            middle = (low + high) // 2
            if holds(middle + extra):
                high = middle
            else:
                low = middle + 1
        if holds(low + extra):
            best = min(best, low + extra)
    return best
