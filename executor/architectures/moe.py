"""A mixture-of-experts MLP in plain torch: a top-k router, routed gated experts
(SwiGLU, or the spec's activation: gpt-oss's clamped SwiGLU, with biases) with an
optional capacity, and shared experts every token goes through.

The router scores each token against every expert (``softmax`` over the logits, as
Mixtral, DeepSeek-V2 and Qwen-MoE, or ``sigmoid`` per expert, as DeepSeek-V3), picks the
k best and weights the experts' outputs by their scores (rescaled to sum to one where
the spec says ``normalize_top_k``, then times DeepSeek's ``routed_scaling``), among the
experts of a token's best expert groups where routing is group-limited (DeepSeek).
DeepSeek-V3's auxiliary-loss-free balancing picks by score plus a per-expert bias that
is not trained by the gradient (``selection_bias``, a buffer, moved after each step by
``executor.expert_balance``); only the score weights the output.

Capacity (GShard, Switch Transformer): with a factor C each expert takes at most
``ceil(C * k * s / E)`` of one sequence's ``k * s`` routed token copies, in token order
(a token's choices in the order of their scores), and drops the rest: a dropped copy
adds nothing, the token goes on through the residual. The capacity counts per sequence,
not per microbatch, so how a batch is cut into microbatches never changes which tokens
are dropped (the pipelined step equals the one-process reference). Without C
(``None``) nothing is dropped.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from executor.architectures.layers import FeedForward


class Router(nn.Module):
    """Scores of ``tokens x hidden`` against ``experts``: the top-k experts of each token
    and their weights.

    With ``groups`` above one (DeepSeek's group-limited routing) the experts are that
    many equal groups; each token keeps the ``groups_kept`` groups of the best group
    scores (``max``: a group's best score; ``top2-sum``: its best two's sum) and picks
    its k among their experts. ``scaling`` multiplies the chosen weights (DeepSeek's
    ``routed_scaling_factor``). ``expert_load`` counts the copies each expert was picked
    for since the step began (once a forward: not in a backward's recompute), which
    the auxiliary-loss-free balancing reads (``executor.expert_balance``)."""

    layer: int = -1  # the model's layer this router belongs to (set by its block)

    def __init__(self, hidden: int, experts: int, top_k: int, gating: str = "softmax",
                 normalize: bool = True, groups: int = 1, groups_kept: int | None = None,
                 group_scoring: str = "max", scaling: float = 1.0, bias: bool = False,
                 balanced_by_bias: bool | None = None) -> None:
        super().__init__()
        self.top_k, self.gating, self.normalize, self.scaling = top_k, gating, normalize, scaling
        self.groups, self.groups_kept, self.group_scoring = groups, groups_kept or groups, group_scoring
        self.gate = nn.Linear(hidden, experts, bias=bias)  # gpt-oss's router has a bias per expert
        if gating == "sigmoid" if balanced_by_bias is None else balanced_by_bias:
            self.register_buffer("selection_bias", torch.zeros(experts))
        else:
            self.selection_bias = None
        self.register_buffer("expert_load", torch.zeros(experts, dtype=torch.int64), persistent=False)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Scores in float32 at least (as Mixtral's and DeepSeek's routers compute them under
        # bf16): a bf16 softmax would tie experts a float32 one tells apart.
        logits = self.gate(tokens)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        scores = logits.softmax(dim=-1) if self.gating == "softmax" else logits.sigmoid()
        ranking = scores.detach()
        if self.selection_bias is not None:
            ranking = ranking + self.selection_bias
        if self.groups > 1:
            ranking = self.within_kept_groups(ranking)
        chosen = ranking.topk(self.top_k, dim=-1).indices
        if torch._C._current_graph_task_id() == -1:  # not a recompute inside a backward
            self.expert_load += torch.bincount(chosen.flatten(), minlength=self.expert_load.numel())
        weights = scores.gather(-1, chosen)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        return weights, chosen

    def within_kept_groups(self, ranking: torch.Tensor) -> torch.Tensor:
        """``ranking`` with every expert outside a token's kept groups at minus infinity
        (DeepSeek's reference code masks them so; a zero could outrank a kept expert
        whose biased score is negative)."""
        tokens, experts = ranking.shape
        grouped = ranking.view(tokens, self.groups, experts // self.groups)
        if self.group_scoring == "top2-sum":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        kept = group_scores.topk(self.groups_kept, dim=-1).indices
        in_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        return grouped.masked_fill(~in_kept.unsqueeze(-1), float("-inf")).view(tokens, experts)


def within_capacity(chosen: torch.Tensor, experts: int, factor: float) -> torch.Tensor:
    """Which routed copies an expert takes: ``chosen`` is ``sequences x seq x k`` expert
    indices; a copy is kept while its expert has taken fewer than
    ``ceil(factor * k * seq / experts)`` copies of that sequence before it (in token
    order, then choice order)."""
    sequences, seq, top_k = chosen.shape
    capacity = math.ceil(factor * top_k * seq / experts)
    one_hot = torch.nn.functional.one_hot(chosen.reshape(sequences, seq * top_k), experts)
    place = (one_hot.cumsum(dim=1) * one_hot).sum(dim=-1) - 1  # copies of that expert before this one
    return (place < capacity).view(sequences, seq, top_k)


class MixtureOfExperts(nn.Module):
    """Routed experts (the top-k of ``experts``, each a SwiGLU MLP of ``expert_ffn``) plus
    ``shared_ffn`` columns of shared experts (one MLP, as DeepSeek runs them), the latter
    optionally scaled by a sigmoid gate (Qwen-MoE)."""

    def __init__(self, hidden: int, experts: int, top_k: int, expert_ffn: int, shared_ffn: int = 0,
                 shared_gate: bool = False, gating: str = "softmax", normalize: bool = True,
                 capacity_factor: float | None = None, groups: int = 1, groups_kept: int | None = None,
                 group_scoring: str = "max", scaling: float = 1.0, router_bias: bool = False,
                 balanced_by_bias: bool | None = None, weighted_input: bool = False, bias: bool = False,
                 activation: str | None = None, limit: float | None = None) -> None:
        super().__init__()
        self.router = Router(hidden, experts, top_k, gating, normalize, groups, groups_kept, group_scoring, scaling,
                             router_bias, balanced_by_bias)
        self.weighted_input = weighted_input  # Llama 4: the weight scales what enters the expert
        # gpt-oss: biased experts with its clamped SwiGLU
        self.experts = nn.ModuleList(FeedForward(hidden, expert_ffn, True, bias, activation, limit)
                                     for _ in range(experts))
        self.shared = FeedForward(hidden, shared_ffn, True, bias, activation, limit) if shared_ffn else None
        self.shared_gate = nn.Linear(hidden, 1, bias=False) if shared_ffn and shared_gate else None
        self.capacity_factor = capacity_factor
        self.num_experts = experts  # all of them, also where a rank holds only its share
        self.dispatcher = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sequences, seq, hidden = x.shape
        tokens = x.reshape(-1, hidden)
        weights, chosen = self.router(tokens)
        keep = torch.ones_like(chosen, dtype=torch.bool)
        if self.capacity_factor is not None:
            keep = within_capacity(chosen.view(sequences, seq, -1), self.num_experts, self.capacity_factor)
            keep = keep.view_as(chosen)
        # One process holds every expert; under expert parallelism (executor.expert_parallel)
        # ``dispatcher`` sends each copy to the rank holding its expert and back.
        out = (self.dispatcher or route_locally)(tokens, weights, chosen, keep, self.experts, self.weighted_input)
        if self.shared is not None:
            shared = self.shared(tokens)
            if self.shared_gate is not None:
                shared = shared * self.shared_gate(tokens).sigmoid()
            out = out + shared.to(out.dtype)
        return out.view(sequences, seq, hidden)


def route_locally(tokens: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, keep: torch.Tensor,
                  experts: nn.ModuleList, weighted_input: bool = False) -> torch.Tensor:
    """The routed experts' weighted sum per token, every expert on this process: each
    kept copy (``chosen`` and ``keep`` are ``tokens x k``) through its expert, times its
    router weight (``weighted_input``: the copy times its weight through the expert)."""
    out = torch.zeros_like(tokens)
    for index, expert in enumerate(experts):
        # An expert no token chose still runs, on no rows: its weights get a zero
        # gradient rather than none, so every rank's gradients (and dp's buckets)
        # hold every parameter, whatever the routing.
        token, slot = torch.nonzero((chosen == index) & keep, as_tuple=True)
        weight = weights[token, slot].unsqueeze(-1)
        weighted = expert(tokens[token] * weight.to(tokens.dtype)) if weighted_input else expert(tokens[token]) * weight
        out = out.index_add(0, token, weighted.to(out.dtype))  # autocast: back to the residual's type
    return out
