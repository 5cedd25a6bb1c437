"""interleaved-auto: the looped placement's fastest order within a memory limit.

What it must do: hold each rank to its limit (counted in chunk stashes, or at each stage's
size), never be slower or hold more than Megatron's interleaved order at that order's own
memory, run under NCCL's rule and torch's runtime, and refuse bad limits in one line."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.cli import main
from schedules.generators import COST_AWARE, PLANNED_SCHEDULES, generate, interleaved_auto
from schedules.generators.common import ScheduleUnavailableError
from schedules.generators.zb_auto import order_cost
from schedules.metrics import order_peak_stashes
from schedules.schedule import looped_placement
from schedules.validate import is_valid


def step_of(schedule, forward, backward, comm=0.0) -> float:
    """The step of ``schedule`` timed as the search times it (free-flowing transfers)."""
    stages = schedule.num_stages
    costs = [forward] * stages if isinstance(forward, float) else forward
    grads = [backward] * stages if isinstance(backward, float) else backward
    return order_cost(schedule.placement, schedule.microbatches, costs, grads, [0.0] * stages, comm)(
        schedule.programs)[1]


def test_at_megatron_s_memory_the_step_is_the_interleaved_closed_form():
    """p 4, v 2, m 8, every chunk F 0.5 and B 1 with free links: Megatron's order takes
    m v (f + b) + (p - 1)(f + b) = 8 x 2 x 1.5 + 3 x 1.5 = 28.5 (Narayanan et al. 2021), and
    at that order's own memory (the default limit) nothing found is shorter."""
    schedule = interleaved_auto(4, 8, 2, 0.5, 1.0)
    assert step_of(schedule, 0.5, 1.0) == pytest.approx(28.5, rel=1e-12)
    assert schedule.meta["order"] == "megatron"
    assert schedule.programs == generate("interleaved-1f1b", 4, 8, 2).programs


def test_a_limit_below_megatron_s_takes_a_searched_order_that_holds_it():
    """p 2, v 2, m 2: Megatron's order runs every forward of rank 0 first (4 chunk stashes);
    at 2 a rank the search interleaves rank 0's backwards, by hand: F0 and F1 of stage 0
    are never held with more than one other stash."""
    megatron = generate("interleaved-1f1b", 2, 2, 2)
    assert [order_peak_stashes(program) for program in megatron.programs] == [4, 3]
    schedule = interleaved_auto(2, 2, 2, 1.0, 2.0, memory_limit=2)
    assert schedule.meta["order"] == "greedy"
    assert [str(action) for action in schedule.programs[0]] == ["0F0", "2F0", "2B0", "0F1", "0B0", "2F1", "2B1",
                                                                 "0B1"]
    assert [order_peak_stashes(program) for program in schedule.programs] == [2, 2]


def test_stash_sizes_count_a_chunk_that_holds_nothing_as_nothing():
    """Meta's first chunk holds only the embedding: stage 0 keeps no activations. Rank 0's
    Megatron order holds stages 0, 0, 2, 2 at once: 4 chunk stashes, but 0 + 0 + 1 + 1 = 2
    at their sizes; rank 1 holds 1 + 1 + 1 = 3 at its peak. Within 2 and 3 at those sizes
    Megatron's order fits; counted in stashes it would not."""
    megatron = generate("interleaved-1f1b", 2, 2, 2)
    sizes = [0.0, 1.0, 1.0, 1.0]
    assert [order_peak_stashes(program, sizes=sizes) for program in megatron.programs] == [2.0, 3.0]
    by_size = interleaved_auto(2, 2, 2, 1.0, 2.0, memory_limit=[2, 3], stash_sizes=sizes)
    assert by_size.meta["order"] == "megatron" and by_size.programs == megatron.programs
    by_count = interleaved_auto(2, 2, 2, 1.0, 2.0, memory_limit=[2, 3])
    assert by_count.meta["order"] == "greedy"


@st.composite
def sizes_and_costs(draw):
    pp = draw(st.integers(1, 5))
    chunks = draw(st.integers(1, 3))
    microbatches = draw(st.integers(1, 10))
    stages = pp * chunks
    forward = draw(st.lists(st.floats(0.1, 2.0), min_size=stages, max_size=stages))
    backward = draw(st.lists(st.floats(0.1, 4.0), min_size=stages, max_size=stages))
    comm = draw(st.sampled_from((0.0, 0.05, 0.5)))
    return pp, chunks, microbatches, forward, backward, comm


