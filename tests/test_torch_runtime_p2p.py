"""Whether a flat lowered file can hang torch's ``_PipelineScheduleRuntime`` on NCCL
(schedules.torch_runtime): an order that hangs and one that does not, the one difference
from pipesim's rendezvous semantics (torch's streams are per peer, pipesim's per rank),
the engine's verdict agreeing with an independent wait-graph search (tests/torch_wait_graph.py)
on generated and shuffled orders, with per-peer streams and with one stream per rank, and
the lowering target never producing a file that hangs."""

from __future__ import annotations

import io
import random

import pytest

from schedules.action import COMM_KINDS, parse_action
from schedules.csv_io import schedule_from_csv
from schedules.generators import GENERATORS, MULTI_CHUNK, generate, interleaved_auto, zb_auto, zbv_auto
from schedules.lowering import lower
from schedules.p2p import P2PError, check_pair_order
from schedules.schedule import Schedule
from schedules.torch_runtime import as_torch_posts, check_torch_runtime, is_torch_runtime_safe, lower_for_torch_runtime
from schedules.validate import ScheduleValidationError, is_valid, validate
from tests.torch_wait_graph import wait_cycle


def flat(*rows: str, microbatches: int = 2) -> Schedule:
    programs = [[parse_action(text) for text in row.split()] for row in rows]
    placement = tuple(sorted({action.stage: rank for rank, program in enumerate(programs)
                              for action in program}.items()))
    return Schedule(len(rows), microbatches, tuple(rank for _, rank in placement), programs)


# 1F1B on two ranks, two microbatches. Rank 1 posts 1SEND_B0 before 1RECV_F1: on NCCL,
# rank 0's 0SEND_F1 waits for rank 1 to start 1RECV_F1, which sits behind 1SEND_B0 on the
# pair's stream; 1SEND_B0 waits for rank 0 to start 0RECV_B0, which sits behind 0SEND_F1.
HANGS = flat("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
             "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1")
# The same compute, rank 1 posting 1RECV_F1 before its first backward: the pair's
# transfers are posted in the same order on both ranks.
RUNS = flat("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
            "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1")


def test_an_order_that_hangs_torchs_runtime_on_nccl_is_refused_naming_the_cycle():
    assert is_valid(HANGS, "buffered")  # gloo buffers sends: it runs there
    with pytest.raises(ScheduleValidationError, match="can hang torch's _PipelineScheduleRuntime") as caught:
        check_torch_runtime(HANGS)
    message = str(caught.value)
    # rank 0's 0SEND_F1 waits for 1RECV_F1, behind 1SEND_B0 on the pair's stream, which
    # waits for 0RECV_B0, behind 0SEND_F1
    assert ("rank 0's group 0SEND_F1 (position 3) waits for rank 1 to post 1RECV_F1 (in 1RECV_F1, position 4), "
            "which cannot start before rank 1's earlier group 1SEND_B0 (position 3) completes") in message
    assert ("rank 1's group 1SEND_B0 (position 3) waits for rank 0 to post 0RECV_B0 (in 0RECV_B0, position 4), "
            "which cannot start before rank 0's earlier group 0SEND_F1 (position 3) completes") in message
    assert set(caught.value.cycle) == {parse_action(text) for text in ("0SEND_F1", "1RECV_F1", "1SEND_B0", "0RECV_B0")}
    assert not is_torch_runtime_safe(HANGS)


def test_the_torch_runtime_semantics_is_a_validation_semantics():
    """``validate(..., p2p="torch-runtime")`` is the check: its errors name the rule."""
    with pytest.raises(ScheduleValidationError, match="can hang torch's") as caught:
        validate(as_torch_posts(HANGS), "torch-runtime")
    assert (caught.value.rank, caught.value.position) in {(0, 3), (1, 3)}
    validate(as_torch_posts(RUNS), "torch-runtime")


def test_an_order_that_does_not_hang_passes():
    assert check_torch_runtime(RUNS).programs == RUNS.programs
    assert is_torch_runtime_safe(RUNS)


def test_groups_in_a_file_count_for_nothing():
    """torch posts every transfer alone, so a group that would make the order safe under
    pipesim's rendezvous (posted together, completing together) does not help."""
    grouped = HANGS.with_programs(HANGS.programs, joins=[frozenset(), frozenset({4})])  # 1SEND_B0+1RECV_F1
    assert is_valid(grouped, "rendezvous")
    assert not is_torch_runtime_safe(grouped)


def test_a_mismatched_pair_order_is_refused():
    swapped = flat("0F0 0F1 0SEND_F1 0SEND_F0 0RECV_B0 0B0 0RECV_B1 0B1",
                   "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1")
    with pytest.raises(ScheduleValidationError, match="NCCL pairs a rank pair's transfers in posting order"):
        check_torch_runtime(swapped)


