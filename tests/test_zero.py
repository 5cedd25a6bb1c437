"""ZeRO stages 0-3: memory per parameter against Rajbhandari et al. 2020 (Table 1), and
each stage's collectives in a step against hand calculations on a two-replica pair."""

from __future__ import annotations

import pytest

from pipesim.cli import main
from pipesim.cluster.files import topology_from_dict
from pipesim.model.costs import Costs, StageCost
from pipesim.sim.memory import BytesPerParam, static_bytes_per_param
from pipesim.sim.parallel import ParallelConfig
from pipesim.sim.step import run_simulation
from pipesim.sim.zero import exposed_gather_seconds
from schedules import generate

# Two replicas joined by a 10 GB/s link each way, no latency: reduce-scatter and
# all-gather over n = 2 move (n-1)/n * S = S/2 bytes.
PAIR = {
    "devices": [{"name": "g0", "memory_bytes": 80e9}, {"name": "g1", "memory_bytes": 80e9}],
    "links": [{"src": "g0", "dst": "g1", "bandwidth": 10e9, "latency": 0.0}],
}
MB = 1e6


# Rajbhandari et al. 2020, Table 1: memory per device (GB) of a 7.5B- and a 128B-parameter
# model with mixed-precision Adam (K = 12) on N_d data-parallel devices, for P_os (stage 1),
# P_os+g (stage 2) and P_os+g+p (stage 3).
TABLE_1 = {
    (7.5e9, 1): (120, 120, 120),
    (7.5e9, 4): (52.5, 41.3, 30),
    (7.5e9, 16): (35.6, 21.6, 7.5),
    (7.5e9, 64): (31.4, 16.6, 1.88),
    (7.5e9, 256): (30.4, 15.4, 0.47),
    (7.5e9, 1024): (30.1, 15.1, 0.12),
    (128e9, 64): (536, 284, 32),
    (128e9, 1024): (513, 257, 2),
}


@pytest.mark.parametrize("params,devices", list(TABLE_1))
def test_memory_per_device_is_the_papers_table_1(params, devices):
    published = TABLE_1[params, devices]
    for stage, figure in zip((1, 2, 3), published, strict=True):
        ours = params * static_bytes_per_param(BytesPerParam(2, 2, 12), devices, stage) / 1e9
        assert ours == pytest.approx(figure, rel=0.01, abs=0.006), (params, devices, stage)
    assert params * static_bytes_per_param(BytesPerParam(), devices, 0) / 1e9 == pytest.approx(16 * params / 1e9)


def test_a_simulated_step_holds_the_sharded_static_memory_and_the_zero3_working_set():
    # One stage of 1e9 parameters in 4 layers on dp 2: static 16, 2+2+6, 2+7, 8 bytes per
    # parameter. Buffers: one 25 MiB bucket for stages 0-2; under ZeRO-3 two layers'
    # weights (2 x 0.25e9 x 2 bytes) and one layer's gradient (0.25e9 x 2) = 1.5e9 bytes.
    costs = Costs(stages=(StageCost(fwd=4e-3, bwd=10e-3, param_bytes=2e9, params=1e9, layers=4),))
    expected = {0: 16e9, 1: 10e9, 2: 9e9, 3: 8e9}
    for zero, static in expected.items():
        result = run_simulation(generate("1f1b", 1, 2), costs, topology_from_dict(PAIR),
                                parallel=ParallelConfig(dp=2, zero=zero))
        (memory,) = result.memory
        assert memory.static_bytes == pytest.approx(static)
        assert memory.buffer_bytes == pytest.approx(1.5e9 if zero == 3 else 25 * 2**20)


def one_stage(param_bytes: float = 100 * MB, layers: int = 0, optimizer: float = 1e-3) -> Costs:
    """pp = 1: one stage of F = 4 ms, B = 10 ms, two microbatches (F0 B0 F1 B1 in 1F1B)."""
    return Costs(stages=(StageCost(fwd=4e-3, bwd=10e-3, param_bytes=param_bytes, layers=layers),),
                 step_overhead=optimizer)


def spans(result, kind: str) -> list[float]:
    events = sorted((event for event in result.trace.events if event.kind == kind), key=lambda event: event.start)
    return [moment for event in events for moment in (event.start, event.end)]


