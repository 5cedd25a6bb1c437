"""``pipesim export --from-plan``: the row's model is the one exported, as ``run --plan``
runs it. The model decides what torchtitan is told (its layers per stage and sequence
length), so these tests read ``torchtitan.args``: GPT-3 1.3B has 24 layers and 2,048-token
sequences (Brown et al. 2020, Table 2.1), GPT-2 small 12 layers and 1,024 positions (its
config file)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipesim.cli import main
from pipesim.model.spec import BUNDLED_CONFIGS

GPT2_CONFIG = BUNDLED_CONFIGS / "gpt2.json"


def run(*argv) -> int:
    return main([str(arg) for arg in argv])


def plan_file(tmp_path: Path, **fields) -> Path:
    """A plan with one 1F1B pp 2 row, as ``pipesim plan --json`` writes its rows."""
    row = {"schedule": "1f1b", "pp": 2, "tp": 1, "dp": 1, "virtual_stages": 1, "microbatch_size": 1,
           "microbatches": 4, "recompute": "none", "zero": 0, "sequence_parallel": False, "cp": 1, "ep": 1,
           "microbatch_group": None, "layout": "1f1b pp2 tp1 dp1 mbs1 m4", **fields}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"ranked": [row], "considered": 1}))
    return path


def torchtitan_args(folder: Path) -> dict[str, str]:
    """``--key value`` pairs of the written ``torchtitan.args``."""
    words = (folder / "torchtitan.args").read_text().split()
    return {word: words[i + 1] for i, word in enumerate(words[:-1]) if word.startswith("--")
            and not words[i + 1].startswith("--")}


def test_the_rows_model_is_exported_without_model(tmp_path):
    plan = plan_file(tmp_path, model="gpt3-1.3b")
    assert run("export", "--from-plan", plan, "--row", 1, "--torchtitan", tmp_path / "planned") == 0
    written = torchtitan_args(tmp_path / "planned")
    assert written["--parallelism.pipeline_parallel_layers_per_stage"] == "12"  # 24 layers over 2 stages
    assert written["--training.seq_len"] == "2048"
    # the same files as naming the model by hand
    assert run("export", "--from-plan", plan, "--model", "gpt3-1.3b", "--torchtitan", tmp_path / "named") == 0
    for name in ("schedule.csv", "schedule-lowered.csv", "torchtitan.args"):
        assert ((tmp_path / "planned" / name).read_text().replace(str(tmp_path / "planned"), "DIR")
                == (tmp_path / "named" / name).read_text().replace(str(tmp_path / "named"), "DIR")), name


def test_a_config_file_row_accepts_the_same_file_by_a_relative_path(tmp_path, monkeypatch):
    plan = plan_file(tmp_path, model=str(GPT2_CONFIG.resolve()))
    monkeypatch.chdir(GPT2_CONFIG.parent)
    assert run("export", "--from-plan", plan, "--model", os.path.join(".", GPT2_CONFIG.name),
               "--torchtitan", tmp_path / "t") == 0
    written = torchtitan_args(tmp_path / "t")
    assert written["--parallelism.pipeline_parallel_layers_per_stage"] == "6"  # 12 layers over 2 stages
    assert written["--training.seq_len"] == "1024"


def test_another_model_is_refused_in_one_line(tmp_path, capsys):
    plan = plan_file(tmp_path, model="gpt3-1.3b")
    assert run("export", "--from-plan", plan, "--model", "llama3-8b", "--out", tmp_path / "order.csv") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert (f"--model llama3-8b conflicts with --from-plan {plan}: layout 1 was planned for gpt3-1.3b; "
            "drop --model") in err
    assert not (tmp_path / "order.csv").exists()


def test_a_row_without_a_model_leaves_it_to_the_flags(tmp_path):
    plan = plan_file(tmp_path)  # written before rows named their model
    assert run("export", "--from-plan", plan, "--torchtitan", tmp_path / "bare") == 0
    assert "--training.seq_len" not in torchtitan_args(tmp_path / "bare")
    assert run("export", "--from-plan", plan, "--model", "llama3-8b", "--torchtitan", tmp_path / "llama") == 0
    written = torchtitan_args(tmp_path / "llama")
    assert written["--parallelism.pipeline_parallel_layers_per_stage"] == "16"  # Llama 3 8B: 32 layers
    assert written["--training.seq_len"] == "8192"


def test_a_row_with_cp_and_ep_is_exported_as_plan_writes_it(tmp_path):
    """plan's own --torchtitan and export --from-plan (no --model, no --cp/--ep: export has
    neither flag) write the same files for a Mixtral row with cp 2 and ep 2."""
    plan = tmp_path / "plan.json"
    assert run("plan", "--model", "mixtral-8x7b", "--gpus", 4, "--global-batch", 4, "--seq-len", 16384,
               "--topology", "ideal", "--top", 1, "--workers", 1, "--quiet", "--schedules", "1f1b", "--cp", 2,
               "--ep", 2, "--json", plan, "--torchtitan", tmp_path / "planned", "--fsdp") == 0
    (row,) = json.loads(plan.read_text())["ranked"]
    assert (row["cp"], row["ep"]) == (2, 2)
    assert run("export", "--from-plan", plan, "--seq-len", 16384, "--topology", "ideal", "--nodes", 1, "--fsdp",
               "--torchtitan", tmp_path / "exported") == 0
    written = torchtitan_args(tmp_path / "exported")
    assert (written["--parallelism.context_parallel_degree"], written["--parallelism.expert_parallel_degree"]) == \
           ("2", "2")
    for name in ("schedule.csv", "schedule-lowered.csv", "torchtitan.args"):
        assert ((tmp_path / "planned" / name).read_text().replace(str(tmp_path / "planned"), "DIR")
                == (tmp_path / "exported" / name).read_text().replace(str(tmp_path / "exported"), "DIR")), name
