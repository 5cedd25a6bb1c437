"""A mixture of experts' memory under expert parallelism, as the executor keeps it:
what the dispatch keeps per routed copy and the rank's own experts' weight copies
(``pipesim.model.saved_tensors``), by hand; and the prediction beside a run taken at
the run's own routing (``pipesim.cli.run_memory.routed_stash_scales``), by hand on a
made-up table of routed rows."""

from __future__ import annotations

import numpy as np
import pytest

from executor.config import RunConfig
from pipesim.cli.run_memory import (
    executor_spec,
    peak_predictor,
    pipeline_rank,
    routed_peaks,
    routed_share,
    routed_stash_scales,
)
from pipesim.model.activations import layer_stash_bytes

# a shrunk Mixtral: hidden 64, 4 experts (top-2) of width 224, one sequence of 32 tokens a microbatch
MIXTRAL = {"model": "mixtral-8x7b", "layers": 4, "hidden": 64, "heads": 8, "kv_heads": 2, "seq_len": 32,
           "vocab": 128, "batch_size": 8, "microbatches": 4, "pp": 2, "dp": 2, "experts": 4, "steps": 2}
TOKENS, COPIES, HIDDEN, EXPERT_FFN = 32, 2, 64, 224


def stash_at(dtype: str, ep: int) -> float:
    spec, saved = executor_spec(RunConfig(**MIXTRAL, dtype=dtype, ep=ep))
    assert (spec.tokens, spec.hidden, spec.moe.expert_ffn) == (TOKENS, HIDDEN, EXPERT_FFN)
    return layer_stash_bytes(spec, saved=saved, layer=0, ep=ep)


def test_expert_parallelism_keeps_the_dispatchs_tensors_in_float32() -> None:
    """Per routed copy the expert rank's ``index_copy`` keeps its float32 source (4h) and
    the row's int64 index (8): 4h + 8 bytes more than running every expert in-process."""
    assert stash_at("float32", 2) - stash_at("float32", 1) == TOKENS * COPIES * (4 * HIDDEN + 8)


def test_expert_parallelism_under_autocast_keeps_its_own_experts_weight_copies() -> None:
    """Under bf16 autocast also the combine's float32 product of the returned rows (4h
    where in-process the bf16 expert output, 2h, is kept): 6h + 8 a copy; and each linear
    keeps its weight's bf16 cast, of the 2 experts the rank holds, not the 4 of the layer:
    two experts' gate, up and down (3 matrices of 64 x 224) fewer."""
    per_copy = TOKENS * COPIES * (6 * HIDDEN + 8)
    weight_copies = 2 * 3 * HIDDEN * EXPERT_FFN * 2
    assert stash_at("bfloat16", 2) - stash_at("bfloat16", 1) == per_copy - weight_copies


# a shrunk Qwen3-30B-A3B folded over tp 2 (--etp 1) with sequence parallelism: hidden 64, 8 experts (top 4)
# of width 24, two sequences of 32 tokens a microbatch, each tp rank routing its own 32 tokens
QWEN3_FOLDED = {"model": "qwen3-30b-a3b", "layers": 4, "hidden": 64, "heads": 8, "kv_heads": 2, "seq_len": 32,
                "vocab": 128, "batch_size": 8, "microbatches": 4, "pp": 2, "tp": 2, "sequence_parallel": True,
                "etp": 1, "experts": 8, "steps": 2, "dtype": "bfloat16"}


def test_folded_expert_parallelism_keeps_the_dispatchs_rows_in_16_bits() -> None:
    """Where sequence parallelism casts the shard to bf16 before its gather, the tokens the
    dispatch sends are bf16, so the expert outputs ``index_copy`` keeps are too (2h, not
    4h); the combine's float32 product (4h where in-process the bf16 output, 2h) and the
    index (8) as before: 4h + 8 a copy, on each rank's 32 tokens x 4 picks; and 4 experts'
    weight casts fewer (gate, up and down, 3 matrices of 64 x 24)."""
    def stash(ep: int) -> float:
        spec, saved = executor_spec(RunConfig(**QWEN3_FOLDED, ep=ep))
        assert (spec.tokens, spec.hidden, spec.moe.expert_ffn, spec.moe.experts_per_token) == (64, 64, 24, 4)
        return layer_stash_bytes(spec, tp=2, sequence_parallel=True, saved=saved, layer=0, ep=ep)

    per_copy = 32 * 4 * (4 * 64 + 8)
    weight_copies = 4 * 3 * 64 * 24 * 2
    assert stash(2) - stash(1) == per_copy - weight_copies


def routed_table(config: RunConfig, rows: dict[tuple[int, int, int], float], even: float = 20.0) -> list:
    """Routed rows ``[rank][stage][microbatch]``: ``even`` on every stage a rank holds,
    ``rows`` where given."""
    table = np.zeros((config.world_size, config.num_stages, config.microbatches))
    for rank in range(config.world_size):
        table[rank, pipeline_rank(config, rank)] = even  # pp 2, one stage a rank: stage = pipeline rank
    for (rank, stage, microbatch), value in rows.items():
        table[rank, stage, microbatch] = value
    return table.tolist()


def test_each_rank_is_scaled_by_its_rows_over_the_mean_of_the_stage() -> None:
    config = RunConfig(**MIXTRAL, ep=2)
    first, other = [rank for rank in range(config.world_size) if pipeline_rank(config, rank) == 0]
    table = routed_table(config, {(first, 0, 0): 30.0, (other, 0, 0): 10.0})
    scales, most = routed_stash_scales(config, table)
    share = routed_share(config)
    assert 0 < share[0] < 1
    stages, microbatches = np.array([0, 0]), np.array([0, 1])
    # the stage's mean at microbatch 0 is 20: 30 is 1.5 times it, 10 half; microbatch 1 as balanced
    np.testing.assert_allclose(scales[first](stages, microbatches), [1 + 0.5 * share[0], 1.0])
    np.testing.assert_allclose(scales[other](stages, microbatches), [1 - 0.5 * share[0], 1.0])
    assert most == pytest.approx(1.5)


def test_a_capacity_or_a_run_without_counts_is_predicted_balanced() -> None:
    table = routed_table(RunConfig(**MIXTRAL, ep=2), {})
    rows = [{"rank": rank, "routed_rows": table[rank]} for rank in range(4)]
    capacity, config = RunConfig(**MIXTRAL, ep=2, capacity_factor=1.0), RunConfig(**MIXTRAL, ep=2)
    assert routed_peaks(capacity, rows, peak_predictor(capacity)) is None
    assert routed_peaks(config, [{"rank": rank} for rank in range(4)], peak_predictor(config)) is None
    balanced, most = routed_peaks(config, rows, peak_predictor(config))
    assert most == 1.0  # every rank at the mean: the balanced prediction itself
    from pipesim.cli.run_memory import predicted_peaks

    expected = predicted_peaks(RunConfig(**MIXTRAL, ep=2))
    for rank, peak in enumerate(balanced):
        assert peak["predicted_peak"] == pytest.approx(expected[pipeline_rank(RunConfig(**MIXTRAL, ep=2), rank)]
                                                       ["predicted_peak"])
