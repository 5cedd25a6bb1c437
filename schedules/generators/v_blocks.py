"""V-Half and V-Min: the V orders of Qi et al., "Pipeline Parallelism with Controllable
Memory" (NeurIPS 2024), built from a repeating building block, at about a half and a
third of ZB-V's activation memory.

On the V placement (rank ``r`` holds stage ``r``, going down, and stage ``2p - 1 - r``,
coming back) a microbatch runs six passes on every rank: the forwards of the down and
the up chunk, the input-gradient backwards of the up and the down chunk, and their two
weight-gradient halves. A *building block* gives the four F and I passes of one
microbatch on every rank a slot each; the schedule repeats it every 6 slots, one
microbatch after another, so a rank's steady state runs F, F, I, I and two W in every 6
slots. How far apart a block spreads the passes decides how long a microbatch's
activations stay on a rank, hence the memory: the paper's V-Min block (the first rank's
down forward at slot 0, its up forward ``2p - 1`` slots later, ...) holds about a third of
ZB-V's, its V-Half block about a half. The offsets of rank ``i`` in slots, as the
authors' scheduler sets them (github.com/sail-sg/zero-bubble-pipeline-parallelism,
``zbv_greedy.py``; a gap ``g`` of 2 slots where 3 divides ``p`` for V-Min, of 3 where 2
divides it for V-Half, keeps the ranks' blocks from colliding):

    V-Min   down F ``i``,      up F ``2p - 1 - i``,  up I ``2p + g + i``,       down I ``4p + g - 1 - i``
    V-Half  down F ``2i``,     up F ``3p - 2 - i``,  up I ``3p + g + 2i - 1``,  down I ``6p + g - i - 2``

Repeated as they are, the blocks leave the warm-up and the drain full of holes. The
paper closes them by *squeezing*: pass by pass in slot order, a pass moves to the
earliest free slot after its inputs that keeps its rank's peak memory within the
repeated schedule's (the steady state, from the first microbatch's last backward on rank
0 to the first rank's last forward, stays as it is). The authors squeeze twice: with
the W passes placed (each W in the first free slot after its backward), then with the
W passes left to fill the free slots as they come; each squeeze ends by running the
order eagerly with unit passes, which packs it. The final W passes are placed the same
way, each after its own chunk's backward. What comes out is each rank's order;
``schedules.engine`` times it on the real costs, as every candidate of ``zbv-auto``.

Memory is counted as the paper counts it and as pipesim's stash is: a forward takes one
chunk's stash (half a microbatch of the rank's share), its W frees it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from schedules.action import Action, ActionKind
from schedules.generators.common import ScheduleUnavailableError
from schedules.schedule import Schedule, v_shape_placement

# the passes of a rank, by the chunk they belong to: forwards of the down and the up
# chunk, input gradients of the up and the down chunk (the order a microbatch meets them
# on the first rank), then their weight gradients
DOWN_F, UP_F, UP_I, DOWN_I, UP_W, DOWN_W = range(6)
BLOCK = 6  # slots a building block repeats after: the six passes of one microbatch
# what each pass waits for on the neighbouring rank: the down chunk flows to higher ranks,
# the up chunk to lower ones (its backward back down)
_FROM_NEIGHBOUR = {DOWN_F: -1, UP_F: 1, UP_I: -1, DOWN_I: 1}
# each F and I pass also waits for the pass before it of the same microbatch on its own rank
_AFTER = {UP_F: DOWN_F, UP_I: UP_F, DOWN_I: UP_I}


def v_min_offsets(pp: int) -> list[list[int]]:
    """Rank ``i``'s slots of a microbatch's four F and I passes in the V-Min block."""
    gap = 2 if pp % 3 == 0 else 0
    return [[i, 2 * pp - 1 - i, 2 * pp + gap + i, 4 * pp + gap - 1 - i] for i in range(pp)]


def v_half_offsets(pp: int) -> list[list[int]]:
    """Rank ``i``'s slots of a microbatch's four F and I passes in the V-Half block."""
    gap = 3 if pp % 2 == 0 else 0
    return [[2 * i, 3 * pp - 2 - i, 3 * pp + gap + 2 * i - 1, 6 * pp + gap - i - 2] for i in range(pp)]


BLOCKS: dict[str, Callable[[int], list[list[int]]]] = {"v-min": v_min_offsets, "v-half": v_half_offsets}

# a rank's passes: slots[kind][microbatch], kinds DOWN_F..DOWN_I, and one list of W passes
# (either chunk's, in the order they free memory) while squeezing, or two at the end
Slots = list[list[int]]


@functools.lru_cache(maxsize=64)
def v_block_order(name: str, pp: int, microbatches: int) -> Schedule:
    """The V-Min (``name`` ``"v-min"``) or V-Half (``"v-half"``) order of ``pp`` ranks and
    ``microbatches`` microbatches on the V placement (see the module)."""
    if name not in BLOCKS:
        raise ScheduleUnavailableError(f"no building block {name!r}; those are: {', '.join(BLOCKS)}")
    if pp < 2 or microbatches < 1:
        raise ScheduleUnavailableError(f"{name}: needs pp >= 2 and at least one microbatch, got pp={pp}, "
                                       f"microbatches={microbatches}")
    repeated = [[list(range(start, start + BLOCK * microbatches, BLOCK)) for start in offsets]
                for offsets in BLOCKS[name](pp)]
    squeezed = _squeeze([_with_weights(rank) for rank in repeated], microbatches, with_weights=True)
    squeezed = _squeeze([rank[:4] for rank in squeezed], microbatches, with_weights=False)
    final = [_with_weights(rank[:4], per_chunk=True) for rank in squeezed]
    programs = [_program(rank, slots, pp) for rank, slots in enumerate(final)]
    return Schedule(pp, microbatches, v_shape_placement(pp, 2), programs, name=name,
                    meta={"memory_microbatches": max(_peak(slots) for slots in final) / 2})


def _all_passes(ranks: list[Slots]) -> list[tuple[int, int, int, int]]:
    """Every rank's passes as ``(slot, rank, kind, microbatch)``, in slot order over all
    ranks (ties by rank, then kind, then microbatch), as the authors' scheduler takes them."""
    return sorted((slot, rank, kind, microbatch) for rank, slots in enumerate(ranks)
                  for kind, times in enumerate(slots) for microbatch, slot in enumerate(times))


