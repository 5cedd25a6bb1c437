"""The engine's fast paths against SimPy, on random cases: the same programs, costs,
cluster and placement must give the same Trace.

- The engine's own event kernel (``pipesim.sim.kernel``, ``kernel="fast"``): event for event
  and in the same order, under both P2P semantics. The engine's rank and stream processes
  are the same code under either kernel, so any difference would come from the order in
  which the kernel runs them.
- The direct rendezvous step (``pipesim.sim.direct``, the default ``kernel="direct"``), which
  computes a step without processes: the same events (the same actions, ranks and
  times), recorded in another order. Uniform costs make many transfers leave at the
  same moment over a shared link; both engines then start groups in rank order.
- The direct step's C inner loop (``pipesim/sim/_rendezvous.c``) against its Python
  version: the same algorithm, so the same events in the same order, bit for bit.
"""

from __future__ import annotations

import shutil
import sysconfig

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.cluster import presets
from pipesim.cluster.mapping import map_ranks
from pipesim.model.costs import Costs, StageCost, uniform_costs
from pipesim.sim import direct as direct_engine
from pipesim.sim.engine import SimulationError, simulate
from pipesim.sim.parallel import comm_plan
from schedules import generate, lower
from schedules.action import Action, ActionKind
from schedules.generators import GENERATORS, MULTI_CHUNK, ScheduleUnavailableError
from schedules.schedule import Schedule
from tests.native_switch import accelerated

CLUSTERS = {  # name -> (preset, nodes); pcie shares its switch and socket links between rank pairs
    "ideal": ("ideal", 1), "nvlink": ("nvlink", 1), "pcie": ("pcie", 1), "ib": ("ib", 2), "ethernet": ("ethernet", 2),
}


NATIVE_BUILT = direct_engine._native is not None


def direct_loop(native: bool):
    return accelerated(direct_engine, native)


def python_and_native_direct(*args, **kwargs):
    """The direct step's Trace from the Python loop, and from the C loop (None if not built)."""
    with direct_loop(False):
        python = simulate(*args, kernel="direct", **kwargs)
    if not NATIVE_BUILT:
        return python, None
    with direct_loop(True):
        return python, simulate(*args, kernel="direct", **kwargs)


@st.composite
def cases(draw):
    name = draw(st.sampled_from(sorted(GENERATORS)))  # zero-bubble, V-shaped and overlapped pairs included
    pp = draw(st.integers(1, 8))
    microbatches = draw(st.integers(1, 12))
    chunks = draw(st.integers(1, 3)) if name in MULTI_CHUNK else 1
    try:
        lowered = lower(generate(name, pp, microbatches, chunks))
    except ScheduleUnavailableError:
        lowered = lower(generate("1f1b", pp, microbatches))
    preset, nodes = CLUSTERS[draw(st.sampled_from(sorted(CLUSTERS)))]
    topology = presets.PRESETS[preset](nodes)
    devices = None
    if not topology.ideal and draw(st.booleans()):  # ranks on scattered devices: other links shared
        devices = draw(st.permutations(topology.devices))[: lowered.pp]
    if draw(st.booleans()):  # uniform costs: many ties, where the order of equal-time steps decides
        costs = uniform_costs(lowered, 1e-3, 2e-3, wgrad=draw(st.sampled_from([0.0, 0.5e-3])),
                              act_bytes=draw(st.sampled_from([0, 1e6, 5e7, 1e9])))
    else:
        seconds = st.floats(1e-5, 5e-3)
        stages = tuple(
            StageCost(fwd=draw(seconds), bwd=draw(st.floats(2e-3, 5e-3)), wgrad=draw(st.floats(0.0, 1e-3)),
                      act_bytes=draw(st.sampled_from([0.0, 1e5, 3e7, 4e8])),
                      param_bytes=draw(st.sampled_from([0.0, 1e8])), layers=2, tp_message_bytes=1e6)
            for _ in range(lowered.num_stages)
        )
        overheads = st.sampled_from([0.0, 2e-6, 1e-5])
        costs = Costs(stages, action_overhead=draw(overheads), comm_overhead=draw(overheads),
                      step_overhead=draw(st.sampled_from([0.0, 1e-3])))
    plan = None
    if draw(st.booleans()):  # a dp x tp job: tp events, dp and optimizer tail, other replicas' transfers (twins)
        topology = presets.ib(4)
        mapping = map_ranks(topology, dp=2, pp=lowered.pp, tp=2)
        devices = mapping.pipeline()
        plan = comm_plan(lowered, costs, topology, mapping, overlap_dp=draw(st.booleans()))
    return lowered, costs, topology, devices, plan, draw(st.sampled_from(["rendezvous", "buffered"]))


