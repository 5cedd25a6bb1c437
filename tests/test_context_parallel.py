"""Context parallelism: the ring attention step against a hand calculation, the all-gather
alternative, the sequence split (activation memory, compute and the attention's ring
steps divided by cp), the gradient reduction over dp x cp, and the errors."""

from __future__ import annotations

import pytest

from pipesim.cluster.collectives import ring_exchange
from pipesim.cluster.presets import nvlink
from pipesim.cluster.topology import ideal_topology
from pipesim.model.costs import Costs, StageCost
from pipesim.model.errors import ModelSpecError
from pipesim.model.spec import model_spec
from pipesim.model.transformer_costs import model_costs
from pipesim.sim.context_parallel import ring_attention_exposed
from pipesim.sim.parallel import ParallelConfig
from pipesim.sim.step import run_simulation
from schedules.generators import generate
from tests.cli_runs import assert_one_line_error, simulate_json

NVLINK_BW = 450e9 * 0.8
NVLINK_PAIR_LATENCY = 2 * 1.5e-6


def test_a_ring_step_lasts_the_longer_of_its_compute_and_its_transfer():
    """cp 4, a layer's attention 4 ms forward / 8 ms backward (1 ms / 2 ms a step), one block
    exchange 1.5 ms, the backward's middle steps (keys, values and their gradients) 3 ms.
    Forward: 3 exchanges each 0.5 ms longer than the step they hide under. Backward: first
    and last exchange (1.5 ms) hidden under 2 ms steps, the 2 middle ones 1 ms longer."""
    assert ring_attention_exposed(4, 4e-3, 8e-3, 1.5e-3, 3e-3) == pytest.approx((3 * 0.5e-3, 2 * 1e-3))
    # compute longer than every transfer: all hidden
    assert ring_attention_exposed(4, 40e-3, 80e-3, 1.5e-3, 3e-3) == (0.0, 0.0)
    # cp 2: one forward exchange; the backward sends K/V at its first step and dK/dV at its last
    assert ring_attention_exposed(2, 2e-3, 2e-3, 1.5e-3, 3e-3) == pytest.approx((0.5e-3, 2 * 0.5e-3))
    assert ring_attention_exposed(1, 2e-3, 2e-3, 1.5e-3, 3e-3) == (0.0, 0.0)


def test_a_ring_exchange_is_one_step_of_a_ring_on_the_slowest_neighbour_route():
    topology = nvlink()
    assert ring_exchange(topology, topology.devices[:4], 36e6) == pytest.approx(36e6 / NVLINK_BW
                                                                                 + NVLINK_PAIR_LATENCY)
    assert ring_exchange(ideal_topology(4), ["gpu0", "gpu1"], 36e6) == 0.0


KV_BYTES = 36e6  # one exchange: 100 us on an NVSwitch port, plus 3 us


def _attention_costs(recompute_layers: float = 0.0) -> Costs:
    stage = StageCost(fwd=1e-3, bwd=2e-3, attention_layers=2, kv_bytes=KV_BYTES, attention_fwd=0.2e-3,
                      attention_bwd=0.4e-3, recompute_layers=recompute_layers)
    return Costs(stages=(stage,) * 2)


def test_ring_attention_in_a_step_holds_the_rank_for_what_the_attention_does_not_hide():
    """pp 2 x cp 4 on one node (cp ring of pipeline rank 0: gpu0-3). Per layer: steps of 50 us
    forward and 100 us backward; exchanges t(S) = 103 us, t(2S) = 203 us. Forward exposed
    3 x 53 = 159 us, backward 2 x 3 + 2 x 103 = 212 us; two layers a stage. (Without the
    slowdown a transfer costs the attention beside it: tests/test_comm_overlap.py adds it.)"""
    one, two = KV_BYTES / NVLINK_BW + NVLINK_PAIR_LATENCY, 2 * KV_BYTES / NVLINK_BW + NVLINK_PAIR_LATENCY
    forward = 3 * (one - 50e-6)
    backward = 2 * (one - 100e-6) + 2 * (two - 100e-6)
    result = run_simulation(generate("1f1b", 2, 2), _attention_costs(), nvlink(),
                            parallel=ParallelConfig(cp=4, overlap_slowdown=0.0))
    by_kind = {"F": [], "B": []}
    for event in result.trace.events:
        if event.stream == "cp":
            by_kind[event.action[len("CP_KV(") + 1]].append(event.duration)
    assert by_kind["F"] == pytest.approx([2 * forward] * 4)
    assert by_kind["B"] == pytest.approx([2 * backward] * 4)
    for rank in result.metrics.ranks:
        assert rank.cp == pytest.approx(2 * (2 * forward + 2 * backward))
        assert rank.time().total == pytest.approx(result.metrics.makespan)
    # full recompute re-runs the forward, its exchanges included, inside the backward
    recomputed = run_simulation(generate("1f1b", 2, 2), _attention_costs(recompute_layers=2), nvlink(),
                                parallel=ParallelConfig(cp=4, overlap_slowdown=0.0))
    backwards = [event.duration for event in recomputed.trace.events
                 if event.stream == "cp" and event.action.startswith("CP_KV(") and event.action[7] == "B"]
    assert backwards == pytest.approx([2 * (backward + forward)] * 4)


