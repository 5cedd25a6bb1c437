"""The dataflow rule: which action feeds which, and the number both ends of a transfer name.

A forward reads the output of the forward of the stage before it and hands its own to
the stage after; a backward piece (``B``, or ``I`` when the backward is split) reads the
input gradient of the stage after it and hands its own to the stage before. On its own
stage a backward needs its forward (the stash) and ``W`` needs its ``I``:

    F(s-1) -> F(s),   F(s) -> B|I(s),   B|I(s+1) -> B|I(s),   I(s) -> W(s).

Data that crosses ranks travels as a transfer: a SEND on the producer's stage and a
RECV on the consumer's (``SEND_OF``, ``RECV_OF``), both ends numbered by the SEND
(``transfer_key``) and carried over the wire that leaves the sending stage in the
transfer's direction (``wire_of``).

The offsets are ``schedules.action``'s tables (``INPUT_OFFSET``, ``OUTPUT_OFFSET``, the
vocabulary's own words); this module is the one place they are applied, to one action
or to whole programs as arrays of kind codes (``schedules.program_arrays``). Lowering,
validation, the dependency graph, the engine, the accounting, the list schedulers,
memory's receive buffers, the simulator's wires and the executor's tags read the rule
here; ``tests/test_rule_homes.py`` fails on a second copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from schedules.action import (
    INPUT_OFFSET,
    KIND_CODES,
    KINDS,
    OUTPUT_OFFSET,
    PEER_OFFSET,
    RECV_OF,
    SEND_OF,
    Action,
    ActionKind,
)

FORWARD, BACKWARD = 0, 1  # a transfer's direction: activations forward, gradients back
DIRECTION = {ActionKind.F: FORWARD, ActionKind.SEND_F: FORWARD, ActionKind.RECV_F: FORWARD,
             ActionKind.B: BACKWARD, ActionKind.I: BACKWARD, ActionKind.SEND_B: BACKWARD, ActionKind.RECV_B: BACKWARD}
# The kinds of the neighbouring stage whose output a compute kind reads: a forward the
# forward before it, a backward piece whichever backward piece (B or I) the stage after ran.
FED_BY = {ActionKind.F: (ActionKind.F,), ActionKind.B: (ActionKind.B, ActionKind.I),
          ActionKind.I: (ActionKind.B, ActionKind.I)}
# What a kind needs from its own stage: a backward piece its forward's stash, W its I.
SAME_STAGE_INPUT = {ActionKind.B: ActionKind.F, ActionKind.I: ActionKind.F, ActionKind.W: ActionKind.I}
WIRES_PER_STAGE = 2  # a stage's forward wire and its backward one
# Per direction, a compute kind whose output travels that way (a forward's, a backward's).
DIRECTION_KINDS = (ActionKind.F, ActionKind.B)


def _by_code(table: dict[str, int], default: int = 0) -> np.ndarray:
    return np.array([table.get(kind, default) for kind in KINDS], dtype=np.int64)


# The tables indexed by kind code, for passes over whole programs.
INPUT_OFFSET_CODES = _by_code(INPUT_OFFSET)
OUTPUT_OFFSET_CODES = _by_code(OUTPUT_OFFSET)
CROSSES_CODES = np.array([kind in INPUT_OFFSET for kind in KINDS])  # F, B, I: they read a neighbour
DIRECTION_CODES = _by_code(DIRECTION)
PEER_OFFSET_CODES = _by_code(PEER_OFFSET)
RECV_OF_CODES = _by_code({kind: KIND_CODES[recv] for kind, recv in RECV_OF.items()}, -1)
SEND_OF_CODES = _by_code({kind: KIND_CODES[send] for kind, send in SEND_OF.items()}, -1)
DIRECTION_KIND_CODES = np.array([KIND_CODES[kind] for kind in DIRECTION_KINDS], dtype=np.int64)
# The sending stage of a transfer end, relative to the end's stage: a SEND's own, a
# RECV's the stage it receives from.
SENDER_OFFSET_CODES = _by_code({ActionKind.RECV_F: PEER_OFFSET[ActionKind.RECV_F],
                                ActionKind.RECV_B: PEER_OFFSET[ActionKind.RECV_B]})


def input_stage(stage: int, kind: str) -> int:
    """The stage whose output a compute action of ``kind`` on ``stage`` reads (it may lie
    outside the pipeline: the first forward and the last backward read none)."""
    return stage + INPUT_OFFSET[kind]


def output_stage(stage: int, kind: str) -> int:
    """The stage a compute action of ``kind`` on ``stage`` hands its output to."""
    return stage + OUTPUT_OFFSET[kind]


def same_copy(stage, other, num_stages: int, copies: int = 1):
    """Whether stages ``stage`` and ``other`` (ints or arrays) lie in one copy of the model:
    a pipeline of ``copies`` copies (DualPipe: 2) is that many chains of ``num_stages /
    copies`` stages, and no data crosses the seam between two of them."""
    if copies == 1:
        return True if isinstance(stage, int) and isinstance(other, int) else np.ones(np.shape(stage), dtype=bool)
    per_copy = num_stages // copies
    return stage // per_copy == other // per_copy


def _inside(stage: int, other: int, num_stages: int, copies: int) -> bool:
    return 0 <= other < num_stages and bool(same_copy(stage, other, num_stages, copies))


def input_from(placement: Sequence[int], stage: int, kind: str, copies: int = 1) -> int | None:
    """The stage whose output ``kind`` on ``stage`` reads, None if it reads none (W, or
    the ends of the pipeline or of its copy of the model)."""
    if kind not in INPUT_OFFSET:
        return None
    source = stage + INPUT_OFFSET[kind]
    return source if _inside(stage, source, len(placement), copies) else None


def output_to(placement: Sequence[int], stage: int, kind: str, copies: int = 1) -> int | None:
    """The stage ``kind`` on ``stage`` hands its output to, None if none (W, the ends)."""
    if kind not in OUTPUT_OFFSET:
        return None
    target = stage + OUTPUT_OFFSET[kind]
    return target if _inside(stage, target, len(placement), copies) else None


def receives(placement: Sequence[int], stage: int, kind: str, rank: int, copies: int = 1) -> bool:
    """Whether ``kind`` on ``stage``, run on ``rank``, reads its input from a stage placed
    on another rank (lowering puts a ``RECV_OF[kind]`` before it)."""
    source = input_from(placement, stage, kind, copies)
    return source is not None and placement[source] != rank


def sends(placement: Sequence[int], stage: int, kind: str, rank: int, copies: int = 1) -> bool:
    """Whether ``kind`` on ``stage``, run on ``rank``, hands its output to a stage placed
    on another rank (lowering puts a ``SEND_OF[kind]`` after it)."""
    target = output_to(placement, stage, kind, copies)
    return target is not None and placement[target] != rank


def neighbour_producers(action: Action, num_stages: int, copies: int = 1) -> list[Action]:
    """The compute actions of the neighbouring stage whose output ``action`` reads (a
    backward piece lists both B and I: a valid schedule holds one of them)."""
    stage, kind, microbatch = action
    if kind not in INPUT_OFFSET:
        return []
    source = stage + INPUT_OFFSET[kind]
    if not _inside(stage, source, num_stages, copies):
        return []
    return [Action(source, producer, microbatch) for producer in FED_BY[kind]]


def crossing_boundaries(placement: Sequence[int], copies: int = 1) -> list[int]:
    """The stages ``s`` whose boundary with ``s + 1`` joins two ranks inside one copy of
    the model: where a forward's output and a backward's gradient cross as transfers."""
    return [stage for stage in range(len(placement) - 1)
            if output_to(placement, stage, ActionKind.F, copies) is not None
            and placement[stage] != placement[output_stage(stage, ActionKind.F)]]


# --- whole programs: arrays of stages and kind codes ------------------------------------------


def input_stages(stage: np.ndarray, kind: np.ndarray, num_stages: int,
                 copies: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Per compute row the stage its input comes from, and whether it reads one (F, B or
    I, its source inside the pipeline and inside the row's copy of the model)."""
    source = stage + INPUT_OFFSET_CODES[kind]
    inside = (source >= 0) & (source < num_stages) & same_copy(stage, source, num_stages, copies)
    return source, CROSSES_CODES[kind] & inside


