"""``run --qkv fused``: the Llama-family architectures with Q, K and V as one ``wqkv``
linear (torchtitan 0.3's ``FusedQKVLinear`` layout, key/value group by group). The fused
model starts as the separate one and computes the same loss and gradients; under
``--recompute per-op`` its backward re-runs the output and up projections only (counted
in aten ops); pipelined, with tp 2 and sequence parallelism, with and without per-op,
its float64 losses and gradients equal the one-process reference (gloo, 1e-10); what it
keeps is the hand count; bad values are refused in one line."""

from __future__ import annotations

import pytest
import torch

from executor.config import RunConfig
from executor.launch import launch
from executor.memory import MemoryTracker
from executor.models import build_model
from executor.recompute import apply_recompute
from executor.reference import reference_run
from pipesim.cli import main
from pipesim.cli.run_memory import executor_spec
from pipesim.model.activations import layer_stash_bytes
from schedules.action import Action, ActionKind
from tests.test_executor_memory_prediction import SIZES, measured_block_bytes
from tests.test_executor_per_op_recompute import ATTENTION, blocks, one_step

pytestmark = pytest.mark.timeout(240)


def grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Rows of Q, K and V in torchtitan's fused order, written out: for each key/value
    head g, the query rows of its group, then K's rows of g, then V's."""
    per_q, per_kv = q.shape[0] // kv_heads, k.shape[0] // kv_heads
    rows = []
    for group in range(kv_heads):
        rows += [q[group * per_q:(group + 1) * per_q], k[group * per_kv:(group + 1) * per_kv],
                 v[group * per_kv:(group + 1) * per_kv]]
    return torch.cat(rows)


def one_process(qkv: str) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Loss, gradients and weights of one 2-block stage, 4 query heads over 2 key/value heads."""
    config = RunConfig(pp=1, model="llama3-8b", hidden=16, heads=4, kv_heads=2, layers=2, seq_len=4, vocab=11,
                       batch_size=2, microbatches=1, dtype="float64", qkv=qkv)
    built = build_model(config)
    stage = built.build_stage(0, 1)
    inputs, targets = built.make_batch(0, 2)
    loss = built.loss_sum(stage(inputs), targets)
    loss.backward()
    return (loss.item(), {name: p.grad for name, p in stage.named_parameters()},
            {name: p.detach() for name, p in stage.named_parameters()})


def test_the_fused_model_starts_as_the_separate_one_and_computes_the_same() -> None:
    loss, grads, weights = one_process("separate")
    fused_loss, fused_grads, fused_weights = one_process("fused")
    assert fused_loss == pytest.approx(loss, abs=1e-12, rel=0)
    for block in (0, 1):
        prefix = f"blocks.{block}.attention."
        parts = [f"{prefix}{name}.weight" for name in ("wq", "wk", "wv")]
        assert torch.equal(fused_weights[f"{prefix}wqkv.weight"], grouped(*(weights[part] for part in parts), 2))
        assert torch.allclose(fused_grads[f"{prefix}wqkv.weight"], grouped(*(grads[part] for part in parts), 2),
                              rtol=0, atol=1e-12)
    others = set(grads) - {name for name in grads if ".wq." in name or ".wk." in name or ".wv." in name}
    assert others == set(fused_grads) - {name for name in fused_grads if "wqkv" in name}
    assert all(torch.allclose(fused_grads[name], grads[name], rtol=0, atol=1e-12) for name in others)


def test_per_op_re_runs_the_output_and_up_projections_and_keeps_wqkv() -> None:
    # forward products: wqkv (1, saved), wo (2), w1 (3, saved), w3 (4), w2 (5, saved)
    none, none_counts, loss, grads = one_step("llama3-8b", "none", kv_heads=1, qkv="fused")
    assert none == []
    matmuls, counts, per_op_loss, per_op_grads = one_step("llama3-8b", "per-op", kv_heads=1, qkv="fused")
    assert sorted(matmuls) == sorted(blocks("attention.wo", "feed_forward.w3"))
    assert counts[ATTENTION] == none_counts[ATTENTION] == 0
    assert per_op_loss == loss
    assert all(torch.equal(a, b) for a, b in zip(grads, per_op_grads, strict=True))


