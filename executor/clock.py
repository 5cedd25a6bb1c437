"""Timing of actions: a monotonic clock on CPU, CUDA events on GPU.

On a GPU the host runs ahead of the kernels it launches, so host time would measure
launches, not work; events recorded on the stream and resolved after the step measure
the work itself. Both clocks hand out opaque marks that become seconds since the step
began only in ``seconds``, after the step is over.

**One timeline for the job** (``shared_clock``, ``earliest_start``, ``shifted``): each
rank's marks count from its own step start, taken when it left the step's barrier, and
ranks leave a gloo barrier up to about 0.7 ms apart. Drawn from their own zeros, the
ranks' timelines then disagreed by that much: a receive's wait ended before its send
was posted (-0.39 to -0.69 ms in 2-rank runs). When every rank reads one
``perf_counter`` (CPU ranks on one host), the worker puts every rank's events on the
earliest rank's start and the step's time runs from there, so the Trace is one
timeline and the step's time the span every rank's work took. CUDA events, and ranks on
several hosts, keep each rank's own zero.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from schedules.trace import TraceEvent


class CpuClock:
    """``time.perf_counter``: monotonic and shared by every process on one machine."""

    def start_step(self) -> None:
        self.origin = time.perf_counter()

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, mark: Any) -> float:
        return mark - self.origin


class CudaClock:
    """CUDA events on the current stream; ``seconds`` synchronises once per step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start_step(self) -> None:
        self.origin = self.mark()
        self.synced = False

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark: Any) -> float:
        if not self.synced:
            torch.cuda.synchronize(self.device)
            self.synced = True
        return self.origin.elapsed_time(mark) / 1000.0


def clock_for(device: torch.device) -> CpuClock | CudaClock:
    """The clock that measures work on ``device``."""
    return CudaClock(device) if device.type == "cuda" else CpuClock()


def shared_clock(device: torch.device, world: int) -> bool:
    """Whether every rank of the job reads the same ``perf_counter``: CPU ranks, all on
    this host (a collective: every rank calls it, once)."""
    if world < 2 or device.type == "cuda":
        return False
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    return len(set(hosts)) == 1


def earliest_start(started: float) -> float:
    """The earliest of the ranks' step starts (``perf_counter`` readings; a collective)."""
    value = torch.tensor([started], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return float(value.item())


def shifted(events: list[TraceEvent], seconds: float) -> list[TraceEvent]:
    """``events`` ``seconds`` later: a rank's events, counted from its own start, on a
    timeline that starts ``seconds`` before it."""
    return [event._replace(start=event.start + seconds, end=event.end + seconds) for event in events]