def test_all_gathered_keys_and_values_are_exposed():
    """The same stages with --cp-comm all-gather: forward all-gathers the 4 ranks' K/V
    (3/4 x 4S / B + 3 alpha), the backward gathers again and reduce-scatters the gradients."""
    gather = 3 / 4 * 4 * KV_BYTES / NVLINK_BW + 3 * NVLINK_PAIR_LATENCY
    result = run_simulation(generate("1f1b", 2, 2), _attention_costs(), nvlink(),
                            parallel=ParallelConfig(cp=4, cp_comm="all-gather"))
    durations = sorted({round(event.duration, 12) for event in result.trace.events if event.stream == "cp"})
    assert durations == pytest.approx(sorted([2 * gather, 2 * 2 * gather]))


def test_gradients_are_reduced_over_dp_x_cp():
    """dp 1, cp 2 on one node: the two cp ranks hold the same weights and all-reduce their
    gradients, 2 (n-1)/n S/B + 2 (n-1) alpha with n = 2: S/B + 2 alpha (one bucket)."""
    stage = StageCost(fwd=1e-3, bwd=2e-3, param_bytes=1e9)
    result = run_simulation(generate("1f1b", 2, 2), Costs(stages=(stage,) * 2), nvlink(),
                            parallel=ParallelConfig(cp=2, bucket_bytes=2e9, overlap_dp=False))
    reductions = [event.duration for event in result.trace.events if event.stream == "dp"]
    assert reductions == pytest.approx([1e9 / NVLINK_BW + 2 * NVLINK_PAIR_LATENCY] * 2)


def test_cp_divides_activation_memory_compute_and_the_attention_by_cp():
    """Llama 3 8B, 8192 tokens, --mfu 0.5 on 1 PFLOP/s: every token-proportional figure halves
    on cp 2, and the ring's merges come on top (pipesim.model.ring_merge: 49,152 bytes a
    token forward and 63,488 backward at cp 2, tests/test_ring_merge.py, for the rank's
    4,096 tokens in each of a stage's 16 layers, at the H100's 3.35 TB/s x 0.85); the
    attention core runs 2 ring steps of a causal s/2 kernel, 4 b h s^2 / cp FLOPs counted
    whole; K and V of the rank's 4096 tokens, 8 heads of 128, bf16."""
    spec = model_spec("llama3-8b")
    whole = model_costs(spec, 2, [1e15] * 2, mfu=0.5, layers_per_stage=[16, 16])
    halves = model_costs(spec, 2, [1e15] * 2, mfu=0.5, cp=2, layers_per_stage=[16, 16])
    streamed = 3350e9 * 0.85
    merge_fwd, merge_bwd = 16 * 49_152 * 4096 / streamed, 16 * 63_488 * 4096 / streamed
    for alone, shard in zip(whole.stages, halves.stages, strict=True):
        assert shard.stash_bytes == pytest.approx(alone.stash_bytes / 2)
        assert shard.fwd == pytest.approx(alone.fwd / 2 + merge_fwd)
        assert shard.bwd == pytest.approx(alone.bwd / 2 + merge_bwd)
        assert shard.params == alone.params  # cp splits the sequence, not the weights
    stage = halves.stages[0]
    assert stage.act_bytes == 4096 * 4096 * 2
    assert stage.attention_fwd == pytest.approx(4 * 8192**2 * 4096 / 2 / (1e15 * 0.5))
    assert stage.kv_bytes == 4096 * 2 * 8 * 128 * 2
    assert stage.attention_layers == 16


def test_a_cp_job_counts_its_gpus_and_sends_each_ranks_share():
    out_args = ["--model", "llama3-8b", "--pp", "2", "-m", "2", "--cp", "8", "--topology", "ib", "--nodes", "2"]
    document = simulate_json(out_args)
    assert document["model"]["gpus"] == 16 and document["cp"] == 8 and document["cp_comm"] == "p2p"
    assert document["rank_order"] == "tp-cp-dp-pp"
    assert document["stage_costs"][0]["act_bytes"] == 1024 * 4096 * 2


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "llama3-8b", "--cp", "3"], "--cp 3: 2 x cp = 6 chunks (causal load balancing"),
    (["--model", "llama3-8b", "--cp", "2", "--no-flash-attention"],
     "--cp 2 conflicts with --no-flash-attention: ring attention is built on the fused attention kernel"),
    (["--fwd", "1e-3", "--cp", "2"], "--cp 2 needs --model"),
    (["--model", "llama3-8b", "--cp", "0"], "--cp must be a whole number >= 1, got 0"),
    (["--model", "llama3-8b", "--cp-comm", "all-gather"], "--cp-comm all-gather needs --cp > 1"),
])
def test_bad_context_layouts_are_one_line_errors_before_any_work(capsys, args, message):
    assert_one_line_error(capsys, ["simulate", "--pp", "2", "-m", "2", *args], message)


def test_ring_attention_needs_the_fused_kernel_in_the_model_too():
    with pytest.raises(ModelSpecError, match="--cp 2 conflicts with --no-flash-attention"):
        model_costs(model_spec("llama3-8b"), 2, [1e15] * 2, cp=2, flash_attention=False)
