"""Costs read off the run's own calibration steps (``executor.run_costs``): against
hand-built step timelines whose every gap and duration is known, and against a stage
that sleeps a known time on 2 gloo ranks."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from executor.config import RunConfig
from executor.models import MlpModel
from executor.run_costs import calibration_configs, overhead_fit, run_costs, stage_entry
from schedules.action import RECV_KINDS, RECV_OF, SEND_KINDS, ActionKind
from schedules.generators import generate
from schedules.lowering import lower
from schedules.runtime_gaps import gaps
from schedules.trace import Trace, TraceEvent

SECONDS = {ActionKind.F: 3.0, ActionKind.B: 5.0, ActionKind.I: 2.0, ActionKind.W: 4.0}  # stage 0's; stage s adds s


def timeline(schedule, action_gap: float, post: float, wait: float, lead: float = 0.0, slow: float = 1.0,
             tp: float = 0.0, bookkeeping: float = 0.0, timed_waits: bool = False) -> Trace:
    """One step as a runtime that costs ``action_gap`` per compute action and ``post`` per
    P2P action, and waits ``wait`` before every action whose input comes from another
    rank, would time it: each rank from its own 0, the first stage's rank ``lead`` late.
    ``tp`` seconds of every compute action are a tp collective inside it. After a wait
    the runtime spends ``bookkeeping`` more (handing the data on); with ``timed_waits``
    each wait is marked as the buffered runtime marks it, a ``recv`` event of its own."""
    events = []
    for rank in range(schedule.pp):
        receives = {(a.kind, a.stage, a.microbatch): a for a in schedule.programs[rank] if a.kind in RECV_KINDS}
        pairs = dict(schedule.fused_pairs(rank))  # the runtime waits for both inputs before the pair's forward
        now, posts = (lead if rank == schedule.placement[0] else 0.0), 0
        for action in schedule.programs[rank]:
            if action.kind in SEND_KINDS | RECV_KINDS:
                posts += 1
                continue
            awaited = [receives[key] for a in (action, *([pairs[action]] if action in pairs else []))
                       if (key := (RECV_OF.get(a.kind, ActionKind.RECV_B), a.stage, a.microbatch)) in receives]
            now += action_gap + posts * post
            if awaited:
                if timed_waits:
                    events.append(TraceEvent.of(rank, awaited[0], now, now + wait, "recv"))
                now += wait + bookkeeping
            seconds = (SECONDS[action.kind] + action.stage) * slow
            events.append(TraceEvent.of(rank, action, now, now + seconds, "compute"))
            if tp:
                events.append(TraceEvent(rank, f"TP({action})", "TP", action.stage, action.microbatch, now + 0.5,
                                         now + 0.5 + tp, "tp"))
            now += seconds
            posts = 0
    return Trace(events, {"pp": schedule.pp, "source": "measured"})


def test_every_cost_comes_back_from_a_step_built_with_it():
    schedule = lower(generate("1f1b", 2, 4))
    trace = timeline(schedule, action_gap=0.25, post=0.125, wait=7.0, lead=2.0)
    last = max(event.end for event in trace.events)
    document = run_costs(schedule, [trace], [last + 1.5])
    for entry in document["stages"]:
        stage = entry["stage"]
        assert (entry["fwd"], entry["bwd"]) == pytest.approx((3.0 + stage, 5.0 + stage))
        assert (entry["igrad"], entry["wgrad"]) == (0.0, 0.0)  # no split backward ran: I is B, W nothing
    assert document["action_overhead"] == pytest.approx(0.25)
    assert document["comm_overhead"] == pytest.approx(0.125)
    # 1.5 s after the last event, and the first rank's 2 s lead (its first F has no post before it)
    assert document["step_overhead"] == pytest.approx(1.5 + 2.0)


def test_the_gaps_that_wait_for_data_are_told_from_the_loop():
    schedule = lower(generate("1f1b", 2, 4))
    samples = gaps(schedule, timeline(schedule, action_gap=0.25, post=0.125, wait=7.0))
    # 8 compute actions per rank, the first of each rank has no gap before it
    assert len(samples) == 2 * (8 - 1)
    waiting = [seconds for seconds, _, waits in samples if waits]
    free = [(seconds, posts) for seconds, posts, waits in samples if not waits]
    assert waiting and all(seconds >= 7.0 for seconds in waiting)
    assert any(posts == 0 for _, posts in free) and any(posts > 0 for _, posts in free)
    assert all(seconds == pytest.approx(0.25 + 0.125 * posts) for seconds, posts in free)


@settings(max_examples=30, deadline=None)
@given(action_gap=st.floats(0.0, 1.0), post=st.floats(0.0, 1.0), wait=st.floats(0.0, 10.0),
       name=st.sampled_from(["gpipe", "1f1b", "zb-h1", "zbv", "dualpipev"]), pp=st.integers(2, 4))
def test_the_overhead_fit_recovers_any_loop_and_post_cost(action_gap, post, wait, name, pp):
    schedule = lower(generate(name, pp, 2 * pp, 2 if name in ("zbv", "dualpipev") else 1))
    per_action, per_post = overhead_fit(gaps(schedule, timeline(schedule, action_gap, post, wait)))
    assert per_action == pytest.approx(action_gap, abs=1e-9)
    assert per_post == pytest.approx(post, abs=1e-9)


def test_timed_waits_price_the_posts_with_the_bookkeeping_of_every_wait():
    """1F1B, pp 2, 4 microbatches, by hand: the gaps between compute actions hold 14
    posts and 7 waits (rank 0: 8 posts, 4 waits; rank 1: 6 posts, 3 waits; each rank's
    first action and rank 1's first receive are before any gap), and 5 gaps hold neither.
    Blocked seconds are taken out; what each wait costs beyond them is spread over the
    posts: 0.125 + 0.5 * 7 / 14."""
    schedule = lower(generate("1f1b", 2, 4))
    trace = timeline(schedule, action_gap=0.25, post=0.125, wait=7.0, bookkeeping=0.5, timed_waits=True)
    samples = gaps(schedule, trace, waits_timed=True)
    assert sum(posts for _, posts, _ in samples) == 14 and sum(waits for _, _, waits in samples) == 7
    assert sum(1 for _, posts, waits in samples if not posts and not waits) == 5
    assert overhead_fit(samples, waits_timed=True) == pytest.approx((0.25, 0.125 + 0.5 * 7 / 14))
    # the fit from the free gaps alone never sees the bookkeeping
    assert overhead_fit(gaps(schedule, trace)) == pytest.approx((0.25, 0.125))
    document = run_costs(schedule, [trace], [100.0], waits_timed=True)
    assert (document["action_overhead"], document["comm_overhead"]) == pytest.approx((0.25, 0.375))


@settings(max_examples=30, deadline=None)
@given(action_gap=st.floats(0.0, 1.0), post=st.floats(0.0, 1.0), wait=st.floats(0.0, 10.0),
       name=st.sampled_from(["gpipe", "1f1b", "zb-h1", "zbv", "dualpipev"]), pp=st.integers(2, 4))
def test_timed_waits_leave_the_loop_and_post_costs_as_they_were(action_gap, post, wait, name, pp):
    """With nothing spent beyond the blocked seconds, every gap, a waiting one too, gives
    back the runtime's costs exactly, however long the waits."""
    schedule = lower(generate(name, pp, 2 * pp, 2 if name in ("zbv", "dualpipev") else 1))
    trace = timeline(schedule, action_gap, post, wait, timed_waits=True)
    per_action, per_post = overhead_fit(gaps(schedule, trace, waits_timed=True), waits_timed=True)
    assert per_action == pytest.approx(action_gap, abs=1e-9)
    assert per_post == pytest.approx(post, abs=1e-9)


def test_a_slow_step_does_not_set_the_costs():
    schedule = lower(generate("1f1b", 2, 4))
    steps = [timeline(schedule, 0.25, 0.125, 1.0, slow=slow) for slow in (1.0, 3.0, 1.0)]
    document = run_costs(schedule, steps, [100.0] * 3)
    assert document["stages"][1]["fwd"] == pytest.approx(4.0)  # the median step's, not the 3x one's


def test_tp_collectives_inside_an_action_are_taken_out_only_when_the_simulator_charges_them():
    schedule = lower(generate("1f1b", 2, 4))
    trace = timeline(schedule, 0.25, 0.125, 1.0, tp=0.75)
    apart = run_costs(schedule, [trace], [100.0], collectives_apart=True)["stages"][0]
    inside = run_costs(schedule, [trace], [100.0])["stages"][0]
    assert (apart["fwd"], apart["bwd"]) == pytest.approx((3.0 - 0.75, 5.0 - 0.75))
    assert (inside["fwd"], inside["bwd"]) == pytest.approx((3.0, 5.0))


def test_a_split_backward_is_kept_as_measured_and_a_missing_b_is_i_plus_w():
    schedule = lower(generate("zb-h1", 2, 4))
    entry = run_costs(schedule, [timeline(schedule, 0.0, 0.0, 0.0)], [100.0])["stages"][1]
    assert (entry["fwd"], entry["igrad"], entry["wgrad"], entry["bwd"]) == pytest.approx((4.0, 3.0, 5.0, 8.0))
    with pytest.raises(ValueError, match="no forward of stage 3"):
        stage_entry(3, {(0, ActionKind.F): 1.0})


def test_calibration_runs_fresh_configs_of_two_steps_and_refuses_none():
    configs = calibration_configs(RunConfig(steps=9, return_grads=True), 3)
    assert [(config.steps, config.return_grads) for config in configs] == [(2, False)] * 3
    with pytest.raises(ValueError, match="--calibration-steps must be >= 1, got 0"):
        calibration_configs(RunConfig(), 0)
    with pytest.raises(ValueError, match="one step time per calibration Trace"):
        run_costs(lower(generate("1f1b", 2, 2)), [], [])


SLEEP = 0.004  # seconds each block sleeps in its forward, twice that in its backward


class Sleep(torch.autograd.Function):
    """Identity that sleeps ``SLEEP`` in the forward and ``2 * SLEEP`` in the backward: a
    stage whose costs are known without a clock."""

    @staticmethod
    def forward(ctx, x):
        time.sleep(SLEEP)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * SLEEP)
        return grad


class SleepBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Sleep.apply(self.linear(x))


class SleepModel(MlpModel):
    """The mlp toy with a sleep in every block (picklable: the launched ranks build it)."""

    def make_block(self, layer: int) -> nn.Module:
        return SleepBlock(self.config.hidden)


@pytest.mark.timeout(240)
def test_sleeping_stages_are_costed_at_their_sleep_on_two_gloo_ranks():
    from executor.launch import launch, validate_schedule
    from executor.run_costs import calibration_document

    config = RunConfig(schedule="1f1b", pp=2, microbatches=2, layers=4, hidden=8, batch_size=4, backend="gloo")
    schedule = validate_schedule(config)
    calibrated = launch(calibration_configs(config, 3), model=SleepModel(config))
    document = calibration_document(config, schedule, calibrated)
    for entry in document["stages"]:  # two blocks per stage; sleep overshoots, never undershoots
        assert 2 * SLEEP <= entry["fwd"] <= 2 * SLEEP + 0.004, entry
        assert 4 * SLEEP <= entry["bwd"] <= 4 * SLEEP + 0.006, entry
    assert document["stages"][0]["act_bytes"] == 2 * 8 * 4  # a microbatch of 2 x 8 float32 features
    assert document["stages"][1]["param_bytes"] == 2 * (8 * 8 + 8) * 4
    assert document["meta"]["source"] == "calibration steps of the run"


