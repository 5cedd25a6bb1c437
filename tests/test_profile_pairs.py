"""``pipesim profile`` times DualPipeV's overlapped pairs as the executor runs them and
writes each pair's seconds as ``overlap_fb`` of its forward stage, with its factor (the
pair over its halves' own F + B) beside it; the calibration steps of ``--calibration
run`` read the same from the pairs they ran. On a CPU the halves run one after the
other, so the factor is about 1."""

from __future__ import annotations

import json

import pytest
import torch

from executor.config import RunConfig
from executor.models import build_model
from executor.pair_timing import pair_factor, stage_pairs, time_pair
from executor.profile import StageProbe
from executor.run_costs import pair_seconds, run_costs
from pipesim.cli import main
from pipesim.cluster.topology import ideal_topology
from pipesim.model.costs import costs_from_dict, load_costs
from pipesim.sim.step import run_simulation
from schedules.generators import generate
from schedules.trace import Trace, TraceEvent
from tests.test_profile_timing import SteppingClock

DUALPIPEV = ["--schedule", "dualpipev", "--pp", "2", "--microbatches", "4", "--model", "mlp", "--layers", "4",
             "--hidden", "512", "--batch-size", "64"]  # milliseconds a pair: timing noise small beside it


def test_each_rank_pairs_its_two_chunks_each_way_round() -> None:
    schedule = generate("dualpipev", 2, 8, 2)  # V placement: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
    assert stage_pairs(schedule, 0) == [(0, 3), (3, 0)]
    assert stage_pairs(schedule, 1) == [(1, 2), (2, 1)]
    assert stage_pairs(generate("1f1b", 2, 4), 0) == []


def test_a_pair_is_timed_from_before_its_forward_to_after_its_backward() -> None:
    config = RunConfig(pp=2, microbatches=2, model="mlp", layers=2, hidden=8, batch_size=4)
    model = build_model(config)
    cpu = torch.device("cpu")
    probes = {stage: StageProbe(model, model.build_stage(stage, 2), stage, 2, config, cpu) for stage in (0, 1)}
    clock = SteppingClock(0.004)  # two readings a pair: 4 ms each, whatever ran between them
    assert time_pair(probes[0], probes[1], cpu, clock, warmup=2, repeats=3) == pytest.approx(0.004)
    assert clock.readings == 2 * (2 + 3)
    # the backward half ran: the last stage's parameters got gradients, the forward half's did not
    assert all(p.grad is not None for p in probes[1].params)
    assert all(p.grad is None for p in probes[0].params)


def test_the_factor_is_the_pair_over_its_halves_alone() -> None:
    assert pair_factor(3.0, 1.0, 2.0) == 1.0
    assert pair_factor(2.4, 1.0, 2.0) == pytest.approx(0.8)
    assert pair_factor(0.5, 0.0, 0.0) == 1.0


def test_calibration_steps_read_a_pair_from_its_forward_start_to_its_backward_end() -> None:
    schedule = generate("dualpipev", 2, 4, 2)
    (forward, backward), *_ = schedule.fused_pairs(0)
    events = [TraceEvent.of(0, forward, 1.0, 1.5, "compute"), TraceEvent.of(0, backward, 1.5, 2.5, "compute")]
    assert pair_seconds(schedule, Trace(events)) == {forward.stage: pytest.approx(1.5)}


@pytest.mark.timeout(120)
def test_profile_writes_each_pairs_seconds_and_factor_and_the_file_round_trips(tmp_path, capsys) -> None:
    path = tmp_path / "costs.json"
    assert main(["profile", *DUALPIPEV, "--warmup", "1", "--repeats", "5", "--min-time", "0.02", "--quiet",
                 "--out", str(path)]) == 0
    printed = capsys.readouterr().out
    written = json.loads(path.read_text())
    assert written["pairs_overlap"] is False  # gloo on a CPU: the halves ran one after the other
    pairs = written["meta"]["measured"]["pairs"]
    by_stage = {entry["stage"]: entry for entry in written["stages"]}
    assert sorted(pairs) == ["0", "1", "2", "3"]
    for stage, pair in pairs.items():
        forward, backward = by_stage[int(stage)], by_stage[pair["backward_stage"]]
        assert pair["backward_stage"] == 3 - int(stage)  # the rank's other chunk
        assert forward["overlap_fb"] == pair["seconds"] > 0
        assert pair["factor"] == pytest.approx(pair["seconds"] / (forward["fwd"] + backward["bwd"]), rel=1e-12)
        # one half after the other: about their own F + B (timing noise on a shared CPU either way)
        assert 0.5 < pair["factor"] < 2.0, pairs
        assert f"pair F{stage} + B{pair['backward_stage']}: " in printed
    costs = load_costs(path, 4)
    assert [stage.overlap_fb for stage in costs.stages] == [by_stage[s]["overlap_fb"] for s in range(4)]
    assert costs.pairs_overlap is False
    assert costs_from_dict(json.loads(json.dumps(costs.to_dict())), 4) == costs
    # where the halves overlap (two CUDA streams), the simulator charges the measured pair
    together = costs_from_dict({**written, "pairs_overlap": True}, 4)
    schedule = generate("dualpipev", 2, 4, 2)
    trace = run_simulation(schedule, together, ideal_topology(2)).trace
    timed = {(event.rank, event.action): event for event in trace.events if event.stream == "compute"}
    for rank in (0, 1):
        for forward, backward in schedule.fused_pairs(rank):
            span = timed[rank, str(forward)].duration + timed[rank, str(backward)].duration
            assert span == pytest.approx(by_stage[forward.stage]["overlap_fb"] + together.action_overhead)


def test_the_costs_of_calibration_steps_carry_the_pairs_they_ran() -> None:
    schedule = generate("dualpipev", 2, 4, 2)
    events, now = [], {0: 0.0, 1: 0.0}
    for rank in (0, 1):
        for action in schedule.programs[rank]:
            if action.kind in ("F", "B"):
                seconds = 1.0 if action.kind == "F" else 2.0
                events.append(TraceEvent.of(rank, action, now[rank], now[rank] + seconds, "compute"))
                now[rank] += seconds
    trace = Trace(events, meta={"pairs_overlap": False})
    document = run_costs(schedule, [trace], [max(now.values())])
    assert document["pairs_overlap"] is False
    assert [entry["overlap_fb"] for entry in document["stages"]] == pytest.approx([3.0] * 4)  # F 1 s + B 2 s
