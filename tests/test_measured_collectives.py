"""The collectives a run holds its ranks for inside compute actions (ep's all-to-alls, the
cp ring's K/V steps) are measured as the executor runs them (``bench-comm``'s
``all_to_all`` and ``ring_exchange``, over groups of the run's size, the mean over
ranks), fitted as themselves and priced by that fit for a group of the measured size;
other sizes keep the links' price. Expected seconds are worked out by hand from the
synthetic timings' line."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipesim.cli.compare import replicas
from pipesim.cli.held_collectives import held_collectives, held_message_sizes
from pipesim.cluster.collectives import all_to_all, ring_exchange
from pipesim.cluster.comm_fit import bench_table, fits_by_operation, measured_collectives, topology_document
from pipesim.cluster.files import topology_from_dict
from pipesim.cluster.topology import TopologyError
from pipesim.model.costs import Costs, StageCost
from pipesim.sim.step import run_simulation
from schedules.generators import generate
from tests.test_compare_ep_links import BANDWIDTH, LATENCY, run_config

SIZES = (1024, 16384, 262144, 4194304)
# the line the synthetic all-to-all and ring exchange timings lie on (seconds, bytes/s)
A2A_LATENCY, A2A_BANDWIDTH = 4e-4, 2e9
RING_LATENCY, RING_BANDWIDTH = 7e-4, 5e8


def bench_result(ranks: int, group: int) -> dict:
    """A bench-comm result: send/recv on ``LATENCY + bytes / BANDWIDTH`` (the links), the
    all-to-all and the ring exchange over groups of ``group`` on lines of their own."""
    rows = [{"operation": "sendrecv", "bytes": size, "seconds": LATENCY + size / BANDWIDTH} for size in SIZES]
    rows += [{"operation": "all_to_all", "bytes": size, "seconds": A2A_LATENCY + size / A2A_BANDWIDTH,
              "group": group} for size in SIZES]
    rows += [{"operation": "ring_exchange", "bytes": size, "seconds": RING_LATENCY + size / RING_BANDWIDTH,
              "group": group} for size in SIZES]
    return {"world": ranks, "backend": "gloo", "device": "cpu", "rows": rows}


def measured_topology(ranks: int = 4, group: int = 2):
    result = bench_result(ranks, group)
    return topology_from_dict(topology_document(result, fits_by_operation(result)), name="measured links")


def test_the_fit_of_a_collective_gives_back_its_timings() -> None:
    fits = fits_by_operation(bench_result(8, 4))
    assert measured_collectives(fits) == [
        {"operation": "all_to_all", "ranks": 4, "latency": pytest.approx(A2A_LATENCY, rel=1e-9),
         "bandwidth": pytest.approx(A2A_BANDWIDTH, rel=1e-9)},
        {"operation": "ring_exchange", "ranks": 4, "latency": pytest.approx(RING_LATENCY, rel=1e-9),
         "bandwidth": pytest.approx(RING_BANDWIDTH, rel=1e-9)}]
    # the links still come from send/recv alone
    assert fits["sendrecv"]["latency"] == pytest.approx(LATENCY) and fits["sendrecv"]["ranks"] == 8


def test_the_table_counts_an_all_to_all_bus_bandwidth_over_its_group() -> None:
    rows = {(row["operation"], row["bytes"]): row for row in bench_table(bench_result(8, 4))}
    row = rows["all_to_all", 4194304]
    seconds = A2A_LATENCY + 4194304 / A2A_BANDWIDTH
    # nccl-tests' AlltoAllGetBw over the 4 ranks of a group, not the 8 of the job
    assert row["algbw"] == pytest.approx(4194304 / seconds) and row["busbw"] == pytest.approx(row["algbw"] * 3 / 4)
    assert rows["ring_exchange", 1024]["busbw"] == pytest.approx(rows["ring_exchange", 1024]["algbw"])


def test_a_group_of_the_measured_size_costs_what_was_measured_others_what_the_links_cost() -> None:
    topology = measured_topology(4, 2)
    pair, four = ["rank0", "rank1"], ["rank0", "rank1", "rank2", "rank3"]
    assert all_to_all(topology, pair, 8192) == pytest.approx(8192 / 2e9 + 4e-4, rel=1e-9)
    assert ring_exchange(topology, pair, 2048) == pytest.approx(2048 / 5e8 + 7e-4, rel=1e-9)
    # 4 members: each sends a quarter of its bytes to each other member over its own link
    assert all_to_all(topology, four, 8192) == pytest.approx(8192 / 4 / BANDWIDTH + LATENCY, rel=1e-9)
    assert ring_exchange(topology, four, 2048) == pytest.approx(2048 / BANDWIDTH + LATENCY, rel=1e-9)
    # a file without measured collectives prices every group by its links, as before
    plain = bench_result(4, 2)
    plain["rows"] = [row for row in plain["rows"] if row["operation"] == "sendrecv"]
    links = topology_from_dict(topology_document(plain, fits_by_operation(plain)))
    assert all_to_all(links, pair, 8192) == pytest.approx(8192 / 2 / BANDWIDTH + LATENCY, rel=1e-9)


def test_compare_charges_every_all_to_all_at_the_measured_pace() -> None:
    config = run_config("--model", "mixtral-8x7b", "--pp", "2", "--dp", "2", "--ep", "2", "-m", "2")
    moe_layers, dispatch = 2, 8192.0
    stage = StageCost(fwd=1e-3, bwd=2e-3, act_bytes=4096.0, moe_layers=moe_layers, dispatch_bytes=dispatch)
    result = run_simulation(generate("1f1b", 2, 2), Costs((stage, stage)), measured_topology(4, 2),
                            parallel=replicas(config))
    held = [event for event in result.trace.events if event.stream == "ep"]
    assert len(held) == 2 * 2 * 2  # 2 ranks x 2 microbatches x (F, B)
    one = dispatch / A2A_BANDWIDTH + A2A_LATENCY  # 4.4096e-4 s, not the links' 8192/2/1e8 + 2e-5 = 6.1e-5 s
    for event in held:
        assert event.duration == pytest.approx(2 * moe_layers * one, rel=1e-9)  # dispatch and combine per layer


def test_compare_charges_the_ring_at_the_measured_pace() -> None:
    config = run_config("--model", "llama3-8b", "--pp", "2", "--cp", "2", "-m", "2")
    layers, block = 2, 2048.0
    stage = StageCost(fwd=1e-3, bwd=2e-3, act_bytes=4096.0, attention_layers=layers, kv_bytes=block)
    result = run_simulation(generate("1f1b", 2, 2), Costs((stage, stage)), measured_topology(4, 2),
                            parallel=replicas(config))
    held = {event.action: event.duration for event in result.trace.events if event.stream == "cp" and event.rank == 0}
    one, two = block / RING_BANDWIDTH + RING_LATENCY, 2 * block / RING_BANDWIDTH + RING_LATENCY
    # no attention to hide them: forward cp - 1 = 1 block, backward the block and the gradients (cp - 2 = 0 middle)
    assert held["CP_KV(0F0)"] == pytest.approx(layers * one, rel=1e-9)
    assert held["CP_KV(0B0)"] == pytest.approx(layers * 2 * one, rel=1e-9)
    assert two > one


def test_compare_benchmarks_the_collectives_the_run_holds_its_ranks_for() -> None:
    mixtral = run_config("--model", "mixtral-8x7b", "--pp", "2", "--dp", "4", "--ep", "4", "-m", "2")
    assert held_collectives(mixtral) == {"all_to_all": 4}
    assert held_collectives(run_config("--model", "llama3-8b", "--pp", "2", "--cp", "2")) == {"ring_exchange": 2}
    # the all-gather's exchanges stay in the measured compute: nothing to price
    assert held_collectives(run_config("--model", "llama3-8b", "--pp", "2", "--cp", "2", "--cp-comm",
                                       "all-gather")) == {}
    assert held_collectives(run_config("--pp", "2")) == {}


def test_compare_times_them_at_the_run_message_sizes_and_two_for_the_bandwidth() -> None:
    # mixtral shrunk: microbatches of 1 sequence of 16 tokens, top-2, hidden 64, float32
    mixtral = run_config("--model", "mixtral-8x7b", "--pp", "2", "--dp", "2", "--ep", "2", "-m", "4")
    assert held_message_sizes(mixtral, 2) == {"all_to_all": [16 * 2 * 64 * 4, 2**20, 2**24]}
    # llama3-8b shrunk: microbatches of 2 sequences, 16 tokens over cp 4 = 4 a rank, key and value 16
    # wide each (1 kv head), float32; the backward's middle steps carry the keys and values with their
    # gradients: twice the block
    llama = run_config("--model", "llama3-8b", "--pp", "2", "--cp", "4", "-m", "4")
    assert llama.replica_batch_size // llama.microbatches == 2
    block = 2 * 4 * (16 + 16) * 4
    assert held_message_sizes(llama, 2) == {"ring_exchange": [block, 2 * block, 2**20, 2**24]}
    assert held_message_sizes(run_config("--pp", "2"), 2) == {}


@pytest.mark.parametrize(("entry", "named"), [
    ({"operation": "broadcast", "ranks": 2, "bandwidth": 1e9, "latency": 0},
     "'operation' 'broadcast' is not one of all_to_all, ring_exchange, all_reduce, all_gather, reduce_scatter"),
    ({"operation": "all_to_all", "ranks": 1, "bandwidth": 1e9, "latency": 0}, "'ranks' must be a whole number >= 2"),
    ({"operation": "all_to_all", "ranks": 2.5, "bandwidth": 1e9, "latency": 0}, "'ranks' must be a whole"),
    ({"operation": "all_to_all", "ranks": 2, "bandwidth": 0, "latency": 0}, "'bandwidth' must be > 0"),
    ({"operation": "ring_exchange", "ranks": 2, "bandwidth": 1e9, "latency": -1}, "'latency' must be >= 0"),
    ({"operation": "ring_exchange", "ranks": 2, "bandwidth": 1e9}, "missing 'latency'"),
])
def test_a_bad_measured_collective_is_refused_naming_the_entry_and_field(entry: dict, named: str) -> None:
    document = topology_document(bench_result(2, 2), fits_by_operation(bench_result(2, 2)))
    document["collectives"] = [document["collectives"][0], entry]
    with pytest.raises(TopologyError, match=r"collectives\[1\]") as error:
        topology_from_dict(document, name="links.json")
    assert named in str(error.value)


@pytest.mark.timeout(120)
def test_bench_comm_times_the_grouped_collectives_on_gloo() -> None:
    from executor.bench_comm import bench_comm  # noqa: PLC0415 - starts gloo ranks

    with pytest.raises(ValueError, match="--group 3: .* must divide --ranks 4"):
        bench_comm(4, ["all_to_all"], [1024], "gloo", groups={"all_to_all": 3})
    result = bench_comm(2, ["all_to_all", "ring_exchange"], [1024, 65536], "gloo", groups={"all_to_all": 2})
    rows = [(row["operation"], row["bytes"], row["group"]) for row in result["rows"]]
    assert rows == [("all_to_all", 1024, 2), ("all_to_all", 65536, 2), ("ring_exchange", 1024, 2),
                    ("ring_exchange", 65536, 2)]
    assert all(row["seconds"] > 0 for row in result["rows"])
    links = [row for row in bench_result(2, 2)["rows"] if row["operation"] == "sendrecv"]
    measured = {**result, "rows": [*result["rows"], *links]}
    topology = topology_from_dict(topology_document(measured, fits_by_operation(measured)))
    assert set(topology.measured_collectives) == {("all_to_all", 2), ("ring_exchange", 2)}


@pytest.mark.parametrize(("group", "named"), [
    ("3", "--group 3: a group needs 2 or more ranks and must divide --ranks 4"), ("1", "--group 1")])
def test_bench_comm_refuses_a_group_that_does_not_cut_the_ranks(capsys, group: str, named: str) -> None:
    from tests.test_cli_errors import assert_one_line_error, run_cli  # noqa: PLC0415

    status, out, err = run_cli(capsys, "bench-comm", "--ranks", "4", "--group", group, "--ops", "all_to_all",
                               "--backend", "gloo")
    assert status == 2 and out == ""
    assert_one_line_error(status, err, named)


def test_compare_reports_what_the_collectives_held_on_each_side() -> None:
    from pipesim.sim.comparison import compare, report_lines  # noqa: PLC0415
    from schedules.action import Action, ActionKind  # noqa: PLC0415
    from schedules.trace import Trace, TraceEvent  # noqa: PLC0415

    def held(rank: int, action: Action, start: float, end: float) -> TraceEvent:
        return TraceEvent(rank, f"ALLTOALL_EP({action})", "ALLTOALL_EP", action.stage, action.microbatch, start, end,
                          "ep")

    first, second = Action(0, ActionKind.F, 0), Action(1, ActionKind.F, 0)
    measured = Trace([TraceEvent.of(0, first, 0.0, 1.0, "compute"), held(0, first, 0.2, 0.3), held(0, first, 0.6, 0.75),
                      TraceEvent.of(1, second, 1.0, 2.0, "compute"), held(1, second, 1.5, 1.6)])
    # the simulator's one event per action, after the compute
    predicted = Trace([TraceEvent.of(0, first, 0.0, 0.75, "compute"), held(0, first, 0.75, 1.05),
                       TraceEvent.of(1, second, 1.05, 1.95, "compute"), held(1, second, 1.95, 2.0)])
    document = compare(measured, [2.0, 2.0], predicted, 2.0, warmup_steps=0)
    assert document["held_collectives"] == {"ep": {"measured": pytest.approx(0.35), "predicted": pytest.approx(0.35),
                                                   "count": 3}}
    (line,) = [line for line in report_lines(document) if line.lstrip().startswith("ep ")]
    assert "measured    350.00 ms" in line and "predicted    350.00 ms" in line
    assert "(3 all-to-alls in the drawn step: 116.667 / 116.667 ms each)" in line
    # a run without collectives inside its actions reports none
    assert "held_collectives" not in compare(Trace(measured.events[:1]), [1.0], Trace(predicted.events[:1]), 1.0,
                                             warmup_steps=0)


def held_trace(kind: str, stream: str, *durations: float):
    """A calibration step's Trace with one collective of ``kind`` on ``stream`` inside a
    forward for each of ``durations`` seconds, back to back."""
    from schedules.action import Action, ActionKind  # noqa: PLC0415
    from schedules.trace import Trace, TraceEvent  # noqa: PLC0415

    forward = Action(0, ActionKind.F, 0)
    events, start = [TraceEvent.of(0, forward, 0.0, 100.0, "compute")], 0.0
    for duration in durations:
        events.append(TraceEvent(0, f"{kind}({forward})", kind, 0, 0, start, start + duration, stream))
        start += duration
    return Trace(events)


def ep_trace(*durations: float):
    """A calibration step's Trace with one all-to-all of each of ``durations`` seconds."""
    return held_trace("ALLTOALL_EP", "ep", *durations)


