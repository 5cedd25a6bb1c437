"""Parallel folding's routing (``run --etp 1``, Megatron-Core's
``--expert-tensor-parallel-size 1``): each tensor-parallel rank routes only its own
sequence shard, as Megatron-Core's ``MoELayer`` does at ``etp 1``.

Under sequence parallelism a tp rank holds ``seq / tp`` tokens of every sequence between
sublayers. With the routed experts whole on every rank there is nothing for the tp group
to gather them for: the router scores the shard, the shard's routed copies go to their
experts by the ep all-to-all, and their outputs come back to the shard. No tensor-parallel
collective runs for the routed experts. Only the shared experts, still split over tp (their
own ``SharedExpertMLP`` on the tp group in Megatron-Core), gather the sequence before their
first GEMM and reduce-scatter their output to the shards.

What a shard alone does not see is made whole here, so that a step still equals the
one-process reference:

- the balance loss's counts: a sequence's choices are summed over the tp group (no gradient
  flows through a count), each rank adding its tokens' share of the mean scores
  (``MixtureOfExperts.router`` reads ``counts_of_sequences``), as Megatron-Core sums its
  sequence-wise auxiliary loss's counts over the tp x cp group;
- the capacity: a copy's place in its expert's queue counts the copies the earlier shards
  of its sequence sent to that expert (``copies_before``);
- the weights every rank holds whole but feeds only its shard (the router's, the shared
  experts' gate): their gradients are summed over tp (``sum_grad_over_tp``), as
  Megatron-Core marks them ``sequence_parallel`` and all-reduces them over tp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


class SequenceShardRouting:
    """This tp rank's shard of every sequence (``index`` of ``parts`` contiguous ones) and
    the group its routers complete their counts over."""

    def __init__(self, tp_mesh: DeviceMesh) -> None:
        self.group = tp_mesh.get_group()
        self.index, self.parts = tp_mesh.get_local_rank(), tp_mesh.size()

    def counts_of_sequences(self, counts: torch.Tensor) -> torch.Tensor:
        """``counts`` (``sequences x experts``, this shard's) summed over the tp group: each
        sequence's whole."""
        total = counts.clone()
        dist.all_reduce(total, group=self.group)
        return total

    def copies_before(self, counts: torch.Tensor) -> torch.Tensor:
        """The copies each expert took from the shards before this one, per sequence
        (``counts``: ``sequences x experts``, this shard's)."""
        every = [torch.empty_like(counts) for _ in range(self.parts)]
        dist.all_gather(every, counts.contiguous(), group=self.group)
        return sum(every[:self.index], torch.zeros_like(counts))


class SummedOverTp(torch.autograd.Function):
    """Identity forward; the gradient summed over ``group`` in the backward (a weight
    every tp rank holds whole and applies to its own tokens)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ShardFedLinear(nn.Linear):
    """A linear every tp rank holds whole and runs on its own sequence shard: its weight
    (and bias) enter through ``SummedOverTp``, so each rank's gradient is the whole
    sequence's. A module still (the split backward's weight gradients record its call)."""

    tp_group: dist.ProcessGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else SummedOverTp.apply(self.bias, self.tp_group)
        return nn.functional.linear(x, SummedOverTp.apply(self.weight, self.tp_group), bias)


def sum_grad_over_tp(linear: nn.Linear, group: dist.ProcessGroup) -> None:
    """Make ``linear`` a ``ShardFedLinear`` over ``group`` (its class swapped, as FSDP2
    swaps a module's: the module, its parameters and its hooks stay)."""
    linear.__class__ = ShardFedLinear
    linear.tp_group = group