def test_a_cp_rank_sends_its_share_of_the_sequence_and_a_tp_shard_holds_its_share_of_the_parameters():
    from executor.run_costs import stage_bytes

    shape = {"model": "gpt", "pp": 2, "layers": 4, "hidden": 16, "heads": 4, "seq_len": 8, "vocab": 32,
             "batch_size": 8, "microbatches": 2}
    whole = stage_bytes(RunConfig(**shape), 2)
    # microbatches of 4 sequences of 8 tokens, hidden 16, float32; the last stage sends nothing
    assert [entry["act_bytes"] for entry in whole] == [4 * 8 * 16 * 4, 0.0]
    # cp splits a transformer's sequences: llama3-8b shrunk to 4 heads keeps its 4:1
    # grouping, one key/value head of 16 / 4 = 4 wide, so each of a ring step's 4 x 8 / 2
    # tokens passes a key and a value of 4 float32
    ring = stage_bytes(RunConfig(**{**shape, "model": "llama3-8b"}, cp=2), 2)[0]
    assert ring["act_bytes"] == 4 * 4 * 16 * 4
    assert ring["attention_layers"] == 2 and ring["kv_bytes"] == 4 * 8 / 2 * 2 * 1 * 4 * 4
    # the toy gpt (multi-head: every head's key and value, 16 wide each) and at tp 2 half
    toy = stage_bytes(RunConfig(**shape, cp=2), 2)[0]
    assert toy["kv_bytes"] == 4 * 8 / 2 * 2 * 16 * 4
    assert stage_bytes(RunConfig(**shape, cp=2, tp=2), 2)[0]["kv_bytes"] == 4 * 8 / 2 * 2 * 8 * 4
    split = stage_bytes(RunConfig(**shape, tp=2), 2)
    assert [entry["param_bytes"] for entry in split] == [entry["param_bytes"] / 2 for entry in whole]
    assert [(entry["layers"], entry["tp_message_bytes"]) for entry in split] == [(2.0, 4 * 8 * 16 * 4)] * 2
    assert "layers" not in whole[0]  # without tp no collective is charged per layer
