"""Each rank's data-parallel channel, as the engine walks it.

A rank's gradients are reduced across its data-parallel group by collectives that NCCL
runs on one communicator, in the order they are issued: a FIFO channel per rank, beside
its compute and its P2P streams. Under ZeRO-1 and 2 with Megatron-Core's
``--overlap-param-gather`` (its default) the same channel first runs the parameter
all-gathers the optimizer of the step before started (``Reductions.gathers``, below).
The engine is told, per stage, the collectives one of its backwards releases
(``Reductions``: each a share of the backward's time at which its bucket is full, and
its seconds) and the links the collective's ring crosses; it issues them as the rank
runs the backward and serves each rank's channel in issue order. A collective starts
once it is issued, once the one before it on the channel is done and once every link it
crosses is free; it holds those links for its seconds, so a P2P transfer that wants one
of them later waits, and it waits for transfers that took them first (the links' one
rule, first come first served, never split).

A collective stands for a run of buckets that fill at the same moment (a layer's
gradients), and NCCL runs each bucket as a collective of its own: the run holds its links
one bucket at a time, so a transfer that wants a link during the run takes it between two
buckets (and the rest of the run follows it), not after the whole run. Where no transfer
and no other rank's reduction crosses a stage's links nothing can come between, and its
runs are walked whole (one step, the run's seconds summed exactly: ``math.fsum``).

When they are issued (``Reductions``):

- with overlap (DDP's and Megatron's default), at their share of the backward that
  releases the stage's gradients, ``start + fraction * (end - start)``;
- without overlap, under ZeRO-2 and 3 (every backward releases), at that backward's end;
  under ZeRO-0 and 1 (only the stage's last backward releases), once the rank's step is
  done (its program walked and its last P2P group completed), in stage order.

Which backwards release: each stage's last B or W in its rank's program, or with
``every_backward`` (ZeRO-2 and 3: a replica keeps only its shard of the gradient) every
one.

The parameter all-gathers (``Reductions.gathers``): the step is periodic, so the gathers
the optimizer started are waited for by this step's first forwards. They are issued at
the step's start, first on the rank's channel (before any reduction), one collective per
layer, stage after stage in the order the rank's program first runs each stage's forward,
each holding the stage's links as a reduction does. A stage's first forward waits for
its gathers as Megatron-Core's forward pre-hook waits for each layer's: it starts no
earlier than its first layer's gather ends, and ends no earlier than its last layer's
gather's end plus one layer's share of the forward (a layer at a time: with gathers of
``g`` seconds back to back from ``P`` and layers of ``c`` seconds, the forward is held to
``P + g + (U - 1) max(0, g - c)``, ``pipesim.sim.zero.exposed_gather_seconds``).

ZeRO-3 / FSDP gathers each layer's parameters before every forward and again before every
backward (B, or I and W when the backward is split: a norm's weight-gradient kernel reads its weight), each microbatch's
(``Reductions.layer_gathers``): one collective per layer, issued on the rank's channel
when the rank reaches the action with its input there (FSDP's pre-forward hook), all of
the action's layers at once, so the channel runs them back to back after whatever it
was running, each holding the stage's links. The action waits for them as a first
forward waits for ZeRO-1/2's (the same gate, ``gate_first``/``gate_last``): it starts no
earlier than its first layer's gather ends and ends no earlier than its last layer's
gather's end plus one layer's share of it. On a channel and links of their own this is
exactly FSDP's one-ahead prefetch (``pipesim.sim.zero.exposed_gather_seconds``: the
action from ``P`` spans ``g + (U - 1) max(c, g) + c``); otherwise they queue behind the
rank's gradient reductions (channel order: each compute row's gathers, then what it
releases) and contend with P2P transfers for links.

``channel_arrays`` lays the collectives out for both walks (the compiled one and
``schedules.engine_reference``) in channel order, each rank's together.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from schedules.program_arrays import B_CODE, F_CODE, I_CODE, W_CODE

if TYPE_CHECKING:
    from schedules.engine import EngineProgram

# when a collective is issued (``ChannelArrays.mode``); AT_ACTION: when its rank reaches the
# compute action that waits for it, its input there (ZeRO-3's per-layer gathers)
AT_FRACTION, AT_BACKWARD_END, AT_STEP_END, AT_STEP_START, AT_ACTION = 0, 1, 2, 3, 4
GATHERING_KINDS = {"F": F_CODE, "B": B_CODE, "I": I_CODE, "W": W_CODE}  # ZeRO-3: what gathers its layers


@dataclass(frozen=True)
class Reductions:
    """The gradient reductions of a step, as the engine reads them: per stage, ``runs``
    ``(fraction, bucket seconds)`` of the collectives one releasing backward issues, in
    issue order (buckets that fill at the same moment, one run); ``links[stage]``, the
    link numbers (those of ``StepTiming.wires``) its collectives hold; ``every_backward``:
    every backward of a stage releases (ZeRO-2 and 3), else its last one; ``overlap``:
    issued at their fraction of the backward, else at its end (``every_backward``) or at
    the rank's step end. ``gathers[stage]``: the seconds of each layer's parameter
    all-gather, first layer first, run from the step's start and waited for by the
    stage's first forward (the module), over the stage's ``links``.
    ``layer_gathers[stage, kind]`` (kind ``F``, ``B``, ``I`` or ``W``): ZeRO-3's, the seconds of
    each layer's gather before every such action of the stage, issued when its rank
    reaches it, over the stage's ``links``."""

    runs: Mapping[int, Sequence[tuple[float, Sequence[float]]]]
    links: Mapping[int, Sequence[int]] = field(default_factory=dict)
    every_backward: bool = False
    overlap: bool = True
    gathers: Mapping[int, Sequence[float]] = field(default_factory=dict)
    layer_gathers: Mapping[tuple[int, str], Sequence[float]] = field(default_factory=dict)

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
    stage's runs), ``table_row`` (its run among every stage's: the end of each of its
    buckets from the run's start is ``offsets[offset_start[table_row]:...]``, the last
    its ``seconds``) and its links (``stage_link_start``/``stage_links`` of its stage). Per
    compute row, ``row_start[row]:row_start[row + 1]`` of ``row_collectives`` are the
    collectives it issues, in channel order. Per compute row, ``gate_first`` and
    ``gate_last``: the first and last parameter gather its forward waits for (-1: none;
    the module)."""

    channel_start: np.ndarray
    row: np.ndarray
    mode: np.ndarray
    fraction: np.ndarray
    seconds: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray
    run: np.ndarray
    table_row: np.ndarray
    offset_start: np.ndarray
    offsets: np.ndarray
    stage_link_start: np.ndarray
    stage_links: np.ndarray
    row_start: np.ndarray
    row_collectives: np.ndarray
    gate_first: np.ndarray
    gate_last: np.ndarray
    link_count: int = 0

    @property
    def count(self) -> int:
        return len(self.row)

    def links_of(self, collective: int) -> list[int]:
        """The link numbers collective ``collective`` holds."""
        stage = int(self.stage[collective])
        return self.stage_links[self.stage_link_start[stage]:self.stage_link_start[stage + 1]].tolist()

    def bucket_ends(self, collective: int) -> list[float]:
        """When each bucket of collective ``collective`` ends, from its start."""
        row = int(self.table_row[collective])
        return self.offsets[self.offset_start[row]:self.offset_start[row + 1]].tolist()


def no_channel(program: EngineProgram) -> ChannelArrays:
    """Channels with no collective (a step without data parallelism), made once per
    program: lowering and the zero-bubble searches time thousands of candidates."""
    return program.no_collectives


def empty_channels(ranks: int, computes: int, num_stages: int) -> ChannelArrays:
    """``ChannelArrays`` with no collective for a program of these sizes."""
    none = np.zeros(0, dtype=np.int64)
    return ChannelArrays(
        channel_start=np.zeros(ranks + 1, dtype=np.int64), row=none, mode=np.zeros(0, dtype=np.int8),
        fraction=np.zeros(0), seconds=np.zeros(0), stage=none, microbatch=none, run=none, table_row=none,
        offset_start=np.zeros(1, dtype=np.int64), offsets=np.zeros(0),
        stage_link_start=np.zeros(num_stages + 1, dtype=np.int64), stage_links=none,
        row_start=np.zeros(computes + 1, dtype=np.int64), row_collectives=none,
        gate_first=np.full(computes, -1, dtype=np.int64), gate_last=np.full(computes, -1, dtype=np.int64))


def channel_arrays(program: EngineProgram, reductions: Reductions | None,
                   wire_links: np.ndarray | None = None) -> ChannelArrays:
    """``reductions`` laid out for ``program``'s walk (``ChannelArrays``); ``wire_links``:
    the links the step's transfers cross (a stage's runs whose links no transfer and no
    other rank's reduction crosses are walked whole)."""
    num_stages = program.arrays.schedule.num_stages
    if reductions is None or not (reductions.runs or reductions.gathers or reductions.layer_gathers):
        return no_channel(program)
    if reductions.gathers and reductions.layer_gathers:
        raise ValueError("a step gathers parameters either from its start (ZeRO-1/2) or before each action "
                         "(ZeRO-3), not both")
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
    link_lists = [list(reductions.links.get(at, ())) for at in range(num_stages)]
    alone = _links_alone(link_lists, program.arrays.schedule.placement, wire_links)
    # the stages' runs as one table, a stage's rows from ``offset[stage]``; then one row per
    # layer's gather (one bucket each): ZeRO-1/2's per stage, then ZeRO-3's per (stage, kind)
    table = [(at, fraction, buckets) for at in range(num_stages) for fraction, buckets in runs.get(at, ())]
    fractions = np.array([row[1] for row in table], dtype=float)
    seconds = np.array([math.fsum(row[2]) for row in table], dtype=float)
    ends = [[whole] if alone[at] else _bucket_ends(buckets, whole)
            for (at, _, buckets), whole in zip(table, seconds.tolist(), strict=True)]
    gathered = _gathering_stages(program, reductions.gathers)
    action_rows, action_table = _gathering_actions(program, reductions.layer_gathers)
    layer_seconds = [layer for _, layers in gathered for layer in layers] + [
        layer for layers in action_table for layer in layers]
    ends += [[layer] for layer in layer_seconds]
    fractions = np.concatenate([fractions, np.zeros(len(layer_seconds))])
    seconds = np.concatenate([seconds, np.array(layer_seconds, dtype=float)])
    offset_start = np.zeros(len(ends) + 1, dtype=np.int64)
    np.cumsum([len(each) for each in ends], out=offset_start[1:])
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
    microbatch = program.compute_microbatch[owner].astype(np.int64)
    row = owner if mode != AT_STEP_END else np.full(len(owner), -1, dtype=np.int64)
    modes = np.full(len(owner), mode, dtype=np.int8)
    # the gathers from the step's start: per gathering stage, one collective per layer
    placement = np.asarray(program.arrays.schedule.placement, dtype=np.int64)
    gather_stage = np.array([at for at, layers in gathered for _ in layers], dtype=np.int64)
    gather_layer = np.array([layer for _, layers in gathered for layer in range(len(layers))], dtype=np.int64)
    none = np.full(len(gather_stage), -1, dtype=np.int64)
    # the gathers before each action: per gathering row, one collective per layer of its (stage, kind)
    first_action_row = len(table) + len(gather_stage)
    action_bases = first_action_row + np.cumsum([0] + [len(layers) for layers in action_table])
    row_key, gathering_rows = action_rows
    layers_of = np.array([len(layers) for layers in action_table], dtype=np.int64)[row_key].astype(np.int64)
    action_row = np.repeat(gathering_rows, layers_of)
    action_layer = np.arange(len(action_row)) - np.repeat(np.cumsum(layers_of) - layers_of, layers_of)
    action_table_row = action_bases[:-1][np.repeat(row_key, layers_of)] + action_layer
    # channel order, per rank: the gathers from the step's start; then, row by row, a row's
    # gathers before the collectives it releases; then those issued at the step's end
    blocks = (len(gather_stage), len(action_row), len(owner))
    ranks_of = np.concatenate([placement[gather_stage], rank[action_row], owner_rank]).astype(np.int64)
    section = np.concatenate([np.zeros(blocks[0]), np.ones(blocks[1]),
                              np.full(blocks[2], 2 if mode == AT_STEP_END else 1)])
    released_by = owner if mode != AT_STEP_END else np.zeros(blocks[2])
    in_section = np.concatenate([np.zeros(blocks[0]), action_row, released_by])
    releases = np.concatenate([np.zeros(blocks[0] + blocks[1]), np.ones(blocks[2])])
    channel_order = np.lexsort((np.arange(len(ranks_of)), releases, in_section, section, ranks_of))
    columns = [np.concatenate(parts)[channel_order] for parts in (
        (none, action_row, row),
        (np.full(blocks[0], AT_STEP_START, dtype=np.int8), np.full(blocks[1], AT_ACTION, dtype=np.int8), modes),
        (len(table) + np.arange(blocks[0], dtype=np.int64), action_table_row, table_row),
        (gather_stage, stage[action_row].astype(np.int64), owner_stage.astype(np.int64)),
        (none, program.compute_microbatch[action_row].astype(np.int64), microbatch),
        (gather_layer, action_layer, run.astype(np.int64)))]
    row, modes, table_row, collective_stage, microbatch, run = columns
    ranks_of = ranks_of[channel_order]
    ranks = program.ranks
    channel_start = np.searchsorted(ranks_of, np.arange(ranks + 1)).astype(np.int64)
    stage_link_start = np.zeros(num_stages + 1, dtype=np.int64)
    np.cumsum([len(links) for links in link_lists], out=stage_link_start[1:])
    stage_links = np.array([link for links in link_lists for link in links], dtype=np.int64)
    issuing = np.flatnonzero((row >= 0) & (modes != AT_ACTION))  # an action's gathers are issued as it is reached
    row_collectives = issuing[np.argsort(row[issuing], kind="stable")].astype(np.int64)
    row_start = np.searchsorted(row[row_collectives], np.arange(program.computes + 1)).astype(np.int64)
    gate_first, gate_last = _gates(program, gathered, collective_stage, modes)
    waiting = np.flatnonzero(modes == AT_ACTION)  # in channel order: each row's layers together, first first
    gate_last[row[waiting]] = waiting
    gate_first[row[waiting[::-1]]] = waiting[::-1]
    return ChannelArrays(
        channel_start=channel_start, row=row.astype(np.int64), mode=modes.astype(np.int8),
        fraction=np.ascontiguousarray(fractions[table_row]), seconds=np.ascontiguousarray(seconds[table_row]),
        stage=collective_stage.astype(np.int64), microbatch=microbatch.astype(np.int64), run=run.astype(np.int64),
        table_row=table_row.astype(np.int64), offset_start=offset_start,
        offsets=np.array([end for each in ends for end in each], dtype=float),
        stage_link_start=stage_link_start, stage_links=stage_links, row_start=row_start,
        row_collectives=row_collectives, gate_first=gate_first, gate_last=gate_last,
        link_count=reductions.link_count)


