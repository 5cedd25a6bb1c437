"""An overlapped pair priced layer by layer, as Megatron-Core runs combined 1F1B
(``pipesim.sim.overlap``): per pair of a forward and a backward MoE layer, three phases
on a compute and a communication stream, each all-to-all beside only the part of the
other half that runs with it. Expected seconds worked out by hand."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipesim.model.costs import StageCost
from pipesim.sim.comm_overlap import overlapped_seconds
from pipesim.sim.overlap import HalfLayers, layered, layered_pair_seconds, two_streams
from schedules.action import ActionKind
from tests.cli_runs import simulate_json

seconds = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)


@given(seconds, seconds, st.floats(min_value=0.0, max_value=1.0))
def test_one_task_a_stream_is_the_overlap_rule(compute, comm, slowdown):
    assert two_streams([compute], [comm], slowdown) == pytest.approx(overlapped_seconds(compute, comm, slowdown),
                                                                     rel=1e-12, abs=1e-12)


tasks = st.lists(seconds, min_size=1, max_size=4)


@given(tasks, tasks, st.floats(min_value=0.0, max_value=1.0), st.data())
def test_two_streams_take_at_least_the_longer_stream_and_at_most_both_in_turn(compute, comm, slowdown, data):
    # any waits that point backwards in the other stream's order (they cannot form a cycle
    # when every compute waits on an earlier comm than any comm that waits on it)
    compute_waits = {i: data.draw(st.integers(0, len(comm) - 1)) for i in range(1, len(compute))
                     if data.draw(st.booleans())}
    comm_waits = {j: data.draw(st.integers(0, len(compute) - 1)) for j in range(1, len(comm))
                  if data.draw(st.booleans())}
    try:
        total = two_streams(compute, comm, slowdown, compute_waits, comm_waits)
    except ValueError as error:  # waits in a cycle: refused, never a wrong number
        assert "cycle" in str(error)
        return
    assert max(sum(compute), sum(comm)) - 1e-9 <= total <= sum(compute) + sum(comm) + 1e-9


forwards = st.builds(HalfLayers, st.integers(1, 4), seconds, seconds, seconds, seconds)  # nothing delayed
backwards = st.builds(HalfLayers, st.integers(1, 4), seconds, seconds, seconds, seconds, seconds)


@given(forwards, backwards, st.floats(min_value=0.0, max_value=1.0))
def test_a_pair_costs_its_compute_at_least_and_never_more_than_everything_in_turn(forward, backward, slowdown):
    compute = sum(half.layers * (half.attention + half.experts + half.delayed) for half in (forward, backward))
    exchanged = sum(half.layers * (half.first_all_to_all + half.second_all_to_all) for half in (forward, backward))
    total = layered_pair_seconds(forward, backward, slowdown)
    assert compute - 1e-9 <= total <= compute + exchanged + 1e-9


def test_waits_between_the_streams_by_hand():
    # compute 2 then 3, comm 1 then 4; the second compute waits for the first comm, the
    # second comm for the first compute. Without slowdown: comm 1 starts at 2, ends at 6
    assert two_streams([2, 3], [1, 4], 0.0, compute_waits={1: 0}, comm_waits={1: 0}) == pytest.approx(6.0)
    # slowdown 0.5: the first compute runs at 2/3 beside the first comm: 2/3 done at 1,
    # done at 7/3; the second comm 7/3 -> 19/3, the second compute beside it 8/3 of 3
    # done, the last 1/3 alone: 20/3
    assert two_streams([2, 3], [1, 4], 0.5, compute_waits={1: 0}, comm_waits={1: 0}) == pytest.approx(20 / 3)


def test_a_cycle_of_waits_is_an_error():
    with pytest.raises(ValueError, match="cycle"):
        two_streams([1, 1], [1, 1], 0.0, compute_waits={0: 0}, comm_waits={0: 0})


FORWARD = HalfLayers(layers=2, attention=1.0, experts=2.0, first_all_to_all=0.5, second_all_to_all=3.0)
BACKWARD = HalfLayers(layers=2, attention=4.0, experts=1.0, first_all_to_all=0.5, second_all_to_all=0.5)


def test_a_pair_by_hand():
    # per layer pair: max(attn_F 1, combine_bwd 0.5) = 1; the experts' phase: the backward's
    # experts 0 -> 1, the dispatch 0 -> 0.5, the dispatch's gradient 1 -> 1.5, the forward's
    # experts 1 -> 3: 3; max(attn_B 4, combine_F 3) = 4. Two layer pairs: 16, the compute alone
    assert layered_pair_seconds(FORWARD, BACKWARD, 0.0) == pytest.approx(16.0)
    # the forward's combine at 5 s is longer than the backward's attention beside it: 1 s
    # exposed per layer, where the whole-pass rule hides it under the backward's 10 s
    longer = HalfLayers(2, 1.0, 2.0, 0.5, 5.0)
    assert layered_pair_seconds(longer, BACKWARD, 0.0) == pytest.approx(18.0)
    whole_pass = 6 + 10 + max(0.0, 2 * 5.5 - 10) + max(0.0, 2 * 1.0 - 6)
    assert whole_pass == pytest.approx(17.0)


def test_layers_one_half_has_beyond_the_other_run_alone():
    three = HalfLayers(3, 1.0, 2.0, 0.5, 3.0)
    assert layered_pair_seconds(three, BACKWARD, 0.0) == pytest.approx(16.0 + 1.0 + 2.0 + 0.5 + 3.0)


def test_without_all_to_alls_a_pair_is_its_compute():
    forward = HalfLayers(4, 0.3, 0.7, 0.0, 0.0)
    backward = HalfLayers(2, 0.9, 1.1, 0.0, 0.0)
    assert layered_pair_seconds(forward, backward, 0.189) == pytest.approx(4 * 1.0 + 2 * 2.0)


def test_halves_read_off_a_stages_costs():
    stage = StageCost(fwd=10.0, bwd=20.0, wgrad=6.0, igrad=12.0, moe_layers=2, dispatch_bytes=100.0,
                      combine_bytes=300.0, expert_fwd=2.0, expert_igrad=1.5, expert_wgrad=2.5)
    assert HalfLayers.forward(stage, 10.0, 8.0) == HalfLayers(2, 3.0, 2.0, 1.0, 3.0)
    # a full backward runs the experts' weight gradient with their input gradient; a split one (I) not
    assert HalfLayers.backward(stage, ActionKind.B, 20.0, 8.0) == HalfLayers(2, 6.0, 4.0, 1.0, 3.0)
    assert HalfLayers.backward(stage, ActionKind.I, 12.0, 8.0) == HalfLayers(2, 4.5, 1.5, 1.0, 3.0)
    assert layered(stage, stage, 8.0, 8.0)
    assert not layered(stage, StageCost(fwd=1.0, bwd=2.0, moe_layers=2), 8.0, 8.0)  # a costs file without them


QWEN3_30B = ["--model", "qwen3-30b-a3b", "--seq-len", "4096", "--schedule",
             "interleaved-1f1b", "-v", "2", "--pp", "2", "-m", "8", "--dp", "16", "--ep", "16", "--topology", "ib",
             "--nodes", "4"]


def test_a_models_stages_give_their_experts_seconds():
    """Qwen3-30B-A3B: every layer a MoE layer; the experts' seconds a part of the stage's."""
    result = simulate_json(QWEN3_30B)
    for stage in result["stage_costs"]:
        layers = stage["layers"]
        assert stage["moe_layers"] == layers > 0
        assert 0 < stage["expert_fwd"] * layers < stage["fwd"]
        assert 0 < (stage["expert_igrad"] + stage["expert_wgrad"]) * layers < stage["bwd"]
        assert 0 < stage["expert_wgrad"] * layers < stage["wgrad"]


def test_combined_1f1b_is_faster_than_the_all_to_alls_exposed_yet_exposes_some():
    """Qwen3-30B-A3B at ep 16 over two nodes: combined 1F1B hides part of the all-to-alls,
    and its short phases leave some exposed on every rank."""
    exposed = simulate_json(QWEN3_30B)["makespan"]
    combined = simulate_json([*QWEN3_30B, "--ep-overlap"])
    assert combined["makespan"] < exposed
    ranks = combined["ranks"]
    assert all(rank["ep"] > 0 for rank in ranks)  # all-to-alls exposed where a phase is short


def test_a_delayed_weight_gradient_lets_the_dispatch_go_first_by_hand():
    forward = HalfLayers(1, 1.0, 1.0, 0.5, 0.0)
    # the backward's experts: 0.4 s input gradient, 0.6 s weight gradient; the dispatch's gradient 2 s
    together = HalfLayers(1, 1.0, 1.0, 0.0, 2.0)
    delayed = HalfLayers(1, 1.0, 0.4, 0.0, 2.0, delayed=0.6)
    # phase 2 together: the dispatch's gradient waits for both gradients (1 s), ends at 3 s;
    # delayed: it waits for the input gradient (0.4 s) and the forward's dispatch (0.5 s): 2.5 s
    assert layered_pair_seconds(forward, together, 0.0) == pytest.approx(1.0 + 3.0 + 1.0)
    assert layered_pair_seconds(forward, delayed, 0.0) == pytest.approx(1.0 + 2.5 + 1.0)
    stage = StageCost(fwd=10.0, bwd=20.0, wgrad=6.0, moe_layers=2, dispatch_bytes=100.0, expert_fwd=2.0,
                      expert_igrad=1.5, expert_wgrad=2.5)
    assert HalfLayers.backward(stage, ActionKind.B, 20.0, 8.0, delayed_wgrad=True) == HalfLayers(
        2, 6.0, 1.5, 2.0, 2.0, delayed=2.5)


def test_delay_wgrad_in_simulate(tmp_path, capsys):
    from pipesim.cli import main
    from tests.cli_runs import assert_one_line_error

    combined = simulate_json([*QWEN3_30B, "--ep-overlap"])
    delayed = simulate_json([*QWEN3_30B, "--ep-overlap", "--delay-wgrad"])
    assert delayed["delay_wgrad"] and not combined["delay_wgrad"]
    assert delayed["makespan"] <= combined["makespan"]
    capsys.readouterr()
    assert_one_line_error(capsys, ["simulate", *QWEN3_30B, "--delay-wgrad"],
                          "--delay-wgrad conflicts with --schedule interleaved-1f1b without --ep-overlap")
    assert_one_line_error(capsys, ["simulate", "--pp", "2", "--delay-wgrad"], "--delay-wgrad needs --model")
    costs = tmp_path / "costs.json"
    costs.write_text('{"stages": [{"fwd": 1, "bwd": 2}], "delayed_wgrad": "yes"}')
    assert main(["simulate", "--costs", str(costs), "--pp", "1"]) == 2
    assert "'delayed_wgrad' must be true or false, got 'yes'" in capsys.readouterr().err