@settings(max_examples=60, deadline=None)
@given(sizes_and_costs())
def test_never_slower_nor_fuller_than_megatron_s_order_at_its_memory(case):
    pp, chunks, microbatches, forward, backward, comm = case
    try:
        megatron = generate("interleaved-1f1b", pp, microbatches, chunks)
    except ScheduleUnavailableError:
        return  # torch's groups do not split these microbatches: no default limit either
    schedule = interleaved_auto(pp, microbatches, chunks, forward, backward, comm)
    assert step_of(schedule, forward, backward, comm) <= step_of(megatron, forward, backward, comm) * (1 + 1e-12)
    for ours, theirs in zip(schedule.programs, megatron.programs, strict=True):
        assert order_peak_stashes(ours) <= order_peak_stashes(theirs)


@settings(max_examples=60, deadline=None)
@given(sizes_and_costs(), st.integers(0, 12), st.booleans())
def test_every_order_holds_its_limit_and_runs_under_nccl_s_rule(case, extra, by_size):
    """Any limit from one microbatch on every chunk of a rank (the least) upward."""
    pp, chunks, microbatches, forward, backward, comm = case
    sizes = [0.0] + [1.0] * (pp * chunks - 1) if by_size else None
    limit = chunks + extra
    schedule = interleaved_auto(pp, microbatches, chunks, forward, backward, comm, memory_limit=limit,
                                stash_sizes=sizes)
    counted = [1.0] * (pp * chunks) if sizes is None else sizes
    assert all(order_peak_stashes(program, sizes=counted) <= limit for program in schedule.programs)
    assert is_valid(schedule, "rendezvous") and is_valid(schedule, "torch-runtime")
    assert all(action.kind in ("F", "B") for program in schedule.programs for action in program)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"memory_limit": 1.5}, r"--memory-limit 1.5 on rank 0 is below one microbatch's stashes on all its chunks "
                            r"\(2\), the least an order with whole backwards holds"),
    ({"memory_limit": math.nan}, "must be a number of chunk stashes per rank"),
    ({"memory_limit": [3, 3, 3]}, r"one per rank of pp=2"),
    ({"memory_limit": True}, "must be a number of chunk stashes per rank"),
    ({"comm": -1.0}, "communication time must be >= 0"),
    ({"stash_sizes": [1.0, -1.0, 1.0, 1.0]}, "stash size costs must be >= 0"),
    ({"stash_sizes": [1.0, 1.0]}, r"2 stash size costs given for pp=2 x v=2 = 4 stages"),
])
def test_bad_limits_and_costs_are_refused_in_one_line(kwargs, message):
    arguments = {"comm": 0.0, **kwargs}
    with pytest.raises(ScheduleUnavailableError, match=message):
        interleaved_auto(2, 4, 2, 1.0, 2.0, **arguments)


def test_bad_chunk_counts_are_refused():
    for chunks in (0, True, 1.5):
        with pytest.raises(ScheduleUnavailableError, match="virtual stages must be a whole number >= 1"):
            interleaved_auto(2, 4, chunks, 1.0, 2.0)


def test_without_torch_s_groups_a_limit_must_be_given():
    # 5 microbatches on pp 2: rounds = 2 do not divide 5, so there is no Megatron order to default to
    with pytest.raises(ScheduleUnavailableError, match="give --memory-limit"):
        interleaved_auto(2, 5, 2, 1.0, 2.0)
    schedule = interleaved_auto(2, 5, 2, 1.0, 2.0, memory_limit=4)
    assert schedule.meta["order"] == "greedy" and is_valid(schedule, "rendezvous")


def test_it_is_cost_aware_and_left_out_of_the_default_plan():
    assert "interleaved-auto" in COST_AWARE and "interleaved-auto" not in PLANNED_SCHEDULES
    assert looped_placement(2, 2) == interleaved_auto(2, 4, 2, 1.0, 2.0).placement


