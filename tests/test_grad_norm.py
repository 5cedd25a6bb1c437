"""Gradient clipping's norm (``--clip-grad``, ``Costs.grad_norm_overhead``) priced by
``simulate`` as Megatron-LM and torchtitan run it: every rank reads the gradients its
optimizer steps, then one all-reduce of a number over every rank holding a share of
them, before the optimizer; against hand calculations."""

from __future__ import annotations

import math
import re

import pytest

from pipesim.cluster.files import topology_from_dict
from pipesim.job import Job, model_spec_of, schedule_of, simulate_job, topology_of
from pipesim.model.costs import Costs, CostsError, StageCost, costs_from_dict
from pipesim.sim.step import run_simulation
from schedules import generate
from schedules.accounting import time_accounting

PAIR = topology_from_dict({"devices": [{"name": "g0"}, {"name": "g1"}],
                           "links": [{"src": "g0", "dst": "g1", "bandwidth": 10e9, "latency": 0.0}]})
H100_HBM = 3.35e12  # bytes/s, the datasheet's
STREAMING = 0.85  # the share of HBM an element-wise pass reaches (docs/cluster-model.md)


def two_stages(norm: float, optimizer: float) -> Costs:
    """pp 2, F 4 ms, B 10 ms, nothing sent."""
    stage = StageCost(fwd=4e-3, bwd=10e-3)
    return Costs(stages=(stage, stage), step_overhead=optimizer, grad_norm_overhead=norm)


def test_every_rank_sums_its_norm_once_the_last_is_done_then_steps():
    # 1F1B, pp 2, m 2 (as tests/test_embedding_sum.py): rank 1 is done at 32 ms, rank 0 at
    # 42. The norm (2 ms) runs on both from 42; rank 1 waits for it from 32. The
    # optimizer (1 ms) follows: 45 ms.
    result = run_simulation(generate("1f1b", 2, 2), two_stages(2e-3, 1e-3), PAIR)
    for rank, ready in ((0, 42e-3), (1, 32e-3)):
        events = sorted(((event.stream, event.kind, event.start, event.end) for event in result.trace.events
                         if event.rank == rank and event.stream in ("step", "wait")), key=lambda part: part[2])
        expected = [("step", "GRAD_NORM_ALLREDUCE", 42e-3, 44e-3), ("step", "OPTIMIZER", 44e-3, 45e-3)]
        if ready < 42e-3:
            expected.insert(0, ("wait", "GRAD_NORM_ALLREDUCE", ready, 42e-3))
        assert [part[:2] for part in events] == [part[:2] for part in expected]
        assert [moment for part in events for moment in part[2:]] == pytest.approx(
            [moment for part in expected for moment in part[2:]])
    assert result.metrics.makespan == pytest.approx(45e-3)


def test_waiting_for_the_last_rank_is_the_pipelines_drain_not_the_optimizer():
    # rank 1: busy 2 x (4 + 10) = 28 ms, norm + optimizer 3 ms; the rest of 45 ms is bubble
    # (4 ms filling, 32..42 draining while it waits for rank 0 to join), as without a norm
    clipped, unclipped = (time_accounting(run_simulation(generate("1f1b", 2, 2), two_stages(norm, 1e-3), PAIR).trace)
                          for norm in (2e-3, 0.0))
    assert clipped[1].busy == pytest.approx(28e-3)
    assert clipped[1].optimizer == pytest.approx(3e-3)
    assert clipped[1].bubble == pytest.approx(45e-3 - 28e-3 - 3e-3)
    assert clipped[1].bubble == pytest.approx(unclipped[1].bubble)  # the step is 2 ms longer on both
    assert clipped[1].overhead == pytest.approx(0.0)


def llama_job(**overrides) -> Job:
    """A small Llama on one 8-GPU node (NVLink between every pair)."""
    fields = dict(model="llama3-8b", layers=4, seq_len=1024, schedule="1f1b", pp=2, microbatches=4, dp=2,
                  topology="ib", nodes=1, gpu="h100")
    return Job(**{**fields, **overrides})


