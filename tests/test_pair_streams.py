"""DualPipeV's overlapped forward-backward pairs in the executor (``executor.pair_streams``):
the lane bookkeeping that puts a pair's halves on two CUDA streams runs on a CPU too
(its stream operations no-ops), so here it is checked for what it decides, and the
pairs' losses and gradients against the one-process reference (float64, 1e-10), in
one process and on gloo under NCCL's rendezvous rule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import executor.runtime
from executor.config import RunConfig
from executor.launch import launch
from executor.pair_streams import COMPUTE_LANE, OverlappedPair, PairLanes, pair_events, with_pairs
from executor.reference import reference_run
from executor.report import summary, summary_lines
from executor.worker import run_local
from schedules import generate, lower
from schedules.action import Action, parse_action
from schedules.trace import TraceEvent
from tests.launched_cases import assert_equals_reference

pytestmark = pytest.mark.timeout(240)


def event(action: str, start: float, end: float) -> TraceEvent:
    return TraceEvent.of(0, parse_action(action), start, end, "compute")


def test_halves_run_one_after_the_other_keep_their_measured_bars():
    forward, backward = event("1F1", 0.0, 2.0), event("0B0", 2.5, 6.0)
    assert pair_events(forward, backward) == (forward, backward)


def test_overlapped_halves_share_the_pair_span_in_proportion_to_their_own_times():
    """F on one stream 0..3 s, B on the other 1..2 s: the rank was busy 0..3 s once, not
    4 s; F took 3 of the halves' 4 s, so it is drawn 0..2.25 s and B 2.25..3 s."""
    forward, backward = pair_events(event("1F1", 0.0, 3.0), event("0B0", 1.0, 2.0))
    assert (forward.start, forward.end) == (0.0, 2.25)
    assert (backward.start, backward.end) == (2.25, 3.0)
    # the backward started first (its stream was free): the span still begins there
    forward, backward = pair_events(event("1F1", 1.0, 2.0), event("0B0", 0.0, 4.0))
    assert (forward.start, forward.end, backward.start, backward.end) == (0.0, 0.8, 0.8, 4.0)


def test_a_pair_becomes_one_step_and_one_split_by_a_transfer_is_refused():
    forward, backward, other = parse_action("1F1"), parse_action("0B0"), parse_action("0F2")
    send = (parse_action("1SEND_F1"),)
    assert with_pairs([other, forward, backward, send], {forward: backward}) == [
        other, OverlappedPair(forward, backward), send]
    with pytest.raises(ValueError, match=r"overlapped pair \(1F1;0B0\) is not adjacent"):
        with_pairs([forward, send, backward], {forward: backward})


def test_lanes_put_each_backward_where_its_forward_ran():
    """Autograd runs a backward where its forward ran; the pair's forward takes the other lane."""
    lanes = PairLanes(torch.device("cpu"))
    assert not lanes.overlaps
    f = parse_action
    assert lanes.assign(OverlappedPair(f("1F1"), f("0B0"))) == (1, 0)  # 0F0 ran alone, on the compute lane
    assert lanes.assign(OverlappedPair(f("0F2"), f("1B1"))) == (0, 1)  # 1F1 ran on lane 1
    assert lanes.assign(OverlappedPair(f("1F2"), f("0B1"))) == (1, 0)


def one_process_config(**fields) -> RunConfig:
    base = dict(schedule="dualpipev", pp=1, microbatches=4, virtual_stages=2, model="gpt", layers=3, hidden=8,
                heads=2, seq_len=4, vocab=11, batch_size=9, steps=2, dtype="float64", optimizer="adamw",
                lr=0.05, return_grads=True)
    return RunConfig(**{**base, **fields})


