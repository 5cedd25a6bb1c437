"""Bubble and exposed communication, apart: a receive wait is bubble until its producer
has the data ready and exposed communication after; every rank's parts sum to the
makespan. Expected values are hand calculations on the schedules' closed forms."""

from __future__ import annotations

import csv
import json
from dataclasses import replace

import pytest

from pipesim.cli import main
from pipesim.cluster.files import topology_from_dict
from pipesim.cluster.presets import ib, nvlink, pcie
from pipesim.cluster.topology import ideal_topology
from pipesim.model.costs import uniform_costs
from pipesim.sim.parallel import ParallelConfig
from pipesim.sim.step import run_simulation
from schedules import generate
from schedules.accounting import split_waits, time_accounting
from schedules.action import parse_action
from schedules.metrics import step_metrics
from schedules.trace import Trace, TraceEvent

FWD, BWD = 1e-3, 2e-3

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2))
# with split backward (I, W) and V-shaped placements too
ALL_SCHEDULES = (*SCHEDULES, ("zb-h1", 1), ("zb-h2", 1), ("zbv", 2), ("dualpipev", 2))


def costs_for(schedule, act_bytes=64e6, **overheads):
    costs = uniform_costs(schedule.num_stages, FWD, BWD, wgrad=BWD / 2, act_bytes=act_bytes,
                          virtual_stages=schedule.virtual_stages)
    return replace(costs, **overheads) if overheads else costs


@pytest.mark.parametrize(("name", "chunks"), ALL_SCHEDULES)
@pytest.mark.parametrize(("topology", "parallel"), [
    (ideal_topology(), ParallelConfig()),
    (nvlink(), ParallelConfig()),
    (pcie(), ParallelConfig(tp=2)),
    (ib(2), ParallelConfig(dp=2, tp=2)),
], ids=["ideal", "nvlink", "pcie-tp2", "ib-dp2-tp2"])
def test_every_rank_accounts_for_the_whole_makespan(name, chunks, topology, parallel):
    schedule = generate(name, 4, 8, chunks)
    costs = costs_for(schedule, comm_overhead=20e-6, step_overhead=0.5e-3)
    costs = replace(costs, stages=tuple(replace(stage, param_bytes=2e9, layers=2, tp_message_bytes=8e6)
                                        for stage in costs.stages))
    result = run_simulation(schedule, costs, topology, parallel=parallel)
    metrics = result.metrics
    for rank in metrics.ranks:
        parts = (rank.busy, rank.bubble, rank.exposed_comm, rank.tp, rank.dp, rank.optimizer, rank.overhead)
        assert min(parts) >= 0
        assert sum(parts) == pytest.approx(metrics.makespan, rel=1e-9)
        assert rank.optimizer == pytest.approx(0.5e-3)
        # sends are posted after a 20 us launch each; that is overhead, not a wait
        assert rank.overhead > 0
    if parallel.tp > 1:
        assert all(rank.tp > 0 for rank in metrics.ranks)
    if not topology.ideal:
        assert sum(rank.exposed_comm for rank in metrics.ranks) > 0


@pytest.mark.parametrize(("name", "chunks"), ALL_SCHEDULES)
@pytest.mark.parametrize("p2p", ["rendezvous", "buffered"])
def test_ideal_topology_exposes_no_communication(name, chunks, p2p):
    schedule = generate(name, 4, 8, chunks)
    result = run_simulation(schedule, costs_for(schedule, act_bytes=1e9), ideal_topology(), p2p=p2p)
    for rank in result.metrics.ranks:
        assert rank.exposed_comm == 0.0
        assert result.comm[rank.rank]["p2p"]["exposed"] == 0.0
    # a calibrated posting cost c is the one communication cost left on free links: a
    # receiver can wait at most for its sender to post a group of two (2c) per receive
    overhead = 10e-6
    result = run_simulation(schedule, costs_for(schedule, act_bytes=1e9, comm_overhead=overhead), ideal_topology(),
                            p2p=p2p)
    receives = [sum(1 for event in result.trace.of_rank(rank) if event.stream == "recv") for rank in range(4)]
    for rank in result.metrics.ranks:
        assert 0.0 <= rank.exposed_comm <= 2 * overhead * receives[rank.rank] + 1e-12


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_is_the_closed_form_on_free_links(name):
    # GPipe and 1F1B: makespan (m+p-1)(F+B), each rank busy m(F+B), so (p-1)(F+B) bubble
    p, m = 4, 8
    result = run_simulation(generate(name, p, m), costs_for(generate(name, p, m), act_bytes=0), ideal_topology())
    for rank in result.metrics.ranks:
        assert rank.bubble == pytest.approx((p - 1) * (FWD + BWD))
        assert rank.exposed_comm == 0.0 and rank.busy == pytest.approx(m * (FWD + BWD))


