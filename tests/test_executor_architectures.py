"""Architectures trained by the executor (``run --model llama3-8b``, ``mixtral-8x7b``,
``deepseek-v3``): a pipelined step of the shrunk model equals the one-process reference.

One gloo launch of 2 processes runs every case, float64, 2 AdamW steps: the loss of
every step and every gradient of the first equal the reference to 1e-10. Cases: a
shrunk Llama 3 (grouped-query attention, SwiGLU, RoPE, RMSNorm) under 1f1b, a
zero-bubble schedule (the split backward: I then W), V-shaped zbv and interleaved
1F1B (two stages per rank; 2 layers on 4 stages, split as simulate splits them: the
first stage holds only the embedding, the last only the output layer); a shrunk
Mixtral with top-2 routing (1f1b, and zb-h1), dropless and with a capacity that drops
tokens; DeepSeek-V3 (latent attention, sigmoid router, a shared expert, a dense first
layer); tensor parallelism 2 of the Llama blocks, with and without sequence
parallelism, of the Mixtral and Qwen-MoE experts (the latter with sequence parallelism
and a shared, gated expert) and of DeepSeek-V3's and V2-Lite's latent attention (the
latter with sequence parallelism and no query latent); and training on a text file
(this one).
"""
from __future__ import annotations

import pytest

from executor.config import RunConfig
from executor.launch import launch
from executor.reference import reference_run
from tests.launched_cases import assert_equals_reference

pytestmark = pytest.mark.timeout(300)

SMALL = {"hidden": 16, "heads": 4, "seq_len": 8, "vocab": 37, "batch_size": 5, "steps": 2, "dtype": "float64",
         "optimizer": "adamw", "lr": 0.02, "return_grads": True}
CASES = {
    "llama-1f1b": {"model": "llama3-8b", "kv_heads": 2, "layers": 3, "schedule": "1f1b", "microbatches": 2},
    "llama-zb-h1": {"model": "llama3-8b", "kv_heads": 2, "layers": 3, "schedule": "zb-h1", "microbatches": 4},
    "llama-zbv": {"model": "llama3-8b", "kv_heads": 2, "layers": 5, "schedule": "zbv", "microbatches": 4,
                  "virtual_stages": 2},
    "llama-interleaved": {"model": "llama3-8b", "kv_heads": 2, "layers": 2, "schedule": "interleaved-1f1b",
                          "microbatches": 4, "virtual_stages": 2, "batch_size": 8},
    "mixtral-top2": {"model": "mixtral-8x7b", "layers": 2, "experts": 4, "schedule": "1f1b", "microbatches": 2},
    "mixtral-zb-h1": {"model": "mixtral-8x7b", "layers": 2, "experts": 8, "seq_len": 4, "batch_size": 2,
                      "schedule": "zb-h1", "microbatches": 2},  # so few tokens that some experts get none
    "mixtral-capacity": {"model": "mixtral-8x7b", "layers": 2, "experts": 4, "capacity_factor": 0.5,
                         "schedule": "1f1b", "microbatches": 2},
    "deepseek-v3": {"model": "deepseek-v3", "layers": 3, "experts": 4, "schedule": "1f1b", "microbatches": 2},
    "llama-tp2": {"model": "llama3-8b", "kv_heads": 2, "layers": 2, "pp": 1, "tp": 2, "microbatches": 2},
    "mixtral-tp2": {"model": "mixtral-8x7b", "kv_heads": 2, "layers": 2, "experts": 4, "pp": 1, "tp": 2,
                    "microbatches": 2},
    "qwen-moe-tp2-sp": {"model": "qwen1.5-moe-a2.7b", "layers": 2, "experts": 4,
                        "ffn_hidden": 16, "pp": 1, "tp": 2, "microbatches": 2, "sequence_parallel": True},
    "llama-text": {"model": "llama3-8b", "kv_heads": 2, "layers": 3, "schedule": "1f1b", "microbatches": 2,
                   "data": __file__, "vocab": 258},  # this file's text, byte by byte
    "deepseek-v3-tp2": {"model": "deepseek-v3", "layers": 2, "experts": 4, "ffn_hidden": 32, "pp": 1, "tp": 2,
                        "microbatches": 2},
    "deepseek-v2-lite-tp2-sp": {"model": "deepseek-v2-lite", "layers": 2, "experts": 4, "ffn_hidden": 32, "pp": 1,
                                "tp": 2, "microbatches": 2, "sequence_parallel": True},
    "llama-tp2-sp": {"model": "llama3-8b", "kv_heads": 2, "layers": 2, "pp": 1, "tp": 2, "microbatches": 2,
                     "sequence_parallel": True},
}
_results: dict[str, dict] = {}


def case_config(name: str, **changes) -> RunConfig:
    fields = {**SMALL, "pp": 2, **CASES[name], **changes}
    return RunConfig(**fields)


def result_of(name: str) -> dict:
    if not _results:
        _results.update(zip(CASES, launch([case_config(case) for case in CASES]), strict=True))
    return _results[name]


@pytest.mark.parametrize("name", CASES)
def test_pipelined_step_equals_one_process_reference(name: str) -> None:
    assert_equals_reference(result_of(name), reference_run(case_config(name)))


def test_the_cases_exercise_what_they_name() -> None:
    """GQA really groups heads, Mixtral routes top-2 of its experts on every layer (and
    leaves some idle in its zb-h1 case), DeepSeek has latent attention and a dense first
    layer: the reference of each builds the parts the numerics above claim to cover."""
    from executor.architectures.latent_attention import LatentAttention  # noqa: PLC0415
    from executor.architectures.layers import Attention  # noqa: PLC0415
    from executor.architectures.moe import MixtureOfExperts  # noqa: PLC0415
    from executor.models import build_model  # noqa: PLC0415

    llama = build_model(case_config("llama-1f1b")).build_stage(1, 2)
    attention = next(m for m in llama.modules() if isinstance(m, Attention))
    assert attention.groups == 2 and attention.wk.out_features == 2 * 4
    mixtral = build_model(case_config("mixtral-top2"))
    moes = [m for stage in range(2) for m in mixtral.build_stage(stage, 2).modules() if isinstance(m, MixtureOfExperts)]
    assert len(moes) == 2 and all(m.router.top_k == 2 and len(m.experts) == 4 for m in moes)
    idle = [name for name, grad in reference_run(case_config("mixtral-zb-h1"))["grads"].items()
            if ".experts." in name and not grad.any()]
    assert idle  # experts no token chose: zero gradients, in the pipelined run too (above)
    deepseek = build_model(case_config("deepseek-v3"))
    modules = [m for stage in range(2) for m in deepseek.build_stage(stage, 2).modules()]
    assert sum(isinstance(m, LatentAttention) for m in modules) == 3
    moes = [m for m in modules if isinstance(m, MixtureOfExperts)]
    assert len(moes) == 2 and all(m.router.gating == "sigmoid" and m.shared is not None for m in moes)
