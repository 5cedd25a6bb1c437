"""What pipesim writes for torchtitan's mixtures of experts runs what pipesim priced.
torchtitan 0.3 folds the routed experts whenever ep > 1 (its sparse mesh: every expert
whole on each rank, ``efsdp * ep = dp_shard * cp * tp``; at ep 1 the experts split over
tp), so a layout with ep > 1 and tp > 1 is written only folded (``etp 1``), folding only
with ep > 1, and ep must divide the FSDP shard x cp x tp ranks. ``export --from-plan``
writes the plan row's experts, combined order and sequence length."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipesim.cli import main
from pipesim.cli.torchtitan import TorchtitanLayout, write_torchtitan
from schedules.generators import generate


def written(folder: Path) -> dict[str, str]:
    words = (folder / "torchtitan.args").read_text().split()
    return {word: words[index + 1] for index, word in enumerate(words[:-1]) if word.startswith("--")}


@pytest.mark.parametrize(("layout", "expected"), [
    (TorchtitanLayout(dp=2, tp=2, fsdp=True, ep=4, sequence_parallel=True),
     "ep 4 with tp 2, the experts split over tp: torchtitan 0.3 folds them whenever ep > 1"),
    (TorchtitanLayout(dp=2, tp=2, fsdp=True, ep=1, etp=1, sequence_parallel=True),
     "etp 1 at ep 1 with tp 2: torchtitan 0.3 splits the experts over tp when ep is 1"),
    (TorchtitanLayout(dp=4, ep=4), "ep 4 must divide torchtitan 0.3's FSDP shard x cp x tp = 1 x 1 x 1 ranks"),
])
def test_expert_layouts_torchtitan_would_run_otherwise_are_refused(tmp_path, layout, expected):
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        write_torchtitan(tmp_path / "out", generate("1f1b", 2, 4), layout)
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_a_folded_layout_is_written_as_torchtitan_folds_it(tmp_path):
    layout = TorchtitanLayout(dp=2, tp=2, fsdp=True, ep=4, etp=1, sequence_parallel=True)
    write_torchtitan(tmp_path, generate("1f1b", 2, 4), layout)
    args = written(tmp_path)
    assert (args["--parallelism.tensor_parallel_degree"], args["--parallelism.expert_parallel_degree"],
            args["--parallelism.data_parallel_shard_degree"]) == ("2", "4", "2")
    # ep cut from dp alone (tp 1) is the same either way
    write_torchtitan(tmp_path / "dp", generate("1f1b", 2, 4), TorchtitanLayout(dp=4, fsdp=True, ep=4))
    assert written(tmp_path / "dp")["--parallelism.expert_parallel_degree"] == "4"


def test_export_from_plan_writes_the_rows_experts_order_and_sequence(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "32", "--global-batch", "64", "--seq-len", "1024",
                 "--schedules", "interleaved-1f1b", "--ep", "8", "--etp", "1", "--ep-overlap", "on",
                 "--constraint", "tp=2", "--top", "1", "--json", str(plan), "--quiet", "--workers", "1"]) == 0
    (row,) = json.loads(plan.read_text())["ranked"]
    assert (row["tp"], row["ep"], row["etp"], row["ep_overlap"], row["seq_len"]) == (2, 8, 1, True, 1024)
    out = tmp_path / "titan"
    assert main(["export", "--from-plan", str(plan), "--fsdp", "--torchtitan", str(out)]) == 0
    args = written(out)
    assert (args["--training.seq_len"], args["--parallelism.expert_parallel_degree"],
            args["--parallelism.tensor_parallel_degree"]) == ("1024", "8", "2")
    assert "OVERLAP_F_B" in (out / "schedule.csv").read_text()  # the combined order the plan simulated
    capsys.readouterr()
    assert main(["export", "--from-plan", str(plan), "--fsdp", "--torchtitan", str(out), "--seq-len", "2048"]) == 2
    assert "layout 1 was planned for 1024-token sequences; drop --seq-len" in capsys.readouterr().err


def test_plan_for_torchtitan_keeps_only_the_expert_layouts_it_runs(tmp_path, capsys):
    """With --torchtitan the plan rules out, by cause, what torchtitan would run otherwise
    than priced; every ranked row's experts are written without refusal."""
    from pipesim.cli.torchtitan import check_experts
    from pipesim.plan.request import Planner, PlanRequest
    from pipesim.plan.torchtitan_experts import TORCHTITAN_FOLDS

    request = PlanRequest(model="mixtral-8x7b", gpus=32, global_batch=64, seq_len=1024, top=40, workers=1,
                          schedules=("1f1b",), torchtitan=True, fsdp=True)
    planner = Planner(request)
    assert planner.ruled_out[TORCHTITAN_FOLDS] > 0
    rows = planner.search().rows[:40]
    assert {row["etp"] for row in rows if row["tp"] > 1 and row["ep"] > 1} == {1}
    for row in rows:
        check_experts(TorchtitanLayout(dp=row["dp"], tp=row["tp"], fsdp=True, ep=row["ep"], etp=row["etp"],
                                       cp=row["cp"], sequence_parallel=row["sequence_parallel"]))
    unfiltered = Planner(PlanRequest(**{**request.__dict__, "torchtitan": False}))
    assert len(unfiltered.layouts) > len(planner.layouts)
