"""Context parallelism: each sequence split over ``cp`` ranks, attention over the whole
sequence by all-gathering keys and values (Llama 3's variant; ``--cp-comm all-gather``)
or by passing them round a ring (``--cp-comm p2p``, ``executor.ring_attention``);
``simulate --cp-comm`` models both.

Load balancing (Megatron-LM, Llama 3): the sequence is cut into ``2 cp`` equal chunks and
rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``, so under the causal mask every rank
has the same amount of attention to compute (an early chunk and a late one). Everything
but attention is per token, so a rank runs its ``S / cp`` tokens through every layer on
its own. In attention it rotates its queries and keys at their true positions, gathers
every rank's keys and values (``GatheredAttention``: all-gathered again in the backward,
their gradients reduce-scattered to their owners) and masks each query to the keys at or
before its position. Latent
attention (MLA) rotates only its rotary part and exchanges every head's key and value. A
model with learned positions (the toy gpt, GPT-3's architecture) embeds each token at its
true position instead (``executor.models.token_positions``).

The loss of a rank is its tokens' share of the sequence's sum (the model divides by the
whole ``--seq-len``), so the ``cp`` ranks' gradients are summed and the replicas'
averaged: the gradients are reduced over the ``dp x cp`` ranks and divided by ``dp``.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from executor.architectures.layers import PLAIN_ROPE, Attention, apply_rotary, rotary_angles
from executor.block_attention import block_backward, block_forward, compute_dtype, merge
from executor.inside_timing import RingTimer
from executor.mesh import MeshPosition
from executor.ring_attention import Ring, ring_attention
from pipesim.model.rotary import Rope


def chunk_positions(seq_len: int, cp: int, cp_index: int) -> torch.Tensor:
    """The sequence positions rank ``cp_index`` holds: chunks ``cp_index`` and
    ``2 cp - 1 - cp_index`` of ``2 cp`` (``2 cp`` divides ``seq_len``)."""
    chunk = seq_len // (2 * cp)
    early, late = cp_index * chunk, (2 * cp - 1 - cp_index) * chunk
    return torch.cat((torch.arange(early, early + chunk), torch.arange(late, late + chunk)))


def dp_cp_group(rank: int, position: MeshPosition, timeout: float) -> dist.ProcessGroup:
    """The ranks of this process's (pp, tp) shard over every dp and cp index: where its
    gradients are reduced. Every process creates every such group, in one order."""
    mine = None
    for pp_index in range(position.pp):
        for tp_index in range(position.tp):
            members = [position.rank_at(pp_index, dp_index, cp_index, tp_index)
                       for dp_index in range(position.dp) for cp_index in range(position.cp)]
            group = dist.new_group(members, timeout=timedelta(seconds=timeout))
            if rank in members:
                mine = group
    return mine


def gather_rows(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """Every cp rank's ``batch x heads x rows x dim`` joined along the rows, in rank order."""
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=2)


