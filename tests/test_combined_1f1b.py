"""``--ep-overlap``: Megatron-Core's combined 1F1B (``--overlap-moe-expert-parallel-comm``).
Every rank runs one more warm-up forward than Megatron's interleaved order, then each
steady-state forward together with the backward after it, the all-to-alls of one under
the other's compute. The orders against Megatron-Core's warm-up rule by hand, the
schedules valid under every P2P semantics (random sizes), the price of a pair by hand
(``pipesim.sim.overlap``'s rule, with the overlap slowdown at 0: ``max(0, A - C)``), and
the flag's one-line errors where Megatron-Core refuses the layout."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.cli import main
from schedules import lower, validate
from schedules.generators import ScheduleUnavailableError
from schedules.generators.combined import combined_1f1b
from schedules.generators.interleaved import interleaved_1f1b
from schedules.p2p import P2P_SEMANTICS
from tests.cli_runs import assert_one_line_error, simulate_json

QWEN3_30B = "qwen3-30b-a3b"


def _warmups(schedule) -> list[int]:
    """Each rank's warm-up forwards: those before its first backward, less the steady
    state's first forward (Megatron's steady state runs a forward, then a backward)."""
    return [next(position for position, action in enumerate(program) if action.kind != "F") - 1
            for program in schedule.programs]


def test_without_pipelining_the_forward_of_the_next_microbatch_runs_with_the_backward():
    """pp 1, 4 microbatches (Megatron-Core's combined_1f1b_schedule_for_no_pipelining):
    F0, then F1 with B0, F2 with B1, F3 with B2, then B3."""
    schedule = combined_1f1b("1f1b", 1, 4)
    assert [str(action) for action in schedule.programs[0]] == \
           ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"]
    assert [(str(f), str(b)) for f, b in schedule.fused_pairs(0)] == [("0F1", "0B0"), ("0F2", "0B1"), ("0F3", "0B2")]


def test_interleaved_warm_up_is_megatrons_plus_one():
    """pp 4, v 2, 8 microbatches (N = 4): Megatron's warm-up 2(p - r - 1) + (v - 1) N is
    10, 8, 6, 4 forwards; combined 1F1B runs one more on every rank, and every later
    forward is paired with the backward after it: 16 - 11, 16 - 9, 16 - 7, 16 - 5 pairs."""
    plain = interleaved_1f1b(4, 8, 2)
    combined = combined_1f1b("interleaved-1f1b", 4, 8, 2)
    assert _warmups(plain) == [10, 8, 6, 4]
    assert _warmups(combined) == [11, 9, 7, 5]
    assert [len(combined.fused_pairs(rank)) for rank in range(4)] == [5, 7, 9, 11]
    for rank in range(4):  # the same actions, one forward moved ahead
        assert sorted(map(str, combined.programs[rank])) == sorted(map(str, plain.programs[rank]))
    assert combined.meta["combined_1f1b"] is True


@st.composite
def interleaved_sizes(draw):
    pp = draw(st.integers(1, 5))
    chunks = draw(st.integers(1, 3))
    microbatches = pp * draw(st.integers(1, 4))
    return pp, microbatches, chunks


@settings(max_examples=30, deadline=None)
@given(interleaved_sizes())
def test_combined_orders_validate_and_pair_only_independent_halves(size):
    """Random sizes: the order and its lowering validate under every P2P semantics (no
    deadlock: a pair's forward waits for both halves' inputs), and no pair runs the
    forward and the backward of the same microbatch on the same stage."""
    pp, microbatches, chunks = size
    schedule = combined_1f1b("interleaved-1f1b", pp, microbatches, chunks)
    validate(schedule)
    lowered = lower(schedule)
    for semantics in P2P_SEMANTICS:
        validate(lowered, semantics)
    for rank in range(pp):
        for forward, backward in schedule.fused_pairs(rank):
            assert (forward.stage, forward.microbatch) != (backward.stage, backward.microbatch)


def test_other_orders_are_refused_by_name():
    with pytest.raises(ScheduleUnavailableError, match="needs the interleaved schedule"):
        combined_1f1b("1f1b", 4, 8)
    with pytest.raises(ScheduleUnavailableError, match="zb-h1 is not one of them"):
        combined_1f1b("zb-h1", 4, 8)


STEP = ["--model", QWEN3_30B, "--seq-len", "4096", "--microbatch-size", "1", "--schedule", "1f1b", "--pp", "1",
        "-m", "2", "--dp", "8", "--ep", "8", "--topology", "nvlink", "--gpu", "h100", "--overlap-slowdown", "0"]


def test_a_pair_hides_each_halfs_all_to_alls_under_the_others_compute():
    """pp 1, 2 microbatches: F0 alone, then F1 with B0, then B1 alone. Each pass's two
    all-to-alls take A (the backward's are the forward's reversed); alone they hold the
    rank after their action, in the pair only what the other half's compute C does not
    cover: A + max(0, A - C_B) + max(0, A - C_F) + A, against 4 A in turn."""
    apart = simulate_json(STEP)
    together = simulate_json([*STEP, "--ep-overlap"])
    (rank,), (paired,) = apart["ranks"], together["ranks"]
    (stage,) = apart["stage_costs"]
    all_to_all = rank["ep"] / 4
    forward, backward = stage["fwd"], stage["bwd"]
    assert paired["ep"] == pytest.approx(2 * all_to_all + max(0.0, all_to_all - backward)
                                         + max(0.0, all_to_all - forward), rel=1e-9)
    assert paired["ep"] < rank["ep"]
    assert paired["busy"] == pytest.approx(rank["busy"], rel=1e-12)  # the compute keeps its own time
    assert together["ep_overlap"] is True and apart["ep_overlap"] is False


@pytest.mark.parametrize(("extra", "message"), [
    (["--ep-overlap"], "--ep-overlap needs --ep above 1"),
    (["--ep-overlap", "--ep", "8", "--schedule", "1f1b", "--pp", "2"], "needs the interleaved schedule"),
    (["--ep-overlap", "--ep", "8", "--schedule", "gpipe", "--pp", "2"], "--ep-overlap conflicts with --schedule gpipe"),
    (["--ep-overlap", "--ep", "8", "--schedule", "interleaved-1f1b", "--pp", "2", "--recompute", "full"],
     "--ep-overlap conflicts with --recompute full"),
])
def test_layouts_megatron_core_refuses_are_one_line(extra, message, capsys):
    args = ["simulate", "--model", QWEN3_30B, "--seq-len", "4096", "-m", "4", "--dp", "8", *extra]
    assert_one_line_error(capsys, args, message)


@pytest.mark.parametrize(("fields", "message"), [
    ({"ep": 1}, "--ep-overlap needs --ep above 1"),
    ({"schedule": "gpipe", "pp": 2}, "--ep-overlap conflicts with --schedule gpipe"),
    ({"schedule": "1f1b", "pp": 2}, "needs the interleaved schedule"),
    ({"schedule": "interleaved-1f1b", "pp": 2, "virtual_stages": 2, "recompute": "full"},
     "--ep-overlap conflicts with --recompute full"),
])
def test_the_executor_refuses_what_megatron_core_refuses(fields, message):
    """``pipesim run --ep-overlap`` runs combined 1F1B (its gradients:
    tests/test_executor_expert_parallel.py) where simulate does, and refuses the rest alike."""
    from executor.config import ConfigError, RunConfig

    base = {"model": "mixtral-8x7b", "hidden": 16, "heads": 4, "kv_heads": 2, "layers": 4, "experts": 4,
            "seq_len": 8, "vocab": 37, "batch_size": 8, "dp": 2, "ep": 2, "pp": 1, "microbatches": 4,
            "ep_overlap": True}
    with pytest.raises(ConfigError, match=message):
        RunConfig(**{**base, **fields}).check()


def test_run_builds_the_combined_order_it_was_asked_for():
    from executor.config import RunConfig, build_schedule

    config = RunConfig(model="mixtral-8x7b", hidden=16, heads=4, kv_heads=2, layers=4, experts=4, seq_len=8,
                       vocab=37, batch_size=8, dp=2, ep=2, pp=2, schedule="interleaved-1f1b", virtual_stages=2,
                       microbatches=4, ep_overlap=True)
    schedule = build_schedule(config)
    assert schedule.meta["combined_1f1b"] is True
    assert [len(schedule.fused_pairs(rank)) for rank in range(2)] == \
           [len(combined_1f1b("interleaved-1f1b", 2, 4, 2).fused_pairs(rank)) for rank in range(2)]


def test_every_moment_of_a_combined_step_is_labelled():
    """A pair on the first stage starts once its backward's input is there: that wait is
    drawn as the receive it waits for (bubble), so no rank's time is left unlabelled."""
    result = simulate_json(["--model", QWEN3_30B, "--seq-len", "4096", "--schedule", "interleaved-1f1b", "-v", "2",
                            "--pp", "4", "-m", "16", "--dp", "4", "--ep", "4", "--topology", "ib", "--nodes", "2",
                            "--gpu", "h100", "--ep-overlap"])
    for rank in result["ranks"]:
        assert rank["overhead"] == 0.0
        assert sum(rank[part] for part in ("busy", "bubble", "exposed_comm", "tp", "ep", "cp", "dp", "optimizer")) == \
               pytest.approx(result["makespan"], rel=1e-9)


def test_the_docs_quote_qwen3_235bs_step_as_simulated():
    """docs/cluster-model.md's Qwen3-235B-A22B example, the recipe's layout with the
    all-to-alls exposed and combined."""
    from pathlib import Path

    docs = " ".join((Path(__file__).resolve().parents[1] / "docs" / "cluster-model.md").read_text().split())
    args = ["--model", "qwen3-235b-a22b", "--seq-len", "4096", "--microbatch-size", "1",
            "--schedule", "interleaved-1f1b", "-v", "4", "--pp", "8", "-m", "128", "--tp", "2", "--dp", "16",
            "--topology", "ib", "--nodes", "32", "--gpu", "h100", "--zero", "1", "--sequence-parallel",
            "--no-tp-overlap", "--ep", "32", "--etp", "1", "--fp8", "current", "--cross-entropy", "te"]
    exposed, combined = simulate_json(args), simulate_json([*args, "--ep-overlap"])
    assert (f"{exposed['makespan']:.2f} s a step with the all-to-alls exposed ({exposed['ranks'][0]['ep']:.2f} s of "
            f"ep on every rank but the last), {combined['makespan']:.2f} s combined "
            f"({combined['ranks'][0]['ep']:.2f} s of ep)") in docs
    for rank in exposed["ranks"][1:-1]:  # every rank but the last alike
        assert rank["ep"] == pytest.approx(exposed["ranks"][0]["ep"], rel=1e-12)


def test_sweep_runs_each_point_combined_as_simulate_does(tmp_path, capsys):
    """``sweep --ep-overlap``: each point the step ``simulate --ep-overlap`` gives; a swept
    schedule combined 1F1B does not cover refuses the sweep in one line."""
    import csv

    common = ["--model", QWEN3_30B, "--seq-len", "4096", "--pp", "2", "--dp", "8", "--ep", "8", "--topology", "ib",
              "--nodes", "2", "--ep-overlap"]
    out = tmp_path / "sweep.csv"
    assert main(["sweep", *common, "--schedule", "interleaved-1f1b", "--microbatches", "4,8", "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    for row in rows:
        alone = simulate_json([*common, "--schedule", "interleaved-1f1b", "-m", row["microbatches"]])
        assert float(row["makespan"]) == pytest.approx(alone["makespan"], rel=1e-12)
    capsys.readouterr()
    assert main(["sweep", *common, "--schedule", "interleaved-1f1b,gpipe", "--microbatches", "4"]) == 2
    assert "--ep-overlap conflicts with --schedule gpipe" in capsys.readouterr().err


@pytest.mark.parametrize("semantics", ["rendezvous", "buffered", "torch-runtime"])
def test_the_compiled_engine_and_its_simpy_specification_agree_on_combined_1f1b(semantics):
    """Bit for bit, on a dp 2 x tp 2 job over two InfiniBand nodes with activations and
    gradients to move: the combined order's pairs are read alike by both (random orders
    too: tests/test_engine_reference.py draws combined 1F1B beside the generators)."""
    from pipesim.cluster import presets
    from pipesim.cluster.mapping import map_ranks
    from pipesim.model.costs import uniform_costs
    from pipesim.sim.engine import step_timing
    from pipesim.sim.parallel import comm_plan
    from schedules import engine
    from tests.test_engine_reference import assert_walks_agree

    if engine._compiled is None:
        pytest.skip("the compiled engine is not built")
    schedule = lower(combined_1f1b("interleaved-1f1b", 4, 8, 2))
    costs = uniform_costs(schedule, 1e-3, 2e-3, 0.0, act_bytes=5e7, param_bytes=1e8)
    topology = presets.ib(4)
    mapping = map_ranks(topology, dp=2, pp=4, tp=2)
    assert_walks_agree(schedule, step_timing(schedule, costs, topology, mapping.pipeline(),
                                             comm_plan(schedule, costs, topology, mapping)), semantics)