# looped-bfs, 3 ranks, 2 chunks each (rank r holds stages r and r + 3), 3 microbatches,
# lowered, with rank 2 posting 5SEND_B0 (to rank 1) before 2RECV_B2 (from rank 0). torch
# runs the two on different streams; pipesim's rendezvous runs a rank's transfers on one
# stream, where 2RECV_B2 then waits behind 5SEND_B0 and closes a cycle through all three
# ranks (written out in full, so that no change of lowering can change the case).
TWO_STREAMS = flat(
    "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 3RECV_F0 3F0 3RECV_F1 3SEND_F0 3F1 3RECV_F2 3SEND_F1 3F2 3SEND_F2 "
    "3RECV_B2 3B2 3SEND_B2 3RECV_B1 3B1 3SEND_B1 3RECV_B0 3B0 0RECV_B2 3SEND_B0 0B2 0RECV_B1 0B1 0RECV_B0 0B0",
    "1RECV_F0 1F0 1RECV_F1 1SEND_F0 1F1 1RECV_F2 1SEND_F1 1F2 1SEND_F2 4RECV_F0 4F0 4RECV_F1 4SEND_F0 4F1 "
    "4RECV_F2 4SEND_F1 4F2 4SEND_F2 4RECV_B2 4B2 4SEND_B2 4RECV_B1 4B1 4SEND_B1 4RECV_B0 4B0 1RECV_B2 4SEND_B0 "
    "1B2 1SEND_B2 1RECV_B1 1B1 1SEND_B1 1RECV_B0 1B0 1SEND_B0",
    "2RECV_F0 2F0 2RECV_F1 2SEND_F0 2F1 2RECV_F2 2SEND_F1 2F2 2SEND_F2 5RECV_F0 5F0 5RECV_F1 5F1 5RECV_F2 5F2 "
    "5B2 5SEND_B2 5B1 5SEND_B1 5B0 5SEND_B0 2RECV_B2 2B2 2SEND_B2 2RECV_B1 2B1 2SEND_B1 2RECV_B0 2B0 2SEND_B0",
    microbatches=3)


def test_torch_runs_an_order_whose_only_cycle_crosses_two_streams_of_one_rank():
    order = TWO_STREAMS
    assert order.placement == (0, 1, 2, 0, 1, 2)
    with pytest.raises(ScheduleValidationError, match="deadlock under rendezvous semantics"):
        validate(order, "rendezvous")
    check_torch_runtime(order)  # per-peer streams: no cycle
    assert wait_cycle(order, per_peer=False)  # one stream per rank: the cycle is back


def shuffled(schedule: Schedule, rng: random.Random, swaps: int) -> Schedule:
    """``schedule`` with ``swaps`` random swaps of a transfer with its neighbour."""
    programs = [list(program) for program in schedule.programs]
    for _ in range(swaps):
        program = programs[rng.randrange(schedule.pp)]
        at = rng.randrange(len(program) - 1)
        if program[at].kind in COMM_KINDS or program[at + 1].kind in COMM_KINDS:
            program[at], program[at + 1] = program[at + 1], program[at]
    return schedule.with_programs(programs)


def test_the_engine_agrees_with_the_wait_graph_on_shuffled_orders():
    """Two formulations of the rule, the engine running the programs and a graph search
    (tests/torch_wait_graph.py), agree on every shuffled order that is well formed, with
    one stream per rank (rendezvous) and one per rank pair (torch's runtime); the sample
    holds both orders that hang and orders that run."""
    rng = random.Random(7)
    outcomes = {True: 0, False: 0}
    for _ in range(1500):
        name = rng.choice(["1f1b", "gpipe", "zb-h1", "interleaved-1f1b", "looped-bfs", "zbv"])
        pp, microbatches = rng.choice([(2, 2), (2, 4), (3, 3), (4, 4)])
        schedule = as_torch_posts(lower(generate(name, pp, microbatches, 2 if name in MULTI_CHUNK else 1)))
        order = shuffled(schedule, rng, rng.choice((2, 6, 20)))
        try:
            validate(order, "buffered")
            check_pair_order(order)
        except (ScheduleValidationError, P2PError):
            continue
        runs = is_valid(order, "rendezvous")
        assert (not wait_cycle(order, per_peer=False)) == runs, order.describe()
        assert (not wait_cycle(order)) == is_valid(order, "torch-runtime"), order.describe()
        outcomes[runs] += 1
    assert outcomes[True] > 50 and outcomes[False] > 10, outcomes


@pytest.mark.parametrize("name", [*(name for name in GENERATORS if name != "dualpipe"), "zb-auto", "zbv-auto",
                                  "interleaved-auto"])
def test_lowering_for_torchs_runtime_never_hangs_it(name):
    virtual = (2, 3) if name in MULTI_CHUNK else (1,)
    for pp in (2, 3, 4, 5):
        for microbatches in (1, 2, 3, 4, 8, 12):
            for chunks in virtual:
                try:
                    if name == "zbv-auto" and chunks != 2:
                        continue  # the V has two chunks per rank
                    schedule = (zb_auto(pp, microbatches, 1.0, 1.2, 0.6, 0.2, pp) if name == "zb-auto"
                                else zbv_auto(pp, microbatches, 1.0, 1.2, 0.6, 0.2) if name == "zbv-auto"
                                else interleaved_auto(pp, microbatches, chunks, 1.0, 1.8, 0.2, pp + 1)
                                if name == "interleaved-auto" else generate(name, pp, microbatches, chunks))
                except ValueError:
                    continue  # the generator does not exist for these sizes
                lowered = lower_for_torch_runtime(schedule)
                assert not any(lowered.joins)
                assert lowered.programs == lower(schedule).programs
                assert not wait_cycle(lowered)


def test_torchs_own_lowered_orders_pass():
    """Another implementation's orders: torch's schedule classes lower their own orders
    (``_add_send_recv``), and those run on GPUs; the check accepts every one."""
    torch_orders = pytest.importorskip("benchmarks.torch_orders")
    for name in torch_orders.TORCH_CLASSES:
        for pp in (2, 3, 4):
            lowered = torch_orders.torch_lowered_schedule(name, pp, 2 * pp)
            check_torch_runtime(lowered)


def test_a_flat_file_is_checked_as_torch_reads_it():
    text = "\n".join(",".join(row.split()) for row in (
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0REDUCE_GRAD",
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1REDUCE_GRAD"))
    assert not is_torch_runtime_safe(schedule_from_csv(io.StringIO(text)))
