"""Calibrated prediction: the alpha-beta fit, nccl-tests bandwidth factors, and the
profile -> simulate and compare commands end to end on a tiny model (gloo, 2 ranks)."""

from __future__ import annotations

import json

import pytest

from executor.estimate import robust_mean
from pipesim.cli import main
from pipesim.cli.bench_comm import parse_sizes
from pipesim.cluster.comm_fit import bandwidths, bus_factor, fit_alpha_beta, link_fit, topology_document
from pipesim.cluster.files import topology_from_dict
from pipesim.model.costs import load_costs
from pipesim.sim.comparison import compare
from schedules.trace import Trace, TraceEvent
from tests.test_bubble_comm import tp_after_forward_events

SIZES = [2**10, 2**14, 2**18, 2**22, 2**26]


def test_alpha_beta_fit_reproduces_the_points_it_was_fitted_to():
    alpha, bandwidth = 25e-6, 12.5e9
    points = [(size, alpha + size / bandwidth) for size in SIZES]
    fit = fit_alpha_beta(points)
    assert fit.alpha == pytest.approx(alpha, rel=1e-9)
    assert fit.bandwidth == pytest.approx(bandwidth, rel=1e-9)
    for size, seconds in points:
        assert fit.seconds(size) == pytest.approx(seconds, rel=1e-9)


def test_alpha_beta_fit_weighs_sizes_by_relative_error():
    # 10% noise on the largest message must not swamp the latency of the small ones
    alpha, bandwidth = 50e-6, 1e9
    points = [(size, alpha + size / bandwidth) for size in SIZES[:-1]]
    points.append((SIZES[-1], (alpha + SIZES[-1] / bandwidth) * 1.1))
    fit = fit_alpha_beta(points)
    assert fit.alpha == pytest.approx(alpha, rel=0.1)
    assert fit.alpha > 0


def test_timings_that_do_not_grow_with_size_still_fit_a_finite_link():
    # A noisy machine timed 64 KB faster than 1 KB: the latency is the fastest timing (80 us)
    # and the bandwidth the slowest that explains both: (100 - 80) us for 1 KB -> 51.2 MB/s.
    fit = fit_alpha_beta([(1024, 100e-6), (65536, 80e-6)])
    assert fit.alpha == pytest.approx(80e-6)
    assert fit.bandwidth == pytest.approx(1024 / 20e-6)
    flat = fit_alpha_beta([(1024, 50e-6), (65536, 50e-6)])
    assert flat.alpha == pytest.approx(50e-6)
    assert flat.bandwidth == pytest.approx(65536 / 50e-6)  # the largest message in one latency


def test_fit_needs_two_sizes():
    with pytest.raises(ValueError, match="two or more message sizes"):
        fit_alpha_beta([(1024, 1e-4), (1024, 2e-4)])


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_bus_bandwidth_factors_follow_nccl_tests(ranks):
    n = ranks
    assert bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    assert bus_factor("all_gather", n) == pytest.approx((n - 1) / n)
    assert bus_factor("reduce_scatter", n) == pytest.approx((n - 1) / n)
    assert bus_factor("sendrecv", n) == 1.0
    algbw, busbw = bandwidths("all_reduce", n, 1e9, 0.5)
    assert algbw == pytest.approx(2e9) and busbw == pytest.approx(2e9 * 2 * (n - 1) / n)


def test_ring_fit_recovers_the_link_behind_a_collective():
    n, latency, bandwidth = 4, 5e-6, 40e9
    points = [(size, 2 * (n - 1) * latency + 2 * (n - 1) / n * size / bandwidth) for size in SIZES]
    fit = link_fit("all_reduce", n, points)
    assert fit["latency"] == pytest.approx(latency, rel=1e-9)
    assert fit["bandwidth"] == pytest.approx(bandwidth, rel=1e-9)