@pytest.mark.parametrize("p2p", ["rendezvous", "buffered"])
def test_one_slow_hop_is_exposed_once_per_wait(p2p):
    # two ranks, one microbatch, 10 GB/s with 1 ms latency: every transfer takes
    # hop = 1 ms + bytes / 10 GB/s. Rank 0 waits for its gradient: F + B of rank 1 and
    # the hop out are bubble (its data is not produced yet), the hop back is exposed.
    # Rank 1 waits F for its input (bubble), then one hop (exposed); under rendezvous
    # it also cannot end its step before its last send has arrived (one more hop,
    # exposed), under buffered it idles instead until rank 0 ends (bubble).
    topology = topology_from_dict({
        "devices": [{"name": "g0"}, {"name": "g1"}],
        "links": [{"src": "g0", "dst": "g1", "bandwidth": 10e9, "latency": 1e-3},
                  {"src": "g1", "dst": "g0", "bandwidth": 10e9, "latency": 1e-3}],
    })
    hop = 1e-3 + 1e9 / 10e9
    result = run_simulation(generate("gpipe", 2, 1), uniform_costs(2, FWD, BWD, act_bytes=1e9), topology, p2p=p2p)
    makespan = 2 * (FWD + BWD) + 2 * hop
    assert result.metrics.makespan == pytest.approx(makespan)
    rank0, rank1 = result.metrics.ranks
    assert rank0.exposed_comm == pytest.approx(hop)
    assert rank0.bubble == pytest.approx(hop + FWD + BWD)
    last_send = hop if p2p == "rendezvous" else 0.0
    assert rank1.exposed_comm == pytest.approx(hop + last_send)
    assert rank1.bubble == pytest.approx(FWD + (hop - last_send) + BWD)


def test_link_queueing_counts_as_exposed_not_bubble():
    # Buffered GPipe on 2 ranks, F = 1 ms, each activation 2 ms on the wire: the second
    # send is posted at 2 ms but waits for the first to leave the link (on the wire
    # 3..5 ms). Rank 1 receives it right after F0 (3..4 ms) and sits from 4 to 5 ms: the
    # data existed since 2 ms, so that whole wait is exposed communication.
    topology = topology_from_dict({
        "devices": [{"name": "g0"}, {"name": "g1"}],
        "links": [{"src": "g0", "dst": "g1", "bandwidth": 1e9, "latency": 0.0},
                  {"src": "g1", "dst": "g0", "bandwidth": 1e9, "latency": 0.0}],
    })
    result = run_simulation(generate("gpipe", 2, 2), uniform_costs(2, FWD, BWD, act_bytes=2e6), topology,
                            p2p="buffered")
    waits = {event.action: event for event in result.trace.events if event.stream == "recv" and event.rank == 1}
    assert (waits["1RECV_F1"].start, waits["1RECV_F1"].end) == pytest.approx((4e-3, 5e-3))
    sends = {event.action: event for event in result.trace.events if event.stream == "send"}
    # posted (data ready) at 2 ms, queued behind the first on the link, arrives at 5 ms
    assert (sends["0SEND_F1"].start, sends["0SEND_F1"].end) == pytest.approx((2e-3, 5e-3))
    # rank 1: 1RECV_F0 waits 0..3 ms (1 ms bubble for F0, 2 ms on the wire), 1RECV_F1 1 ms on the wire
    assert result.metrics.ranks[1].exposed_comm == pytest.approx(2e-3 + 1e-3)


