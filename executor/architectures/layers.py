"""The parts of a Llama-style decoder in plain torch: RMSNorm, rotary positions,
grouped-query attention (with the query and key norms, sliding windows, chunks and
attention sinks the spec names), the SwiGLU (or GeLU) MLP.

As in torchtitan, a part never knows how it is parallelised: tensor parallelism splits
its linear layers from outside (``executor.tensor_parallel``), so every count of heads
is read from the (possibly split) projection's output, never from the config.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch spelling
from torch import nn

from pipesim.model.rotary import Rope

PLAIN_ROPE = Rope()  # base 10000, unscaled: Llama 1/2's, and the toys'


def l2_norm(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dimension, no weight: Llama 4's query
    and key norm (Hugging Face's ``Llama4TextL2Norm``, at its configs' ``rms_norm_eps``)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension (Zhang and Sennrich
    2019): no mean subtracted, no bias; ``offset``: times ``1 + weight`` (Gemma)."""

    # Tensor parallelism: how the weight enters the product where this rank normalises only
    # its own heads (a query or key norm), so its gradient is a share to sum over tp
    # (executor.tensor_parallel.sum_weight_grad_over_tp); None: the weight as it is.
    weight_in_use: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, dim: int, eps: float = 1e-6, offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        # Gemma's: the scale is 1 + weight, the weight starting at zero (weight decay pulls it to 1)
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.weight_in_use is None else self.weight_in_use(self.weight)
        if self.offset:
            weight = 1 + weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight


