"""``--recompute norm-mla-up`` (DeepSeek-V3's recompute of every norm and of latent
attention's up-projections, ``executor.rebuilt_activations``): what it drops, counted by
hand; what it re-runs, counted in aten ops; gradients equal to a run without it on one
process; and pipelined steps on gloo, float64, equal to the one-process reference (which
recomputes nothing) under 1f1b, a split backward, dp with ZeRO-3, tp with sequence
parallelism and cp."""

from __future__ import annotations

import pytest
import torch

from executor import rebuilt_activations
from executor.config import ConfigError, RunConfig
from executor.launch import launch
from executor.models import build_model
from executor.recompute import apply_recompute
from executor.reference import reference_run
from tests.launched_cases import assert_equals_reference
from tests.test_executor_recompute import OpCounter

pytestmark = pytest.mark.timeout(300)

F64 = 8  # bytes of a float64
SEQ, HIDDEN, HEADS = 8, 64, 4


def one_process(model: str, mode: str, sequences: int = 2) -> dict:
    """One forward and backward of a 2-layer stage holding the whole model: the bytes its
    graph keeps when the forward ends, the loss, the gradients, the aten ops."""
    config = RunConfig(pp=1, model=model, hidden=HIDDEN, heads=HEADS, layers=2, seq_len=SEQ, vocab=32,
                       batch_size=sequences, microbatches=1, dtype="float64",
                       experts=4 if model.startswith("deepseek") else None)
    built = build_model(config)
    stage = built.build_stage(0, 1)
    apply_recompute(stage, mode)
    inputs, targets = built.make_batch(0, sequences)
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    saved: dict[int, torch.UntypedStorage] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        # by address, the latest storage there: a dropped storage's address may be reused
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage()
        return tensor

    with OpCounter() as counter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = stage(inputs)
        kept = sum(storage.nbytes() for key, storage in saved.items() if key not in params)
        loss = built.loss_sum(output, targets)
        loss.backward()
    return {"kept": kept, "loss": loss.item(), "grads": {n: p.grad for n, p in stage.named_parameters()},
            "ops": counter.counts, "spec": getattr(built, "spec", None)}


@pytest.mark.parametrize("model", ["gpt", "llama3-8b"])
def test_each_norm_output_is_dropped_and_only_the_norms_rerun(model: str) -> None:
    plain, dropped = one_process(model, "none"), one_process(model, "norm-mla-up")
    tokens = 2 * SEQ
    # two norms a layer, each output tokens x hidden float64 (its readers' saved input)
    assert plain["kept"] - dropped["kept"] == 2 * 2 * tokens * HIDDEN * F64
    extra = {op: count - plain["ops"][op] for op, count in dropped["ops"].items() if count != plain["ops"][op]}
    gemms = ("aten.mm", "aten.addmm", "aten.bmm", "aten._scaled_dot_product_flash_attention_for_cpu")
    assert not any(op in extra for op in gemms)  # no GEMM and no attention run again
    if model == "gpt":  # LayerNorm: one kernel per norm, 2 norms x 2 layers once more
        assert extra["aten.native_layer_norm"] == 4
    else:  # the executor's RMSNorm: x * rsqrt(mean(x^2) + eps) * weight, its rsqrt once per norm
        assert extra["aten.rsqrt"] == 4
    assert dropped["loss"] == plain["loss"]
    assert all(torch.equal(plain["grads"][name], grad) for name, grad in dropped["grads"].items())