def _gathering_actions(program: EngineProgram, layer_gathers: Mapping[tuple[int, str], Sequence[float]]
                       ) -> tuple[tuple[np.ndarray, np.ndarray], list[list[float]]]:
    """ZeRO-3's gathers laid out: the (stage, kind)s that gather (some layer's gather takes
    time), each its layers' seconds (the table), and per compute row that gathers, in
    program order, its (stage, kind)'s place in the table and the row."""
    keys = [(at, kind) for (at, kind), layers in layer_gathers.items() if len(layers) and math.fsum(layers) > 0]
    if not keys:
        return (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)), []
    for at, kind in keys:
        if kind not in GATHERING_KINDS:
            raise ValueError(f"layer gathers of stage {at}, kind {kind!r}: only {', '.join(GATHERING_KINDS)} gather")
    num_stages = program.arrays.schedule.num_stages
    place = np.full((num_stages, int(max(GATHERING_KINDS.values())) + 1), -1, dtype=np.int64)
    for index, (at, kind) in enumerate(keys):
        if 0 <= at < num_stages:
            place[at, GATHERING_KINDS[kind]] = index
    codes = program.compute_kind.astype(np.int64)
    known = codes < place.shape[1]
    key_of = np.full(program.computes, -1, dtype=np.int64)
    key_of[known] = place[program.compute_stage[known], codes[known]]
    rows = np.flatnonzero(key_of >= 0)
    return (key_of[rows], rows), [[float(seconds) for seconds in layer_gathers[key]] for key in keys]


