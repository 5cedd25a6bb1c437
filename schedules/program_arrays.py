"""A schedule's programs as flat arrays: what validation, lowering and the timing engine
read instead of walking hundreds of thousands of ``Action`` tuples one by one.

Every action of every rank, in program order, rank after rank, becomes one row:
``rank``, ``stage``, ``kind`` (a small code, ``KINDS[code]``), ``microbatch`` and its
``position`` in its rank's program. P2P groups become an item number per row: a compute
action is an item of its own, a run of communication actions joined into one group is
one item (``Schedule.joins``). Transfers are numbered by the SEND both of their ends
name (``transfer_key``), so the two ends of a transfer find each other by index.

Which stage feeds which, and the transfer numbers, are ``schedules.dataflow``'s.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from operator import itemgetter

import numpy as np

from schedules.action import KIND_CODES, KINDS, UnknownKindError
from schedules.dataflow import end_transfer_key, transfer_count
from schedules.schedule import Schedule

F_CODE, B_CODE, I_CODE, W_CODE = (KIND_CODES[kind] for kind in ("F", "B", "I", "W"))
SEND_F_CODE, RECV_F_CODE, SEND_B_CODE, RECV_B_CODE = (KIND_CODES[kind]
                                                      for kind in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"))
COMPUTE_CODES = (F_CODE, B_CODE, I_CODE, W_CODE)


@dataclass(frozen=True)
class ProgramArrays:
    """The flat rows of a schedule's programs (see the module). ``rank_start[r]`` is the
    first row of rank ``r``'s program; rows ``rank_start[r] .. rank_start[r + 1] - 1``
    are its actions in order.

    The arrays are kept with their schedule (``Schedule.derived``) and point back to it
    weakly: a strong reference both ways would make every schedule a reference cycle that
    only Python's cyclic collector frees, and a planner's lowering searches drop hundreds
    of candidate schedules of thousands of actions each. Whoever reads the arrays holds
    the schedule (an engine's ``StepRun`` keeps it for its readers)."""

    owner: weakref.ReferenceType
    rank: np.ndarray
    stage: np.ndarray
    kind: np.ndarray
    microbatch: np.ndarray
    position: np.ndarray
    rank_start: np.ndarray

    @property
    def schedule(self) -> Schedule:
        schedule = self.owner()
        if schedule is None:  # pragma: no cover - a reader that kept the arrays and dropped the schedule
            raise ReferenceError("a schedule's program arrays were read after the schedule was freed")
        return schedule

    @property
    def size(self) -> int:
        return len(self.kind)

    @cached_property
    def is_compute(self) -> np.ndarray:
        return self.kind < len(COMPUTE_CODES)

    @cached_property
    def is_send(self) -> np.ndarray:
        return (self.kind == SEND_F_CODE) | (self.kind == SEND_B_CODE)

    @cached_property
    def is_recv(self) -> np.ndarray:
        return (self.kind == RECV_F_CODE) | (self.kind == RECV_B_CODE)

    @cached_property
    def joined(self) -> np.ndarray:
        """Rows whose communication action is posted in the same group as the row before."""
        joined = np.zeros(self.size, dtype=bool)
        for rank, positions in enumerate(self.schedule.joins):
            if positions:
                joined[self.rank_start[rank] + np.fromiter(positions, np.int64, len(positions))] = True
        return joined

    @cached_property
    def item(self) -> np.ndarray:
        """Each row's item number (global, in rank then program order): a compute action
        is an item, a P2P group one item for all of its rows."""
        starts = ~(~self.is_compute & self.joined)
        return np.cumsum(starts) - 1

    @cached_property
    def microbatches(self) -> int:
        """The microbatch index space the transfer keys use: the schedule's count, or more
        when a malformed program names a larger microbatch."""
        largest = int(self.microbatch.max()) + 1 if self.size else 0
        return max(self.schedule.microbatches, largest)

    def transfer_key(self, stage: np.ndarray, kind: np.ndarray, microbatch: np.ndarray) -> np.ndarray:
        """The number of the transfer each communication row belongs to: that of its SEND
        (``schedules.dataflow.transfer_key``); both ends agree."""
        return end_transfer_key(stage, kind, microbatch, self.microbatches)

    @cached_property
    def transfers(self) -> int:
        """How many transfer keys there are (most of them unused)."""
        return transfer_count(self.schedule.num_stages, self.microbatches)


def program_arrays(schedule: Schedule) -> ProgramArrays:
    """The schedule's programs as arrays, built once and kept with the schedule
    (``Schedule.derived``). Raises ``UnknownKindError`` naming an action of a kind that
    does not exist."""
    return schedule.derived("program_arrays", _build)


def keep_program_arrays(schedule: Schedule, rank: np.ndarray, stage: np.ndarray, kind: np.ndarray,
                        microbatch: np.ndarray) -> ProgramArrays:
    """Keep with ``schedule`` the arrays of its rows, given by a pass that built its programs
    from them (a generator, lowering): reading them back from hundreds of thousands of
    ``Action`` tuples would cost about as much as building the programs did. The rows are the programs' actions in
    order, rank after rank (``rank`` ascending); ``kind`` holds ``KIND_CODES``."""
    return schedule.derived("program_arrays",
                            lambda owner: program_arrays_of_rows(owner, rank, stage, kind, microbatch))


def _build(schedule: Schedule) -> ProgramArrays:
    programs = schedule.programs
    lengths = np.fromiter(map(len, programs), np.int64, len(programs))
    flat = list(chain.from_iterable(programs))
    count = len(flat)
    try:
        kind = np.fromiter(map(KIND_CODES.__getitem__, map(itemgetter(1), flat)), np.int8, count)
    except KeyError:
        bad = next(action for action in flat if action[1] not in KIND_CODES)
        raise UnknownKindError(f"{bad} has unknown kind {bad[1]!r}; valid kinds: {', '.join(KINDS)}") from None
    stage = np.fromiter(map(itemgetter(0), flat), np.int64, count)
    microbatch = np.fromiter(map(itemgetter(2), flat), np.int64, count)
    rank = np.repeat(np.arange(len(programs), dtype=np.int64), lengths)
    return program_arrays_of_rows(schedule, rank, stage, kind, microbatch)


def program_arrays_of_rows(schedule: Schedule, rank: np.ndarray, stage: np.ndarray, kind: np.ndarray,
                           microbatch: np.ndarray) -> ProgramArrays:
    """The arrays of rows already in program order, rank after rank, that ``schedule``'s
    placement, stages and microbatches describe; not kept with it (``keep_program_arrays``
    keeps them): lowering times its candidate placements with them before it builds the
    one it keeps."""
    rank_start = np.searchsorted(rank, np.arange(schedule.pp + 1)).astype(np.int64)
    position = np.arange(len(rank), dtype=np.int64) - rank_start[rank]
    return ProgramArrays(weakref.ref(schedule), rank.astype(np.int64, copy=False), stage.astype(np.int64, copy=False),
                         kind.astype(np.int8, copy=False), microbatch.astype(np.int64, copy=False), position,
                         rank_start)