def test_the_calibration_steps_time_one_all_to_all_as_the_median_of_their_means() -> None:
    from executor.run_costs import held_seconds  # noqa: PLC0415

    # step means 2, 4 and 1 ms: the median, 2 ms (a slow step does not set it)
    assert held_seconds([ep_trace(1e-3, 3e-3), ep_trace(4e-3), ep_trace(1e-3)], "ep") == pytest.approx(2e-3)
    assert held_seconds([ep_trace()], "ep") is None


def test_compare_gives_the_all_to_all_the_seconds_its_calibration_steps_timed() -> None:
    from pipesim.cli.held_collectives import calibrate_held  # noqa: PLC0415
    from pipesim.cluster.comm_fit import calibrate_latency  # noqa: PLC0415

    measured = {("all_to_all", 2): (A2A_BANDWIDTH, A2A_LATENCY)}
    assert calibrate_latency(measured, "all_to_all", 4, 8192, 1e-3) is None and len(measured) == 1
    assert calibrate_latency(measured, "all_to_all", 2, 8192, 1e-3) == (A2A_BANDWIDTH, 1e-3 - 8192 / A2A_BANDWIDTH)
    assert calibrate_latency(measured, "all_to_all", 2, 8192, 1e-6) == (A2A_BANDWIDTH, 0.0)  # never below zero

    config = run_config("--model", "mixtral-8x7b", "--pp", "2", "--dp", "2", "--ep", "2", "-m", "2")
    moe_layers, dispatch = 2, 8192.0
    stage = StageCost(fwd=1e-3, bwd=2e-3, act_bytes=4096.0, moe_layers=moe_layers, dispatch_bytes=dispatch)
    costs = Costs((stage, stage))
    topology = measured_topology(4, 2)
    schedule = generate("1f1b", 2, 2)
    paces = calibrate_held(topology, config, schedule, costs, [{"trace": ep_trace(1e-3, 2e-3)},
                                                               {"trace": ep_trace(3e-3)}, {"trace": ep_trace(1.2e-3)}])
    # step means 1.5, 3 and 1.2 ms: 1.5 ms an all-to-all, the benchmark's bandwidth kept
    assert paces == {"all_to_all": {"ranks": 2, "bytes": dispatch, "seconds": pytest.approx(1.5e-3),
                                    "bandwidth": pytest.approx(A2A_BANDWIDTH),
                                    "latency": pytest.approx(1.5e-3 - dispatch / A2A_BANDWIDTH),
                                    "benchmark_seconds": pytest.approx(A2A_LATENCY + dispatch / A2A_BANDWIDTH)}}
    assert all_to_all(topology, ["rank0", "rank1"], dispatch) == pytest.approx(1.5e-3, rel=1e-9)
    result = run_simulation(generate("1f1b", 2, 2), costs, topology, parallel=replicas(config))
    for event in (event for event in result.trace.events if event.stream == "ep"):
        assert event.duration == pytest.approx(2 * moe_layers * 1.5e-3, rel=1e-9)
    # a run without ep keeps the benchmark's price
    assert calibrate_held(measured_topology(4, 2), run_config("--pp", "2"), schedule, costs,
                          [{"trace": ep_trace(1e-3)}]) == {}


