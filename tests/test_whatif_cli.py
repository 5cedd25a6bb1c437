"""The what-if flags through ``pipesim simulate`` and ``pipesim sweep``, and Kendall's tau
between the deterministic and the p99 ranking."""

from __future__ import annotations

import csv
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.plan.ranking import kendall_tau
from tests.test_cli_errors import assert_one_line_error, run_cli

BASE = ["simulate", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--fwd", "1", "--bwd", "2"]


def test_simulate_straggler_json_and_summary(capsys, tmp_path):
    """Rank 1 at 1.5x: 9 + 22 * 1.5 = 42 s in every sample (tests/test_whatif.py derives it)."""
    out = tmp_path / "step.json"
    status, stdout, _ = run_cli(capsys, *BASE, "--straggler", "1:1.5", "--samples", "20", "--json", out)
    assert status == 0
    document = json.loads(out.read_text())
    assert document["makespan"] == 33.0
    assert document["step_time_quantiles"] == {"p50": 42.0, "p90": 42.0, "p99": 42.0}
    assert document["step_time_mean"] == pytest.approx(42.0)
    assert document["samples"] == 20
    assert document["critical_path_owner"] == [{"rank": 1, "share": 1.0}]
    assert document["variability"]["stragglers"] == {"1": 1.5}
    assert "20 samples (seed 0): mean 42 s; p50 42, p90 42, p99 42 s; deterministic 33 s" in stdout
    assert "owned by rank 1 100%" in stdout


def test_simulate_cv_zero_is_the_deterministic_step(capsys, tmp_path):
    out = tmp_path / "step.json"
    status, _, _ = run_cli(capsys, "simulate", "--schedule", "interleaved-1f1b", "--topology", "nvlink",
                           "--act-bytes", "4e6", "--jitter", "F=0,B=0,comm=0", "--samples", "4", "--json", out)
    assert status == 0
    document = json.loads(out.read_text())
    assert set(document["step_time_quantiles"].values()) == {document["makespan"]}


def test_simulate_without_whatif_flags_has_no_distribution(capsys, tmp_path):
    out = tmp_path / "step.json"
    assert run_cli(capsys, *BASE, "--json", out)[0] == 0
    assert "step_time_quantiles" not in json.loads(out.read_text())


def test_simulate_html_shows_the_distribution_and_the_median_and_p99_steps(capsys, tmp_path):
    page = tmp_path / "whatif.html"
    status, stdout, _ = run_cli(capsys, *BASE, "--jitter", "0.1", "--samples", "50", "--seed", "2", "--html", page,
                                "--plotly", "cdn")
    assert status == 0 and f"wrote {page}" in stdout
    text = page.read_text()
    for phrase in ("cumulative distribution", "histogram", "p50 sample #", "p99 sample #", "deterministic 33 s"):
        assert phrase in text, phrase


@pytest.mark.parametrize(("flags", "phrase"), [
    (["--jitter", "-0.2"], "--jitter -0.2: must be a coefficient of variation >= 0, got -0.2"),
    (["--jitter", "nan"], "--jitter nan: must be a coefficient of variation >= 0, got nan"),
    (["--jitter", "F=0.1,Q=1"], "--jitter F=0.1,Q=1: unknown kind 'Q'"),
    (["--straggler", "7:1.5"], "--straggler 7:1.5: rank 7 is out of range; the pipeline has ranks 0..3"),
    (["--straggler", "1:0"], "--straggler 1:0: must be a slowdown factor > 0"),
    (["--straggler", "1:1.2", "--straggler", "1:1.5"], "--straggler 1:1.5: rank 1 is already named"),
    (["--stragglers", "2:1.5"], "--stragglers 2:1.5: must be a fraction of GPUs between 0 and 1, got 2.0"),
    (["--slow-link", "1x2:2"], "--slow-link 1x2:2: the link must be two different ranks A-B"),
    (["--slow-link", "0-3:2"], "--slow-link 0-3:2.0: no transfer goes between ranks 0 and 3"),
    (["--samples", "0"], "--samples must be a whole number >= 1, got 0"),
    (["--seed", "-1", "--jitter", "0.1"], "--seed must be a whole number >= 0, got -1"),
])
def test_bad_whatif_flags_exit_2_with_one_line(capsys, flags, phrase):
    status, _, err = run_cli(capsys, *BASE, *flags)
    assert status == 2
    assert_one_line_error(status, err, phrase)


def test_sweep_ranks_by_step_and_by_p99_with_kendall_tau(capsys, tmp_path):
    """gpipe and 1f1b tie on paper ((m + p - 1)(F + B) both); interleaved is faster. A
    straggler leaves interleaved first. Tau is computed from the printed rows by hand."""
    table = tmp_path / "rows.csv"
    status, stdout, _ = run_cli(capsys, "sweep", "--schedule", "gpipe,1f1b,interleaved-1f1b", "--pp", "4", "-m", "8",
                                "--straggler", "2:1.5", "--jitter", "0.05", "--samples", "40", "--quiet",
                                "--csv", table)
    assert status == 0
    rows = list(csv.DictReader(table.open()))
    assert [row["schedule"] for row in rows] == ["gpipe", "1f1b", "interleaved-1f1b"]
    for row in rows:
        assert float(row["step_time_p50"]) <= float(row["step_time_p90"]) <= float(row["step_time_p99"])
        assert float(row["step_time_p99"]) > float(row["makespan"])
    makespans = [float(row["makespan"]) for row in rows]
    p99s = [float(row["step_time_p99"]) for row in rows]
    assert makespans[0] == makespans[1] > makespans[2]
    # tau-b by hand: pairs (gpipe, 1f1b) tied on paper; the two pairs with interleaved are
    # concordant when its p99 is the lowest; the untied pairs: 2 on paper, 3 sampled
    assert p99s[2] < min(p99s[:2])
    expected = 2 / math.sqrt(2 * 3)
    assert f"Kendall tau between the two rankings: {expected:+.3f}" in stdout
    assert "by p99 of sampled steps" in stdout


@pytest.mark.parametrize(("first", "second", "tau"), [
    ([1, 2, 3], [10, 20, 30], 1.0),
    ([1, 2, 3], [3, 2, 1], -1.0),
    ([1, 2, 3, 4], [1, 3, 2, 4], (5 - 1) / 6),  # one discordant pair of six
    ([1, 1, 2], [1, 2, 3], 2 / math.sqrt(2 * 3)),  # a tie on one side
])
def test_kendall_tau_hand_values(first, second, tau):
    assert kendall_tau(first, second) == pytest.approx(tau)


def test_kendall_tau_of_all_ties_is_nan_and_lengths_must_match():
    assert math.isnan(kendall_tau([1, 1], [1, 2]))
    with pytest.raises(ValueError, match="two scorings of the same items, got 2 and 3"):
        kendall_tau([1, 2], [1, 2, 3])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3), min_size=2, max_size=12, unique=True),
       st.lists(st.floats(-1e3, 1e3), min_size=12, max_size=12))
