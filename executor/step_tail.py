"""The work of a step after its pipeline, timed and drawn: what the executor does once
the schedule's last action is done (the tied embeddings' gradient all-reduce, the
gradient norm's all-reduce and the optimizer step, the expert-load all-reduce, the loss
all-reduce), as Trace events. Without them a measured chart drew this stretch as the
rank idling (``viz.lanes.idle_tails``), though the rank was working or waiting in a
collective.

The simulator charges the same stretch as an ``OPTIMIZER`` event on the ``step`` stream
(``Costs.step_overhead``, which a profile measures as this whole tail), after a tied
model's ``EMBEDDING_ALLREDUCE`` and the gradient norm's ``GRAD_NORM_ALLREDUCE`` where it
prices them from a model (``Costs.embedding_sums``, ``Costs.grad_norm_overhead``);
the executor's events keep every part apart, named by what they do, on the same ``step``
stream (the tied embeddings' all-reduce too: it is no data-parallel traffic, and a ``dp``
event would read as dp communication in a run without dp).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from schedules.accounting import GRAD_NORM_ALLREDUCE
from schedules.trace import TraceEvent

if TYPE_CHECKING:  # torch is loaded by the run, not by a reader of these names (pipesim compare, run_costs)
    from executor.clock import CpuClock, CudaClock

EMBEDDING_ALLREDUCE = "EMBEDDING_ALLREDUCE"  # a tied model's two table copies' gradients summed
OPTIMIZER = "OPTIMIZER"  # named as the simulator names its step_overhead event
EXPERT_LOAD_ALLREDUCE = "EXPERT_LOAD_ALLREDUCE"  # DeepSeek-V3's balancing: the experts' loads summed
LOSS_ALLREDUCE = "LOSS_ALLREDUCE"  # the replicas' losses summed, and read on the host
# every part on the step stream; the order is the encoding's (executor.gather)
TAIL_KINDS = (EMBEDDING_ALLREDUCE, GRAD_NORM_ALLREDUCE, OPTIMIZER, EXPERT_LOAD_ALLREDUCE, LOSS_ALLREDUCE)
TAIL_STREAM = "step"


def tail_event(rank: int, kind: str, start: float, end: float) -> TraceEvent:
    """One part of the step's tail, as the simulator names its own: ``OPTIMIZER``."""
    return TraceEvent(rank, kind, kind, -1, -1, start, end, TAIL_STREAM)


def split_joining_waits(events: list[TraceEvent]) -> list[TraceEvent]:
    """The ranks' events with each gradient-norm all-reduce cut where the last traced rank
    joined it: before, the rank waiting for the others (a ``wait`` event of the same kind,
    which ``schedules.accounting`` counts as bubble, the pipeline draining), after, the
    collective itself on the ``step`` stream, as the simulator draws them
    (``pipesim.sim.parallel.step_tail_columns``). The events must share one timeline
    (``executor.clock.shared_clock``); a rank of another replica that joined later is not
    in the trace, so the waits drawn are the least the ranks waited."""
    norms = [event for event in events if event.kind == GRAD_NORM_ALLREDUCE and event.stream == TAIL_STREAM]
    if len(norms) < 2:
        return events
    joined = max(event.start for event in norms)
    result = []
    for event in events:
        if event.kind == GRAD_NORM_ALLREDUCE and event.stream == TAIL_STREAM and event.start < joined:
            result.append(event._replace(end=min(joined, event.end), stream="wait"))
            if event.end > joined:
                result.append(event._replace(start=joined))
        else:
            result.append(event)
    return result


class StepTail:
    """Marks around each part of the tail on the step's clock; ``events`` once the step
    is done (on a GPU after a synchronisation: the marks are CUDA events on the current
    stream, which is where the optimizer and these collectives run)."""

    def __init__(self, clock: CpuClock | CudaClock) -> None:
        self.clock = clock
        self.marks: list[tuple[str, object, object]] = []

    @contextlib.contextmanager
    def timing(self, kind: str) -> Iterator[None]:
        start = self.clock.mark()
        yield
        self.marks.append((kind, start, self.clock.mark()))

    def events(self, rank: int) -> list[TraceEvent]:
        """This step's parts as events, and the marks cleared for the next step."""
        device = getattr(self.clock, "device", None)  # a CudaClock's
        if device is not None and self.marks:
            import torch  # noqa: PLC0415 - loaded by the run already

            torch.cuda.synchronize(device)
        events = [tail_event(rank, kind, self.clock.seconds(start), self.clock.seconds(end))
                  for kind, start, end in self.marks]
        self.marks = []
        return events