def ring_step(waited: float):
    """A calibration step of 1f1b over 2 ranks and 2 microbatches (stage s on rank s):
    every compute action, and ring waits of ``waited`` seconds in all."""
    from schedules.trace import Trace, TraceEvent  # noqa: PLC0415

    schedule = generate("1f1b", 2, 2)
    events = [TraceEvent.of(rank, action, 0.0, 1.0, "compute") for rank, program in enumerate(schedule.programs)
              for action in program]
    first = schedule.programs[0][0]
    events.append(TraceEvent(0, f"CP_KV({first})", "CP_KV", 0, 0, 0.0, waited, "cp"))
    return {"trace": Trace(events)}


def test_compare_gives_the_ring_the_latency_at_which_the_simulator_charges_the_waits_measured() -> None:
    from pipesim.cli.held_collectives import calibrate_held  # noqa: PLC0415

    config = run_config("--model", "llama3-8b", "--pp", "2", "--cp", "2", "-m", "2")
    layers, block = 2, 2048.0
    # a layer's attention: 2 ms forward, 4 ms backward, so a ring step's share is 1 and 2 ms
    stage = StageCost(fwd=1e-2, bwd=2e-2, act_bytes=4096.0, attention_layers=layers, kv_bytes=block,
                      attention_fwd=2e-3, attention_bwd=4e-3)
    costs, schedule = Costs((stage, stage)), generate("1f1b", 2, 2)
    # A 3 ms transfer outlasts both steps even slowed (1.189 and 2.378 ms): it leaves 2 ms exposed
    # after a forward step and 1 ms after a backward one. Per action, 2 layers: F 1 step x 2 ms, B
    # 2 steps x 1 ms, 4 ms each; 8 actions in the step: 32 ms of waits.
    steps = [ring_step(30e-3), ring_step(32e-3), ring_step(40e-3)]  # the median step waited 32 ms
    topology = measured_topology(4, 2)
    paces = calibrate_held(topology, config, schedule, costs, steps)
    latency = 3e-3 - block / RING_BANDWIDTH
    assert paces == {"ring_exchange": {
        "ranks": 2, "bytes": block, "seconds": pytest.approx(3e-3, rel=1e-9),
        "bandwidth": pytest.approx(RING_BANDWIDTH), "latency": pytest.approx(latency, rel=1e-9),
        "benchmark_seconds": pytest.approx(RING_LATENCY + block / RING_BANDWIDTH)}}
    assert ring_exchange(topology, ["rank0", "rank1"], block) == pytest.approx(3e-3, rel=1e-9)
    result = run_simulation(schedule, costs, topology, parallel=replicas(config))
    held = [event.duration for event in result.trace.events if event.stream == "cp"]
    assert sum(held) == pytest.approx(32e-3, rel=1e-9)
    # waits the simulator charges even at no latency leave it at 0; none timed: nothing set
    assert calibrate_held(measured_topology(4, 2), config, schedule, costs, [ring_step(1e-9)])[
        "ring_exchange"]["latency"] == 0.0
    assert calibrate_held(measured_topology(4, 2), config, schedule, costs, [ring_step(0.0)]) == {}


