"""Where the two halves of an overlapped forward-backward pair run (DualPipe's
``OVERLAP_F_B``): two CUDA streams on a GPU, one after the other on a CPU.

DualPipeV's steady state pairs the forward of one microbatch on one chunk with the
full backward of another microbatch on the rank's other chunk; the two are independent,
so on a GPU their kernels can share the device. The host still launches them in one
order (forward half, then backward half), and each half runs on its own *lane*:

- autograd runs a backward op on the stream its forward op ran on (torch's "stream
  semantics of backward passes"), so the backward half's lane is the one its
  microbatch's forward ran on, and the forward half takes the other lane;
- before the pair both lanes wait for the compute stream (lane 0), where the pair's
  received inputs were waited for; after it the compute stream waits for both lanes,
  so the pair's outputs are complete before any send is posted (P2P is posted on the
  compute stream only, never inside a half);
- a tensor made on one stream and used on another is handed over with
  ``Tensor.record_stream``, so the caching allocator does not give its memory to a
  new tensor while the other stream may still read it.

A CPU has no streams: the same lane bookkeeping runs and every stream operation is a
no-op, so the halves run one after the other in the order a GPU launches them (gloo's
collectives and torch's CPU kernels already use the cores; two threads would only
contend). ``overlaps`` says which of the two happened, and the simulator charges the
pair accordingly (``ParallelConfig.overlap_pairs``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from schedules.action import Action
from schedules.trace import TraceEvent

Key = tuple[int, int]  # (stage, microbatch)
COMPUTE_LANE = 0  # the device's current stream: every action outside a pair runs here


def pairs_overlap_on(backend: str) -> bool:
    """Whether a run on ``backend`` (resolved) overlaps a pair's halves: NCCL ranks run on
    CUDA devices, whose streams do; gloo ranks run on the CPU (``executor.process.init_rank``
    picks the device by backend), one half after the other."""
    return backend == "nccl"


@dataclass(frozen=True)
class OverlappedPair:
    """A forward and the backward it overlaps, run as one step of the program."""

    forward: Action
    backward: Action


def with_pairs(items: list, pairs: dict[Action, Action]) -> list:
    """The program's items with each overlapped pair's forward and backward (adjacent:
    ``schedules.overlap.keep_pairs_together``) replaced by one ``OverlappedPair``."""
    result: list = []
    index = 0
    while index < len(items):
        item = items[index]
        backward = pairs.get(item) if isinstance(item, Action) else None
        if backward is None:
            result.append(item)
            index += 1
            continue
        if index + 1 >= len(items) or items[index + 1] != backward:
            raise ValueError(f"overlapped pair ({item};{backward}) is not adjacent in the program: a transfer "
                             f"or action between the two halves would run inside the pair")
        result.append(OverlappedPair(item, backward))
        index += 2
    return result


class PairLanes:
    """The lanes (streams) of a rank's overlapped pairs, and which lane each
    microbatch's forward ran on, step by step."""

    def __init__(self, device: torch.device) -> None:
        self.overlaps = device.type == "cuda"
        self.streams: tuple = (None, None)
        if self.overlaps:
            self.streams = (torch.cuda.current_stream(device), torch.cuda.Stream(device))
        self.forward_lane: dict[Key, int] = {}

    def start_step(self) -> None:
        self.forward_lane = {}

    def assign(self, pair: OverlappedPair) -> tuple[int, int]:
        """The (forward, backward) lanes of ``pair``: the backward where its forward ran
        (autograd puts it there), the forward on the other lane."""
        backward_lane = self.forward_lane.pop((pair.backward.stage, pair.backward.microbatch), COMPUTE_LANE)
        forward_lane = 1 - backward_lane
        self.forward_lane[(pair.forward.stage, pair.forward.microbatch)] = forward_lane
        return forward_lane, backward_lane

    def fork(self) -> None:
        """Both lanes wait for the compute stream: the pair's inputs are ready there."""
        compute, side = self.streams
        if self.overlaps:
            side.wait_stream(compute)

    def join(self) -> None:
        """The compute stream waits for both lanes: the pair's outputs are complete
        before the next action or send on it."""
        compute, side = self.streams
        if self.overlaps:
            compute.wait_stream(side)

    def hand_over(self, tensors: Iterable[torch.Tensor | None], lane: int) -> None:
        """Tell the allocator that ``lane`` uses these tensors (made on another stream):
        their memory is not reused before the lane's work queued so far is done."""
        stream = self.streams[lane]
        if stream is None:
            return
        for tensor in tensors:
            if tensor is not None and tensor.is_cuda:
                tensor.record_stream(stream)

    @contextmanager
    def on(self, lane: int) -> Iterator[None]:
        """Run what is launched inside on ``lane``'s stream (nothing to switch on a CPU)."""
        stream = self.streams[lane]
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            yield


def pair_events(forward: TraceEvent, backward: TraceEvent) -> tuple[TraceEvent, TraceEvent]:
    """The Trace's two bars of a pair whose halves were timed on their own lanes. Run
    one after the other (a CPU), they are kept as measured. Overlapped (two streams),
    the pair occupied the rank from the first start to the last end; that span is
    shared between the halves in proportion to their own times, forward first, as the
    simulator draws a pair (``pipesim.sim.overlap``), so the rank's busy time is the
    span once, not both halves counted over each other."""
    if forward.end <= backward.start or backward.end <= forward.start:
        return forward, backward
    start, end = min(forward.start, backward.start), max(forward.end, backward.end)
    total = forward.duration + backward.duration
    split = start + (end - start) * (forward.duration / total if total > 0 else 0.5)
    return forward._replace(start=start, end=split), backward._replace(start=split, end=end)
