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

So on NCCL a flat file hangs exactly when these waits can never all be met: an op starts
once the previous op on its pair's stream has completed and every compute action before
it has run; it completes once the matching op on the peer has started (NCCL's
rendezvous, the k-th send of a pair matching the k-th receive); a compute action runs
once the previous one has and its receive has completed. That is the timing engine's
``torch-runtime`` semantics (``schedules.engine``): rendezvous, every transfer a group
of its own, a stream per rank pair. ``check_torch_runtime`` validates a file under it.

**Against pipesim's rendezvous semantics** (``schedules.p2p``): pipesim runs all of a
rank's groups on one communication stream, torch's runtime on one stream per peer.
``validate(as_torch_posts(schedule), p2p="rendezvous")`` is therefore this check where
every rank exchanges with one peer (pp = 2), and stricter elsewhere: it can refuse a file
whose only cycle runs through two streams of one rank, which torch runs (the tests show
one). ``lower_for_torch_runtime`` is the lowering target: ``lower`` with every transfer
alone, checked under torch's rule.
"""

from __future__ import annotations

from schedules.lowering import lower
from schedules.p2p import TORCH_RUNTIME
from schedules.schedule import Schedule


def as_torch_posts(schedule: Schedule) -> Schedule:
    """The schedule as torch's runtime posts it: the same programs, every transfer a P2P
    group of its own (what a flat file reads back as; torch has no groups)."""
    posted = schedule.with_programs(schedule.programs)
    posted.meta.update(schedule.meta)
    return posted


def check_torch_runtime(schedule: Schedule) -> Schedule:
    """Raise ``ScheduleValidationError`` if torch's ``_PipelineScheduleRuntime`` running
    ``schedule``'s flat file could hang on NCCL (naming the waits on the cycle), or if the
    file is malformed for it; return the schedule as torch posts it otherwise. P2P groups
    in ``schedule`` are ignored, as torch ignores them."""
    from schedules.validate import validate  # validate knows this semantics by name

    return validate(as_torch_posts(schedule), TORCH_RUNTIME)


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
