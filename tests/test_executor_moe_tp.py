"""A mixture of experts under tensor parallelism as Megatron-Core runs it
(``executor.tensor_parallel.split_experts``): each expert on this rank's shards with no
collective of its own, the layer's output reduced once, and the gradients only the whole
output gives summed where the layer hands them back. Float64 runs on gloo (Mixtral with
and without sequence parallelism, Qwen-MoE's gated shared expert, ep 2 beside tp 2)
equal the one-process reference, and the trace holds the tp collectives counted by
hand, beside a dense Llama's: one collective a sublayer and pass, each sublayer's
column-parallel projections reading one input."""

from __future__ import annotations

from collections import Counter

import pytest

from executor.reference import reference_run
from tests.hf_fixtures import CONFIGS
from tests.launched_cases import LaunchedCases, assert_equals_reference, assert_weights_equal_reference

pytestmark = pytest.mark.timeout(300)

MIXTRAL = {"model": "mixtral-8x7b", "kv_heads": 2, "experts": 4, "ffn_hidden": 32}
CASES = LaunchedCases(
    {"layers": 2, "hidden": 16, "heads": 4, "seq_len": 8, "vocab": 37, "batch_size": 4, "microbatches": 2,
     "steps": 2, "dtype": "float64", "optimizer": "adamw", "lr": 0.02, "return_grads": True, "pp": 1, "tp": 2,
     "schedule": "1f1b"},
    {2: {"llama": {"model": "llama3-8b", "kv_heads": 2, "ffn_hidden": 32},
         "mixtral": MIXTRAL,
         "mixtral-sp": {**MIXTRAL, "sequence_parallel": True},
         "qwen-moe": {"model": str(CONFIGS / "qwen1.5-moe-a2.7b.json"), "ffn_hidden": 64}},
     4: {"mixtral-dp2-ep2": {**MIXTRAL, "dp": 2, "ep": 2}}})


@pytest.mark.parametrize("name", list(CASES.cases))
def test_experts_split_over_tp_equal_the_reference(name: str) -> None:
    result, reference = CASES.result(name), reference_run(CASES.config(name))
    assert_equals_reference(result, reference)
    assert_weights_equal_reference(result, reference)


def tp_collectives(name: str) -> dict[str, int]:
    """The tp collectives each action of case ``name``'s traced step held, by kind (F, B)."""
    counts = Counter(event.action for event in CASES.result(name)["trace"].events if event.stream == "tp")
    kinds = {action[action.index("(") + 1:action.index(")")].rstrip("0123456789"): count
             for action, count in counts.items()}
    return kinds


def test_a_mixture_of_experts_reduces_once_a_pass() -> None:
    """By hand, per layer: the forward all-reduces the attention's output (1) and the
    experts' partial sums once (1): 2, 4 for 2 layers (reducing each of the 4 experts'
    outputs, as before, it was 5 a layer, 10). The backward all-reduces the attention's
    input gradient once (1: its Q, K and V projections read one input, their gradients
    summed first), the experts' input gradient once (1) and the routing weights' (1): 3,
    6 (each of Q, K and V and each expert's two column-parallel inputs' gradients
    reduced apart, as before: 11 a layer, 22); Qwen-MoE's gate on its shared expert adds
    its gradient's (1): 8. With
    sequence parallelism the forward gathers and reduce-scatters around each sublayer
    (4 a layer) and gathers once before the head: 9; the backward mirrors the gathers
    and scatters (2 a sublayer, the MoE input's gather's mirror a slice) and sums the
    experts' inputs and weights (2): 5 a layer, and the embedding cut's all-gather: 11;
    and it gathers each sublayer's input again from the shard the forward kept
    (``executor.rebuilt_activations.read_gathered_shard``, 2 a layer): 15."""
    assert tp_collectives("llama") == {"0F": 4, "0B": 4}  # dense: one a sublayer each way (10 backward before)
    assert tp_collectives("mixtral") == {"0F": 4, "0B": 6}
    assert tp_collectives("qwen-moe") == {"0F": 4, "0B": 8}
    assert tp_collectives("mixtral-sp") == {"0F": 9, "0B": 15}