@pytest.mark.parametrize("model", ["deepseek-v3", "deepseek-v2-lite"])
@pytest.mark.parametrize("sequences", [1, 2])
def test_latent_attention_drops_its_up_projections_q_k_v_and_reruns_only_them(
        model: str, sequences: int, monkeypatch) -> None:
    dropped = one_process(model, "norm-mla-up", sequences)
    kept_all = []  # the same run with nothing dropped: what each drop would free
    monkeypatch.setattr(rebuilt_activations, "DroppedUntilBackward",
                        lambda tensors, rebuild, what: kept_all.append(tensors) or _KeepAll())
    undropped = one_process(model, "norm-mla-up", sequences)
    spec = dropped["spec"]
    mla, heads, tokens = spec.mla, spec.heads, sequences * SEQ
    q_latent = mla.q_lora_rank or 0
    # per layer, by hand: two norm outputs (h); the query latent's norm output (when there is
    # one) and the key-value latent's; V in its own storage; Q and K. Each tokens wide, float64.
    per_token = 2 * spec.hidden + q_latent + mla.kv_lora_rank + heads * mla.v_head_dim + 2 * heads * mla.qk_head_dim
    assert undropped["kept"] - dropped["kept"] == 2 * tokens * per_token * F64
    assert len(kept_all) == 2 * 3  # a layer: its attention's Q, K, V; each of its two norms
    # re-run: two GEMMs a layer, the key-value up-projection and the query's (its
    # up-projection, or without a query latent its projection from the layer's recomputed
    # input), and no other GEMM
    plain = one_process(model, "none", sequences)
    assert dropped["ops"]["aten.mm"] - plain["ops"]["aten.mm"] == 2 * 2
    assert dropped["ops"]["aten.addmm"] == plain["ops"]["aten.addmm"]
    assert dropped["loss"] == pytest.approx(plain["loss"], abs=1e-13, rel=0)
    for name, grad in plain["grads"].items():
        assert (dropped["grads"][name] - grad).abs().max().item() < 1e-12, name


class _KeepAll:
    """A drop that drops nothing (to measure what a drop frees)."""

    def refill(self, _grad=None) -> None:
        return None


def test_a_storage_read_before_its_refill_fails_loudly() -> None:
    weight = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 4, dtype=torch.float64)
    normed = torch.nn.functional.normalize(x, dim=-1)
    out = normed @ weight
    rebuilt_activations.DroppedUntilBackward((normed,), lambda: (normed,), "test")  # dropped, no hook
    with pytest.raises(RuntimeError):
        out.sum().backward()  # the matmul's weight gradient reads the dropped input


def test_a_model_without_norms_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match="--recompute norm-mla-up recomputes the norms' outputs .* --model mlp "
                                          "has neither"):
        RunConfig(model="mlp", recompute="norm-mla-up").check()


SMALL = {"hidden": 16, "heads": 4, "seq_len": 8, "vocab": 37, "batch_size": 4, "steps": 2, "dtype": "float64",
         "optimizer": "adamw", "lr": 0.02, "return_grads": True, "recompute": "norm-mla-up", "experts": 4,
         "ffn_hidden": 32}
CASES = {
    "deepseek-v3-1f1b-dp2": {"model": "deepseek-v3", "layers": 3, "pp": 2, "dp": 2, "microbatches": 2},
    "deepseek-v3-zbv": {"model": "deepseek-v3", "layers": 4, "pp": 2, "dp": 2, "schedule": "zbv",
                        "microbatches": 2, "virtual_stages": 2},
    "deepseek-v2-lite-zb-h1-zero3": {"model": "deepseek-v2-lite", "layers": 3, "pp": 2, "dp": 2, "zero": 3,
                                     "schedule": "zb-h1", "microbatches": 2},
    "deepseek-v3-tp2-sp": {"model": "deepseek-v3", "layers": 2, "pp": 2, "tp": 2, "microbatches": 2,
                           "sequence_parallel": True},
    "deepseek-v3-cp2": {"model": "deepseek-v3", "layers": 2, "pp": 2, "cp": 2, "microbatches": 2},
    "llama-tp2-sp": {"model": "llama3-8b", "kv_heads": 2, "layers": 2, "pp": 2, "tp": 2, "microbatches": 2,
                     "sequence_parallel": True, "experts": None, "ffn_hidden": None},
}
_results: dict[str, dict] = {}


def case_config(name: str) -> RunConfig:
    return RunConfig(**{"schedule": "1f1b", **SMALL, **CASES[name]})


@pytest.mark.parametrize("name", CASES)
def test_pipelined_step_equals_the_reference_without_recompute(name: str) -> None:
    if not _results:
        _results.update(zip(CASES, launch([case_config(case) for case in CASES]), strict=True))
    assert_equals_reference(_results[name], reference_run(case_config(name)))