@settings(max_examples=200, deadline=None)
@given(cases())
def test_the_fast_kernel_and_the_direct_step_give_simpys_trace(case):
    lowered, costs, topology, devices, plan, p2p = case
    reference = simulate(lowered, costs, topology, devices, plan, p2p, kernel="simpy")
    fast = simulate(lowered, costs, topology, devices, plan, p2p, kernel="fast")
    assert fast.events == reference.events  # event for event, in the same order
    direct, native = python_and_native_direct(lowered, costs, topology, devices, plan, p2p)
    assert sorted(direct.events) == sorted(reference.events)  # recorded in another order
    assert fast.meta == direct.meta == reference.meta
    if native is not None:
        assert native.events == direct.events  # the C loop: the same events in the same order
        assert native.meta == direct.meta


@pytest.mark.parametrize("p2p", ["rendezvous", "buffered"])
def test_a_large_interleaved_step_is_the_same_under_every_kernel(p2p):
    lowered = lower(generate("interleaved-1f1b", 16, 64, 2))
    costs = uniform_costs(lowered.num_stages, 10e-3, 20e-3, act_bytes=64e6, virtual_stages=2)
    topology = presets.ib(2)
    reference = simulate(lowered, costs, topology, p2p=p2p, kernel="simpy").events
    assert simulate(lowered, costs, topology, p2p=p2p, kernel="fast").events == reference
    direct, native = python_and_native_direct(lowered, costs, topology, p2p=p2p)
    assert sorted(direct.events) == sorted(reference)
    if native is not None:
        assert native.events == direct.events


@pytest.mark.parametrize("p2p", ["rendezvous", "buffered"])
def test_a_deadlock_is_named_the_same_under_every_kernel(p2p):
    # both ranks receive before they send: neither receive can ever be served
    recv_f, send_b = Action(1, ActionKind.RECV_F, 0), Action(1, ActionKind.SEND_B, 0)
    recv_b, send_f = Action(0, ActionKind.RECV_B, 0), Action(0, ActionKind.SEND_F, 0)
    schedule = Schedule(
        pp=2, microbatches=1, placement=(0, 1),
        programs=((recv_b, Action(0, "F", 0), send_f, Action(0, "B", 0)),
                  (recv_f, Action(1, "F", 0), Action(1, "B", 0), send_b)),
    )
    costs = uniform_costs(2, 1.0, 2.0, act_bytes=1e6)
    messages = []
    for kernel, native in (("simpy", False), ("fast", False), ("direct", False), ("direct", NATIVE_BUILT)):
        with direct_loop(native), pytest.raises(SimulationError, match="deadlock") as error:
            simulate(schedule, costs, presets.nvlink(1), p2p=p2p, kernel=kernel)
        messages.append(str(error.value))
    assert len(set(messages)) == 1


@pytest.mark.parametrize("native", [False, True])
def test_an_action_the_direct_step_cannot_time_is_named(native):
    if native and not NATIVE_BUILT:
        pytest.skip("the C loop is not built")
    # a RECV where a compute action belongs: no cost slot, so the step names it
    schedule = Schedule(pp=1, microbatches=1, placement=(0,), programs=((Action(0, "F", 0), Action(0, "Q", 0)),))
    with direct_loop(native), pytest.raises(SimulationError, match=r"rank 0: cannot simulate action 0Q0 "
                                                                   r"\(unknown kind 'Q'\)"):
        simulate(schedule, uniform_costs(1, 1.0, 2.0), presets.nvlink(1), kernel="direct")


@pytest.mark.skipif(not (shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC")
                                      else "cc")), reason="no C compiler: pipesim runs the Python loop")
def test_the_c_loops_are_built_where_a_compiler_is():
    # setup.py builds them as optional extensions; a silent failure would cost 3-10x in speed
    import importlib

    for name in ("pipesim._rendezvous", "schedules._accounting", "schedules._lowering", "schedules._timing"):
        try:
            importlib.import_module(name)
        except ImportError as error:
            raise AssertionError(f"{name} did not build: see the install log (pip install -e . -v)") from error
    assert direct_engine.ACCELERATED or direct_engine.os.environ.get("PIPESIM_PURE_PYTHON")


def test_an_unknown_kernel_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown simulation kernel 'fastest'"):
        simulate(generate("1f1b", 2, 2), uniform_costs(2, 1.0, 2.0), presets.nvlink(1), kernel="fastest")
