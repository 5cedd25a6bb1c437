"""DDP-style gradient reduction overlapped with the last backward, and ZeRO-1's
reduce-scatter + parameter all-gather, against hand calculations on a small case."""

from __future__ import annotations

import pytest

from pipesim.cli import main
from pipesim.cluster.files import topology_from_dict
from pipesim.model.costs import Costs, StageCost
from pipesim.sim.parallel import ParallelConfig
from pipesim.sim.step import run_simulation
from schedules import generate

# Two replicas joined by a 10 GB/s link each way, no latency: a ring all-reduce over
# n = 2 moves 2(n-1)/n * S = S bytes, so S / 10 GB/s; reduce-scatter and all-gather
# move (n-1)/n * S = S/2 each.
PAIR = {
    "devices": [{"name": "g0"}, {"name": "g1"}],
    "links": [{"src": "g0", "dst": "g1", "bandwidth": 10e9, "latency": 0.0}],
}
BW = 10e9
FWD, BWD = 4e-3, 10e-3
MB = 1e6


def one_stage_job(param_bytes: float, layers: int = 0, optimizer: float = 0.0) -> Costs:
    """pp = 1: one stage holding the whole model, two microbatches."""
    return Costs(stages=(StageCost(fwd=FWD, bwd=BWD, param_bytes=param_bytes, layers=layers),),
                 step_overhead=optimizer)


def flat(spans) -> list[float]:
    """``[(start, end), ...]`` as one flat list (pytest.approx compares flat sequences)."""
    return [moment for span in spans for moment in span]


def dp_events(result):
    return sorted((event for event in result.trace.events if event.stream == "dp"), key=lambda event: event.start)


def test_buckets_reduce_as_they_fill_during_the_last_backward():
    # 100 MB of gradients in 40 MB buckets: 40, 40, 20 MB, all-reduced in 4, 4, 2 ms.
    # pp=1, m=2: F F B B, the last backward runs 18..28 ms (B = 10 ms). With no layer
    # count the bytes fill evenly: bucket 0 is full at 40% (22 ms) and reduces 22..26,
    # bucket 1 full at 80% (26 ms) reduces 26..30, bucket 2 full at 28 ms waits for the
    # link until 30 and reduces 30..32. Step: 32 ms; 4 ms of reduction exposed. (No slowdown
    # of the compute beside the reductions here: tests/test_comm_overlap.py adds it.)
    config = ParallelConfig(dp=2, bucket_bytes=40 * MB, overlap_slowdown=0.0)
    result = run_simulation(generate("1f1b", 1, 2), one_stage_job(100 * MB), topology_from_dict(PAIR),
                            parallel=config)
    spans = [(event.start, event.end) for event in dp_events(result)]
    assert flat(spans) == pytest.approx(flat([(22e-3, 26e-3), (26e-3, 30e-3), (30e-3, 32e-3)]))
    assert result.metrics.makespan == pytest.approx(32e-3)
    (rank,) = result.metrics.ranks
    assert rank.dp == pytest.approx(4e-3)
    assert rank.busy + rank.dp == pytest.approx(result.metrics.makespan)


def test_layer_granular_buckets_fill_when_their_last_layer_is_done():
    # The same 100 MB over 3 layers (33.3 MB each, last layer's first): bucket 0 (40 MB)
    # needs two layers, full at 2/3 of the backward (18 + 6.67 ms); buckets 1 and 2 need
    # all three, full at 28 ms. Reductions: 24.67..28.67, 28.67..32.67, 32.67..34.67; the
    # last two filled together and ran back to back, so they are one event, 28.67..34.67.
    config = ParallelConfig(dp=2, bucket_bytes=40 * MB, overlap_slowdown=0.0)
    result = run_simulation(generate("1f1b", 1, 2), one_stage_job(100 * MB, layers=3), topology_from_dict(PAIR),
                            parallel=config)
    first = 18e-3 + 10e-3 * 2 / 3
    spans = [(event.start, event.end) for event in dp_events(result)]
    assert flat(spans) == pytest.approx(flat([(first, first + 4e-3), (first + 4e-3, first + 10e-3)]))
    assert [event.action for event in dp_events(result)] == ["0ALLREDUCE_DP[0]", "0ALLREDUCE_DP[1-2]"]
    assert result.metrics.makespan == pytest.approx(first + 10e-3)


def test_no_dp_overlap_reduces_after_the_last_action():
    # 28 ms of compute, then 100 MB at 10 GB/s = 10 ms, then a 1 ms optimizer step
    config = ParallelConfig(dp=2, bucket_bytes=40 * MB, overlap_dp=False)
    result = run_simulation(generate("1f1b", 1, 2), one_stage_job(100 * MB, optimizer=1e-3),
                            topology_from_dict(PAIR), parallel=config)
    events = dp_events(result)
    assert events[0].start == pytest.approx(28e-3) and events[-1].end == pytest.approx(38e-3)
    assert result.metrics.makespan == pytest.approx(39e-3)
    (rank,) = result.metrics.ranks
    assert (rank.dp, rank.optimizer) == pytest.approx((10e-3, 1e-3))


def test_zero1_reduce_scatters_during_backward_and_gathers_parameters_after_the_optimizer():
    # Reduce-scatter moves S/2: buckets take 2, 2, 1 ms. Ready at 22, 26, 28 ms (as
    # above): 22..24, 26..28, 28..29. Optimizer 29..30 ms, then the parameters are
    # all-gathered in the same buckets, S/2 again: 2, 2, 1 ms from 30 to 35 ms (one event:
    # all three can start once the optimizer is done, and run back to back): Megatron without
    # --overlap-param-gather, and no slowdown of the compute beside the reduce-scatters.
    config = ParallelConfig(dp=2, bucket_bytes=40 * MB, zero=1, overlap_param_gather=False, overlap_slowdown=0.0)
    result = run_simulation(generate("1f1b", 1, 2), one_stage_job(100 * MB, optimizer=1e-3),
                            topology_from_dict(PAIR), parallel=config)
    events = dp_events(result)
    scatter = [(event.start, event.end) for event in events if event.kind == "REDUCE_SCATTER_DP"]
    gather = [(event.start, event.end) for event in events if event.kind == "ALLGATHER_PARAMS"]
    assert flat(scatter) == pytest.approx(flat([(22e-3, 24e-3), (26e-3, 28e-3), (28e-3, 29e-3)]))
    assert flat(gather) == pytest.approx(flat([(30e-3, 35e-3)]))
    assert result.metrics.makespan == pytest.approx(35e-3)
    (rank,) = result.metrics.ranks
    # exposed: 28..29 (the last reduce-scatter) and 30..35 (the gather); 29..30 optimizer
    assert (rank.dp, rank.optimizer) == pytest.approx((6e-3, 1e-3))


def test_zero_flag_reaches_the_json_and_rejects_other_stages(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["simulate", "--pp", "1", "-m", "2", "--dp", "2", "--zero", "1", "--topology", "nvlink",
                 "--json", str(out)]) == 0
    assert '"zero": 1' in out.read_text()
    with pytest.raises(SystemExit):
        main(["simulate", "--zero", "4"])
    assert "--zero" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--zero 4 is not a ZeRO stage: use 0 .*3 \\(parameters sharded too"):
        ParallelConfig(zero=4)