def test_zero2_reduce_scatters_every_backward_then_gathers_after_the_optimizer():
    # 100 MB in 40 MB buckets reduce-scatter in 2, 2, 1 ms (S/2 at 10 GB/s), as they fill:
    # at 40%, 80% and 100% of each backward. B0 runs 4..14 ms: 8..10, 12..14, 14..15;
    # B1 18..28 ms: 22..24, 26..28, 28..29. Optimizer 29..30 ms, then the parameters'
    # all-gather in the same buckets, 2 + 2 + 1 ms: 30..35 ms.
    result = run_simulation(generate("1f1b", 1, 2), one_stage(), topology_from_dict(PAIR),
                            parallel=ParallelConfig(dp=2, bucket_bytes=40 * MB, zero=2,
                                                    overlap_param_gather=False, overlap_slowdown=0.0))
    assert spans(result, "REDUCE_SCATTER_DP") == pytest.approx(
        [8e-3, 10e-3, 12e-3, 14e-3, 14e-3, 15e-3, 22e-3, 24e-3, 26e-3, 28e-3, 28e-3, 29e-3])
    assert spans(result, "ALLGATHER_PARAMS") == pytest.approx([30e-3, 35e-3])
    assert result.metrics.makespan == pytest.approx(35e-3)
    (rank,) = result.metrics.ranks
    # exposed: 14..15 is hidden by F1, 28..29 and the gather 30..35 are not
    assert (rank.dp, rank.optimizer) == pytest.approx((6e-3, 1e-3))
    (comm,) = result.comm
    assert comm["dp"]["total"] == pytest.approx(15e-3)


@pytest.mark.parametrize("zero,layers,expected", [
    (0, 0, 10e-3),  # all-reduced: S at 10 GB/s over two ranks, 4 + 4 + 2 ms
    (1, 0, 5e-3),  # reduce-scattered: S/2, 2 + 2 + 1 ms
    (2, 0, 5e-3),  # the same buckets, reduced once per backward
    (3, 4, 5e-3),  # one per layer: 4 x 25 MB, 1.25 ms each
])
def test_one_backwards_gradient_reduction_is_its_buckets_collectives_by_hand(zero, layers, expected):
    from pipesim.cluster.mapping import map_ranks
    from pipesim.sim.parallel import comm_plan, gradient_reduction_seconds

    costs, topology = one_stage(layers=layers), topology_from_dict(PAIR)
    schedule, mapping = generate("1f1b", 1, 2), map_ranks(topology, dp=2)
    seconds = gradient_reduction_seconds(schedule, costs, topology, mapping, 40 * MB, zero=zero)
    assert seconds == pytest.approx({0: expected})
    # what the simulation charges per backward (comm_plan's buckets), summed
    plan = comm_plan(schedule, costs, topology, mapping, bucket_bytes=40 * MB, zero=zero)
    assert plan.dp_seconds == pytest.approx(seconds)


def test_zero3_gathers_every_layer_before_forward_and_backward_with_prefetch():
    # 100 MB in 4 layers of 25 MB: a layer's gather takes 25 MB / 2 / 10 GB/s = 1.25 ms and
    # so does its reduce-scatter, all on the rank's one dp channel, in the order issued.
    # Each action issues its four gathers as the rank reaches it; it starts once the first
    # is done and ends no earlier than the last one's end plus a layer's compute.
    # F0 (1 ms a layer): gathers 0..5, so 0F0 runs 2..6 (5 + 1 - 4 = 2: the closed form's
    # 1.25 + 3 x 0.25 ms). B0 (2.5 ms a layer): gathers 6..11, B0 7.25..17.25 (only the
    # first waited for); its reduce-scatters, issued at its quarters 9.75, 12.25, 14.75 and
    # 17.25, run 11..12.25 (behind the gathers), 12.25..13.5, 14.75..16 and 17.25..18.5.
    # F1, reached at 17.25, finds the channel busy with B0's last reduce-scatter: gathers
    # 18.5..23.5, F1 20.5..24.5. B1: gathers 24.5..29.5, B1 25.75..35.75, reduce-scatters
    # 29.5..30.75, 30.75..32, 33.25..34.5, 35.75..37. Optimizer 37..38 ms; nothing is
    # gathered after it.
    # (the prefetched gathers' slowdown of the compute beside them is off here: tests/test_comm_overlap.py)
    result = run_simulation(generate("1f1b", 1, 2), one_stage(layers=4), topology_from_dict(PAIR),
                            parallel=ParallelConfig(dp=2, zero=3, overlap_slowdown=0.0))
    compute = sorted((event.start, event.end) for event in result.trace.events if event.stream == "compute")
    assert [moment for span in compute for moment in span] == pytest.approx(
        [2e-3, 6e-3, 7.25e-3, 17.25e-3, 20.5e-3, 24.5e-3, 25.75e-3, 35.75e-3])
    assert spans(result, "REDUCE_SCATTER_DP") == pytest.approx(
        [11e-3, 12.25e-3, 12.25e-3, 13.5e-3, 14.75e-3, 16e-3, 17.25e-3, 18.5e-3,
         29.5e-3, 30.75e-3, 30.75e-3, 32e-3, 33.25e-3, 34.5e-3, 35.75e-3, 37e-3])
    # each action's four gathers, one event each, back to back from where the channel took them up
    starts = [0.0, 6e-3, 18.5e-3, 24.5e-3]
    assert spans(result, "ALLGATHER_PARAMS") == pytest.approx(
        [start + moment for start in starts for layer in range(4)
         for moment in (layer * 1.25e-3, (layer + 1) * 1.25e-3)])
    assert result.metrics.makespan == pytest.approx(38e-3)
    (rank,) = result.metrics.ranks
    # waited for the channel: 2 + 1.25 + 3.25 + 1.25 ms before actions, 1.25 ms for the last reduce-scatter
    assert (rank.busy, rank.dp, rank.optimizer) == pytest.approx((28e-3, 9e-3, 1e-3))
    (comm,) = result.comm
    assert comm["dp"]["total"] == pytest.approx(16 * 1.25e-3 + 8 * 1.25e-3)


