"""Property tests of the simulator over generated schedules: every schedule that exists
simulates, each rank's trace holds its program, and the makespan respects the obvious
lower bounds whatever the costs and links."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.cluster.files import topology_from_dict
from pipesim.model.costs import uniform_costs
from pipesim.sim.engine import simulate
from schedules import ScheduleUnavailableError, generate, lower, step_metrics


@st.composite
def plans(draw):
    name = draw(st.sampled_from(("gpipe", "1f1b", "interleaved-1f1b")))
    pp = draw(st.integers(1, 16))
    microbatches = draw(st.integers(1, 64))
    chunks = draw(st.integers(1, 4)) if name == "interleaved-1f1b" else 1
    fwd = draw(st.floats(1e-4, 1.0))
    bwd = draw(st.floats(1e-4, 2.0))
    act_bytes = draw(st.sampled_from([0.0, 1e3, 1e8]))
    return name, pp, microbatches, chunks, fwd, bwd, act_bytes


def chain_topology(devices: int):
    """A line of devices with slow-ish links, so transfers matter."""
    return topology_from_dict({
        "devices": [{"name": f"g{index}"} for index in range(devices)],
        "links": [{"src": f"g{index}", "dst": f"g{index + 1}", "bandwidth": 1e9, "latency": 1e-5}
                  for index in range(devices - 1)],
    })


@settings(max_examples=60, deadline=None)
@given(plans())
def test_every_generated_schedule_simulates_within_its_bounds(plan):
    name, pp, microbatches, chunks, fwd, bwd, act_bytes = plan
    try:
        schedule = lower(generate(name, pp, microbatches, chunks))
    except ScheduleUnavailableError:
        return
    costs = uniform_costs(schedule.num_stages, fwd, bwd, act_bytes=act_bytes, virtual_stages=chunks)
    trace = simulate(schedule, costs, chain_topology(pp))
    metrics = step_metrics(trace, chunks)
    busiest = max(rank.busy for rank in metrics.ranks)
    assert busiest == pytest.approx(microbatches * (fwd + bwd), rel=1e-9)
    assert metrics.makespan >= busiest * (1 - 1e-12)
    # and never better than the free-link closed form for its family
    if chunks == 1:
        assert metrics.makespan >= (microbatches + pp - 1) * (fwd + bwd) * (1 - 1e-9)
    assert 0.0 <= metrics.bubble_fraction < 1.0
    by_rank = trace.by_rank()
    for rank, program in enumerate(schedule.programs):
        assert [event.action for event in by_rank[rank] if event.stream == "compute"] == [
            str(action) for action in program if action.is_compute
        ]
