"""Sequence parallelism as Megatron-Core runs it: the residual stream stays sharded by
sequence between the blocks of a stage and across stages (``executor.tensor_parallel.
shard_residual_stream``), each tp rank sending its ``batch x seq/tp x hidden`` shard to
its peer of the next stage.

One gloo launch of 4 processes runs every case in float64: the gpt under 1f1b over
pp 2 x tp 2 (3 layers: 2 blocks on stage 0, 1 on stage 1), a shrunk Llama 3 (grouped-query
attention, RoPE, RMSNorm, SwiGLU) under zb-h1 (the split backward I and W) over pp 2 x
tp 2 and the gpt under zb-h1, the gpt over dp 2 x tp 2 on one stage, and the gpt interleaved (two stages a rank)
with full recompute over pp 2 x tp 2. Losses and gradients equal the
one-process reference to 1e-10, and the trace holds, by hand, Megatron's four tp
collectives a block and pass plus one where the sequence is cut or joined.
"""

from __future__ import annotations

import pytest

from executor.config import RunConfig
from executor.context_parallel import local_shape
from executor.models import build_model
from executor.reference import reference_run
from executor.run_costs import stage_bytes
from tests.launched_cases import LaunchedCases, assert_equals_reference

pytestmark = pytest.mark.timeout(300)

GPT = {"model": "gpt", "hidden": 8, "heads": 2, "layers": 3, "seq_len": 4, "vocab": 11}
LLAMA = {"model": "llama3-8b", "hidden": 16, "heads": 4, "kv_heads": 2, "layers": 3, "seq_len": 8, "vocab": 37}
CASES = LaunchedCases(
    {"batch_size": 5, "steps": 2, "dtype": "float64", "optimizer": "adamw", "lr": 0.05, "return_grads": True,
     "tp": 2, "sequence_parallel": True},
    {4: {"gpt-pp2": {**GPT, "schedule": "1f1b", "pp": 2, "microbatches": 2},
         "llama-zb-h1-pp2": {**LLAMA, "schedule": "zb-h1", "pp": 2, "microbatches": 4},
         # the gpt's output gradients held from I to W include a pending tp gather's (executor.memory)
         "gpt-zb-h1-pp2": {**GPT, "schedule": "zb-h1", "pp": 2, "microbatches": 4},
         "gpt-dp2": {**GPT, "schedule": "1f1b", "pp": 1, "dp": 2, "batch_size": 6, "microbatches": 2},
         "gpt-interleaved-recompute": {**GPT, "layers": 5, "schedule": "interleaved-1f1b", "pp": 2,
                                       "virtual_stages": 2, "microbatches": 2, "recompute": "full"}}})


@pytest.mark.parametrize("name", list(CASES.cases))
def test_sharded_residual_stream_equals_one_process_reference(name: str) -> None:
    assert_equals_reference(CASES.result(name), reference_run(CASES.config(name)))


def test_each_block_issues_megatrons_four_collectives_a_pass() -> None:
    """By hand: a block's forward all-gathers before attention and before the MLP and
    reduce-scatters after each (4); its backward mirrors them (4) and, as Megatron-Core
    runs it, gathers each sublayer's input again from the shard it kept (2 more: 6).
    Stage 0 holds 2 blocks, stage 1 one (3 layers, the even split): 8 and 12, 4 and 6.
    The first stage's backward adds the all-gather of the embedding output's gradient
    (the cut's backward), the last stage's forward the one all-gather before the head:
    13 and 5. (Gathering every block's output back to the whole activation, as before,
    issued 5 a block and pass: 10 on stage 0's forward.)"""
    assert tuple(build_model(CASES.config("gpt-pp2")).layout) == (2, 1)
    assert CASES.tp_collectives_per_action("gpt-pp2") == {"0F": {8}, "0B": {13}, "1F": {5}, "1B": {6}}
    # One stage holds both ends and 3 blocks: 12 + 1 forward, 18 + 1 backward.
    assert CASES.tp_collectives_per_action("gpt-dp2") == {"0F": {13}, "0B": {19}}