def test_simulate_holds_each_rank_to_the_limit_in_microbatches(tmp_path):
    """--memory-limit 2: two microbatches' activations a rank, 4 chunk stashes at v 2; the
    JSON says so and every rank's peak in flight is within it."""
    out = tmp_path / "step.json"
    assert main(["simulate", "--schedule", "interleaved-auto", "--pp", "4", "-m", "8", "-v", "2", "--fwd", "1",
                 "--bwd", "2", "--memory-limit", "2", "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    assert document["schedule"] == "interleaved-auto" and document["stash_limits"] == [2.0] * 4
    assert all(rank["peak_inflight_microbatches"] <= 2 for rank in document["ranks"])
    megatron = tmp_path / "megatron.json"
    assert main(["simulate", "--schedule", "interleaved-1f1b", "--pp", "4", "-m", "8", "-v", "2", "--fwd", "1",
                 "--bwd", "2", "--json", str(megatron)]) == 0
    assert document["makespan"] >= json.loads(megatron.read_text())["makespan"]


def test_simulate_within_a_budget_in_gb_fits_every_rank(tmp_path, capsys):
    """A small Llama on 4 H100s in 36 GB a GPU (its first rank holds 25.9 GB of state): the
    order fits the budget on every rank, where Megatron's interleaved order at the same size
    does not."""
    common = ["--model", "llama3-8b", "--layers", "16", "--seq-len", "4096", "--pp", "4", "-m", "16", "-v", "2",
              "--gpu", "h100", "--topology", "nvlink"]
    out, megatron = tmp_path / "auto.json", tmp_path / "megatron.json"
    assert main(["simulate", "--schedule", "interleaved-auto", *common, "--memory-limit", "36GB",
                 "--json", str(out)]) == 0
    assert "note: --memory-limit 36GB: interleaved-auto may hold" in capsys.readouterr().err
    assert main(["simulate", "--schedule", "interleaved-1f1b", *common, "--json", str(megatron)]) == 0
    ranks = json.loads(out.read_text())["ranks"]
    assert all(rank["peak_memory_bytes"] <= 36e9 for rank in ranks)
    assert max(rank["peak_memory_bytes"] for rank in json.loads(megatron.read_text())["ranks"]) > 36e9


def test_run_names_the_export_that_writes_its_order(capsys):
    assert main(["run", "--schedule", "interleaved-auto", "--pp", "2", "-m", "4", "-v", "2", "--model", "mlp",
                 "--layers", "4", "--batch-size", "8", "--steps", "1"]) != 0
    assert ("pipesim export --schedule interleaved-auto --pp 2 -m 4 -v 2 --costs COSTS.json"
            in capsys.readouterr().err)


@pytest.mark.parametrize("limit", ["0.5", "0", "-1"])
def test_simulate_refuses_a_count_below_one_microbatch_in_its_unit(limit, capsys):
    """A rank holds at least one microbatch on all its chunks: the error says so in the unit
    the flag was given in."""
    assert main(["simulate", "--schedule", "interleaved-auto", "--pp", "4", "-m", "8", "-v", "2", "--fwd", "1",
                 "--bwd", "2", "--memory-limit", limit]) != 0
    err = capsys.readouterr().err
    assert (f"interleaved-auto: --memory-limit {float(limit):g} on rank 0 is below one microbatch's activations, "
            "the least an order with whole backwards holds") in err


def test_one_microbatch_a_rank_is_enough(capsys):
    schedule = interleaved_auto(3, 5, 4, 1.0, 2.0, 0.1, memory_limit=4)
    assert [order_peak_stashes(program) for program in schedule.programs] == [4, 4, 4]
    assert is_valid(schedule, "rendezvous")


def test_an_interleaved_step_out_of_memory_points_to_the_order_that_fits(tmp_path, capsys):
    """A 16-layer Llama on 4 A100s of 40 GB: Megatron's order needs 40.8 GB on rank 0, over
    the 40.6 usable; simulate says so and names interleaved-auto, which fits every rank."""
    common = ["--model", "llama3-8b", "--layers", "16", "--seq-len", "4096", "--pp", "4", "-m", "16", "-v", "2",
              "--gpu", "a100-40gb", "--topology", "nvlink"]
    megatron = tmp_path / "megatron.json"
    assert main(["simulate", "--schedule", "interleaved-1f1b", *common, "--json", str(megatron)]) == 0
    printed = capsys.readouterr().out
    assert json.loads(megatron.read_text())["oom"]
    assert ("hint: interleaved-auto keeps interleaved-1f1b's placement and builds its order within each device's "
            "memory: --schedule interleaved-auto --memory-limit device") in printed
    auto = tmp_path / "auto.json"
    assert main(["simulate", "--schedule", "interleaved-auto", *common, "--memory-limit", "device",
                 "--json", str(auto)]) == 0
    document = json.loads(auto.read_text())
    assert not document["oom"] and all(rank["peak_memory_bytes"] <= rank["memory"]["usable_bytes"]
                                       for rank in document["ranks"])
    assert "hint:" not in capsys.readouterr().out