def test_rendezvous_waits_split_on_a_hand_timeline():
    # Rendezvous, pp=2, m=2, F=1, B=2, 1 s on the wire, one-action groups:
    #   rank 0: 0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0B1
    #   rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1
    # 0F0 [0,1]; 0SEND_F0 meets 1RECV_F0 (posted at 0): wire [1,2]. Rank 0 posts 0RECV_B0
    # at 1; 1F0 [2,3], 1B0 [3,5], 1SEND_B0 posted at 5: wire [5,6]. So rank 0 waits 1..6:
    # bubble until 5 (the gradient not sent yet), exposed 5..6. At the end rank 1 posts
    # 1SEND_B1 at 13 (0F1 [8,9], wire [9,10], 1F1 [10,11], 1B1 [11,13]) and cannot end its
    # step before it arrives at 14: a 1 s wait with the data in flight, exposed.
    from pipesim.sim.engine import simulate
    from schedules.schedule import Schedule

    def program(texts):
        return [parse_action(text) for text in texts.split()]

    schedule = Schedule(2, 2, (0, 1), [
        program("0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0B1"),
        program("1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"),
    ])
    topology = topology_from_dict({
        "devices": [{"name": "g0"}, {"name": "g1"}],
        "links": [{"src": "g0", "dst": "g1", "bandwidth": 1e9, "latency": 0.0},
                  {"src": "g1", "dst": "g0", "bandwidth": 1e9, "latency": 0.0}],
    })
    trace = simulate(schedule, uniform_costs(2, 1.0, 2.0, act_bytes=1e9), topology, p2p="rendezvous")
    waits = {event.action: (event.start, event.end) for event in trace.events if event.stream == "recv"}
    assert waits["0RECV_B0"] == pytest.approx((1.0, 6.0))
    pieces = {event.action: parts for event, parts in split_waits(trace)}
    assert [part for _, _, part in pieces["0RECV_B0"]] == ["bubble", "exposed_comm"]
    assert [moment for start, end, _ in pieces["0RECV_B0"] for moment in (start, end)] == pytest.approx([1, 5, 5, 6])
    (rank1_wait,) = [event for event in trace.events if event.stream == "wait"]
    assert (rank1_wait.rank, rank1_wait.start, rank1_wait.end) == (1, pytest.approx(13.0), pytest.approx(14.0))
    rank0, rank1 = time_accounting(trace)
    # rank 1: 1RECV_F0 0..2 (1 s bubble, 1 s exposed), 1RECV_F1 5..10 (4 s bubble, 1 s
    # exposed), the wait 13..14 (exposed), then idle while rank 0 runs 0B1 [14,16] (bubble)
    assert (rank1.bubble, rank1.exposed_comm) == pytest.approx((1 + 4 + 2, 1 + 1 + 1))
    assert rank0.total == pytest.approx(rank1.total)


@pytest.mark.parametrize(("p2p", "bubble", "exposed"), [("rendezvous", 3.0, 2.0), ("buffered", 1.0, 4.0)])
def test_an_unmatched_send_of_the_rank_holds_it_under_rendezvous_only(p2p, bubble, exposed):
    # Rank 0 posts 0SEND_F1 at 2 (its receive is posted only at 5) and waits on 0RECV_B0
    # from 2 to 7, whose send was posted at 3. 2..3: the gradient is not sent (bubble);
    # 3..5: under rendezvous the rank is held by its own send, waiting for rank 1 to post
    # the receive (bubble); under buffered sends do not hold it, the gradient is in
    # flight (exposed); 5..7 exposed.
    trace = Trace([
        event(0, "0F1", 0, 2, "compute"),
        event(0, "0SEND_F1", 2, 6, "send"),
        event(0, "0RECV_B0", 2, 7, "recv"),
        event(1, "1B0", 0, 3, "compute"),
        event(1, "1SEND_B0", 3, 7, "send"),
        event(1, "1F9", 3, 5, "compute"),
        event(1, "1RECV_F1", 5, 6, "recv"),
        event(1, "1F1", 6, 7, "compute"),
    ], {"pp": 2, "p2p": p2p})
    rank0 = time_accounting(trace)[0]
    assert (rank0.busy, rank0.bubble, rank0.exposed_comm) == pytest.approx((2.0, bubble, exposed))
    (pieces,) = [parts for event, parts in split_waits(trace) if event.action == "0RECV_B0"]
    assert sum(end - start for start, end, part in pieces if part == "bubble") == pytest.approx(bubble)


def event(rank, text, start, end, stream):
    action = parse_action(text)
    return TraceEvent(rank, text, action.kind, action.stage, action.microbatch, start, end, stream)


