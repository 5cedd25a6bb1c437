"""compare with data parallelism: the run's dp replicas and their gradient all-reduce are
predicted, and the profile times one replica's pipeline (gloo, 4 tiny ranks)."""

from __future__ import annotations

import json

import pytest

from executor.config import RunConfig
from pipesim.cli import main
from pipesim.cli.compare import profiled_shape, replicas

TINY_DP = ["--schedule", "1f1b", "--pp", "2", "--dp", "2", "--microbatches", "2", "--model", "mlp", "--layers", "2",
           "--hidden", "16", "--batch-size", "8", "--backend", "gloo"]


def test_a_replica_is_profiled_at_its_own_microbatch_size():
    # a batch of 8 over 2 replicas is 4 samples each, cut into 2 microbatches of 2
    config = RunConfig(pp=2, dp=2, microbatches=2, batch_size=8, dp_bucket_mb=1.0)
    assert profiled_shape(config)["microbatch_size"] == 2
    parallel = replicas(config)
    assert (parallel.dp, parallel.bucket_bytes) == (2, 2**20)


def write_links_and_costs(folder) -> None:
    """``links.json``: 4 ranks joined at 1 GB/s and 0.1 ms; ``costs.json``: two stages of
    0.1 / 0.2 ms with 4 MB of parameters each (so a ring over 2 replicas moves 4 MB an
    all-reduce, 2 MB a reduce-scatter or all-gather)."""
    link = {"bandwidth": 1e9, "latency": 1e-4, "medium": "gloo measured"}
    topology = {"devices": [{"name": f"rank{rank}"} for rank in range(4)],
                "links": [{"src": f"rank{a}", "dst": f"rank{b}", **link} for a in range(4) for b in range(a + 1, 4)]}
    (folder / "links.json").write_text(json.dumps(topology))
    stage = {"fwd": 1e-4, "bwd": 2e-4, "act_bytes": 2 * 16 * 4, "param_bytes": 4e6}
    (folder / "costs.json").write_text(json.dumps({"stages": [stage, stage]}))


@pytest.mark.timeout(240)
def test_compare_runs_and_predicts_two_replicas(tmp_path, capsys):
    write_links_and_costs(tmp_path)
    assert main(["compare", *TINY_DP, "--steps", "3", "--costs", str(tmp_path / "costs.json"), "--topology",
                 str(tmp_path / "links.json"), "--json", str(tmp_path / "compare.json"), "--predicted-trace",
                 str(tmp_path / "predicted.json")]) == 0
    document = json.loads((tmp_path / "compare.json").read_text())
    assert document["measured_step_time"] > 0
    events = json.loads((tmp_path / "predicted.json").read_text())["events"]
    # each pipeline rank all-reduces its stage's 4 MB of gradients with its other replica:
    # ring over 2 ranks moves 2 (n - 1) / n x 4 MB = 4 MB at 1 GB/s (4 ms) after 2 latencies
    reductions = [event for event in events if event["stream"] == "dp"]
    assert {event["rank"] for event in reductions} == {0, 1}
    for rank in (0, 1):
        seconds = sum(event["end"] - event["start"] for event in reductions if event["rank"] == rank)
        assert seconds == pytest.approx(4e-3 + 2e-4, rel=0.05)
    assert document["predicted_step_time"] > 4e-3


@pytest.mark.timeout(240)
@pytest.mark.parametrize("zero", [1, 2])
def test_compare_predicts_zero_1_and_2_as_the_run_reduces_and_gathers(tmp_path, zero):
    # the executor reduce-scatters the buckets (ZeRO-2: after every backward) and, after the
    # optimizer steps its shard, all-gathers the parameters and waits for them inside the
    # step: the prediction must do the same, not an all-reduce as under DDP
    config = RunConfig(pp=2, dp=2, microbatches=2, batch_size=8, zero=zero)
    parallel = replicas(config)
    assert (parallel.zero, parallel.overlap_param_gather) == (zero, False)
    write_links_and_costs(tmp_path)
    assert main(["compare", *TINY_DP, "--zero", str(zero), "--steps", "3", "--costs", str(tmp_path / "costs.json"),
                 "--topology", str(tmp_path / "links.json"), "--predicted-trace",
                 str(tmp_path / "predicted.json")]) == 0
    events = json.loads((tmp_path / "predicted.json").read_text())["events"]
    for rank in (0, 1):
        mine = [event for event in events if event["rank"] == rank]
        scatters = [event for event in mine if event["kind"] == "REDUCE_SCATTER_DP"]
        gathers = [event for event in mine if event["kind"] == "ALLGATHER_PARAMS"]
        assert not [event for event in mine if event["kind"] == "ALLREDUCE_DP"]
        # a ring of 2 moves (n - 1) / n of the 4 MB each way, at 1 GB/s, after one latency
        assert len(scatters) == (1 if zero == 1 else 2)  # ZeRO-2: each of the 2 backwards
        for event in [*scatters, *gathers]:
            assert event["end"] - event["start"] == pytest.approx(2e-3 + 1e-4, rel=0.05)
        # after the optimizer (no cost given: it follows the last reduction at once)
        assert len(gathers) == 1 and gathers[0]["start"] >= max(event["end"] for event in scatters) - 1e-12
        assert gathers[0]["end"] == pytest.approx(max(event["end"] for event in mine))  # inside the step


def test_compare_refuses_stage_costs_for_a_tensor_parallel_run_in_one_line(capsys):
    # a stage profile times whole stages; the run's own calibration steps time tp shards
    assert main(["compare", *TINY_DP[:-10], "--model", "gpt", "--tp", "2", "--batch-size", "8",
                 "--calibration", "stages"]) == 2
    assert "--calibration stages times whole pipeline stages, not --tp 2 shards" in capsys.readouterr().err
