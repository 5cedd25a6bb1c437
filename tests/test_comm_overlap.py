"""Communication beside the compute (pipesim.sim.comm_overlap) and where a step runs it:
the closed forms by hand, the tensor-parallel collectives under --tp-comm-overlap, the
reduce-scatters' slowdown of the backward, the parameter all-gathers under the next
step's forwards, ring attention's transfers. Every expected figure is worked out in the
comments, on a pair of GPUs joined by 10 GB/s with no latency."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipesim.cli import main
from pipesim.cluster.files import topology_from_dict
from pipesim.cluster.mapping import map_ranks
from pipesim.model.costs import Costs, StageCost
from pipesim.sim.comm_overlap import exposed_seconds, overlapped_seconds, slowed_by
from pipesim.sim.context_parallel import ring_attention_exposed
from pipesim.sim.parallel import ParallelConfig, tp_collective_seconds
from pipesim.sim.step import run_simulation
from schedules import generate

PAIR = {"devices": [{"name": "g0"}, {"name": "g1"}],
        "links": [{"src": "g0", "dst": "g1", "bandwidth": 10e9, "latency": 0.0}]}
# two pipeline ranks of two replicas: pp neighbours g0-g2, g1-g3; dp pairs g0-g1, g2-g3
SQUARE = {"devices": [{"name": f"g{index}"} for index in range(4)],
          "links": [{"src": src, "dst": dst, "bandwidth": 10e9, "latency": 0.0}
                    for src, dst in (("g0", "g1"), ("g2", "g3"), ("g0", "g2"), ("g1", "g3"))]}
MB = 1e6
MS = 1e-3


def test_the_closed_forms_by_hand():
    # a reduce-scatter of 4 ms under 10 ms of backward is hidden whole when overlap is free
    assert overlapped_seconds(10 * MS, 4 * MS, 0.0) == pytest.approx(10 * MS)
    assert exposed_seconds(10 * MS, 4 * MS, 0.0) == 0.0
    # 14 ms of it under the same backward: the tail, 14 - 10 = 4 ms, is exposed
    assert exposed_seconds(10 * MS, 14 * MS, 0.0) == pytest.approx(4 * MS)
    # at a 25% slowdown the 4 ms beside the compute cost it 4 x 0.25 / 1.25 = 0.8 ms
    assert exposed_seconds(10 * MS, 4 * MS, 0.25) == pytest.approx(0.8 * MS)
    assert slowed_by(4 * MS, 0.25) == pytest.approx(0.8 * MS)
    # 14 ms is longer than the slowed compute (10 x 1.25 = 12.5 ms): the collective sets the pace
    assert overlapped_seconds(10 * MS, 14 * MS, 0.25) == pytest.approx(14 * MS)
    # at 12 ms the compute is slowed all along (12 < 12.5): 10 + 12 x 0.2 = 12.4 ms
    assert overlapped_seconds(10 * MS, 12 * MS, 0.25) == pytest.approx(12.4 * MS)
    assert exposed_seconds(0.0, 3 * MS, 0.25) == pytest.approx(3 * MS)  # nothing to hide it under


@given(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1))
def test_overlap_never_loses_to_running_one_after_the_other(compute, comm, slowdown):
    both = overlapped_seconds(compute, comm, slowdown)
    assert max(compute, comm) - 1e-12 <= both <= compute + comm + 1e-12
    assert both <= compute * (1 + slowdown) + max(0.0, comm - compute * (1 + slowdown)) + 1e-12


def tp_stage(message: float, attention: float = 0.0) -> StageCost:
    """Two layers, F 4 ms (2 ms a layer), B 10 ms, I 6 ms; each tp collective pair of a
    layer moves ``message`` bytes."""
    return StageCost(fwd=4 * MS, bwd=10 * MS, wgrad=4 * MS, layers=2, tp_message_bytes=message,
                     attention_layers=2, attention_fwd=attention, attention_bwd=2 * attention)


def tp_holds(stage: StageCost, sequence_parallel: bool, overlap: bool, slowdown: float) -> tuple[float, ...]:
    topology = topology_from_dict(PAIR)
    schedule = generate("1f1b", 1, 1)
    holds = tp_collective_seconds(schedule, Costs(stages=(stage,), sequence_parallel=sequence_parallel), topology,
                                  map_ranks(topology, tp=2), overlap=overlap, slowdown=slowdown)
    return holds[0, "F"], holds[0, "B"], holds[0, "I"]


def test_tensor_parallel_collectives_beside_the_gemms():
    # Over 2 GPUs an all-gather and a reduce-scatter of 10 MB move 5 MB each: 1 ms a pair,
    # two pairs a layer per pass = 2 ms, 4 ms for the stage's two layers when exposed.
    assert tp_holds(tp_stage(10 * MB), True, False, 0.25) == pytest.approx((4 * MS,) * 3)
    # Beside the GEMMs: a layer's window is 2 ms forward, 5 ms B, 3 ms I; 2 ms of collectives
    # fit under each, so with free overlap nothing is held ...
    assert tp_holds(tp_stage(10 * MB), True, True, 0.0) == pytest.approx((0.0,) * 3)
    # ... and at a 25% slowdown each layer pays 2 x 0.25 / 1.25 = 0.4 ms: 0.8 ms a stage
    assert tp_holds(tp_stage(10 * MB), True, True, 0.25) == pytest.approx((0.8 * MS,) * 3)
    # 40 MB: 8 ms a layer under a 2 ms forward window (> 2 x 1.25): 6 ms exposed a layer;
    # B: 8 > 5 x 1.25, 3 ms; I: 8 > 3.75, 5 ms
    assert tp_holds(tp_stage(40 * MB), True, True, 0.25) == pytest.approx((12 * MS, 6 * MS, 10 * MS))
    # the attention core is not a GEMM the collectives feed: with 1 ms of it the forward
    # window is 1 ms, and 2 ms of collectives leave 1 ms exposed a layer
    assert tp_holds(tp_stage(10 * MB, attention=1 * MS), True, True, 0.0)[0] == pytest.approx(2 * MS)
    # without sequence parallelism the all-reduces stay on the critical path: 2 x 2 x 1 ms
    assert tp_holds(tp_stage(10 * MB), False, True, 0.25) == pytest.approx((4 * MS,) * 3)


def test_each_tensor_parallel_collective_hides_only_beside_its_own_gemms():
    # The same two layers with their GEMMs known: forward seconds a layer beside attention's
    # all-gather 1 ms (QKV), its reduce-scatter 0.5 ms (output projection), the MLP's 3 ms
    # and 2 ms. 40 MB over 2 GPUs: 4 ms a pair, 2 ms each all-gather or reduce-scatter.
    stage = replace(tp_stage(40 * MB), tp_window_attention_in=1 * MS, tp_window_attention_out=0.5 * MS,
                    tp_window_mlp_in=3 * MS, tp_window_mlp_out=2 * MS)
    # F, free overlap: 2 - 1 and 2 - 0.5 exposed beside attention, nothing beside the MLP:
    # 2.5 ms a layer, 5 ms the stage (the whole-layer window hid all but 6 ms of 8 in two layers)
    # B: the input sides' reduce-scatters beside their input- and weight-gradient products
    # (2 ms and 6 ms), the output sides' all-gathers beside the input-gradient product
    # (0.5 and 2 ms): 0 + 1.5 + 0 + 0 = 1.5 ms a layer. I: the forward's windows again.
    assert tp_holds(stage, True, True, 0.0) == pytest.approx((5 * MS, 3 * MS, 5 * MS))
    # at a 25% slowdown: a window w beside 2 ms hides it while 2 <= 1.25 w, for 2 x 0.2 =
    # 0.4 ms; else it exposes 2 - w. F: 1 + 1.5 + 0.4 + 0.4 = 3.3 ms a layer; B: attention's
    # input side 2 ms (2 <= 2.5) 0.4, its output 1.5, the MLP 0.4 + 0.4 = 2.7 ms a layer
    assert tp_holds(stage, True, True, 0.25) == pytest.approx((6.6 * MS, 5.4 * MS, 6.6 * MS))
    # full recompute re-runs both layers' forwards, and their collectives, in the backward
    recomputed = replace(stage, recompute_layers=2)
    assert tp_holds(recomputed, True, True, 0.0) == pytest.approx((5 * MS, 8 * MS, 10 * MS))
    # with overlap off, or without sequence parallelism, the windows change nothing
    assert tp_holds(stage, True, False, 0.25) == pytest.approx((16 * MS,) * 3)
    assert tp_holds(stage, False, True, 0.25) == pytest.approx((16 * MS,) * 3)


def test_a_models_costs_carry_each_collectives_gemms():
    """Llama 3 8B at tp 8 with sequence parallelism, 8,192 tokens: the windows are its
    GEMMs' forward seconds as the compute model times them, grouped by hand from the
    weights (QKV; the output projection; gate and up; down)."""
    from pipesim.model.compute_model import gpu_compute_model, operation_time
    from pipesim.model.operations import layer_operations
    from pipesim.model.spec import PRESETS
    from pipesim.model.transformer_costs import model_stage_costs

    spec = replace(PRESETS["llama3-8b"], seq_len=8192)
    stage = model_stage_costs(spec, 1, [989e12], tp=8, sequence_parallel=True, fallback_gpu="h100").stages[0]
    compute = gpu_compute_model("h100")
    forward = {operation.name: operation_time(operation, compute, 2).forward
               for operation in layer_operations(spec, 8, True)}
    assert stage.tp_windows == pytest.approx((forward["qkv"], forward["attention_out"], forward["mlp_in"],
                                              forward["mlp_out"]))
    # the GEMMs are only part of a layer's compute beside which the lumped rule hid them
    assert sum(stage.tp_windows) < stage.fwd / stage.layers - stage.attention_fwd
    # without tensor parallelism there is nothing to hide
    assert model_stage_costs(spec, 1, [989e12], tp=1, fallback_gpu="h100").stages[0].tp_windows == (0.0,) * 4
    # a costs file written from them keeps them, and prices the collectives the same
    from pipesim.model.costs import costs_from_dict

    costs = model_stage_costs(spec, 1, [989e12], tp=8, sequence_parallel=True, fallback_gpu="h100")
    read = costs_from_dict(json.loads(json.dumps(costs.to_dict())))
    assert read.stages[0].tp_windows == stage.tp_windows
    topology = topology_from_dict({"devices": [{"name": f"g{index}"} for index in range(8)],
                                   "links": [{"src": f"g{index}", "dst": f"g{index + 1}", "bandwidth": 100e9,
                                              "latency": 0.0} for index in range(7)]})
    schedule = generate("1f1b", 1, 1)
    price = [tp_collective_seconds(schedule, each, topology, map_ranks(topology, tp=8)) for each in (costs, read)]
    assert price[0] == price[1] and price[0][0, "F"] > 0


def zero_stage(layers: int = 0, param_bytes: float = 100 * MB, optimizer: float = 0.0) -> Costs:
    return Costs(stages=(StageCost(fwd=4 * MS, bwd=10 * MS, param_bytes=param_bytes, layers=layers),),
                 step_overhead=optimizer)


def test_reductions_beside_the_backward_slow_it():
    # ZeRO-2, pp 1, m 2: F 0..4, 4..8, B0 8..18, B1 18..28. 100 MB in 40 MB buckets
    # reduce-scatter in 2, 2, 1 ms as they fill (40%, 80%, 100% of each backward): B0's
    # 12..14, 16..18, 18..19 and B1's 22..24, 26..28, 28..29. Beside compute: 2 + 2 + 1
    # (18..19, under B1) + 2 + 2 = 9 ms; at a 25% slowdown the compute loses 9 x 0.2 =
    # 1.8 ms: the rank's last action ends at 28 + 1.8 = 29.8 ms, after the last bucket (29).
    # (The parameters' all-gather after the step is left out: exposed, it would follow.)
    topology = topology_from_dict(PAIR)
    free = run_simulation(generate("1f1b", 1, 2), zero_stage(), topology, parallel=ParallelConfig(
        dp=2, bucket_bytes=40 * MB, zero=2, overlap_slowdown=0.0, overlap_param_gather=False))
    assert free.metrics.makespan == pytest.approx(29 * MS + 5 * MS)
    slowed = run_simulation(generate("1f1b", 1, 2), zero_stage(), topology, parallel=ParallelConfig(
        dp=2, bucket_bytes=40 * MB, zero=2, overlap_slowdown=0.25, overlap_param_gather=False))
    assert slowed.metrics.makespan == pytest.approx(29.8 * MS + 5 * MS)
    (event,) = [event for event in slowed.trace.events if event.kind == "DP_SLOWDOWN"]
    assert (event.start, event.end) == pytest.approx((28 * MS, 29.8 * MS))
    (rank,) = slowed.metrics.ranks
    assert rank.dp == pytest.approx(1.8 * MS + 5 * MS)  # 28..29.8 (the last bucket's 28..29 inside), the gather
    assert rank.time().total == pytest.approx(slowed.metrics.makespan)


def test_parameter_gathers_run_under_the_next_steps_forwards():
    # ZeRO-1, pp 1, m 2, five layers: reduce-scatters 22..24, 26..28, 28..29 (the buckets
    # fill at 2/5, 4/5 and 5/5 of the last backward), optimizer 29..30 ms. The updated
    # parameters' all-gather is 2 + 2 + 1 = 5 ms: after the optimizer, exposed, 30..35 ms.
    topology = topology_from_dict(PAIR)
    costs = zero_stage(layers=5, optimizer=1 * MS)
    exposed = run_simulation(generate("1f1b", 1, 2), costs, topology, parallel=ParallelConfig(
        dp=2, bucket_bytes=40 * MB, zero=1, overlap_param_gather=False, overlap_slowdown=0.0))
    assert exposed.metrics.makespan == pytest.approx(35 * MS)
    # Under the next step's forwards (in the engine's walk): the five layers' gathers run
    # from the step's start, 1 ms each (0..1, ..., 4..5 ms), and F0 (0.8 ms a layer) starts
    # once the first ends and so that it ends no earlier than the last one's end plus a
    # layer: max(1, 5 + 0.8 - 4) = 1.8 ms (the closed form: 1 + 4 x 0.2). Everything after
    # follows 1.8 ms later: B1 ends at 29.8, the last reduce-scatter at 30.8, the optimizer
    # at 31.8 ms, the step the closed form gave (29 + 1 + 1.8).
    overlapped = run_simulation(generate("1f1b", 1, 2), costs, topology, parallel=ParallelConfig(
        dp=2, bucket_bytes=40 * MB, zero=1, overlap_slowdown=0.0))
    assert overlapped.metrics.makespan == pytest.approx(31.8 * MS)
    gathers = sorted(moment for event in overlapped.trace.events if event.kind == "ALLGATHER_PARAMS"
                     for moment in (event.start, event.end))
    assert gathers == pytest.approx([moment * MS for layer in range(5) for moment in (layer, layer + 1)])
    (first,) = [event for event in overlapped.trace.events if event.action == "0F0"]
    assert (first.start, first.end) == pytest.approx((1.8 * MS, 5.8 * MS))
    (rank,) = overlapped.metrics.ranks
    assert rank.dp == pytest.approx(1.8 * MS + 1 * MS)  # the wait before F0, the last reduce-scatter
    # At a 25% slowdown: the gathers ran beside F0 from 1.8 to 5 ms (3.2 ms), the first two
    # reduce-scatters beside B1 (23.8..25.8, 27.8..29.8: 4 ms): 7.2 x 0.2 = 1.44 ms after
    # B1's end, 29.8..31.24, which the optimizer waits for: 31.24..32.24 ms.
    slowed = run_simulation(generate("1f1b", 1, 2), costs, topology, parallel=ParallelConfig(
        dp=2, bucket_bytes=40 * MB, zero=1, overlap_slowdown=0.25))
    assert slowed.metrics.makespan == pytest.approx(32.24 * MS)


def test_a_rank_idle_before_its_first_forward_hides_its_gathers():
    # pp 2 x dp 2, 1F1B, m 2, one layer a stage, 20 MB each: a 1 ms gather on each rank
    # from the step's start. Rank 0's first forward starts the step: it waits for its
    # gather, 0..1 ms, and runs 1..5. Rank 1 waits for F(0,0)'s output until 5 ms anyway:
    # its gather (0..1) is hidden in that wait, and its first forward starts 1 ms later
    # than without gathers (4 ms), not 2. Without the overlap each rank gathers 1 ms after
    # its reduce-scatter, after the step.
    topology = topology_from_dict(SQUARE)
    stage = StageCost(fwd=4 * MS, bwd=10 * MS, param_bytes=20 * MB, layers=1)
    costs = Costs(stages=(stage, stage))

    def run(overlap: bool):
        return run_simulation(generate("1f1b", 2, 2), costs, topology, parallel=ParallelConfig(
            dp=2, zero=1, overlap_param_gather=overlap, overlap_slowdown=0.0))

    def first_forwards(result) -> list[float]:
        return [event.start for event in result.trace.events if event.action in ("0F0", "1F0")]

    overlapped, after = run(True), run(False)
    assert first_forwards(overlapped) == pytest.approx([1 * MS, 5 * MS])
    assert first_forwards(after) == pytest.approx([0.0, 4 * MS])
    # rank 0's wait is its gather's (dp, with its last reduce-scatter's 1 ms), rank 1's a bubble
    assert [rank.dp for rank in overlapped.metrics.ranks] == pytest.approx([2 * MS, 1 * MS])
    assert [rank.bubble for rank in overlapped.metrics.ranks] == pytest.approx(
        [rank.bubble + extra for rank, extra in zip(after.metrics.ranks, (0.0, 1 * MS), strict=True)])
    # both gather the whole 1 ms, at the step's start or after it
    for result in (overlapped, after):
        held = [sum(event.duration for event in result.trace.events
                    if event.kind == "ALLGATHER_PARAMS" and event.rank == rank) for rank in (0, 1)]
        assert held == pytest.approx([1 * MS, 1 * MS])


def test_ring_attention_transfers_slow_the_attention_beside_them():
    # cp 4, forward steps of 1 ms against a 1.5 ms exchange: 1.5 > 1 x 1.25, so 0.5 ms a
    # step, 3 steps: 1.5 ms. Backward steps of 2 ms: a 1.5 ms exchange fits under the slowed
    # step (2.5 ms) and costs it 1.5 x 0.2 = 0.3 ms, twice; 3 ms of two blocks does not:
    # 1 ms, twice. 2.6 ms; with free overlap 0 + 2 = 2 ms.
    assert ring_attention_exposed(4, 4 * MS, 8 * MS, 1.5 * MS, 3 * MS, 0.25) == pytest.approx((1.5 * MS, 2.6 * MS))
    assert ring_attention_exposed(4, 4 * MS, 8 * MS, 1.5 * MS, 3 * MS) == pytest.approx((1.5 * MS, 2 * MS))


def test_the_flags_reach_the_json_and_bad_values_are_refused(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["simulate", "--pp", "1", "-m", "2", "--dp", "2", "--zero", "1", "--topology", "nvlink",
                 "--no-tp-overlap", "--no-param-gather-overlap", "--overlap-slowdown", "0.1",
                 "--json", str(out)]) == 0
    text = out.read_text()
    assert '"tp_overlap": false' in text and '"param_gather_overlap": false' in text
    assert '"overlap_slowdown": 0.1' in text
    for value in ("-0.5", "nan", "inf"):
        assert main(["simulate", "--dp", "2", "--overlap-slowdown", value]) == 2
        (line,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert "--overlap-slowdown must be a finite number >= 0" in line and value.lstrip("-") in line.lower()
    assert math.isclose(ParallelConfig().overlap_slowdown, 0.189)


def _walk_rates(compute: float, comm: float, slowdown: float) -> float:
    """The rate picture walked in two phases (an oracle for ``overlapped_seconds``): both
    run until one ends, the compute at ``1 / (1 + slowdown)``; then whichever is left
    runs alone at full speed."""
    together = min(comm, compute * (1 + slowdown))  # the first to end: the collective, or the slowed compute
    left = compute - together / (1 + slowdown)
    return together + max(left, comm - together)


@given(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1))
def test_overlapped_seconds_walks_the_rate_picture(compute, comm, slowdown):
    assert overlapped_seconds(compute, comm, slowdown) == pytest.approx(_walk_rates(compute, comm, slowdown),
                                                                       abs=1e-12)


def _walk_gathers(issued_before: float, first_forward: float, layers: int, gather: float, forward: float) -> float:
    """Layer by layer (an oracle for the parameter gathers' wait): gathers run back to back
    from the step's start after ``issued_before`` seconds of others; layer u's forward
    starts once the layer before has computed and its own gather is done."""
    moment = first_forward
    for layer in range(1, layers + 1):
        moment = max(moment, issued_before + layer * gather) + forward
    return moment - (first_forward + layers * forward)


@given(st.floats(0, 1), st.floats(0, 1), st.integers(1, 12), st.floats(1e-6, 1), st.floats(0, 1))
def test_the_parameter_gathers_wait_is_the_layer_walks(issued_before, first_forward, layers, gather, forward):
    """(A stage with parameters: one with nothing to gather waits for nothing.)"""
    from pipesim.sim.zero import exposed_gather_seconds

    closed = max(0.0, issued_before + exposed_gather_seconds(layers, gather, forward) - first_forward)
    assert closed == pytest.approx(_walk_gathers(issued_before, first_forward, layers, gather, forward), abs=1e-9)
