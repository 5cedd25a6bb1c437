"""How torch's own runtime posts a lowered file's transfers, and whether that can hang on NCCL.

``torch.distributed.pipelining``'s ``_PipelineScheduleRuntime`` runs a lowered CSV
(``_load_csv(path, format="compute_comms")``) as written. What it does with the SEND/RECV
cells, read from torch 2.13's ``torch/distributed/pipelining/schedules.py``:

1. It walks the rank's row in order (``_PipelineScheduleRuntime._step_microbatches``,
   the loop over ``pipeline_order_with_comms[self.rank]``) and never blocks the host on a
   transfer when it posts it (``_perform_action``): a ``SEND_F``/``SEND_B`` cell posts
   the stage's send ops and keeps the works in ``send_ops``, waited only after the last
   action of the step (``while send_ops: _wait_batch_p2p(send_ops.pop())``); a
   ``RECV_F``/``RECV_B`` cell posts the receive ops and keeps the works in
   ``fwd_recv_ops``/``bwd_recv_ops`` until the compute action that consumes them.
2. Nothing is batched across cells. Each cell's ops go through ``_batch_p2p``, which
   posts a list of only sends (or only receives) as separate ``dist.isend``/``dist.irecv``
   calls, not as one ``batch_isend_irecv`` ("avoids coalescing for homogeneous
   batches"); one cell never mixes the two, so a flat file's transfers are each posted
   alone, in file order. A ``+`` group in a cell is not read at all: torch's action
   parser stops at the first action.
3. Waits: ``F`` waits for its ``RECV_F`` works (``_wait_batch_p2p(self.fwd_recv_ops.pop(
   ...))``) and ``B``/``I`` for their ``RECV_B`` works just before computing; ``W``,
   ``REDUCE_GRAD``, ``UNSHARD``, ``RESHARD`` wait for no transfer; stages on the same
   rank (a V's turn) hand tensors over without any transfer.
4. On NCCL, ``ProcessGroupNCCL`` runs a single ``isend``/``irecv`` (one not inside
   ``batch_isend_irecv``) on a two-rank communicator per rank pair (key ``"low:high"``,
   ``getKeySendRecv``) with its own NCCL stream: the ops a rank exchanges with one peer,
   both directions, run one after another in posting order; ops with different peers run
   on different streams. Each op's stream first waits for the rank's compute stream as it
   stands when the op is posted (``syncStreams``), so an op starts only after every
   compute action before it in the file. ``Work.wait()`` makes the compute stream wait,
   not the host. The pair communicators are created before the step, in torch's warm-up
   (``_warmup_p2p``: "warms up 2-rank sub-communicators (used by ``_batch_p2p``
   homogeneous fast-path)"), so creating them cannot block inside the step.

So on NCCL a flat file hangs exactly when these waits form a cycle: an op starts once
the previous op on its pair's stream has completed and every compute action before it
has run; it completes once the matching op on the peer has started (NCCL's rendezvous,
the k-th send of a pair matching the k-th receive); a compute action runs once the
previous one has and its receive has completed. ``check_torch_runtime`` builds that
graph and looks for a cycle.

**Against pipesim's rendezvous semantics** (``schedules.p2p``): torch posts every
transfer as a group of one (``as_torch_posts``), and the rest of its rules are pipesim's
rendezvous rules, with one difference: pipesim runs all of a rank's groups on one
communication stream, torch's runtime on one stream per peer. ``validate(
as_torch_posts(schedule), p2p="rendezvous")`` is therefore exactly this check where
every rank exchanges with one peer (pp = 2), and stricter elsewhere: it can refuse a file
whose only cycle runs through two streams of one rank, which torch runs (the tests show
one). ``check_torch_runtime`` has torch's rule exactly; with ``per_peer=False`` it is
pipesim's rendezvous walk again (tested equal on generated and shuffled orders).
``check_torch_runtime_progress`` is that rule alone (``P2PError``, as
``schedules.p2p.check_progress`` raises), for a validator that dispatches on the
semantics name ``TORCH_RUNTIME``; ``check_torch_runtime`` adds the structural and
pair-order checks. ``lower_for_torch_runtime`` is the lowering target: ``lower`` with
every transfer alone, checked under torch's rule.
"""

from __future__ import annotations

from schedules.action import COMM_KINDS, SEND_KINDS, Action, ActionKind
from schedules.lowering import lower
from schedules.p2p import BUFFERED, P2PError, check_pair_order
from schedules.schedule import Schedule

TORCH_RUNTIME = "torch-runtime"