class RecordingLanes(PairLanes):
    """PairLanes that log what the runtime asks of them (a CPU has no streams to look at)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.log: list[tuple] = []
        self.runtime = None

    def fork(self) -> None:
        self.log.append(("fork",))

    def join(self) -> None:
        self.log.append(("join",))

    def hand_over(self, tensors, lane: int) -> None:
        self.log.append(("hand_over", lane, [tensor for tensor in tensors if tensor is not None],
                         self.runtime.current))

    def on(self, lane: int):
        self.log.append(("on", lane, self.runtime.current))
        return super().on(lane)


def test_one_process_pairs_follow_the_lane_rules_and_equal_the_reference(monkeypatch):
    """dualpipev on one rank (both chunks here, 5 pairs a step): each pair forks, runs its
    forward half on the lane other than its backward's, whose lane is where that
    microbatch's forward ran, hands each half its inputs, joins; losses and gradients
    equal the one-process reference, and on a CPU no pair's halves overlap."""
    made: list[RecordingLanes] = []

    def recording(device):
        made.append(RecordingLanes(device))
        return made[-1]

    monkeypatch.setattr(executor.runtime, "PairLanes", recording)
    original = executor.runtime.PipelineRuntime.overlapped_pair

    def tracked(runtime, pair):
        made[-1].runtime = runtime
        original(runtime, pair)

    monkeypatch.setattr(executor.runtime.PipelineRuntime, "overlapped_pair", tracked)
    config = one_process_config()
    result = run_local(config)
    assert_equals_reference(result, reference_run(config))

    log = made[-1].log
    halves = [(entry[1], entry[2]) for entry in log if entry[0] == "on"]
    assert len(halves) == 2 * 5 * config.steps  # 5 pairs (m = 4, pp = 1), two halves each, per step
    for step in range(config.steps):
        forward_lane: dict[tuple[int, int], int] = {}  # forwards outside pairs ran on the compute lane
        mine = halves[10 * step:10 * (step + 1)]
        for (forward_on, forward), (backward_on, backward) in zip(mine[::2], mine[1::2], strict=True):
            assert forward.kind == "F" and backward.kind == "B"
            assert backward_on == forward_lane.pop((backward.stage, backward.microbatch), COMPUTE_LANE), backward
            assert forward_on == 1 - backward_on
            forward_lane[(forward.stage, forward.microbatch)] = forward_on
    # per pair: fork, the forward's inputs handed to its lane, the backward's, join, outputs to the compute lane
    per_pair = [entry[0] for entry in log if entry[0] != "on"]
    assert per_pair == ["fork", "hand_over", "hand_over", "join", "hand_over"] * 5 * config.steps
    handed = [entry for entry in log if entry[0] == "hand_over"]
    last = 1
    for forward_inputs, backward_inputs in zip(handed[::3], handed[1::3], strict=True):
        forward, backward = forward_inputs[3], backward_inputs[3]
        # the forward's input (the first stage's is the batch's), and the targets on the last stage
        assert len(forward_inputs[2]) == 1 + (forward.stage == last), forward
        # the stash (input, except on the first stage; output) and the output gradient (none for the loss)
        assert len(backward_inputs[2]) == (backward.stage > 0) + 1 + (backward.stage < last), backward

    meta = result["trace"].meta
    assert (meta["pairs_overlap"], meta["pairs"], meta["pairs_overlapped"]) == (False, 5, 0)
    events = {event.action: event for event in result["trace"].events}
    assert events["1F1"].end <= events["0B0"].start  # one after the other
    assert "overlapped pairs (rank 0, last step): 5, halves one after the other (no streams on a CPU)" in (
        summary_lines(result))
    assert summary(result)["pairs"] == {"per_step": 5, "streams": False, "overlapped": 0}


def test_pairs_on_gloo_under_nccls_rule_equal_the_reference():
    """pp 2 dualpipev (3 pairs per rank) on gloo emulating NCCL's rendezvous: the pair's
    receives are waited for before it and its sends posted after both halves, in the
    order lowering gave both peers (gloo as it is: tests/test_executor_zero_bubble.py)."""
    config = one_process_config(pp=2, microbatches=4, layers=5, batch_size=9, steps=2, timeout=60, p2p="rendezvous")
    (result,) = launch([config])
    assert_equals_reference(result, reference_run(config))
    assert (result["trace"].meta["pairs_overlap"], result["trace"].meta["pairs"]) == (False, 3)


@settings(max_examples=40, deadline=None)
@given(pp=st.integers(1, 6), extra=st.integers(0, 6), lowered=st.booleans())
def test_every_dualpipev_pair_becomes_one_step_with_its_halves_on_two_lanes(pp, extra, lowered):
    """For any dualpipev (lowered or not): the walk's steps hold each pair once, in place,
    and nothing else changes; walking a rank's steps, each pair's backward lane is the
    lane its microbatch's forward ran on and its forward takes the other."""
    schedule = generate("dualpipev", pp, 2 * pp + extra, 2)
    if lowered:
        schedule = lower(schedule)
    for rank in range(pp):
        items = schedule.program_items(rank)
        pairs = dict(schedule.fused_pairs(rank))
        steps = with_pairs(items, pairs)
        assert sum(isinstance(step, OverlappedPair) for step in steps) == len(pairs)
        flat = [half for step in steps
                for half in ((step.forward, step.backward) if isinstance(step, OverlappedPair) else (step,))]
        assert flat == items
        lanes, ran_on = PairLanes(torch.device("cpu")), {}
        for step in steps:
            if isinstance(step, OverlappedPair):
                forward_lane, backward_lane = lanes.assign(step)
                assert backward_lane == ran_on.get((step.backward.stage, step.backward.microbatch), COMPUTE_LANE)
                assert forward_lane != backward_lane
                ran_on[(step.forward.stage, step.forward.microbatch)] = forward_lane
            elif isinstance(step, Action) and step.kind == "F":
                ran_on[(step.stage, step.microbatch)] = COMPUTE_LANE
