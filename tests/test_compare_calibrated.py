"""compare with the costs of the run's own calibration steps (the default): on 2-4 tiny
gloo ranks, with tp shards whose collectives the simulator charges from the links."""

from __future__ import annotations

import json

import pytest

from pipesim.cli import main

TINY = ["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--backend", "gloo", "--steps", "2",
        "--calibration-steps", "1"]


def topology(path, ranks: int, bandwidth: float = 1e9, latency: float = 1e-4) -> str:
    link = {"bandwidth": bandwidth, "latency": latency, "medium": "gloo measured"}
    document = {"devices": [{"name": f"rank{rank}"} for rank in range(ranks)],
                "links": [{"src": f"rank{a}", "dst": f"rank{b}", **link}
                          for a in range(ranks) for b in range(a + 1, ranks)]}
    path.write_text(json.dumps(document))
    return str(path)


@pytest.mark.timeout(300)
def test_compare_predicts_a_tp_run_with_its_collectives_priced_by_the_links(tmp_path):
    # gpt, 2 layers over 2 stages, microbatches of 2 sequences of 8 tokens, hidden 16
    assert main(["compare", *TINY, "--tp", "2", "--model", "gpt", "--layers", "2", "--hidden", "16", "--heads", "2",
                 "--seq-len", "8", "--batch-size", "4", "--topology", topology(tmp_path / "links.json", 4),
                 "--json", str(tmp_path / "compare.json"), "--predicted-trace", str(tmp_path / "predicted.json")]) == 0
    document = json.loads((tmp_path / "compare.json").read_text())
    costs = document["costs"]
    assert costs["meta"]["source"] == "calibration steps of the run"
    for stage in costs["stages"]:
        assert stage["layers"] == 1
        assert stage["tp_message_bytes"] == 2 * 8 * 16 * 4  # the layer's s*b*h activation in float32
        assert stage["fwd"] > 0 and stage["bwd"] > 0
    # Megatron's two all-reduces per layer after F and after B; a ring all-reduce over 2
    # ranks: 2 (n - 1) / n * S / B + 2 (n - 1) * latency = 1024 B / 1 GB/s + 0.2 ms
    one = 1024 / 1e9 + 2e-4
    events = json.loads((tmp_path / "predicted.json").read_text())["events"]
    collectives = [event for event in events if event["stream"] == "tp"]
    assert {event["action"] for event in collectives if event["rank"] == 0} == {"TP(0F0)", "TP(0F1)", "TP(0B0)",
                                                                               "TP(0B1)"}
    assert len(collectives) == 2 * 2 * 2  # per rank: 2 microbatches x (F, B)
    for event in collectives:
        assert event["end"] - event["start"] == pytest.approx(2 * one, rel=1e-6)
    assert document["measured_step_time"] > 0 and document["predicted_step_time"] > 0
    # gloo buffers its P2P and marks each wait: the runtime between actions, both sides
    for rank in document["ranks"]:
        assert rank["measured_runtime"] > 0 and rank["predicted_runtime"] > 0


@pytest.mark.timeout(300)
def test_compare_prices_the_sequence_parallel_collectives_from_its_calibration_steps(tmp_path):
    # links benchmarked by compare itself (no --topology): the calibration steps price tp's collectives
    assert main(["compare", *TINY, "--tp", "2", "--sequence-parallel", "--model", "gpt", "--layers", "2",
                 "--hidden", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "4",
                 "--json", str(tmp_path / "compare.json"), "--predicted-trace", str(tmp_path / "predicted.json")]) == 0
    document = json.loads((tmp_path / "compare.json").read_text())
    paces = document["calibrated_collectives"]
    assert set(paces) == {"all_gather", "reduce_scatter"}  # no all-reduce under sequence parallelism
    pace = paces["all_gather"]
    assert paces["reduce_scatter"] == pace  # one price: the executor's events do not tell them apart
    assert pace["ranks"] == 2 and pace["bytes"] == 2 * 8 * 16 * 4  # the layer's s*b*h activation in float32
    assert pace["latency"] >= 0 and pace["bandwidth"] > 0 and pace["benchmark_seconds"] > 0
    assert pace["seconds"] == pytest.approx(pace["bytes"] / pace["bandwidth"] + pace["latency"], rel=1e-12)
    # one calibration step, its tp total spread over the 40 collectives the simulator charges it
    # (8 actions x 1 layer x 2 all-gathers and 2 reduce-scatters, and each of the 4 B's 2
    # all-gathers of the sublayers' inputs again) where the executor timed 44 (it also cuts the
    # sequence at the first stage, gathered in each of its 2 B, and joins it before the last
    # stage's head in each of its 2 F): a collective 44/40 of the mean one timed
    assert pace["seconds"] == pytest.approx(pace["timed_seconds"] * 44 / 40, rel=1e-9)
    # the simulator's tp hold after each F: 1 layer x (2 all-gathers + 2 reduce-scatters); after
    # each B 2 all-gathers more
    events = json.loads((tmp_path / "predicted.json").read_text())["events"]
    collectives = [event for event in events if event["stream"] == "tp"]
    assert len(collectives) == 2 * 2 * 2  # per rank: 2 microbatches x (F, B)
    for event in collectives:
        held = 4 if "F" in event["action"] else 6  # TP(0F1), TP(0B1)
        assert event["end"] - event["start"] == pytest.approx(held * pace["seconds"], rel=1e-6), event