def tp_trace(*durations: float):
    """A calibration step's Trace with one tp all-reduce of each of ``durations`` seconds."""
    return held_trace("TP", "tp", *durations)


def test_compare_gives_the_tp_all_reduce_the_seconds_its_calibration_steps_timed() -> None:
    from pipesim.cli.held_collectives import calibrate_held  # noqa: PLC0415
    from pipesim.cluster.collectives import all_reduce  # noqa: PLC0415

    config = run_config("--model", "gpt", "--pp", "2", "--tp", "2", "-m", "2")
    layers, message = 2, 65536.0
    stage = StageCost(fwd=1e-3, bwd=2e-3, act_bytes=4096.0, layers=layers, tp_message_bytes=message)
    costs = Costs((stage, stage))
    topology = measured_topology(4, 2)
    group = ["rank0", "rank1"]
    # by hand, over the send/recv links (BANDWIDTH, LATENCY): a ring all-reduce of 2 ranks
    # moves 2(n-1)/n = 1 message and pays 2(n-1) = 2 latencies
    links_price = message / BANDWIDTH + 2 * LATENCY
    assert all_reduce(topology, group, message) == pytest.approx(links_price)
    # a simulation before the calibration keeps the links' price of a rank's tp collective
    before = run_simulation(generate("1f1b", 2, 2), costs, topology, parallel=replicas(config))
    assert any(event.stream == "tp" for event in before.trace.events)
    # step means 2, 4 and 1 ms: 2 ms an all-reduce; the links' all-reduce bandwidth, 1e8 x n / 2(n-1)
    paces = calibrate_held(topology, config, generate("1f1b", 2, 2), costs,
                           [{"trace": tp_trace(1e-3, 3e-3)}, {"trace": tp_trace(4e-3)}, {"trace": tp_trace(1e-3)}])
    assert paces == {"all_reduce": {"ranks": 2, "bytes": message, "seconds": pytest.approx(2e-3),
                                    "bandwidth": pytest.approx(BANDWIDTH),
                                    "latency": pytest.approx(2e-3 - message / BANDWIDTH),
                                    "benchmark_seconds": pytest.approx(links_price)}}
    assert all_reduce(topology, group, message) == pytest.approx(2e-3)
    assert all_reduce(topology, group, message, "tree") == pytest.approx(2e-3)  # as measured, whatever the algorithm
    # the simulator's tp hold of a forward: two all-reduces a layer, each as calibrated
    result = run_simulation(generate("1f1b", 2, 2), costs, topology, parallel=replicas(config))
    forwards = [event for event in result.trace.events if event.stream == "tp" and "F" in event.action]
    assert forwards and all(event.duration == pytest.approx(2 * layers * 2e-3) for event in forwards)


