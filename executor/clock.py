"""Timing of actions: a monotonic clock on CPU, CUDA events on GPU.

On a GPU the host runs ahead of the kernels it launches, so host time would measure
launches, not work; events recorded on the stream and resolved after the step measure
the work itself. Both clocks hand out opaque marks that become seconds since the step
began only in ``seconds``, after the step is over.
"""

from __future__ import annotations

import time
from typing import Any

import torch


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
