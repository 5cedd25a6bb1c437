"""Mixture-of-experts layers under tensor parallelism with sequence parallelism, as
Megatron-Core runs them: each tp rank routes only its own sequence shard.

Under sequence parallelism a tp rank holds ``seq / tp`` tokens of every sequence between
sublayers. Megatron-Core's ``MoELayer`` routes that shard where it is: the router scores
it, its routed copies go to their experts' ranks by the ep all-to-all and their outputs
come back to it. Then:

- under parallel folding (``--etp 1``, the routed experts whole on every rank, the ep
  groups cut from every rank of a stage) no tensor-parallel collective runs for the routed
  experts at all;
- with the experts split over tp (``--etp`` = ``--tp``, the default, with ``--ep`` above
  1) the rows a rank received are gathered over its tp group, each rank runs its shard
  of the experts' columns on all of them, and the partial outputs are reduce-scattered
  back to the ranks that received them (``RowsOverTp``: Megatron-Core's all-to-all
  dispatcher gathers and scatters them over the expert tp group so).

Shared experts stay split over tp as a dense MLP is (Megatron-Core's ``SharedExpertMLP``
on the tp group): they gather the sequence for themselves and reduce-scatter their output
(``executor.tensor_parallel.transformer_block_plan``).

What a shard alone does not see is made whole here, so that a step still equals the
one-process reference:

- the balance loss's counts: a sequence's choices are summed over the tp group (no gradient
  flows through a count), each rank adding its tokens' share of the mean scores
  (``SequenceShardRouting.counts_of_sequences``), as Megatron-Core sums its sequence-wise
  auxiliary loss's counts over the tp x cp group;
- the capacity: a copy's place in its expert's queue counts the copies the earlier shards
  of its sequence sent to that expert (``copies_before``);
- the weights every rank holds whole but feeds only its shard (the router's, the shared
  experts' gate): their gradients are summed over tp (``sum_grad_over_tp``), as
  Megatron-Core marks them ``sequence_parallel`` and all-reduces them over tp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

# The functional collectives DTensor calls, which tensor parallelism's timer wraps
# (executor.tensor_parallel.TpTimer), and ``RowsOverTp`` calls too: the ``*_single`` names in
# current torch, the ``*_tensor`` names in releases before them (2.11, say), which have no ``*_single``.
TIMED_COLLECTIVES = (("all_reduce", "all_gather_single", "reduce_scatter_single")
                     if hasattr(funcol, "all_gather_single")
                     else ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor"))
_GATHER, _SCATTER = TIMED_COLLECTIVES[1:]


class TpPlace:
    """This rank's tp group, its ``index`` in it and the group's size ``parts``."""

    def __init__(self, tp_mesh: DeviceMesh) -> None:
        self.group = tp_mesh.get_group()
        self.index, self.parts = tp_mesh.get_local_rank(), tp_mesh.size()


class SequenceShardRouting(TpPlace):
    """This tp rank's shard of every sequence (``index`` of ``parts`` contiguous ones) and
    the group its routers complete their counts over."""

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


class RowsOverTp(TpPlace):
    """The expert tensor-parallel exchange around experts split over tp: every rank's
    received rows gathered over the tp group before the experts (``gather``), each rank's
    rows of the experts' partial outputs summed back to it after them (``scatter``).
    Ranks receive different numbers of rows, so each pads its rows to the group's most
    for the collective (the rows' counts travel first, untimed, as the all-to-all's do);
    the collectives themselves are the functional ones tensor parallelism's timer times
    (``executor.tensor_parallel.TpTimer``), so a run's calibration counts them as tp's."""

    def counts(self, rows: int, device: torch.device) -> list[int]:
        """Every tp rank's number of rows, in rank order."""
        mine = torch.tensor([rows], dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(self.parts)]
        dist.all_gather(every, mine, group=self.group)
        return [int(count) for count in every]

    def gather(self, rows: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Every tp rank's ``rows`` and their ``experts`` (rank order), and the counts."""
        counts = self.counts(len(rows), rows.device)
        gathered = GatherRows.apply(rows, counts, self)
        padded = _padded(experts.unsqueeze(-1), max(counts))
        every = [torch.empty_like(padded) for _ in range(self.parts)]
        dist.all_gather(every, padded, group=self.group)
        return gathered, torch.cat([part[:count, 0] for part, count in zip(every, counts, strict=True)]), counts

    def scatter(self, outputs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's rows of ``outputs`` (every rank's rows in rank order, each rank's
        partial sums) summed over the tp group."""
        return ScatterRows.apply(outputs, counts, self)

    def all_gather(self, padded: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``padded`` (``max(counts)`` rows) of every rank, unpadded, in rank order."""
        every = getattr(funcol, _GATHER)(padded.contiguous(), 0, self.group)
        every = every.wait() if isinstance(every, funcol.AsyncCollectiveTensor) else every
        width = max(counts)
        return torch.cat([every[rank * width:rank * width + count] for rank, count in enumerate(counts)])

    def reduce_scatter(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's ``counts[index]`` rows of ``rows`` (every rank's, in rank order),
        summed over the group."""
        width = max(counts)
        starts = [sum(counts[:rank]) for rank in range(self.parts)]
        stacked = torch.cat([_padded(rows[start:start + count], width)
                             for start, count in zip(starts, counts, strict=True)])
        mine = getattr(funcol, _SCATTER)(stacked.contiguous(), "sum", 0, self.group)
        mine = mine.wait() if isinstance(mine, funcol.AsyncCollectiveTensor) else mine
        return mine[:counts[self.index]]


def _padded(rows: torch.Tensor, width: int) -> torch.Tensor:
    """``rows`` with zero rows after them up to ``width``."""
    return torch.cat((rows, rows.new_zeros((width - len(rows), *rows.shape[1:]))))


class GatherRows(torch.autograd.Function):
    """All-gather of uneven rows over the tp group; backward: each rank's rows of the
    gradient summed over the group (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, counts: list[int], over: RowsOverTp) -> torch.Tensor:
        ctx.counts, ctx.over = counts, over
        return over.all_gather(_padded(rows, max(counts)), counts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.over.reduce_scatter(grad, ctx.counts), None, None


class ScatterRows(torch.autograd.Function):
    """Reduce-scatter of uneven rows over the tp group; backward: the gradient of every
    rank's rows gathered (an all-gather)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, counts: list[int], over: RowsOverTp) -> torch.Tensor:
        ctx.counts, ctx.over = counts, over
        return over.reduce_scatter(rows, counts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.over.all_gather(_padded(grad, max(ctx.counts)), ctx.counts), None, None


class SummedOverTp(torch.autograd.Function):
    """Identity forward; the gradient summed over ``group`` in the backward (a weight
    every tp rank holds whole and applies to its own tokens). Not
    ``executor.tensor_parallel.ReduceGradFrom``, whose functional all-reduce the tp timer
    times as a layer's collective: this one, which the simulator does not price (a
    router's weights are small), stays in the measured compute, as the count exchanges do."""

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
