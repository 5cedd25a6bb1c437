"""Point-to-point transfers between pipeline ranks, posted group by group.

Shapes come from the model's ``boundary_shape`` (known ahead), so no rank ever asks a
peer what it is about to receive. Each P2P group of the lowered program (a tuple of
SEND/RECV actions, ``Schedule.program_items``) is posted as one ``batch_isend_irecv``
in the group's own order, which lowering makes the same on both peers of a pair. Each
transfer carries a tag derived from (sending stage, microbatch, direction) so that gloo
matches it to the right receive; NCCL ignores tags and matches by posting order.

Two semantics (``schedules.p2p``):

- ``buffered`` (gloo as it is): sends complete in the background; receives match by tag.
- ``rendezvous`` (NCCL's rule): a group completes only once every peer has posted the
  matching operations, matched in posting order per rank pair. NCCL does that itself.
  On gloo it is emulated with a handshake: for each receive, the receiver sends the
  sender a small token carrying its per-pair receive number and the receive action,
  tagged by that number; the sender's group waits for the token of *its* per-pair send
  number. So a send cannot complete before the peer posted its receive, and if the two
  ranks' orders differ the sender gets the token of another action and fails naming
  both: exactly the pairs NCCL would have matched (and corrupted or hung on).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from schedules.action import SEND_KINDS, Action, ActionKind
from schedules.dataflow import action_transfer_key, transfer_count

TOKEN_KINDS = (ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B)




class Posted(NamedTuple):
    """One posted action: its data tensor, the work handles that complete it, and (in
    the gloo handshake) the token received for a send."""

    action: Action
    tensor: torch.Tensor
    works: list
    token: torch.Tensor | None = None
    number: int = 0  # per-pair send number, for the handshake check
    token_works: list | None = None  # the token's transfer (the handshake only)


class Pending(NamedTuple):
    """A send in flight: kept until complete, holding its tensor so it is not freed
    early; ``end`` is its completion mark when the clock can take it ahead (CUDA)."""

    item: Posted
    start: Any
    end: Any = None


class OrderMismatchError(RuntimeError):
    """Two ranks posted transfers between them in different orders: under rendezvous
    semantics (NCCL) the k-th send of one pairs with the k-th receive of the other."""


def encode_action(action: Action) -> list[int]:
    return [action.stage, TOKEN_KINDS.index(action.kind), action.microbatch]


def decode_action(values: list[int]) -> Action:
    stage, kind, microbatch = values
    return Action(stage, TOKEN_KINDS[kind], microbatch)


class PeerLinks:
    """Who a rank's communication actions talk to, and how."""

    def __init__(self, placement: tuple[int, ...], microbatches: int, device: torch.device, dtype: torch.dtype,
                 shape_of: Callable[[Action], tuple[int, ...]], handshake: bool = False, rank: int = 0) -> None:
        self.placement = placement
        self.microbatches = microbatches
        self.device = device
        self.dtype = dtype
        self.shape_of = shape_of  # a transfer end -> the shape of the activation it carries
        self.handshake = handshake  # emulate rendezvous on a backend that buffers (gloo)
        self.rank = rank  # this process's global rank, for messages
        self.token_base = transfer_count(len(placement), microbatches)  # above every transfer number
        self.start_step()

    def start_step(self) -> None:
        """Per-pair transfer numbers restart with each step (every step posts the whole
        program, so both ends count alike)."""
        self.sent: Counter[int] = Counter()
        self.received: Counter[int] = Counter()

    def peer(self, action: Action) -> int:
        return self.placement[action.peer_stage()]

    def tag(self, action: Action) -> int:
        """Same number on both ends: the transfer's (``schedules.dataflow.transfer_key``:
        the sending stage, the direction, the microbatch)."""
        return action_transfer_key(action, self.microbatches)

    def buffer(self, action: Action) -> torch.Tensor:
        return torch.empty(self.shape_of(action), dtype=self.dtype, device=self.device)

    def post(self, ops: list[tuple[Action, torch.Tensor]]) -> list[Posted]:
        """Post every (action, tensor) as one batch, in the given order; return one
        ``Posted`` per op. With the handshake, each op also posts its token."""
        p2p_ops, owners, posted = [], [], []  # owners: (index in posted, whether the op is the token's)
        for action, tensor in ops:
            peer = self.peer(action)
            is_send = action.kind in SEND_KINDS
            p2p_ops.append(dist.P2POp(dist.isend if is_send else dist.irecv, tensor, peer, tag=self.tag(action)))
            owners.append((len(posted), False))
            token, number = None, 0
            if self.handshake:
                if is_send:
                    number = self.sent[peer]
                    self.sent[peer] += 1
                    token = torch.full((4,), -1, dtype=torch.int64)
                    p2p_ops.append(dist.P2POp(dist.irecv, token, peer, tag=self.token_base + number))
                else:
                    number = self.received[peer]
                    self.received[peer] += 1
                    token = torch.tensor([number, *encode_action(action)], dtype=torch.int64)
                    p2p_ops.append(dist.P2POp(dist.isend, token, peer, tag=self.token_base + number))
                owners.append((len(posted), True))
            posted.append(Posted(action, tensor, [], token, number, [] if self.handshake else None))
        works = dist.batch_isend_irecv(p2p_ops)
        if len(works) == len(p2p_ops):
            for (owner, is_token), work in zip(owners, works, strict=True):
                (posted[owner].token_works if is_token else posted[owner].works).append(work)
        else:  # one handle for the whole batch (NCCL coalesces a batch)
            for item in posted:
                item.works.extend(works)
        return posted

    @staticmethod
    def all_works(item: Posted) -> list:
        """Every handle of a posted action, its token's first: a send's token says which
        receive the peer posted, and must be read before waiting for the data (which,
        when the orders differ, would never be taken)."""
        return [*(item.token_works or []), *item.works]

    def check_token(self, item: Posted) -> None:
        """Once a send's token has arrived (handshake): the receive the peer posted as
        its matching one must be this send's own receive."""
        if item.token is None or item.action.kind not in SEND_KINDS:
            return
        number, *code = item.token.tolist()
        theirs = decode_action(code)
        if number != item.number or theirs != item.action.matching():
            peer = self.peer(item.action)
            raise OrderMismatchError(
                f"rendezvous order mismatch: rank {self.rank}'s {item.action} is its send #{item.number + 1} "
                f"to rank {peer}, but rank {peer}'s receive #{item.number + 1} from rank {self.rank} is "
                f"{theirs}; NCCL would pair these two (expected {item.action.matching()})"
            )
