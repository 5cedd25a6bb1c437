"""Multi-head latent attention (MLA, DeepSeek-V2 and V3): keys and values, and
optionally queries, pass through a low-rank latent.

Per layer, hidden h, heads a, with the configs' names (DeepSeek-V2 paper, section 2.1):

    queries   h -> q_lora_rank (RMSNorm) -> a * (qk_nope_head_dim + qk_rope_head_dim)
              or, with q_lora_rank null (V2-Lite), h -> a * (qk_nope + qk_rope) directly
    keys, values
              h -> kv_lora_rank + qk_rope_head_dim   (the latent and one shared rotary key)
              kv_lora_rank (RMSNorm) -> a * (qk_nope_head_dim + v_head_dim)
    output    a * v_head_dim -> h

so a head's query and key are ``qk_nope + qk_rope`` wide and its value ``v_head_dim``;
the attention core costs ``2 s a (qk + v)`` FLOPs per token (QK^T and PV, counted whole).
Under tensor parallelism the up-projections and the output projection are split by heads
and the down-projections to the latents are held whole on every rank (Megatron-LM's
MLA), which is what ``pipesim.model.weights`` counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipesim.model.errors import require_count


@dataclass(frozen=True)
class LatentAttention:
    """The low-rank projections of multi-head latent attention."""

    q_lora_rank: int | None  # None: queries projected directly from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            require_count(getattr(self, key), f"latent attention: {key}")
        if self.q_lora_rank is not None:
            require_count(self.q_lora_rank, "latent attention: q_lora_rank (or null)")

    @property
    def qk_head_dim(self) -> int:
        """Width of one head's query and key: the position-free part plus the rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim
