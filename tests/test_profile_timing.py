"""How the profile turns timings into costs, on a clock the test controls: the time
budget of a timing loop, and the median of round means setting a slow round aside.
One process, no process group."""

from __future__ import annotations

import time

import pytest
import torch

import executor.profile as profile_module
from executor.config import RunConfig
from executor.estimate import ROUNDS
from executor.models import build_model
from executor.profile import StageProbe, time_stages


class SteppingClock:
    """A clock that advances by ``tick`` seconds at every reading, ``slow`` times as
    much while ``slow_now()`` says so; counts its readings."""

    def __init__(self, tick: float) -> None:
        self.tick, self.now, self.readings, self.slow = tick, 0.0, 0, 1.0

    def __call__(self) -> float:
        self.readings += 1
        self.now += self.tick * self.slow
        return self.now


@pytest.fixture
def probes():
    config = RunConfig(pp=2, microbatches=2, model="mlp", layers=2, hidden=8, batch_size=4)
    model = build_model(config)
    return {stage: StageProbe(model, model.build_stage(stage, 2), stage, 2, config, torch.device("cpu"))
            for stage in (0, 1)}


def test_forward_backward_loop_runs_for_its_repeats_and_its_time_budget(probes, monkeypatch):
    clock = SteppingClock(0.001)  # every pass reads the clock 3 times: F = B = 1 ms
    monkeypatch.setattr(profile_module, "clock_for_compute", lambda device, kind="thread": clock)
    forward, backward = probes[0].time_forward_backward(torch.device("cpu"), warmup=2, repeats=3, min_time=0.0)
    assert forward == pytest.approx(0.001) and backward == pytest.approx(0.001)
    assert clock.readings == 3 * (2 + 3)  # repeats alone decide when there is no time budget

    clock.readings = 0
    probes[0].time_forward_backward(torch.device("cpu"), warmup=2, repeats=3, min_time=0.05)
    assert clock.readings == 3 * (2 + 25)  # 2 ms of timed work per pass: 25 passes make 50 ms


def test_a_slow_round_does_not_set_the_cost(probes, monkeypatch):
    clock = SteppingClock(0.001)
    monkeypatch.setattr(profile_module, "clock_for_compute", lambda device, kind="thread": clock)
    original = StageProbe.time_forward_backward
    rounds_seen = []

    def one_round(self, *args, **kwargs):
        rounds_seen.append(self)
        # the third round of every stage runs 5x slow, as in a slow spell of the machine
        clock.slow = 5.0 if len(rounds_seen) in (5, 6) else 1.0
        return original(self, *args, **kwargs)

    monkeypatch.setattr(StageProbe, "time_forward_backward", one_round)
    measured = time_stages(probes, torch.device("cpu"), warmup=1, repeats=10, min_time=0.0)
    # rounds take turns between the stages: 0, 1, 0, 1, ...
    assert rounds_seen == [probes[0], probes[1]] * ROUNDS
    for stage in (0, 1):
        assert measured[stage]["F"] == pytest.approx(0.001)
        assert measured[stage]["B"] == pytest.approx(0.001)
        assert measured[stage]["param_bytes"] > 0


def test_the_wall_clock_counts_time_off_the_core_and_the_thread_clock_does_not():
    # a compute that waits (as one does while another process holds its core) for 20 ms
    from executor.profile import mean_seconds  # noqa: PLC0415

    def waits() -> None:
        time.sleep(0.02)

    cpu = torch.device("cpu")
    assert mean_seconds(waits, cpu, warmup=0, repeats=2, clock="wall") >= 0.02
    assert mean_seconds(waits, cpu, warmup=0, repeats=2, clock="thread") < 0.01
    with pytest.raises(ValueError, match="compute clock must be one of thread, wall, got 'cpu'"):
        profile_module.clock_for_compute(cpu, "cpu")
