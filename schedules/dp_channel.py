"""Each rank's data-parallel channel, as the engine walks it.

A rank's gradients are reduced across its data-parallel group by collectives that NCCL
runs on one communicator, in the order they are issued: a FIFO channel per rank, beside
its compute and its P2P streams. The engine is told, per stage, the collectives one of
its backwards releases (``Reductions``: each a share of the backward's time at which its
bucket is full, and its seconds) and the links the collective's ring crosses; it
issues them as the rank runs the backward and serves each rank's channel in issue
order. A collective starts once it is issued, once the one before it on the channel is
done and once every link it crosses is free; it holds those links for its seconds, so a
P2P transfer that wants one of them later waits, and it waits for transfers that took
them first (the links' one rule, first come first served, never split).

When they are issued (``Reductions``):

- with overlap (DDP's and Megatron's default), at their share of the backward that
  releases the stage's gradients, ``start + fraction * (end - start)``;
- without overlap, under ZeRO-2 and 3 (every backward releases), at that backward's end;
  under ZeRO-0 and 1 (only the stage's last backward releases), once the rank's step is
  done (its program walked and its last P2P group completed), in stage order.

Which backwards release: each stage's last B or W in its rank's program, or with
``every_backward`` (ZeRO-2 and 3: a replica keeps only its shard of the gradient) every
one. ``channel_arrays`` lays the collectives out for both walks (the compiled one and
``schedules.engine_reference``) in channel order, each rank's together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from schedules.program_arrays import B_CODE, W_CODE

if TYPE_CHECKING:
    from schedules.engine import EngineProgram

AT_FRACTION, AT_BACKWARD_END, AT_STEP_END = 0, 1, 2  # when a collective is issued (``ChannelArrays.mode``)


@dataclass(frozen=True)
class Reductions:
    """The gradient reductions of a step, as the engine reads them: per stage, ``runs``
    ``(fraction, seconds)`` of the collectives one releasing backward issues, in issue
    order (buckets that fill at the same moment may be one run); ``links[stage]``, the
    link numbers (those of ``StepTiming.wires``) its collectives hold; ``every_backward``:
    every backward of a stage releases (ZeRO-2 and 3), else its last one; ``overlap``:
    issued at their fraction of the backward, else at its end (``every_backward``) or at
    the rank's step end."""

    runs: Mapping[int, Sequence[tuple[float, float]]]
    links: Mapping[int, Sequence[int]] = field(default_factory=dict)
    every_backward: bool = False
    overlap: bool = True

    @property
    def link_count(self) -> int:
        """One more than the highest link number its collectives hold (0: none)."""
        return max((max(links) + 1 for links in self.links.values() if len(links)), default=0)


@dataclass(frozen=True)
class ChannelArrays:
    """The collectives of every rank's channel, flat, in channel order (rank
    ``r``'s are ``channel_start[r]:channel_start[r + 1]``): per collective the compute row
    that issues it (-1: the rank's step end), ``mode`` (``AT_FRACTION``, ...),
    ``fraction``, ``seconds``, its stage and microbatch, ``run`` (its place among its
    stage's runs) and its links (``stage_link_start``/``stage_links`` of its stage). Per
    compute row, ``row_start[row]:row_start[row + 1]`` of ``row_collectives`` are the
    collectives it issues, in channel order."""

    channel_start: np.ndarray
    row: np.ndarray
    mode: np.ndarray
    fraction: np.ndarray
    seconds: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray
    run: np.ndarray
    stage_link_start: np.ndarray
    stage_links: np.ndarray
    row_start: np.ndarray
    row_collectives: np.ndarray
    link_count: int = 0

    @property
    def count(self) -> int:
        return len(self.row)

    def links_of(self, collective: int) -> list[int]:
        """The link numbers collective ``collective`` holds."""
        stage = int(self.stage[collective])
        return self.stage_links[self.stage_link_start[stage]:self.stage_link_start[stage + 1]].tolist()


def no_channel(program: EngineProgram) -> ChannelArrays:
    """Channels with no collective (a step without data parallelism), made once per
    program: lowering and the zero-bubble searches time thousands of candidates."""
    return program.no_collectives


