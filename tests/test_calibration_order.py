"""compare's calibration order: the launch order of calibration and timed configs, the
measured result merged from interleaved timed configs (hand-built results), the flags
it refuses, and one 2-rank gloo compare in each order."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from executor.config import RunConfig
from pipesim.cli import main
from pipesim.cli.calibration_order import (
    AROUND,
    CALIBRATION,
    INTERLEAVED,
    TIMED,
    launch_order,
    median_index,
    merged_timed_result,
    split_results,
    timed_configs,
)
from schedules.trace import Trace, TraceEvent
from tests.test_compare_calibrated import topology

C, T = CALIBRATION, TIMED


def test_five_and_five_alternate_starting_with_a_calibration_config():
    assert launch_order(5, 5, INTERLEAVED) == [(C, 0), (T, 0), (C, 1), (T, 1), (C, 2), (T, 2), (C, 3), (T, 3),
                                               (C, 4), (T, 4)]


def test_unequal_counts_are_spread_evenly_by_hand():
    # calibration at 1/6, 3/6, 5/6; timed at 1/10, 3/10, 5/10, 7/10, 9/10 (a tie at 5/10 and
    # 1/2: the calibration config first)
    assert launch_order(3, 5, INTERLEAVED) == [(T, 0), (C, 0), (T, 1), (C, 1), (T, 2), (T, 3), (C, 2), (T, 4)]
    # calibration at 1/10, 3/10, 5/10, 7/10, 9/10; timed at 1/4, 3/4
    assert launch_order(5, 2, INTERLEAVED) == [(C, 0), (T, 0), (C, 1), (C, 2), (C, 3), (T, 1), (C, 4)]


def test_around_is_half_the_calibration_then_the_timed_config_then_the_rest():
    assert launch_order(5, 1, AROUND) == [(C, 0), (C, 1), (C, 2), (T, 0), (C, 3), (C, 4)]
    assert launch_order(1, 1, AROUND) == [(C, 0), (T, 0)]
    assert launch_order(4, 1, AROUND) == [(C, 0), (C, 1), (T, 0), (C, 2), (C, 3)]


@given(st.integers(1, 40), st.integers(1, 40))
def test_interleaved_order_holds_each_config_once_in_turn_and_never_two_timed_ones_together(calibration, timed):
    order = launch_order(calibration, timed, INTERLEAVED)
    assert [index for kind, index in order if kind == C] == list(range(calibration))
    assert [index for kind, index in order if kind == T] == list(range(timed))
    kinds = [kind for kind, _ in order]
    # with at least as many calibration configs as timed ones, a calibration config lies
    # between any two timed ones (and the other way round)
    if calibration >= timed:
        assert all(not (a == T and b == T) for a, b in pairwise(kinds))
    if timed >= calibration:
        assert all(not (a == C and b == C) for a, b in pairwise(kinds))
    # every prefix has seen the same share of each kind, within one config of each
    seen = {C: 0, T: 0}
    for kind in kinds:
        seen[kind] += 1
        assert abs(seen[C] / calibration - seen[T] / timed) <= 1 / calibration + 1 / timed


def test_launch_order_refuses_an_unknown_order_and_empty_kinds():
    with pytest.raises(ValueError, match="--calibration-order must be one of interleaved, around, got 'sideways'"):
        launch_order(2, 2, "sideways")
    with pytest.raises(ValueError, match="need a calibration config and a timed one, got 0 and 3"):
        launch_order(0, 3, INTERLEAVED)


def test_timed_configs_map_steps_and_warmup_onto_configs():
    config = RunConfig(pp=2, steps=6)
    interleaved = timed_configs(config, INTERLEAVED, 1)
    assert [c.steps for c in interleaved] == [2] * 5  # --steps 6 --warmup-steps 1: 5 configs of 2 steps
    assert [c.steps for c in timed_configs(config, INTERLEAVED, 2)] == [3] * 4
    assert all(c.pp == 2 for c in interleaved)
    assert timed_configs(config, AROUND, 1) == [config]


def test_split_results_sorts_the_launch_back_into_calibration_and_timed():
    order = launch_order(3, 2, INTERLEAVED)  # C0 T0 C1 T1 C2
    results = [{"name": f"{kind}{index}"} for kind, index in order]
    calibration, timed = split_results(order, results)
    assert [r["name"] for r in calibration] == ["calibration0", "calibration1", "calibration2"]
    assert [r["name"] for r in timed] == ["timed0", "timed1"]
    with pytest.raises(ValueError, match="launched 5 configs but got 4 results"):
        split_results(order, results[:4])


def timed_result(warmup: list[float], step: float, loss: float) -> dict:
    """One timed config's rank-0 result as the launcher returns it: the Trace of its last step."""
    events = [TraceEvent(0, "0F0", "F", 0, 0, 0.0, step / 2, "compute")]
    return {"step_times": [*warmup, step], "losses": [loss + 1.0, loss], "memory": [{"rank": 0, "peak": step}],
            "trace": Trace(events, {"pp": 2, "source": "measured", "step": len(warmup)})}


