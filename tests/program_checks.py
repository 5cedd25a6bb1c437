"""Checks shared by the executor tests: a measured Trace against the program it ran."""

from __future__ import annotations

from collections import Counter

from schedules.schedule import Schedule
from schedules.trace import Trace


def assert_each_rank_ran_its_program(schedule: Schedule, trace: Trace) -> None:
    """Every action of every rank's program ran and was timed once, and the compute
    actions ran in program order; after them, the step's close (``executor.step_tail``:
    at least the optimizer step and the loss all-reduce)."""
    for rank, program in enumerate(schedule.programs):
        events = [event for event in trace.of_rank(rank) if event.stream != "step"]
        tail = [event.action for event in trace.of_rank(rank) if event.stream == "step"]
        assert tail[-2:] == ["OPTIMIZER", "LOSS_ALLREDUCE"], (rank, tail)
        assert Counter(event.action for event in events) == Counter(str(action) for action in program), rank
        compute = [e.action for e in sorted(events, key=lambda e: e.start) if e.stream == "compute"]
        assert compute == [str(a) for a in program if a.is_compute], rank
