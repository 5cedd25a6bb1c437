"""``--recompute per-op`` held to torchtitan's own SelectiveAC: torchtitan 0.3's Llama 3
block under its per-op policy (``tests/torchtitan_per_op_policy.py``, in the cached
torchtitan environment of ``tests/test_torchtitan_release.py``) saves the products pipesim
says it saves, and nothing else of theirs, with separate Q, K and V projections and with
torchtitan 0.3's own fused ``wqkv`` (``--qkv fused``). Deselect with ``-m "not torchtitan"``."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipesim.model.per_op_checkpoint import forward_products, recomputed_matrices, stash_bytes_per_token
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


def test_fused_wqkv_saves_what_pipesim_says(decisions):
    # torchtitan 0.3's Llama 3 configs fuse Q, K and V into one wqkv: five products, of which
    # wqkv, w1 and w2 are saved (the output projection and w3 re-run), so K's output is kept
    # too and K's GEMM not re-run; pipesim's --qkv fused counts the same products
    fused, spec = decisions["fused"], replace(SPEC, fused_qkv=True)
    recomputed = recomputed_matrices(spec)
    assert fused["products_saved"] == [not {weight.name for weight in product} & recomputed
                                       for product in forward_products(spec)]
    assert fused["products_saved"] == [True, False, True, False, True]  # torchtitan's rule, by hand
    products = stash_bytes_per_token(spec) / spec.dtype_bytes - spec.hidden - spec.v_width
    assert fused["saved_elements_per_token"] == products == 320  # Q 64, K 32, V 32, w1 128, w2 64
    assert decisions["separate"]["saved_elements_per_token"] == 288  # Q 64, V 32, w1 128, w2 64
