"""Lowering: add the SEND/RECV actions that a compute-only schedule implies.

Every dependency that crosses ranks (a forward output going to the next stage, an
input gradient going back to the previous one) becomes a SEND right after the action
that produces it and a RECV right before the action that consumes it. A SEND followed
directly by a RECV on the same rank is the pair an executor batches into one P2P call.
"""

from __future__ import annotations

from schedules.action import Action, ActionKind
from schedules.schedule import Schedule


def lower(schedule: Schedule) -> Schedule:
    """The schedule with communication actions inserted; already-lowered schedules
    (for instance a CSV written by hand with its own SEND/RECV order) come back as they are."""
    if schedule.is_lowered:
        return schedule
    placement = schedule.placement
    last_stage = schedule.num_stages - 1
    lowered = []
    for rank, program in enumerate(schedule.programs):
        actions: list[Action] = []
        append = actions.append
        for action in program:
            stage, kind, microbatch = action
            if kind == ActionKind.F:
                if stage > 0 and placement[stage - 1] != rank:
                    append(Action(stage, ActionKind.RECV_F, microbatch))
                append(action)
                if stage < last_stage and placement[stage + 1] != rank:
                    append(Action(stage, ActionKind.SEND_F, microbatch))
            elif kind == ActionKind.B or kind == ActionKind.I:
                if stage < last_stage and placement[stage + 1] != rank:
                    append(Action(stage, ActionKind.RECV_B, microbatch))
                append(action)
                if stage > 0 and placement[stage - 1] != rank:
                    append(Action(stage, ActionKind.SEND_B, microbatch))
            else:
                append(action)
        lowered.append(actions)
    return schedule.with_programs(lowered)
