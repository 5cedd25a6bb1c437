"""``pipesim plan`` searches parallel folding (``--etp 1``, Megatron-Core's
``--expert-tensor-parallel-size 1``) for a mixture of experts: the folded layouts it tries
are written out here by hand, each row is what ``pipesim simulate --etp 1`` prints for
it, its bounds stay below its step, and ``pipesim run --plan --row N`` runs such a row
folded, with the losses of the one-process reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from executor.reference import reference_run
from pipesim.cli import build_parser, main
from pipesim.cli.plan_row import config_from_plan_row
from pipesim.plan.layouts import ETP_WITHOUT_SP, Layout, SearchSpace, enumerate_layouts, parse_constraints
from pipesim.plan.request import Planner, PlanRequest
from tests.plan_moe import mixtral_evaluator, row_as_simulated

pytestmark = pytest.mark.timeout(300)


def moe_space(**changes) -> SearchSpace:
    fields = dict(gpus=8, gpus_per_node=4, global_batch=16, layers=8, heads=8, kv_heads=8,
                  schedules=("1f1b", "interleaved-1f1b"), microbatch_sizes=(1,), virtual_stages=(2,),
                  sequence_parallel=(False, True), experts=8, expert_tp=(0, 1))
    fields.update(changes)
    return SearchSpace(**fields)


def test_folded_layouts_are_written_out_by_hand():
    """Folded: tp > 1 with sequence parallelism, ep any power of two dividing the 8 experts
    and the stage's tp x dp ranks (cut from all of them, not only from dp)."""
    layouts, rejected = enumerate_layouts(moe_space())
    folded = {layout for layout in layouts if layout.etp}
    expected = set()
    for layout in layouts:
        if layout.etp or layout.tp == 1 or not layout.sequence_parallel:
            continue
        for ep in (1, 2, 4, 8):
            if (layout.tp * layout.dp) % ep == 0:
                expected.add(layout._replace(ep=ep, etp=1))
    assert folded == expected
    assert any(layout.ep > layout.dp for layout in folded)  # ep beyond dp: only folded
    # by hand: (tp, pp, dp) with tp > 1: (2,1,4) (2,2,2) (2,4,1) (4,1,2) (4,2,1); ep | tp x dp = 8, 4, 2, 8, 4;
    # 1f1b everywhere, interleaved v2 at pp 2 and 4 (pp 1: 1f1b alone) -> schedules 1, 2, 2, 1, 2
    assert len(folded) == 4 * 1 + 3 * 2 + 2 * 2 + 4 * 1 + 3 * 2
    # folded without sequence parallelism, ruled out by its cause: at ep 1 (ep > 1 falls to ep's own
    # rule first), one per (tp, pp) and schedule, as above
    assert rejected[ETP_WITHOUT_SP] == 1 + 2 + 2 + 1 + 2
    dense, _ = enumerate_layouts(moe_space(experts=0))
    assert not any(layout.etp for layout in dense)


def test_etp_constraints_and_labels():
    assert parse_constraints(["etp=1"]) == {"etp": {"1"}}
    assert parse_constraints(["etp=tp"]) == {"etp": {"0"}}
    with pytest.raises(ValueError, match="etp is 1 .* or tp"):
        parse_constraints(["etp=2"])
    layout = Layout("1f1b", 2, 2, 2, 1, 1, 8, sequence_parallel=True, ep=4, etp=1)
    assert layout.label() == "1f1b pp2 tp2 dp2 ep4 etp1 mbs1 m8 sp"


def test_the_default_tries_folding_for_experts_only():
    moe = Planner(PlanRequest(model="mixtral-8x7b", gpus=8, global_batch=8, workers=1))
    assert moe.space.expert_tp == [0, 1] and any(layout.etp for layout in moe.layouts)
    dense = Planner(PlanRequest(model="llama3-8b", gpus=8, global_batch=8, workers=1))
    assert dense.space.expert_tp == [0] and not any(layout.etp for layout in dense.layouts)
    with pytest.raises(ValueError, match="--etp 1: llama3-8b has no experts to fold"):
        Planner(PlanRequest(model="llama3-8b", gpus=8, global_batch=8, etp=[1]))
    with pytest.raises(ValueError, match="--etp 2: plan tries the experts split over tp"):
        Planner(PlanRequest(model="mixtral-8x7b", gpus=8, global_batch=8, etp=[2]))


moe_evaluator = pytest.fixture(scope="module")(mixtral_evaluator)  # bad --etp values: tests/test_plan_ep_overlap.py


