"""Memory per rank: activation stashes from the Trace, static state, OOM flags."""

from __future__ import annotations

import json

import pytest

from pipesim.cli import main
from pipesim.cluster.files import topology_from_dict
from pipesim.cluster.topology import ideal_topology
from pipesim.model.costs import Costs, StageCost
from pipesim.sim.memory import (
    BytesPerParam,
    OutOfMemoryError,
    check_memory,
    memory_report,
    parse_bytes_per_param,
    program_order_trace,
)
from pipesim.sim.step import run_simulation
from schedules import generate
from schedules.generators import GENERATORS, MULTI_CHUNK, ScheduleUnavailableError
from schedules.lowering import lower

STASH = 1e9


def stash_costs(num_stages: int, param_bytes: float = 0.0, act_bytes: float = 0.0) -> Costs:
    stage = StageCost(fwd=1.0, bwd=2.0, stash_bytes=STASH, param_bytes=param_bytes, act_bytes=act_bytes)
    return Costs(stages=(stage,) * num_stages)


@pytest.mark.parametrize("pp,microbatches", [(4, 8), (4, 12), (3, 5)])
def test_rank0_stash_peak_is_p_for_1f1b_and_m_for_gpipe(pp, microbatches):
    one_f_one_b = run_simulation(generate("1f1b", pp, microbatches), stash_costs(pp), ideal_topology())
    gpipe = run_simulation(generate("gpipe", pp, microbatches), stash_costs(pp), ideal_topology())
    assert one_f_one_b.memory[0].peak_stash_bytes == pp * STASH
    assert gpipe.memory[0].peak_stash_bytes == microbatches * STASH
    assert one_f_one_b.memory[-1].peak_stash_bytes == STASH
    timeline = gpipe.memory[0].timeline
    assert timeline[0][0] == 0.0 and timeline[-1][1] == 0.0  # all stashes freed by the end
    assert max(value for _, value in timeline) == microbatches * STASH


def test_static_memory_is_16_bytes_per_parameter_by_default_and_buffers_per_peer():
    params = 1e9  # 2e9 bytes of bf16 weights per stage
    result = run_simulation(generate("1f1b", 2, 2), stash_costs(2, param_bytes=2 * params, act_bytes=1e6),
                            ideal_topology())
    rank = result.memory[0]
    assert rank.static_bytes == pytest.approx(16 * params)
    assert rank.buffer_bytes == pytest.approx(2 * 1e6)  # one peer: activation out, gradient in
    assert rank.peak_bytes == pytest.approx(16 * params + 2e6 + 2 * STASH)
    assert parse_bytes_per_param("4,4,8") == BytesPerParam(4, 4, 8)
    with pytest.raises(ValueError, match="WEIGHTS,GRADS,OPTIMIZER"):
        parse_bytes_per_param("2,2")


SMALL_GPUS = {
    "devices": [{"name": "g0", "memory_bytes": 10e9}, {"name": "g1", "memory_bytes": 10e9}],
    "links": [{"src": "g0", "dst": "g1", "bandwidth": 10e9, "latency": 1e-6}],
}


def test_a_plan_that_does_not_fit_is_flagged():
    result = run_simulation(generate("gpipe", 2, 16), stash_costs(2), topology_from_dict(SMALL_GPUS))
    assert result.oom and result.memory[0].oom
    document = result.to_dict()
    assert document["oom"] is True
    assert document["ranks"][0]["peak_memory_bytes"] == 16 * STASH
    assert "warning: rank 0 on g0 needs 16.00 GB but the device holds 10.00 GB" in result.summary()
    with pytest.raises(OutOfMemoryError, match="rank 0 on g0 peaks at 16.00 GB .* holds 10.00 GB"):
        check_memory(result.memory)
    fits = run_simulation(generate("1f1b", 2, 16), stash_costs(2), topology_from_dict(SMALL_GPUS))
    assert not fits.oom