def test_kendall_tau_properties(values, others):
    """Itself: 1; its reverse: -1; symmetric; within [-1, 1]."""
    other = others[:len(values)]
    assert kendall_tau(values, values) == pytest.approx(1.0)
    assert kendall_tau(values, [-value for value in values]) == pytest.approx(-1.0)
    tau = kendall_tau(values, other)
    if not math.isnan(tau):
        assert -1 - 1e-12 <= tau <= 1 + 1e-12
        assert kendall_tau(other, values) == pytest.approx(tau)


PLAN = ["plan", "--model", "gpt3-1.3b", "--gpus", "8", "--global-batch", "16", "--topology", "nvlink",
        "--microbatch-sizes", "1", "--workers", "1", "--quiet", "--constraint", "pp=4"]


def test_plan_objective_p99_ranks_the_top_layouts_by_sampled_p99(capsys, tmp_path):
    out = tmp_path / "plan.json"
    status, stdout, _ = run_cli(capsys, *PLAN, "--top", "3", "--objective", "p99", "--straggler", "1:1.3",
                                "--samples", "20", "--json", out)
    assert status == 0
    rows = json.loads(out.read_text())["ranked"][:3]
    p99s = [row["step_time_p99"] for row in rows]
    assert p99s == sorted(p99s)
    for row in rows:  # a straggler only lengthens actions: no sample is faster than the deterministic step
        assert row["step_time_p99"] >= row["step_time"]
        assert row["tokens_per_second_p99"] == pytest.approx(row["tokens_per_second"] * row["step_time"]
                                                             / row["step_time_p99"])
    assert "the table is in order of the p99 of 20 sampled steps (seed 0)" in stdout
    assert "Kendall tau between the two rankings" in stdout
    best = rows[0]  # the same layout through simulate gives the same p99
    simulated = tmp_path / "simulate.json"
    assert run_cli(capsys, "simulate", "--model", "gpt3-1.3b", "--topology", "nvlink", "--nodes", "1",
                   "--schedule", best["schedule"], "--pp", best["pp"], "--tp", best["tp"], "--dp", best["dp"],
                   "-v", best["virtual_stages"], "-m", best["microbatches"], "--microbatch-size", "1",
                   "--zero", best["zero"], "--recompute", best["recompute"],
                   *(["--sequence-parallel"] if best["sequence_parallel"] else []),
                   "--straggler", "1:1.3", "--samples", "20", "--json", simulated)[0] == 0
    assert json.loads(simulated.read_text())["step_time_quantiles"]["p99"] == pytest.approx(best["step_time_p99"],
                                                                                            rel=1e-12)


