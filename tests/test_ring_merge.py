"""Ring attention's merges (Transformer Engine's ``AttnFuncWithCPAndKVP2P``): the bytes
counted by hand from its passes, on a grouped-query and a latent-attention model; only
under the ring (``--cp-comm p2p``) and only at cp >= 2; the exchange carried from the
flag to the spec; a bad value refused by name."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipesim.cli import build_parser
from pipesim.job import Job, model_spec_of
from pipesim.model.errors import ModelSpecError
from pipesim.model.operations import layer_operations
from pipesim.model.ring_merge import ring_merge_bytes
from pipesim.model.spec import PRESETS


def merges(spec, tp: int = 1, cp: int = 2):
    return [op for op in layer_operations(spec, tp, cp=cp) if op.name == "ring_merge"]


def test_the_passes_by_hand() -> None:
    """Q = O = 100, KV = 40 bytes a token. Forward: the send buffer 2 KV, the first
    output 2 O, each later step 3 O. Backward: the ring buffer 2 KV, the query gradient
    2 Q + 3 Q a later step, the key-value gradient 2 KV + 1.5 KV a later step."""
    assert ring_merge_bytes(1, 100, 100, 40) == (0.0, 0.0)
    assert ring_merge_bytes(2, 100, 100, 40) == (80 + 200 + 300, 80 + 500 + 140)
    assert ring_merge_bytes(4, 100, 100, 40) == (80 + 200 + 900, 80 + 200 + 900 + 80 + 180)


def test_llama3_8b_at_cp_2_by_hand() -> None:
    """8,192 tokens over cp 2: 4,096 a rank. BF16 queries and output 32 x 128 x 2 = 8,192
    bytes a token, keys and values 2 x 8 x 128 x 2 = 4,096. Forward 2 x 4,096 + 2 x 8,192 +
    3 x 8,192 = 49,152 bytes a token; backward 2 x 4,096 + 5 x 8,192 + 3.5 x 4,096 = 63,488."""
    spec = replace(PRESETS["llama3-8b"], seq_len=8192, microbatch_size=1)
    (merge,) = merges(spec)
    assert merge.bytes == 49_152 * 4096 and merge.backward_bytes == 63_488 * 4096
    assert merge.attention_core  # re-run with the attention core under selective recompute
    assert merges(spec, cp=1) == []
    assert merges(replace(spec, cp_comm="all-gather")) == []


def test_tensor_parallel_shards_the_heads() -> None:
    """tp 8 on Llama 3 8B: 4 query heads and one key-value head a rank, an eighth of tp
    1's bytes (4 x 128 x 2 = 1,024 a token of Q and of O, 2 x 128 x 2 = 512 of K and V):
    forward 2 x 512 + 5 x 1,024."""
    spec = replace(PRESETS["llama3-8b"], seq_len=8192, microbatch_size=1)
    (merge,) = merges(spec, tp=8)
    assert merge.bytes == (2 * 512 + 5 * 1024) * 4096


def test_latent_attention_counts_the_up_projected_heads() -> None:
    """DeepSeek-V2-Lite: 16 heads, keys 192 wide (128 + 64 rotary), values 128; at cp 2 of
    4,096 tokens, 2,048 a rank: Q 16 x 192 x 2 = 6,144 bytes a token, O 16 x 128 x 2 =
    4,096, K and V 16 x 320 x 2 = 10,240. Forward 2 x 10,240 + 5 x 4,096 = 40,960; backward
    2 x 10,240 + 5 x 6,144 + 3.5 x 10,240 = 87,040."""
    spec = replace(PRESETS["deepseek-v2-lite"], seq_len=4096, microbatch_size=1)
    (merge,) = merges(spec)
    assert merge.bytes == 40_960 * 2048 and merge.backward_bytes == 87_040 * 2048


def test_the_flag_reaches_the_spec_and_a_bad_value_is_refused() -> None:
    argv = ["simulate", "--model", "llama3-8b", "--pp", "2", "--cp", "2"]
    job = Job.from_namespace(build_parser("simulate").parse_args(argv))
    assert model_spec_of(job).cp_comm == "p2p"
    job = Job.from_namespace(build_parser("simulate").parse_args([*argv, "--cp-comm", "all-gather"]))
    assert model_spec_of(job).cp_comm == "all-gather"
    with pytest.raises(ModelSpecError, match="context-parallel exchange 'ring' is not one of p2p, all-gather"):
        replace(PRESETS["llama3-8b"], cp_comm="ring")
