"""Run in a Python with torchtitan (``tests/test_per_op_torchtitan.py`` starts it): one of
torchtitan's own Llama 3 blocks (``_build_llama3_layers``: hidden 64, 4 heads, 2 key-value
heads, SwiGLU of 128, float32) wrapped by torchtitan's ``SelectiveAC`` (per-op), run
forward and backward on 16 tokens, with every decision of the policy recorded: for each
matrix product in forward order whether it is saved, and the elements of every output the
policy saves. Once with separate Q, K and V projections, once with torchtitan 0.3's fused
``wqkv``.

    python tests/torchtitan_per_op_policy.py > decisions.json

On CPU the attention runs as torch's SDPA (FlexAttention, torchtitan 0.3's language-model
default, has no CPU backward), whose CPU kernel is not in the save list: the attention
output, which a GPU's fused kernel saves, is not among the recorded outputs.
"""

from __future__ import annotations

import json

HIDDEN, HEADS, KV_HEADS, FFN, TOKENS = 64, 4, 2, 128, 16


def decisions(fuse_qkv: bool) -> dict:
    """The policy's decisions on the block's matrix products and what it saved, per token."""
    import torch
    import torch.utils.checkpoint as checkpoint
    from torchtitan.distributed import activation_checkpoint
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.llama3 import _build_llama3_layers

    layer = _build_llama3_layers(n_layers=1, dim=HIDDEN, n_heads=HEADS, hidden_dim=FFN, n_kv_heads=KV_HEADS,
                                 rope=ComplexRoPE.Config(dim=HIDDEN // HEADS, max_seq_len=TOKENS, theta=500000),
                                 fuse_qkv=fuse_qkv, attn_backend="flex")[0]
    block = layer.build()

    class CpuAttention(torch.nn.Module):
        """torch's SDPA in place of FlexAttention, which has no backward on CPU."""

        def forward(self, query, key, value, attention_masks=None, scale=None, enable_gqa=False, **_):
            out = torch.nn.functional.scaled_dot_product_attention(
                query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), is_causal=True, scale=scale,
                enable_gqa=enable_gqa)
            return out.transpose(1, 2)

    block.attention.inner_attention = CpuAttention()
    products, saved = [], []
    contexts = checkpoint.create_selective_checkpoint_contexts

    def recording(policy, *args, **kwargs):
        def recorded(context, func, *op_args, **op_kwargs):
            decision = policy(context, func, *op_args, **op_kwargs)
            if not context.is_recompute:
                keep = decision == checkpoint.CheckpointPolicy.MUST_SAVE
                if func == torch.ops.aten.mm.default:
                    products.append(keep)
                if keep:
                    outputs = context.op_output if isinstance(context.op_output, (tuple, list)) \
                        else (context.op_output,)
                    saved.extend(t.numel() for t in outputs if isinstance(t, torch.Tensor))
            return decision
        return contexts(recorded, *args, **kwargs)

    activation_checkpoint.create_selective_checkpoint_contexts = recording
    try:
        wrapped = activation_checkpoint.SelectiveAC(activation_checkpoint.SelectiveAC.Config())._wrap_block(block)
        x = torch.randn(1, TOKENS, HIDDEN, requires_grad=True)
        wrapped(x, None, torch.arange(TOKENS).unsqueeze(0)).sum().backward()
    finally:
        activation_checkpoint.create_selective_checkpoint_contexts = contexts
    return {"products_saved": products, "saved_elements_per_token": sum(saved) / TOKENS}


if __name__ == "__main__":
    print(json.dumps({"separate": decisions(False), "fused": decisions(True)}))