def test_split_backward_keeps_the_collectives_in_the_input_gradient() -> None:
    """Under zb-h1 the input gradient I carries the backward's six collectives a block
    (and the first stage's the embedding cut's all-gather) and W none, as the simulator
    charges it (and as Megatron's zero-bubble weight-gradient store runs it): I gathers
    the sublayers' inputs again and holds them for W, and the split records each
    row-parallel GEMM's own output, before the reduce-scatter, so I keeps the
    all-gathered output gradient for W. Llama 3's 3 layers on 2 stages: the simulator's
    split, 2 and 1 (the first stage also holds the embedding)."""
    model = build_model(CASES.config("llama-zb-h1-pp2"))
    assert tuple(model.layout) == (2, 1)
    assert CASES.tp_collectives_per_action("llama-zb-h1-pp2") == {"0F": {8}, "0I": {13}, "1F": {5}, "1I": {6}}


def test_stage_boundary_message_is_the_sequence_shard() -> None:
    """gpt, microbatch 3 of sequence 8 and hidden 8, tp 2 with sequence parallelism: a
    rank sends 3 x 4 x 8 float64s = 768 bytes (whole: 1536); a Llama of hidden 16 with
    cp 2 too sends a quarter of the sequence, 3 x 2 x 16 x 8 = 768 bytes. The run's
    costs (``act_bytes``) say the same; the tp collectives still carry the whole s*b*h.
    """
    config = RunConfig(**{**GPT, "seq_len": 8}, pp=2, tp=2, sequence_parallel=True, batch_size=6, microbatches=2,
                       dtype="float64")
    assert config.boundary_sequence_split == 2
    model = build_model(config)
    assert local_shape(model.boundary_shape(3), config.boundary_sequence_split) == (3, 4, 8)
    stages = stage_bytes(config, 2)
    assert [stage["act_bytes"] for stage in stages] == [3 * 4 * 8 * 8.0, 0.0]
    assert stages[0]["tp_message_bytes"] == 3 * 8 * 8 * 8.0  # the collectives carry the whole s*b*h
    whole = RunConfig(**{**GPT, "seq_len": 8}, pp=2, tp=2, batch_size=6, microbatches=2, dtype="float64")
    assert whole.boundary_sequence_split == 1
    assert stage_bytes(whole, 2)[0]["act_bytes"] == 3 * 8 * 8 * 8.0
    with_cp = RunConfig(model="llama3-8b", hidden=16, heads=4, kv_heads=2, layers=2, seq_len=8, vocab=37, pp=2,
                        tp=2, cp=2, sequence_parallel=True, batch_size=6, microbatches=2, dtype="float64")
    assert with_cp.boundary_sequence_split == 4
    assert stage_bytes(with_cp, 2)[0]["act_bytes"] == 3 * 2 * 16 * 8.0


def test_memory_prediction_holds_the_shard_between_stages() -> None:
    """``run``'s memory line prices the boundary buffers at what the executor now sends:
    3 x 4 x 8 float64s = 768 bytes a message at tp 2 with sequence parallelism (the whole
    1536 without), the last stage sending none."""
    from pipesim.cli.run_memory import executor_spec, with_whole_ends  # noqa: PLC0415
    from pipesim.model.transformer_costs import model_stage_costs  # noqa: PLC0415

    for sequence_parallel, boundary in ((True, 3 * 4 * 8 * 8.0), (False, 3 * 8 * 8 * 8.0)):
        config = RunConfig(**{**GPT, "seq_len": 8}, pp=2, tp=2, sequence_parallel=sequence_parallel, batch_size=6,
                           microbatches=2, dtype="float64")
        spec, saved = executor_spec(config)
        costs = model_stage_costs(spec, 2, [0.0, 0.0], tp=2, sequence_parallel=sequence_parallel,
                                  layers_per_stage=[2, 1], saved_tensors=saved)
        stages = with_whole_ends(costs, spec, 2, sequence_parallel, saved).stages
        assert [stage.act_bytes for stage in stages] == [boundary, 0.0]