def test_simulate_fail_on_oom_exits_non_zero_naming_the_rank(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["simulate", "--model", "gpt3-175b", "--pp", "2", "--topology", "nvlink", "--json", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text())["oom"] is True
    assert "out of memory" in capsys.readouterr().out
    assert main([*argv, "--fail-on-oom"]) == 3
    error = capsys.readouterr().err
    assert "out of memory: rank 0 on n0.gpu0 peaks at" in error and "holds 85.52 GB" in error


def run_json(tmp_path, *argv) -> dict:
    out = tmp_path / "r.json"
    assert main(["simulate", *map(str, argv), "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("microbatches", [4, 64])
def test_flag_costs_with_stash_bytes_track_gpipe_in_flight(tmp_path, microbatches):
    """GPipe keeps every microbatch's stash on rank 0: m x --stash-bytes, plus 16 bytes per
    parameter of --param-bytes / 2 (bf16 weights)."""
    document = run_json(tmp_path, "--schedule", "gpipe", "--pp", 4, "-m", microbatches, "--fwd", 1, "--bwd", 2,
                        "--stash-bytes", 1e8, "--param-bytes", 2e9)
    rank = document["ranks"][0]
    assert rank["memory"]["peak_stash_bytes"] == pytest.approx(microbatches * 1e8)
    assert rank["memory"]["static_bytes"] == pytest.approx(16 * 1e9)


def test_without_memory_flags_memory_is_na_not_zero(tmp_path, capsys):
    document = run_json(tmp_path, "--pp", 2, "-m", 4)
    assert all(rank["peak_memory_bytes"] is None for rank in document["ranks"])
    assert "n/a" in capsys.readouterr().out
    assert main(["sweep", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert row.split()[-1] == "n/a"


def test_bytes_per_param_keeps_the_model_parameter_count(tmp_path):
    """4,4,8 (fp32 weights and grads) is 16 bytes per parameter as 2,2,12 is: same static
    memory, not half (the count comes from the model, not from bf16 bytes / 4)."""
    base = ["--model", "gpt3-1.3b", "--pp", 2, "-m", 2, "--layers-per-stage", "12,12"]
    bf16 = run_json(tmp_path, *base)["ranks"][0]["memory"]["static_bytes"]
    fp32 = run_json(tmp_path, *base, "--bytes-per-param", "4,4,8")["ranks"][0]["memory"]["static_bytes"]
    h, vocab, seq = 2048, 50257, 2048
    params = 12 * (12 * h * h + 13 * h) + vocab * h + seq * h
    assert bf16 == pytest.approx(16 * params) and fp32 == pytest.approx(16 * params)
    flags = run_json(tmp_path, "--pp", 2, "-m", 2, "--param-bytes", 4e9, "--bytes-per-param", "4,4,8")
    assert flags["ranks"][0]["memory"]["static_bytes"] == pytest.approx(1e9 * 16)  # 4e9 bytes of fp32 = 1e9


def test_zero1_shards_the_optimizer_state_over_dp(tmp_path):
    base = ["--pp", 2, "-m", 2, "--param-bytes", 2e9, "--dp", 4, "--topology", "nvlink"]
    plain = run_json(tmp_path, *base)["ranks"][0]["memory"]["static_bytes"]
    zero = run_json(tmp_path, *base, "--zero", 1)["ranks"][0]["memory"]["static_bytes"]
    assert plain == pytest.approx(1e9 * (2 + 2 + 12))
    assert zero == pytest.approx(1e9 * (2 + 2 + 12 / 4))


def test_llama3_8b_rank0_memory_by_hand(tmp_path):
    """1F1B pp=4: rank 0 holds 8 layers + the embedding (16 B/param) and the stash of p=4
    microbatches of 8 layers (flash attention: 34h... here GQA/SwiGLU, per token
    2(2h+h+h) + 2(2h+2k) + 2*3f bytes), plus one peer's activation and gradient buffers."""
    document = run_json(tmp_path, "--model", "llama3-8b", "--pp", 4, "-m", 8)
    s, h, kv, f, vocab = 8192, 4096, 1024, 14336, 128256
    layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    static = 16 * (8 * layer + vocab * h)
    stash = 4 * 8 * s * (2 * (2 * h + h + h) + 2 * (2 * h + 2 * kv) + 2 * 3 * f)
    buffers = 2 * s * h * 2
    assert document["ranks"][0]["peak_memory_bytes"] == pytest.approx(static + stash + buffers)
    assert document["ranks"][0]["peak_memory_bytes"] < 80e9  # the 414 GB of the GPT formula without flash is gone


def test_one_entry_costs_file_is_per_rank_like_the_flags(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"stages": [{"fwd": 1.0, "bwd": 2.0, "stash_bytes": 1e9, "param_bytes": 2e9}]}))
    common = ["--schedule", "interleaved-1f1b", "--pp", 2, "-m", 4, "-v", 2]
    from_file = run_json(tmp_path, *common, "--costs", path)
    from_flags = run_json(tmp_path, *common, "--fwd", 1, "--bwd", 2, "--stash-bytes", 1e9, "--param-bytes", 2e9)
    assert from_file["makespan"] == pytest.approx(from_flags["makespan"])
    assert from_file["ranks"][0]["memory"] == from_flags["ranks"][0]["memory"]
    # interleaved, uniform costs, free links: m(F+B) + (p-1)(F+B)/v with F+B per rank = 3
    assert from_file["makespan"] == pytest.approx(4 * 3 + (2 - 1) * 3 / 2)


def test_costs_entries_are_placed_by_their_stage_key(tmp_path):
    from pipesim.model.costs import CostsError, costs_from_dict

    costs = costs_from_dict({"stages": [{"stage": 1, "fwd": 2.0, "bwd": 4.0}, {"stage": 0, "fwd": 1.0, "bwd": 2.0}]},
                            2)
    assert [stage.fwd for stage in costs.stages] == [1.0, 2.0]
    with pytest.raises(CostsError, match="stage 1 is given twice"):
        costs_from_dict({"stages": [{"stage": 1, "fwd": 1, "bwd": 2}, {"stage": 1, "fwd": 1, "bwd": 2}]}, 2)
    with pytest.raises(CostsError, match=r"no costs for stage\(s\) \[1\]"):
        costs_from_dict({"stages": [{"stage": 0, "fwd": 1, "bwd": 2}]}, 2)
    with pytest.raises(CostsError, match="stage 5 is out of range"):
        costs_from_dict({"stages": [{"stage": 5, "fwd": 1, "bwd": 2}, {"stage": 0, "fwd": 1, "bwd": 2}]}, 2)
    with pytest.raises(CostsError, match="give 'stage' on every entry or on none"):
        costs_from_dict({"stages": [{"stage": 0, "fwd": 1, "bwd": 2}, {"fwd": 1, "bwd": 2}]}, 2)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_the_programs_order_gives_the_simulated_peak_of_every_rank(name):
    # Uneven stages (stash and times differ per stage) on links that take time: each rank's
    # peak read off its program order equals the simulated one, for every generator.
    chunks = 2 if name in MULTI_CHUNK else 1
    try:
        schedule = lower(generate(name, 4, 8, chunks))
    except ScheduleUnavailableError:
        pytest.skip(f"{name} has no order for pp 4, m 8")
    stages = tuple(StageCost(fwd=1e-3 * (1 + stage % 3), bwd=2.5e-3 * (1 + stage % 2), wgrad=1e-3,
                             stash_bytes=STASH * (1 + stage), param_bytes=2e9, act_bytes=5e7)
                   for stage in range(schedule.num_stages))
    # and with an embedding-only first stage: no time, no stash (a model without dropout)
    embedding_only = (StageCost(fwd=0.0, bwd=0.0, param_bytes=1e9, act_bytes=5e7), *stages[1:])
    for costs in (Costs(stages=stages), Costs(stages=embedding_only)):
        result = run_simulation(schedule, costs, topology_from_dict(PAIRS_OF_FOUR))
        # DualPipe's two copies reduce their gradients together, so hold a bucket even alone
        ordered = memory_report(program_order_trace(schedule), costs, schedule.placement, result.devices,
                                [80e9] * 4, dp=schedule.copies, bucket_bytes=result.parallel.bucket_bytes,
                                timelines=False)
        assert [rank.peak_bytes for rank in ordered] == [rank.peak_bytes for rank in result.memory]
        assert [rank.peak_stash_bytes for rank in ordered] == [rank.peak_stash_bytes for rank in result.memory]


# Four devices in a line at 10 GB/s with 5 us latency: transfers take time and queue.
PAIRS_OF_FOUR = {
    "devices": [{"name": f"g{index}", "memory_bytes": 80e9} for index in range(4)],
    "links": [{"src": f"g{index}", "dst": f"g{index + 1}", "bandwidth": 10e9, "latency": 5e-6} for index in range(3)],
}


def test_the_headroom_is_kept_back_from_every_device(tmp_path, capsys):
    # One rank on an H100 (81559 MiB, as nvidia-smi reports it): 8.75e9 bf16 bytes of weights
    # = 4.375e9 parameters x 16 bytes = 70 GB static, and a 12 GB stash: an 82 GB peak. The
    # default rule keeps back the CUDA context (426 MiB) and 3% of the peak for fragmentation
    # (one rank joins no NCCL communicator): (85.52 GB - 0.45 GB) / 1.03 = 82.60 GB usable,
    # so it fits; 10% (8.55 GB) leaves 76.97 GB: out of memory; 3 GB leaves 82.52: it fits;
    # 4 GB leaves 81.52: it does not. A 13 GB stash (83 GB) is over the rule's limit.
    capacity = 81559 * 2**20
    usable = (capacity - 426 * 2**20) / 1.03
    base = ["--pp", 1, "-m", 1, "--topology", "nvlink", "--param-bytes", 8.75e9]
    default = run_json(tmp_path, *base, "--stash-bytes", 12e9)
    rank = default["ranks"][0]
    assert rank["peak_memory_bytes"] == pytest.approx(82e9)
    assert rank["memory"]["capacity_bytes"] == capacity
    assert rank["memory"]["usable_bytes"] == pytest.approx(usable)
    assert rank["memory"]["headroom_bytes"] == pytest.approx(capacity - usable) and default["oom"] is False
    for headroom, oom in (("0", False), ("3", False), ("4", True), ("10%", True), ("3%", False), ("auto", False)):
        assert run_json(tmp_path, *base, "--stash-bytes", 12e9, "--memory-headroom", headroom)["oom"] is oom, headroom
    assert run_json(tmp_path, *base, "--stash-bytes", 13e9)["oom"] is True
    capsys.readouterr()
    assert main(["simulate", *map(str, base), "--stash-bytes", "13e9", "--fail-on-oom"]) == 3
    error = capsys.readouterr().err
    assert ("peaks at 83.00 GB" in error and "holds 85.52 GB, 82.60 GB of it usable after the 2.92 GB headroom "
            "(CUDA context 0.45 GB, NCCL 0.00 GB, 3% fragmentation; --memory-headroom)" in error)


@pytest.mark.parametrize("value", ["-1", "100%", "abc", "nan", "inf"])
def test_a_bad_memory_headroom_is_one_line_before_any_work(value, capsys):
    assert main(["simulate", "--pp", "2", "--memory-headroom", value]) == 2
    error = capsys.readouterr().err
    assert f"--memory-headroom {value!r}: expected auto (CUDA context, NCCL buffers and fragmentation)" in error
    assert "a share of each device's memory below 100%" in error
    assert "Traceback" not in error and "step time" not in error
