"""``pipesim plan`` searches DeepSeek-V3's ``--recompute norm-mla-up`` for models with
latent attention (MLA), and only for those: the row it ranks is the step and memory
``simulate`` gives the same layout, a model without MLA asking for it is refused in one
line, and ``run --plan`` runs such a row."""

from __future__ import annotations

import json

import pytest

from pipesim.cli import main
from pipesim.job import Job, simulate_job
from pipesim.model.spec import BUNDLED_CONFIGS
from pipesim.plan.request import Planner, PlanRequest

CONFIG = BUNDLED_CONFIGS / "deepseek-v3.json"


@pytest.fixture(scope="module")
def small_deepseek(tmp_path_factory) -> str:
    """DeepSeek-V3's config (MLA with a query latent, a dense first layer, routed and shared
    experts) shrunk to four layers of hidden 2048, so a plan of it takes a second."""
    data = json.loads(CONFIG.read_text())
    data.pop("quantization_config", None)
    data.update(num_hidden_layers=4, first_k_dense_replace=1, hidden_size=2048, num_attention_heads=16,
                num_key_value_heads=16, n_routed_experts=16, intermediate_size=4096, moe_intermediate_size=512,
                num_experts_per_tok=4, n_group=4, topk_group=2, q_lora_rank=512, kv_lora_rank=256, vocab_size=32000)
    path = tmp_path_factory.mktemp("deepseek") / "deepseek-v3-small.json"
    path.write_text(json.dumps(data))
    return str(path)


PLAN = ["--gpus", "8", "--global-batch", "16", "--seq-len", "4096", "--topology", "nvlink", "--schedules", "1f1b",
        "--microbatch-sizes", "1", "--zero", "1", "--sequence-parallel", "off", "--constraint", "pp=2",
        "--constraint", "ep=1", "--constraint", "tp=1", "--top", "10", "--workers", "1", "--quiet"]


@pytest.fixture(scope="module")
def planned(small_deepseek, tmp_path_factory) -> tuple[dict, str]:
    """The plan's JSON and printed table for the small DeepSeek-V3, every recompute mode by default."""
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    with pytest.MonkeyPatch.context() as patch:
        lines = []
        patch.setattr("builtins.print", lambda *parts, **_: lines.append(" ".join(map(str, parts))))
        assert main(["plan", "--model", small_deepseek, *PLAN, "--json", str(out)]) == 0
    return json.loads(out.read_text()), "\n".join(lines)


def test_a_model_with_latent_attention_has_its_norm_mla_up_row_searched_and_printed(planned) -> None:
    document, table = planned
    modes = [row["recompute"] for row in document["ranked"]]
    assert sorted(modes) == ["full", "none", "norm-mla-up", "selective"]  # pp 2, dp 4: one layout per mode
    assert "1f1b pp2 tp1 dp4 mbs1 m4 recompute=norm-mla-up zero1" in table


def test_the_norm_mla_up_row_is_what_simulate_gives_the_same_layout(planned, small_deepseek) -> None:
    rows = {row["recompute"]: row for row in planned[0]["ranked"]}
    row = rows["norm-mla-up"]
    job = Job(model=small_deepseek, seq_len=4096, topology="nvlink", nodes=1, schedule="1f1b", pp=2, dp=4,
              microbatches=4, microbatch_size=1, zero=1, recompute="norm-mla-up")
    result = simulate_job(job)
    assert row["step_time"] == pytest.approx(result.metrics.makespan, rel=1e-12)
    assert row["peak_memory_bytes"] == pytest.approx(max(rank.peak_bytes for rank in result.memory), rel=1e-12)
    # what the mode is for: less kept than none (norms' outputs and MLA's Q, K, V are
    # recomputed), more than full; paid for in time between the two
    assert rows["full"]["peak_memory_bytes"] < row["peak_memory_bytes"] < rows["none"]["peak_memory_bytes"]
    assert rows["none"]["step_time"] < row["step_time"] < rows["full"]["step_time"]


def test_only_models_with_latent_attention_search_it_by_default(small_deepseek) -> None:
    def searched(model: str) -> list[str]:
        return Planner(PlanRequest(model=model, gpus=8, global_batch=16, seq_len=4096)).space.recompute

    assert searched(small_deepseek) == ["none", "selective", "norm-mla-up", "full"]
    assert searched("deepseek-v2-lite") == ["none", "selective", "norm-mla-up", "full"]
    assert searched("mixtral-8x7b") == ["none", "selective", "full"]
    assert searched("llama3-8b") == ["none", "selective", "per-op", "full"]  # torchtitan's, for dense models


def test_a_model_without_latent_attention_asking_for_it_is_refused_in_one_line(capsys) -> None:
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8",
                 "--recompute", "none,norm-mla-up"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == ("pipesim plan: error: --recompute norm-mla-up: llama3-8b has no latent "
                                    "attention (MLA), whose up-projections it recomputes (DeepSeek-V3's); use "
                                    "none, selective or full")
    assert captured.out == ""


def test_asked_for_alone_it_is_the_only_mode_searched(small_deepseek, tmp_path) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", small_deepseek, *PLAN, "--recompute", "norm-mla-up", "--json", str(out)]) == 0
    assert {row["recompute"] for row in json.loads(out.read_text())["ranked"]} == {"norm-mla-up"}


def test_run_executes_a_norm_mla_up_row_and_equals_the_one_process_reference(small_deepseek, tmp_path,
                                                                           capsys) -> None:
    """The same plan on 4 GPUs (pp 2 x dp 2): its norm-mla-up row runs through ``run --plan``
    on the model shrunk, and its float64 losses equal the reference's, which recomputes
    nothing."""
    from executor.reference import reference_run  # noqa: PLC0415
    from pipesim.cli import build_parser  # noqa: PLC0415
    from pipesim.cli.plan_row import config_from_plan_row  # noqa: PLC0415

    path = tmp_path / "plan.json"
    four = [*PLAN]
    four[1], four[3] = "4", "8"  # --gpus 4, --global-batch 8
    assert main(["plan", "--model", small_deepseek, *four, "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["ranked"]
    number = 1 + [row["recompute"] for row in rows].index("norm-mla-up")
    argv = ["--plan", str(path), "--row", str(number), "--dtype", "float64", "--steps", "2", "--hidden", "16",
            "--heads", "2", "--seq-len", "8", "--vocab", "37", "--experts", "4", "--ffn-hidden", "32",
            "--optimizer", "adamw"]
    out = tmp_path / "run.json"
    assert main(["run", *argv, "--json", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert f"plan row {number}: {rows[number - 1]['layout']} kept (world 4" in printed
    # DeepSeek-V3's config names a multi-token prediction module, built on the last stage (tp and cp 1)
    assert "multi-token" not in printed
    config, _ = config_from_plan_row(build_parser("run").parse_args(["run", *argv]))
    assert (config.recompute, config.pp, config.dp) == ("norm-mla-up", 2, 2)
    assert json.loads(out.read_text())["losses"] == pytest.approx(reference_run(config)["losses"], abs=1e-10, rel=0)
