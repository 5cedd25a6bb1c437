"""Who set the step: the critical path of a timed step, walked back from its end.

Start at the compute action that let its rank go last (its end plus its hold) and walk
back through what each action waited for: if it started later than its rank reached it,
its input set its start, so the path goes on at the action that produced that input (on
another rank, or an earlier chunk on the same one); otherwise the rank was busy, so the
path goes on at the rank's previous compute action. The path's **owner** is the rank
whose actions on it ran longest over their costs in all (a straggler's, or the unluckiest
jitter draws): the delays the step absorbed. On a path where nothing ran over its cost
(the deterministic step) it is the rank holding most of the path's compute seconds. Its
**stretched action** is the one action on it whose time grew most over its cost.

Seconds are not enough to name the owner: under a straggler, the start of a long path
runs through ranks that were simply busy before the straggler's pace caught up with
them (interleaved 1F1B at pp 32 with rank 3 at 1.5x: the last rank holds more of the
path's seconds than rank 3), while every second the step lost was lost on rank 3.

Walked for many samples at once (``critical_owners``): each step of the walk is one
array operation over the samples, so a thousand samples cost about as much as the
longest path's length in array operations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schedules import dataflow
from schedules.engine import EngineProgram, action_rows
from schedules.program_arrays import B_CODE, F_CODE, I_CODE


@dataclass(frozen=True)
class PathLinks:
    """Per compute row of a program: the row producing its input (-1 none) and its
    rank's previous compute row (-1 for a rank's first)."""

    producer: np.ndarray
    previous: np.ndarray


def path_links(program: EngineProgram) -> PathLinks:
    """Where the walk can go back to from each compute row (see the module)."""
    stage, kind, microbatch = program.compute_stage, program.compute_kind, program.compute_microbatch
    forward = kind == F_CODE
    backward = (kind == B_CODE) | (kind == I_CODE)
    producer = np.full(program.computes, -1, dtype=np.int64)
    # where each row's input comes from (schedules.dataflow: the stage below for a forward,
    # above for a backward piece, never across the seam between copies of the model), and
    # which of that stage's kinds produced it (a forward's forward; a backward's B, or I)
    schedule = program.arrays.schedule
    source, reads = dataflow.input_stages(stage, kind, schedule.num_stages, schedule.copies)
    for wanted, source_kind in ((forward, "F"), (backward, "B"), (backward, "I")):
        rows = np.flatnonzero(wanted & reads)
        found = action_rows(program, list(zip(source[rows].tolist(), [source_kind] * len(rows),
                                              microbatch[rows].tolist(), strict=True)))
        producer[rows[found >= 0]] = found[found >= 0]
    rank = program.compute_rank
    previous = np.arange(program.computes, dtype=np.int64) - 1
    previous[np.r_[True, rank[1:] != rank[:-1]] if program.computes else []] = -1
    return PathLinks(producer, previous)


@dataclass(frozen=True)
class Owners:
    """Per sample: the rank owning the critical path (see the module) and the row of its
    most stretched action (-1 where no action ran longer than its cost)."""

    rank: np.ndarray
    stretched: np.ndarray


def critical_owners(program: EngineProgram, links: PathLinks, start: np.ndarray, end: np.ndarray,
                    ready: np.ndarray, hold: np.ndarray, seconds: np.ndarray, nominal: np.ndarray) -> Owners:
    """The owners of ``samples`` steps at once: ``start``, ``end``, ``ready`` and
    ``seconds`` are ``[sample, compute row]``; ``hold`` and ``nominal`` (each row's cost)
    per compute row."""
    samples = start.shape[0]
    ranks = program.ranks
    owned = np.zeros((samples, ranks))
    over = np.zeros((samples, ranks))
    best_excess = np.zeros(samples)
    stretched = np.full(samples, -1, dtype=np.int64)
    current = np.argmax(end + hold, axis=1)
    walking = np.arange(samples)
    for _ in range(program.computes):
        if not len(walking):
            break
        row = current[walking]
        took = seconds[walking, row]
        np.add.at(owned, (walking, program.compute_rank[row]), took)
        excess = took - nominal[row]
        np.add.at(over, (walking, program.compute_rank[row]), np.maximum(excess, 0.0))
        better = excess > best_excess[walking]
        best_excess[walking[better]] = excess[better]
        stretched[walking[better]] = row[better]
        waited = start[walking, row] > ready[walking, row]
        following = np.where(waited, links.producer[row], links.previous[row])
        current[walking] = following
        walking = walking[following >= 0]
    stretched_any = over.max(axis=1) > 0
    return Owners(np.where(stretched_any, np.argmax(over, axis=1), np.argmax(owned, axis=1)), stretched)