def test_zero3s_gathers_beside_the_compute_slow_it_as_the_reductions_do():
    # The step above with a slowdown of k = 0.25: the dp channel's collectives ran beside
    # compute for 3 (F0: 2..5) + 3.75 (B0's gathers, 7.25..11) + 3.75 (B0's first three
    # reduce-scatters) + 3 (F1: 20.5..23.5) + 3.75 (B1's gathers) + 3.75 (B1's first three
    # reduce-scatters) = 21 ms, which cost the compute 21 k / (1 + k) = 4.2 ms: a
    # DP_SLOWDOWN after the last backward (35.75..39.95), then the optimizer to 40.95 ms.
    result = run_simulation(generate("1f1b", 1, 2), one_stage(layers=4), topology_from_dict(PAIR),
                            parallel=ParallelConfig(dp=2, zero=3, overlap_slowdown=0.25))
    assert spans(result, "DP_SLOWDOWN") == pytest.approx([35.75e-3, 39.95e-3])
    assert result.metrics.makespan == pytest.approx(40.95e-3)


def test_zero3_split_backward_gathers_before_the_input_gradient_and_reduces_after_the_weight_gradient():
    # ZB-H1 on one stage splits B = 10 ms into I = 6 ms and W = 4 ms: I hides 1.5 ms a
    # layer (gathers 1.25 ms: only the first is waited for); W gathers its layers again
    # (FSDP freed them after I; a LayerNorm's weight-gradient kernel reads its weight).
    costs = Costs(stages=(StageCost(fwd=4e-3, bwd=10e-3, wgrad=4e-3, param_bytes=100 * MB, layers=4),))
    result = run_simulation(generate("zb-h1", 1, 2), costs, topology_from_dict(PAIR),
                            parallel=ParallelConfig(dp=2, zero=3))
    gathers = [event.action for event in result.trace.events if event.kind == "ALLGATHER_PARAMS"]
    assert len(gathers) == 24  # four layers before each F, I and W
    assert sorted({name[name.index("(") + 1:-1] for name in gathers}) == ["0F0", "0F1", "0I0", "0I1", "0W0", "0W1"]
    scatter = [event for event in result.trace.events if event.kind == "REDUCE_SCATTER_DP"]
    weight = [event for event in result.trace.events if event.stream == "compute" and event.kind == "W"]
    assert len(scatter) == 8 and {event.microbatch for event in scatter} == {0, 1}
    for event in scatter:  # each after a quarter of its microbatch's W
        (w,) = [action for action in weight if action.microbatch == event.microbatch]
        assert event.start >= w.start + 1e-3 - 1e-12


def test_exposed_gather_seconds_by_hand():
    assert exposed_gather_seconds(4, 1.25, 1.0) == pytest.approx(2.0)
    assert exposed_gather_seconds(4, 1.25, 2.5) == pytest.approx(1.25)
    assert exposed_gather_seconds(1, 3.0, 0.5) == pytest.approx(3.0)
    assert exposed_gather_seconds(8, 0.0, 1.0) == 0.0


def test_zero_stages_on_the_command_line(tmp_path, capsys):
    for zero in (2, 3):
        out = tmp_path / f"zero{zero}.json"
        assert main(["simulate", "--pp", "2", "-m", "4", "--dp", "2", "--zero", str(zero), "--topology", "nvlink",
                     "--param-bytes", "2e9", "--json", str(out)]) == 0
        assert f'"zero": {zero}' in out.read_text()
