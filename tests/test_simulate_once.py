"""One simulated step prices its step once: ``step_timing``'s work (durations, holds,
overlapped pairs, wires) is done once per distinct timing, and the Trace reuses it."""

from __future__ import annotations

import pytest

from pipesim.cluster import presets
from pipesim.model.costs import uniform_costs
from pipesim.sim import engine as sim_engine
from pipesim.sim import step as sim_step
from pipesim.sim.parallel import ParallelConfig
from schedules import generate


@pytest.fixture
def counted(monkeypatch):
    calls = {"price_step": 0, "overlapped_pairs": 0}

    def counting(name, module, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    price, pairs = sim_engine.price_step, sim_engine.overlapped_pairs
    counting("price_step", sim_engine, price)
    counting("price_step", sim_step, price)
    counting("overlapped_pairs", sim_engine, pairs)
    return calls


def test_a_step_without_collectives_is_priced_once(counted):
    schedule = generate("dualpipev", 2, 4, 2)  # overlapped pairs: their prices are part of it
    costs = uniform_costs(schedule, 1e-3, 2e-3, 1e-3, act_bytes=1e6)
    result = sim_step.run_simulation(schedule, costs, presets.PRESETS["nvlink"]())
    assert result.metrics.makespan > 0
    assert counted == {"price_step": 1, "overlapped_pairs": 1}


def test_simulate_prices_once(counted):
    schedule = generate("1f1b", 4, 8)
    sim_engine.simulate(schedule, uniform_costs(schedule, 1e-3, 2e-3, act_bytes=1e6), presets.PRESETS["pcie"]())
    assert counted == {"price_step": 1, "overlapped_pairs": 1}


def test_with_collectives_lowering_and_the_run_each_price_their_own_timing(counted):
    """Lowering plans without the collectives (their plan is made from the lowered
    schedule); the run is priced with them: two timings, each priced once."""
    schedule = generate("1f1b", 2, 4)
    costs = uniform_costs(schedule, 1e-3, 2e-3, act_bytes=1e6, param_bytes=1e8)
    sim_step.run_simulation(schedule, costs, presets.PRESETS["nvlink"](), parallel=ParallelConfig(dp=2))
    assert counted == {"price_step": 2, "overlapped_pairs": 2}
