"""Whether a flat lowered file can hang torch's ``_PipelineScheduleRuntime`` on NCCL
(schedules.torch_runtime): an order that hangs and one that does not, the one difference
from pipesim's rendezvous semantics (torch's streams are per peer, pipesim's per rank),
the wait graph agreeing with pipesim's rendezvous walk when given one stream per rank,
and the lowering target never producing a file that hangs."""

from __future__ import annotations

import io
import random

import pytest

from schedules.action import COMM_KINDS, parse_action
from schedules.csv_io import schedule_from_csv
from schedules.generators import GENERATORS, MULTI_CHUNK, generate, zb_auto
from schedules.lowering import lower
from schedules.p2p import P2PError, check_pair_order
from schedules.schedule import Schedule
from schedules.torch_runtime import (
    as_torch_posts,
    check_torch_runtime,
    check_torch_runtime_progress,
    is_torch_runtime_safe,
    lower_for_torch_runtime,
    wait_cycle,
)
from schedules.validate import ScheduleValidationError, is_valid, validate


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
    for waits in ("rank 0's 0SEND_F1 (position 3) completes only once rank 1's 1RECV_F1 (position 4) has started",
                  "rank 1's 1RECV_F1 (position 4) starts only after rank 1's 1SEND_B0 (position 3)",
                  "rank 1's 1SEND_B0 (position 3) completes only once rank 0's 0RECV_B0 (position 4) has started",
                  "rank 0's 0RECV_B0 (position 4) starts only after rank 0's 0SEND_F1 (position 3)"):
        assert waits in message
    assert set(caught.value.cycle) == {parse_action(text) for text in ("0SEND_F1", "1RECV_F1", "1SEND_B0", "0RECV_B0")}
    assert not is_torch_runtime_safe(HANGS)


def test_the_progress_check_alone_raises_as_pipesims_p2p_checks_do():
    """``check_torch_runtime_progress`` is the piece a validator dispatching on a semantics
    name calls after its structural and pair-order checks, like ``p2p.check_progress``."""
    with pytest.raises(P2PError, match="can hang torch's") as caught:
        check_torch_runtime_progress(HANGS)
    assert (caught.value.rank, caught.value.position) in {(0, 3), (0, 4), (1, 3), (1, 4)}
    check_torch_runtime_progress(RUNS)


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


def test_wait_graph_with_one_stream_per_rank_is_pipesims_rendezvous_walk():
    """Two implementations of the rendezvous rule, a walk (schedules.p2p) and a graph
    search (schedules.torch_runtime), agree on every shuffled order that is well formed;
    the sample holds both orders that hang and orders that run."""
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
        outcomes[runs] += 1
    assert outcomes[True] > 50 and outcomes[False] > 10, outcomes


@pytest.mark.parametrize("name", [*GENERATORS, "zb-auto"])
def test_lowering_for_torchs_runtime_never_hangs_it(name):
    virtual = (2, 3) if name in MULTI_CHUNK else (1,)
    for pp in (2, 3, 4, 5):
        for microbatches in (1, 2, 3, 4, 8, 12):
            for chunks in virtual:
                try:
                    schedule = (zb_auto(pp, microbatches, 1.0, 1.2, 0.6, 0.2, pp) if name == "zb-auto"
                                else generate(name, pp, microbatches, chunks))
                except ValueError:
                    continue  # the generator does not exist for these sizes
                lowered = lower_for_torch_runtime(schedule)
                assert not any(lowered.joins)
                assert lowered.programs == lower(schedule).programs
                assert not wait_cycle(lowered)


def test_torchs_own_lowered_orders_pass():
    """Another implementation's orders: torch's schedule classes lower their own orders
    (``_add_send_recv``), and those run on GPUs; the check accepts every one."""
    torch_orders = pytest.importorskip("tests.torch_orders")
    for name in torch_orders.TORCH_CLASSES:
        for pp in (2, 3, 4):
            lowered = torch_orders.torch_lowered_schedule(name, pp, 2 * pp)
            check_torch_runtime(lowered)


def test_a_flat_file_is_checked_as_torch_reads_it():
    text = "\n".join(",".join(row.split()) for row in (
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0REDUCE_GRAD",
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1REDUCE_GRAD"))
    assert not is_torch_runtime_safe(schedule_from_csv(io.StringIO(text)))
