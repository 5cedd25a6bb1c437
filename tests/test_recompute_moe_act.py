"""``--recompute-moe-act`` (Megatron-Core's ``moe_act`` recompute module): the routed
experts keep their activation's inputs, not its output, and every backward re-runs the
activation. What it drops and re-runs, counted by hand, in the simulator's inventory and
in the executor's blocks; pipelined float64 steps on gloo equal to the one-process
reference (which recomputes nothing); the executor's measured peak within 1% of the
prediction under a split backward; bad combinations refused in one line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from executor.config import ConfigError, RunConfig
from executor.models import build_model
from executor.recompute import apply_recompute
from executor.reference import reference_run
from pipesim.cli import build_parser, main
from pipesim.model.activations import layer_stash_bytes
from pipesim.model.compute_model import layer_memory_seconds
from pipesim.model.hf_config import spec_from_hf_config
from pipesim.model.memory_traffic import HBM_EFFICIENCY
from pipesim.model.spec import BUNDLED_CONFIGS, PRESETS, ModelSpecError
from tests.launched_cases import LaunchedCases, assert_equals_reference
from tests.test_executor_memory_prediction import (
    TIGHT_RUN,
    assert_every_block_as_predicted,
    assert_launched_peaks_within,
    measured_block_bytes,
)

pytestmark = pytest.mark.timeout(300)

# Mixtral 8x7B by hand, one sequence of 4,096 a microbatch: 4,096 tokens, 2 of 8 experts a token, each 14,336 wide, bf16
TOKENS, TOP_K, EXPERT_FFN, BF16 = 4096, 2, 14336, 2
MIXTRAL = replace(PRESETS["mixtral-8x7b"], seq_len=4096, microbatch_size=1)


def test_the_routed_experts_drop_their_activation_output_and_nothing_else() -> None:
    assert (MIXTRAL.tokens, MIXTRAL.moe.experts_per_token, MIXTRAL.moe.expert_ffn) == (TOKENS, TOP_K, EXPERT_FFN)
    dropped = replace(MIXTRAL, moe_act_recompute=True)
    for recompute in ("none", "selective", "norm-mla-up"):
        saved = layer_stash_bytes(MIXTRAL, recompute=recompute) - layer_stash_bytes(dropped, recompute=recompute)
        assert saved == TOKENS * TOP_K * EXPERT_FFN * BF16  # the down projections' inputs: 234,881,024 bytes
    assert TOKENS * TOP_K * EXPERT_FFN * BF16 == 234_881_024


def test_under_fp8_caching_the_activation_is_recomputed_already() -> None:
    fp8 = replace(MIXTRAL, fp8=True)
    assert layer_stash_bytes(replace(fp8, moe_act_recompute=True)) == layer_stash_bytes(fp8)
    bandwidth = 4.8e12
    assert (layer_memory_seconds(replace(fp8, moe_act_recompute=True), bandwidth)
            == layer_memory_seconds(fp8, bandwidth))


@pytest.mark.parametrize("tp", [1, 2])
def test_every_backward_reruns_the_routed_activation(tp: int) -> None:
    """SwiGLU over the routed copies reads the gate and up outputs and writes their
    product: 3 x 2 x 14,336 elements a token, streamed at the memory-bound kernels'
    efficiency; the forward is unchanged."""
    bandwidth = 4.8e12
    forward, backward = layer_memory_seconds(MIXTRAL, bandwidth, tp=tp)
    forward_moe_act, backward_moe_act = layer_memory_seconds(replace(MIXTRAL, moe_act_recompute=True), bandwidth,
                                                             tp=tp)
    assert forward_moe_act == forward
    rerun_bytes = TOKENS * 3 * TOP_K * EXPERT_FFN * BF16 / tp
    assert backward_moe_act - backward == pytest.approx(rerun_bytes / (bandwidth * HBM_EFFICIENCY), rel=1e-12)


def test_the_shared_experts_keep_their_activation_output() -> None:
    """Qwen1.5-MoE's shared expert (5,632 wide) is left whole: only the 4 routed copies'
    1,408 columns each are dropped."""
    with open(BUNDLED_CONFIGS / "qwen1.5-moe-a2.7b.json") as handle:
        spec = spec_from_hf_config(json.load(handle), seq_len=4096)
    assert (spec.moe.experts_per_token, spec.moe.expert_ffn, spec.moe.shared_ffn) == (4, 1408, 5632)
    saved = layer_stash_bytes(spec) - layer_stash_bytes(replace(spec, moe_act_recompute=True))
    assert saved == spec.tokens * 4 * 1408 * spec.dtype_bytes


def test_a_dense_spec_refuses_it() -> None:
    with pytest.raises(ModelSpecError, match="no mixture of experts"):
        replace(PRESETS["llama3-8b"], moe_act_recompute=True)


@pytest.mark.parametrize(("flags", "message"), [
    (["--model", "llama3-8b"], "--recompute-moe-act: llama3-8b has no mixture of experts"),
    (["--model", "mixtral-8x7b", "--recompute", "full"],
     "--recompute-moe-act conflicts with --recompute full: full recompute already re-runs the whole layer"),
    (["--model", "mixtral-8x7b", "--recompute", "per-op"], "--recompute-moe-act conflicts with --recompute per-op"),
])
def test_simulate_refuses_what_it_cannot_mean_in_one_line(flags, message, capsys) -> None:
    assert main(["simulate", *flags, "--recompute-moe-act"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_simulate_reports_the_smaller_peak(tmp_path) -> None:
    """pp 2 of a 4-layer Mixtral, 1F1B with 4 microbatches: rank 0 holds 2 microbatches of
    its 2 layers when its peak comes, so its peak falls by 2 x 2 x 234,881,024 bytes."""
    def peak(extra: list[str]) -> float:
        out = tmp_path / f"run{len(extra)}.json"
        assert main(["simulate", "--model", "mixtral-8x7b", "--layers", "4", "--pp", "2", "-m", "4",
                     "--seq-len", "4096", "--microbatch-size", "1", "--schedule", "1f1b", "--json", str(out),
                     *extra]) == 0
        return json.loads(out.read_text())["ranks"][0]["peak_memory_bytes"]

    assert peak([]) - peak(["--recompute-moe-act"]) == pytest.approx(2 * 2 * 234_881_024, rel=1e-9)


SIZES = {"layers": 1, "hidden": 32, "heads": 4, "seq_len": 16, "batch_size": 1, "microbatches": 1, "pp": 1}


GPT_OSS = "gpt-oss-20b"


@pytest.mark.parametrize(("model", "kept_per_copy"), [("mixtral-8x7b", 4), (GPT_OSS, 7)])
def test_the_executors_experts_keep_the_gate_and_up_outputs_alone(model: str, kept_per_copy: int) -> None:
    """16 tokens x top-k routed copies, float32. Without it each copy's expert keeps
    ``4f`` (SwiGLU: the gate and up outputs, silu(gate), their product) or gpt-oss's
    clamped SwiGLU ``7f``; with it the checkpoint's two inputs, ``2f``."""
    config = RunConfig(model=model, **SIZES, experts=4)
    dropped = replace(config, recompute_moe_act=True)
    spec = build_model(config).spec
    copies = 16 * spec.moe.experts_per_token
    freed = (kept_per_copy - 2) * spec.moe.expert_ffn * copies * 4
    assert measured_block_bytes(config) - measured_block_bytes(dropped) == freed
    assert_every_block_as_predicted(dropped)


