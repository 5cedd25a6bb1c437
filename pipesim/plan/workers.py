"""The plan's worker processes and how its search hands them work: what runs in a
worker (a layout judged, screened or evaluated exactly, in turn over a group), how a
worker starts (the collector off, the search's layouts and its evaluator kept), and the
finalists' feeder, which gives each worker the next group of finalists as it runs out of
work.

A worker receives its evaluator once, when it starts: forked, the caller's own (its job,
cluster and routes already loaded); spawned, rebuilt from its job. Work is then sent as
the name of the evaluator's method to call (``screen``, ``evaluate``) and the layout's
place or the layout itself, never the evaluator again. Functions sent to a worker are
module-level: a process pool finds them by name.
"""

from __future__ import annotations

import gc
import math
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipesim.plan.layouts import Layout
    from pipesim.plan.search import Evaluator


def judge(evaluator: Evaluator, prune: bool, layout: Layout) -> tuple[str | None, float | None]:
    """The layout's cause to be rejected before simulation, or None and its lower bound (0
    without ``prune``: every layout is simulated)."""
    cause = evaluator.reject_cause(layout)
    if cause is not None:
        return cause, None
    return None, evaluator.lower_bound(layout) if prune else 0.0


class _Worker:
    """In a worker process: the layouts of the search it serves and its evaluator."""

    layouts: list = []
    evaluator: Evaluator | None = None


def start_worker(layouts: list[Layout], evaluator: Evaluator) -> None:
    """A worker's start: the collector off (``search``), the search's layouts kept, so that
    the first pass names them by their places (with fork, given without pickling), and the
    evaluator every call in this process uses."""
    gc.disable()
    _Worker.layouts = layouts
    _Worker.evaluator = evaluator


def judge_places(prune: bool, places: list[int]) -> list[tuple[str | None, float | None]]:
    """``judge`` of the worker's layouts at ``places``, in turn."""
    return [judge(_Worker.evaluator, prune, _Worker.layouts[place]) for place in places]


def each_of(method: str, layouts: list[Layout]) -> list:
    """The worker's evaluator's ``method`` of each of ``layouts``, in turn."""
    function = getattr(_Worker.evaluator, method)
    return [function(layout) for layout in layouts]


def timed_in_worker(method: str, layout: Layout, cutoff: float = math.inf) -> tuple[dict, float]:
    """``timed`` of the worker's evaluator's ``method`` of ``layout``."""
    return timed(getattr(_Worker.evaluator, method), layout, cutoff)


def timed(function: Callable[..., dict], *arguments) -> tuple[dict, float]:
    """``function(*arguments)`` and the seconds it took."""
    started = time.perf_counter()
    row = function(*arguments)
    return row, time.perf_counter() - started


def worker_context():
    """Forked workers where the platform has fork: they inherit the caller's evaluator (its
    job, topology and routes loaded) instead of rebuilding it, and functions are found by
    name. Elsewhere the platform's default."""
    if "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context()


class Feeder:
    """The finalists' exact evaluations, each handed to a worker as it runs out of work.

    What they cost is not known before (a cost-aware order's full search can take ten
    times its screen), so none is assigned ahead: whenever a worker has nothing left, it
    gets the next group, the heaviest first by what screening took. Finalists that differ
    only in their ZeRO stage go together (they share their order and its lowering). The
    finalists may be asked for while screens are still in flight (``want``, again as
    rows come in): one that drops out before it is handed over is never evaluated, one
    that drops out after was evaluated for nothing, which changes no result. ``refine``
    names the evaluator's method that evaluates a finalist exactly."""

    def __init__(self, refine: str, pools: list, waiting: list[list], seconds: dict[Layout, float]) -> None:
        self.refine, self.pools, self.waiting, self.seconds = refine, pools, waiting, seconds
        self.queue: list[list[Layout]] = []  # groups not yet handed over, heaviest first
        self.handed: dict[Layout, tuple] = {}  # finalist -> (its group's future, its place in it)
        self.running: list = [None] * len(pools)  # per worker, the future of the group it has

    def want(self, chosen: list[Layout]) -> None:
        """The finalists are ``chosen`` as far as is known now."""
        groups: dict[Layout, list[Layout]] = {}
        for layout in chosen:
            if layout not in self.handed:
                groups.setdefault(layout._replace(zero=0), []).append(layout)
        self.queue = sorted(groups.values(), key=lambda group: -sum(self.seconds.get(layout, 0.0)
                                                                     for layout in group))
        self._hand_over()

    def run_until(self, future) -> None:
        """Hand groups to workers that run out of work until ``future`` is done."""
        while not future.done():
            pending = [other for futures in self.waiting for other in futures if not other.done()]
            wait([*pending, *(group for group in self.running if group is not None)], return_when=FIRST_COMPLETED)
            self._hand_over()

    def results(self, chosen: list[Layout]) -> list[dict]:
        """The exact rows of ``chosen`` (all wanted), once every one is in."""
        while self.queue:
            wait([group for group in self.running if group is not None], return_when=FIRST_COMPLETED)
            self._hand_over()
        return [self.handed[layout][0].result()[self.handed[layout][1]] for layout in chosen]

    def _hand_over(self) -> None:
        for worker, pool in enumerate(self.pools):
            if not self.queue:
                return
            idle = (self.running[worker] is None or self.running[worker].done()) \
                and all(future.done() for future in self.waiting[worker])
            if idle:
                group = self.queue.pop(0)
                self.running[worker] = pool.submit(each_of, self.refine, group)
                self.handed.update({layout: (self.running[worker], index) for index, layout in enumerate(group)})


def default_workers() -> int:
    """Worker processes: the CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1
