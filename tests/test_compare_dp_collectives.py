"""``compare`` prices the dp group's collectives at what its calibration steps timed them
at (``pipesim.cli.held_collectives.dp_collectives``): the links' bandwidth for the
collective, the latency that makes the mean over the simulator's buckets the steps'
mean. Expected seconds are worked out by hand from the synthetic send/recv line
(``LATENCY + bytes / BANDWIDTH``) and the synthetic timings."""

from __future__ import annotations

import pytest

from pipesim.cli.compare import replicas
from pipesim.cli.held_collectives import dp_collectives
from pipesim.model.costs import Costs, StageCost
from pipesim.sim.step import run_simulation
from schedules.generators import generate
from schedules.trace import Trace, TraceEvent
from tests.test_compare_ep_links import BANDWIDTH, fitted_topology, run_config

# per step: a reduce-scatter and a parameter all-gather on each of two ranks (ms)
TIMED_MS = {"REDUCE_SCATTER_DP": ((40.0, 42.0), (44.0, 46.0), (41.0, 41.0)),
            "ALLGATHER_PARAMS": ((26.0, 26.0), (20.0, 24.0), (30.0, 30.0))}


def calibration_traces(timed: dict[str, tuple]) -> list[Trace]:
    """One trace per step, each rank's dp events of the given durations (seconds apart)."""
    traces = []
    for step in range(len(next(iter(timed.values())))):
        events = [TraceEvent(rank, f"{rank}{kind}[0]", kind, rank, -1, 1.0, 1.0 + per_rank[step][rank] / 1e3, "dp")
                  for kind, per_rank in timed.items() for rank in range(2)]
        traces.append(Trace(events, {"pp": 2, "source": "measured"}))
    return traces


def stages(*param_bytes: float) -> Costs:
    return Costs(tuple(StageCost(fwd=1e-3, bwd=2e-3, act_bytes=4096.0, param_bytes=size) for size in param_bytes))


def test_zero1_collectives_are_priced_at_the_steps_timing_and_the_simulator_charges_it() -> None:
    config = run_config("--pp", "2", "--dp", "2", "--zero", "1", "-m", "2")
    topology, costs = fitted_topology(4), stages(1e6, 1e6)  # one bucket a stage (25 MiB buckets)
    before = run_simulation(generate("1f1b", 2, 2), costs, topology, parallel=replicas(config))
    assert {round(event.duration, 9) for event in before.trace.events if event.stream == "dp"} == {5.02e-3}
    paces = dp_collectives(topology, config, generate("1f1b", 2, 2), costs, calibration_traces(TIMED_MS))
    # medians over the steps of each step's mean: (41, 45, 41) -> 41 ms; (26, 22, 30) -> 26 ms
    assert paces["reduce_scatter"]["seconds"] == pytest.approx(0.041, rel=1e-12)
    assert paces["all_gather"]["seconds"] == pytest.approx(0.026, rel=1e-12)
    # the links' bandwidth for half a ring over 2 ranks: the bytes cross at 2x the send/recv's
    assert paces["reduce_scatter"]["bandwidth"] == pytest.approx(2 * BANDWIDTH, rel=1e-9)
    assert paces["reduce_scatter"]["latency"] == pytest.approx(0.041 - 1e6 / (2 * BANDWIDTH), rel=1e-9)
    # what the links alone priced them at: 1e6 / 2 / 1e8 + 2e-5 = 5.02 ms
    assert paces["all_gather"]["benchmark_seconds"] == pytest.approx(5.02e-3, rel=1e-9)
    # priced again, not the links' price kept from the simulation before
    result = run_simulation(generate("1f1b", 2, 2), costs, topology, parallel=replicas(config))
    charged = {(event.rank, event.kind): event.duration for event in result.trace.events if event.stream == "dp"}
    for rank in range(2):
        assert charged[rank, "REDUCE_SCATTER_DP"] == pytest.approx(0.041, rel=1e-9)
        assert charged[rank, "ALLGATHER_PARAMS"] == pytest.approx(0.026, rel=1e-9)


def test_buckets_of_other_sizes_keep_the_bandwidth_and_share_the_latency() -> None:
    config = run_config("--pp", "2", "--dp", "2", "-m", "2")
    topology, costs = fitted_topology(4), stages(1e6, 3e6)
    timed = {"ALLREDUCE_DP": ((50.0, 70.0), (60.0, 60.0), (58.0, 62.0))}  # 60 ms a collective
    paces = dp_collectives(topology, config, generate("1f1b", 2, 2), costs, calibration_traces(timed))
    assert set(paces) == {"all_reduce"}
    # a ring all-reduce over 2 ranks moves 2 (n-1)/n = 1x the bytes: the send/recv's bandwidth;
    # the mean bucket (2 MB) costs the steps' 60 ms, each stage its bytes' difference more or less
    result = run_simulation(generate("1f1b", 2, 2), costs, topology, parallel=replicas(config))
    charged = {event.rank: event.duration for event in result.trace.events if event.kind == "ALLREDUCE_DP"}
    assert charged[0] == pytest.approx(0.060 - 1e6 / BANDWIDTH, rel=1e-9)  # 50 ms
    assert charged[1] == pytest.approx(0.060 + 1e6 / BANDWIDTH, rel=1e-9)  # 70 ms


def test_a_collective_faster_than_its_bytes_keeps_no_negative_latency() -> None:
    config = run_config("--pp", "2", "--dp", "2", "-m", "2")
    topology = fitted_topology(4)
    timed = {"ALLREDUCE_DP": ((1.0, 1.0),)}  # 1 ms, under the 10 ms the bytes take at the links' pace
    paces = dp_collectives(topology, config, generate("1f1b", 2, 2), stages(1e6, 1e6), calibration_traces(timed))
    assert paces["all_reduce"]["latency"] == 0.0
    assert paces["all_reduce"]["seconds"] == pytest.approx(1e6 / BANDWIDTH, rel=1e-12)


@pytest.mark.parametrize("flags", [("--zero", "3"), ("--dp", "1")])
def test_nothing_is_priced_where_the_run_has_no_such_dp_collectives(flags) -> None:
    config = run_config("--pp", "2", "--dp", "2", "-m", "2", *flags)
    topology = fitted_topology(config.world_size)
    assert dp_collectives(topology, config, generate("1f1b", 2, 2), stages(1e6, 1e6),
                          calibration_traces(TIMED_MS)) == {}
    assert not topology.measured_collectives


def test_a_tp_group_of_the_same_size_keeps_the_price_its_steps_set() -> None:
    config = run_config("--model", "gpt", "--pp", "2", "--dp", "2", "--tp", "2", "-m", "2")
    topology = fitted_topology(8)
    topology.measured_collectives["all_reduce", 2] = (1e9, 1e-3)  # as tp's calibration set it
    timed = {"ALLREDUCE_DP": ((60.0, 60.0),)}
    assert dp_collectives(topology, config, generate("1f1b", 2, 2), stages(1e6, 1e6),
                          calibration_traces(timed)) == {}
    assert topology.measured_collectives["all_reduce", 2] == (1e9, 1e-3)
