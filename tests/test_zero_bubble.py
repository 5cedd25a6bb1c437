"""The zero-bubble family and V-shaped pipelines against the papers' closed forms and
against torch.distributed.pipelining's own orders.

Expected values come from Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024):
bubble ``(p-1)(F+I+W)`` for 1F1B, ``(p-1)(F+I-W)`` for ZB-H1, ``(p-1)(F+I-2W+2T)`` for
ZB-H2 where positive, and the authors' comparison table (sail-sg, "Comparison assuming
T_F = T_B = T_W": bubble rate (p-1)/m, (p-1)/3m, 0, 0; activation memory 1x, 1x, 2x,
1x; communication volume 1x, 1x, 1x, 2x for 1F1B, ZB1P, ZB2P, ZB-V). The paper counts a
bubble per rank, from that rank's first action to its last ("the largest execution time
of all stages"): with the optimizer step's synchronisation removed the next step's
warm-up fills the lead-in. ``longest_rank_span`` measures that from the Trace; the step
makespan additionally contains the lead-in, ``(p-1)`` forwards on the last rank.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from benchmarks.paper_model import longest_rank_span, run
from pipesim.cluster.topology import ideal_topology
from pipesim.model.costs import uniform_costs
from pipesim.sim.engine import simulate
from pipesim.sim.step import run_simulation
from schedules import generate, lower, schedule_from_csv, schedule_to_csv, step_metrics
from schedules.generators import ScheduleUnavailableError, zb_auto
from schedules.schedule import Schedule

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
from benchmarks.torch_orders import StandInStage, torch_schedule  # noqa: E402 - after the torch skip


def makespan(trace) -> float:
    return step_metrics(trace).makespan


def span_then_step(trace) -> tuple[float, float]:
    """(the longest rank's span from its first compute start to its last end, the step):
    the order zb-auto ranks its candidates in, the zero-bubble paper's cost first."""
    columns = trace.columns
    compute = columns.on_stream("compute")
    rank, start, end = columns.rank[compute], columns.start[compute], columns.end[compute]
    spans = [end[rank == each].max() - start[rank == each].min() for each in set(rank.tolist())]
    return max(spans), makespan(trace)


def peak_stash(trace, chunks: int) -> float:
    return max(rank.peak_inflight_microbatches for rank in step_metrics(trace, chunks).ranks)


# --- closed forms under unit costs (F = I = W = 1, free links) --------------------------


@pytest.mark.parametrize("pp", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_zb_h1_bubble_is_a_third_of_1f1bs(pp, extra):
    microbatches = pp + extra
    work = 3 * microbatches
    one_f_one_b = makespan(run(generate("1f1b", pp, microbatches), 1, 1, 1)) - work
    zb_h1 = makespan(run(generate("zb-h1", pp, microbatches), 1, 1, 1)) - work
    assert one_f_one_b == pytest.approx((pp - 1) * 3)  # (p-1)(F+I+W)
    assert zb_h1 == pytest.approx((pp - 1) * 1)  # (p-1)(F+I-W)
    assert zb_h1 == pytest.approx(one_f_one_b / 3)


@pytest.mark.parametrize(("forward", "backward_input", "backward_weight"), [(1, 1, 0.5), (1, 1.5, 0.5), (2, 1, 1)])
def test_zb_h1_bubble_with_unequal_passes(forward, backward_input, backward_weight):
    pp, microbatches = 4, 12
    trace = run(generate("zb-h1", pp, microbatches), forward, backward_input, backward_weight)
    bubble = longest_rank_span(trace) - microbatches * (forward + backward_input + backward_weight)
    assert bubble == pytest.approx((pp - 1) * (forward + backward_input - backward_weight))


@pytest.mark.parametrize("pp", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("rounds", [2, 3])
def test_zb_h2_has_zero_bubble_and_twice_the_memory(pp, rounds):
    microbatches = rounds * pp
    trace = run(generate("zb-h2", pp, microbatches), 1, 1, 1)
    assert longest_rank_span(trace) == pytest.approx(3 * microbatches)  # zero bubble per rank
    assert makespan(trace) == pytest.approx(3 * microbatches + (pp - 1))  # + the lead-in of p-1 forwards
    assert peak_stash(trace, 1) <= 2 * pp - 1


@pytest.mark.parametrize(
    ("forward", "backward_input", "backward_weight", "hop"),
    [(1, 1, 1, 0.5), (1, 1, 0.5, 0.25), (2, 1, 1, 0.3), (1, 1.5, 0.5, 0.2), (1, 1, 0.5, 0.0), (1.2, 1, 1, 0.3),
     (1, 0.6, 1, 0.1)],
)
@pytest.mark.parametrize(("pp", "microbatches"), [(4, 8), (4, 16), (6, 24)])
def test_zb_h2_bubble_under_communication(forward, backward_input, backward_weight, hop, pp, microbatches):
    """(p-1)(F + I - 2W + 2T) where positive, zero otherwise (the paper's Section 2.2).
    The fixed order's analysis assumes a round trip 2T fits in a W and W is no longer
    than F + I (true of transformer layers); beyond that its steady state stalls too and
    zb-auto's re-planning is what helps (``test_zb_auto_closes_the_bubble...``)."""
    trace = run(generate("zb-h2", pp, microbatches), forward, backward_input, backward_weight, hop)
    bubble = longest_rank_span(trace) - microbatches * (forward + backward_input + backward_weight)
    expected = max(0.0, (pp - 1) * (forward + backward_input - 2 * backward_weight + 2 * hop))
    assert bubble == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("pp", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("rounds", [2, 3])
def test_zbv_zero_bubble_with_1f1b_memory(pp, rounds):
    """Per chunk F = I = W = 1 (per rank 2 each): no gap on any rank, a lead-in of p-1
    chunk forwards, at most p microbatches of the rank's share in flight."""
    microbatches = rounds * pp
    trace = run(generate("zbv", pp, microbatches, 2), 2, 2, 2)
    assert longest_rank_span(trace) == pytest.approx(6 * microbatches)
    assert makespan(trace) == pytest.approx(6 * microbatches + (pp - 1) * 1)
    assert peak_stash(trace, 2) <= pp


@pytest.mark.parametrize(("pp", "microbatches"), [(4, 8), (4, 24), (8, 32)])
def test_the_authors_comparison_table(pp, microbatches):
    """sail-sg's "Comparison assuming T_F=T_B=T_W": bubble rate (bubble over compute),
    activation memory and pipeline communication volume relative to 1F1B."""
    table = {"1f1b": ((pp - 1) / microbatches, 1, 1), "zb-h1": ((pp - 1) / (3 * microbatches), 1, 1),
             "zb-h2": (0.0, (2 * pp - 1) / pp, 1), "zbv": (0.0, 1, 2)}  # "2x": 2p - 1 stashes (Section 2.2)
    one_f_one_b = generate("1f1b", pp, microbatches)
    base_memory = peak_stash(run(one_f_one_b, 1, 1, 1), 1)
    base_sends = sum(action.kind.startswith("SEND") for program in lower(one_f_one_b).programs for action in program)
    for name, (rate, memory, volume) in table.items():
        schedule = generate(name, pp, microbatches, 2 if name == "zbv" else 1)
        trace = run(schedule, 1, 1, 1) if name != "zbv" else run(schedule, 2, 2, 2)
        work = 3 * microbatches * (2 if name == "zbv" else 1)
        assert (longest_rank_span(trace) - work) / work == pytest.approx(rate, abs=1e-12), name
        assert peak_stash(trace, schedule.virtual_stages) / base_memory == pytest.approx(memory), name
        sends = sum(action.kind.startswith("SEND") for program in lower(schedule).programs for action in program)
        assert sends / base_sends == pytest.approx(volume), name


# --- zb-auto ------------------------------------------------------------------------------


@st.composite
def auto_cases(draw):
    pp = draw(st.integers(1, 6))
    microbatches = draw(st.integers(1, 16))
    passes = [draw(st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0])) for _ in range(3)]
    hop = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    limit = draw(st.integers(1, 2 * pp))
    # the optimising pass on a quarter of the cases (about a second each); heuristics alone
    # on the rest, which must keep the same promises
    search_seconds = draw(st.sampled_from([0.0, 0.0, 0.0, 0.2]))
    return pp, microbatches, passes, hop, limit, search_seconds


@settings(max_examples=60, deadline=None)
@given(auto_cases())
# zb-auto's order here has the shorter longest span (11.3 s against zb-h1's 11.55 s) and the
# longer step (11.6 s against 11.55 s): the paper's cost ranks the span first
@example((5, 7, [0.25, 0.5, 0.5], 0.1, 6, 0.0))
def test_zb_auto_respects_its_memory_limit_and_beats_the_handcrafted_orders(case):
    """Within its memory limit; never worse than the handcrafted orders that fit it in
    the cost it ranks candidates by (the longest rank span, then the step), measured in
    the papers' model."""
    pp, microbatches, (forward, backward_input, backward_weight), hop, limit, search_seconds = case
    schedule = zb_auto(pp, microbatches, forward, backward_input, backward_weight, hop, limit,
                       search_seconds=search_seconds)
    trace = run(schedule, forward, backward_input, backward_weight, hop)
    assert peak_stash(trace, 1) <= limit
    ours = makespan(trace)
    assert ours >= microbatches * (forward + backward_input + backward_weight) - 1e-9
    ranked = span_then_step(trace)
    for name, memory in (("zb-h1", pp), ("zb-h2", 2 * pp - 1)):
        if limit >= memory:
            handcrafted = span_then_step(run(generate(name, pp, microbatches), forward, backward_input,
                                             backward_weight, hop))
            assert ranked[0] <= handcrafted[0] + 1e-9, name
            if ranked[0] >= handcrafted[0] - 1e-9:  # the same span: the step decides
                assert ranked[1] <= handcrafted[1] + 1e-9, name


def test_zb_auto_closes_the_bubble_where_the_handcrafted_order_cannot():
    """Round trips longer than a W stall zb-h2's fixed order; zb-auto plans for them."""
    pp, microbatches, hop = 4, 16, 1.0
    handcrafted = run(generate("zb-h2", pp, microbatches), 1, 1, 1, hop)
    auto = run(zb_auto(pp, microbatches, 1, 1, 1, hop, 2 * pp - 1), 1, 1, 1, hop)
    assert makespan(auto) < makespan(handcrafted)


@pytest.mark.parametrize("limit", [0, -3, 2.5])
def test_zb_auto_refuses_a_memory_limit_that_holds_nothing(limit):
    with pytest.raises(ScheduleUnavailableError, match=r"--memory-limit must be a whole number .* >= 1"):
        zb_auto(4, 8, 1, 1, 1, 0.0, limit)


def test_zb_auto_needs_costs_and_says_so():
    with pytest.raises(ValueError, match="zb-auto builds its order from stage costs"):
        generate("zb-auto", 4, 8)


# --- torch interop ---------------------------------------------------------------------

TORCH_CASES = [(2, 4), (4, 8), (4, 12), (3, 9), (8, 16)]
COSTS = [(1, 1, 1, 0.0), (1, 1.2, 0.6, 0.1), (1.5, 1, 0.4, 0.3)]


@pytest.mark.parametrize("name", ["zb-h1", "interleaved-zb", "zbv", "looped-bfs", "dualpipev"])
@pytest.mark.parametrize(("pp", "microbatches"), TORCH_CASES)
@pytest.mark.parametrize(("forward", "backward_input", "backward_weight", "hop"), COSTS)
@pytest.mark.parametrize("production", [False, True], ids=["papers-model", "nccl-lowering"])
def test_our_orders_are_never_slower_than_torchs(name, pp, microbatches, forward, backward_input, backward_weight,
                                                hop, production):
    chunks = 1 if name == "zb-h1" else 2
    try:
        ours = generate(name, pp, microbatches, chunks)
    except ScheduleUnavailableError:
        with pytest.raises(ValueError):  # torch refuses the same sizes
            torch_schedule(name, pp, microbatches)
        return
    theirs = torch_schedule(name, pp, microbatches)
    assert theirs.placement == ours.placement
    ours_time = makespan(run(ours, forward, backward_input, backward_weight, hop, production))
    theirs_time = makespan(run(theirs, forward, backward_input, backward_weight, hop, production))
    assert ours_time <= theirs_time * (1 + 1e-12)


@pytest.mark.parametrize(("pp", "microbatches"), TORCH_CASES)
@pytest.mark.parametrize(("forward", "backward_input", "backward_weight", "hop"), COSTS)
@pytest.mark.parametrize("production", [False, True], ids=["papers-model", "nccl-lowering"])
def test_zb_auto_is_never_slower_than_torchs_zb1p(pp, microbatches, forward, backward_input, backward_weight, hop,
                                                  production):
    ours = zb_auto(pp, microbatches, forward, backward_input, backward_weight, hop, pp)
    theirs = torch_schedule("zb-h1", pp, microbatches)
    assert makespan(run(ours, forward, backward_input, backward_weight, hop, production)) <= makespan(
        run(theirs, forward, backward_input, backward_weight, hop, production)) * (1 + 1e-12)


def torch_runtime_schedule(schedule: Schedule):
    """A torch schedule object over stand-in stages for ``schedule``'s rank 0, of a class
    with the right number of stages per rank, ready to ``_load_csv`` into."""
    chunks = schedule.virtual_stages
    stages = [StandInStage(stage, schedule.num_stages, schedule.pp, 0) for stage in schedule.stages_of(0)]
    if schedule.placement[-1] == 0 and chunks == 2:
        return torch_schedules.ScheduleZBVZeroBubble(stages, max(schedule.microbatches, 2 * schedule.pp))
    return torch_schedules.ScheduleInterleavedZeroBubble(stages, schedule.pp * chunks)


@pytest.mark.parametrize(
    ("name", "pp", "microbatches", "chunks"),
    [("zb-h1", 4, 8, 1), ("zb-h2", 4, 8, 1), ("zbv", 4, 8, 2), ("interleaved-zb", 4, 8, 2), ("looped-bfs", 3, 6, 2),
     ("zb-auto", 4, 8, 1), ("dualpipev", 4, 8, 2)],
)
def test_torch_reads_and_lowers_our_csv(tmp_path, name, pp, microbatches, chunks):
    schedule = (zb_auto(pp, microbatches, 1, 1, 0.5, 0.1, 2 * pp - 1) if name == "zb-auto"
                else generate(name, pp, microbatches, chunks))
    path = tmp_path / f"{name}.csv"
    schedule_to_csv(schedule, path)
    loader = torch_runtime_schedule(schedule)
    loader._n_microbatches = microbatches
    loader._load_csv(str(path))  # parses, validates completeness, infers placement and lowers
    written = {rank: row.split(",") for rank, row in enumerate(path.read_text().splitlines())}
    assert {rank: [str(action) for action in actions] for rank, actions in loader.pipeline_order.items()} == written
    assert sum(len(row) for row in written.values()) == schedule.num_actions - sum(map(len, schedule.fused))
    assert [loader.stage_index_to_group_rank[stage] for stage in range(schedule.num_stages)] == list(
        schedule.placement)
    assert loader.pipeline_order_with_comms  # torch's own lowering accepted the order


def test_zb_auto_from_the_command_line_respects_memory_limit(tmp_path, capsys):
    from pipesim.cli import main

    out = tmp_path / "result.json"
    assert main(["simulate", "--schedule", "zb-auto", "--pp", "4", "-m", "12", "--fwd", "1e-3", "--bwd", "2e-3",
                 "--wgrad", "1e-3", "--memory-limit", "2", "--json", str(out)]) == 0
    import json

    result = json.loads(out.read_text())
    assert max(rank["peak_inflight_microbatches"] for rank in result["ranks"]) <= 2
    assert result["schedule"] == "zb-auto"


def test_run_simulation_of_zb_schedules_counts_split_backward_as_busy():
    result = run_simulation(generate("zb-h1", 4, 8), uniform_costs(4, 1.0, 2.0, 1.0), ideal_topology())
    assert all(rank.busy == pytest.approx(8 * 3) for rank in result.metrics.ranks)


# --- overlapped pairs (DualPipeV) --------------------------------------------------------


def overlapped_program(overlap_fb: float):
    """One rank holding stages 0 and 1 (F = 1, B = 2 each), with 0F1 and 0B0 overlapped."""
    from schedules.action import B, F

    program = [F(0, 0), F(1, 0), B(1, 0), F(0, 1), B(0, 0), F(1, 1), B(1, 1), B(0, 1)]
    schedule = Schedule(1, 2, (0, 0), [program], fused=(frozenset({4}),))
    costs = uniform_costs(2, 1.0, 2.0)
    if overlap_fb:
        stages = list(costs.stages)
        stages[0] = dataclasses.replace(stages[0], overlap_fb=overlap_fb)
        costs = dataclasses.replace(costs, stages=tuple(stages))
    return schedule, costs


@pytest.mark.parametrize(("overlap_fb", "expected"), [(0.0, 12.0), (2.2, 12.0 - 3.0 + 2.2), (3.5, 12.5)])
def test_an_overlapped_pair_costs_its_own_time(overlap_fb, expected):
    """Four forwards (1 s) and four backwards (2 s) run back to back: 12 s, except that
    the pair 0F1 + 0B0 costs ``overlap_fb`` when the costs give it (F + B = 3 s if not),
    shared 1:2 between the two actions in the Trace."""
    schedule, costs = overlapped_program(overlap_fb)
    trace = simulate(schedule, costs, ideal_topology())
    assert makespan(trace) == pytest.approx(expected)
    by_action = {event.action: event for event in trace.events}
    pair = overlap_fb or 3.0
    assert by_action["0F1"].duration == pytest.approx(pair / 3)
    assert by_action["0B0"].duration == pytest.approx(2 * pair / 3)
    assert by_action["0B0"].start == pytest.approx(by_action["0F1"].end)


def test_overlapped_pairs_in_csv_are_torchs_cells(tmp_path):
    schedule = generate("dualpipev", 4, 10, 2)
    path = tmp_path / "dualpipev.csv"
    schedule_to_csv(schedule, path)
    cells = [cell for row in path.read_text().splitlines() for cell in row.split(",")]
    pairs = [cell for cell in cells if cell.endswith("OVERLAP_F_B")]
    assert len(pairs) == sum(len(positions) for positions in schedule.fused)
    for cell in pairs:  # torch parses each into the same forward and backward
        parsed = torch_schedules._Action.from_str(cell)
        assert parsed.computation_type.value == "OVERLAP_F_B"
        assert cell == f"({parsed.sub_actions[0]};{parsed.sub_actions[1]})OVERLAP_F_B"
    loaded = schedule_from_csv(path)
    assert loaded.programs == schedule.programs and loaded.fused == schedule.fused
    # and the pairs come back the same way from torch's own DualPipeV order
    theirs = torch_schedule("dualpipev", 4, 10)
    assert theirs.programs == schedule.programs and theirs.fused == schedule.fused


def test_overlapped_pairs_stay_adjacent_and_marked_through_lowering():
    schedule = generate("dualpipev", 3, 8, 2)
    lowered = lower(schedule)
    for rank in range(schedule.pp):
        assert lowered.fused_pairs(rank) == schedule.fused_pairs(rank)


@pytest.mark.parametrize(("pp", "microbatches"), [(2, 4), (4, 8), (4, 16), (8, 32)])
def test_nccl_lowering_of_overlapped_pairs_costs_nothing_with_free_links(pp, microbatches):
    """Lowering plans each pair as one step, so with free links the rendezvous-safe
    groups take no more time than the papers' model (each transfer at its producer and
    consumer); the same holds for the V schedule without pairs."""
    for name in ("dualpipev", "zbv"):
        schedule = generate(name, pp, microbatches, 2)
        ideal = makespan(run(schedule, 1, 1, 1))
        assert makespan(run(schedule, 1, 1, 1, production=True)) == pytest.approx(ideal)
