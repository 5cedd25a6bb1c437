"""Actions: the words a pipeline schedule is written in.

The text form is the one ``torch.distributed.pipelining`` dumps and loads
(``{stage}{KIND}{microbatch}``, e.g. ``0F0``, ``5B3``, ``3SEND_F1``), so a schedule
written here can be read there and the other way round.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from itertools import repeat
from typing import NamedTuple


class ActionKind:
    """What an action does, as the short string of the text form.

    Plain strings, not an ``enum.Enum``: ``Enum.__hash__`` is Python code, and the
    simulator hashes actions hundreds of thousands of times per run. Compute kinds run
    on a rank's compute stream; communication kinds move one microbatch's activation
    or gradient between ranks.
    """

    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients together)
    I = "I"  # noqa: E741  input-gradient backward (zero-bubble split)
    W = "W"  # weight-gradient backward (zero-bubble split)
    SEND_F = "SEND_F"  # send this stage's forward output to the next stage
    RECV_F = "RECV_F"  # receive this stage's forward input from the previous stage
    SEND_B = "SEND_B"  # send this stage's input gradient to the previous stage
    RECV_B = "RECV_B"  # receive this stage's output gradient from the next stage


# The compute kinds in their one order: their codes (``KIND_CODES``), the columns of the
# engine's ``StepTiming.seconds`` and every per-kind table follow it.
COMPUTE_KINDS = (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)
# The piece that completes a stage's weight gradient for a microbatch (B, or W when the
# backward is split): after the last of them a stage's gradients can be reduced.
WEIGHT_GRAD_DONE_KINDS = frozenset({ActionKind.B, ActionKind.W})
SEND_KINDS = frozenset({ActionKind.SEND_F, ActionKind.SEND_B})
RECV_KINDS = frozenset({ActionKind.RECV_F, ActionKind.RECV_B})
COMM_KINDS = SEND_KINDS | RECV_KINDS
ALL_KINDS = frozenset(COMPUTE_KINDS) | COMM_KINDS
# Every kind in a fixed order: ``KIND_CODES[kind]`` is the small number that stands for
# it where programs or traces are read as arrays (``schedules.program_arrays``); compute
# kinds first, so a code below ``len(COMPUTE_KINDS)`` is a computation.
KINDS = (*COMPUTE_KINDS, ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B)
KIND_CODES = {kind: code for code, kind in enumerate(KINDS)}

# Which neighbouring stage a compute kind reads its input from and hands its output to
# (forward: from the stage before, to the stage after; a backward the other way; W
# consumes only its own stage's I), and the transfer kinds that carry a compute kind's
# output (on its rank) and input (on the consumer's). The words of the dataflow rule;
# ``schedules.dataflow`` applies them (to one action or to whole programs as arrays) for
# lowering, validation, the engine, the accounting, the list schedulers and the executor.
INPUT_OFFSET = {ActionKind.F: -1, ActionKind.B: 1, ActionKind.I: 1}
OUTPUT_OFFSET = {ActionKind.F: 1, ActionKind.B: -1, ActionKind.I: -1}
SEND_OF = {ActionKind.F: ActionKind.SEND_F, ActionKind.B: ActionKind.SEND_B, ActionKind.I: ActionKind.SEND_B}
RECV_OF = {ActionKind.F: ActionKind.RECV_F, ActionKind.B: ActionKind.RECV_B, ActionKind.I: ActionKind.RECV_B}
# The stage on the other end of a transfer action, relative to its own: a SEND goes where
# its producer's output goes, a RECV comes from where its consumer's input comes from.
PEER_OFFSET = {ActionKind.SEND_F: OUTPUT_OFFSET[ActionKind.F], ActionKind.RECV_F: INPUT_OFFSET[ActionKind.F],
               ActionKind.SEND_B: OUTPUT_OFFSET[ActionKind.B], ActionKind.RECV_B: INPUT_OFFSET[ActionKind.B]}

_ACTION_TEXT = re.compile(r"^\s*(\d+)([A-Z_]+?)(\d+)\s*$")


class ActionParseError(ValueError):
    """A piece of text is not an action of the form ``{stage}{KIND}{microbatch}``."""


class UnknownKindError(ValueError):
    """An action whose kind is none of ``KINDS``."""


class Action(NamedTuple):
    """One step of a rank's program: ``kind`` applied to ``microbatch`` on global ``stage``.

    A NamedTuple rather than a dataclass: schedules hold hundreds of thousands of
    actions and the simulator hashes them on its hot path, where tuples are cheapest.
    """

    stage: int
    kind: str  # one of ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def peer_stage(self) -> int:
        """The stage on the other end of a communication action (``PEER_OFFSET``)."""
        offset = PEER_OFFSET.get(self.kind)
        if offset is None:
            raise ValueError(f"{self} is a compute action; it has no peer stage")
        return self.stage + offset

    def matching(self) -> Action:
        """The RECV that completes this SEND, or the SEND that feeds this RECV."""
        partner = MATCHING_KIND.get(self.kind)
        if partner is None:
            raise ValueError(f"{self} is a compute action; it has no matching transfer")
        return Action(self.peer_stage(), partner, self.microbatch)


# The kind of the other end of a transfer: a SEND's RECV and the other way round.
MATCHING_KIND = {
    ActionKind.SEND_F: ActionKind.RECV_F,
    ActionKind.RECV_F: ActionKind.SEND_F,
    ActionKind.SEND_B: ActionKind.RECV_B,
    ActionKind.RECV_B: ActionKind.SEND_B,
}


def parse_action(text: str) -> Action:
    """Parse ``"3SEND_F1"`` into ``Action(3, SEND_F, 1)``; raise naming the bad text."""
    match = _ACTION_TEXT.match(text)
    if not match:
        raise ActionParseError(
            f"{text!r} is not an action: expected {{stage}}{{KIND}}{{microbatch}} such as "
            f"'0F0', '5B3' or '3SEND_F1'"
        )
    stage, kind_text, microbatch = match.groups()
    if kind_text not in ALL_KINDS:
        valid = ", ".join(sorted(ALL_KINDS))
        raise ActionParseError(f"{text!r} has unknown kind {kind_text!r}; valid kinds: {valid}")
    return Action(int(stage), kind_text, int(microbatch))


GROUP_SEPARATOR = "+"


def format_group(actions: tuple[Action, ...] | list[Action]) -> str:
    """The text form of a P2P group: its actions joined by ``+`` (``1SEND_F3+1RECV_B1``)."""
    return GROUP_SEPARATOR.join(str(action) for action in actions)


def parse_group(text: str) -> tuple[Action, ...]:
    """Parse one cell of a lowered program: an action, or a P2P group of communication
    actions joined by ``+``. Raise naming the bad text; a compute action cannot be part of
    a group (groups are posted as one ``batch_isend_irecv``, which holds only transfers)."""
    parts = text.split(GROUP_SEPARATOR)
    actions = tuple(parse_action(part) for part in parts)
    if len(actions) > 1:
        for action in actions:
            if action.kind not in COMM_KINDS:
                raise ActionParseError(
                    f"{text!r} groups {action}, a compute action; only SEND/RECV actions are posted "
                    f"together in a P2P group"
                )
    return actions


_new_action = tuple.__new__  # Action(...) without NamedTuple's Python-level __new__: generators build many


def actions_of(stages: Iterable[int], kinds: Iterable[str], microbatches: Iterable[int]) -> list[Action]:
    """``Action(stage, kind, microbatch)`` of each position of the three sequences, built
    in one pass: what a pass that computed whole arrays of actions turns them into."""
    return list(map(_new_action, repeat(Action), zip(stages, kinds, microbatches, strict=True)))


def F(stage: int, microbatch: int) -> Action:  # noqa: N802 - reads like the text form
    """Forward of ``microbatch`` on ``stage``."""
    return _new_action(Action, (stage, ActionKind.F, microbatch))


def B(stage: int, microbatch: int) -> Action:  # noqa: N802
    """Full backward of ``microbatch`` on ``stage``."""
    return _new_action(Action, (stage, ActionKind.B, microbatch))


def I(stage: int, microbatch: int) -> Action:  # noqa: N802, E741, E743
    """Input-gradient backward of ``microbatch`` on ``stage``."""
    return _new_action(Action, (stage, ActionKind.I, microbatch))


def W(stage: int, microbatch: int) -> Action:  # noqa: N802
    """Weight-gradient backward of ``microbatch`` on ``stage``."""
    return _new_action(Action, (stage, ActionKind.W, microbatch))


# An overlapped forward-and-backward pair (DualPipe): two actions of one rank run as one
# step, so their compute and communication hide each other. Programs keep both actions,
# the F then the B (``Schedule.fused`` marks the pair); the text form is torch's
# ``(F;B)OVERLAP_F_B`` cell, so torch.distributed.pipelining reads our CSVs and we read its.
OVERLAP_F_B = "OVERLAP_F_B"
_OVERLAP_TEXT = re.compile(r"^\s*\(([^;()]+);([^;()]+)\)" + OVERLAP_F_B + r"\s*$")


def format_overlap(forward: Action, backward: Action) -> str:
    """``(0F7;7B3)OVERLAP_F_B``: torch's text for an overlapped pair."""
    return f"({forward};{backward}){OVERLAP_F_B}"


def parse_overlap(text: str) -> tuple[Action, Action] | None:
    """The (F, B) of an ``(F;B)OVERLAP_F_B`` cell, None for any other text; raise naming
    the text if the pair is not a forward then a backward."""
    match = _OVERLAP_TEXT.match(text)
    if match is None:
        return None
    forward, backward = parse_action(match.group(1)), parse_action(match.group(2))
    if forward.kind != ActionKind.F or backward.kind not in (ActionKind.B, ActionKind.I):
        raise ActionParseError(
            f"{text!r}: an {OVERLAP_F_B} pair is a forward then a backward, e.g. '(0F7;7B3){OVERLAP_F_B}'"
        )
    return forward, backward
