"""Multi-head latent attention (MLA, DeepSeek-V2 section 2.1) in plain torch.

Keys and values come out of one low-rank latent per token (``kv_lora_rank``, RMS-
normalised) and one rotary key shared by every head; queries pass through a latent of
their own (``q_lora_rank``) or straight from the hidden state (V2-Lite). A head's query
and key are ``qk_nope + qk_rope`` wide (the position-free part from the latent, the
rotary part), its value ``v_head_dim``. The widths are those ``pipesim.model`` counts
(``pipesim.model.latent_attention``), so the executor trains the model the simulator
prices. Inference's trick of absorbing the up-projections into the query is a serving
optimisation, not a different model: training computes keys and values in full, as here.
"""

from __future__ import annotations

import torch
from torch import nn

from executor.architectures.layers import (
    PLAIN_ROPE,
    RMSNorm,
    apply_rotary,
    attend,
    attend_keeping_inputs,
    rotary_angles,
)
from executor.rebuilt_activations import drop_until_backward
from pipesim.model.latent_attention import LatentAttention as LatentSizes
from pipesim.model.rotary import Rope


class LatentAttention(nn.Module):
    """Causal self-attention of ``heads`` heads through the latents ``sizes`` describes."""

    def __init__(self, hidden: int, heads: int, sizes: LatentSizes, bias: bool = False,
                 rope: Rope = PLAIN_ROPE) -> None:
        super().__init__()
        self.sizes, self.rope = sizes, rope
        qk = sizes.qk_head_dim
        if sizes.q_lora_rank:
            self.wq_a = nn.Linear(hidden, sizes.q_lora_rank, bias=bias)
            self.q_norm = RMSNorm(sizes.q_lora_rank)
            self.wq_b = nn.Linear(sizes.q_lora_rank, heads * qk, bias=bias)
        else:
            self.wq = nn.Linear(hidden, heads * qk, bias=bias)
        self.wkv_a = nn.Linear(hidden, sizes.kv_lora_rank + sizes.qk_rope_head_dim, bias=bias)
        self.kv_norm = RMSNorm(sizes.kv_lora_rank)
        self.wkv_b = nn.Linear(sizes.kv_lora_rank, heads * (sizes.qk_nope_head_dim + sizes.v_head_dim), bias=bias)
        self.wo = nn.Linear(heads * sizes.v_head_dim, hidden, bias=bias)
        self.context = None  # context parallelism: this rank's share of the sequence (executor.context_parallel)
        self.recompute_up = False  # --recompute norm-mla-up: Q, K and V rebuilt from the latents for the backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sizes = self.sizes
        seq, rope = x.shape[1], sizes.qk_rope_head_dim
        query_in = self.wq_a(x) if sizes.q_lora_rank else x
        latent, k_rope = self.wkv_a(x).split([sizes.kv_lora_rank, rope], dim=-1)
        if self.context is not None:  # this rank's tokens, rotated at their true positions
            cos, sin = self.context.rotary(rope, x.dtype, x.device, self.rope)
        else:
            cos, sin = rotary_angles(seq, rope, self.rope, dtype=x.dtype, device=x.device)
        if not self.recompute_up:
            q, k, v, _ = self.up_projected(query_in, latent, k_rope, cos, sin)
            return self.wo(self.core(q, k, v))
        q, k, v, made = self.up_projected(query_in, latent, k_rope, cos, sin, own_values=True)
        out = self.core(q, k, v, inputs_kept=True)
        drop_until_backward((out,), made, lambda: self.up_projected(query_in, latent, k_rope, cos, sin, True)[3],
                            "latent attention's up-projections")
        return self.wo(out)

    def up_projected(self, query_in: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, own_values: bool = False,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """Q, K and V from the query latent (or, without one, the layer's input), the key-value
        latent and the rotary key; and the tensors made on the way that a backward reads
        (the latents' norm outputs, which the up-projections keep, Q, K and V; the
        rotation keeps only its cos and sin): what ``--recompute norm-mla-up`` drops and
        rebuilds.
        ``own_values``: V in a storage of its own, not a view of the joint K-nope/V
        up-projection (which a microbatch of several sequences copies in the attention's
        matmul anyway), so that dropping it frees it."""
        sizes = self.sizes
        batch, seq = latent.shape[:2]
        nope, rope = sizes.qk_nope_head_dim, sizes.qk_rope_head_dim
        if sizes.q_lora_rank:
            query_normed = self.q_norm(query_in)
            query_up = self.wq_b(query_normed)
            made: tuple[torch.Tensor, ...] = (query_normed,)
        else:  # no query latent (V2-Lite): the query projection reads the layer's input
            query_up = self.wq(query_in)
            made = ()
        q = query_up.view(batch, seq, -1, nope + rope).transpose(1, 2)
        latent_normed = self.kv_norm(latent)
        kv_up = self.wkv_b(latent_normed)
        k_nope, v = kv_up.view(batch, seq, -1, nope + sizes.v_head_dim).transpose(1, 2).split(
            [nope, sizes.v_head_dim], dim=-1)
        q_nope, q_rope = q.split([nope, rope], dim=-1)
        k_rope = apply_rotary(k_rope.unsqueeze(1), cos, sin).expand(-1, q.shape[1], -1, -1)
        q = torch.cat((q_nope, apply_rotary(q_rope, cos, sin)), dim=-1)
        if self.rope.latent_softmax_scale != 1.0:  # DeepSeek's YaRN: the softmax scale times mscale^2
            q = q * self.rope.latent_softmax_scale
        k = torch.cat((k_nope, k_rope), dim=-1)
        if own_values:
            v = v.contiguous()
        return q, k, v, (*made, latent_normed, v, q, k)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs_kept: bool = False) -> torch.Tensor:
        """The attention core; ``inputs_kept``: one whose backward reads Q, K and V
        themselves (so dropping them frees them), not copies."""
        if self.context is not None:
            return self.context.attend_rotated(q, k, v)
        if inputs_kept and not q.is_cuda:  # CUDA's kernels keep their inputs; CPU's math path scaled copies
            return attend_keeping_inputs(q, k, v)
        return attend(q, k, v)