@pytest.mark.parametrize("recompute", ["none", "selective", "norm-mla-up"])
def test_gradients_are_those_of_a_run_without_it(recompute: str) -> None:
    def one_process(moe_act: bool) -> tuple[float, dict]:
        config = RunConfig(model=GPT_OSS, **{**SIZES, "layers": 2, "batch_size": 2},
                           experts=4, dtype="float64", recompute=recompute)
        torch.manual_seed(0)
        built = build_model(config)
        stage = built.build_stage(0, 1)
        apply_recompute(stage, recompute, moe_act)
        inputs, targets = built.make_batch(0, 2)
        loss = built.loss_sum(stage(inputs), targets)
        loss.backward()
        return loss.item(), {name: p.grad for name, p in stage.named_parameters()}

    (plain_loss, plain), (loss, grads) = one_process(False), one_process(True)
    assert loss == plain_loss
    assert plain.keys() == grads.keys()
    for name, grad in plain.items():
        assert torch.equal(grads[name], grad), name


def test_run_refuses_what_it_cannot_mean_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"--recompute-moe-act recomputes the routed experts' activation of a "
                                          r"mixture-of-experts model; use e\.g\. --model mixtral-8x7b \(got --model "
                                          r"llama3-8b\)"):
        RunConfig(model="llama3-8b", recompute_moe_act=True).check()
    with pytest.raises(ConfigError, match="--recompute-moe-act conflicts with --recompute full"):
        RunConfig(model="mixtral-8x7b", recompute="full", recompute_moe_act=True).check()