def reduce_rows(grad: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """The inverse of ``gather_rows`` for gradients: to each rank the sum over ranks of
    its rows' gradient (a reduce-scatter; gloo has none, so there an all-reduce of the
    whole gradient, keeping this rank's rows)."""
    parts = [part.contiguous() for part in grad.chunk(cp, dim=2)]
    mine = dist.get_rank(group)
    if dist.get_backend(group) == "nccl":
        out = torch.empty_like(parts[mine])
        dist.reduce_scatter(out, parts, group=group)
        return out
    total = grad.contiguous()
    dist.all_reduce(total, group=group)
    return total.chunk(cp, dim=2)[mine].contiguous()


class GatheredAttention(torch.autograd.Function):
    """Causal attention of this rank's ``q`` over the whole sequence's keys and values,
    all-gathered from the cp ranks (``batch x heads x S/cp x dim`` in, ``batch x heads x
    S/cp x v_dim`` out). As Transformer Engine's ``AttnFuncWithCPAndKVAllGather`` (and as
    ``simulate --cp-comm all-gather`` prices it), the gathered keys and values are not
    kept: the backward gathers them again, and reduce-scatters their gradients to their
    owners. Not ``torch.distributed.nn.functional.all_gather``: on gloo its backward
    scatters with the group's ranks taken for global ranks, which fails on any cp group
    without global rank 0 (a cp group of a later pipeline stage)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: ContextShard) -> torch.Tensor:
        compute = compute_dtype(q.dtype)
        with torch.autocast(q.device.type, enabled=False):
            keys, values = (gather_rows(x, shard.group, shard.cp).to(compute) for x in (k, v))
            out = q.new_zeros((*q.shape[:3], v.shape[-1]), dtype=compute)
            lse = q.new_full(q.shape[:3], float("-inf"), dtype=compute)
            merge(out, lse, *block_forward(q.to(compute), keys, values, shard.mask(q.device), q.shape[-1] ** -0.5,
                                           q.shape[1] // k.shape[1]))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.shard = shard
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, out_grad: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        shard, compute = ctx.shard, out.dtype
        with torch.autocast(q.device.type, enabled=False):
            keys, values = (gather_rows(x, shard.group, shard.cp).to(compute) for x in (k, v))
            q_, grad = q.to(compute), out_grad.to(compute)
            dq = torch.zeros_like(q_)
            dk, dv = block_backward(q_, keys, values, grad, (grad * out).sum(-1), lse, shard.mask(q.device),
                                    q.shape[-1] ** -0.5, q.shape[1] // k.shape[1], dq)
            # in the keys' own type on the wire, as they were gathered
            dk, dv = (reduce_rows(part.to(x.dtype), shard.group, shard.cp) for part, x in ((dk, k), (dv, v)))
        return dq.to(q.dtype), dk, dv, None


class ContextShard:
    """This rank's share of every sequence, the cp group attention exchanges over, and
    how: all-gathered keys and values (``all-gather``) or ring attention (``p2p``,
    ``executor.ring_attention``)."""

    def __init__(self, group: dist.ProcessGroup, cp: int, cp_index: int, seq_len: int,
                 comm: str = "all-gather", timer: RingTimer | None = None) -> None:
        self.group, self.cp, self.seq_len = group, cp, seq_len
        self.positions = chunk_positions(seq_len, cp, cp_index)
        held = [chunk_positions(seq_len, cp, r) for r in range(cp)]
        self.gathered_positions = torch.cat(held)  # the sequence position of each gathered row (rank order)
        self.ring = Ring(group, cp, cp_index, held, timer=timer) if comm == "p2p" else None

    def local(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's columns of a ``batch x ... x seq`` tensor (inputs, targets, or a
        multi-token prediction's rows of targets)."""
        return tokens[..., self.positions.to(tokens.device)]

    def mask(self, device: torch.device) -> torch.Tensor:
        """``S/cp x S``: which gathered keys (rank order) each of this rank's queries sees."""
        return self.positions.to(device).unsqueeze(1) >= self.gathered_positions.to(device).unsqueeze(0)

    def rotary(self, dim: int, dtype: torch.dtype, device: torch.device,
               rope: Rope = PLAIN_ROPE) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary ``cos`` and ``sin`` at this rank's true positions."""
        cos, sin = rotary_angles(self.seq_len, dim, rope, dtype=dtype, device=device)
        positions = self.positions.to(device)
        return cos[positions], sin[positions]

    def attend(self, attention: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence's keys and
        values, heads joined: ``batch x S/cp x (heads * dim)``."""
        if attention.rotary:
            cos, sin = self.rotary(attention.rotary_dim, q.dtype, q.device, attention.rope)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.attend_rotated(q, k, v)

    def attend_rotated(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``attend`` for queries and keys already rotated at their positions (latent
        attention rotates only part of each head); ``k`` and ``v`` may have fewer heads
        than ``q`` (GQA) and ``v`` another width (MLA)."""
        out = ring_attention(q, k, v, self.ring) if self.ring is not None else GatheredAttention.apply(q, k, v, self)
        return out.transpose(1, 2).flatten(2)


def shard_context(stage: nn.Module, shard: ContextShard) -> None:
    """Make every attention of ``stage`` (grouped-query, latent, the toy gpt's blocks)
    attend over the whole sequence from this rank's share, and a learned position table
    embed the rank's true positions: every module with a ``context`` slot."""
    for module in stage.modules():
        if hasattr(module, "context"):  # Attention, LatentAttention, the toy Block, the embeddings
            module.context = shard


def local_shape(shape: tuple[int, ...], parts: int) -> tuple[int, ...]:
    """A ``batch x seq x hidden`` activation's shape on one rank of ``parts`` that split
    its sequence (the cp ranks, times tp under sequence parallelism:
    ``RunConfig.boundary_sequence_split``)."""
    return (shape[0], shape[1] // parts, *shape[2:])
