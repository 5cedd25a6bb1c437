"""Step-time distributions (``pipesim.sim.whatif``): the deterministic step when nothing
varies, a straggler's step against a hand-derived closed form, the compiled engine's
samples against the SimPy specification's on identical draws (sample by sample) and on
independent ones (two-sample Kolmogorov-Smirnov over 5 seeds), the critical path's
owner, and one-line errors for bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pipesim.job import Job, simulate_job
from pipesim.sim.variability import (
    Sampler,
    Variability,
    parse_jitter,
    parse_slow_link,
    parse_straggler,
    parse_straggler_share,
    per_transfer_wires,
)
from pipesim.sim.whatif import SampleStepper, sample_steps
from schedules import engine, generate
from schedules import engine_reference as reference

pytestmark = pytest.mark.skipif(engine._compiled is None, reason="the compiled engine is not built")


def job(**fields) -> Job:
    return Job(**{"schedule": "1f1b", "pp": 4, "microbatches": 8, **fields})


# -- nothing varies: the deterministic step, exactly ----------------------------------------

NEUTRAL = Variability(jitter=dict.fromkeys(("F", "B", "I", "W", "comm"), 0.0), stragglers={0: 1.0, 3: 1.0},
                      straggler_share=(0.5, 1.0), slow_links={(1, 2): 1.0}, samples=5, seed=3)


@pytest.mark.parametrize("fields", [
    {"schedule": "interleaved-1f1b", "topology": "nvlink", "act_bytes": 4e6},  # wires that queue
    {"schedule": "zb-h1", "wgrad": 0.8e-3, "topology": "ib", "nodes": 2, "act_bytes": 1e6},
    {"topology": "ib", "nodes": 2, "dp": 2, "tp": 2, "act_bytes": 1e6, "param_bytes": 1e8},  # dp tail, tp holds
])
def test_factor_one_and_cv_zero_give_the_deterministic_step(fields):
    result = simulate_job(job(**fields))
    whatif = sample_steps(result, NEUTRAL)
    assert not NEUTRAL.varies
    assert whatif.step_times.tolist() == [result.metrics.makespan] * 5
    assert set(whatif.quantiles.values()) == {result.metrics.makespan}


def test_comm_jitter_of_zero_on_per_transfer_wires_is_the_deterministic_step():
    """The per-transfer wires (used when transfers vary) time the step as the per-wire ones."""
    result = simulate_job(job(schedule="interleaved-1f1b", topology="pcie", act_bytes=8e6))
    stepper = SampleStepper(result, Variability())
    wires = per_transfer_wires(stepper.program, stepper.wires, np.ones(stepper.program.arrays.transfers))
    step = engine.run_inputs(stepper.per_transfer, engine.StepInputs(stepper.seconds, stepper.hold, wires,
                                                                    stepper.comm_overhead))
    assert step.makespan == result.metrics.makespan


# -- a straggler against a hand-derived closed form ---------------------------------------------


@pytest.mark.parametrize(("p2p", "factor"), [("rendezvous", 1.5), ("rendezvous", 2.0), ("buffered", 1.5),
                                             ("buffered", 2.5), ("buffered", 3.0)])
def test_straggler_sets_the_1f1b_step_as_derived_by_hand(p2p, factor):
    """1F1B, p = 4, m = 8, F = 1, B = 2, rank 1 slowed by f (F' = f, B' = 2f). Once rank 1
    is the bottleneck the critical path is: 0F0, 1F0, 2F0, 3F0 (1 + f + 1 + 1), 3B0, 2B0
    (2 + 2), then rank 1 busy to its end: its m backwards and the m - (p - 1) forwards
    after its first backward (8 * 2f + 5 * f), then 0B7 (2): 9 + 22 f. It holds from
    f = 1.5 (below, the others' fill and drain still bind) up to 2 under rendezvous and 3
    buffered (beyond, rank 1's sends also wait for rank 2's receives, or its forwards
    for rank 0's)."""
    result = simulate_job(job(fwd=1.0, bwd=2.0, p2p=p2p))
    assert result.metrics.makespan == 33.0  # (m + p - 1)(F + B)
    whatif = sample_steps(result, Variability(stragglers={1: factor}, samples=2))
    assert whatif.step_times.tolist() == pytest.approx([9 + 22 * factor] * 2, rel=1e-12)
    assert whatif.owner_shares == [(1, 1.0)]


def test_straggler_share_of_everyone_is_every_rank_slowed():
    """FRACTION 1: every GPU straggles, so every action takes f times its cost and so does
    the step (no links, no overheads: time scales)."""
    result = simulate_job(job(schedule="interleaved-1f1b"))
    whatif = sample_steps(result, Variability(straggler_share=(1.0, 1.5), samples=3))
    assert whatif.step_times == pytest.approx([1.5 * result.metrics.makespan] * 3, rel=1e-12)


def test_straggler_share_with_tp_straggles_a_rank_when_any_of_its_gpus_does():
    result = simulate_job(job(topology="ib", nodes=2, tp=4))
    stepper = SampleStepper(result, Variability(straggler_share=(0.1, 2.0)))
    assert stepper.sampler.rank_straggle_chance == pytest.approx(1 - 0.9 ** 4)
    drawn = np.array([stepper.sampler.draw(sample).rank_factor for sample in range(2000)])
    assert set(np.unique(drawn)) == {1.0, 2.0}
    assert (drawn == 2.0).mean() == pytest.approx(1 - 0.9 ** 4, abs=0.02)


def test_slow_link_slows_the_transfers_between_its_ranks_only():
    result = simulate_job(job(topology="ib", nodes=2, act_bytes=64e6))
    stepper = SampleStepper(result, Variability(slow_links={(1, 2): 4.0}))
    draws = stepper.sampler.draw(0)
    arrays = stepper.program.arrays
    stage = np.arange(arrays.transfers) // arrays.microbatches // 2
    direction = np.arange(arrays.transfers) // arrays.microbatches % 2
    between_1_and_2 = ((stage == 1) & (direction == 0)) | ((stage == 2) & (direction == 1))
    assert draws.transfer[between_1_and_2].tolist() == [4.0] * int(between_1_and_2.sum())
    assert set(draws.transfer[~between_1_and_2].tolist()) == {1.0}
    slow = sample_steps(result, Variability(slow_links={(1, 2): 4.0}, samples=1))
    assert slow.step_times[0] > result.metrics.makespan


# -- the compiled engine against the SimPy specification -------------------------------------


class PerturbedStep(reference.SimpyStep):
    """The specification with one sample's draws applied where the SimPy model applies
    them: each action's seconds as it runs, each transfer's routes as it reserves them."""

    def __init__(self, program, seconds, hold, wires, comm_overhead, draws):
        super().__init__(program, seconds, hold, wires, comm_overhead)
        flat = [action for rank_program in self.schedule.programs for action in rank_program]
        self.factor = {flat[row]: draws.compute[index] for index, row in enumerate(program.compute_row.tolist())}
        self.transfer_factor = draws.transfer

    def compute_seconds(self, rank, action, seconds):
        return seconds * self.factor[action]

    def transfer(self, key, now):
        wires, wire = self.wires, int(self.program.transfer_wire[key])
        factor = 1.0 if self.transfer_factor is None else self.transfer_factor[key]
        arrival = now
        for route in range(wires.route_start[wire], wires.route_start[wire + 1]):
            links = wires.links[wires.link_start[route]:wires.link_start[route + 1]].tolist()
            arrival = max(arrival, self.links.reserve(links, wires.occupancy[route] * factor,
                                                      wires.latency[route] * factor, now))
        return arrival


def specified_step_times(result, variability: Variability) -> np.ndarray:
    stepper = SampleStepper(result, variability)
    times = []
    for sample in range(variability.samples):
        draws = stepper.sampler.draw(sample)
        step = PerturbedStep(stepper.program, stepper.seconds, stepper.hold, stepper.wires, stepper.comm_overhead,
                             draws).run()
        times.append(step.makespan)
    return np.array(times)


def ks_two_sample(first: np.ndarray, second: np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov p-value (asymptotic Kolmogorov distribution)."""
    values = np.sort(np.concatenate([first, second]))
    cdf_first = np.searchsorted(np.sort(first), values, side="right") / len(first)
    cdf_second = np.searchsorted(np.sort(second), values, side="right") / len(second)
    distance = np.abs(cdf_first - cdf_second).max()
    effective = len(first) * len(second) / (len(first) + len(second))
    lam = (math.sqrt(effective) + 0.12 + 0.11 / math.sqrt(effective)) * distance
    if lam < 0.2:  # the series converges badly here; Q(0.2) = 1 - 1e-20
        return 1.0
    return float(min(1.0, max(0.0, 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam)
                                           for k in range(1, 101)))))


VARIED = {"jitter": {"F": 0.1, "B": 0.15, "comm": 0.3}, "straggler_share": (0.2, 1.5), "slow_links": {(0, 1): 2.0}}


@pytest.mark.parametrize("seed", range(5))
def test_engine_and_specification_agree_sample_by_sample_and_in_distribution(seed):
    result = simulate_job(job(schedule="interleaved-1f1b", topology="pcie", act_bytes=16e6))
    variability = Variability(**VARIED, samples=60, seed=seed)
    compiled = sample_steps(result, variability).step_times
    specified = specified_step_times(result, variability)
    np.testing.assert_allclose(compiled, specified, rtol=1e-12)  # identical draws: the same steps
    assert compiled.std() > 0
    independent = sample_steps(result, Variability(**VARIED, samples=60, seed=seed + 100)).step_times
    assert ks_two_sample(independent, specified) > 0.01


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev"]), st.integers(2, 4),
       st.integers(2, 8), st.sampled_from(["ideal", "nvlink", "pcie"]), st.sampled_from(["rendezvous", "buffered"]),
       st.floats(0, 0.3), st.floats(0, 0.5), st.floats(0, 1), st.integers(0, 2 ** 16))
def test_engine_and_specification_agree_on_random_layouts(name, pp, microbatches, cluster, p2p, cv, comm_cv, share,
                                                           seed):
    """Any generator (V-shaped and overlapped pairs included), cluster and semantics: the
    compiled samples are the SimPy specification's on the same draws."""
    from schedules.generators import ScheduleUnavailableError

    try:
        result = simulate_job(job(schedule=name, pp=pp, microbatches=microbatches, topology=cluster, p2p=p2p,
                                  act_bytes=8e6, wgrad=0.4e-3))
    except (ScheduleUnavailableError, ValueError):
        assume(False)  # no such schedule at this size
    variability = Variability(jitter={"F": cv, "B": cv, "I": cv, "W": cv, "comm": comm_cv},
                              straggler_share=(share, 1.5), slow_links={(0, 1): 2.0}, samples=3, seed=seed)
    np.testing.assert_allclose(sample_steps(result, variability).step_times,
                               specified_step_times(result, variability), rtol=1e-12)


def test_the_two_sample_test_tells_a_straggler_from_none():
    """The KS check above can fail: 1.5x stragglers against none are told apart."""
    result = simulate_job(job(schedule="interleaved-1f1b", topology="pcie", act_bytes=16e6))
    base = {"jitter": VARIED["jitter"], "samples": 60}
    slowed = sample_steps(result, Variability(**base, stragglers={2: 1.5}, seed=1)).step_times
    specified = specified_step_times(result, Variability(**base, seed=2))
    assert ks_two_sample(slowed, specified) < 1e-6


def test_ks_p_value_against_known_values():
    """Identical samples: p = 1; fully separated samples of 50: D = 1, p ~ 2 exp(-2 lam^2)."""
    values = np.arange(50.0)
    assert ks_two_sample(values, values) == 1.0
    lam = math.sqrt(25) + 0.12 + 0.11 / 5
    assert ks_two_sample(values, values + 100) == pytest.approx(2 * math.exp(-2 * lam * lam), rel=1e-6)


# -- jitter's draws ----------------------------------------------------------------------------


def test_jitter_factors_have_mean_one_and_the_asked_cv():
    result = simulate_job(job(schedule="interleaved-1f1b", pp=8, microbatches=64))
    sampler = SampleStepper(result, Variability(jitter={"F": 0.2, "B": 0.05})).sampler
    factors = np.concatenate([sampler.draw(sample).compute for sample in range(20)])
    kind = np.tile(sampler.program.compute_kind, 20)
    for code, cv in ((0, 0.2), (1, 0.05)):
        drawn = factors[kind == code]
        assert drawn.mean() == pytest.approx(1.0, abs=0.01)
        assert drawn.std() / drawn.mean() == pytest.approx(cv, rel=0.05)
    assert (factors > 0).all()


def test_a_sample_is_drawn_again_alike_and_quantiles_are_samples():
    result = simulate_job(job(topology="nvlink", act_bytes=1e6))
    variability = Variability(jitter=parse_jitter("0.1"), samples=101, seed=7)
    whatif = sample_steps(result, variability)
    again = Sampler(whatif._stepper.program, variability)
    assert np.array_equal(again.draw(37).compute, whatif._stepper.sampler.draw(37).compute)
    ordered = np.sort(whatif.step_times)
    assert whatif.quantiles == {"p50": ordered[50], "p90": ordered[90], "p99": ordered[99]}
    p99 = whatif.sample_at("p99")
    assert whatif.trace(p99).meta["sample"] == p99
    from schedules.metrics import makespan

    assert makespan(whatif.trace(p99)) == whatif.step_times[p99]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=3), st.floats(0, 1), st.floats(0, 1)),
                         max_size=3), min_size=4, max_size=4),
       st.integers(1, 3), st.data())