def kept_activations(qkv: str, mode: str) -> float:
    """Bytes one microbatch's forward of a 2-block stage leaves tracked (``executor.memory``)."""
    config = RunConfig(pp=1, microbatches=1, model="llama3-8b", hidden=16, heads=2, kv_heads=1, ffn_hidden=40,
                       layers=2, seq_len=8, vocab=32, batch_size=2, dtype="float64", qkv=qkv)
    built = build_model(config)
    stage = built.build_stage(0, 1)
    apply_recompute(stage, mode)
    tracker = MemoryTracker(list(stage.parameters()), torch.device("cpu"))
    tracker.start_step()
    forward = Action(0, ActionKind.F, 0)
    tracker.before_action(forward)
    stage(built.make_batch(0, 2)[0])
    tracker.after_action(forward)
    return tracker.last.activations


def test_per_op_keeps_qkv_whole_by_hand() -> None:
    # hidden 16, 2 query heads of 8, 1 key/value head, MLP 40, 2 x 8 tokens, float64: beyond
    # full recompute's block inputs, per token of each block wqkv's output 16 + 8 + 8, the
    # attention output 16 and its log-sum-exp 2, w1's output 40, w2's 16
    assert kept_activations("fused", "per-op") - kept_activations("fused", "full") == \
        2 * 2 * 8 * (16 + 8 + 8 + 16 + 2 + 40 + 16) * 8


def test_under_bf16_autocast_wqkv_casts_its_input_once() -> None:
    # the llama block of tests/test_executor_memory_prediction.py (h 32, 16 tokens): autocast
    # keeps each linear's own bf16 cast of its input, so fused keeps K's and V's casts fewer,
    # 2 x 32 elements x 2 bytes a token; in float32 the same bytes either way
    measured = {(dtype, qkv): measured_block_bytes(RunConfig(model="llama3-8b", dtype=dtype, qkv=qkv, **SIZES))
                for dtype in ("float32", "bfloat16") for qkv in ("separate", "fused")}
    assert measured["float32", "fused"] == measured["float32", "separate"] == 52096
    assert measured["bfloat16", "separate"] - measured["bfloat16", "fused"] == 16 * 2 * 32 * 2
    spec, saved = executor_spec(RunConfig(model="llama3-8b", dtype="bfloat16", qkv="fused", **SIZES))
    assert layer_stash_bytes(spec, saved=saved) == measured["bfloat16", "fused"]


CASES = {
    "pp2-dp2": dict(dp=2, recompute="none"),
    "pp2-dp2-per-op": dict(dp=2, recompute="per-op"),
    "pp2-tp2-sp-per-op": dict(tp=2, sequence_parallel=True, recompute="per-op"),
    "pp2-tp2": dict(tp=2, recompute="none"),
}
_results: dict[str, dict] = {}


def case_config(name: str) -> RunConfig:
    # 4 query heads over 2 key/value heads: with tp 2 each rank holds one whole group; 4 ranks each
    # (configs launched together share one world size)
    base = dict(model="llama3-8b", qkv="fused", kv_heads=2, hidden=16, heads=4, layers=2, seq_len=4, vocab=32,
                schedule="1f1b", pp=2, microbatches=2, batch_size=4, steps=2, dtype="float64", optimizer="adamw",
                lr=0.05, return_grads=True, backend="gloo")
    return RunConfig(**{**base, **CASES[name]})


@pytest.mark.parametrize("name", CASES)
def test_pipelined_fused_model_equals_the_one_process_reference(name: str) -> None:
    if not _results:
        _results.update(zip(CASES, launch([case_config(case) for case in CASES]), strict=True))
    config = case_config(name)
    result, reference = _results[name], reference_run(config)
    assert any("wqkv" in key for key in reference["grads"])  # the reference builds the same fused layout
    assert result["losses"] == pytest.approx(reference["losses"], abs=1e-10, rel=0)
    for key, grad in reference["grads"].items():
        assert (result["grads"][key] - grad).abs().max().item() < 1e-10, key


@pytest.mark.parametrize(("flags", "error"), [
    (["--model", "llama3-8b", "--qkv", "grouped"], "--qkv 'grouped' is not one of: separate, fused"),
    (["--model", "gpt", "--qkv", "fused"], "--qkv fused builds an architecture's Q, K and V as one wqkv (--model "
     "llama3-8b, a config.json); --model gpt has its own packed, biased qkv linear"),
    (["--model", "deepseek-v2-lite", "--qkv", "fused"], "--model deepseek-v2-lite: model deepseek-v2-lite: latent "
     "attention has no Q, K and V projections to fuse; drop --qkv fused"),
])
def test_run_refuses_a_bad_qkv_in_one_line(flags, error, capsys) -> None:
    assert main(["run", "--pp", "2", *flags]) == 2
    assert capsys.readouterr().err.strip() == f"pipesim run: error: {error}"
