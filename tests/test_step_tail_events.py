"""The work after a step's pipeline (the tied embeddings' all-reduce, the gradient norm's,
the optimizer step, the loss all-reduce) is timed and drawn as what it is, not as the
rank idling: events on the ``step`` stream, the simulator's for its step overhead, that
travel through the ranks' gather and are kept out of the calibration's tail."""

from __future__ import annotations

import pytest

from executor.gather import decode, encode
from executor.run_costs import step_tail
from executor.step_tail import (
    EMBEDDING_ALLREDUCE,
    GRAD_NORM_ALLREDUCE,
    LOSS_ALLREDUCE,
    OPTIMIZER,
    TAIL_KINDS,
    split_joining_waits,
    tail_event,
)
from pipesim.model.spec import BUNDLED_CONFIGS
from schedules.accounting import time_accounting
from schedules.generators import generate
from schedules.lowering import lower
from schedules.trace import Trace, TraceEvent

QWEN3_TIED = str(BUNDLED_CONFIGS / "qwen3-0.6b.json")


def test_tail_events_travel_through_the_gather() -> None:
    program = lower(generate("1f1b", 2, 2, 1)).programs[0]
    events = [TraceEvent.of(0, program[0], 0.0, 1.0, "compute"),
              *(tail_event(0, kind, 2.0 + index, 2.5 + index) for index, kind in enumerate(TAIL_KINDS))]
    assert decode(0, program, encode(program, events)) == events


def test_the_calibrations_tail_starts_where_the_pipeline_ends() -> None:
    schedule = lower(generate("1f1b", 1, 1, 1))
    compute = TraceEvent.of(0, schedule.programs[0][0], 0.0, 1.0, "compute")
    trace = Trace([compute, tail_event(0, OPTIMIZER, 1.2, 1.5), tail_event(0, LOSS_ALLREDUCE, 1.5, 1.9)], {})
    # everything after the pipeline's last event, the tail's own events included
    assert step_tail(schedule, trace, 2.0, 0.0, 0.0) == pytest.approx(1.0)


@pytest.mark.timeout(120)
def test_a_tied_clipped_run_draws_its_tail() -> None:
    from executor.config import RunConfig
    from executor.launch import launch

    config = RunConfig(model=QWEN3_TIED, pp=2, layers=4, hidden=32, heads=4, seq_len=16, vocab=64, batch_size=4,
                       microbatches=2, steps=2, clip_grad=1.0)
    (result,) = launch(config)
    trace = result["trace"]
    for rank in (0, 1):
        tail = [event for event in trace.events if event.rank == rank and event.stream == "step"]
        assert [event.kind for event in tail] == [EMBEDDING_ALLREDUCE, GRAD_NORM_ALLREDUCE, OPTIMIZER, LOSS_ALLREDUCE]
        pipeline_end = max(event.end for event in trace.events if event.rank == rank and event.kind not in TAIL_KINDS)
        assert tail[0].start >= pipeline_end  # after the rank's last action
        assert all(before.end <= after.start for before, after in zip(tail, tail[1:], strict=False))
        if rank == 0:  # its step's time (the one reported) ends with its loss all-reduce
            assert tail[-1].end <= result["step_times"][-1] + 1e-9


def test_the_norms_all_reduce_is_cut_where_the_last_rank_joined() -> None:
    # rank 1 enters at 3.0 and rank 0 at 5.0; both leave at 5.5: rank 1 waited 3.0..5.0 for rank 0
    events = [tail_event(0, GRAD_NORM_ALLREDUCE, 5.0, 5.5), tail_event(1, GRAD_NORM_ALLREDUCE, 3.0, 5.5),
              tail_event(1, OPTIMIZER, 5.5, 6.0)]
    cut = split_joining_waits(events)
    assert sorted((event.rank, event.stream, event.start, event.end) for event in cut if event.kind != OPTIMIZER) == [
        (0, "step", 5.0, 5.5), (1, "step", 5.0, 5.5), (1, "wait", 3.0, 5.0)]
    # the wait is the drain's bubble, the collective and the optimizer the step's
    program = lower(generate("1f1b", 2, 2, 1)).programs[1]
    compute = TraceEvent.of(1, program[0], 0.0, 3.0, "compute")
    times = time_accounting(Trace([compute, *cut], {}))
    assert times[1].bubble == pytest.approx(2.0) and times[1].optimizer == pytest.approx(1.0)
    assert split_joining_waits(events[:1]) == events[:1]  # one rank: nothing to wait for


@pytest.mark.timeout(120)
def test_a_clipped_pipeline_draws_the_wait_for_the_last_rank_as_a_wait() -> None:
    from executor.config import RunConfig
    from executor.launch import launch

    config = RunConfig(model="llama3-8b", pp=2, layers=2, hidden=32, heads=4, kv_heads=2, seq_len=16, vocab=64,
                       batch_size=4, microbatches=2, steps=2, clip_grad=1.0)
    (result,) = launch(config)
    trace = result["trace"]
    norms = [event for event in trace.events if event.kind == GRAD_NORM_ALLREDUCE]
    on_step = [event for event in norms if event.stream == "step"]
    assert sorted(event.rank for event in on_step) == [0, 1]
    joined = max(event.start for event in on_step)
    assert all(event.start == joined for event in on_step)  # the collective from the last rank's arrival
    for wait in (event for event in norms if event.stream == "wait"):
        assert wait.end == joined and wait.start < joined