_F, _B, _I = ActionKind.F, ActionKind.B, ActionKind.I
_PEER_OFFSET = {ActionKind.SEND_F: 1, ActionKind.RECV_F: -1, ActionKind.SEND_B: -1, ActionKind.RECV_B: 1}
_START, _DONE = "start", "done"

Node = tuple[str, int, int]  # (start|done, rank, program position)


def as_torch_posts(schedule: Schedule) -> Schedule:
    """The schedule as torch's runtime posts it: the same programs, every transfer a P2P
    group of its own (what a flat file reads back as; torch has no groups)."""
    posted = schedule.with_programs(schedule.programs).with_fused_from(schedule)
    posted.meta.update(schedule.meta)
    return posted


def check_torch_runtime_progress(schedule: Schedule) -> None:
    """Raise ``P2PError`` naming the waits on a cycle if torch's runtime running
    ``schedule``'s flat file could hang on NCCL. Like ``schedules.p2p.check_progress``, it
    expects a lowered schedule that passed the structural and pair-order checks; P2P
    groups are ignored, as torch ignores them."""
    posted = as_torch_posts(schedule)
    cycle = wait_cycle(posted)
    if cycle:
        raise _deadlock_error(posted, cycle)


def check_torch_runtime(schedule: Schedule) -> Schedule:
    """Raise ``ScheduleValidationError`` if torch's ``_PipelineScheduleRuntime`` running
    ``schedule``'s flat file could hang on NCCL (naming the waits on the cycle), or if the
    file is malformed for it; return the schedule as torch posts it otherwise. P2P groups
    in ``schedule`` are ignored, as torch ignores them."""
    from schedules.validate import ScheduleValidationError, validate  # validate may dispatch to this module

    posted = as_torch_posts(schedule)
    validate(posted, BUFFERED)  # actions, completeness, transfers before their consumers
    if not posted.is_lowered:
        return posted
    try:
        check_pair_order(posted)
        check_torch_runtime_progress(posted)
    except P2PError as error:
        raise ScheduleValidationError(str(error), action=error.action, rank=error.rank, position=error.position,
                                      cycle=error.cycle) from None
    return posted


def is_torch_runtime_safe(schedule: Schedule) -> bool:
    """Whether ``check_torch_runtime`` accepts the schedule."""
    from schedules.validate import ScheduleValidationError

    try:
        check_torch_runtime(schedule)
    except ScheduleValidationError:
        return False
    return True


def lower_for_torch_runtime(schedule: Schedule) -> Schedule:
    """Lowering for torch's runtime: ``lower``'s transfers, each posted alone (as a flat
    file is), checked not to hang torch's runtime on NCCL. Lowering posts the transfers of
    every rank pair in the same order on both ends, at moments both ends can meet, so
    flattening its groups keeps that order and the check holds (tested for every
    generator); a lowering that ever broke that would be refused here, not written."""
    return check_torch_runtime(lower(schedule))


# --- the wait graph -----------------------------------------------------------------------


def wait_cycle(schedule: Schedule, per_peer: bool = True) -> list[Node]:
    """The nodes of one cycle of waits when ``schedule``'s lowered programs run with every
    transfer posted alone (empty: every action completes). ``per_peer``: a rank's
    transfers run on one stream per peer rank (torch's runtime on NCCL); otherwise on one
    stream per rank (pipesim's rendezvous semantics). The schedule must have passed
    ``validate(..., "buffered")`` and the pair-order check."""
    base = [0]
    for program in schedule.programs:
        base.append(base[-1] + len(program))
    waits = _wait_graph(schedule, per_peer, base)  # node -> the nodes it waits for
    pending = [len(before) for before in waits]
    followers: list[list[int]] = [[] for _ in waits]
    for node, before in enumerate(waits):
        for earlier in before:
            followers[earlier].append(node)
    ready = [node for node, count in enumerate(pending) if count == 0]
    while ready:
        node = ready.pop()
        for later in followers[node]:
            pending[later] -= 1
            if pending[later] == 0:
                ready.append(later)
    left = [node for node, count in enumerate(pending) if count > 0]
    if not left:
        return []
    # Every node left waits for another node left: follow such waits until one repeats.
    node = left[0]
    path: list[int] = []
    seen: dict[int, int] = {}
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = next(earlier for earlier in waits[node] if pending[earlier] > 0)
    ranks = len(schedule.programs)

    def named(node: int) -> Node:
        position = node // 2
        rank = next(rank for rank in range(ranks) if base[rank] <= position < base[rank + 1])
        return (_START if node % 2 else _DONE, rank, position - base[rank])

    return [named(node) for node in path[seen[node]:]]