def test_measured_style_trace_with_a_batched_pair_of_receives():
    # An executor-style trace: rank 1 posts two receives as one batch at t=1; the
    # first completes at 4, the second at 6. Their sends were posted (data ready) at 3
    # and 5. The batch is done only when both are, so while the second's producer is
    # still working (1..5) the wait is bubble, even where the first is in flight
    # (3..4: hidden behind that wait); 5..6 is exposed communication.
    trace = Trace([
        event(0, "0F0", 0, 3, "compute"),
        event(0, "0SEND_F0", 3, 4, "send"),
        event(0, "0F1", 3, 5, "compute"),
        event(0, "0SEND_F1", 5, 6, "send"),
        event(1, "1F9", 0, 1, "compute"),
        event(1, "1RECV_F0", 1, 4, "recv"),
        event(1, "1RECV_F1", 1, 6, "recv"),
        event(1, "1F0", 6, 7, "compute"),
        event(1, "1F1", 7.5, 8, "compute"),  # 0.5 s of host time before it
    ], {"pp": 2, "source": "measured"})
    rank0, rank1 = time_accounting(trace)
    assert (rank1.busy, rank1.bubble, rank1.exposed_comm, rank1.overhead) == pytest.approx((2.5, 4.0, 1.0, 0.5))
    assert rank1.total == pytest.approx(8.0)
    assert (rank0.busy, rank0.bubble, rank0.exposed_comm) == pytest.approx((5.0, 3.0, 0.0))


def test_dp_reduction_hidden_by_a_wait_or_compute_is_not_counted():
    # A dp all-reduce 2..6 on a rank computing 0..3 and blocked on a receive 3..5
    # (data ready at 4): only 5..6 is exposed dp; 3..4 is bubble, 4..5 exposed comm.
    trace = Trace([
        event(0, "0F0", 0, 4, "compute"),
        event(0, "0SEND_F0", 4, 4.5, "send"),
        event(1, "1F7", 0, 3, "compute"),
        event(1, "1RECV_F0", 3, 5, "recv"),
        TraceEvent(1, "1ALLREDUCE_DP", "ALLREDUCE_DP", 1, -1, 2, 6, "dp"),
    ], {"pp": 2})
    rank1 = time_accounting(trace)[1]
    assert (rank1.busy, rank1.bubble, rank1.exposed_comm, rank1.dp) == pytest.approx((3, 1, 1, 1))


def test_json_summary_and_sweep_use_the_two_names(tmp_path, capsys):
    document = tmp_path / "step.json"
    assert main(["simulate", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--act-bytes", "256e6",
                 "--topology", "pcie", "--json", str(document)]) == 0
    printed = capsys.readouterr().out
    assert "bubble" in printed and "blocked on data in flight (exposed)" in printed
    ranks = json.loads(document.read_text())["ranks"]
    # bytes each rank sends, by hand: rank 0 eight activations, ranks 1 and 2 eight activations
    # and eight gradients, rank 3 eight gradients, 256 MB each
    sent = [rank["p2p"]["bytes"] for rank in json.loads(document.read_text())["comm"]]
    assert sent == pytest.approx([8 * 256e6, 16 * 256e6, 16 * 256e6, 8 * 256e6])
    assert f"{48 * 256e6 / 1e9:.4g} GB sent" in printed
    makespan = json.loads(document.read_text())["makespan"]
    for rank in ranks:
        assert rank["busy"] + rank["bubble"] + rank["exposed_comm"] + rank["overhead"] == pytest.approx(makespan)
        assert rank["exposed_comm"] > 0 and rank["bubble"] > 0
    table = tmp_path / "sweep.csv"
    assert main(["sweep", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--act-bytes", "256e6",
                 "--topology", "pcie", "--csv", str(table), "--quiet"]) == 0
    (row,) = list(csv.DictReader(table.open()))
    assert float(row["bubble"]) == pytest.approx(sum(rank["bubble"] for rank in ranks))
    assert float(row["exposed_comm"]) == pytest.approx(sum(rank["exposed_comm"] for rank in ranks))


def test_issue_example_gpt3_13b_on_ideal_is_all_bubble():
    # the issue's case: gpt3-13b, 1F1B, pp=4, m=16 on ideal links. Before the split,
    # rank 0 reported 0.3524 s of "exposed comm"; all of it is bubble.
    from pipesim.model.spec import model_costs, model_spec

    schedule = generate("1f1b", 4, 16)
    costs = model_costs(model_spec("gpt3-13b"), schedule.num_stages, [989e12] * 4)
    metrics = step_metrics(run_simulation(schedule, costs, ideal_topology()).trace, 1)
    for rank in metrics.ranks:
        assert rank.exposed_comm == 0.0
        # the model's optimizer step ends the step; everything else that is not compute is bubble
        assert rank.bubble == pytest.approx(metrics.makespan - rank.busy - rank.optimizer)


