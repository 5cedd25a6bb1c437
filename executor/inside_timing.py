"""Timing the expert-parallel all-to-alls and ring attention's K/V exchanges a compute
action runs inside it, so that ``pipesim compare`` can take them out of the measured
compute and price them from the links it benchmarked, as it does the tp collectives
(``executor.tensor_parallel.TpTimer``).

The simulator charges each MoE layer two all-to-alls of the rank's routed token copies in
the forward (dispatch and combine) and the same two in the input-gradient backward
(``pipesim.sim.expert_parallel``). The dispatcher (``executor.expert_parallel``) sends
exactly those through ``timed_all_to_all``, which marks the runtime clock around each one
and around its backward's; the small exchanges of counts and expert indices that precede
them are not in the simulator's model and stay in the measured compute.

Ring attention (``executor.ring_attention``) overlaps each block's transfer with the
attention over the block before it; the simulator charges what the attention does not
hide (``pipesim.sim.context_parallel``: per step, the transfer beyond the step's share of
the attention core). So ``RingTimer`` times both: each wait for a transfer after the
step's compute (what held the rank: ``CP_KV(action)`` events) and the attention core's
compute of every step (``attention``, the seconds the simulator sets the transfers
against).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.distributed as dist

# The Trace's name for an all-to-all inside an action, as the simulator names it
# (pipesim.sim.expert_parallel.EP_KIND, on the ``ep`` stream)
EP_KIND = "ALLTOALL_EP"
# ... and the part of a ring attention's K/V exchange the attention did not hide
# (pipesim.sim.context_parallel.CP_KIND, on the ``cp`` stream)
CP_KIND = "CP_KV"


class CollectiveTimer:
    """Records ``(action, start, end)`` of every collective run inside ``timed()``, in the
    marks of the runtime's clock (``executor.clock``: host times on a CPU, CUDA events on
    the compute stream on a GPU), the action being the one the runtime runs then."""

    def __init__(self, current_action: Callable[[], object], mark: Callable[[], object] = time.perf_counter) -> None:
        self.current_action, self.mark = current_action, mark
        self.intervals: list[tuple[object, object, object]] = []

    def timed(self) -> AbstractContextManager[None]:
        return self._recorded(self.intervals)

    def take(self) -> list[tuple[object, object, object]]:
        """The intervals recorded since the last call."""
        return self._drained("intervals")

    def _drained(self, name: str) -> list[tuple[object, object, object]]:
        """The list held as ``name``, replaced by an empty one."""
        recorded = getattr(self, name)
        setattr(self, name, [])
        return recorded

    @contextmanager
    def _recorded(self, into: list[tuple[object, object, object]]) -> Iterator[None]:
        """Append ``(action, start, end)`` of the block it wraps to ``into``."""
        start = self.mark()
        yield
        into.append((self.current_action(), start, self.mark()))


class RingTimer(CollectiveTimer):
    """A ``CollectiveTimer`` for ring attention: ``timed()`` around each wait for a
    block, ``computing()`` around each step's attention over a block (``attention``:
    ``(action, start, end)`` in the clock's marks)."""

    def __init__(self, current_action: Callable[[], object], mark: Callable[[], object] = time.perf_counter) -> None:
        super().__init__(current_action, mark)
        self.attention: list[tuple[object, object, object]] = []

    def computing(self) -> AbstractContextManager[None]:
        return self._recorded(self.attention)

    def take_attention(self) -> list[tuple[object, object, object]]:
        """The attention intervals recorded since the last call."""
        return self._drained("attention")


class TimedAllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with autograd (the backward trades the gradients back
    with the splits swapped, as ``torch.distributed.nn.functional.all_to_all_single``),
    each direction timed by ``timer`` when one is given."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, received: int, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup, timer: CollectiveTimer | None) -> torch.Tensor:
        ctx.shape, ctx.splits, ctx.group, ctx.timer = rows.shape, (out_splits, in_splits), group, timer
        return _exchange(rows.contiguous(), received, out_splits, in_splits, group, timer)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = _exchange(grad.contiguous(), ctx.shape[0], in_splits, out_splits, ctx.group, ctx.timer)
        return back, None, None, None, None, None


def _exchange(rows: torch.Tensor, received: int, out_splits: list[int], in_splits: list[int],
              group: dist.ProcessGroup, timer: CollectiveTimer | None) -> torch.Tensor:
    """One all-to-all of ``rows``: ``in_splits`` rows to each member, ``out_splits`` from each."""
    output = rows.new_empty((received, *rows.shape[1:]))
    with timer.timed() if timer is not None else nullcontext():
        dist.all_to_all_single(output, rows, out_splits, in_splits, group=group)
    return output


def timed_all_to_all(rows: torch.Tensor, received: int, out_splits: list[int], in_splits: list[int],
                     group: dist.ProcessGroup, timer: CollectiveTimer | None = None) -> torch.Tensor:
    """Send ``rows`` (``in_splits`` to each member of ``group``) and return the
    ``received`` rows that come back (``out_splits`` from each), differentiably."""
    return TimedAllToAll.apply(rows, received, out_splits, in_splits, group, timer)
