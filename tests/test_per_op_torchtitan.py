"""``--recompute per-op`` held to torchtitan's own SelectiveAC: torchtitan 0.3's Llama 3
block under its per-op policy (``tests/torchtitan_per_op_policy.py``, in the cached
torchtitan environment of ``tests/test_torchtitan_release.py``) saves the products pipesim
says it saves, and nothing else of theirs. Deselect with ``-m "not torchtitan"``."""

from __future__ import annotations

import json

import pytest

from pipesim.model.per_op_checkpoint import recomputed_matrices, stash_bytes_per_token
from pipesim.model.spec import ModelSpec
from pipesim.model.weights import layer_weights
from tests.test_torchtitan_release import launch, torchtitan_python  # noqa: F401  (the environment's fixture)

pytestmark = [pytest.mark.torchtitan, pytest.mark.timeout(1500)]

# the block the script builds: hidden 64, 4 heads, 2 key-value heads, SwiGLU of 128, no biases
SPEC = ModelSpec("titan-block", layers=1, hidden=64, heads=4, seq_len=16, vocab=100, kv_heads=2, ffn_hidden=128,
                 gated_mlp=True, tied_embeddings=False, learned_positions=False, bias=False, rms_norm=True,
                 dropout=False)


@pytest.fixture(scope="module")
def decisions(torchtitan_python) -> dict:  # noqa: F811
    done = launch("tests/torchtitan_per_op_policy.py", python=torchtitan_python, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_separate_projections_save_what_pipesim_says(decisions):
    separate = decisions["separate"]
    recomputed = recomputed_matrices(SPEC)
    assert separate["products_saved"] == [weight.name not in recomputed for weight in layer_weights(SPEC, False)]
    # of pipesim's inventory, what the products' outputs are: all but the block input and the
    # attention output (the checkpoint keeps the one, a GPU's fused kernel saves the other)
    products = stash_bytes_per_token(SPEC) / SPEC.dtype_bytes - SPEC.hidden - SPEC.v_width
    assert separate["saved_elements_per_token"] == products


def test_torchtitan_03s_fused_qkv_keeps_k_too(decisions):
    # torchtitan 0.3's Llama 3 configs fuse Q, K and V into one wqkv: five products, of which
    # wqkv, w1 and w2 are saved (the output projection and w3 recomputed), so K's output is
    # kept as well and K's GEMM not re-run: pipesim models the separate projections (the
    # published per-op SAC runs and the executor), and docs/cluster-model.md says by how much
    fused, separate = decisions["fused"], decisions["separate"]
    assert fused["products_saved"] == [True, False, True, False, True]
    assert fused["saved_elements_per_token"] - separate["saved_elements_per_token"] == SPEC.kv_width