def test_the_tp_all_reduce_keeps_the_links_price_without_timings_or_with_sequence_parallelism() -> None:
    from pipesim.cli.held_collectives import calibrate_held  # noqa: PLC0415

    stage = StageCost(fwd=1e-3, bwd=2e-3, act_bytes=4096.0, layers=2, tp_message_bytes=65536.0)
    costs, schedule = Costs((stage, stage)), generate("1f1b", 2, 2)
    plain = run_config("--model", "gpt", "--pp", "2", "--tp", "2", "-m", "2")
    assert calibrate_held(measured_topology(4, 2), plain, schedule, costs, [{"trace": tp_trace()}]) == {}
    sequence_parallel = run_config("--model", "gpt", "--pp", "2", "--tp", "2", "-m", "2", "--sequence-parallel")
    topology = measured_topology(4, 2)
    assert "all_reduce" not in calibrate_held(topology, sequence_parallel, schedule, costs,
                                              [{"trace": tp_trace(2e-3)}])
    assert ("all_reduce", 2) not in topology.measured_collectives
    # links a --topology file gave are the user's: kept
    stage_costs = Costs((stage, stage))
    given = measured_topology(4, 2)
    assert calibrate_held(given, plain, schedule, stage_costs, [{"trace": tp_trace(2e-3)}],
                          links_benchmarked=False) == {}
    assert ("all_reduce", 2) not in given.measured_collectives
    assert calibrate_held(given, sequence_parallel, schedule, Costs((stage, stage), sequence_parallel=True),
                          [{"trace": tp_trace(2e-3)}], links_benchmarked=False) == {}
    assert ("all_gather", 2) not in given.measured_collectives