def test_the_merged_result_is_the_timed_steps_with_the_median_steps_trace_and_memory():
    timed = [timed_result([0.9], 0.30, 2.0), timed_result([0.8], 0.10, 2.1), timed_result([0.7], 0.20, 2.2),
             timed_result([0.6], 0.50, 2.3), timed_result([0.5], 0.40, 2.4)]
    merged = merged_timed_result(timed)
    assert merged["step_times"] == [0.30, 0.10, 0.20, 0.50, 0.40]  # the last step of each config, no warm-up
    assert merged["warmup_step_times"] == [[0.9], [0.8], [0.7], [0.6], [0.5]]
    assert merged["losses"] == [2.0, 2.1, 2.2, 2.3, 2.4]
    # median 0.30: the first config's step; its Trace, memory and index
    assert merged["trace"].events == timed[0]["trace"].events
    assert merged["trace"].meta["step"] == 0 and merged["trace"].meta["timed_configs"] == 5
    assert merged["memory"] == [{"rank": 0, "peak": 0.30}]
    assert timed[0]["trace"].meta["step"] == 1  # the input left as it was


def test_an_even_count_draws_the_lower_middle_step():
    assert median_index([0.4, 0.1, 0.3, 0.2]) == 3  # sorted 0.1 0.2 | 0.3 0.4
    assert median_index([0.2, 0.2]) == 0
    merged = merged_timed_result([timed_result([1.0, 1.0], 0.4, 1.0), timed_result([1.0, 1.0], 0.2, 1.0)])
    assert merged["trace"].meta["step"] == 1 and merged["warmup_step_times"] == [[1.0, 1.0], [1.0, 1.0]]


TINY = ["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--backend", "gloo", "--model", "mlp",
        "--layers", "2", "--hidden", "8", "--batch-size", "4"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--steps", "1"], "--steps 1 with --warmup-steps 1 leaves no timed step"),
    (["--warmup-steps", "0"], "--warmup-steps 0 with --calibration-order interleaved would time each fresh model's "
                              "first step"),
    (["--calibration", "stages", "--calibration-order", "around"],
     "--calibration-order around orders the calibration steps of --calibration run; --calibration stages runs none"),
    (["--costs", "costs.json", "--calibration-order", "interleaved"],
     "--calibration-order interleaved orders the calibration steps of --calibration run; --costs costs.json runs "
     "none"),
])
def test_compare_refuses_orders_and_steps_that_make_no_sense_in_one_line(flags, message, capsys):
    assert main(["compare", *TINY, *flags]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1


def test_around_keeps_a_run_without_warmup_or_with_fewer_steps_than_the_warmup():
    from pipesim.cli.calibration_order import check_order_steps

    check_order_steps(AROUND, 1, 1)
    check_order_steps(AROUND, 3, 0)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("order", [INTERLEAVED, AROUND])
def test_compare_in_either_order_measures_only_the_timed_steps(order, tmp_path, monkeypatch, capsys):
    import executor.launch

    real_launch, launched = executor.launch.launch, []

    def recording_launch(configs, **kwargs):  # the real launch, its configs and results kept
        results = real_launch(configs, **kwargs)
        launched.append((list(configs), results))
        return results

    monkeypatch.setattr(executor.launch, "launch", recording_launch)
    out = tmp_path / "compare.json"
    assert main(["compare", *TINY, "--steps", "3", "--calibration-steps", "2", "--calibration-order", order,
                 "--topology", topology(tmp_path / "links.json", 2), "--json", str(out), "--quiet",
                 "--trace", str(tmp_path / "measured.json"), "--html", str(tmp_path / "compare.html")]) == 0
    document = json.loads(out.read_text())
    measured = json.loads((tmp_path / "measured.json").read_text())
    drawn = measured["meta"]["step"]
    assert f"drawn: step {drawn}," in (tmp_path / "compare.html").read_text()
    assert len(measured["meta"]["memory"]) == 2  # each rank's measured memory, beside the prediction
    ((configs, results),) = launched
    steps = [config.steps for config in configs]
    assert document["calibration_order"] == order
    assert document["costs"]["meta"]["calibration_steps"] == 2
    if order == INTERLEAVED:
        # --steps 3 --warmup-steps 1: two timed configs of 2 steps, between the 2 calibration ones
        assert steps == [2, 2, 2, 2]
        timed = [results[1], results[3]]  # C T C T
        assert document["measured_step_times"] == [result["step_times"][-1] for result in timed]
        assert document["measured_warmup_step_times"] == [result["step_times"][:1] for result in timed]
        assert document["warmup_steps"] == 0 and document["warmup_steps_per_timed_step"] == 1
        # the drawn Trace is the timed config whose step is the lower middle of the two
        times = document["measured_step_times"]
        assert drawn == (0 if times[0] <= times[1] else 1)
        assert Trace.from_dict(measured).events == timed[drawn]["trace"].events
    else:
        assert steps == [2, 3, 2]  # C, the timed config's 3 steps, C
        assert document["measured_step_times"] == results[1]["step_times"]
        assert document["warmup_steps"] == 1 and "measured_warmup_step_times" not in document
        assert drawn == 2  # the timed model's last step
    kept = document["measured_step_times"][document["warmup_steps"]:]
    assert len(kept) == 2
    assert document["measured_step_time"] == pytest.approx(sum(kept) / 2)  # the median of two
    assert document["error"] == pytest.approx(
        (document["predicted_step_time"] - document["measured_step_time"]) / document["measured_step_time"])
    assert len(document["ranks"]) == 2 and all(rank["measured_busy"] > 0 for rank in document["ranks"])
    assert len(document["compute_stretch"]) == 2
    assert f"{document['measured_step_time'] * 1e3:9.2f} ms" in capsys.readouterr().out
