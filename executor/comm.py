"""Point-to-point transfers between pipeline ranks, posted in program order.

Shapes come from the model's ``boundary_shape`` (known ahead), so no rank ever asks a
peer what it is about to receive. Consecutive SEND/RECV actions of a program are posted
together through ``batch_isend_irecv``: with NCCL, a rank that blocks in a send while
its peer blocks in the opposite send deadlocks; posting the pair as one batch cannot.
Each transfer carries a tag derived from (sending stage, microbatch, direction) so that
gloo matches it to the right receive; NCCL ignores tags and relies on the program order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from schedules.action import SEND_KINDS, Action, ActionKind


class Pending(NamedTuple):
    """A posted send: kept until complete, holding its tensor so it is not freed early."""

    action: Action
    work: Any
    tensor: torch.Tensor
    start: Any


class PeerLinks:
    """Who a rank's communication actions talk to, and how."""

    def __init__(self, placement: tuple[int, ...], microbatches: int, device: torch.device, dtype: torch.dtype,
                 shape_of: Callable[[int], tuple[int, ...]]) -> None:
        self.placement = placement
        self.microbatches = microbatches
        self.device = device
        self.dtype = dtype
        self.shape_of = shape_of  # microbatch -> activation shape

    def peer(self, action: Action) -> int:
        return self.placement[action.peer_stage()]

    def tag(self, action: Action) -> int:
        """Same number on both ends: the sending stage, the microbatch, the direction."""
        sender = action.stage if action.kind in SEND_KINDS else action.peer_stage()
        backward = action.kind in (ActionKind.SEND_B, ActionKind.RECV_B)
        return (sender * self.microbatches + action.microbatch) * 2 + int(backward)

    def buffer(self, action: Action) -> torch.Tensor:
        return torch.empty(self.shape_of(action.microbatch), dtype=self.dtype, device=self.device)

    def post(self, ops: list[tuple[Action, torch.Tensor]]) -> list[Any]:
        """Post every (action, tensor) as one batch; return the work handles in order."""
        if len(ops) == 1:
            action, tensor = ops[0]
            is_send = action.kind in SEND_KINDS
            function = dist.isend if is_send else dist.irecv
            return [function(tensor, self.peer(action), tag=self.tag(action))]
        p2p_ops = [
            dist.P2POp(dist.isend if action.kind in SEND_KINDS else dist.irecv,
                       tensor, self.peer(action), tag=self.tag(action))
            for action, tensor in ops
        ]
        return dist.batch_isend_irecv(p2p_ops)