def _events(slots: Slots) -> list[tuple[int, int, int]]:
    """A rank's passes as ``(slot, kind, microbatch)`` in slot order."""
    return sorted((slot, kind, microbatch) for kind, times in enumerate(slots) for microbatch, slot in enumerate(times))


def _with_weights(slots: Slots, per_chunk: bool = False) -> Slots:
    """``slots`` (F and I passes) with a W after each I, in the first free slot after it
    (after the last pass where none is free): one W list, or one per chunk
    (``per_chunk``: the up chunk's W first where both wait)."""
    taken = {slot for times in slots for slot in times}
    last = max(taken)
    weights: list[list[int]] = [[], []] if per_chunk else [[]]
    waiting = [0, 0]
    pending = sorted((slot, kind) for kind in (UP_I, DOWN_I) for slot in slots[kind])
    at = 0
    for slot in range(last + 1):
        while at < len(pending) and pending[at][0] < slot:  # an I done before this slot: its W may follow
            waiting[pending[at][1] - UP_I if per_chunk else 0] += 1
            at += 1
        if slot in taken:
            continue
        for chunk in range(len(weights)):
            if waiting[chunk]:
                weights[chunk].append(slot)
                waiting[chunk] -= 1
                break
    while at < len(pending):
        waiting[pending[at][1] - UP_I if per_chunk else 0] += 1
        at += 1
    for chunk in range(len(weights)):
        for _ in range(waiting[chunk]):
            last += 1
            weights[chunk].append(last)
    return [*(list(times) for times in slots), *weights]


def _peak(slots: Slots) -> int:
    """The most chunk stashes a rank holds: each F takes one, each W frees one; without W
    passes (four lists) a free slot after an I frees one, as the W it will hold would."""
    return _Stashes(slots).peak


class _Stashes:
    """A rank's chunk stashes slot by slot (``_peak``'s count), kept so that moving one pass
    earlier is checked by walking only the slots the move changes: from the pass's new
    slot until, past its old one, the count and the I passes waiting for a W are again what
    they were (the rest of the rank is then as before)."""

    def __init__(self, slots: Slots) -> None:
        self.placed_weights = len(slots) > 4
        self.at: dict[int, int] = {slot: kind for kind, times in enumerate(slots) for slot in times}
        self._count()

    def _step(self, kind: int | None, held: int, waiting: int) -> tuple[int, int]:
        if kind in (DOWN_F, UP_F):
            return held + 1, waiting
        if kind in (UP_I, DOWN_I):
            return held, waiting + 1
        if kind is not None:  # a W
            return held - 1, waiting
        if not self.placed_weights and waiting:
            return held - 1, waiting - 1
        return held, waiting

    def _count(self) -> None:
        """Each slot's state after it: stashes held, I passes waiting for a W."""
        self.last = max(self.at)
        held = waiting = 0
        self.held: list[int] = []
        self.waiting: list[int] = []
        for slot in range(self.last + 1):
            held, waiting = self._step(self.at.get(slot), held, waiting)
            self.held.append(held)
            self.waiting.append(waiting)
        self._extremes()

    def _extremes(self) -> None:
        """The most held up to and from each slot, and over the rank."""
        counts = np.array(self.held)
        self.before = np.maximum.accumulate(counts)  # most held in slots 0..s
        self.after = np.maximum.accumulate(counts[::-1])[::-1]  # most held in slots s..last
        self.peak = max(0, int(self.before[-1]))

    def _state(self, slot: int) -> tuple[int, int]:
        return (self.held[slot], self.waiting[slot]) if slot >= 0 else (0, 0)

    def fits_moved(self, old: int, new: int, budget: int) -> bool:
        """Whether the pass at slot ``old`` may move to the free slot ``new < old`` with the
        rank's peak staying within ``budget``."""
        kind = self.at[old]
        held, waiting = self._state(new - 1)
        peak = int(self.before[new - 1]) if new else 0
        for slot in range(new, self.last + 1):
            here = kind if slot == new else None if slot == old else self.at.get(slot)
            held, waiting = self._step(here, held, waiting)
            peak = max(peak, held)
            if peak > budget:
                return False
            if slot >= old and held == self.held[slot] and waiting == self.waiting[slot]:  # the rest as before
                return slot == self.last or int(self.after[slot + 1]) <= budget
        return True

    def move(self, old: int, new: int) -> None:
        """Move the pass at slot ``old`` to ``new``: the states recounted from ``new`` until
        they are again what they were (a rank's last slot stays its last: the slots after a
        pass that left it only free stashes)."""
        self.at[new] = self.at.pop(old)
        held, waiting = self._state(new - 1)
        for slot in range(new, self.last + 1):
            held, waiting = self._step(self.at.get(slot), held, waiting)
            if slot > old and held == self.held[slot] and waiting == self.waiting[slot]:
                break
            self.held[slot], self.waiting[slot] = held, waiting
        self._extremes()


