"""Context parallelism executed (``run --cp``): each sequence cut into ``2 cp`` chunks,
rank ``r`` holding chunks ``r`` and ``2 cp - 1 - r``, attention over the whole sequence
by all-gathering keys and values or by ring attention (``--cp-comm p2p``). A shrunk
Llama 3, Mixtral and DeepSeek-V3 (latent attention), the toy gpt and GPT-3's
architecture (learned positions, each rank embedding its tokens' true ones) in float64 on
gloo: every
step's loss and every gradient of the first step equal the one-process reference to
1e-10; the layout is the load-balanced one, and bad values are refused in one line.
"""

from __future__ import annotations

import pytest
import torch

from executor.config import ConfigError, RunConfig
from executor.context_parallel import ContextShard, chunk_positions, local_shape
from executor.mesh import MeshPosition
from executor.reference import reference_run
from pipesim.cli import main
from tests.launched_cases import LaunchedCases, assert_equals_reference

pytestmark = pytest.mark.timeout(300)

SMALL = {"model": "llama3-8b", "hidden": 16, "heads": 4, "kv_heads": 2, "layers": 2, "seq_len": 8, "vocab": 37,
         "batch_size": 4, "steps": 2, "dtype": "float64", "optimizer": "adamw", "lr": 0.02, "return_grads": True,
         "schedule": "1f1b", "microbatches": 2,
         "cp_comm": "all-gather"}  # Llama 3's gather; the cases named -ring take run's default, the ring
MLA = {"model": "deepseek-v3", "kv_heads": None, "experts": 4}  # latent attention, MoE
CASES_OF_WORLD = {
    2: {
        "llama-pp1-cp2": {"pp": 1, "cp": 2},
        # ep cut from the cp ranks: the two halves of a sequence trade tokens with each other
        "mixtral-pp1-cp2-ep2": {"model": "mixtral-8x7b", "experts": 4, "pp": 1, "cp": 2, "ep": 2},
        # ring attention (--cp-comm p2p): GQA (2 key/value heads for 4 query heads), and MLA
        # (every head's key and value, values narrower) ringed and all-gathered
        "llama-pp1-cp2-ring": {"pp": 1, "cp": 2, "cp_comm": "p2p"},
        "deepseek-pp1-cp2-ring": {**MLA, "pp": 1, "cp": 2, "cp_comm": "p2p"},
        "deepseek-pp1-cp2": {**MLA, "pp": 1, "cp": 2},
        # full recompute runs the ring's forward again inside the backward, on every cp rank
        "llama-pp1-cp2-ring-recompute": {"pp": 1, "cp": 2, "cp_comm": "p2p", "recompute": "full"},
        # learned positions: each rank embeds its tokens' true positions (the toy gpt, whose
        # attention is its own, and GPT-3's architecture)
        "gpt-pp1-cp2": {"model": "gpt", "kv_heads": None, "pp": 1, "cp": 2},
        "gpt-pp1-cp2-ring": {"model": "gpt", "kv_heads": None, "pp": 1, "cp": 2, "cp_comm": "p2p"},
        "gpt3-pp1-cp2-ring": {"model": "gpt3-1.3b", "kv_heads": None, "pp": 1, "cp": 2, "cp_comm": "p2p"},
    },
    4: {
        "llama-pp2-cp2": {"pp": 2, "cp": 2},
        "llama-pp1-dp2-cp2": {"pp": 1, "dp": 2, "cp": 2},  # gradients reduced over dp x cp
        "llama-pp1-cp4": {"pp": 1, "cp": 4},  # 8 chunks of one token
        # the gather's backward inside zero-bubble's input-gradient pass; a dropless MoE
        # tp splits the heads; each tp shard gathers its own heads' keys and values over cp
        "llama-pp1-cp2-tp2": {"pp": 1, "cp": 2, "tp": 2},
        "llama-pp1-cp2-tp2-sp": {"pp": 1, "cp": 2, "tp": 2, "sequence_parallel": True},
        "mixtral-pp1-dp2-cp2-ep4": {"model": "mixtral-8x7b", "experts": 4, "pp": 1, "dp": 2, "cp": 2, "ep": 4},
        "mixtral-pp2-cp2-zb-h1": {"model": "mixtral-8x7b", "experts": 4, "pp": 2, "cp": 2, "schedule": "zb-h1",
                                  "microbatches": 4},
        # the ring's middle steps (keys, values and their gradients in one message) only exist from cp 3
        "llama-pp1-cp4-ring": {"pp": 1, "cp": 4, "cp_comm": "p2p"},
        "gpt-pp2-cp2-ring": {"model": "gpt", "kv_heads": None, "pp": 2, "cp": 2, "cp_comm": "p2p"},
        "gpt-pp1-cp2-tp2-sp": {"model": "gpt", "kv_heads": None, "pp": 1, "cp": 2, "tp": 2,
                               "sequence_parallel": True},
        # the ring's backward inside zero-bubble's input-gradient pass, between pipeline stages
        "mixtral-pp2-cp2-zb-h1-ring": {"model": "mixtral-8x7b", "experts": 4, "pp": 2, "cp": 2, "schedule": "zb-h1",
                                       "microbatches": 4, "cp_comm": "p2p"},
    },
}
LAUNCHED = LaunchedCases(SMALL, CASES_OF_WORLD)
CASES = LAUNCHED.cases
case_config = LAUNCHED.config


