"""The planner as a library: ``pipesim.api.plan`` returns what ``pipesim plan`` writes,
each ``LayoutEvaluator`` keeps its own cache (a second job does not see the first's
answers), and bad plan input is refused in one line naming the flag and the rule."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import string
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipesim
from pipesim.cli import main
from pipesim.job import Job, simulate_job
from pipesim.plan import search as search_module
from pipesim.plan.evaluate import LayoutEvaluator
from pipesim.plan.layouts import Layout, SearchSpace, enumerate_layouts, parse_constraints
from pipesim.plan.request import PlanRequest
from pipesim.plan.search import EXACT, search

SMALL = dict(model="gpt3-1.3b", gpus=8, global_batch=16, topology="nvlink")
SMALL_FLAGS = ["--model", "gpt3-1.3b", "--gpus", "8", "--global-batch", "16", "--topology", "nvlink"]
TIMING_FIELDS = ("seconds", "simulated_per_second")


def without_timing(plan: dict) -> dict:
    return {key: value for key, value in plan.items() if key not in TIMING_FIELDS}


def test_api_plan_returns_what_the_command_writes(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", *SMALL_FLAGS, "--schedules", "1f1b,zb-h1,zbv", "--microbatch-sizes", "1,2",
                 "--constraint", "pp=2,4", "--top", "3", "--workers", "1", "--quiet", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    result = pipesim.api.plan(pipesim.PlanRequest(**SMALL, schedules=("1f1b", "zb-h1", "zbv"),
                                                  microbatch_sizes=(1, 2), constraints=("pp=2,4",), top=3,
                                                  workers=1))
    assert len(written["ranked"]) == 3 and written["simulated"] >= 3
    assert without_timing(result.to_dict(3)) == without_timing(written)


PIPELINE = Layout("1f1b", 2, 1, 4, 1, 1, 4)  # pp 2, tp 1, dp 4, one chunk, microbatch size 1, 4 microbatches


def test_each_evaluator_keeps_its_own_answers():
    # Two jobs that differ only in their GPU (H100 against a 40 GB A100): the same layout's
    # bound and step differ, and each evaluator answers for its own job whatever the other
    # has computed since, as simulate does for each job alone.
    h100 = LayoutEvaluator(Job(model="gpt3-1.3b", topology="nvlink", nodes=1))
    bound, step = h100.lower_bound(PIPELINE), h100.evaluate(PIPELINE)["step_time"]
    kept = len(h100.cache)
    assert kept > 0
    a100 = LayoutEvaluator(Job(model="gpt3-1.3b", topology="nvlink", nodes=1, gpu="a100-40gb"))
    assert len(a100.cache) == 0  # starts empty: nothing of the first job's
    a100_step = a100.evaluate(PIPELINE)["step_time"]
    assert a100_step == pytest.approx(simulate_job(a100.layout_job(PIPELINE)).metrics.makespan, rel=1e-12)
    assert a100_step > step * 1.5  # an A100 has about a third of an H100's peak: a shared cache would show
    assert a100.lower_bound(PIPELINE) > bound
    assert len(h100.cache) == kept  # the second evaluator added nothing to the first's cache
    assert h100.lower_bound(PIPELINE) == bound
    assert h100.evaluate(PIPELINE)["step_time"] == pytest.approx(
        simulate_job(h100.layout_job(PIPELINE)).metrics.makespan, rel=1e-12)


def test_an_evaluator_sent_to_a_spawned_worker_is_rebuilt_from_its_job(monkeypatch):
    # Where workers are spawned rather than forked, each receives the evaluator pickled:
    # rebuilt from its job, its cache empty, and it searches as one process does.
    evaluator = LayoutEvaluator(Job(model="gpt3-1.3b", topology="nvlink", nodes=1))
    evaluator.lower_bound(PIPELINE)
    copy = pickle.loads(pickle.dumps(evaluator))
    assert copy.base == evaluator.base and len(copy.cache) == 0
    assert copy.lower_bound(PIPELINE) == evaluator.lower_bound(PIPELINE)
    layouts, _ = enumerate_layouts(SearchSpace(gpus=8, gpus_per_node=8, global_batch=16, layers=24, heads=16,
                                               kv_heads=16, schedules=("1f1b",), microbatch_sizes=(2,),
                                               zero=(0, 1)))
    one = search(layouts, evaluator, top=2, passes=EXACT)
    monkeypatch.setattr(search_module, "worker_context", lambda: multiprocessing.get_context("spawn"))
    spawned = search(layouts, evaluator, top=2, workers=2, passes=EXACT)
    assert [(row["layout"], row["step_time"]) for row in spawned.rows[:2]] == \
        [(row["layout"], row["step_time"]) for row in one.rows[:2]]


def error_of(argv: list[str], capsys) -> str:
    """The one line ``pipesim`` prints for ``argv``, which must exit 2 within 5 s."""
    started = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - started < 5
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_plan_cp_that_splits_no_sequence_says_what_simulate_says(capsys):
    simulated = error_of(["simulate", "--model", "gpt3-1.3b", "--topology", "nvlink", "--pp", "2", "--cp", "3"],
                         capsys)
    reason = simulated.split("error: ", 1)[1]
    assert reason.startswith("--cp 3: 2 x cp = 6 chunks")
    assert reason in error_of(["plan", *SMALL_FLAGS, "--cp", "3"], capsys)


def test_plan_ep_that_splits_no_experts_says_what_simulate_says(capsys):
    simulated = error_of(["simulate", "--model", "mixtral-8x7b", "--topology", "ib", "--nodes", "2", "--dp", "3",
                          "--ep", "3"], capsys)
    reason = simulated.split("error: ", 1)[1]
    assert reason.startswith("--ep 3 does not divide the 8 routed experts")
    assert reason in error_of(["plan", "--model", "mixtral-8x7b", "--gpus", "16", "--global-batch", "32",
                               "--topology", "ib", "--ep", "2,3"], capsys)


@pytest.mark.parametrize("argv,message", [
    (["--cp", "3", "--seq-len", "3072"], "--cp 3 does not divide the 8 GPUs (--gpus)"),  # 6 divides 3072
    (["--constraint", "pp=banana"], "--constraint 'pp=banana': pp is a whole number >= 1, not 'banana'"),
    (["--constraint", "pp=0"], "pp is a whole number >= 1, not '0'"),
    (["--constraint", "tp=2.5"], "tp is a whole number >= 1, not '2.5'"),
    (["--constraint", "pp=8,,16"], "--constraint 'pp=8,,16': an empty value in the list"),
    (["--constraint", "pp=8,"], "an empty value in the list"),
    (["--constraint", "zero=4"], "zero is a ZeRO stage, one of 0, 1, 2, 3, not '4'"),
    (["--constraint", "schedule=1f1b,nope"], "unknown schedule 'nope'"),
    (["--constraint", "recompute=some"], "unknown recompute mode 'some'"),
    (["--constraint", "sequence_parallel=maybe"], "sequence_parallel is on or off"),
    (["--constraint", "nope=1"], "unknown field 'nope'"),
    (["--constraint", "=8"], "unknown field ''"),
    (["--schedules", "1f1b,dualpipe"], "--schedules dualpipe: plan does not search bidirectional DualPipe"),
])
def test_plan_refuses_bad_constraints_and_sizes_in_one_line(argv, message, capsys):
    assert message in error_of(["plan", *SMALL_FLAGS, "--workers", "1", *argv], capsys)


@pytest.mark.parametrize("fields,message", [
    ({"schedules": ("nope",)}, "--schedules: unknown nope"),
    ({"schedules": ()}, "--schedules: unknown nothing"),
    ({"microbatch_sizes": (0,)}, "--microbatch-sizes 0: expected integers >= 1"),
    ({"zero": (4,)}, "--zero: unknown 4"),
    ({"sequence_parallel": ("on",)}, "--sequence-parallel: unknown on"),
    ({"recompute": ("some",)}, "--recompute: unknown some"),
    ({"gpus": 0}, "--gpus must be >= 1, got 0"),
    ({"top": 0}, "--top must be >= 1, got 0"),
    ({"workers": 0}, "--workers must be >= 1, got 0"),
    ({"cp": (3,)}, "--cp 3: 2 x cp = 6 chunks"),
    ({"constraints": ("pp=banana",)}, "--constraint 'pp=banana'"),
])
def test_a_bad_plan_request_raises_naming_the_flag(fields, message):
    started = time.perf_counter()
    with pytest.raises(ValueError, match=None) as error:
        pipesim.api.plan(PlanRequest(**{**SMALL, "workers": 1, **fields}))
    assert message in str(error.value)
    assert time.perf_counter() - started < 5  # refused before the search


# The search space both tests below use: 1F1B only, no recompute, ZeRO or sequence
# parallelism, pp 2 kept by a constraint. The candidates of a microbatch size are the
# (tp, pp) with tp x pp dividing 8 GPUs: tp 1 with pp 1, 2, 4, 8; tp 2 with pp 1, 2, 4;
# tp 4 with pp 1, 2; tp 8 with pp 1: 10. At microbatch size 3 (or 5) none splits the
# global batch of 16, the first rule they meet.
NARROW = ["--schedules", "1f1b", "--recompute", "none", "--zero", "0", "--sequence-parallel", "off",
          "--constraint", "pp=2", "--workers", "1", "--quiet"]


def test_a_searched_value_no_layout_keeps_is_named_with_its_rules_counted(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", *SMALL_FLAGS, *NARROW, "--microbatch-sizes", "1,3", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    # microbatch size 1: the 10 candidates split the batch; the constraint keeps pp 2 with tp 1, 2 and 4
    assert written["considered"] == 20 and written["simulated"] + written["pruned_by_bound"] == 3
    rule = "global batch not divisible by dp x microbatch size"
    assert written["values_left_out"] == {"microbatch_size=3": {rule: 10}}
    assert f"searched values no layout kept: microbatch_size=3 ({rule}: 10)" in capsys.readouterr().out


def test_values_a_constraint_leaves_out_are_not_listed_as_broken(tmp_path):
    # zbv and microbatch size 2 are left out by the user's constraints alone: no rule broke
    out = tmp_path / "plan.json"
    assert main(["plan", *SMALL_FLAGS, *NARROW, "--schedules", "1f1b,zbv", "--microbatch-sizes", "1,2,3",
                 "--constraint", "schedule=1f1b", "--constraint", "microbatch_size=1,3", "--json", str(out)]) == 0
    assert list(json.loads(out.read_text())["values_left_out"]) == ["microbatch_size=3"]


def test_when_no_layout_is_left_the_causes_are_counted_per_rule(capsys):
    assert main(["plan", *SMALL_FLAGS, *NARROW, "--microbatch-sizes", "3,5"]) == 1
    err = capsys.readouterr().err
    rule = "global batch not divisible by dp x microbatch size"
    assert f"ruled out: {rule}: 20" in err
    assert (f"searched values no layout kept: microbatch_size=3 ({rule}: 10); microbatch_size=5 ({rule}: 10)"
            in err)


SPACE = SearchSpace(gpus=8, gpus_per_node=4, global_batch=16, layers=8, heads=8, kv_heads=8,
                    schedules=("1f1b", "interleaved-1f1b", "zbv"), microbatch_sizes=(1, 2), virtual_stages=(2,),
                    recompute=("none", "full"), zero=(0, 1), sequence_parallel=(False, True),
                    experts=4, expert_parallel=(1, 2), ep_overlap=(False, True), expert_tp=(0, 1))
ALL_LAYOUTS = enumerate_layouts(SPACE)[0]
SWITCH_SPELLINGS = {True: ("on", "true", "True", "1"), False: ("off", "false", "FALSE", "0")}


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(ALL_LAYOUTS), st.sampled_from(Layout._fields), st.integers(0, 3))
def test_a_constraint_keeps_exactly_the_layouts_with_its_value(layout, name, spelling):
    value = getattr(layout, name)
    if isinstance(value, bool):
        text = SWITCH_SPELLINGS[value][spelling]
    elif isinstance(value, int):
        text = [str(value), f"0{value}", f" {value} ", f"{value},{value}"][spelling]
    else:
        text = value
    kept, ruled_out = enumerate_layouts(SearchSpace(**{**SPACE.__dict__,
                                                       "constraints": parse_constraints([f"{name}={text}"])}))
    expected = [other for other in ALL_LAYOUTS if getattr(other, name) == value]
    assert kept == expected
    assert ruled_out["excluded by --constraint"] == len(ALL_LAYOUTS) - len(expected)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([name for name in Layout._fields if name not in ("schedule", "recompute")]),
       st.text(alphabet=string.ascii_letters + ".", min_size=1, max_size=8))
def test_a_constraint_with_a_word_for_a_number_or_switch_is_refused(name, word):
    if name in ("sequence_parallel", "ep_overlap") and word.lower() in ("on", "off", "true", "false"):
        return  # a switch's own words
    if name == "etp" and word.lower() == "tp":
        return  # the experts split over tp (0)
    if name == "microbatch_group" and word.lower() == "none":
        return  # the schedule's own group
    with pytest.raises(ValueError) as error:
        parse_constraints([f"{name}={word}"])
    assert f"--constraint '{name}={word}'" in str(error.value) and repr(word.strip()) in str(error.value)


def test_a_plan_row_carries_the_limit_its_memory_verdict_was_judged_against():
    """An H100 holds 81559 MiB (nvidia-smi's total); with a 10% headroom the usable limit is
    90% of it (hand figures), the line the plan chart draws (viz.limits.memory_lines)."""
    result = pipesim.api.plan(pipesim.PlanRequest(**SMALL, gpu="h100", schedules=("1f1b",), microbatch_sizes=(1,),
                                                  constraints=("pp=2",), top=1, workers=1,
                                                  memory_headroom="10%"))
    row = result.rows[0]
    assert row["capacity_bytes"] == pytest.approx(81559 * 2**20)
    assert row["usable_bytes"] == pytest.approx(0.9 * 81559 * 2**20)
    assert row["memory_headroom"] == "10%"