# 4 ranks each, launched together
MOE_ACT_CASES = LaunchedCases(
    {"hidden": 16, "heads": 4, "seq_len": 8, "vocab": 37, "batch_size": 4, "steps": 2, "dtype": "float64",
     "optimizer": "adamw", "lr": 0.02, "return_grads": True, "recompute_moe_act": True, "experts": 4,
     "ffn_hidden": 32, "model": "mixtral-8x7b", "layers": 2, "pp": 2, "dp": 2, "microbatches": 2,
     "schedule": "1f1b"},
    {4: {"1f1b-dp2": {},
         "zb-h1-split-backward": {"schedule": "zb-h1"},
         "ep2-dp2": {"ep": 2},
         "tp2-sp": {"dp": 1, "tp": 2, "sequence_parallel": True, "kv_heads": 2},
         "gpt-oss-zbv-norm-mla-up": {"model": GPT_OSS, "schedule": "zbv", "virtual_stages": 2, "layers": 4,
                                     "recompute": "norm-mla-up"},
         "selective-dualpipev": {"schedule": "dualpipev", "virtual_stages": 2, "layers": 4, "microbatches": 4,
                                 "batch_size": 8, "recompute": "selective"}}})


@pytest.mark.parametrize("name", MOE_ACT_CASES.cases)
def test_pipelined_step_equals_the_reference_without_recompute(name: str) -> None:
    assert_equals_reference(MOE_ACT_CASES.result(name), reference_run(MOE_ACT_CASES.config(name)))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_launched_peak_within_one_percent_of_the_prediction(schedule: str) -> None:
    """Under a split backward the rebuilt activation output is held from ``I`` until the
    down projection's ``W`` reads it: predicted so (``rebuilt_until_weight_grad_bytes``)."""
    assert_launched_peaks_within(RunConfig(**TIGHT_RUN, model="mixtral-8x7b", schedule=schedule, experts=4,
                                           recompute_moe_act=True), 0.01)


OLMOE = "olmoe-1b-7b"
PLAN_FLAGS = ["--gpus", "2", "--global-batch", "4", "--seq-len", "64", "--topology", "ideal", "--top", "1000",
              "--quiet", "--workers", "1", "--schedules", "1f1b"]


@pytest.fixture(scope="module")
def moe_act_plan(tmp_path_factory):
    """Three real plans of OLMoE on 2 GPUs: the experts' activation recomputed off (the
    default), on (the flag alone) and both searched (``off,on``), every layout ranked."""
    folder = tmp_path_factory.mktemp("plan")
    paths = {}
    for name, extra in (("off", []), ("on", ["--recompute-moe-act"]), ("both", ["--recompute-moe-act", "off,on"])):
        paths[name] = folder / f"{name}.json"
        assert main(["plan", "--model", OLMOE, *PLAN_FLAGS, "--json", str(paths[name]), *extra]) == 0
    return {name: json.loads(path.read_text())["ranked"] for name, path in paths.items()} | {"paths": paths}


def without_moe_act(row: dict) -> tuple:
    return tuple(row[name] for name in ("schedule", "pp", "tp", "dp", "virtual_stages", "microbatch_size",
                                        "microbatches", "recompute", "zero", "sequence_parallel", "ep", "cp",
                                        "ep_overlap", "etp"))


def test_a_plan_searches_it_off_on_or_both(moe_act_plan) -> None:
    off, on, both = moe_act_plan["off"], moe_act_plan["on"], moe_act_plan["both"]
    assert {row["recompute_moe_act"] for row in off} == {False}
    assert {row["recompute_moe_act"] for row in on} == {True}
    assert {row["recompute"] for row in on} == {"none", "selective"}  # full and per-op are not searched beside it
    assert len(both) == len(off) + len(on)  # each layout off, and on where its recompute goes with it
    assert all(row["layout"].endswith(" moe-act") for row in on)
    by_layout = {(without_moe_act(row), row["recompute_moe_act"]): row for row in both}
    for row in on:
        plain = by_layout[without_moe_act(row), False]
        # the activation's output no longer kept: less memory; re-run in every backward: no faster
        assert row["peak_memory_bytes"] < plain["peak_memory_bytes"]
        assert row["step_time"] >= plain["step_time"]