def empty_channels(ranks: int, computes: int, num_stages: int) -> ChannelArrays:
    """``ChannelArrays`` with no collective for a program of these sizes."""
    none = np.zeros(0, dtype=np.int64)
    return ChannelArrays(
        channel_start=np.zeros(ranks + 1, dtype=np.int64), row=none, mode=np.zeros(0, dtype=np.int8),
        fraction=np.zeros(0), seconds=np.zeros(0), stage=none, microbatch=none, run=none,
        stage_link_start=np.zeros(num_stages + 1, dtype=np.int64), stage_links=none,
        row_start=np.zeros(computes + 1, dtype=np.int64), row_collectives=none)


def channel_arrays(program: EngineProgram, reductions: Reductions | None) -> ChannelArrays:
    """``reductions`` laid out for ``program``'s walk (``ChannelArrays``)."""
    num_stages = program.arrays.schedule.num_stages
    if reductions is None or not reductions.runs:
        return no_channel(program)
    stage, kind, rank = program.compute_stage, program.compute_kind, program.compute_rank
    runs = reductions.runs
    per_stage = np.zeros(num_stages, dtype=np.int64)
    for at, stage_runs in runs.items():
        per_stage[at] = len(stage_runs)
    releasing = np.flatnonzero(((kind == B_CODE) | (kind == W_CODE)) & (per_stage[stage] > 0))
    if not reductions.every_backward and len(releasing):
        # each stage's last releasing backward in program order: the last of its rows
        last = np.full(num_stages, -1, dtype=np.int64)
        np.maximum.at(last, stage[releasing], releasing)
        releasing = np.sort(last[last >= 0])
    # the stages' runs as one table, a stage's rows from ``offset[stage]``
    table = [(at, fraction, seconds) for at in range(num_stages) for fraction, seconds in runs.get(at, ())]
    fractions = np.array([row[1] for row in table], dtype=float)
    seconds = np.array([row[2] for row in table], dtype=float)
    offset = np.cumsum(per_stage) - per_stage
    count = per_stage[stage[releasing]]
    owner = np.repeat(releasing, count)  # the compute row issuing each collective
    run = np.arange(len(owner)) - np.repeat(np.cumsum(count) - count, count)
    table_row = offset[stage[owner]] + run
    mode = AT_FRACTION
    if not reductions.overlap:
        mode = AT_BACKWARD_END if reductions.every_backward else AT_STEP_END
    owner_rank, owner_stage = rank[owner], stage[owner]
    if mode == AT_STEP_END:  # all at the rank's step end, served in stage order
        order = np.lexsort((run, owner_stage, owner_rank))
    else:  # as the rank walks its backwards: rows are in program order, rank after rank
        order = np.arange(len(owner))
    owner, run, table_row, owner_rank, owner_stage = (column[order] for column in
                                                      (owner, run, table_row, owner_rank, owner_stage))
    ranks = program.ranks
    channel_start = np.searchsorted(owner_rank, np.arange(ranks + 1)).astype(np.int64)
    link_lists = [list(reductions.links.get(at, ())) for at in range(num_stages)]
    stage_link_start = np.zeros(num_stages + 1, dtype=np.int64)
    np.cumsum([len(links) for links in link_lists], out=stage_link_start[1:])
    stage_links = np.array([link for links in link_lists for link in links], dtype=np.int64)
    issued_by_row = mode != AT_STEP_END
    row_collectives = np.arange(len(owner), dtype=np.int64) if issued_by_row else np.zeros(0, dtype=np.int64)
    row_start = np.searchsorted(owner if issued_by_row else np.zeros(0, dtype=np.int64),
                                np.arange(program.computes + 1)).astype(np.int64)
    return ChannelArrays(
        channel_start=channel_start, row=np.where(issued_by_row, owner, -1).astype(np.int64),
        mode=np.full(len(owner), mode, dtype=np.int8), fraction=np.ascontiguousarray(fractions[table_row]),
        seconds=np.ascontiguousarray(seconds[table_row]), stage=owner_stage.astype(np.int64),
        microbatch=program.compute_microbatch[owner].astype(np.int64), run=run.astype(np.int64),
        stage_link_start=stage_link_start, stage_links=stage_links, row_start=row_start,
        row_collectives=row_collectives, link_count=reductions.link_count)
