"""Timing FSDP2's own collectives (``--zero 3``), so that a ZeRO-3 step's Trace shows its
parameter all-gathers and gradient reduce-scatters on the ``dp`` stream, named and
placed as the simulator places them (``pipesim.sim.parallel``: ``ALLGATHER_PARAMS`` before
each layer's forward and backward, ``REDUCE_SCATTER_DP`` after each layer's backward).

FSDP2 lets a unit's collectives be replaced (``FSDPModule.set_custom_all_gather`` and
``set_custom_reduce_scatter``, added by pytorch/pytorch#155189 in mid-2025);
``time_unit`` hands each unit wrappers that call torch's default collective and mark the
runtime's clock around it.

Where the time goes: FSDP2 issues both collectives with ``async_op=False`` (the executor never asks for
an asynchronous unshard). On gloo that call blocks the rank until the collective is done,
so the interval from issue to return is the time the rank was held. On a GPU FSDP2 calls
them inside ``torch.cuda.stream`` of its all-gather or reduce-scatter stream, so the
clock's marks (CUDA events on the current stream, ``executor.clock``) land on the stream
the collective runs on and time the collective there, as ``executor.inside_timing`` times
the tp, ep and cp collectives on theirs (written for CUDA and not run here: no GPU). Were
a collective issued asynchronously, the interval would cover its issue only (the wait is
in FSDP's copy-out, which offers no hook).

Every one of these collectives runs inside a compute action (a block's pre-forward and
pre-backward hooks, its post-backward, and the root's callback at the end of the
backward call), and the action it serves is the one the runtime is running when it is
issued. As with tp, ep and cp, they are held collectives inside the action: the compute
event keeps its whole measured span and the ``dp`` event marks the part of it the
collective took, so nothing is counted twice (``schedules.accounting`` gives the overlap
to compute, as it does for the simulator's ZeRO-3 gathers inside the actions that wait
for them).

Units: block ``i`` of a stage is ``L{i}`` (a routed expert of that block, its own unit
under expert parallelism, too), the stage itself (embedding, final norm, head) ``root``.
On a torch without the hooks the units are left as they are and nothing is drawn.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from executor.data_parallel import PARAM_GATHER, REDUCE_SCATTER

try:  # torch with FSDP2's comm hooks: the interfaces set_custom_all_gather/set_custom_reduce_scatter take
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
except ImportError:  # older torch: FSDP's collectives are not drawn
    AllGather = ReduceScatter = None

# (kind, stage, unit, action, start mark, end mark)
Interval = tuple[str, int, int, object, object, object]


class FsdpTimer:
    """Records every FSDP collective of this rank as ``(kind, stage, unit, action, start,
    end)``, ``action`` the one the runtime runs when it is issued, the marks the runtime
    clock's."""

    def __init__(self, current_action: Callable[[], object], mark: Callable[[], object] = time.perf_counter) -> None:
        self.current_action, self.mark = current_action, mark
        self.intervals: list[Interval] = []

    def take(self) -> list[Interval]:
        """The intervals recorded since the last call."""
        taken, self.intervals = self.intervals, []
        return taken

    def timed(self, kind: str, stage: int, unit: int, call: Callable[[], object]) -> object:
        """``call()``, its interval recorded under ``kind``, ``stage`` and ``unit``."""
        start = self.mark()
        result = call()
        self.intervals.append((kind, stage, unit, self.current_action(), start, self.mark()))
        return result


def hooks_available(unit: nn.Module) -> bool:
    """Whether this torch lets a unit's collectives be replaced (FSDP2's comm hooks)."""
    return AllGather is not None and all(hasattr(unit, hook) for hook in ("set_custom_all_gather",
                                                                          "set_custom_reduce_scatter"))


if AllGather is not None:
    class TimedAllGather(AllGather):
        """torch's default all-gather of a unit, timed by ``timer``."""

        def __init__(self, timer: FsdpTimer, stage: int, unit: int) -> None:
            self.inner, self.timer, self.stage, self.unit = DefaultAllGather(), timer, stage, unit

        def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                     async_op: bool = False):
            return self.timer.timed(PARAM_GATHER, self.stage, self.unit,
                                    lambda: self.inner(output_tensor, input_tensor, group, async_op))

    class TimedReduceScatter(ReduceScatter):
        """torch's default reduce-scatter of a unit's gradients, timed by ``timer``."""

        def __init__(self, timer: FsdpTimer, stage: int, unit: int) -> None:
            self.inner, self.timer, self.stage, self.unit = DefaultReduceScatter(), timer, stage, unit

        def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                     op, async_op: bool = False):
            return self.timer.timed(REDUCE_SCATTER, self.stage, self.unit,
                                    lambda: self.inner(output_tensor, input_tensor, group, op, async_op))


def time_unit(unit: nn.Module, timer: FsdpTimer | None, stage: int, index: int) -> None:
    """Have FSDP unit ``unit`` (block ``index`` of ``stage``, or its root) run its
    collectives through ``timer``; nothing without a timer or on a torch without the hooks."""
    if timer is None or not hooks_available(unit):
        return
    unit.set_custom_all_gather(TimedAllGather(timer, stage, index))
    unit.set_custom_reduce_scatter(TimedReduceScatter(timer, stage, index))