def test_compare_refuses_costs_given_twice_and_no_calibration_steps(tmp_path, capsys):
    assert main(["compare", *TINY[:-2], "--calibration-steps", "0"]) == 2
    assert "--calibration-steps must be >= 1, got 0" in capsys.readouterr().err
    assert main(["compare", *TINY, "--costs", "costs.json", "--calibration", "run"]) == 2
    assert "--costs costs.json gives the costs; --calibration run measures them: give one of them" in (
        capsys.readouterr().err)


def test_compute_stretch_counts_the_tp_collectives_the_run_holds_inside_its_compute():
    from pipesim.sim.comparison import compare
    from schedules.trace import Trace, TraceEvent

    meta = {"pp": 1, "schedule": "1f1b", "microbatches": 1, "virtual_stages": 1}
    # measured: one forward of 0.5 s with its collective inside; predicted: 0.4 s of
    # compute and the 0.1 s collective after it, on the tp stream
    measured = Trace([TraceEvent(0, "0F0", "F", 0, 0, 0.0, 0.5, "compute")], {**meta, "source": "measured"})
    predicted = Trace([TraceEvent(0, "0F0", "F", 0, 0, 0.0, 0.4, "compute"),
                       TraceEvent(0, "TP(0F0)", "TP", 0, 0, 0.4, 0.5, "tp")], {**meta, "source": "simulated"})
    document = compare(measured, [0.5] * 6, predicted, 0.5)
    assert document["compute_stretch"] == pytest.approx([1.0])
    assert not any(warning.startswith("compute ran") for warning in document["warnings"])


def test_the_stage_profile_refuses_tp_and_names_the_calibration_that_takes_it(tmp_path, capsys):
    assert main(["profile", "--pp", "2", "--tp", "2", "--model", "gpt", "--batch-size", "8", "--backend", "gloo",
                 "--out", str(tmp_path / "costs.json")]) == 2
    assert "--calibration run times the run's own steps with them" in capsys.readouterr().err
    assert not (tmp_path / "costs.json").exists()


def test_a_stage_profile_costs_file_is_refused_for_a_tp_run_and_a_run_calibrated_one_taken(tmp_path, capsys):
    from executor.config import RunConfig
    from pipesim.cli.compare import check_whole_stages

    stage = {"fwd": 1e-3, "bwd": 2e-3}
    (tmp_path / "costs.json").write_text(json.dumps({"stages": [stage, stage], "meta": {"source": "pipesim profile"}}))
    assert main(["compare", *TINY, "--tp", "2", "--model", "gpt", "--batch-size", "4",
                 "--costs", str(tmp_path / "costs.json")]) == 2
    assert f"--costs {tmp_path / 'costs.json'} times whole pipeline stages, not --tp 2 shards" in (
        capsys.readouterr().err)
    config = RunConfig(pp=2, tp=2, model="gpt")
    check_whole_stages(config, "--costs c.json", {"source": "calibration steps of the run"})  # taken
    check_whole_stages(RunConfig(pp=2), "--costs c.json", {})  # no shards: any costs


@pytest.mark.timeout(240)
def test_profile_writes_the_costs_of_the_runs_own_steps_for_compare_to_take(tmp_path, capsys):
    flags = ["--schedule", "zb-h1", "--pp", "2", "--microbatches", "2", "--model", "mlp", "--layers", "2", "--hidden",
             "8", "--batch-size", "4", "--backend", "gloo"]
    out = tmp_path / "costs.json"
    assert main(["profile", *flags, "--calibration", "run", "--calibration-steps", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    document = json.loads(out.read_text())
    assert document["meta"]["source"] == "calibration steps of the run"
    assert document["meta"]["calibration_steps"] == 1
    for entry in document["stages"]:  # zb-h1 splits every backward: B is I + W as run
        assert entry["igrad"] > 0 and entry["wgrad"] > 0
        assert entry["bwd"] == pytest.approx(entry["igrad"] + entry["wgrad"])
        assert entry["param_bytes"] == (8 * 8 + 8) * 4  # one Linear(8, 8) per stage, float32
    assert f"stage 1: F {document['stages'][1]['fwd'] * 1e3:.3f} ms" in printed
    assert all(document[key] >= 0 for key in ("action_overhead", "comm_overhead", "step_overhead"))
