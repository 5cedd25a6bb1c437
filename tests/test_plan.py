"""pipesim plan: the layouts enumerated (counted by hand), the lower bound never above
the simulated step, pruning that never drops a layout of the top, the Pareto front, and
the command's output files and errors."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from pipesim.cli import main
from pipesim.job import Job, simulate_job
from pipesim.plan.evaluate import LayoutEvaluator
from pipesim.plan.layouts import (
    PER_OP_SPLIT,
    Layout,
    SearchSpace,
    context_parallel_sizes,
    enumerate_layouts,
    expert_parallel_sizes,
    parse_constraints,
)
from pipesim.plan.memory_floors import ORDER_OUT_OF_MEMORY
from pipesim.plan.search import EXACT, pareto_front, search
from schedules.generators import GENERATORS, MULTI_CHUNK, PLANNED_SCHEDULES, SPLIT_BACKWARD, generate


def small_space(**changes) -> SearchSpace:
    fields = dict(gpus=8, gpus_per_node=4, global_batch=16, layers=8, heads=8, kv_heads=8,
                  schedules=("1f1b", "interleaved-1f1b"), microbatch_sizes=(1, 2), virtual_stages=(2,))
    fields.update(changes)
    return SearchSpace(**fields)


TOO_MANY_STAGES = "more stages (pp x virtual stages) than layers + 2 (an embedding-only and a head-only chunk)"


def test_enumeration_matches_a_hand_count():
    # tp in {1, 2, 4}; pp | 8 GPUs / tp and pp <= 8 layers: tp1 -> pp 1,2,4,8; tp2 -> 1,2,4; tp4 -> 1,2.
    # 9 (tp, pp) pairs; dp = 8 / (tp pp); mbs in {1, 2} always divides 16 / dp here (dp <= 8).
    # 1f1b: 9 x 2 = 18 layouts; interleaved v2 needs 2 pp <= 8 layers + 2: pp in {2, 4}
    # (tp1: 2,4; tp2: 2,4; tp4: 2) = 5 pairs x 2 = 10 layouts (at pp 1 there is no pipeline:
    # 1f1b stands for every schedule), and pp 8 ruled out twice (mbs 1, 2).
    layouts, rejected = enumerate_layouts(small_space())
    assert len([layout for layout in layouts if layout.schedule == "1f1b"]) == 18
    assert len([layout for layout in layouts if layout.schedule == "interleaved-1f1b"]) == 10
    assert rejected[TOO_MANY_STAGES] == 2
    only_interleaved, _ = enumerate_layouts(small_space(schedules=("interleaved-1f1b",)))
    assert len(only_interleaved) == 16  # searched alone, it stands for itself at pp 1
    for layout in layouts:
        assert layout.pp * layout.tp * layout.dp == 8
        assert layout.microbatches * layout.dp * layout.microbatch_size == 16


def test_layers_need_not_divide_the_stages_and_each_split_is_chosen_not_enumerated():
    # 7 layers: no pp > 1 divides them, yet every (pp, v) with pp v <= 9 stays a layout, one
    # per (pp, v), as with 8: interleaved pp 4 v 2 (8 stages, one split of 7 layers) is one
    # layout, not one per split. pp 8 x v 2 = 16 > 9 stays ruled out.
    seven, rejected = enumerate_layouts(small_space(layers=7))
    eight, _ = enumerate_layouts(small_space(layers=8))
    assert [layout.label() for layout in seven] == [layout.label() for layout in eight]
    assert rejected[TOO_MANY_STAGES] == 2
    assert any(layout.pp * layout.virtual_stages == 8 for layout in seven)


def test_tp_must_divide_kv_heads_and_batch_must_divide():
    layouts, rejected = enumerate_layouts(small_space(kv_heads=2, global_batch=4))
    assert all(layout.tp <= 2 for layout in layouts)
    # every tp=4 candidate: pp in {1, 2} (tp x pp divides 8) x mbs in {1, 2} x {1f1b, interleaved v2},
    # but at pp 1 only 1f1b: 2 + 4
    assert rejected["tp does not divide the attention (or key-value) heads"] == 6
    # dp = 8 with mbs 1 needs 4 % 8 == 0: rejected
    assert rejected["global batch not divisible by dp x microbatch size"] > 0
    assert all(4 % (layout.dp * layout.microbatch_size) == 0 for layout in layouts)


def test_per_op_recompute_is_not_searched_with_a_split_backward():
    # 1f1b and zb-h1 with recompute none and per-op on the small space: zb-h1's per-op
    # candidates, pp 2, 4, 8 at tp 1, 2, 4 at tp 2 and 2 at tp 4 (at pp 1 1f1b stands for
    # every schedule), with mbs 1 and 2: (3 + 2 + 1) x 2 = 12, all ruled out by the rule;
    # 1f1b keeps its per-op rows.
    layouts, rejected = enumerate_layouts(small_space(schedules=("1f1b", "zb-h1"), recompute=("none", "per-op")))
    kept = {(layout.schedule, layout.recompute) for layout in layouts}
    assert kept == {("1f1b", "none"), ("1f1b", "per-op"), ("zb-h1", "none")}
    assert rejected[PER_OP_SPLIT] == 12
    assert PER_OP_SPLIT.startswith("per-op recompute with a split backward")


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_split_backward_names_exactly_the_generators_whose_programs_hold_i_and_w(name):
    schedule = generate(name, 4, 8, 2 if name in MULTI_CHUNK else 1)
    kinds = {action.kind for program in schedule.programs for action in program}
    assert (name in SPLIT_BACKWARD) == ("I" in kinds) == ("W" in kinds)


def test_constraints_filter_and_errors():
    layouts, rejected = enumerate_layouts(small_space(constraints=parse_constraints(["pp=2", "tp=2,4"])))
    assert {(layout.pp, layout.tp) for layout in layouts} == {(2, 2), (2, 4)}
    assert rejected["excluded by --constraint"] > 0
    with pytest.raises(ValueError, match="unknown field 'ppp'"):
        parse_constraints(["ppp=2"])
    with pytest.raises(ValueError, match="expected FIELD=VALUE"):
        parse_constraints(["pp"])


def test_pareto_front_by_hand():
    rows = [{"peak_memory_bytes": 10, "tokens_per_second": 5}, {"peak_memory_bytes": 20, "tokens_per_second": 4},
            {"peak_memory_bytes": 30, "tokens_per_second": 9}, {"peak_memory_bytes": 5, "tokens_per_second": 1}]
    assert [(row["peak_memory_bytes"], row["tokens_per_second"]) for row in pareto_front(rows)] == [
        (5, 1), (10, 5), (30, 9)]


@pytest.fixture
def small_model_worker():
    return LayoutEvaluator(Job(model="gpt3-1.3b", topology="nvlink", nodes=1))


def test_lower_bound_never_exceeds_the_simulated_step(small_model_worker):
    layouts, _ = enumerate_layouts(SearchSpace(
        gpus=8, gpus_per_node=8, global_batch=16, layers=24, heads=16, kv_heads=16,
        schedules=("gpipe", "1f1b", "interleaved-1f1b"), microbatch_sizes=(1, 2), virtual_stages=(2,)))
    assert len(layouts) > 20
    for layout in layouts[::3]:
        row = small_model_worker.evaluate(layout)
        if "error" in row:
            continue
        assert small_model_worker.lower_bound(layout) <= row["step_time"] * (1 + 1e-9), layout.label()


def simulated_across_nodes(schedule: str):
    """(layout, its simulated step) of ``schedule`` on two 8-GPU InfiniBand nodes, so that
    transfers cross links with latency, over tp, dp, ZeRO 0-3 and recompute (ZeRO-3's
    gathers hold ranks after their compute, as tp collectives do); at least 8 of them; and
    the evaluator that simulated them."""
    evaluator = LayoutEvaluator(Job(model="gpt3-1.3b", topology="ib", nodes=2))
    chunks = 2 if schedule in MULTI_CHUNK else 1
    simulated = []
    for pp, tp, dp, microbatches in ((4, 2, 2, 8), (8, 1, 2, 16), (4, 1, 4, 4), (2, 4, 2, 8)):
        for zero, recompute in ((0, "none"), (1, "full"), (2, "none"), (3, "selective")):
            layout = Layout(schedule, pp, tp, dp, chunks, 1, microbatches, recompute, zero)
            row = evaluator.evaluate(layout)
            if "error" not in row:
                simulated.append((layout, row["step_time"]))
    assert len(simulated) >= 8
    return evaluator, simulated


@pytest.mark.parametrize("schedule", PLANNED_SCHEDULES)  # what plan searches
def test_lower_bound_holds_for_every_schedule_across_nodes(schedule):
    # A split backward (zb-*, zbv, dualpipev) may end a rank on weight gradients: a bound
    # that still adds the input gradients' trip back would exceed the step.
    evaluator, simulated = simulated_across_nodes(schedule)
    for layout, step in simulated:
        assert evaluator.lower_bound(layout) <= step * (1 + 1e-9), layout.label()


def test_under_zero2_the_bound_holds_the_dp_streams_reductions_when_they_decide_the_step():
    # A 1.3B model on 256-token sequences with its dp groups across two InfiniBand nodes
    # (tp-pp-dp): under ZeRO-2 every microbatch's gradient is reduce-scattered, one at a
    # time on a rank's dp stream, and they take longer than the rank's compute. The bound
    # holds at least the busiest rank's reductions as the simulation runs them, while the
    # compute terms alone (the ZeRO-1 bound of the same layout) stay below them.
    evaluator = LayoutEvaluator(Job(model="gpt3-1.3b", topology="ib", nodes=2, seq_len=256, rank_order="tp-pp-dp"))
    for schedule, chunks in (("1f1b", 1), ("zb-h1", 1), ("zbv", 2)):
        layout = Layout(schedule, 2, 1, 8, chunks, 1, 16, "none", 2)
        step = evaluator.evaluate(layout)["step_time"]
        columns = simulate_job(evaluator.layout_job(layout)).trace.columns
        reductions = columns.on_stream("dp") & (columns.kind == columns.kind_code("REDUCE_SCATTER_DP"))
        busiest = max(np.bincount(columns.rank[reductions], weights=(columns.end - columns.start)[reductions]))
        bound = evaluator.lower_bound(layout)
        assert busiest <= bound <= step * (1 + 1e-9), layout.label()
        assert evaluator.lower_bound(layout._replace(zero=1)) < busiest, layout.label()


@pytest.mark.parametrize("schedule", PLANNED_SCHEDULES)  # what plan searches
def test_the_bound_of_a_built_order_holds_for_every_schedule_across_nodes(schedule):
    # The order timed with free-flowing transfers (each its unloaded time), the bound's holds
    # and tails: never above the simulated step, never below the layout's own lower bound.
    tighter = 0
    evaluator, simulated = simulated_across_nodes(schedule)
    for layout, step in simulated:
        order = evaluator.order_of(layout._replace(zero=0), None)
        bound = evaluator.order_bound(layout, order)
        assert evaluator.lower_bound(layout) <= bound <= step * (1 + 1e-9), layout.label()
        tighter += bound > evaluator.lower_bound(layout) * (1 + 1e-6)
    assert tighter or schedule in ("dualpipev",), "the order's timing adds nothing to the lower bound"


def test_layouts_pruned_by_their_orders_bound_leave_the_top_as_it_was():
    # Two 8-GPU InfiniBand nodes: the search that lets each screen stop at its order's bound
    # ranks the same top 3 as the exhaustive search, prunes some that way, and its buckets add up.
    evaluator = LayoutEvaluator(Job(model="gpt3-1.3b", topology="ib", nodes=2))
    layouts, ruled_out = enumerate_layouts(SearchSpace(
        gpus=16, gpus_per_node=8, global_batch=32, layers=24, heads=16, kv_heads=16,
        schedules=("1f1b", "interleaved-1f1b", "zb-h1", "zbv", "gpipe"), microbatch_sizes=(1, 2),
        virtual_stages=(2,), zero=(0, 2)))
    cut = search(layouts, evaluator, top=3, rejected=ruled_out, passes=("screen",))
    exhaustive = search(layouts, evaluator, top=3, passes=("screen",), prune=False)
    assert [row["layout"] for row in cut.rows[:3]] == [row["layout"] for row in exhaustive.rows[:3]]
    assert [row["step_time"] for row in cut.rows[:3]] == [row["step_time"] for row in exhaustive.rows[:3]]
    by_order = [other for other in cut.others if other["cause"].startswith("its order's bound")]
    assert by_order and all(other["bucket"] == "pruned" for other in by_order)
    buckets = sum(cut.ruled_out.values()) + sum(cut.screened.values()) + cut.simulated + cut.pruned
    assert buckets == cut.considered == len(layouts) + sum(ruled_out.values())


def test_pruning_keeps_the_same_top(small_model_worker):
    layouts, _ = enumerate_layouts(SearchSpace(
        gpus=8, gpus_per_node=8, global_batch=16, layers=24, heads=16, kv_heads=16,
        schedules=("1f1b", "interleaved-1f1b"), microbatch_sizes=(1, 2), virtual_stages=(2,)))
    pruned = search(layouts, small_model_worker, top=3, passes=EXACT)
    exhaustive = search(layouts, small_model_worker, top=3, passes=EXACT, prune=False)
    assert exhaustive.pruned == 0
    assert [row["layout"] for row in pruned.rows[:3]] == [row["layout"] for row in exhaustive.rows[:3]]
    assert pruned.simulated + pruned.pruned + sum(pruned.screened.values()) == pruned.considered == len(layouts)
    assert pruned.ranked + sum(pruned.failed.values()) == pruned.simulated


def test_plan_command_writes_its_files(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["plan", "--model", "gpt3-1.3b", "--gpus", "8", "--global-batch", "16", "--topology", "nvlink",
                 "--schedules", "1f1b,gpipe", "--microbatch-sizes", "1", "--top", "3", "--workers", "1",
                 "--json", str(out), "--csv", str(tmp_path / "plan.csv"), "--html", str(tmp_path / "plan.html")])
    assert code == 0
    text = capsys.readouterr().out
    assert "considered" in text and "simulated" in text
    data = json.loads(out.read_text())
    assert 1 <= len(data["ranked"]) <= 3
    steps = [row["step_time"] for row in data["ranked"]]
    assert steps == sorted(steps)
    assert (data["ruled_out"] + data["rejected_before_simulation"] + data["simulated"] + data["pruned_by_bound"]
            == data["considered"])
    assert data["simulated_and_ranked"] + data["simulated_and_failed"] == data["simulated"]
    best = data["ranked"][0]
    layout = Layout(**{key: best[key] for key in Layout._fields})
    assert layout.pp * layout.tp * layout.dp == 8
    assert (tmp_path / "plan.csv").read_text().startswith("schedule,")
    assert "Pareto front" in (tmp_path / "plan.html").read_text()


def test_plan_matches_simulate_for_the_chosen_layout(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt3-1.3b", "--gpus", "4", "--global-batch", "8", "--topology", "nvlink",
                 "--schedules", "1f1b", "--microbatch-sizes", "1", "--top", "1", "--workers", "1",
                 "--json", str(out)]) == 0
    best = json.loads(out.read_text())["ranked"][0]
    result = tmp_path / "simulate.json"
    assert main(["simulate", "--model", "gpt3-1.3b", "--topology", "nvlink", "--nodes", "1",
                 "--schedule", "1f1b", "--pp", str(best["pp"]), "--tp", str(best["tp"]), "--dp", str(best["dp"]),
                 "-m", str(best["microbatches"]), "--microbatch-size", "1", "--recompute", best["recompute"],
                 "--zero", str(best["zero"]), *(["--sequence-parallel"] if best["sequence_parallel"] else []),
                 "--json", str(result)]) == 0
    assert json.loads(result.read_text())["makespan"] == pytest.approx(best["step_time"], rel=1e-12)


def test_plan_searches_zb_auto_and_it_equals_simulate(tmp_path):
    # the cost-aware generator is generated per layout from that layout's costs; its row is
    # what `simulate --schedule zb-auto` prints for the layout
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt3-1.3b", "--gpus", "4", "--global-batch", "8", "--topology", "nvlink",
                 "--schedules", "zb-auto", "--microbatch-sizes", "1", "--top", "2", "--workers", "1",
                 "--constraint", "pp=4", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["ranked"]
    assert rows and all(row["schedule"] == "zb-auto" and row["pp"] == 4 for row in rows)
    best = rows[0]
    result = tmp_path / "simulate.json"
    assert main(["simulate", "--model", "gpt3-1.3b", "--topology", "nvlink", "--nodes", "1",
                 "--schedule", "zb-auto", "--pp", "4", "--tp", str(best["tp"]), "--dp", str(best["dp"]),
                 "-m", str(best["microbatches"]), "--microbatch-size", "1", "--recompute", best["recompute"],
                 "--zero", str(best["zero"]), *(["--sequence-parallel"] if best["sequence_parallel"] else []),
                 "--json", str(result)]) == 0
    assert json.loads(result.read_text())["makespan"] == pytest.approx(best["step_time"], rel=1e-12)


@pytest.mark.parametrize("argv,message", [
    (["--gpus", "0"], "must be >= 1"),
    (["--workers", "0"], "--workers must be >= 1"),
    (["--mfu", "nan"], "mfu"),
    (["--gpus", "12", "--gpus-per-node", "8"], "not a whole number of 8-GPU nodes"),
    (["--schedules", "nope"], "unknown nope"),
    (["--microbatch-sizes", "x"], "expected integers"),
    (["--constraint", "pp"], "expected FIELD=VALUE"),
    (["--json", "/nonexistent/dir/plan.json"], "does not exist"),
    (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
    (["--gpu", "a100"], "argument --gpu: invalid choice: 'a100'"),
    (["--recompute", "some"], "--recompute: unknown some"),
    (["--sequence-parallel", "maybe"], "--sequence-parallel: unknown maybe"),
    (["--model", "nope"], "nope"),
    (["--topology", "nope"], "nope"),
    (["--gpus", "64"], "preset nvlink is one node"),
    (["--gpus", "10000000", "--global-batch", "10000000"], "--gpus 10,000,000: plan models the cluster"),
])
def test_plan_bad_input_is_one_line(argv, message, capsys):
    base = ["plan", "--model", "gpt3-1.3b", "--gpus", "8", "--global-batch", "16", "--topology", "nvlink",
            "--workers", "1"]
    started = time.perf_counter()
    try:
        code = main(base + argv)
    except SystemExit as exit:  # argparse's own refusals exit
        code = exit.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert "simulate" not in err  # plan's own usage and error, not simulate's
    assert time.perf_counter() - started < 10  # refused before the search, not after it


def test_memory_floor_only_rejects_layouts_the_simulation_finds_out_of_memory():
    evaluator = LayoutEvaluator(Job(model="gpt3-13b", topology="nvlink", nodes=1, gpu="a100-40gb"))
    layouts, _ = enumerate_layouts(SearchSpace(
        gpus=8, gpus_per_node=8, global_batch=16, layers=40, heads=40, kv_heads=40,
        schedules=("gpipe", "1f1b", "zbv", "dualpipev", "interleaved-1f1b"), microbatch_sizes=(1,),
        zero=(0, 1, 2, 3)))
    screened = [layout for layout in layouts if evaluator.reject_cause(layout)]
    assert {layout.schedule for layout in screened} >= {"1f1b", "zbv"}  # looped and V placements
    assert screened, "the case must exercise the floor (gpt3-13b does not fit one 40 GB GPU)"
    checked = set()
    for layout in screened:
        row = evaluator.evaluate(layout)
        if "error" in row:  # no such schedule for that pp and m: nothing to compare
            continue
        assert row.get("rejected") == ORDER_OUT_OF_MEMORY or row["oom"], layout.label()
        assert simulate_job(evaluator.layout_job(layout)).oom, layout.label()
        checked.add(layout.schedule)
    assert checked >= {"1f1b", "zbv"}


def test_a_layout_rejected_by_its_programs_order_is_one_the_simulation_finds_out_of_memory():
    # gpt3-13b on 8 A100-40GB: the plan reads each built schedule's peak memory off its
    # programs' order and rejects it unsimulated; the simulation must agree on every one,
    # and on every layout it lets through.
    evaluator = LayoutEvaluator(Job(model="gpt3-13b", topology="nvlink", nodes=1, gpu="a100-40gb"))
    layouts, _ = enumerate_layouts(SearchSpace(
        gpus=8, gpus_per_node=8, global_batch=16, layers=40, heads=40, kv_heads=40,
        schedules=("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"), microbatch_sizes=(1, 2),
        zero=(0, 1, 2, 3), recompute=("none", "full")))
    verdicts = {"rejected": 0, "simulated": 0}
    for layout in layouts:
        if evaluator.reject_cause(layout):
            continue
        row = evaluator.evaluate(layout)
        if "error" in row:
            continue
        oom = simulate_job(evaluator.layout_job(layout)).oom
        if "rejected" in row:
            assert oom, layout.label()
            verdicts["rejected"] += 1
        else:
            assert row["oom"] == oom, layout.label()
            verdicts["simulated"] += 1
    assert verdicts["rejected"] >= 5 and verdicts["simulated"] >= 5, verdicts


def test_the_search_over_two_workers_is_deterministic_and_keeps_the_top(small_model_worker):
    # what is simulated, pruned and ranked follows from the bounds and the window of layouts
    # in flight, not from which worker finishes first; more in flight may simulate a few more
    # layouts than one process does, never a different top
    layouts, _ = enumerate_layouts(SearchSpace(
        gpus=8, gpus_per_node=8, global_batch=16, layers=24, heads=16, kv_heads=16,
        schedules=("1f1b", "interleaved-1f1b", "zb-h1"), microbatch_sizes=(1, 2), virtual_stages=(2,)))
    one = search(layouts, small_model_worker, top=3, workers=1, passes=EXACT)
    runs = [search(layouts, small_model_worker, top=3, workers=2, passes=EXACT) for _ in range(2)]
    assert [row["layout"] for row in runs[0].rows] == [row["layout"] for row in runs[1].rows]
    assert (runs[0].simulated, runs[0].pruned) == (runs[1].simulated, runs[1].pruned)
    assert [row["layout"] for row in runs[0].rows[:3]] == [row["layout"] for row in one.rows[:3]]
    assert runs[0].simulated >= one.simulated


def test_a_layouts_job_is_the_job_of_its_simulate_command_line():
    # plan fills each layout into its base job; simulate parses the same settings from flags
    from pipesim.cli import build_parser

    evaluator = LayoutEvaluator(Job(model="gpt3-1.3b", topology="ib", nodes=2, seq_len=1024, gpu="a100-80gb"))
    layouts, _ = enumerate_layouts(SearchSpace(
        gpus=16, gpus_per_node=8, global_batch=32, layers=24, heads=16, kv_heads=16,
        schedules=("1f1b", "interleaved-1f1b", "zbv", "zb-auto"), microbatch_sizes=(1, 2), virtual_stages=(1, 2),
        recompute=("none", "selective", "full"), zero=(0, 1), sequence_parallel=(False, True)))
    assert len(layouts) > 100
    parser = build_parser()
    for layout in layouts:
        argv = ["simulate", "--model", "gpt3-1.3b", "--topology", "ib", "--nodes", "2", "--seq-len", "1024",
                "--gpu", "a100-80gb", "--schedule", layout.schedule, "--pp", str(layout.pp), "--tp", str(layout.tp),
                "--dp", str(layout.dp), "-m", str(layout.microbatches), "--microbatch-size",
                str(layout.microbatch_size), "-v", str(layout.virtual_stages), "--recompute", layout.recompute,
                "--zero", str(layout.zero), *(["--sequence-parallel"] if layout.sequence_parallel else [])]
        assert evaluator.layout_job(layout) == Job.from_namespace(parser.parse_args(argv)), layout.label()


def test_plan_writes_the_best_layout_for_torchtitan_as_export_does(tmp_path, capsys):
    common = ["--model", "gpt3-1.3b", "--topology", "nvlink"]
    assert main(["plan", *common, "--gpus", "8", "--global-batch", "16", "--schedules", "1f1b,zbv",
                 "--constraint", "pp=2", "--microbatch-sizes", "1", "--top", "1", "--workers", "1",
                 "--json", str(tmp_path / "plan.json"), "--torchtitan", str(tmp_path / "planned"), "--fsdp"]) == 0
    assert main(["export", *common, "--nodes", "1", "--from-plan", str(tmp_path / "plan.json"), "--fsdp",
                 "--torchtitan", str(tmp_path / "exported")]) == 0
    for name in ("schedule.csv", "schedule-lowered.csv", "torchtitan.args"):  # the config names its own folder
        planned = (tmp_path / "planned" / name).read_text().replace(str(tmp_path / "planned"), "DIR")
        assert planned == (tmp_path / "exported" / name).read_text().replace(str(tmp_path / "exported"), "DIR"), name


def test_the_headroom_is_kept_back_alike_by_the_floor_and_by_simulate():
    # gpt3-13b, 1F1B pp 4 dp 2 ZeRO-1 on 40 GB A100s (40960 MiB): parameters, optimizer state
    # and one stash alone need 37.7 GB on some rank. Without headroom the floor lets it
    # through; keeping 6 GB back (36.9 GB usable) it is rejected, and simulate calls the same
    # layout out of memory with that headroom (its peak is above the floor) and not with 0
    # when it fits.
    capacity = 40960 * 2**20
    layout = Layout("1f1b", 4, 1, 2, 1, 1, 8, "none", 1)
    verdicts = {}
    for headroom in ("0", "6"):
        evaluator = LayoutEvaluator(Job(model="gpt3-13b", topology="nvlink", nodes=1, gpu="a100-40gb",
                                        memory_headroom=headroom))
        floor = max(floor for floor, _ in evaluator.memory_floors(layout))
        assert capacity - 6e9 < floor < capacity
        verdicts[headroom] = (evaluator.reject_cause(layout), evaluator.evaluate(layout))
    assert verdicts["0"][0] is None
    assert verdicts["6"][0] == "out of memory (parameters, optimizer state and one stash alone, with the headroom)"
    row = verdicts["0"][1]
    assert "rejected" in row or row["oom"] == (row["peak_memory_bytes"] > capacity)
    job = evaluator.layout_job(layout)
    result = simulate_job(job)  # the 6 GB job set up last: out of memory, as the floor said
    assert result.oom and all(memory.usable_bytes == pytest.approx(capacity - 6e9) for memory in result.memory)


def test_every_considered_layout_lands_in_exactly_one_bucket_with_zero_stages_and_uneven_splits(small_model_worker):
    # gpt3-1.3b's 24 layers over pp x v up to 8 x 4 = 32 stages: most splits are uneven.
    layouts, ruled_out = enumerate_layouts(SearchSpace(
        gpus=8, gpus_per_node=8, global_batch=16, layers=24, heads=16, kv_heads=16,
        schedules=("1f1b", "interleaved-1f1b", "zbv"), microbatch_sizes=(1, 2), virtual_stages=(2, 4),
        zero=(0, 1, 2, 3), recompute=("none", "full")))
    assert {layout.zero for layout in layouts} == {0, 1, 2, 3}
    assert any(24 % (layout.pp * layout.virtual_stages) for layout in layouts)
    result = search(layouts, small_model_worker, top=3, rejected=ruled_out, passes=EXACT)
    seen = [row["layout"] for row in result.rows] + [other["layout"] for other in result.others]
    assert sorted(seen) == sorted(layout.label() for layout in layouts)  # each once
    buckets = sum(result.ruled_out.values()) + sum(result.screened.values()) + result.simulated + result.pruned
    assert buckets == result.considered == len(layouts) + sum(ruled_out.values())
    assert result.ranked + sum(result.failed.values()) == result.simulated


def test_plan_matches_simulate_for_a_zero3_layout_with_an_uneven_split(tmp_path):
    # 24 layers over 4 ranks x 4 chunks = 16 stages: the balanced split, chosen alike by both
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt3-1.3b", "--gpus", "8", "--global-batch", "16", "--topology", "nvlink",
                 "--schedules", "interleaved-1f1b", "--virtual-stages", "4", "--microbatch-sizes", "1",
                 "--constraint", "pp=4", "--constraint", "zero=3", "--top", "1", "--workers", "1",
                 "--json", str(out)]) == 0
    best = json.loads(out.read_text())["ranked"][0]
    assert (best["zero"], best["pp"], best["virtual_stages"]) == (3, 4, 4)
    result = tmp_path / "simulate.json"
    assert main(["simulate", "--model", "gpt3-1.3b", "--topology", "nvlink", "--nodes", "1",
                 "--schedule", "interleaved-1f1b", "-v", "4", "--pp", "4", "--tp", str(best["tp"]),
                 "--dp", str(best["dp"]), "-m", str(best["microbatches"]), "--microbatch-size", "1",
                 "--recompute", best["recompute"], "--zero", "3",
                 *(["--sequence-parallel"] if best["sequence_parallel"] else []), "--json", str(result)]) == 0
    simulated = json.loads(result.read_text())
    assert simulated["makespan"] == pytest.approx(best["step_time"], rel=1e-12)
    # 24 layers over 16 stages, the output layer weighing 1.7 layers: the last stage holds it alone
    layers = [stage["layers"] for stage in simulated["stage_costs"]]
    assert layers[-1] == 0 and set(layers[:-1]) == {1, 2} and sum(layers) == 24


# Screened steps and exact ones by hand: layouts "a" to "e" screen at 10, 10.1, 10.3,
# 11 and 12 s; exactly they take 9.9, 10.1, 9.8, 11 and 11.5 s ("e" is faster exactly
# but screened beyond the 2% margin of the second-best screened step: left screened).
_SCREENED = {1: 10.0, 2: 10.1, 3: 10.3, 4: 11.0, 5: 12.0}
_EXACT = {1: 9.9, 2: 10.1, 3: 9.8, 4: 11.0, 5: 11.5}


def _toy_layouts() -> list[Layout]:
    return [Layout("1f1b", pp=1, tp=1, dp=dp, microbatch_size=1, microbatches=1, virtual_stages=1) for dp in _SCREENED]


def _toy_row(layout: Layout, step: float) -> dict:
    return {"layout": layout.label(), **{name: getattr(layout, name) for name in Layout._fields},
            "step_time": step, "oom": False}


def _toy_screen(layout: Layout) -> dict:
    return _toy_row(layout, _SCREENED[layout.dp])


def _toy_exact(layout: Layout) -> dict:
    if layout.dp == 4:
        return {"error": "needs more memory exactly"}
    return _toy_row(layout, _EXACT[layout.dp])


class _ToyEvaluator:
    """An evaluator of given screened and exact rows and bound, with no memory floor."""

    def __init__(self, screen, exact, bound=lambda layout: 0.0) -> None:
        self.screened, self.exact, self.bound = screen, exact, bound

    def screen(self, layout: Layout, cutoff: float = math.inf) -> dict:
        return self.screened(layout)

    def evaluate(self, layout: Layout, cutoff: float = math.inf) -> dict:
        return self.exact(layout)

    def lower_bound(self, layout: Layout) -> float:
        return self.bound(layout)

    def reject_cause(self, layout: Layout) -> None:
        return None

    def describe(self, layout: Layout) -> dict:
        return {}


def test_the_finalists_are_simulated_exactly_and_ranked_by_it():
    result = search(_toy_layouts(), _ToyEvaluator(_toy_screen, _toy_exact), top=2, prune=False)
    # finalists: the top 2 screened (10, 10.1) and every one within 2% of 10.1 (<= 10.302): 10.3 too
    assert result.refined == 3
    assert [(row["dp"], row["step_time"], row.get("screened", False)) for row in result.rows] == [
        (3, 9.8, False), (1, 9.9, False), (2, 10.1, False), (4, 11.0, True), (5, 12.0, True)]
    assert result.ranked + sum(result.failed.values()) == result.simulated == 5


def test_a_finalist_that_fails_exactly_leaves_the_ranking_and_is_counted_once():
    result = search(_toy_layouts(), _ToyEvaluator(_toy_screen, _toy_exact), top=4, prune=False)
    # top 4 screened are dp 1-4; within 2% of 11.0 (<= 11.22) adds none; dp 4 fails exactly
    assert result.refined == 4
    assert [row["dp"] for row in result.rows] == [3, 1, 2, 5]
    assert result.failed == {"needs more memory exactly": 1}
    assert result.ranked + sum(result.failed.values()) == result.simulated == 5
    assert [other["dp"] for other in result.others if other["bucket"] == "simulated"] == [4]


# Screened in bound order, the first rows found are finalists that later ones push out:
# "a" (dp 1) screens at 12 s, "b" at 11.9 s, then "c" to "h" at 10 to 10.5 s.
_DROPPING = {1: 12.0, 2: 11.9, 3: 10.0, 4: 10.5, 5: 10.1, 6: 10.4, 7: 10.2, 8: 10.3}


def _dropping_screen(layout: Layout) -> dict:
    time.sleep(0.02)  # each in flight a while: the first rows' exact runs start before the last screens end
    return _toy_row(layout, _DROPPING[layout.dp])


def _dropping_bound(layout: Layout) -> float:
    return float(layout.dp)  # bound order: dp 1 first


def _dropping_exact(layout: Layout) -> dict:
    return _toy_row(layout, _DROPPING[layout.dp] - 0.01 * layout.dp)


def test_finalists_started_while_screens_are_in_flight_change_nothing():
    # two workers hand finalists over as soon as nothing more is to be screened, while
    # screens are still in flight ("a" and "b" drop out later); what is ranked and
    # counted is what one process finds, which evaluates exactly only the final ones
    layouts = [Layout("1f1b", pp=1, tp=1, dp=dp, microbatch_size=1, microbatches=1, virtual_stages=1)
               for dp in _DROPPING]
    dropping = _ToyEvaluator(_dropping_screen, _dropping_exact, _dropping_bound)
    one = search(layouts, dropping, top=2)
    two = search(layouts, dropping, top=2, workers=2)
    # finalists: 10.0 and 10.1, and 10.2 and 10.3 within 2% of 10.1 (<= 10.302); exactly
    # 9.97, 10.05, 10.13 and 10.22
    assert [row["dp"] for row in one.rows[:4]] == [3, 5, 7, 8]
    assert [row["step_time"] for row in one.rows[:4]] == pytest.approx([9.97, 10.05, 10.13, 10.22], abs=1e-12)
    assert one.refined == two.refined == 4
    assert [(row["dp"], row["step_time"], row.get("screened", False)) for row in two.rows] == \
        [(row["dp"], row["step_time"], row.get("screened", False)) for row in one.rows]
    assert (two.simulated, two.pruned) == (one.simulated, one.pruned) == (8, 0)


def test_plan_searches_expert_parallelism_and_its_row_equals_simulate(tmp_path):
    # a mixture of experts: ep is searched (here 2 and 4, cut from the 4 replicas) and the
    # chosen layout's row is what `simulate --ep` prints for it
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "16", "--global-batch", "32", "--seq-len", "4096",
                 "--topology", "ib", "--gpu", "h100", "--schedules", "1f1b", "--microbatch-sizes", "1",
                 "--constraint", "pp=2", "--constraint", "tp=2", "--ep", "2,4", "--top", "3", "--workers", "1",
                 # full recompute: without it none of these layouts fits as torchtitan's FSDP runs them
                 "--recompute", "full", "--quiet", "--json", str(out), "--torchtitan", str(tmp_path / "titan"),
                 "--fsdp"]) == 0
    plan = json.loads(out.read_text())
    rows = plan["ranked"]
    assert rows and {row["ep"] for row in rows} <= {2, 4}
    words = (tmp_path / "titan" / "torchtitan.args").read_text().split()
    assert words[words.index("--parallelism.expert_parallel_degree") + 1] == str(rows[0]["ep"])
    assert all(f"dp4 ep{row['ep']}" in row["layout"] for row in rows)
    best = rows[0]
    assert best["etp"] == 1  # for torchtitan, which folds the experts whenever ep > 1 (docs/interop.md)
    result = tmp_path / "simulate.json"
    assert main(["simulate", "--model", "mixtral-8x7b", "--seq-len", "4096", "--topology", "ib", "--nodes", "2",
                 "--gpu", "h100", "--schedule", "1f1b", "--pp", "2", "--tp", "2", "--dp", "4", "--ep", str(best["ep"]),
                 "-m", str(best["microbatches"]), "--microbatch-size", "1", "--zero", str(best["zero"]),
                 "--recompute", best["recompute"],
                 # as torchtitan's FSDP runs pipelined replicas (pipesim.plan.torchtitan_fsdp), with its loss
                 "--bytes-per-param", "2,4,12", "--no-dp-overlap", "--cross-entropy", "torch",
                 *(["--sequence-parallel"] if best["sequence_parallel"] else []), "--etp", "1",
                 "--json", str(result)]) == 0
    assert json.loads(result.read_text())["makespan"] == pytest.approx(best["step_time"], rel=1e-12)


def test_plan_refuses_ep_for_a_dense_model(capsys):
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--ep", "2"]) == 2
    assert "llama3-8b has no experts to split" in capsys.readouterr().err


def test_expert_parallel_sizes_are_the_powers_of_two_dividing_the_experts():
    space = SearchSpace(gpus=8, gpus_per_node=8, global_batch=8, layers=4, heads=8, kv_heads=8, experts=12)
    assert expert_parallel_sizes(space) == [1, 2, 4]  # 8 does not divide 12
    assert expert_parallel_sizes(SearchSpace(gpus=8, gpus_per_node=8, global_batch=8, layers=4, heads=8,
                                             kv_heads=8)) == [1]


def test_context_parallel_sizes_leave_each_rank_8k_tokens_and_split_the_sequence_evenly():
    def space(seq_len: int, **given) -> SearchSpace:
        return SearchSpace(gpus=8, gpus_per_node=8, global_batch=8, layers=4, heads=8, kv_heads=8, seq_len=seq_len,
                           **given)

    assert context_parallel_sizes(space(4096)) == [1]
    assert context_parallel_sizes(space(8192)) == [1]
    assert context_parallel_sizes(space(32768)) == [1, 2, 4]
    assert context_parallel_sizes(space(131072)) == [1, 2, 4, 8, 16]
    assert context_parallel_sizes(space(24576)) == [1, 2]  # cp 4 would leave 6144 tokens a rank
    assert context_parallel_sizes(space(40000)) == [1, 2, 4]  # 40000 = 2 x 4 x 5000: cp 4 splits it evenly
    assert context_parallel_sizes(space(49154)) == [1]  # 6 x 8192 + 2: 4 and 8 do not divide it
    assert context_parallel_sizes(space(4096, context_parallel=[2, 1, 2])) == [1, 2]


def test_plan_searches_context_parallelism_on_long_sequences_and_its_row_equals_simulate(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama3-8b", "--gpus", "16", "--global-batch", "16", "--seq-len", "32768",
                 "--topology", "ib", "--gpu", "h100", "--schedules", "1f1b", "--microbatch-sizes", "1",
                 "--constraint", "pp=2", "--constraint", "tp=1", "--constraint", "zero=1", "--top", "3",
                 "--workers", "1", "--quiet", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["ranked"]
    assert rows and all(row["cp"] * row["dp"] * row["pp"] == 16 for row in rows)
    best = next(row for row in rows if row["cp"] > 1)
    assert f"cp{best['cp']} dp{best['dp']}" in best["layout"]
    result = tmp_path / "simulate.json"
    assert main(["simulate", "--model", "llama3-8b", "--seq-len", "32768", "--topology", "ib", "--nodes", "2",
                 "--gpu", "h100", "--schedule", "1f1b", "--pp", "2", "--dp", str(best["dp"]), "--cp", str(best["cp"]),
                 "-m", str(best["microbatches"]), "--microbatch-size", "1", "--zero", "1",
                 "--recompute", best["recompute"], "--json", str(result)]) == 0
    assert json.loads(result.read_text())["makespan"] == pytest.approx(best["step_time"], rel=1e-12)