def tp_step(*durations: float) -> dict:
    """A calibration step of 1f1b over 2 ranks and 2 microbatches (stage s on rank s):
    every compute action, and tp collectives of ``durations`` seconds inside the first."""
    from schedules.trace import Trace, TraceEvent  # noqa: PLC0415

    schedule = generate("1f1b", 2, 2)
    events = [TraceEvent.of(rank, action, 0.0, 1.0, "compute") for rank, program in enumerate(schedule.programs)
              for action in program]
    first, start = schedule.programs[0][0], 0.0
    for duration in durations:
        events.append(TraceEvent(0, f"TP({first})", "TP", 0, 0, start, start + duration, "tp"))
        start += duration
    return {"trace": Trace(events)}


def test_compare_prices_the_sequence_parallel_collectives_at_what_its_calibration_steps_held() -> None:
    from pipesim.cli.held_collectives import calibrate_held  # noqa: PLC0415
    from pipesim.cluster.collectives import all_gather, reduce_scatter  # noqa: PLC0415

    config = run_config("--model", "gpt", "--pp", "2", "--tp", "2", "-m", "2", "--sequence-parallel")
    layers, message = 2, 65536.0
    stage = StageCost(fwd=1e-3, bwd=2e-3, act_bytes=4096.0, layers=layers, tp_message_bytes=message)
    costs, schedule = Costs((stage, stage), sequence_parallel=True), generate("1f1b", 2, 2)
    topology, group = measured_topology(4, 2), ["rank0", "rank1"]
    # by hand, over the send/recv links (BANDWIDTH, LATENCY): a ring all-gather of 2 ranks
    # moves (n-1)/n = half the message and pays n-1 = 1 latency; a reduce-scatter the same
    links_price = message / 2 / BANDWIDTH + LATENCY
    assert all_gather(topology, group, message) == pytest.approx(links_price)
    # Each step's actions: 8 (F and B of 2 microbatches on each of 2 stages), each charged 2
    # layers x (2 all-gathers + 2 reduce-scatters): 64 collectives a step. The steps held their
    # ranks 30, 32 and 40 ms in all (the median 32 ms: 0.5 ms a collective), in 5, 4 and 8
    # collectives timed (means 6, 8 and 5 ms: the median 6 ms)
    steps = [tp_step(*[6e-3] * 5), tp_step(*[8e-3] * 4), tp_step(*[5e-3] * 8)]
    paces = calibrate_held(topology, config, schedule, costs, steps)
    bandwidth = BANDWIDTH * 2  # the links' ring pace over (n-1)/n of the bytes
    pace = {"ranks": 2, "bytes": message, "seconds": pytest.approx(0.5e-3, rel=1e-9),
            "bandwidth": pytest.approx(bandwidth), "latency": pytest.approx(0.5e-3 - message / bandwidth, rel=1e-9),
            "benchmark_seconds": pytest.approx(links_price), "timed_seconds": pytest.approx(6e-3)}
    assert paces == {"all_gather": pace, "reduce_scatter": pace}
    assert all_gather(topology, group, message) == pytest.approx(0.5e-3, rel=1e-9)
    assert reduce_scatter(topology, group, message) == pytest.approx(0.5e-3, rel=1e-9)
    # a group of another size keeps the links' price: 3/4 of the bytes, 3 latencies
    four = ["rank0", "rank1", "rank2", "rank3"]
    assert all_gather(topology, four, message) == pytest.approx(0.75 * message / BANDWIDTH + 3 * LATENCY)
    # the simulator's tp hold of each action: 8 collectives at 0.5 ms, 32 ms a step in all
    result = run_simulation(schedule, costs, topology, parallel=replicas(config))
    held = [event.duration for event in result.trace.events if event.stream == "tp"]
    assert len(held) == 8 and all(seconds == pytest.approx(4e-3, rel=1e-9) for seconds in held)
    # a step that held its ranks less than the bytes alone cost: latency 0, never below
    floored = calibrate_held(measured_topology(4, 2), config, schedule, costs, [tp_step(1e-6)])
    assert floored["all_gather"]["latency"] == 0.0
    assert floored["all_gather"]["seconds"] == pytest.approx(message / bandwidth)
    # no collective timed: the links' price stands, nothing set
    untimed = measured_topology(4, 2)
    assert calibrate_held(untimed, config, schedule, costs, [tp_step()]) == {}
    assert ("all_gather", 2) not in untimed.measured_collectives
    assert ("reduce_scatter", 2) not in untimed.measured_collectives