def test_per_transfer_wires_give_each_transfer_its_wires_routes_scaled(wire_routes, microbatches, data):
    """2 stages, 4 wires (stage 0 and 1, two directions), routes drawn at random."""
    from schedules.engine import wire_arrays  # the flattening the engine reads

    schedule = generate("1f1b", 2, microbatches)
    program = engine.compile_program(schedule, engine.FREE)
    wires = wire_arrays([[(tuple(links), occupancy, latency) for links, occupancy, latency in routes]
                          for routes in wire_routes], program.arrays)
    factor = np.array(data.draw(st.lists(st.floats(0.5, 2), min_size=program.arrays.transfers,
                                         max_size=program.arrays.transfers)))
    flat = per_transfer_wires(program, wires, factor)
    for key in range(program.arrays.transfers):
        expected = wire_routes[key // microbatches]
        routes = range(flat.route_start[key], flat.route_start[key + 1])
        assert len(routes) == len(expected)
        for route, (links, occupancy, latency) in zip(routes, expected, strict=True):
            assert flat.links[flat.link_start[route]:flat.link_start[route + 1]].tolist() == links
            assert flat.occupancy[route] == occupancy * factor[key]
            assert flat.latency[route] == latency * factor[key]


# -- bad input: one line naming the flag ------------------------------------------------------


@pytest.mark.parametrize(("call", "text", "message"), [
    (parse_jitter, "-0.1", "--jitter -0.1: must be a coefficient of variation >= 0, got -0.1"),
    (parse_jitter, "nan", "--jitter nan: must be a coefficient of variation >= 0, got nan"),
    (parse_jitter, "F=0.1,X=2", "--jitter F=0.1,X=2: unknown kind 'X'; use F, B, I, W, comm"),
    (parse_jitter, "lots", "--jitter lots: expected a coefficient of variation"),
    (parse_straggler, "3:0", "--straggler 3:0: must be a slowdown factor > 0, got 0.0"),
    (parse_straggler, "3:-2", "--straggler 3:-2: must be a slowdown factor > 0, got -2.0"),
    (parse_straggler, "3", "--straggler 3: expected RANK:FACTOR, e.g. 3:1.5"),
    (parse_straggler, "x:2", "--straggler x:2: the rank must be a whole number >= 0, got 'x'"),
    (parse_straggler_share, "1.5:2", "--stragglers 1.5:2: must be a fraction of GPUs between 0 and 1, got 1.5"),
    (parse_straggler_share, "0.1:0", "--stragglers 0.1:0: must be a slowdown factor > 0, got 0.0"),
    (parse_slow_link, "1:2", "--slow-link 1:2: the link must be two different ranks A-B, e.g. 3-4:2"),
    (parse_slow_link, "1-1:2", "--slow-link 1-1:2: the link must be two different ranks A-B"),
    (parse_slow_link, "1-2", "--slow-link 1-2: expected A-B:FACTOR, e.g. 3-4:2"),
    (parse_slow_link, "1-2:inf", "--slow-link 1-2:inf: must be a slowdown factor > 0, got inf"),
])
def test_bad_variability_is_one_line_naming_the_flag(call, text, message):
    with pytest.raises(ValueError) as error:
        parsed = call(text)
        if call is parse_jitter:
            Variability(jitter=parsed)
        elif call is parse_straggler:
            Variability(stragglers=dict([parsed]))
        elif call is parse_straggler_share:
            Variability(straggler_share=parsed)
        else:
            Variability(slow_links=dict([parsed]))
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("samples", [0, -3, 2.5])
def test_samples_below_one_are_refused(samples):
    with pytest.raises(ValueError, match=rf"^--samples must be a whole number >= 1, got {samples!r}$"):
        Variability(samples=samples)


def test_ranks_and_links_the_pipeline_lacks_are_refused():
    result = simulate_job(job())
    with pytest.raises(ValueError, match=r"^--straggler 4:1.5: rank 4 is out of range; the pipeline has ranks 0..3$"):
        sample_steps(result, Variability(stragglers={4: 1.5}))
    with pytest.raises(ValueError, match=r"^--slow-link 0-2:2: no transfer goes between ranks 0 and 2; the "
                                         r"pipeline's links are 0-1, 1-2, 2-3$"):
        sample_steps(result, Variability(slow_links={(0, 2): 2}))
