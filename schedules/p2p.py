"""Point-to-point semantics, named: what a P2P group waits for.

- ``rendezvous`` (NCCL): between a pair of ranks, operations match in the order they
  are posted, and a send may wait until its receive is posted. A rank's groups run one
  after another on its communication stream: a group starts once it is posted and the
  previous group has completed, and completes once every peer's group holding a
  matching operation has started. Posting does not block the host: it waits for a
  group right before the compute action that consumes one of its receives.
- ``buffered`` (gloo): transfers match by tag and a send never waits; a receive is
  posted without blocking (``irecv``) and the rank waits for its data right before the
  compute action that needs it.
- ``torch-runtime``: NCCL as torch.distributed.pipelining's ``_PipelineScheduleRuntime``
  drives it from a flat file: every transfer posted alone (no groups), on one stream
  per rank pair rather than one per rank (a two-rank communicator per pair), otherwise
  rendezvous (``schedules.torch_runtime`` says where each rule is read in torch).

A schedule that runs under rendezvous runs under buffered too, not the other way round:
gloo hides orders that hang on GPUs, so a schedule is checked under the semantics of the
backend it will run on before any process starts. The timing engine
(``schedules.engine``) runs programs under either; a rank it leaves stuck is a deadlock,
which ``schedules.validate`` explains. Under rendezvous this module also checks that each
rank pair's transfers are posted in the same order on both sides (``check_pair_order``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from schedules.action import MATCHING_KIND, PEER_OFFSET, SEND_KINDS, Action
from schedules.dataflow import PEER_OFFSET_CODES
from schedules.program_arrays import program_arrays
from schedules.schedule import Schedule

RENDEZVOUS = "rendezvous"
BUFFERED = "buffered"
TORCH_RUNTIME = "torch-runtime"
P2P_SEMANTICS = (RENDEZVOUS, BUFFERED, TORCH_RUNTIME)


class P2PError(ValueError):
    """A lowered schedule that mismatches or hangs under a P2P semantics. Raised as a
    ``ScheduleValidationError`` by ``validate``; this base keeps the module free of it."""

    def __init__(self, message: str, action: Action, rank: int, position: int, cycle: Sequence[Action] = ()) -> None:
        super().__init__(message)
        self.action, self.rank, self.position, self.cycle = action, rank, position, tuple(cycle)


def default_semantics(backend: str) -> str:
    """The semantics of a torch.distributed backend: NCCL's rendezvous for ``nccl``
    (and any GPU backend), gloo's buffered matching for ``gloo``."""
    return BUFFERED if backend == "gloo" else RENDEZVOUS


def require_semantics(p2p: str) -> str:
    """``p2p`` if it names a semantics; a clear error otherwise."""
    if p2p not in P2P_SEMANTICS:
        raise ValueError(f"unknown P2P semantics {p2p!r}; choose one of: {', '.join(P2P_SEMANTICS)}")
    return p2p


def check_pair_order(schedule: Schedule) -> None:
    """Under rendezvous, the k-th send from rank r to rank r' must be the transfer of the
    k-th receive on r' from r: NCCL pairs them by position, not by what they carry.
    Raise naming both actions of the first pair that disagrees. The schedule has passed
    the transfer check (every send has its receive): the orders are compared as arrays
    first, and walked action by action only to name a disagreement."""
    if _pair_orders_agree(schedule):
        return
    placement = schedule.placement
    sends: dict[tuple[int, int], list[tuple]] = {}
    recvs: dict[tuple[int, int], list[tuple]] = {}
    for rank, program in enumerate(schedule.programs):
        for action in program:
            kind = action[1]
            if kind in PEER_OFFSET:
                peer_stage = action[0] + PEER_OFFSET[kind]
                if kind in SEND_KINDS:
                    sends.setdefault((rank, placement[peer_stage]), []).append(
                        (peer_stage, MATCHING_KIND[kind], action[2]))
                else:
                    recvs.setdefault((placement[peer_stage], rank), []).append(action)
    for pair, expected in sends.items():
        received = recvs.get(pair, [])
        if expected != received[: len(expected)]:
            _explain_pair_order(schedule, pair, expected, received)


def _explain_pair_order(schedule: Schedule, pair: tuple[int, int], expected: list, received: list) -> None:
    sender, receiver = pair
    for index, (wanted, recv) in enumerate(zip(expected, received, strict=False)):
        if wanted == recv:
            continue
        send = Action(*wanted).matching()
        recv = Action(*recv)
        at_send = schedule.programs[sender].index(send)
        at_recv = schedule.programs[receiver].index(recv)
        raise P2PError(
            f"rank {sender}, position {at_send}: {send} is rank {sender}'s send number {index + 1} to rank "
            f"{receiver}, but rank {receiver}'s receive number {index + 1} from rank {sender} is {recv} "
            f"(position {at_recv}); NCCL pairs a rank pair's transfers in posting order, so {send} would "
            f"fill {recv}'s buffer. Post {send.matching()} in that place on rank {receiver}, or reorder "
            f"rank {sender}'s sends",
            action=send, rank=sender, position=at_send,
        )
    # More sends than receives: the transfer check names the send without a receive.


def _pair_orders_agree(schedule: Schedule) -> bool:
    """Whether every rank pair's sends and receives carry the same transfers in the same order."""
    arrays = program_arrays(schedule)
    placement = np.asarray(schedule.placement, dtype=np.int64)
    orders = []
    for rows, sending in ((np.flatnonzero(arrays.is_send), True), (np.flatnonzero(arrays.is_recv), False)):
        stage, kind, rank = arrays.stage[rows], arrays.kind[rows], arrays.rank[rows]
        peer = placement[np.clip(stage + PEER_OFFSET_CODES[kind], 0, schedule.num_stages - 1)]
        pair = rank * schedule.pp + peer if sending else peer * schedule.pp + rank
        # rows run in program order within each rank, and a pair has one rank on this side:
        # grouping them by pair (a stable sort) leaves each pair's in posting order
        order = np.argsort(pair.astype(np.int16) if schedule.pp**2 <= 2**15 else pair, kind="stable")
        orders.append((pair[order], arrays.transfer_key(stage, kind, arrays.microbatch[rows])[order]))
    (send_pairs, send_keys), (recv_pairs, recv_keys) = orders
    return bool(np.array_equal(send_pairs, recv_pairs) and np.array_equal(send_keys, recv_keys))