def rotary_angles(seq_len: int, dim: int, rope: Rope = PLAIN_ROPE, dtype: torch.dtype | None = None,
                  device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of the angle ``p * f_i`` for position ``p`` and feature pair
    ``i`` (RoFormer, Su et al. 2021; ``f_i = theta^(-2i/dim)``, rescaled as ``rope`` says:
    ``pipesim.model.rotary``), each ``seq_len x dim/2`` and times YaRN's attention factor
    where ``rope`` has one, in ``dtype`` (default: torch's default type); computed in
    float64 whatever the type, so a bf16 run rounds the angles' cosines, not the angles."""
    frequencies = torch.tensor(rope.inverse_frequencies(dim, seq_len), dtype=torch.float64, device=device)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), frequencies)
    dtype = dtype or torch.get_default_dtype()
    scale = rope.cos_sin_scale
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn each pair of features ``(x[2i], x[2i+1])`` of ``x`` (``... x seq x dim``) by its
    position's angle (Meta's interleaved pairs); where the tables cover fewer pairs than
    ``x`` has (GPT-NeoX's partial rotary, ``rotary_pct``), the first ``2 * pairs``
    features turn and the rest pass through."""
    width = 2 * cos.shape[-1]
    if width < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :width], cos, sin), x[..., width:]), dim=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Causal self-attention with ``kv_heads`` key/value heads shared by groups of
    ``heads / kv_heads`` query heads (GQA, Ainslie et al. 2023; ``kv_heads == heads`` is
    multi-head attention), rotary positions on queries and keys.

    Q, K and V are three linears (``wq``, ``wk``, ``wv``) or, ``fused_qkv``, one ``wqkv``
    (torchtitan 0.3's ``FusedQKVLinear``), its output features laid out as torchtitan lays
    them out, key/value group by group: each group's query heads, then its key head, then
    its value head. A contiguous column split over tp ranks (tp divides the key/value
    heads) then hands each rank whole groups, and the heads are read from the output
    whatever its width. The fused weight is the three linears' initial weights
    rearranged, so a fused model starts as the separate one (no draw of the RNG more)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool = False,
                 qkv_bias: bool = False, rotary: bool = True, fused_qkv: bool = False, qk_norm: str | None = None,
                 window: int | None = None, chunk: int | None = None, sinks: bool = False,
                 rope: Rope = PLAIN_ROPE, rotary_dim: int | None = None, norm_offset: bool = False,
                 query_scale: float = 1.0, softcap: float | None = None,
                 temperature: tuple[float, float] | None = None) -> None:
        super().__init__()
        self.temperature = temperature  # Llama 4's layers without rotary positions: (floor_scale, attn_scale)
        # Gemma 2/3: the softmax scale is query_pre_attn_scalar^-1/2, not head_dim^-1/2: the queries
        # are multiplied by the ratio (every attention path, ring and gathered too, scales by the width)
        self.query_scale, self.softcap = query_scale, softcap
        self.head_dim, self.groups, self.rotary, self.rope = head_dim, heads // kv_heads, rotary, rope
        self.rotary_dim = rotary_dim or head_dim  # the features of a head turned by position (GPT-NeoX: a share)
        self.window, self.chunk = window, chunk
        # Qwen3, Gemma 3: an RMSNorm one head wide on every query and key head; OLMoE: one
        # over the whole query projection and one over the whole key projection
        self.q_norm = self.k_norm = None
        if qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(head_dim, offset=norm_offset), RMSNorm(head_dim, offset=norm_offset)
        elif qk_norm == "projection":
            self.q_norm = RMSNorm(heads * head_dim, offset=norm_offset)
            self.k_norm = RMSNorm(kv_heads * head_dim, offset=norm_offset)
        self.qk_norm = qk_norm  # "l2" (Llama 4): no weight, after the rotary turn (forward)
        # gpt-oss: one learned logit per head in each softmax's denominator
        self.sinks = nn.Parameter(torch.randn(heads) / 4) if sinks else None
        self.wq = nn.Linear(hidden, heads * head_dim, bias=bias or qkv_bias)
        self.wk = nn.Linear(hidden, kv_heads * head_dim, bias=bias or qkv_bias)
        self.wv = nn.Linear(hidden, kv_heads * head_dim, bias=bias or qkv_bias)
        self.wo = nn.Linear(heads * head_dim, hidden, bias=bias)
        self.wqkv = None
        if fused_qkv:
            self.wqkv = fused_projection(self.wq, self.wk, self.wv, kv_heads)
            del self.wq, self.wk, self.wv
        self.context = None  # context parallelism: this rank's share of the sequence (executor.context_parallel)

    def heads_of(self, projection: torch.Tensor) -> torch.Tensor:
        """``batch x seq x (heads * head_dim)`` -> ``batch x heads x seq x head_dim``."""
        batch, seq = projection.shape[:2]
        return projection.view(batch, seq, -1, self.head_dim).transpose(1, 2)

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K and V, each ``batch x heads x seq x head_dim``."""
        if self.wqkv is None:
            q, k, v = self.heads_of(self.wq(x)), self.heads_of(self.wk(x)), self.heads_of(self.wv(x))
        else:
            qkv = self.wqkv(x)
            batch, seq = qkv.shape[:2]
            grouped = qkv.view(batch, seq, -1, self.groups + 2, self.head_dim)  # key/value groups on this rank
            q, k, v = (part.reshape(batch, seq, -1, self.head_dim).transpose(1, 2)
                       for part in grouped.split([self.groups, 1, 1], dim=3))
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.qk_norm == "projection":  # over every head at once: the projection's features
            q, k = self.across_heads(self.q_norm, q), self.across_heads(self.k_norm, k)
        if self.query_scale != 1.0:  # a rotation is linear: scaling before it is scaling after
            q = q * self.query_scale
        return q, k, v

    def across_heads(self, norm: nn.Module, heads: torch.Tensor) -> torch.Tensor:
        """``norm`` over a ``batch x heads x seq x head_dim`` tensor's features, all heads joined."""
        joined = norm(heads.transpose(1, 2).flatten(2))
        return joined.view(*joined.shape[:2], -1, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.projections(x)
        if self.temperature is not None:
            positions = self.context.positions if self.context is not None else torch.arange(q.shape[2])
            q = q * long_position_scales(positions, *self.temperature).to(q.device, q.dtype).view(-1, 1)
        if self.context is not None:
            return self.wo(self.context.attend(self, q, k, v))
        if self.rotary:
            cos, sin = rotary_angles(q.shape[2], self.rotary_dim, self.rope, dtype=q.dtype, device=q.device)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.qk_norm == "l2":
            q, k = l2_norm(q), l2_norm(k)
        return self.wo(attend(q, k.repeat_interleave(self.groups, dim=1), v.repeat_interleave(self.groups, dim=1),
                              self.window, self.chunk, self.sinks, self.softcap))


def long_position_scales(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """Llama 4's query temperature at each position ``p``: ``1 + attn_scale * ln(floor((p +
    1) / floor_scale) + 1)`` (Hugging Face's ``Llama4TextAttention``): 1 up to position
    ``floor_scale - 2``, growing slowly past the context its chunks were trained on."""
    steps = torch.floor((positions.to(torch.float64) + 1) / floor_scale)
    return torch.log(steps + 1) * attn_scale + 1


def fused_projection(wq: nn.Linear, wk: nn.Linear, wv: nn.Linear, kv_heads: int) -> nn.Linear:
    """One linear computing ``wq``, ``wk`` and ``wv`` at once, its rows (output features)
    grouped by key/value head: ``[q heads of group 0, k_0, v_0, q heads of group 1, ...]``
    (torchtitan's ``FusedQKVLinear`` layout, ``_merge_qkv_on_load``)."""
    fused = nn.utils.skip_init(nn.Linear, wq.in_features, wq.out_features + wk.out_features + wv.out_features,
                               bias=wq.bias is not None, device=wq.weight.device, dtype=wq.weight.dtype)
    with torch.no_grad():
        for name in ("weight", "bias") if wq.bias is not None else ("weight",):
            q, k, v = (getattr(linear, name).unflatten(0, (kv_heads, -1)) for linear in (wq, wk, wv))
            getattr(fused, name).copy_(torch.cat((q, k, v), dim=1).flatten(0, 1))
    return fused


def visible_keys(seq: int, window: int | None = None, chunk: int | None = None,
                 device: torch.device | None = None) -> torch.Tensor:
    """``seq x seq``, true where query ``i`` sees key ``j``: ``j <= i``, within the last
    ``window`` tokens (itself and the ``window - 1`` before: Mistral's, Gemma's and
    gpt-oss's sliding layers) and in ``i``'s chunk of ``chunk`` tokens (Llama 4's
    chunked layers)."""
    query = torch.arange(seq, device=device).unsqueeze(1)
    key = torch.arange(seq, device=device).unsqueeze(0)
    seen = key <= query
    if window is not None:
        seen &= query - key < window
    if chunk is not None:
        seen &= query // chunk == key // chunk
    return seen


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
           chunk: int | None = None, sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of ``batch x heads x seq x dim`` tensors, heads joined again:
    ``batch x seq x (heads * v_dim)``; within a sliding ``window`` or a ``chunk`` where
    given, with one ``sinks`` logit per head in every softmax's denominator (gpt-oss:
    a query may give part of its weight to no key), and with the scores soft-capped,
    ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2); the last two written
    out (scores, mask, softmax)."""
    seq = q.shape[-2]
    if sinks is not None or softcap is not None:
        out = written_out_attention(q, k, v, window, chunk, sinks, softcap)
    else:
        limited = (window is not None and window < seq) or (chunk is not None and chunk < seq)
        mask = visible_keys(seq, window, chunk, q.device) if limited else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    return out.transpose(1, 2).flatten(2)


@torch.overrides.wrap_torch_function(lambda q, k, v, *args, **kwargs: (q, k, v))
def written_out_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
                          chunk: int | None = None, sinks: torch.Tensor | None = None,
                          softcap: float | None = None) -> torch.Tensor:
    """``attend``'s core where torch's kernel cannot run it (sinks, soft-capped scores):
    the scores, the mask (made here, so a checkpoint of this core keeps none of it), the
    softmax and the weighted values, ``batch x heads x seq x v_dim``. It takes part in
    torch's function dispatch like ``scaled_dot_product_attention``, so a torch function
    mode sees it as one call (``executor.recompute``'s selective recompute checkpoints it)."""
    mask = visible_keys(q.shape[-2], window, chunk, q.device)
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return weights @ v


def attend_keeping_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``attend`` written out (scores, causal mask, softmax, weighted values) so that
    autograd keeps Q, K and V themselves. torch's math path, which a CPU runs when the
    query's and value's widths differ (latent attention), multiplies Q and K by the
    scale's square root first and keeps those products: dropping Q, K and V
    (``--recompute norm-mla-up``) would leave the copies in place. The bytes kept are
    the math path's: Q, K, V and the softmax's output."""
    seq = q.shape[-2]
    mask = torch.full((seq, seq), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
    weights = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + mask, dim=-1)
    return (weights @ v).transpose(1, 2).flatten(2)


GPT_OSS_ALPHA = 1.702  # gpt-oss's clamped SwiGLU: the sigmoid's slope (fixed in its code, not in its config)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu": F.gelu, "gelu-tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


class SoftCappedLinear(nn.Linear):
    """A linear whose outputs are ``cap * tanh(out / cap)`` (Gemma 2's output logits,
    ``final_logit_softcapping``); still the ``nn.Linear`` a tied output layer is."""

    def __init__(self, in_features: int, out_features: int, cap: float, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.cap = cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x) / self.cap) * self.cap


class FeedForward(nn.Module):
    """The MLP: gated, ``w2(act(w1 x) * w3 x)`` (SwiGLU with silu, Shazeer 2020; Gemma's
    GeGLU with tanh-approximated GeLU), or two matrices with the activation between
    (GPT-2). ``clamped-swiglu`` is gpt-oss's: ``w2((up + 1) * g * sigmoid(1.702 g))``
    with ``g = min(w1 x, limit)`` and ``up = w3 x`` clamped to ``[-limit, limit]``
    (Hugging Face's ``GptOssExperts``).

    ``recompute_activation`` (a routed expert under ``--recompute-moe-act``, Megatron-Core's
    ``moe_act``: ``executor.recompute``) runs the activation under a checkpoint, so it keeps
    only its inputs (the gate and up outputs), and drops its output once the down
    projection has saved it, rebuilding it before that projection's backward
    (``executor.rebuilt_activations``), as Megatron-Core's output-discarding checkpoint
    does. The backward runs the activation twice here (the rebuild, then the checkpoint's
    own re-run for its gradient) where Megatron-Core runs it once; the simulator prices
    Megatron-Core's one."""

    recompute_activation = False

    def __init__(self, hidden: int, ffn: int, gated: bool = True, bias: bool = False, activation: str | None = None,
                 limit: float | None = None) -> None:
        super().__init__()
        self.activation = activation or ("silu" if gated else "gelu")
        self.limit = limit
        self.w1 = nn.Linear(hidden, ffn, bias=bias)
        self.w2 = nn.Linear(ffn, hidden, bias=bias)
        self.w3 = nn.Linear(hidden, ffn, bias=bias) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = (self.w1(x),) if self.w3 is None else (self.w1(x), self.w3(x))
        if not (self.recompute_activation and torch.is_grad_enabled()):
            return self.w2(self.activate(*inner))
        from torch.utils.checkpoint import checkpoint  # noqa: PLC0415 - only under --recompute-moe-act

        from executor.rebuilt_activations import drop_until_backward  # noqa: PLC0415 - it imports DTensor

        hidden = checkpoint(self.activate, *inner, use_reentrant=False)
        out = self.w2(hidden)
        drop_until_backward((out,), (hidden,), lambda: (self.activate(*inner),), "an expert's activation output")
        return out

    def activate(self, gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        """The activation on the first projection's output (``gate``), times the second's
        (``up``) where the MLP is gated."""
        if up is None:
            return ACTIVATIONS[self.activation](gate)
        if self.activation == "clamped-swiglu":
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * GPT_OSS_ALPHA))
        return ACTIVATIONS[self.activation](gate) * up