def test_a_plan_prices_every_layout_with_it_as_simulate_does(moe_act_plan, tmp_path) -> None:
    row = moe_act_plan["on"][0]
    out = tmp_path / "simulated.json"
    assert main(["simulate", "--model", OLMOE, "--seq-len", "64", "--topology", "ideal", "--schedule",
                 row["schedule"], "--pp", str(row["pp"]), "-m", str(row["microbatches"]), "--dp", str(row["dp"]),
                 "--ep", str(row["ep"]), "--microbatch-size", str(row["microbatch_size"]), "--zero", str(row["zero"]),
                 "--recompute", row["recompute"], *(["--ep-overlap"] if row["ep_overlap"] else []),
                 "--recompute-moe-act", "--json", str(out)]) == 0
    simulated = json.loads(out.read_text())
    assert simulated["makespan"] == pytest.approx(row["step_time"], rel=1e-9)
    assert max(rank["peak_memory_bytes"] for rank in simulated["ranks"]) == pytest.approx(row["peak_memory_bytes"],
                                                                                          rel=1e-9)


def test_run_plan_row_recomputes_as_the_plan_priced(moe_act_plan) -> None:
    from pipesim.cli.plan_row import config_from_plan_row

    def planned(path, number, *extra):
        return config_from_plan_row(build_parser("run").parse_args(["run", "--plan", str(path), "--row", str(number),
                                                                     *extra]))[0]
    both, path = moe_act_plan["both"], moe_act_plan["paths"]["both"]
    for number, row in enumerate(both[:6], start=1):
        assert planned(path, number).recompute_moe_act == row["recompute_moe_act"]
    with pytest.raises(ConfigError, match="--recompute-moe-act conflicts with --plan"):
        planned(moe_act_plan["paths"]["off"], 1, "--recompute-moe-act")


def test_a_plan_refuses_it_where_it_cannot_mean_anything(capsys) -> None:
    assert main(["plan", "--model", OLMOE, *PLAN_FLAGS, "--recompute-moe-act", "--recompute", "none,full"]) == 2
    assert "--recompute full conflicts with --recompute-moe-act" in capsys.readouterr().err
    assert main(["plan", "--model", OLMOE, *PLAN_FLAGS, "--recompute-moe-act", "--torchtitan", "out"]) == 2
    assert "--recompute-moe-act conflicts with --torchtitan" in capsys.readouterr().err
    assert main(["plan", "--model", "llama3-8b", *PLAN_FLAGS, "--recompute-moe-act", "off,on"]) == 2
    assert "--recompute-moe-act: llama3-8b has no mixture of experts" in capsys.readouterr().err
    assert main(["plan", "--model", OLMOE, *PLAN_FLAGS, "--recompute-moe-act", "maybe"]) == 2
    assert "--recompute-moe-act" in capsys.readouterr().err


def test_the_published_recipes_that_recompute_moe_act_run_with_it_and_the_zoos_layout_fits() -> None:
    """gpt-oss-120b's Megatron-Bridge recipe and the Megatron-Core MoE team's first two
    Qwen3-235B-A22B layouts recompute ``layernorm`` and ``moe_act``; the combined-1F1B
    layout ran on its 80 GB H100s, so it must fit them (without moe_act pipesim put its
    fullest rank at 80.7 GB against 79.3 usable)."""
    from benchmarks.published_overlap import ZOO_SOURCE, mixture_of_experts, model_zoo
    from pipesim.job import Job, simulate_job

    recomputing = [run for run in [*mixture_of_experts(), *model_zoo()]
                   if run.label.startswith("gpt-oss") or (run.source == ZOO_SOURCE and run.recompute != "none")]
    assert len(recomputing) == 7
    for run in recomputing:
        assert "--recompute-moe-act" in run.argv() and run.recompute == "norm-mla-up", run.label
    (combined,) = [run for run in recomputing if run.ep_overlap]
    job = Job.from_namespace(build_parser("simulate").parse_args(["simulate", *combined.argv()]))
    result = simulate_job(job)
    assert not result.oom


def test_export_for_torchtitan_refuses_it_before_writing(tmp_path, capsys) -> None:
    """torchtitan has no recompute of the experts' activation alone: its files would not
    run what pipesim priced."""
    folder = tmp_path / "titan"
    assert main(["export", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--model", "mixtral-8x7b",
                 "--torchtitan", str(folder), "--recompute-moe-act"]) == 2
    assert "--recompute-moe-act: torchtitan 0.3 has no recompute of the routed experts' activation alone" in \
        capsys.readouterr().err
    assert not folder.exists()