@pytest.mark.timeout(120)
def test_measured_trace_sends_start_when_the_data_is_ready_and_parts_sum_to_the_makespan():
    # A real 2-rank gloo run: every send is stamped when it is posted, right after the
    # compute that produced its data, so the same rule splits measured receive waits.
    pytest.importorskip("torch")
    from executor.config import RunConfig
    from executor.launch import launch

    config = RunConfig(schedule="1f1b", pp=2, microbatches=4, model="mlp", hidden=8, layers=3, batch_size=8,
                       steps=1, dtype="float64")
    (result,) = launch(config)
    trace = result["trace"]
    events = {(event.rank, event.action): event for event in trace.events}
    sends = [event for event in trace.events if event.stream == "send"]
    assert sends
    for send in sends:
        producer = events[(send.rank, f"{send.stage}{'F' if send.kind == 'SEND_F' else 'B'}{send.microbatch}")]
        assert send.start >= producer.end
    metrics = step_metrics(trace)
    for rank in metrics.ranks:
        parts = (rank.busy, rank.bubble, rank.exposed_comm, rank.tp, rank.dp, rank.optimizer, rank.overhead)
        assert min(parts) >= 0 and sum(parts) == pytest.approx(metrics.makespan, rel=1e-9)
        assert rank.bubble > 0  # 1F1B on 2 ranks: each waits for the other's first work


def accounting_moment_by_moment(trace) -> list[dict[str, float]]:
    """The accounting rule of ``schedules.accounting``'s docstring applied the slow,
    obvious way, as an independent reference: every stretch between two consecutive event
    boundaries of a rank goes to the part that holds the rank at its midpoint."""
    events = trace.events
    first, last = min(event.start for event in events), max(event.end for event in events)
    sent = {event.action: event.start for event in events if event.stream == "send"}
    received = {event.action: event.start for event in events if event.stream == "recv"}
    holds_on_sends = trace.meta.get("p2p") != "buffered"
    result = []
    for rank in range(trace.num_ranks):
        mine = [event for event in events if event.rank == rank and event.end > event.start]
        peer = []  # stretches in which the rank waits for a peer
        for event in mine:
            if event.stream == "recv":
                sender = (f"{event.stage - 1}SEND_F{event.microbatch}" if event.kind == "RECV_F"
                          else f"{event.stage + 1}SEND_B{event.microbatch}")
                if sent.get(sender, event.start) > event.start:
                    peer.append((event.start, min(sent[sender], event.end)))
            elif event.stream == "send" and holds_on_sends:
                receiver = (f"{event.stage + 1}RECV_F{event.microbatch}" if event.kind == "SEND_F"
                            else f"{event.stage - 1}RECV_B{event.microbatch}")
                if received.get(receiver, event.start) > event.start:
                    peer.append((event.start, min(received[receiver], event.end)))
        own = [event for event in mine if event.stream != "send"]
        parts = dict.fromkeys(("busy", "bubble", "exposed_comm", "tp", "dp", "optimizer", "overhead"), 0.0)
        if not own:
            parts["bubble"] = last - first
            result.append(parts)
            continue
        own_first, own_last = min(event.start for event in own), max(event.end for event in own)
        parts["bubble"] += (own_first - first) + (last - own_last)
        moments = sorted({own_first, own_last} | {moment for event in own for moment in (event.start, event.end)
                                                   if own_first <= moment <= own_last}
                         | {moment for low, high in peer for moment in (low, high) if own_first < moment < own_last})
        for low, high in zip(moments, moments[1:], strict=False):
            middle = (low + high) / 2
            covering = {event.stream for event in own if event.start < middle < event.end}
            waiting_on_peer = any(start < middle < end for start, end in peer)
            holding = [part for stream, part in (("compute", "busy"), ("tp", "tp"), ("step", "optimizer"))
                       if stream in covering]
            if holding:
                part = holding[0]
            elif covering & {"recv", "wait"}:
                part = "bubble" if waiting_on_peer else "exposed_comm"
            else:
                part = "dp" if "dp" in covering else "overhead"
            parts[part] += high - low
        result.append(parts)
    return result