def _wait_graph(schedule: Schedule, per_peer: bool, base: list[int]) -> list[list[int]]:
    """Each event and the events it waits for (all of them: there are no alternatives,
    so the step finishes exactly when this graph has no cycle). The action at
    ``position`` of ``rank`` is event ``2 * (base[rank] + position)`` when it is done and,
    for a transfer, ``+ 1`` when it has started."""
    placement = schedule.placement
    last_stage = schedule.num_stages - 1
    waits: list[list[int]] = [[] for _ in range(2 * base[-1])]
    sends: dict[tuple[int, int], list[int]] = {}  # (sender, receiver) -> the sends' events
    recvs: dict[tuple[int, int], list[int]] = {}  # (sender, receiver) -> the receives' events
    for rank, program in enumerate(schedule.programs):
        position = {action: at for at, action in enumerate(program)}
        first = base[rank]
        last_compute = -1  # event of the rank's last compute action so far
        stream_tail: dict[int, int] = {}  # stream (peer, or -1 for the rank's one) -> its last op's event
        for at, action in enumerate(program):
            done = 2 * (first + at)
            stage, kind, _ = action
            if kind in COMM_KINDS:
                peer = placement[stage + _PEER_OFFSET[kind]]
                stream = peer if per_peer else -1
                started = waits[done + 1]
                if last_compute >= 0:
                    started.append(last_compute)
                if stream in stream_tail:
                    started.append(stream_tail[stream])
                stream_tail[stream] = done
                waits[done].append(done + 1)  # and the peer's matching op, below
                if kind in SEND_KINDS:
                    sends.setdefault((rank, peer), []).append(done)
                else:
                    recvs.setdefault((peer, rank), []).append(done)
                continue
            if last_compute >= 0:
                waits[done].append(last_compute)
            receive = _receive_of(action, placement, last_stage)
            if receive is not None:
                waits[done].append(2 * (first + position[receive]))
            last_compute = done
    for pair, send_events in sends.items():
        for send, recv in zip(send_events, recvs.get(pair, ()), strict=False):
            waits[send].append(recv + 1)
            waits[recv].append(send + 1)
    return waits


def _receive_of(action: Action, placement, last_stage: int) -> Action | None:
    """The RECV that brings ``action`` its input from another rank, if any."""
    stage, kind, microbatch = action
    rank = placement[stage]
    if kind == _F and stage > 0 and placement[stage - 1] != rank:
        return Action(stage, ActionKind.RECV_F, microbatch)
    if kind in (_B, _I) and stage < last_stage and placement[stage + 1] != rank:
        return Action(stage, ActionKind.RECV_B, microbatch)
    return None


def _deadlock_error(schedule: Schedule, cycle: list[Node]) -> P2PError:
    """The cycle as the waits a reader can follow, one clause per wait."""
    programs = schedule.programs

    def named(node: Node) -> str:
        _, rank, at = node
        return f"rank {rank}'s {programs[rank][at]} (position {at})"

    clauses = []
    for index, node in enumerate(cycle):
        waited = cycle[(index + 1) % len(cycle)]
        event, rank, at = node
        action = programs[rank][at]
        if event == _DONE and waited[0] == _START and waited[1:] == node[1:]:
            continue  # an op completes after it starts: says nothing
        if event == _DONE and action.kind in COMM_KINDS:
            clauses.append(f"{named(node)} completes only once {named(waited)} has started")
        elif event == _START and programs[rank][waited[2]].kind in COMM_KINDS:
            clauses.append(f"{named(node)} starts only after {named(waited)}, posted before it to the same "
                           f"peer, completes")
        elif event == _START:
            clauses.append(f"{named(node)} starts only after {programs[rank][waited[2]]} (position {waited[2]}), "
                           f"computed before it is posted")
        elif programs[waited[1]][waited[2]].kind in COMM_KINDS:
            clauses.append(f"{named(node)} waits for its input from {named(waited)}")
        else:
            clauses.append(f"{named(node)} runs after {programs[waited[1]][waited[2]]} (position {waited[2]})")
    first = cycle[0]
    actions = [programs[rank][at] for _, rank, at in cycle]
    return P2PError(
        "can hang torch's _PipelineScheduleRuntime on NCCL (each SEND/RECV posted alone in file order, one stream "
        "per rank pair, a transfer completes only once its peer has started the matching one): "
        + "; ".join(clauses) + ". Write the file with `pipesim export --lowered`, whose transfers cannot hang it",
        action=actions[0], rank=first[1], position=first[2], cycle=list(dict.fromkeys(actions)),
    )