def _first_forward_rows(program: EngineProgram) -> dict[int, int]:
    """Per stage with a forward in the program, the compute row of its first forward."""
    forwards = np.flatnonzero(program.compute_kind == F_CODE)
    stages, first = np.unique(program.compute_stage[forwards], return_index=True)
    return dict(zip(stages.tolist(), forwards[first].tolist(), strict=True))


def _gathering_stages(program: EngineProgram, gathers: Mapping[int, Sequence[float]]
                      ) -> list[tuple[int, list[float]]]:
    """``(stage, each layer's gather seconds)`` of the stages that gather (a forward of
    theirs is in the program and some layer's gather takes time), in the order of their
    first forward's row: rank after rank, each rank's in its program's order."""
    if not gathers:
        return []
    first_row = _first_forward_rows(program)
    wanted = [at for at, layers in gathers.items() if at in first_row and len(layers) and math.fsum(layers) > 0]
    return [(at, [float(seconds) for seconds in gathers[at]]) for at in sorted(wanted, key=first_row.get)]


def _gates(program: EngineProgram, gathered: list[tuple[int, list[float]]], collective_stage: np.ndarray,
           modes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per compute row, the first and last gather its forward waits for: each gathering
    stage's first forward, its first and last layer's collectives (-1 elsewhere)."""
    gate_first = np.full(program.computes, -1, dtype=np.int64)
    gate_last = np.full(program.computes, -1, dtype=np.int64)
    if not gathered:
        return gate_first, gate_last
    first_row = _first_forward_rows(program)
    gathers = np.flatnonzero(modes == AT_STEP_START)
    for at, _ in gathered:
        mine = gathers[collective_stage[gathers] == at]
        gate_first[first_row[at]], gate_last[first_row[at]] = mine[0], mine[-1]
    return gate_first, gate_last


def _bucket_ends(buckets: Sequence[float], whole: float) -> list[float]:
    """When each bucket of a run ends from the run's start, the last at ``whole``."""
    ends = np.cumsum(np.asarray(buckets, dtype=float)).tolist()
    ends[-1] = whole
    return ends


def _links_alone(link_lists: list[list[int]], placement: Sequence[int], wire_links: np.ndarray | None) -> list[bool]:
    """Per stage, whether no transfer and no reduction of another rank crosses any of its
    links: then nothing can come between its buckets."""
    users: dict[int, set[int]] = {}
    for stage, links in enumerate(link_lists):
        for link in links:
            users.setdefault(link, set()).add(placement[stage])
    crossed = set(wire_links.tolist()) if wire_links is not None else set()
    return [not any(link in crossed or len(users[link]) > 1 for link in links) for links in link_lists]
