"""``pipesim plan`` searches combined 1F1B (``--ep-overlap``) for a mixture of experts:
the layouts it tries are those Megatron-Core runs (written out here by hand), each row is
what ``pipesim simulate --ep-overlap`` prints for it, its lower bound stays below its
step, and ``pipesim run --plan --row N`` runs such a row with the losses of the
one-process reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from executor.reference import reference_run
from pipesim.cli import build_parser, main
from pipesim.cli.plan_row import config_from_plan_row
from pipesim.plan.layouts import Layout, SearchSpace, enumerate_layouts, parse_constraints
from pipesim.plan.request import Planner, PlanRequest
from tests.cli_runs import assert_one_line_error
from tests.plan_moe import mixtral_evaluator, row_as_simulated

pytestmark = pytest.mark.timeout(300)


def moe_space(**changes) -> SearchSpace:
    fields = dict(gpus=8, gpus_per_node=4, global_batch=16, layers=8, heads=8, kv_heads=8,
                  schedules=("1f1b", "interleaved-1f1b", "zb-h1", "gpipe"), microbatch_sizes=(1, 2),
                  virtual_stages=(2,), recompute=("none", "full"), experts=8, expert_parallel=(1, 2, 4),
                  ep_overlap=(False, True))
    fields.update(changes)
    return SearchSpace(**fields)


def megatron_runs_combined(layout: Layout) -> bool:
    """Where Megatron-Core runs --overlap-moe-expert-parallel-comm (its schedules.py and
    arguments checks, read by hand): expert parallelism, the interleaved schedule or 1F1B
    without a pipeline, and no full recompute."""
    return (layout.ep > 1 and layout.recompute != "full"
            and (layout.schedule == "interleaved-1f1b" or (layout.schedule == "1f1b" and layout.pp == 1)))


def test_combined_layouts_are_exactly_the_twins_megatron_runs():
    layouts, _ = enumerate_layouts(moe_space())
    off = {layout for layout in layouts if not layout.ep_overlap}
    on = {layout for layout in layouts if layout.ep_overlap}
    assert on == {layout._replace(ep_overlap=True) for layout in off if megatron_runs_combined(layout)}
    assert on and {layout.schedule for layout in on} == {"1f1b", "interleaved-1f1b"}
    assert {layout.pp for layout in on if layout.schedule == "1f1b"} == {1}
    # searched off only (the default for a dense model), nothing combined is enumerated
    without, _ = enumerate_layouts(moe_space(ep_overlap=(False,)))
    assert set(without) == off


def test_a_combined_layout_is_labelled_and_constrained_by_name():
    layout = Layout("interleaved-1f1b", 2, 1, 4, 2, 1, 4, ep=2, ep_overlap=True)
    assert layout.label() == "interleaved-1f1b v2 pp2 tp1 dp4 ep2 mbs1 m4 ep-overlap"
    assert parse_constraints(["ep_overlap=on"]) == {"ep_overlap": {"True"}}
    assert parse_constraints(["ep-overlap=false,true"]) == {"ep_overlap": {"False", "True"}}
    with pytest.raises(ValueError, match="ep_overlap is on or off"):
        parse_constraints(["ep_overlap=maybe"])
    kept, _ = enumerate_layouts(moe_space(constraints=parse_constraints(["ep_overlap=on"])))
    assert kept and all(layout.ep_overlap for layout in kept)


def test_the_default_searches_both_for_experts_and_off_for_a_dense_model():
    moe = Planner(PlanRequest(model="mixtral-8x7b", gpus=8, global_batch=8, workers=1))
    dense = Planner(PlanRequest(model="llama3-8b", gpus=8, global_batch=8, workers=1))
    assert moe.space.ep_overlap == [False, True] and any(layout.ep_overlap for layout in moe.layouts)
    assert dense.space.ep_overlap == [False] and not any(layout.ep_overlap for layout in dense.layouts)
    with pytest.raises(ValueError, match="--ep-overlap on: llama3-8b has no experts"):
        Planner(PlanRequest(model="llama3-8b", gpus=8, global_batch=8, ep_overlap=[True]))


PLAN = ["plan", "--gpus", "8", "--global-batch", "8", "--quiet", "--model"]


@pytest.mark.parametrize(("args", "message"), [
    (["mixtral-8x7b", "--ep-overlap", "sometimes"], "--ep-overlap: unknown sometimes; available: off, on"),
    (["mixtral-8x7b", "--ep-overlap", ""], "--ep-overlap: unknown ''"),
    (["llama3-8b", "--ep-overlap", "on"], "--ep-overlap on: llama3-8b has no experts"),
    (["mixtral-8x7b", "--etp", "2"], "--etp: unknown 2; available: tp, 1"),
    (["llama3-8b", "--etp", "1"], "--etp 1: llama3-8b has no experts to fold"),
])
def test_bad_moe_plan_values_are_one_line_errors(capsys, args, message):
    assert_one_line_error(capsys, PLAN + args, message)


moe_evaluator = pytest.fixture(scope="module")(mixtral_evaluator)


def test_a_combined_row_is_what_simulate_ep_overlap_prints(moe_evaluator):
    layout = Layout("interleaved-1f1b", 2, 2, 4, 2, 1, 8, zero=1, sequence_parallel=True, ep=4, ep_overlap=True)
    assert moe_evaluator.layout_job(layout).ep_overlap
    row = row_as_simulated(moe_evaluator, layout)
    # the same layout with the all-to-alls exposed: combined hides some, at one more
    # warm-up microbatch's memory
    exposed = moe_evaluator.evaluate(layout._replace(ep_overlap=False))
    assert row["step_time"] < exposed["step_time"]
    assert row["peak_memory_bytes"] > exposed["peak_memory_bytes"]


@pytest.mark.parametrize("schedule, pp, chunks", [("interleaved-1f1b", 2, 2), ("interleaved-1f1b", 4, 2),
                                                   ("1f1b", 1, 1)])
def test_the_bounds_of_a_combined_layout_stay_below_its_step(moe_evaluator, schedule, pp, chunks):
    simulated = 0
    for tp, zero, recompute in ((1, 0, "none"), (2, 1, "selective"), (1, 3, "none"), (2, 3, "selective")):
        dp = 16 // (pp * tp)
        layout = Layout(schedule, pp, tp, dp, chunks, 1, 2 * pp, recompute, zero, sequence_parallel=tp > 1, ep=2,
                        ep_overlap=True)
        row = moe_evaluator.evaluate(layout)
        if "rejected" in row:  # Mixtral's 47B parameters do not fit one rank without ZeRO-3
            continue
        order = moe_evaluator.order_of(layout._replace(zero=0), None)
        assert any(order.fused)
        bound = moe_evaluator.order_bound(layout, order)
        assert moe_evaluator.lower_bound(layout) <= bound <= row["step_time"] * (1 + 1e-9), layout.label()
        simulated += 1
    assert simulated >= 2


def test_a_planned_combined_row_runs_and_equals_the_one_process_reference(tmp_path: Path, capsys):
    """A real plan of Mixtral on 4 GPUs searching combined 1F1B: its interleaved pp 2 x
    dp 2 x ep 2 row with ep-overlap runs (world 4, gloo) as combined 1F1B on a shrunk
    Mixtral, losses equal to the one-process reference."""
    path = tmp_path / "plan.json"
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "4", "--global-batch", "8", "--seq-len", "1024",
                 "--topology", "ideal", "--top", "20", "--json", str(path), "--quiet", "--workers", "1",
                 "--schedules", "interleaved-1f1b", "--ep", "2", "--zero", "0", "--ep-overlap", "on", "--etp", "tp",
                 "--constraint", "pp=2", "--constraint", "recompute=none", "--constraint", "tp=1"]) == 0
    rows = json.loads(path.read_text())["ranked"]
    assert rows and all(row["ep_overlap"] and row["layout"].endswith("ep-overlap") for row in rows)
    number = 1
    argv = ["--plan", str(path), "--row", str(number), "--dtype", "float64", "--steps", "2", "--layers", "4",
            "--hidden", "16", "--seq-len", "8", "--vocab", "37", "--optimizer", "adamw"]
    config = config_from_plan_row(build_parser("run").parse_args(["run", *argv]))[0]
    assert (config.schedule, config.pp, config.dp, config.ep, config.ep_overlap) == \
           ("interleaved-1f1b", 2, 2, 2, True)
    out = tmp_path / "run.json"
    assert main(["run", *argv, "--json", str(out), "--quiet"]) == 0
    capsys.readouterr()
    document = json.loads(out.read_text())
    assert document["ep_overlap"] is True
    assert document["losses"] == pytest.approx(reference_run(config)["losses"], abs=1e-10, rel=0)


def test_a_run_flag_the_row_fixes_is_refused(tmp_path: Path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"ranked": [{"schedule": "1f1b", "pp": 1, "tp": 1, "dp": 2, "virtual_stages": 1,
                                            "microbatch_size": 1, "microbatches": 2, "recompute": "none", "zero": 0,
                                            "sequence_parallel": False, "ep": 2, "ep_overlap": "yes",
                                            "layout": "1f1b pp1 dp2 ep2"}]}))
    with pytest.raises(ValueError, match="--ep-overlap conflicts with --plan"):
        config_from_plan_row(build_parser("run").parse_args(["run", "--plan", str(path), "--ep-overlap"]))
    with pytest.raises(ValueError, match="plan row 1: ep_overlap must be true or false, got 'yes'"):
        config_from_plan_row(build_parser("run").parse_args(["run", "--plan", str(path)]))


def test_experts_with_tensor_parallelism_and_no_sequence_parallelism_are_ruled_out_not_simulated():
    """Megatron-LM refuses ep with tp > 1 unless sequence parallelism is on (its dispatcher
    sends each tp rank's shard); the plan rules those candidates out by that cause instead
    of simulating each into the same error."""
    from pipesim.plan.layouts import EP_TP_WITHOUT_SP

    space = moe_space(sequence_parallel=(False, True), ep_overlap=(False,))
    layouts, rejected = enumerate_layouts(space)
    assert not [layout for layout in layouts if layout.ep > 1 and layout.tp > 1 and not layout.sequence_parallel]
    assert [layout for layout in layouts if layout.ep > 1 and layout.tp > 1]  # with sp they stay
    # by hand: tp 2 (pp 1, 2, 4) and tp 4 (pp 1, 2) give dp 4, 2, 1 and 2, 1; ep 2 and 4 cut from dp;
    # per (tp, pp) each ep <= dp, times 2 microbatch sizes, 2 recompute modes, and the schedules
    # at that pp (1 at pp 1; 1f1b, zb-h1, gpipe and interleaved v2 at pp 2; at pp 4 too, 4 x 2 <= 10).
    pairs = {(2, 1): 4, (2, 2): 2, (2, 4): 1, (4, 1): 2, (4, 2): 1}  # (tp, pp): dp
    expected = sum(len([ep for ep in (2, 4) if ep <= dp]) * 2 * 2 * (1 if pp == 1 else 4)
                   for (tp, pp), dp in pairs.items())
    assert rejected[EP_TP_WITHOUT_SP] == expected