@pytest.mark.parametrize("name", CASES)
def test_context_parallel_step_equals_one_process_reference(name: str) -> None:
    assert_equals_reference(LAUNCHED.result(name), reference_run(case_config(name)))


@pytest.mark.parametrize(("name", "comm"), [("llama-pp1-cp2", "all-gather"), ("llama-pp1-cp2-ring", "p2p")])
def test_the_summary_says_how_keys_and_values_were_exchanged(name: str, comm: str) -> None:
    from executor.report import summary, summary_lines  # noqa: PLC0415

    document = summary(LAUNCHED.result(name))
    assert document["cp_comm"] == comm
    assert f" cp=2 cp-comm={comm} (world 2)" in summary_lines(LAUNCHED.result(name), document)[0]


def test_chunks_are_load_balanced() -> None:
    """seq 8, cp 2: chunks of 2; rank 0 the first and last, rank 1 the middle two."""
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert chunk_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    # every rank has the same causal work: the sum over its queries of the keys they see
    work = [sum(p + 1 for p in chunk_positions(16, 4, rank).tolist()) for rank in range(4)]
    assert work == [34, 34, 34, 34]


def test_each_query_sees_the_gathered_keys_at_or_before_it() -> None:
    shard = ContextShard(None, 2, 0, 8)
    # rank 0's rows are positions 0,1,6,7 and rank 1's 2,3,4,5, gathered in rank order
    assert shard.gathered_positions.tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    mask = shard.mask(torch.device("cpu")).int().tolist()
    assert mask[0] == [1, 0, 0, 0, 0, 0, 0, 0]  # position 0: itself only
    assert mask[2] == [1, 1, 1, 0, 1, 1, 1, 1]  # position 6: all but 7
    assert shard.local(torch.arange(16).view(2, 8)).tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert local_shape((3, 8, 16), 2) == (3, 4, 16)


def test_ranks_are_numbered_tp_cp_dp_pp() -> None:
    """dp 2, pp 2, tp 2, cp 2 (16 ranks): tp innermost, then cp, dp, pp, as the
    simulator's tp-cp-ep-dp-pp order numbers devices."""
    position = MeshPosition.of_rank(13, dp=2, pp=2, tp=2, cp=2)  # 13 = 8 + 4 + 0 + 1
    assert (position.pp_index, position.dp_index, position.cp_index, position.tp_index) == (1, 1, 0, 1)
    assert position.global_rank(0) == 5
    assert MeshPosition.of_rank(5, dp=2, pp=1, tp=1, cp=3).cp_index == 2


@pytest.mark.parametrize(("changes", "expected"), [
    ({"cp": 3}, "--cp 3 cuts each sequence into 6 equal chunks: --seq-len 8 must be a multiple of 6"),
    ({"cp": 2, "model": "mlp", "kv_heads": None}, "--cp 2 splits each sequence of a transformer; --model mlp has "
                                                  "no sequence"),
    ({"cp": 2, "tp": 4, "heads": 4, "kv_heads": 4, "sequence_parallel": True, "seq_len": 12},
     "--tp 4 must divide each cp rank's 6 tokens"),
    ({"cp": 2, "cp_comm": "ring"}, "--cp-comm 'ring' is not one of: all-gather, p2p"),
    ({"cp": 2, "model": "mixtral-8x7b", "experts": 4, "capacity_factor": 1.0}, "--cp 2 with --capacity-factor"),
    ({"cp": 0}, "--cp must be at least 1, got 0"),
])
def test_bad_context_parallel_is_refused(changes: dict, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        RunConfig(**{**SMALL, "pp": 1, **changes}).check()


def test_run_refuses_cp_in_one_line(capsys) -> None:
    status = main(["run", "--model", "llama3-8b", "--cp", "2", "--seq-len", "6", "--microbatches", "2"])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert len(err.splitlines()) == 1 and "--seq-len 6 must be a multiple of 4" in err


def test_profile_refuses_cp_in_one_line(capsys, tmp_path) -> None:
    status = main(["profile", "--model", "llama3-8b", "--pp", "2", "--cp", "2", "--microbatches", "2",
                   "--out", str(tmp_path / "costs.json")])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert len(err.splitlines()) == 1 and "--cp 2" in err and "profile measures whole pipeline stages" in err