@pytest.mark.parametrize(("name", "chunks"), ALL_SCHEDULES)
@pytest.mark.parametrize("p2p", ["rendezvous", "buffered"])
@pytest.mark.parametrize(("topology", "dp"), [(pcie(), 1), (ib(2), 2)], ids=["pcie-tp2", "ib-dp2-tp2"])
def test_the_accounting_agrees_with_a_moment_by_moment_reference(name, chunks, p2p, topology, dp):
    # overlapping events on purpose: tp after compute, dp under the last backwards, waits
    # for data of both kinds, sends that hold the rank under rendezvous
    schedule = generate(name, 4, 8, chunks)
    costs = costs_for(schedule, act_bytes=256e6, comm_overhead=5e-6, step_overhead=1e-4)
    costs = replace(costs, stages=tuple(replace(stage, param_bytes=1e9, layers=2, tp_message_bytes=8e6)
                                        for stage in costs.stages))
    trace = run_simulation(schedule, costs, topology, parallel=ParallelConfig(dp=dp, tp=2), p2p=p2p).trace
    span = max(event.end for event in trace.events) - min(event.start for event in trace.events)
    for ours, reference in zip(time_accounting(trace), accounting_moment_by_moment(trace), strict=True):
        assert ours.total == pytest.approx(span, rel=1e-9)
        for part, seconds in reference.items():
            assert getattr(ours, part) == pytest.approx(seconds, rel=1e-9, abs=1e-12 * span), part


def tp_after_forward_events() -> list[TraceEvent]:
    """A hand-built 2 s step. Rank 0: F [0, 1], its send leaves at 1, then a tp all-reduce
    [1, 2]. Rank 1: waits [0, 1] for data not sent before 1 (bubble), then F [1, 2].
    Bubble 1 s of 4 rank-seconds: 0.25. Not computing: 2 of 4, 0.5 (the tp second too)."""
    return [
        TraceEvent(0, "0F0", "F", 0, 0, 0.0, 1.0, "compute"),
        TraceEvent(0, "0SEND_F0", "SEND_F", 0, 0, 1.0, 1.0, "send"),
        TraceEvent(0, "TP(0F0)", "TP", 0, 0, 1.0, 2.0, "tp"),
        TraceEvent(1, "1RECV_F0", "RECV_F", 1, 0, 0.0, 1.0, "recv"),
        TraceEvent(1, "1F0", "F", 1, 0, 1.0, 2.0, "compute"),
    ]


def test_bubble_fraction_leaves_out_tp_time_and_idle_fraction_keeps_it():
    metrics = step_metrics(Trace(tp_after_forward_events(), {"pp": 2}))
    assert metrics.makespan == pytest.approx(2.0)
    assert metrics.bubble_fraction == pytest.approx(0.25)
    assert metrics.idle_fraction == pytest.approx(0.5)
    assert [rank.tp for rank in metrics.ranks] == pytest.approx([1.0, 0.0])


@pytest.mark.parametrize(("name", "chunks"), SCHEDULES)
def test_without_communication_bubble_and_idle_fractions_agree_with_the_closed_form(name, chunks):
    # Ideal links, no tp/dp: (p - 1) / (m + p - 1) for GPipe and 1F1B, (p - 1) / (v m + p - 1)
    # for interleaved (F, B uniform), and nothing else keeps a rank from computing.
    pp, microbatches = 4, 8
    schedule = generate(name, pp, microbatches, chunks)
    costs = uniform_costs(schedule.num_stages, FWD, BWD, virtual_stages=chunks)
    metrics = run_simulation(schedule, costs, ideal_topology()).metrics
    expected = (pp - 1) / (chunks * microbatches + pp - 1)
    assert metrics.bubble_fraction == pytest.approx(expected)
    assert metrics.idle_fraction == pytest.approx(expected)


def test_the_summary_prints_float_dust_as_zero(capsys):
    # on free links nothing is on the wire and no rank waits on data in flight: every such
    # figure is 0, not 8.674e-16 (a difference of equal sums)
    assert main(["simulate", "--schedule", "interleaved-1f1b", "--pp", "4", "-m", "8", "--fwd", "1e-3",
                 "--act-bytes", "1e6", "--topology", "ideal"]) == 0
    printed = capsys.readouterr().out
    assert "e-1" not in printed and "e-2" not in printed
    rows = [line.split() for line in printed.splitlines() if line.strip().split()[:1] in (["0"], ["1"], ["2"], ["3"])]
    assert rows and all(row[4] == "0" and row[5] == "0" for row in rows[:4])  # exposed, on wire