@given(collectives=st.integers(1, 200), transfer=st.floats(0.0, 1e-2), target=st.floats(1e-6, 10.0))
def test_the_matching_latency_charges_the_target_or_is_zero_when_the_bytes_alone_reach_it(
        collectives: int, transfer: float, target: float) -> None:
    from pipesim.cli.held_collectives import matching_latency  # noqa: PLC0415

    set_at = []

    def charged(latency: float) -> float:  # ``collectives`` of ``transfer + latency`` seconds each
        set_at.append(latency)
        return collectives * (transfer + latency)

    latency = matching_latency(charged, target)
    assert set_at[-1] == latency  # left set where it was found
    if collectives * transfer >= target:
        assert latency == 0.0
    else:
        assert latency == pytest.approx(target / collectives - transfer, rel=1e-9, abs=1e-15)


def test_the_ring_keeps_the_benchmark_price_when_no_latency_charges_its_waits() -> None:
    from pipesim.cli.held_collectives import calibrate_held  # noqa: PLC0415
    from schedules.trace import Trace, TraceEvent  # noqa: PLC0415

    config = run_config("--model", "llama3-8b", "--pp", "2", "--cp", "2", "-m", "2")
    ringed = StageCost(fwd=1e-2, bwd=2e-2, act_bytes=4096.0, attention_layers=2, kv_bytes=2048.0,
                       attention_fwd=2e-3, attention_bwd=4e-3)
    plain = StageCost(fwd=1e-2, bwd=2e-2, act_bytes=4096.0)
    # waits timed inside the second stage's forward, which has no attention to charge them to
    second = generate("1f1b", 2, 2).programs[1][0]
    step = Trace([TraceEvent.of(1, second, 0.0, 1.0, "compute"),
                  TraceEvent(1, f"CP_KV({second})", "CP_KV", 1, 0, 0.0, 5e-3, "cp")])
    topology = measured_topology(4, 2)
    assert calibrate_held(topology, config, generate("1f1b", 2, 2), Costs((ringed, plain)),
                          [{"trace": step}]) == {}
    assert topology.measured_collectives["ring_exchange", 2] == pytest.approx((RING_BANDWIDTH, RING_LATENCY))
