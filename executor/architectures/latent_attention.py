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

from executor.architectures.layers import RMSNorm, apply_rotary, attend, rotary_angles
from pipesim.model.latent_attention import LatentAttention as LatentSizes


class LatentAttention(nn.Module):
    """Causal self-attention of ``heads`` heads through the latents ``sizes`` describes."""

    def __init__(self, hidden: int, heads: int, sizes: LatentSizes, bias: bool = False) -> None:
        super().__init__()
        self.sizes = sizes
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

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        return self.wq_b(self.q_norm(self.wq_a(x))) if self.sizes.q_lora_rank else self.wq(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sizes = self.sizes
        batch, seq, _ = x.shape
        nope, rope = sizes.qk_nope_head_dim, sizes.qk_rope_head_dim
        q = self.queries(x).view(batch, seq, -1, nope + rope).transpose(1, 2)
        latent, k_rope = self.wkv_a(x).split([sizes.kv_lora_rank, rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(batch, seq, -1, nope + sizes.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([nope, sizes.v_head_dim], dim=-1)
        if self.context is not None:  # this rank's tokens, rotated at their true positions
            cos, sin = self.context.rotary(rope, x.dtype, x.device)
        else:
            cos, sin = rotary_angles(seq, rope, dtype=x.dtype, device=x.device)
        q_nope, q_rope = q.split([nope, rope], dim=-1)
        k_rope = apply_rotary(k_rope.unsqueeze(1), cos, sin).expand(-1, q.shape[1], -1, -1)
        q = torch.cat((q_nope, apply_rotary(q_rope, cos, sin)), dim=-1)
        k = torch.cat((k_nope, k_rope), dim=-1)
        if self.context is not None:
            return self.wo(self.context.attend_rotated(q, k, v))
        return self.wo(attend(q, k, v))