def test_sizes_parse_as_a_range_or_a_list():
    assert parse_sizes("1KB..64MB") == [2**10, 2**12, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24, 2**26]
    assert parse_sizes("4KB,1MB") == [4096, 2**20]
    # a unit without its B, in either case, is the same unit (16m once failed with a KeyError)
    assert parse_sizes("16k..1m") == [2**14, 2**16, 2**18, 2**20]
    assert parse_sizes("2G,3") == [2 * 2**30, 3]
    for empty in ("0", "0K,1M", ","):
        with pytest.raises(ValueError, match="at least 1 byte"):
            parse_sizes(empty)
    with pytest.raises(ValueError, match="64XB"):
        parse_sizes("64XB")


def test_topology_document_is_a_topology_the_simulator_reads():
    result = {"world": 2, "backend": "gloo", "device": "cpu",
              "rows": [{"operation": "sendrecv", "bytes": size, "seconds": 1e-4 + size / 1e9} for size in SIZES]}
    fits = {"sendrecv": link_fit("sendrecv", 2, [(row["bytes"], row["seconds"]) for row in result["rows"]])}
    topology = topology_from_dict(topology_document(result, fits))
    route = topology.route("rank0", "rank1")
    assert route.latency == pytest.approx(1e-4) and route.bandwidth == pytest.approx(1e9)


def test_compare_document_error_and_idle():
    def trace(busy: float, source: str) -> Trace:
        events = [TraceEvent(rank, "0F0", "F", rank, 0, 0.0, busy, "compute") for rank in range(2)]
        return Trace(events, {"pp": 2, "schedule": "1f1b", "microbatches": 1, "virtual_stages": 1, "source": source})

    document = compare(trace(0.5, "measured"), [9.0, 1.0, 1.0, 1.2], trace(0.5, "simulated"), 1.1)
    assert document["measured_step_time"] == pytest.approx(1.0)
    assert document["error"] == pytest.approx(0.1)
    # idle of the traced (last) step: 1.2 - 0.5, not the median's 1.0 - 0.5 (tests/test_compare_traced_step.py)
    assert [rank["measured_idle"] for rank in document["ranks"]] == pytest.approx([0.7, 0.7])
    assert [rank["predicted_idle"] for rank in document["ranks"]] == pytest.approx([0.6, 0.6])


TINY = ["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--model", "mlp", "--layers", "4",
        "--hidden", "32", "--batch-size", "8"]


def test_robust_mean_is_the_median_of_round_means_and_sets_a_slow_round_aside():
    assert robust_mean([2.0, 1.0, 3.0]) == 2.0
    # one round that a slow spell covered moves the estimate not at all; a plain mean by 30%
    rounds = [1.00, 1.02, 0.99, 1.01, 2.50]
    assert robust_mean(rounds) == pytest.approx(1.01)
    with pytest.raises(ValueError, match="no timing rounds"):
        robust_mean([])


@pytest.mark.parametrize("flags, named", [(["--min-time", "-1"], "--min-time"), (["--repeats", "0"], "--repeats"),
                                          (["--min-time", "nan"], "--min-time"),
                                          (["--min-time", "inf"], "--min-time")])
def test_profile_rejects_bad_measurement_settings(flags, named, tmp_path, capsys):
    for command in ("profile", "compare"):
        extra = ["--out", str(tmp_path / "costs.json")] if command == "profile" else []
        assert main([command, *TINY, *flags, *extra]) == 2
        error = capsys.readouterr().err
        assert named in error and f"pipesim {command}: error" in error
    assert not (tmp_path / "costs.json").exists()


@pytest.mark.timeout(180)
def test_profile_simulate_and_compare_end_to_end(tmp_path, capsys):
    costs_path = tmp_path / "costs.json"
    assert main(["profile", *TINY, "--warmup", "1", "--repeats", "3", "--min-time", "0.2",
                 "--out", str(costs_path)]) == 0
    written = json.loads(costs_path.read_text())
    assert written["meta"]["min_time"] == 0.2 and written["meta"]["compute_clock"] == "thread"
    # the split backward as measured: the file's I and W are the profile's own means
    for entry in written["stages"]:
        measured = written["meta"]["measured"]["stages"][str(entry["stage"])]
        assert (entry["igrad"], entry["wgrad"]) == (measured["I"], measured["W"]) and entry["igrad"] > 0
    costs = load_costs(costs_path, 2)
    assert all(stage.fwd > 0 and stage.bwd > 0 and stage.param_bytes > 0 for stage in costs.stages)
    assert costs.stages[0].act_bytes == 2 * 32 * 4  # microbatch of 2 x hidden 32, float32
    assert costs.step_overhead > 0 and costs.comm_overhead > 0

    links = tmp_path / "links.json"
    assert main(["bench-comm", "--sizes", "1KB,64KB", "--ops", "sendrecv,all_reduce", "--out", str(links),
                 "--html", str(tmp_path / "bench.html")]) == 0
    printed = capsys.readouterr().out
    assert "busbw" in printed and "fit sendrecv" in printed and (tmp_path / "bench.html").exists()

    predicted_json = tmp_path / "predicted.json"
    assert main(["simulate", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--costs", str(costs_path),
                 "--topology", str(links), "--json", str(predicted_json)]) == 0
    predicted = json.loads(predicted_json.read_text())
    assert predicted["makespan"] > costs.step_overhead

    compare_json = tmp_path / "compare.json"
    assert main(["compare", *TINY, "--steps", "3", "--costs", str(costs_path), "--topology", str(links),
                 "--json", str(compare_json), "--html", str(tmp_path / "compare.html")]) == 0
    document = json.loads(compare_json.read_text())
    assert len(document["measured_step_times"]) == 3 and document["measured_step_time_spread"]["min"] > 0
    assert document["warnings"][0].startswith("only 2 steps measured after the warm-up")
    for key in ("measured_step_time", "predicted_step_time", "error"):
        assert isinstance(document[key], float)
    assert document["predicted_step_time"] == pytest.approx(predicted["makespan"])
    assert document["error"] == pytest.approx(
        (document["predicted_step_time"] - document["measured_step_time"]) / document["measured_step_time"])
    assert [rank["rank"] for rank in document["ranks"]] == [0, 1]
    assert all({"measured_idle", "predicted_idle"} <= set(rank) for rank in document["ranks"])
    assert (tmp_path / "compare.html").exists()


def test_compare_tells_the_pipeline_bubble_from_idle_time():
    # the predicted step of tests/test_bubble_comm.py (bubble 0.25 of 2 ranks x 2 s; rank
    # 0's tp all-reduce [1, 2] on a stream of its own) and the same step as the executor
    # measures it: the all-reduce runs inside rank 0's forward, F [0, 2] holding TP [1, 2].
    # Bubble 1 of 4 rank-seconds on both sides; busy 3 of 4 on both (the tp second counted
    # as the executor's action holds it), so idle 0.25, not the 0.5 of compute alone
    meta = {"pp": 2, "schedule": "1f1b", "microbatches": 1, "virtual_stages": 1}
    measured = [
        TraceEvent(0, "0F0", "F", 0, 0, 0.0, 2.0, "compute"),
        TraceEvent(0, "TP(0F0)", "TP", 0, 0, 1.0, 2.0, "tp"),
        TraceEvent(0, "0SEND_F0", "SEND_F", 0, 0, 1.0, 1.0, "send"),
        TraceEvent(1, "1RECV_F0", "RECV_F", 1, 0, 0.0, 1.0, "recv"),
        TraceEvent(1, "1F0", "F", 1, 0, 1.0, 2.0, "compute"),
    ]
    document = compare(Trace(measured, {**meta, "source": "measured"}), [2.0, 2.0],
                       Trace(tp_after_forward_events(), {**meta, "source": "simulated"}), 2.0)
    assert document["measured_bubble_fraction"] == pytest.approx(0.25)
    assert document["predicted_bubble_fraction"] == pytest.approx(0.25)
    assert document["measured_idle_fraction"] == pytest.approx(0.25)
    assert document["predicted_idle_fraction"] == pytest.approx(0.25)
    assert [(rank["measured_busy"], rank["predicted_busy"]) for rank in document["ranks"]] == [(2.0, 2.0),
                                                                                               (1.0, 1.0)]
