"""The attention parts today's configs name, built by the executor: query and key norms
(Qwen3's one head wide, OLMoE's over the whole projection), sliding windows (Mistral,
gpt-oss), chunks (Llama 4), attention sinks and a biased router (gpt-oss). Each against
a hand computation; pipelined float64 runs on gloo equal the one-process reference;
what the executor's tp and cp cannot split is refused in one line; head-wide query and
key norms run under tp, their weights' gradients summed over it."""

from __future__ import annotations

import math

import pytest
import torch

from executor.architectures.layers import Attention, attend, visible_keys
from executor.config import ConfigError, RunConfig
from executor.models import build_model
from executor.reference import reference_run
from pipesim.model.spec import BUNDLED_CONFIGS
from tests.launched_cases import LaunchedCases, assert_equals_reference, assert_weights_equal_reference

pytestmark = pytest.mark.timeout(300)
CONFIGS = BUNDLED_CONFIGS


def config_path(name: str) -> str:
    return str(CONFIGS / f"{name}.json")


def test_visible_keys_of_a_window_and_of_a_chunk() -> None:
    window = visible_keys(5, window=2).int().tolist()
    assert window == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    chunk = visible_keys(5, chunk=2).int().tolist()
    assert chunk == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]]


def by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sees, sink: list[float] | None = None) -> torch.Tensor:
    """Attention one query at a time: softmax over the keys ``sees(i, j)`` allows, plus
    ``exp(sink[h])`` in the denominator where given."""
    batch, heads, seq, dim = q.shape
    out = torch.zeros(batch, seq, heads, v.shape[-1], dtype=q.dtype)
    for b in range(batch):
        for h in range(heads):
            for i in range(seq):
                keys = [j for j in range(seq) if sees(i, j)]
                scores = [float(q[b, h, i] @ k[b, h, j]) / math.sqrt(dim) for j in keys]
                total = sum(math.exp(score) for score in scores) + (math.exp(sink[h]) if sink else 0.0)
                for j, score in zip(keys, scores, strict=True):
                    out[b, i, h] += math.exp(score) / total * v[b, h, j]
    return out.flatten(2)


@pytest.mark.parametrize(("window", "chunk", "sink"), [
    (3, None, None), (None, 4, None), (None, None, [0.5, -1.0]), (3, None, [2.0, 0.0])])
def test_attend_equals_attention_by_hand(window, chunk, sink) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 4, dtype=torch.float64) for _ in range(3))

    def sees(i: int, j: int) -> bool:
        return j <= i and (window is None or i - j < window) and (chunk is None or i // chunk == j // chunk)

    sinks = torch.tensor(sink, dtype=torch.float64) if sink else None
    assert torch.allclose(attend(q, k, v, window, chunk, sinks), by_hand(q, k, v, sees, sink), atol=1e-12)


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * weight


@pytest.mark.parametrize("kind", ["head", "projection"])
def test_query_and_key_norms_by_hand(kind: str) -> None:
    torch.manual_seed(1)
    attention = Attention(8, 2, 1, 4, qk_norm=kind).double()
    with torch.no_grad():
        attention.q_norm.weight.uniform_(0.5, 1.5)
        attention.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    q, k, _ = attention.projections(x)
    raw_q, raw_k = attention.wq(x), attention.wk(x)  # batch x seq x (heads * 4), (1 * 4)
    if kind == "head":  # every head of 4 features normalised on its own
        expected_q = rms(raw_q.view(1, 3, 2, 4), attention.q_norm.weight).transpose(1, 2)
    else:  # the 8 features of both heads normalised together, then cut into heads
        expected_q = rms(raw_q, attention.q_norm.weight).view(1, 3, 2, 4).transpose(1, 2)
    expected_k = rms(raw_k, attention.k_norm.weight).view(1, 3, 1, 4).transpose(1, 2)
    assert torch.allclose(q, expected_q, atol=1e-12) and torch.allclose(k, expected_k, atol=1e-12)


def test_configs_build_their_parts() -> None:
    def parts(name: str, **sizes) -> dict:
        config = RunConfig(model=config_path(name), layers=2, hidden=16, heads=4, pp=1, **sizes)
        stage = build_model(config).build_stage(0, 1)
        attention = [block.attention for block in stage.blocks]
        return {"norm": attention[0].qk_norm, "windows": [a.window for a in attention],
                "sinks": attention[0].sinks is not None,
                "router_bias": any(m.gate.bias is not None for m in stage.modules() if hasattr(m, "gate"))}

    assert parts("qwen3-8b")["norm"] == "head"
    assert parts("olmoe-1b-7b")["norm"] == "projection"
    oss = parts("gpt-oss-20b")
    assert oss["windows"] == [128, None] and oss["sinks"] and oss["router_bias"]  # sliding, then full
    assert parts("mistral-7b")["windows"] == [4096, 4096]


@pytest.mark.parametrize(("model", "flag", "message"), [
    ("olmoe-1b-7b", {"tp": 2}, "query and key norms span the whole projection"),
    ("gpt-oss-20b", {"cp": 2, "seq_len": 256}, "sliding window 128 is shorter than --seq-len 256"),
    ("gpt-oss-20b", {"cp": 2, "seq_len": 64}, "attention sinks are not in context parallelism"),
])
def test_what_tp_and_cp_cannot_split_is_refused(model: str, flag: dict, message: str) -> None:
    sizes = {"layers": 2, "hidden": 16, "heads": 4, "pp": 1, "microbatches": 1, "batch_size": 2}
    with pytest.raises(ConfigError, match=message):
        RunConfig(model=config_path(model), **{**sizes, **flag}).check()


SMALL = {"hidden": 16, "heads": 4, "vocab": 37, "batch_size": 4, "steps": 2, "dtype": "float64",
         "optimizer": "adamw", "lr": 0.02, "return_grads": True, "layers": 2, "pp": 2, "microbatches": 2,
         "schedule": "1f1b", "seq_len": 8}
CASES = LaunchedCases(SMALL, {4: {
    "qwen3-dp2": {"model": config_path("qwen3-8b"), "dp": 2},
    "qwen3-cp2": {"model": config_path("qwen3-8b"), "cp": 2},
    "olmoe-dp2-ep2": {"model": config_path("olmoe-1b-7b"), "dp": 2, "ep": 2, "experts": 4},
    # head-wide query and key norms under tp: each rank's weight gradient its heads' share, summed over tp
    "qwen3-tp2-sp": {"model": config_path("qwen3-8b"), "tp": 2, "kv_heads": 2, "sequence_parallel": True},
    "qwen3-tp2-zbv": {"model": config_path("qwen3-8b"), "tp": 2, "kv_heads": 2, "schedule": "zbv", "virtual_stages": 2,
                      "layers": 4},
    # a 160-token sequence past gpt-oss's 128-token window: the sliding layer's mask cuts
    "gpt-oss-zbv-dp2": {"model": config_path("gpt-oss-20b"), "dp": 2, "experts": 4, "seq_len": 160,
                        "schedule": "zbv", "virtual_stages": 2, "layers": 4},
    # the sinks' written-out core checkpointed by selective recompute: the sinks' gradient through the re-run
    "gpt-oss-dp2-selective": {"model": config_path("gpt-oss-20b"), "dp": 2, "experts": 4, "seq_len": 160,
                              "recompute": "selective", "layers": 4},
}})


@pytest.mark.parametrize("name", list(CASES.cases))
def test_pipelined_runs_equal_the_reference(name: str) -> None:
    result, reference = CASES.result(name), reference_run(CASES.config(name))
    assert_equals_reference(result, reference)
    assert_weights_equal_reference(result, reference)
