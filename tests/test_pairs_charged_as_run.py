"""The simulator charges an overlapped pair as the executor ran it: with costs whose
``pairs_overlap`` is false (the executor on a CPU runs the halves one after the other)
each half costs what it costs alone, whatever ``overlap_fb`` says and with its
all-to-alls held after it; ``pipesim compare`` sets that from the run."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pipesim.cli import main
from pipesim.cluster.presets import nvlink
from pipesim.cluster.topology import ideal_topology
from pipesim.model.costs import Costs, CostsError, StageCost, costs_from_dict, uniform_costs
from pipesim.sim.parallel import ParallelConfig
from pipesim.sim.step import run_simulation
from schedules.action import B, F
from schedules.generators import generate
from schedules.metrics import makespan
from schedules.schedule import Schedule


def one_rank_pair(overlap_fb: float, pairs_overlap: bool) -> tuple[Schedule, Costs]:
    """One rank holding stages 0 and 1 (F = 1 s, B = 2 s each), 0F1 and 0B0 overlapped."""
    program = [F(0, 0), F(1, 0), B(1, 0), F(0, 1), B(0, 0), F(1, 1), B(1, 1), B(0, 1)]
    schedule = Schedule(1, 2, (0, 0), [program], fused=(frozenset({4}),))
    costs = uniform_costs(2, 1.0, 2.0)
    stages = (dataclasses.replace(costs.stages[0], overlap_fb=overlap_fb), costs.stages[1])
    return schedule, dataclasses.replace(costs, stages=stages, pairs_overlap=pairs_overlap)


@pytest.mark.parametrize("overlap_fb", [0.0, 2.2, 3.5])
def test_halves_one_after_the_other_cost_f_plus_b_whatever_overlap_fb_says(overlap_fb):
    """Four forwards of 1 s and four backwards of 2 s back to back: 12 s, the pair's F 1 s
    and its B 2 s right after (overlapped, 2.2 s would make it 11.2 s)."""
    schedule, costs = one_rank_pair(overlap_fb, pairs_overlap=False)
    result = run_simulation(schedule, costs, ideal_topology(1))
    assert makespan(result.trace) == pytest.approx(12.0)
    by_action = {event.action: event for event in result.trace.events}
    assert by_action["0F1"].duration == pytest.approx(1.0)
    assert by_action["0B0"].duration == pytest.approx(2.0)
    assert by_action["0B0"].start == pytest.approx(by_action["0F1"].end)
    together, costs = one_rank_pair(2.2, pairs_overlap=True)
    assert run_simulation(together, costs, ideal_topology(1)).metrics.makespan == pytest.approx(11.2)


def test_halves_one_after_the_other_keep_their_all_to_alls():
    """DualPipeV pp 2 with MoE stages on ep 4: overlapped, a pair's forward hides its
    all-to-alls under the backward; one after the other, each paired half is held after
    it exactly as long as the same kind of action alone."""
    stage = StageCost(fwd=0.2e-3, bwd=0.4e-3, moe_layers=2, dispatch_bytes=72e6)
    schedule = generate("dualpipev", 2, 4, 2)
    results = {overlap: run_simulation(schedule, Costs(stages=(stage,) * 4, pairs_overlap=overlap), nvlink(),
                                       parallel=ParallelConfig(dp=4, ep=4)) for overlap in (True, False)}
    paired = {(a.stage, a.kind, a.microbatch) for rank in range(2) for pair in schedule.fused_pairs(rank)
              for a in pair}
    alone = {}
    held = {overlap: {} for overlap in results}
    for overlap, result in results.items():
        for event in result.trace.events:
            if event.stream == "ep":
                held[overlap][event.action] = event.duration
    for event in results[True].trace.events:
        key = (event.stage, event.kind, event.microbatch)
        if event.stream == "compute" and key not in paired and event.kind in "FB":
            alone[event.kind] = held[True][f"ALLTOALL_EP({event.stage}{event.kind}{event.microbatch})"]
    assert set(alone) == {"F", "B"}
    hidden = [key for key in paired if key[1] == "F"]
    assert hidden and all(f"ALLTOALL_EP({s}F{m})" not in held[True] for s, _, m in hidden)
    for stage_index, kind, microbatch in paired:
        assert held[False][f"ALLTOALL_EP({stage_index}{kind}{microbatch})"] == pytest.approx(alone[kind])
    assert results[False].metrics.makespan > results[True].metrics.makespan


def test_costs_files_keep_pairs_overlap_and_refuse_a_non_boolean():
    document = {"stages": [{"fwd": 1.0, "bwd": 2.0}], "pairs_overlap": False}
    costs = costs_from_dict(document, 2)
    assert costs.pairs_overlap is False
    assert costs_from_dict(costs.to_dict(), 2).pairs_overlap is False
    assert "pairs_overlap" not in uniform_costs(2, 1.0, 2.0).to_dict()  # the usual case left unwritten
    with pytest.raises(CostsError, match="^costs: 'pairs_overlap' must be true or false, got 'no'$"):
        costs_from_dict({**document, "pairs_overlap": "no"}, 2)


def test_simulate_refuses_a_costs_file_with_a_bad_pairs_overlap_in_one_line(tmp_path, capsys):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"stages": [{"fwd": 1, "bwd": 2}], "pairs_overlap": 1}))
    assert main(["simulate", "--schedule", "dualpipev", "--pp", "2", "-m", "4", "--costs", str(costs)]) == 2
    error = capsys.readouterr().err.strip()
    assert error == f"pipesim simulate: error: {costs}: 'pairs_overlap' must be true or false, got 1"


@pytest.mark.timeout(180)
def test_compare_on_gloo_charges_the_pairs_one_after_the_other(tmp_path):
    """A costs file saying an overlapped pair takes 10 s (overlap_fb): the run on gloo
    runs the halves one after the other, so the prediction charges F + B instead. Each
    rank computes 2 stages x 4 microbatches x (1 + 2) ms = 24 ms; with the 10 s pairs
    (3 per rank) it would be over 30 s."""
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"stages": [{"stage": s, "fwd": 1e-3, "bwd": 2e-3, "overlap_fb": 10.0}
                                            for s in range(4)]}))
    out = tmp_path / "compare.json"
    assert main(["compare", "--schedule", "dualpipev", "--pp", "2", "-m", "4", "--virtual-stages", "2",
                 "--model", "mlp", "--layers", "4", "--hidden", "16", "--batch-size", "8", "--steps", "2",
                 "--costs", str(costs), "--topology", "ideal", "--json", str(out), "--quiet"]) == 0
    predicted = json.loads(out.read_text())["predicted_step_time"]
    assert 24e-3 <= predicted < 0.1
