"""``--memory-limit`` as a memory budget: gigabytes per GPU, or each device's usable memory,
turned into the activation stashes zb-auto (rank by rank) and zbv-auto (one count) may hold.

Expected counts by hand from the flag costs: a stage of ``--param-bytes P`` (weights in
2-byte BF16, so ``P / 2`` parameters) holds ``16 P / 2 = 8 P`` bytes of weights, gradients
and Adam state; a rank's pipeline buffers are two boundary activations (``--act-bytes``)
per neighbour it exchanges with (one at either end of the pipeline, two in the middle);
one microbatch's stash is ``--stash-bytes``. So with P = 1 GB, activations 0.1 GB and
stashes 2 GB, an end rank holds 8.2 GB before any stash and a middle rank 8.4 GB, and a
18.3 GB budget leaves floor(10.1 / 2) = 5 stashes at the ends and floor(9.9 / 2) = 4 in
the middle.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.cli import main
from pipesim.plan.memory_floors import MEMORY_LIMIT_TOO_SMALL
from pipesim.sim.stash_budget import MemoryBudget, parse_memory_limit
from schedules.generators import zb_auto, zbv_auto
from schedules.generators.common import ScheduleUnavailableError
from schedules.metrics import order_peak_stashes
from schedules.validate import validate

FLAG_COSTS = ["--fwd", "1", "--bwd", "2", "--wgrad", "1", "--param-bytes", "1e9", "--act-bytes", "1e8",
              "--stash-bytes", "2e9"]


@pytest.mark.parametrize(("text", "expected"), [
    ("60GB", MemoryBudget(60e9, "60GB")), ("60 gb", MemoryBudget(60e9, "60 gb")),
    ("30GiB", MemoryBudget(30 * 2**30, "30GiB")), ("device", MemoryBudget(None, "device")),
    ("4", 4), ("2.5", 2.5)])
def test_a_limit_reads_as_stashes_a_size_or_the_device(text, expected):
    assert parse_memory_limit(text) == expected


@pytest.mark.parametrize("text", ["0GB", "-1GB", "nanGB", "infGB", "GB", "abc", "inf", "nan", "60TB"])
def test_a_limit_that_is_neither_refuses_naming_it(text):
    with pytest.raises(ValueError, match="got '"):
        parse_memory_limit(text)


def simulate(tmp_path, *args: str) -> tuple[int, dict | None, str]:
    """``pipesim simulate`` with ``args``: its exit code, its JSON and what it printed on stderr."""
    out = tmp_path / "step.json"
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        try:
            code = main(["simulate", *args, "--json", str(out)])
        except SystemExit as stop:
            code = stop.code
    return code, (json.loads(out.read_text()) if out.exists() else None), errors.getvalue()


def test_a_budget_gives_each_rank_the_stashes_that_fit_it(tmp_path):
    code, step, notes = simulate(tmp_path, "--schedule", "zb-auto", "--pp", "4", "-m", "8", *FLAG_COSTS,
                                 "--memory-limit", "18.3GB")
    assert code == 0
    assert "may hold 5, 4, 4, 5 microbatches' activations on ranks 0 to 3" in notes
    peaks = [rank["peak_memory_bytes"] for rank in step["ranks"]]
    assert peaks == pytest.approx([18.2e9, 16.4e9, 16.4e9, 18.2e9])  # 8.2 + 5 x 2, 8.4 + 4 x 2
    assert [rank["peak_inflight_microbatches"] for rank in step["ranks"]] == [5, 4, 4, 5]
    assert step["stash_limits"] == [5, 4, 4, 5]


def test_zbv_auto_counts_each_ranks_halves(tmp_path):
    # the flags give a rank's share, split over its two chunks: 4 GB of static bytes and 1 GB stashes
    # each, a microbatch 2 GB. In the V, rank 0 holds stages 0 and 7 and exchanges with rank 1 both
    # ways (2 links, 0.4 GB), ranks 1 and 2 with both neighbours both ways (0.8 GB), rank 3 with rank 2
    # (0.4 GB): 8.4 GB before stashes at the ends, 8.8 GB in the middle. 16.7 GB leaves the ends
    # floor(8.3 / 1) = 8 chunk stashes (4 microbatches) and the middle ranks 7 (3.5)
    code, step, notes = simulate(tmp_path, "--schedule", "zbv-auto", "--pp", "4", "-m", "8", *FLAG_COSTS,
                                 "--memory-limit", "16.7GB")
    assert code == 0, notes
    assert "may hold 4, 3.5, 3.5, 4 microbatches' activations on ranks 0 to 3; rank 1: 8.80 GB" in notes
    assert step["stash_limits"] == [4, 3.5, 3.5, 4]
    assert max(rank["peak_memory_bytes"] for rank in step["ranks"]) <= 16.7e9


def test_every_rank_peaks_within_the_budget_for_a_model(tmp_path):
    docs = (Path(__file__).resolve().parents[1] / "docs" / "schedules.md").read_text()
    for schedule, limit in (("zb-auto", "75GB"), ("zb-auto", "device"), ("zbv-auto", "device")):
        code, step, notes = simulate(tmp_path, "--model", "llama3-8b", "--pp", "4", "-m", "16", "--schedule",
                                     schedule, "--gpu", "h100", "--topology", "nvlink", "--memory-limit", limit)
        assert code == 0, notes
        if limit == "75GB":  # the docs quote this note as the command prints it
            note = notes.split("; rank")[0]
            assert " ".join(note.split()) in " ".join(docs.split()), note
        for rank in step["ranks"]:
            usable = rank["memory"]["usable_bytes"]
            assert rank["peak_memory_bytes"] <= (75e9 if limit == "75GB" else usable), (schedule, limit, rank)
        assert not step["oom"]


def test_a_budget_below_one_microbatch_names_the_rank_and_its_bytes(tmp_path, capsys):
    code, _, notes = simulate(tmp_path, "--schedule", "zb-auto", "--pp", "4", "-m", "8", *FLAG_COSTS,
                              "--memory-limit", "10GB")
    assert code != 0
    assert "--memory-limit 10GB: rank 1 holds 8.40 GB" in notes and "2.000 GB per microbatch" in notes


@pytest.mark.parametrize(("args", "says"), [
    (["--fwd", "1", "--bwd", "2", "--memory-limit", "10GB"], "needs each stage's memory"),
    ([*FLAG_COSTS, "--memory-limit", "device"], "gives no device memory"),
])
def test_a_budget_without_what_it_needs_refuses_in_one_line(tmp_path, args, says):
    code, _, notes = simulate(tmp_path, "--schedule", "zb-auto", "--pp", "4", "-m", "8", *args)
    assert code != 0 and says in notes
    assert "Traceback" not in notes


def test_a_sweep_skips_the_points_a_budget_cannot_hold(tmp_path, capsys):
    # 10.3 GB: at pp 2 each rank holds 8.2 GB and room for one 2 GB stash; at pp 4 the middle ranks
    # hold 8.4 GB and none
    code = main(["sweep", "--schedule", "zb-auto", "--pp", "2,4", "-m", "8", *FLAG_COSTS, "--memory-limit",
                 "10.3GB", "--json", str(tmp_path / "sweep.json")])
    assert code == 0
    by_pp = {row["pp"]: row for row in json.loads((tmp_path / "sweep.json").read_text())}
    assert by_pp[2]["note"] == "" and by_pp[2]["peak_memory_bytes"] == pytest.approx(10.2e9)
    assert "--memory-limit 10.3GB: rank 1 holds 8.40 GB" in by_pp[4]["note"]


@settings(max_examples=60, deadline=None)
@given(pp=st.integers(2, 5), microbatches=st.integers(1, 12), data=st.data())
def test_zb_auto_keeps_each_ranks_own_limit(pp, microbatches, data):
    limits = data.draw(st.lists(st.integers(1, 2 * pp), min_size=pp, max_size=pp))
    costs = [data.draw(st.lists(st.floats(0.1, 3.0), min_size=pp, max_size=pp)) for _ in range(3)]
    comm = data.draw(st.sampled_from([0.0, 0.3]))
    search = data.draw(st.sampled_from([0.0, 0.05]))  # heuristics only, or with the optimising pass
    schedule = zb_auto(pp, microbatches, *costs, comm=comm, memory_limit=limits, search_seconds=search)
    validate(schedule)
    for rank, program in enumerate(schedule.programs):
        assert order_peak_stashes(program) <= limits[rank]


@settings(max_examples=40, deadline=None)
@given(pp=st.integers(2, 4), microbatches=st.integers(1, 8), data=st.data())
def test_zbv_auto_keeps_each_ranks_own_limit_in_halves(pp, microbatches, data):
    limits = [half / 2 for half in data.draw(st.lists(st.integers(2, 4 * pp), min_size=pp, max_size=pp))]
    costs = [data.draw(st.lists(st.floats(0.1, 3.0), min_size=2 * pp, max_size=2 * pp)) for _ in range(3)]
    try:
        schedule = zbv_auto(pp, microbatches, *costs, comm=0.2, memory_limit=limits, quick=True)
    except ScheduleUnavailableError as error:  # every greedy variant waited for room: said, never ignored
        assert "no order of" in str(error)
        return
    validate(schedule)
    for rank, program in enumerate(schedule.programs):
        assert order_peak_stashes(program) <= 2 * limits[rank]  # chunk stashes, each half a microbatch


def test_equal_limits_per_rank_are_the_one_limit():
    costs = ([1.0, 1.0, 1.2], [1.0, 1.1, 1.0], [0.6, 0.5, 0.7])
    one = zb_auto(3, 6, *costs, memory_limit=4, search_seconds=0.0)
    each = zb_auto(3, 6, *costs, memory_limit=[4, 4, 4], search_seconds=0.0)
    assert each.programs == one.programs
    assert zbv_auto(3, 6, 1.0, 1.0, 0.5, memory_limit=[2.5] * 3).programs == \
        zbv_auto(3, 6, 1.0, 1.0, 0.5, memory_limit=2.5).programs


@pytest.mark.parametrize("limit", [[2, 2], [2, 0, 2], [2, True, 2], [2, 1.5, 2]])
def test_per_rank_limits_that_cannot_be_refuse_naming_them(limit):
    with pytest.raises(ScheduleUnavailableError, match="one per rank of pp=3"):
        zb_auto(3, 6, 1.0, 1.0, 1.0, memory_limit=limit)


@pytest.mark.parametrize("limit", [[2, 2], [2, 0.5, 2], [2, float("nan"), 2], [2, True, 2]])
def test_zbv_per_rank_limits_that_cannot_be_refuse_naming_them(limit):
    with pytest.raises(ScheduleUnavailableError, match="zbv-auto: --memory-limit"):
        zbv_auto(3, 6, 1.0, 1.0, 1.0, memory_limit=limit)


def plan_rows(limit: str | None) -> dict:
    from pipesim.api import plan
    from pipesim.plan.request import PlanRequest

    request = PlanRequest(model="llama3-8b", gpus=8, global_batch=32, seq_len=4096, topology="nvlink", gpu="h100",
                          schedules=["zb-auto", "1f1b"], constraints=("pp=4", "tp=2", "recompute=none"), top=40,
                          microbatch_sizes=[1, 2, 4], sequence_parallel=[False, True], memory_limit=limit, workers=1)
    return plan(request)


def test_a_plan_rejects_the_layouts_a_budget_cannot_hold_and_says_why():
    # every zb-auto layout of pp 4 x tp 2 holds more than 20 GB before one microbatch's activations on
    # some rank (static weights alone: 16 bytes x 8.0 B parameters / 8 = 16 GB); 1F1B is not held to it
    result = plan_rows("20GB")
    assert result.rows and all(row["schedule"] == "1f1b" for row in result.rows)
    assert result.screened[MEMORY_LIMIT_TOO_SMALL] == 6  # microbatch sizes 1, 2, 4 x sequence parallel off, on


def test_a_plan_within_each_device_keeps_every_ranked_layout_in_memory():
    rows = plan_rows("device").rows
    zb = [row for row in rows if row["schedule"] == "zb-auto"]
    assert zb and all(row["peak_memory_bytes"] <= row["usable_bytes"] and not row["oom"] for row in zb)


def test_a_plan_builds_a_budgeted_order_for_the_layout_s_own_sharding(tmp_path):
    """Under a budget the room for stashes is what the sharded state leaves: a ZeRO-1 layout's
    zb-auto order is built for ZeRO-1's state, as simulate builds it (before, the plan built
    every order for ZeRO 0, whose optimizer state left no room within 30 GB: no row)."""
    from pipesim.api import plan
    from pipesim.plan.request import PlanRequest

    result = plan(PlanRequest(model="llama3-8b", gpus=8, global_batch=32, seq_len=4096, topology="nvlink",
                              gpu="h100", schedules=["zb-auto"], top=5, sequence_parallel=[False], memory_limit="30GB",
                              constraints=("pp=4", "tp=1", "recompute=none", "zero=1", "microbatch_size=1"), workers=1))
    (row,) = result.rows
    assert row["dp"] == 2 and row["microbatches"] == 16 and row["peak_memory_bytes"] <= 30e9
    code, step, _ = simulate(tmp_path, "--model", "llama3-8b", "--seq-len", "4096", "--schedule", "zb-auto", "--pp",
                             "4", "--dp", "2", "-m", "16", "--zero", "1", "--recompute", "none", "--gpu", "h100",
                             "--topology", "nvlink", "--memory-limit", "30GB")
    assert code == 0 and step["makespan"] == pytest.approx(row["step_time"], rel=1e-12)


def test_a_plan_refuses_a_limit_it_cannot_read_naming_the_flag():
    with pytest.raises(ValueError, match="--memory-limit: .*got '20QB'"):
        plan_rows("20QB")


@pytest.mark.parametrize(("limit", "says"), [
    (0, "a count of stashes must be a number >= 1"), (-1, "a count of stashes must be a number >= 1"),
    (2.5, "zb-auto counts whole stashes")])
def test_a_plan_refuses_a_count_its_schedules_cannot_take_before_searching(limit, says):
    with pytest.raises(ValueError, match=f"--memory-limit {limit:g}: {says}"):
        plan_rows(limit)


def test_show_refuses_a_budget_its_unit_costs_cannot_fit(capsys):
    code = main(["show", "--schedule", "zb-auto", "--pp", "4", "-m", "8", "--memory-limit", "20GB"])
    err = capsys.readouterr().err
    assert code != 0 and "--memory-limit 20GB: show runs unit costs" in err and "Traceback" not in err


def test_zbv_auto_takes_zbvs_own_memory_where_its_order_fits_the_budget_and_runs_faster(tmp_path):
    """Llama 3 8B on 4 H100s, each rank's usable memory: the counts a budget gives zbv-auto
    are safe (every chunk's stash whole until its W, at the larger chunk's size) and leave
    rank 0 3 microbatches; the order at zbv's own 4 fits every rank all the same, counted
    as held, and runs faster, so it is taken: the step and peaks of ``--memory-limit 4``."""
    args = ["--model", "llama3-8b", "--pp", "4", "-m", "16", "--schedule", "zbv-auto", "--gpu", "h100",
            "--topology", "nvlink"]
    code, by_budget, notes = simulate(tmp_path, *args, "--memory-limit", "device")
    assert code == 0 and "may hold 3, 5.5, 4, 4 microbatches'" in notes and "at zbv's own memory" in notes
    code, by_count, _ = simulate(tmp_path, *args, "--memory-limit", "4")
    assert code == 0 and by_budget["makespan"] == by_count["makespan"] and by_budget["stash_limits"] == [4] * 4
    assert all(rank["peak_memory_bytes"] <= rank["memory"]["usable_bytes"] for rank in by_budget["ranks"])
    code, conservative, _ = simulate(tmp_path, *args, "--memory-limit", "2.5")
    assert by_budget["makespan"] < conservative["makespan"]


@pytest.mark.parametrize("command", ["simulate", "sweep"])
@pytest.mark.parametrize("limit", ["4", "60GB"])
def test_a_limit_beside_a_schedule_file_is_refused_by_name(tmp_path, capsys, command, limit):
    path = tmp_path / "one.csv"
    assert main(["export", "--schedule", "1f1b", "--pp", "2", "-m", "2", "--out", str(path)]) == 0
    capsys.readouterr()
    code = main([command, "--schedule-file", str(path), "--fwd", "1", "--bwd", "2", "--memory-limit", limit])
    assert code == 2 and f"--memory-limit conflicts with --schedule-file {path}" in capsys.readouterr().err