def output_stages(stage: np.ndarray, kind: np.ndarray, num_stages: int,
                  copies: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Per compute row the stage its output goes to, and whether it hands one on."""
    target = stage + OUTPUT_OFFSET_CODES[kind]
    inside = (target >= 0) & (target < num_stages) & same_copy(stage, target, num_stages, copies)
    return target, CROSSES_CODES[kind] & inside


def transfer_key(sending_stage, direction, microbatch, microbatches: int):
    """The number of a transfer: ``(sending stage * 2 + direction) * microbatches +
    microbatch``, scalars or arrays. Both ends name it, so they find each other by index;
    ``sending stage * 2 + direction`` is its wire (``wire_of``)."""
    return wire_of(sending_stage, direction) * microbatches + microbatch


def transfer_count(num_stages: int, microbatches: int) -> int:
    """How many transfer numbers a pipeline of ``num_stages`` and ``microbatches`` has
    (``transfer_key`` runs from 0 below it; the ends of the pipeline leave some unused)."""
    return num_stages * WIRES_PER_STAGE * microbatches


def end_transfer_key(stage: np.ndarray, kind: np.ndarray, microbatch: np.ndarray, microbatches: int) -> np.ndarray:
    """``transfer_key`` of each communication row (a SEND or a RECV, by kind code): that
    of its SEND, so that both ends agree."""
    return transfer_key(stage + SENDER_OFFSET_CODES[kind], DIRECTION_CODES[kind], microbatch, microbatches)


def action_transfer_key(action: Action, microbatches: int) -> int:
    """``end_transfer_key`` of one SEND or RECV action."""
    code = KIND_CODES[action.kind]
    return transfer_key(action.stage + int(SENDER_OFFSET_CODES[code]), int(DIRECTION_CODES[code]), action.microbatch,
                        microbatches)


def transfer_parts(key, microbatches: int):
    """``(sending stage, direction, microbatch)`` of transfer numbers (``transfer_key``)."""
    wire, microbatch = np.divmod(key, microbatches)
    stage, direction = wire_parts(wire)
    return stage, direction, microbatch


def transfer_wire(key, microbatches: int):
    """The wire (``wire_of``) each transfer number travels on."""
    return key // microbatches


def wire_of(sending_stage, direction):
    """The wire a transfer leaves ``sending_stage`` on in ``direction``: a stage's forward
    wire, then its backward one (``StepTiming.wires`` is indexed so)."""
    return sending_stage * WIRES_PER_STAGE + direction


def receiving_stage(sending_stage, direction):
    """The stage a transfer leaving ``sending_stage`` in ``direction`` arrives at."""
    return sending_stage + OUTPUT_OFFSET_CODES[DIRECTION_KIND_CODES[direction]]


def wire_parts(wire):
    """``(sending stage, direction)`` of wire numbers (``wire_of``)."""
    return np.divmod(wire, WIRES_PER_STAGE)

