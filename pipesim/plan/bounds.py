"""What a layout provably cannot beat, before it is simulated: a lower bound on its step
time, and the least memory any schedule of it holds. The search simulates layouts best
bound first and stops once no bound left can reach the top; layouts whose floor exceeds
the device are rejected without a simulation (``tests/test_plan.py`` holds both to the
simulation of every schedule, with tp, dp and ZeRO).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import add, attrgetter

from pipesim.model.costs import Costs


def step_lower_bound(costs: Costs, placement: Sequence[int], microbatches: int, split_backward: bool,
                     holds: dict[tuple[int, str], float], gather_seconds: dict[int, float],
                     hop: Callable[[int, int], float], overlapped_pairs: bool = False,
                     reductions: Reductions | None = None) -> float:
    """A step time no order of a schedule with this ``placement`` can beat.

    For each pipeline rank r (whose lowest stage is stage r under both the looped and the
    V placement):
    - it cannot start before microbatch 0's forward has crossed stages 0..r-1: their
      forwards, what holds a rank after each (``holds[stage, kind]``: tensor-parallel
      collectives, ZeRO-3's unhidden parameter gathers) and the unloaded transfer of each
      boundary (``hop(source, target)``);
    - it then runs all its work: every microbatch's forward and backward of its stages,
      each with its holds (a split backward's are the full backward's or more: its input
      gradient hides less of the gathers and ends with the same tp collectives);
    - without a split backward its last action is a backward of stage r (any later
      backward of a higher stage would feed one of stage r after it), which then still
      has to cross stages r-1..0; with a split backward the weight gradients may come
      last, so nothing is added;
    - then the optimizer step and, under ZeRO-1 and 2, the parameter all-gathers
      (``gather_seconds``) of the rank that ends the step;
    - and the rank's one dp stream (``reductions``): the optimizer step waits for its
      last gradient reduction, and the reductions run one at a time. Under ZeRO-2 and 3
      every microbatch's backward is reduced, none before the rank's first forward can
      start (its fill), so the stream holds ``microbatches`` reductions of the rank's
      stages after the fill; without overlap a once-per-step reduction waits for the
      rank's last action.
    With overlapped forward-backward pairs of a given cost (``overlap_fb``) the pair may
    undercut F + B: only the step's tail is certain."""
    if overlapped_pairs:
        return costs.step_overhead + costs.grad_norm_overhead
    return bound_of(with_tail(busy_terms(costs, placement, holds, hop), costs, placement, gather_seconds),
                    microbatches, split_backward, reductions)


@dataclass(frozen=True)
class Reductions:
    """What a rank's dp stream must carry in a step, for ``step_lower_bound``: per pipeline
    rank, one reduction of its stages' gradients (every bucket,
    ``pipesim.sim.parallel.gradient_reduction_seconds``), reduced after every
    microbatch's backward (``every_backward``: ZeRO-2 and 3) or once, and then whether
    only after the rank's last action (``after_compute``: no overlap with the backward)."""

    per_rank: tuple[float, ...]
    every_backward: bool
    after_compute: bool


def reductions_of(placement: Sequence[int], stage_seconds: dict[int, float], every_backward: bool,
                  after_compute: bool) -> Reductions | None:
    """``Reductions`` of the stages' one-backward reduction seconds, added per rank in stage
    order; None where they cannot raise the bound (reduced once, overlapping the backward:
    the stream's work then fits in the step's compute)."""
    if not stage_seconds or not (every_backward or after_compute):
        return None
    per_rank = [0.0] * (max(placement) + 1)
    for stage, rank in enumerate(placement):
        per_rank[rank] += stage_seconds.get(stage, 0.0)
    return Reductions(tuple(per_rank), every_backward, after_compute)


@dataclass(frozen=True)
class BoundTerms:
    """What ``step_lower_bound`` adds up, per pipeline rank: one microbatch's forwards and
    backwards of its stages with their holds (``work``), microbatch 0's forward across
    the stages below it (``fill``), the backward's trip back across them (``drain``), and
    the optimizer step with the rank's parameter gathers (``tail``). The same for every
    schedule of a placement and every microbatch count, so a planner keeps them."""

    work: tuple[float, ...]
    fill: tuple[float, ...]
    drain: tuple[float, ...]
    tail: tuple[float, ...]


def busy_terms(costs: Costs, placement: Sequence[int], holds: dict[tuple[int, str], float],
               hop: Callable[[int, int], float]) -> BoundTerms:
    """The terms of ``step_lower_bound`` without the tail (left empty), one pass over the stages: the same
    for every optimizer step and parameter gather after it, so a planner keeps them for
    every ZeRO stage that gathers nothing per layer."""
    stages = costs.stages
    pp = max(placement) + 1
    # each stage's compute plus its holds, by builtins over the stages (a plan bounds thousands)
    forward = list(map(add, map(_FORWARD, stages), map(holds.get, _held_keys(len(stages), "F"), repeat(0.0))))
    backward = list(map(add, map(_BACKWARD, stages), map(holds.get, _held_keys(len(stages), "B"), repeat(0.0))))
    work = [0.0] * pp  # each rank's forwards and backwards of one microbatch, its stages in order
    for rank, seconds in zip(placement, map(add, forward, backward), strict=True):
        work[rank] += seconds
    fill, drain = [0.0] * pp, [0.0] * pp  # across stages 0..rank-1, running sums
    for rank in range(1, pp):
        fill[rank] = fill[rank - 1] + (forward[rank - 1] + hop(rank - 1, rank))
        drain[rank] = drain[rank - 1] + (backward[rank - 1] + hop(rank, rank - 1))
    return BoundTerms(tuple(work), tuple(fill), tuple(drain), ())


_FORWARD, _BACKWARD = attrgetter("fwd"), attrgetter("bwd")


@functools.lru_cache(maxsize=256)
def _held_keys(stages: int, kind: str) -> tuple[tuple[int, str], ...]:
    """The ``holds`` keys of ``kind`` of stages 0..stages-1, in order, built once per count."""
    return tuple((stage, kind) for stage in range(stages))


def with_tail(terms: BoundTerms, costs: Costs, placement: Sequence[int],
              gather_seconds: dict[int, float]) -> BoundTerms:
    """``terms`` with each rank's tail: gradient clipping's norm, the optimizer step and
    its stages' parameter gathers (``gather_seconds``), added in stage order."""
    tail = [0.0] * len(terms.work)
    if gather_seconds:  # else every rank adds only zeros: ZeRO 0 and 3 gather nothing after the step
        for stage, rank in enumerate(placement):
            tail[rank] += gather_seconds.get(stage, 0.0)
    after = costs.grad_norm_overhead + costs.step_overhead
    return BoundTerms(terms.work, terms.fill, terms.drain, tuple(after + seconds for seconds in tail))


def bound_of(terms: BoundTerms, microbatches: int, split_backward: bool,
             reductions: Reductions | None = None) -> float:
    """``step_lower_bound`` from its terms: the largest over ranks of fill + every
    microbatch's work + tail, without a split backward the drain back to stage 0
    before rank 0's tail, and the fill + the dp stream's reductions + tail."""
    busy = [microbatches * work for work in terms.work]  # one list pass per term: a plan bounds many layouts
    ends = [0.0] + [fill + work + tail for fill, work, tail in zip(terms.fill, busy, terms.tail, strict=True)]
    if not split_backward:
        first_tail = terms.tail[0]
        ends += [fill + work + drain + first_tail
                 for fill, work, drain in zip(terms.fill[1:], busy[1:], terms.drain[1:], strict=True)]
    if reductions is not None:
        if reductions.every_backward:  # every microbatch's, one after another, none before the fill
            ends += [fill + microbatches * reduce + tail
                     for fill, reduce, tail in zip(terms.fill, reductions.per_rank, terms.tail, strict=True)]
        else:  # once, after the rank's last action
            ends += [fill + work + reduce + tail
                     for fill, work, reduce, tail in zip(terms.fill, busy, reductions.per_rank, terms.tail,
                                                         strict=True)]
    return max(ends)


def static_floor(placement: Sequence[int], static_bytes: Sequence[float]) -> list[float]:
    """``floor_of``'s parameters, gradients and optimizer state per rank, its stages
    added in order (as a sum over them would add them). Apart from the stash: a planner
    shares each part among the layouts that hold the same of it."""
    static = [0.0] * (max(placement) + 1)
    for rank, held in zip(placement, static_bytes, strict=True):
        static[rank] += held
    return static


def stash_floor(costs: Costs, placement: Sequence[int]) -> list[float]:
    """``floor_of``'s stash per rank: one microbatch's of its largest stage."""
    stash = [0.0] * (max(placement) + 1)
    for rank, cost in zip(placement, costs.stages, strict=True):
        if cost.stash_bytes > stash[rank]:
            stash[rank] = cost.stash_bytes
    return stash


def floor_of(static: Sequence[float], stash: Sequence[float]) -> list[float]:
    """Per rank, the least memory any schedule holds: its stages' parameters, gradients and
    optimizer state (``static_floor``) and one microbatch's stash of its largest stage
    (``stash_floor``), kept apart so that a planner shares each part among the layouts
    that hold the same of it."""
    return [held + largest for held, largest in zip(static, stash, strict=True)]
