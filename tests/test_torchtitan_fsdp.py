"""torchtitan's FSDP as it runs a layout's replicas (``pipesim.plan.torchtitan_fsdp``):
ZeRO-3 without pipelining; under torch's pipelining runtime every stage's parameters
(bf16) and gradients (float32) whole for the step, the optimizer state sharded and the
reduce-scatter after the backward. What ``plan --torchtitan --fsdp`` ranks the layouts
by, and ``export --torchtitan --fsdp`` prices a layout by before writing it (refusing
one that does not fit)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pipesim.cli import main
from pipesim.job import Job, simulate_job
from pipesim.plan.request import Planner, PlanRequest
from pipesim.plan.torchtitan_fsdp import TORCHTITAN_FSDP, torchtitan_fsdp_flags, torchtitan_fsdp_job


def test_pipelined_replicas_hold_parameters_and_float32_gradients_whole():
    job = Job(model="gpt3-1.3b", pp=2, dp=4, zero=3, bytes_per_param="2,2,12")
    priced = torchtitan_fsdp_job(job)
    assert (priced.zero, priced.bytes_per_param, priced.no_dp_overlap) == (1, "2,4,12", True)
    assert torchtitan_fsdp_flags(job) == "--zero 1 --bytes-per-param 2,4,12 --no-dp-overlap"


def test_unpipelined_replicas_are_zero_3_with_float32_gradient_shards():
    priced = torchtitan_fsdp_job(Job(model="gpt3-1.3b", pp=1, dp=8, zero=1, bytes_per_param="2,2,16"))
    assert (priced.zero, priced.bytes_per_param, priced.no_dp_overlap) == (3, "2,4,16", False)


def test_one_replica_and_wider_gradients_are_kept():
    job = Job(model="gpt3-1.3b", pp=2, dp=1, zero=0)
    assert torchtitan_fsdp_job(job) == job
    assert torchtitan_fsdp_job(Job(model="gpt3-1.3b", pp=2, dp=2, bytes_per_param="2,8,12")).bytes_per_param == "2,8,12"


def test_the_static_memory_is_each_stages_parameters_at_2_plus_4_plus_12_over_dp():
    """By hand from the rank's parameter count P (ZeRO-0's 16 bytes a parameter): torchtitan
    holds 2 (bf16 parameters) + 4 (float32 gradients) + 12 / dp (master weights and AdamW's
    moments, sharded) bytes a parameter under pipelining, where the plan's ZeRO-3 holds
    16 / dp."""
    base = Job(model="gpt3-1.3b", topology="nvlink", nodes=1, gpu="h100", schedule="1f1b", pp=2, dp=4,
               microbatches=4, seq_len=1024)
    params = [memory.static_bytes / 16 for memory in simulate_job(replace(base, zero=0)).memory]
    ranks = simulate_job(torchtitan_fsdp_job(replace(base, zero=3))).memory
    for count, memory in zip(params, ranks, strict=True):
        assert memory.static_bytes == pytest.approx(count * (2 + 4 + 12 / 4))
    zero3 = simulate_job(replace(base, zero=3)).memory
    for count, memory in zip(params, zero3, strict=True):
        assert memory.static_bytes == pytest.approx(count * 16 / 4)


MIXTRAL_PLAN = ["plan", "--model", "mixtral-8x7b", "--gpus", "16", "--global-batch", "32", "--seq-len", "4096",
                "--topology", "ib", "--gpu", "h100", "--schedules", "1f1b", "--microbatch-sizes", "1", "--constraint",
                "pp=2", "--constraint", "tp=2", "--ep", "2,4", "--workers", "1", "--quiet", "--recompute", "none,full"]


def test_plan_for_torchtitans_fsdp_searches_only_the_zero_stage_it_runs():
    request = PlanRequest(model="llama3-8b", gpus=16, global_batch=64, schedules=("1f1b",), torchtitan=True,
                          fsdp=True, qkv="fused", workers=1)
    planner = Planner(request)
    assert planner.ruled_out[TORCHTITAN_FSDP] > 0
    sharded = [layout for layout in planner.layouts if layout.dp * layout.cp > 1]
    assert sharded and all(layout.zero == (3 if layout.pp == 1 else 1) for layout in sharded)
    assert planner.base.bytes_per_param == "2,4,12"  # float32 gradients, as torchtitan reduces them


def test_plan_ranks_the_layouts_as_torchtitan_runs_them(tmp_path, capsys):
    """Mixtral over pp 2 x tp 2 x dp 4: Megatron-Core's ZeRO-1 fits without recompute
    (76.2 GB); torchtitan's whole stages do not, so for torchtitan the plan ranks only the
    layouts with full recompute, each as `simulate --zero 1 --bytes-per-param 2,4,12
    --no-dp-overlap --cross-entropy torch` (torchtitan's loss) prices it, and writes the
    best."""
    assert main([*MIXTRAL_PLAN, "--json", str(tmp_path / "megatron.json")]) == 0
    megatron = json.loads((tmp_path / "megatron.json").read_text())["ranked"][0]
    assert megatron["recompute"] == "none" and megatron["zero"] == 1
    capsys.readouterr()
    assert main([*MIXTRAL_PLAN, "--json", str(tmp_path / "titan.json"), "--torchtitan", str(tmp_path / "titan"),
                 "--fsdp"]) == 0
    rows = json.loads((tmp_path / "titan.json").read_text())["ranked"]
    assert rows and all(row["recompute"] == "full" and row["zero"] == 1 for row in rows)
    best = rows[0]
    assert main(["simulate", "--model", "mixtral-8x7b", "--seq-len", "4096", "--topology", "ib", "--nodes", "2",
                 "--gpu", "h100", "--schedule", "1f1b", "--pp", "2", "--tp", "2", "--dp", "4", "--ep", str(best["ep"]),
                 "--etp", "1", "--sequence-parallel", "-m", str(best["microbatches"]), "--recompute", "full",
                 "--zero", "1", "--bytes-per-param", "2,4,12", "--no-dp-overlap", "--cross-entropy", "torch",
                 "--json", str(tmp_path / "simulate.json")]) == 0
    simulated = json.loads((tmp_path / "simulate.json").read_text())
    assert simulated["makespan"] == pytest.approx(best["step_time"], rel=1e-12)
    peak = max(rank["peak_memory_bytes"] for rank in simulated["ranks"])
    assert peak == pytest.approx(best["peak_memory_bytes"], rel=1e-12)
    out = capsys.readouterr().out
    assert "torchtitan shards the 4 replicas with FSDP: each stage's parameters whole in bf16" in out
    assert f"wrote {tmp_path / 'titan' / 'schedule.csv'}" in out
    # docs/interop.md's figures: the plan's best without --torchtitan, and that row's layout with the experts
    # folded (as torchtitan runs them) priced as torchtitan's FSDP holds it
    docs = " ".join((Path(__file__).resolve().parents[1] / "docs" / "interop.md").read_text().split())
    best_figures = f"{megatron['step_time']:.3f} s, {megatron['peak_memory_bytes'] / 1e9:.1f} GB"
    assert f"{megatron['layout']}` first ({best_figures})" in docs
    folded = simulate_job(torchtitan_fsdp_job(Job(
        model="mixtral-8x7b", seq_len=4096, topology="ib", nodes=2, gpu="h100", schedule="1f1b", pp=2, tp=2, dp=4,
        ep=megatron["ep"], etp=1, sequence_parallel=True, microbatches=megatron["microbatches"], zero=1,
        cross_entropy="torch")))
    peak = max(memory.peak_bytes for memory in folded.memory)
    usable = min(memory.usable_bytes for memory in folded.memory)
    assert folded.oom and f"would hold {peak / 1e9:.1f} GB of the {usable / 1e9:.1f} usable" in docs


def test_export_notes_how_torchtitan_runs_the_replicas(tmp_path, capsys):
    assert main(["export", "--model", "gpt3-1.3b", "--topology", "nvlink", "--nodes", "1", "--schedule", "1f1b",
                 "--pp", "2", "--dp", "4", "-m", "4", "--zero", "3", "--fsdp", "--torchtitan",
                 str(tmp_path / "titan")]) == 0
    err = capsys.readouterr().err
    assert "note: torchtitan shards the 4 replicas with FSDP: each stage's parameters whole in bf16" in err
    assert "(as chosen: " in err


def test_export_refuses_in_one_line_what_torchtitans_fsdp_would_not_fit(tmp_path, capsys):
    """Llama 3 70B over pp 4 x dp 8: torchtitan holds a stage's 17.6 B parameters at 2 + 4
    bytes each, over 100 GB before any activation."""
    assert main(["export", "--model", "llama3-70b", "--seq-len", "4096", "--topology", "ib", "--nodes", "4", "--gpu",
                 "h100", "--schedule", "1f1b", "--pp", "4", "--dp", "8", "-m", "8", "--zero", "3", "--qkv", "fused",
                 "--fsdp", "--torchtitan", str(tmp_path / "titan")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("pipesim export: error: torchtitan shards the 8 replicas")
    assert error[0].endswith("it does not fit; choose pp 1, more pipeline stages or recompute, or drop --fsdp")
    assert not (tmp_path / "titan").exists()
