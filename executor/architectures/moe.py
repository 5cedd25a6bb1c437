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

The load-balancing loss (``balance_loss``, the spec's coefficient ``alpha``; Switch
Transformer's, per sequence as DeepSeek's sequence-wise loss and Megatron-Core's
``seq_aux_loss``): for each sequence of ``T`` tokens, ``alpha E sum_e f_e P_e`` with
``f_e`` the share of the router's ``k T`` choices that went to expert ``e`` (before any
capacity drop) and ``P_e`` the mean over the tokens of its score (softmax; a sigmoid
router's scores normalised to sum to one per token, as DeepSeek-V3 and Megatron-Core
normalise them); summed over the sequences and divided by the batch as the model's loss
is. Taken per sequence, it does not depend on how the batch is cut into microbatches
and replicas, so a pipelined run equals the one-process reference (Megatron-Core's
default ``aux_loss`` takes the counts over a whole microbatch instead). Its gradient
starts where the layer ran (``AttachBalanceLoss``, as Megatron-Core's
``MoEAuxLossAutoScaler``): the loss needs no path to the pipeline's last stage. With
context parallelism a rank holds part of each sequence: the counts are summed over the
cp group (no gradient flows through a count) and each rank adds its tokens' share of
``P``, so the ranks' losses and gradients sum to the whole sequence's, as their model
losses do.

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
from collections.abc import Callable, Iterable

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
    context = None  # context parallelism's shard (executor.context_parallel): each sequence split over its group
    # parallel folding (executor.shard_routing): this tp rank routes only its shard of each sequence
    sequence_shard = None

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
        """The top-k weights and experts of each of ``tokens``."""
        weights, chosen, _ = self.route(tokens)
        return weights, chosen

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``forward``'s weights and experts, and every expert's score of each token
        (what the balance loss reads)."""
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
        return weights, chosen, scores

    def balance_loss(self, scores: torch.Tensor, chosen: torch.Tensor, sequences: int,
                     coefficient: float) -> torch.Tensor:
        """``coefficient E sum_e f_e P_e`` of each of the ``sequences`` (the tokens' rows
        in order, a sequence's together), summed (see the module)."""
        experts = scores.shape[-1]
        probabilities = scores if self.gating == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        probabilities = probabilities.view(sequences, -1, experts)
        counts = torch.nn.functional.one_hot(chosen, experts).sum(dim=1).view(sequences, -1, experts).sum(dim=1)
        seq_len = probabilities.shape[1]
        if self.sequence_shard is not None:  # each tp rank routes its shard of the (cp rank's) sequence
            counts = self.sequence_shard.counts_of_sequences(counts)
            seq_len *= self.sequence_shard.parts
        if self.context is not None:  # each rank holds part of every sequence: the counts are the group's
            import torch.distributed as dist  # noqa: PLC0415 - only a cp run reaches here

            dist.all_reduce(counts, group=self.context.group)
            seq_len = self.context.seq_len
        shares = counts.to(probabilities.dtype) / (seq_len * self.top_k)
        mean_scores = probabilities.sum(dim=1) / seq_len
        return coefficient * experts * (shares * mean_scores).sum()

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


class AttachBalanceLoss(torch.autograd.Function):
    """The layer's output unchanged; in the backward, ``loss``'s gradient is ``scale``
    (what the step multiplies the model's loss by: ``1 / batch``, times fp16's loss
    scale), so the balance loss's gradient reaches the router from the layer itself
    (Megatron-Core's ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def within_capacity(chosen: torch.Tensor, experts: int, factor: float, shard=None) -> torch.Tensor:
    """Which routed copies an expert takes: ``chosen`` is ``sequences x seq x k`` expert
    indices; a copy is kept while its expert has taken fewer than
    ``ceil(factor * k * seq / experts)`` copies of that sequence before it (in token
    order, then choice order). With ``shard`` (parallel folding,
    ``executor.shard_routing``) ``chosen`` is one of ``shard.parts`` contiguous shards of
    each sequence: the capacity is the whole sequence's, and the copies the earlier shards
    sent count as before this one's."""
    sequences, seq, top_k = chosen.shape
    whole = seq * (shard.parts if shard is not None else 1)
    capacity = math.ceil(factor * top_k * whole / experts)
    one_hot = torch.nn.functional.one_hot(chosen.reshape(sequences, seq * top_k), experts)
    place = (one_hot.cumsum(dim=1) * one_hot).sum(dim=-1) - 1  # copies of that expert before this one
    if shard is not None:
        before = shard.copies_before(one_hot.sum(dim=1))  # sequences x experts
        place = place + (one_hot * before.unsqueeze(1)).sum(dim=-1)
    return (place < capacity).view(sequences, seq, top_k)


class MixtureOfExperts(nn.Module):
    """Routed experts (the top-k of ``experts``, each a SwiGLU MLP of ``expert_ffn``) plus
    ``shared_ffn`` columns of shared experts (one MLP, as DeepSeek runs them), the latter
    optionally scaled by a sigmoid gate (Qwen-MoE)."""

    # under parallel folding with sequence parallelism, the shared expert's gathered input dropped
    # after its forward and gathered again before its backward; off under a checkpoint (executor.recompute)
    regather_shards = True

    def __init__(self, hidden: int, experts: int, top_k: int, expert_ffn: int, shared_ffn: int = 0,
                 shared_gate: bool = False, gating: str = "softmax", normalize: bool = True,
                 capacity_factor: float | None = None, groups: int = 1, groups_kept: int | None = None,
                 group_scoring: str = "max", scaling: float = 1.0, router_bias: bool = False,
                 balanced_by_bias: bool | None = None, weighted_input: bool = False, bias: bool = False,
                 activation: str | None = None, limit: float | None = None, balance_loss: float = 0.0) -> None:
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
        # Under tp (executor.tensor_parallel.split_experts) the experts return this rank's partial
        # sums, reduced once for the layer; ``tp_sum_grad`` (identity forward, the gradient summed
        # over tp) then completes what only the whole output's gradient gives: the experts'
        # inputs', the routing weights' and the shared expert's gate's
        self.tp_sum_grad: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Under tp with sequence parallelism, folded or with ep (executor.shard_routing): this tp
        # rank routes its own sequence shard, the shared expert gathering the sequence for itself
        # (shared_output); with the experts split over tp, ``expert_tp`` gathers the rows this rank
        # received over tp around them
        self.sequence_shard = None
        self.expert_tp = None
        self.balance_loss = balance_loss  # the load-balancing loss's coefficient (see the module)
        self.balance_scale = 1.0  # its gradient: set each step by the runtime (set_balance_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on ``x``: the whole sequence (one process, or every tp rank routing the
        gathered sequence), or under tp with sequence parallelism this tp rank's sequence
        shard (``sequence_shard``, ``executor.shard_routing``: a DTensor sharded on the
        sequence, the norm's output), whose tokens are routed here, Megatron-Core's layer."""
        local = x.to_local() if hasattr(x, "to_local") else x
        sequences, seq, hidden = local.shape
        tokens = local.reshape(-1, hidden)
        weights, chosen, balance, keep = self.routed(tokens, sequences, seq)
        # One process holds every expert; under expert parallelism (executor.expert_parallel)
        # ``dispatcher`` sends each copy to the rank holding its expert and back (``expert_tp``
        # gathering the rows it received over tp around experts split over tp).
        complete = self.tp_sum_grad or _unchanged  # the router read the tokens whole; the experts, partial sums
        inputs, weights = complete(tokens), complete(weights)
        if self.dispatcher is not None:
            out = self.dispatcher(inputs, weights, chosen, keep, self.experts, self.weighted_input, self.expert_tp)
        else:
            out = route_locally(inputs, weights, chosen, keep, self.experts, self.weighted_input)
        if self.shared is not None:
            shared = self.shared_output(x, inputs).reshape(-1, hidden)
            if self.shared_gate is not None:  # on a shard: its weight's gradient summed over tp (ShardFedLinear)
                shared = shared * complete(self.shared_gate(tokens).sigmoid())
            out = out + shared.to(out.dtype)
        if balance is not None:
            out = AttachBalanceLoss.apply(out, balance, self.balance_scale)
        return out.view(sequences, seq, hidden)

    def shared_output(self, x: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """The shared expert's output: on the tokens ``inputs``, or on a sequence shard
        (``sequence_shard``) split over tp as a dense MLP, gathering the sequence ``x`` for
        itself and reduce-scattering its output to the shard
        (``executor.tensor_parallel.transformer_block_plan``). With ``regather_shards`` its
        gathered input is dropped after its forward and gathered again before its backward
        (``read_gathered_shard``), as Megatron-Core's sequence-parallel linears keep it."""
        if self.sequence_shard is None:
            return self.shared(inputs)
        from executor.rebuilt_activations import read_gathered_shard  # noqa: PLC0415 - a tp run only

        return read_gathered_shard(self.shared, x) if self.regather_shards else self.shared(x)

    def routed(self, tokens: torch.Tensor, sequences: int, seq: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The router's weights and choices for ``tokens`` (``sequences x seq``, a
        sequence's together), the balance loss (None where none is added) and which
        copies the capacity keeps."""
        weights, chosen, scores = self.router.route(tokens)
        balance = None
        if self.balance_loss > 0 and torch.is_grad_enabled():
            balance = self.router.balance_loss(scores, chosen, sequences, self.balance_loss)
        keep = torch.ones_like(chosen, dtype=torch.bool)
        if self.capacity_factor is not None:
            keep = within_capacity(chosen.view(sequences, seq, -1), self.num_experts, self.capacity_factor,
                                   self.sequence_shard).view_as(chosen)
        return weights, chosen, balance, keep


def _unchanged(tensor: torch.Tensor) -> torch.Tensor:
    """``tp_sum_grad`` where there is no tp: the tensor as it is."""
    return tensor


def balanced_layers(stages: Iterable[nn.Module]) -> list[MixtureOfExperts]:
    """The mixtures of experts of ``stages`` that add a balance loss."""
    return [module for stage in stages for module in stage.modules()
            if isinstance(module, MixtureOfExperts) and module.balance_loss > 0]


def set_balance_scale(layers: Iterable[MixtureOfExperts], scale: float) -> None:
    """What the step multiplies the model's loss by (``1 / batch``, times fp16's loss
    scale), for each of ``layers`` (``balanced_layers``) to start its balance loss's
    gradient with."""
    for layer in layers:
        layer.balance_scale = scale


def route_locally(tokens: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, keep: torch.Tensor,
                  experts: nn.ModuleList, weighted_input: bool = False) -> torch.Tensor:
    """The routed experts' weighted sum per token, every expert on this process: each
    kept copy (``chosen`` and ``keep`` are ``tokens x k``) through its expert, times its
    router weight (``weighted_input``: the copy times its weight through the expert),
    summed in ``combine_dtype``."""
    out = tokens.new_zeros(tokens.shape, dtype=combine_dtype(tokens, weights))
    for index, expert in enumerate(experts):
        # An expert no token chose still runs, on no rows: its weights get a zero
        # gradient rather than none, so every rank's gradients (and dp's buckets)
        # hold every parameter, whatever the routing.
        token, slot = torch.nonzero((chosen == index) & keep, as_tuple=True)
        weight = weights[token, slot].unsqueeze(-1)
        weighted = expert(tokens[token] * weight.to(tokens.dtype)) if weighted_input else expert(tokens[token]) * weight
        out = out.index_add(0, token, weighted.to(out.dtype))  # autocast: back to the residual's type
    return out


def combine_dtype(tokens: torch.Tensor, weights: torch.Tensor) -> torch.dtype:
    """The type the routed experts' outputs are weighted and summed in: the wider of the
    tokens' and the routing weights' (float32 at least, ``Router.route``). Under autocast
    with sequence parallelism the tokens arrive in 16 bits (cast before the gather,
    ``executor.rebuilt_activations.read_gathered_shard``) and the sum stays in float32,
    as it is where they arrive in float32."""
    return torch.promote_types(tokens.dtype, weights.dtype)