def norm_seconds(job: Job) -> float:
    """The step with clipping less the step without: what the norm costs."""
    return (simulate_job(job).metrics.makespan
            - simulate_job(Job(**{**job.__dict__, "clip_grad": 0.0})).metrics.makespan)


def expected_norm(job: Job, grad_bytes_per_param: float, group: int) -> float:
    """The slowest rank's read of its stages' gradients at the streaming share of the
    H100's HBM, then a tree all-reduce of 4 bytes over ``group`` devices of the node:
    ``2 * 4 / B + 2 ceil(log2 n) alpha`` (NCCL's double binary tree)."""
    from pipesim.job import costs_of

    schedule = schedule_of(job)
    topology = topology_of(job)
    costs = costs_of(Job(**{**job.__dict__, "clip_grad": 0.0}), schedule, topology)
    per_rank: dict[int, float] = {}
    for stage, cost in enumerate(costs.stages):
        rank = schedule.placement[stage]
        per_rank[rank] = per_rank.get(rank, 0.0) + cost.params * grad_bytes_per_param
    read = max(per_rank.values()) / (H100_HBM * STREAMING)
    route = topology.route("n0.gpu0", "n0.gpu1")  # every pair of the node alike
    return read + 2 * 4 / route.bandwidth + 2 * math.ceil(math.log2(group)) * route.latency


def test_without_zero_each_replica_reads_all_its_gradients_and_sums_over_its_pipeline():
    job = llama_job()
    assert model_spec_of(job).dtype_bytes == 2  # --bytes-per-param 2,2,12: 2-byte gradients
    # ZeRO 0: the replicas hold the same gradient; the norm is one replica's tp x pp = 2 ranks'
    assert norm_seconds(job) == pytest.approx(expected_norm(job, 2.0, 2), rel=1e-9)


def test_under_zero_each_replica_reads_its_shard_and_every_rank_sums():
    job = llama_job(zero=1)
    # the optimizer's shard: 2 bytes / dp 2 per parameter; the sum over all 4 ranks
    assert norm_seconds(job) == pytest.approx(expected_norm(job, 1.0, 4), rel=1e-9)


def test_no_clipping_charges_nothing_and_the_trace_has_no_norm():
    result = simulate_job(llama_job(clip_grad=0.0))
    assert result.costs.grad_norm_overhead == 0.0
    assert not [event for event in result.trace.events if event.kind == "GRAD_NORM_ALLREDUCE"]


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf])
def test_a_bad_clip_grad_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=r"^--clip-grad .*expected a norm >= 0"):
        simulate_job(llama_job(clip_grad=value))


def test_the_cli_refuses_a_bad_clip_grad_in_one_line(capsys):
    from pipesim.cli import main

    assert main(["simulate", "--model", "llama3-8b", "--layers", "2", "--pp", "2", "-m", "2",
                 "--clip-grad", "-0.5"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--clip-grad -0.5" in err


def test_costs_files_keep_the_norm_and_refuse_a_bad_one():
    costs = two_stages(2e-3, 1e-3)
    assert costs_from_dict(costs.to_dict()).grad_norm_overhead == 2e-3
    assert "grad_norm_overhead" not in two_stages(0.0, 1e-3).to_dict()  # measured costs carry none
    with pytest.raises(CostsError, match=r"^c\.json: grad_norm_overhead must be a finite"):
        costs_from_dict({**costs.to_dict(), "grad_norm_overhead": -1}, name="c.json")
    with pytest.raises(CostsError, match=re.escape("grad_norm_overhead")):
        two_stages(math.nan, 0.0)


def test_without_a_model_clip_grad_is_refused_not_ignored(capsys):
    from pipesim.cli import main

    assert main(["simulate", "--fwd", "1", "--clip-grad", "1"]) != 0
    assert "--clip-grad 1 needs --model" in capsys.readouterr().err
    assert main(["simulate", "--fwd", "1"]) == 0  # not given: nothing to refuse
