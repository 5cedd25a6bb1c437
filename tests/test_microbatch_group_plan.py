"""The planner and interleaved-1f1b's microbatch group N: where equal rounds do not exist
(5 microbatches on 2 ranks) it plans Megatron-Core's smallest group instead of dropping
the schedule, ``--microbatch-group`` searches the groups asked for, and a planned group
reaches simulate, export and run as the row says."""

from __future__ import annotations

import json

import pytest

from pipesim.cli import build_parser, main
from pipesim.cli.plan_row import config_from_plan_row
from pipesim.job import Job
from pipesim.plan.evaluate import LayoutEvaluator
from pipesim.plan.layouts import Layout, SearchSpace, enumerate_layouts, parse_constraints

OUT_OF_RANGE = "microbatch group outside Megatron-Core's range (pp <= N <= m, m mod N zero or >= pp)"


def space(**changes) -> SearchSpace:
    # 2 GPUs, a global batch of 5 sequences, microbatch size 1: pp 2 tp 1 dp 1 (m 5) and pp 1 tp 2 dp 1
    # (m 5); dp 2 does not divide 5 (ruled out).
    fields = dict(gpus=2, gpus_per_node=2, global_batch=5, layers=8, heads=8, kv_heads=8,
                  schedules=("1f1b", "interleaved-1f1b"), microbatch_sizes=(1,), virtual_stages=(2,))
    return SearchSpace(**{**fields, **changes})


def test_where_equal_rounds_do_not_exist_the_smallest_megatron_group_is_planned():
    # 5 microbatches on pp 2: rounds = max(1, 5 // 2) = 2 does not divide 5, so the schedule's
    # own order does not exist; Megatron's range: N = 2 leaves 5 mod 2 = 1 < 2, N = 3 leaves 2 (= pp).
    layouts, _ = enumerate_layouts(space())
    interleaved = [layout for layout in layouts if layout.schedule == "interleaved-1f1b"]
    assert [(layout.pp, layout.microbatches, layout.microbatch_group) for layout in interleaved] == [(2, 5, 3)]
    assert "N3" in interleaved[0].label()
    # where the own group exists (m = 4 on pp 2: N = 2), it is kept as None: the same order
    layouts, _ = enumerate_layouts(space(global_batch=4))
    assert {layout.microbatch_group for layout in layouts} == {None}


def test_asked_for_groups_are_searched_and_those_out_of_range_ruled_out():
    layouts, ruled_out = enumerate_layouts(space(microbatch_groups=(2, 3, 5)))
    groups = sorted(layout.microbatch_group for layout in layouts if layout.schedule == "interleaved-1f1b")
    assert groups == [3, 5]
    assert ruled_out[OUT_OF_RANGE] == 1  # N = 2 on pp 2 with m 5
    # m 8 on pp 2: N = 2 is the own group (None), 4 and 8 are searched besides, 3 leaves 2 (kept)
    layouts, _ = enumerate_layouts(space(global_batch=8, microbatch_groups=(2, 3, 4, 8)))
    groups = {layout.microbatch_group for layout in layouts if layout.schedule == "interleaved-1f1b"
              and layout.pp == 2}
    assert groups == {None, 3, 4, 8}
    assert parse_constraints(["microbatch_group=3,none"]) == {"microbatch_group": {"3", "None"}}


def test_a_grouped_layouts_job_is_the_job_of_its_simulate_command_line():
    evaluator = LayoutEvaluator(Job(model="gpt3-1.3b", topology="nvlink", nodes=1, seq_len=1024))
    layout = Layout("interleaved-1f1b", 2, 1, 1, 2, 1, 5, microbatch_group=3)
    argv = ["simulate", "--model", "gpt3-1.3b", "--topology", "nvlink", "--nodes", "1", "--seq-len", "1024",
            "--schedule", "interleaved-1f1b", "--pp", "2", "--tp", "1", "--dp", "1", "-m", "5",
            "--microbatch-size", "1", "-v", "2", "--microbatch-group", "3"]
    assert evaluator.layout_job(layout) == Job.from_namespace(build_parser().parse_args(argv))


def test_plan_ranks_the_grouped_layout_as_simulate_runs_it(tmp_path):
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt3-1.3b", "--gpus", "2", "--global-batch", "5", "--topology", "nvlink",
                 "--schedules", "interleaved-1f1b", "--microbatch-sizes", "1", "--virtual-stages", "2",
                 "--recompute", "none", "--zero", "0", "--sequence-parallel", "off", "--top", "3", "--workers", "1",
                 "--quiet", "--json", str(plan)]) == 0
    (row,) = [row for row in json.loads(plan.read_text())["ranked"] if row["pp"] == 2]
    assert row["microbatch_group"] == 3
    simulated = tmp_path / "simulate.json"
    assert main(["simulate", "--model", "gpt3-1.3b", "--topology", "nvlink", "--nodes", "1", "--schedule",
                 "interleaved-1f1b", "--pp", "2", "--tp", "1", "--dp", "1", "-m", "5", "--microbatch-size", "1",
                 "-v", "2", "--microbatch-group", "3", "--json", str(simulated)]) == 0
    assert json.loads(simulated.read_text())["makespan"] == pytest.approx(row["step_time"], rel=1e-12)
    # export --from-plan builds the same order (Megatron's N = 3 table, warm-up 2 + 3 on rank 0)
    order = tmp_path / "order.csv"
    assert main(["export", "--from-plan", str(plan), "--plan-rank", "1", "--out", str(order)]) == 0
    first_rank = order.read_text().splitlines()[0].split(",")
    assert first_rank[:6] == ["0F0", "0F1", "0F2", "2F0", "2F1", "2F2"]
    # and run --plan runs it with the same group
    config, _ = config_from_plan_row(build_parser("run").parse_args(["run", "--plan", str(plan), "--row", "1"]))
    assert (config.schedule, config.microbatches, config.microbatch_group) == ("interleaved-1f1b", 5, 3)


def test_plan_refuses_groups_without_the_schedule(capsys):
    assert main(["plan", "--model", "gpt3-1.3b", "--gpus", "2", "--global-batch", "5", "--schedules", "1f1b",
                 "--microbatch-group", "3", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--microbatch-group 3: only interleaved-1f1b runs microbatches in groups" in err
    assert len(err.strip().splitlines()) == 1