@pytest.mark.parametrize(("flags", "phrase"), [
    (["--objective", "p99"], "--objective p99 needs what varies: give --jitter, --straggler"),
    (["--jitter", "0.1"], "rank layouts only with --objective p99"),
    (["--objective", "p99", "--jitter", "-1"], "--jitter -1: must be a coefficient of variation >= 0"),
])
def test_plan_objective_flags_are_checked_first(capsys, flags, phrase):
    status, _, err = run_cli(capsys, *PLAN, *flags)
    assert status == 2
    assert_one_line_error(status, err, phrase)


def test_distribution_figure_marks_the_quantiles_and_ends_its_cdf_at_one():
    from viz.whatif import distribution_figure

    times = [0.010, 0.012, 0.011, 0.015]
    figure = distribution_figure(times, 0.0105, {"p50": 0.011, "p99": 0.015})
    histogram, cdf = figure.data[0], figure.data[1]
    assert sorted(histogram.x) == pytest.approx([10.0, 11.0, 12.0, 15.0])  # ms: the times' unit
    assert list(cdf.y) == [0.25, 0.5, 0.75, 1.0]
    assert [trace.name for trace in figure.data[2:]] == ["deterministic 10.5 ms", "p50 11 ms", "p99 15 ms"]
    assert sorted(shape.x0 for shape in figure.layout.shapes) == pytest.approx([10.5, 10.5, 11, 11, 15, 15])
    with pytest.raises(ValueError, match="at least one sample"):
        distribution_figure([], 1.0, {})


def test_sweep_csv_without_whatif_flags_keeps_its_columns(capsys, tmp_path):
    table = tmp_path / "rows.csv"
    assert run_cli(capsys, "sweep", "--schedule", "1f1b", "--pp", "2", "-m", "4", "--quiet", "--csv", table)[0] == 0
    header = table.read_text().splitlines()[0]
    assert "step_time_p99" not in header and header.startswith("schedule,pp,microbatches")


def test_compare_spread_is_order_statistics_of_the_kept_steps_and_the_samples():
    """Kept steps [1, 2, 3, 4] s (the warm-up 5 s left out): p50 is the 2nd (ceil(0.5 x 4)),
    p90 and p99 the 4th; 10 samples 10..19 s: p50 the 5th, p90 the 9th, p99 the 10th."""
    from pipesim.sim.comparison import add_spread, report_lines

    document = {"schedule": "1f1b", "pp": 2, "microbatches": 4, "virtual_stages": 1, "measured_step_time": 2.5,
                "predicted_step_time": 2.0, "error": -0.2, "measured_step_times": [5.0, 1.0, 2.0, 3.0, 4.0],
                "warmup_steps": 1, "measured_bubble_fraction": 0.1, "predicted_bubble_fraction": 0.1,
                "measured_idle_fraction": 0.2, "predicted_idle_fraction": 0.2, "ranks": []}
    add_spread(document, [float(value) for value in range(19, 9, -1)])
    assert document["measured_step_time_quantiles"] == {"p50": 2.0, "p90": 4.0, "p99": 4.0}
    assert document["predicted_step_time_quantiles"] == {"p50": 14.0, "p90": 18.0, "p99": 19.0}
    lines = report_lines(document)
    assert "  p99         measured   4000.00 ms   predicted  19000.00 ms   (4 steps / 10 sampled steps)" in lines


def test_compare_checks_whatif_flags_before_running_anything(capsys):
    status, _, err = run_cli(capsys, "compare", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4",
                             "--model", "mlp", "--layers", "4", "--hidden", "32", "--batch-size", "8",
                             "--straggler", "1:-1")
    assert_one_line_error(status, err, "--straggler 1:-1: must be a slowdown factor > 0")
    assert status == 2
