"""Costs files that hold the split backward as measured (I and W apart from B), and the
runtime's per-action overheads, against hand-computed steps."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipesim.cluster.topology import ideal_topology
from pipesim.model.costs import Costs, CostsError, StageCost, costs_from_dict, load_costs, uniform_costs
from pipesim.sim.engine import simulate
from schedules import generate, step_metrics
from schedules.action import parse_action
from schedules.schedule import Schedule

seconds = st.floats(min_value=1e-6, max_value=10.0, allow_nan=False)


@given(fwd=seconds, bwd=seconds, igrad=seconds, wgrad=seconds)
def test_a_costs_file_round_trips_distinct_i_and_w(fwd, bwd, igrad, wgrad):
    costs = Costs(stages=(StageCost(fwd=fwd, bwd=bwd, igrad=igrad, wgrad=wgrad, act_bytes=64.0),) * 2)
    again = costs_from_dict(json.loads(json.dumps(costs.to_dict())), 2)
    assert again == costs
    stage = again.stages[1]
    assert (stage.seconds("F"), stage.seconds("B"), stage.seconds("I"), stage.seconds("W")) == (fwd, bwd, igrad, wgrad)


def test_an_older_costs_file_without_igrad_reads_i_as_what_w_leaves_of_b(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"stages": [{"fwd": 1.0, "bwd": 2.0, "wgrad": 0.5}]}))
    stage = load_costs(path, 1).stages[0]
    assert stage.igrad == 0.0
    assert stage.seconds("I") == 1.5 and stage.seconds("W") == 0.5


def test_w_may_exceed_b_only_when_i_is_measured_too():
    measured = costs_from_dict({"stages": [{"fwd": 1.0, "bwd": 1.0, "igrad": 0.9, "wgrad": 1.2}]}, 1)
    assert measured.stages[0].seconds("W") == 1.2
    with pytest.raises(CostsError, match=r"stages\[0\]: wgrad \(1.2\) is part of bwd \(1.0\).*igrad"):
        costs_from_dict({"stages": [{"fwd": 1.0, "bwd": 1.0, "wgrad": 1.2}]}, 1)
    with pytest.raises(CostsError, match=r"stages\[0\]\.igrad must be a finite number >= 0, got -1"):
        costs_from_dict({"stages": [{"fwd": 1.0, "bwd": 1.0, "igrad": -1, "wgrad": 0.2}]}, 1)


def test_a_rank_entry_splits_igrad_over_its_chunks():
    costs = costs_from_dict({"stages": [{"fwd": 2.0, "bwd": 4.0, "igrad": 3.0, "wgrad": 2.0}]}, 4,
                            virtual_stages=2)
    assert {stage.seconds("I") for stage in costs.stages} == {1.5}


def split_schedule() -> Schedule:
    """Two stages, one microbatch, the backward split: rank 1 runs I then W; rank 0's I
    waits for rank 1's I."""
    programs = ((parse_action("0F0"), parse_action("0I0"), parse_action("0W0")),
                (parse_action("1F0"), parse_action("1I0"), parse_action("1W0")))
    return Schedule(pp=2, microbatches=1, placement=(0, 1), programs=programs, name="split")


def test_the_simulator_runs_a_split_backward_with_the_measured_i_and_w():
    # I + W = 1.7 B, as the profile measures on small CPU stages
    stage0 = StageCost(fwd=1.0, bwd=2.0, igrad=1.5, wgrad=1.9)
    stage1 = StageCost(fwd=1.2, bwd=2.2, igrad=1.6, wgrad=2.1)
    trace = simulate(split_schedule(), Costs(stages=(stage0, stage1)), ideal_topology())
    # rank 1: F1 after F0, then I1, W1 -> 1.0 + 1.2 + 1.6 + 2.1 = 5.9
    # rank 0: I0 after I1 ends (1.0 + 1.2 + 1.6 = 3.8), then W0 -> 3.8 + 1.5 + 1.9 = 7.2
    assert step_metrics(trace).makespan == pytest.approx(7.2, rel=1e-12)
    # read the older way (I = B - W: 0.1 on both stages) the same step is predicted short:
    # rank 1 ends at 1.0 + 1.2 + 0.1 + 2.1 = 4.4, rank 0 at 2.3 + 0.1 + 1.9 = 4.3
    older = Costs(stages=(StageCost(fwd=1.0, bwd=2.0, wgrad=1.9), StageCost(fwd=1.2, bwd=2.2, wgrad=2.1)))
    assert step_metrics(simulate(split_schedule(), older, ideal_topology())).makespan == pytest.approx(4.4)


@pytest.mark.parametrize("pp,microbatches", [(2, 4), (4, 8)])
def test_each_compute_action_pays_the_action_overhead(pp, microbatches):
    # 1F1B with free links: (m + p - 1) (F + B); each F and each B starts a = 0.1 later
    # than its data allows, so each pays a once: (m + p - 1) (F + a + B + a)
    schedule = generate("1f1b", pp, microbatches)
    fwd, bwd, overhead = 1.0, 2.0, 0.1
    base = uniform_costs(schedule.num_stages, fwd, bwd)
    costs = Costs(stages=base.stages, action_overhead=overhead, step_overhead=0.3)
    makespan = step_metrics(simulate(schedule, costs, ideal_topology())).makespan
    assert makespan == pytest.approx((microbatches + pp - 1) * (fwd + bwd + 2 * overhead) + 0.3, rel=1e-12)