def test_a_folded_row_is_what_simulate_etp_prints(moe_evaluator):
    layout = Layout("interleaved-1f1b", 2, 2, 4, 2, 1, 8, zero=1, sequence_parallel=True, ep=8, etp=1)
    assert moe_evaluator.layout_job(layout).etp == 1
    row_as_simulated(moe_evaluator, layout)
    # ep 8 cut from dp 4 alone is no layout: folded it is one
    assert "error" in moe_evaluator.evaluate(layout._replace(etp=0))


@pytest.mark.parametrize("schedule, pp, chunks", [("1f1b", 2, 1), ("interleaved-1f1b", 2, 2), ("zb-h1", 4, 1)])
def test_the_bounds_and_floors_of_a_folded_layout_hold(moe_evaluator, schedule, pp, chunks):
    simulated = 0
    for tp, ep, zero in ((2, 4, 1), (2, 8, 3), (4, 4, 0), (2, 2, 2)):
        dp = 16 // (pp * tp)
        layout = Layout(schedule, pp, tp, dp, chunks, 1, 2 * pp, "selective", zero, sequence_parallel=True, ep=ep,
                        etp=1)
        row = moe_evaluator.evaluate(layout)
        if "step_time" not in row:  # out of memory before simulating, or ep 8 over a stage of 4 ranks
            continue
        assert moe_evaluator.reject_cause(layout) is None or row["oom"], layout.label()
        order = moe_evaluator.order_of(layout._replace(zero=0), None)
        bound = moe_evaluator.order_bound(layout, order)
        assert moe_evaluator.lower_bound(layout) <= bound <= row["step_time"] * (1 + 1e-9), layout.label()
        for floor, _ in moe_evaluator.memory_floors(layout):
            assert floor <= row["peak_memory_bytes"] * (1 + 1e-9), layout.label()
        simulated += 1
    assert simulated >= 2


def test_a_planned_folded_row_runs_and_equals_the_one_process_reference(tmp_path: Path, capsys):
    """A real plan of Mixtral on 4 GPUs: its tp 2 x dp 2 row with ep 4 folded (ep cut from
    both tp ranks of both replicas) runs on gloo, folded, losses equal to the reference."""
    path = tmp_path / "plan.json"
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "4", "--global-batch", "8", "--seq-len", "1024",
                 "--topology", "ideal", "--top", "5", "--json", str(path), "--quiet", "--workers", "1",
                 "--schedules", "1f1b", "--ep", "4", "--etp", "1", "--zero", "1", "--constraint", "tp=2",
                 "--constraint", "recompute=none"]) == 0
    rows = json.loads(path.read_text())["ranked"]
    assert rows and all(row["etp"] == 1 and row["ep"] == 4 and row["dp"] == 2 for row in rows)
    argv = ["--plan", str(path), "--row", "1", "--dtype", "float64", "--steps", "2", "--layers", "2",
            "--hidden", "16", "--seq-len", "8", "--vocab", "37", "--optimizer", "adamw"]
    config = config_from_plan_row(build_parser("run").parse_args(["run", *argv]))[0]
    assert (config.tp, config.dp, config.ep, config.etp, config.folded) == (2, 2, 4, 1, True)
    out = tmp_path / "run.json"
    assert main(["run", *argv, "--json", str(out), "--quiet"]) == 0
    assert "1f1b: dp=2 pp=1 tp=2 ep=4 etp=1 (world 4)" in capsys.readouterr().out
    document = json.loads(out.read_text())
    assert (document["tp"], document["ep"], document["etp"]) == (2, 4, 1)
    assert document["losses"] == pytest.approx(reference_run(config)["losses"], abs=1e-10, rel=0)


@pytest.mark.parametrize("value", [2, "1", True, None])
def test_a_rows_bad_etp_is_refused_in_one_line(tmp_path: Path, value):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"ranked": [{"schedule": "1f1b", "pp": 1, "tp": 2, "dp": 2, "virtual_stages": 1,
                                            "microbatch_size": 1, "microbatches": 2, "recompute": "none", "zero": 0,
                                            "sequence_parallel": True, "ep": 4, "etp": value,
                                            "layout": "1f1b pp1 tp2 dp2 ep4"}]}))
    with pytest.raises(ValueError, match=f"plan row 1: etp must be 0 .* or 1 .*, got {value!r}"):
        config_from_plan_row(build_parser("run").parse_args(["run", "--plan", str(path)]))
    with pytest.raises(ValueError, match="--etp conflicts with --plan"):
        config_from_plan_row(build_parser("run").parse_args(["run", "--plan", str(path), "--etp", "1"]))