def _squeeze(ranks: list[Slots], microbatches: int, with_weights: bool) -> list[Slots]:
    """Each pass moved to the earliest free slot after its inputs that keeps its rank's
    peak within the schedule's (the module), in slot order over all ranks; then the order
    run eagerly with unit passes. Without W passes the warm-up stays as it is."""
    stashes = [_Stashes(slots) for slots in ranks]
    budget = max(rank.peak for rank in stashes)
    pp = len(ranks)
    taken: list[set[int]] = [set() for _ in ranks]
    phase = "warm-up"
    for slot, rank, kind, microbatch in _all_passes(ranks):
        if phase == "warm-up" and kind == DOWN_I and rank == 0:
            phase = "steady"  # the first microbatch has come back to the first rank
        if phase == "steady" or (phase == "warm-up" and not with_weights):
            if phase == "steady" and kind == DOWN_F and microbatch == microbatches - 1:
                phase = "cool-down"
            taken[rank].add(slot)
            continue
        earliest = _ready(ranks, rank, kind, microbatch, pp) + 1
        moved = next((free for free in range(earliest, slot)
                      if free not in taken[rank] and stashes[rank].fits_moved(slot, free, budget)), slot)
        if moved != slot:
            ranks[rank][kind][microbatch] = moved
            stashes[rank].move(slot, moved)
        taken[rank].add(moved)
    if not with_weights:  # the W passes take the free slots before the order is packed
        ranks = [_with_weights(slots) for slots in ranks]
    return _eager(ranks, pp)


def _inputs(rank: int, kind: int, microbatch: int, pp: int) -> list[tuple[int, int, int]]:
    """The passes ``(rank, kind, microbatch)`` a pass waits for, the one rule of both the
    squeeze and the eager run: the same pass of the microbatch on the neighbouring rank,
    the pass before it on its own rank, and the same pass of the previous microbatch."""
    inputs = []
    step = _FROM_NEIGHBOUR.get(kind)
    if step is not None and 0 <= rank + step < pp:
        inputs.append((rank + step, kind, microbatch))
    if kind in _AFTER:
        inputs.append((rank, _AFTER[kind], microbatch))
    if microbatch:
        inputs.append((rank, kind, microbatch - 1))
    return inputs


def _ready(ranks: list[Slots], rank: int, kind: int, microbatch: int, pp: int) -> int:
    """The latest slot among what a pass waits for (-1: nothing): its ``_inputs``, and a
    W the ``microbatch``-th I of its rank."""
    ready = max((ranks[other][what][which] for other, what, which in _inputs(rank, kind, microbatch, pp)),
                default=-1)
    if kind > DOWN_I:  # the single W list: after as many I passes as Ws before it
        slots = ranks[rank]
        ready = max(ready, sorted(slots[UP_I] + slots[DOWN_I])[microbatch])
    return ready


def _eager(ranks: list[Slots], pp: int) -> list[Slots]:
    """Each rank's passes in their slot order, each at the earliest unit slot after its
    inputs and the rank's previous pass (the order run with unit passes and free links)."""
    starts: list[Slots] = [[[0] * len(times) for times in slots] for slots in ranks]
    free = [0] * pp
    for _, rank, kind, microbatch in _all_passes(ranks):
        start = free[rank]
        for other, what, which in _inputs(rank, kind, microbatch, pp):
            start = max(start, starts[other][what][which] + 1)
        starts[rank][kind][microbatch] = start
        free[rank] = start + 1
    return starts


def _program(rank: int, slots: Slots, pp: int) -> list[Action]:
    """Rank ``rank``'s passes in slot order as actions on its two stages of the V."""
    down, up = rank, 2 * pp - 1 - rank
    actions = {DOWN_F: (down, ActionKind.F), UP_F: (up, ActionKind.F), UP_I: (up, ActionKind.I),
               DOWN_I: (down, ActionKind.I), UP_W: (up, ActionKind.W), DOWN_W: (down, ActionKind.W)}
    return [Action(actions[kind][0], actions[kind][1], microbatch) for _, kind, microbatch in _events(slots)]
