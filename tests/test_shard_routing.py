"""The tp exchanges of shard routing (``executor.shard_routing``) on 2 gloo ranks, against
values by hand: uneven rows gathered over tp and partial outputs summed back (forward
and backward, a rank with no rows included), and a sequence's counts completed over its
shards."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from executor.shard_routing import RowsOverTp, SequenceShardRouting
from executor.spawn import launch_ranks

pytestmark = pytest.mark.timeout(300)

WIDTH = 3


def rows_of(rank: int, count: int) -> torch.Tensor:
    """Rank ``rank``'s ``count`` rows: distinct values, ``100 * rank`` apart."""
    return torch.arange(count * WIDTH, dtype=torch.float64).view(count, WIDTH) + 100 * rank


def exchange_on_two_ranks(counts: tuple[int, int]) -> dict:
    """Gather this rank's rows over a 2-rank tp group, weight what it gathered by
    ``rank + 1`` (a partial output), scatter it back, and take the gradient of the sum."""
    mesh = init_device_mesh("cpu", (2,))
    rank = mesh.get_local_rank()
    over = RowsOverTp(mesh)
    rows = rows_of(rank, counts[rank]).requires_grad_()
    experts = torch.arange(counts[rank]) + 10 * rank
    gathered, every_expert, gathered_counts = over.gather(rows, experts)
    mine = over.scatter(gathered * (rank + 1), gathered_counts)
    mine.sum().backward()
    shard = SequenceShardRouting(mesh)
    counts_here = torch.tensor([[1, 2], [0, 1]]) if rank == 0 else torch.tensor([[3, 0], [1, 1]])
    return {"gathered": gathered.detach(), "experts": every_expert, "counts": gathered_counts,
            "mine": mine.detach(), "grad": rows.grad, "whole": shard.counts_of_sequences(counts_here),
            "before": shard.copies_before(counts_here)}


@pytest.mark.parametrize("counts", [(2, 5), (3, 0)])
def test_rows_gathered_over_tp_and_partial_outputs_summed_back(counts: tuple[int, int]) -> None:
    results = launch_ranks(exchange_on_two_ranks, (counts,), 2)
    every = torch.cat([rows_of(rank, count) for rank, count in enumerate(counts)])
    for rank, result in results.items():
        assert result["counts"] == list(counts)
        assert torch.equal(result["gathered"], every)
        assert result["experts"].tolist() == [*range(counts[0]), *range(10, 10 + counts[1])]
        # rank 0 weighted its gathered copy by 1, rank 1 by 2: each rank gets 3 x its own rows back
        assert torch.equal(result["mine"], 3 * rows_of(rank, counts[rank]))
        # d(sum of both ranks' outputs)/d(a row) = 1 + 2, through the scatter's gather and the gather's scatter
        assert torch.equal(result["grad"], torch.full((counts[rank], WIDTH), 3.0, dtype=torch.float64))


def test_a_sequences_counts_are_completed_over_its_shards() -> None:
    results = launch_ranks(exchange_on_two_ranks, ((1, 1),), 2)
    for result in results.values():
        assert result["whole"].tolist() == [[4, 2], [1, 2]]
    assert results[0]["before"].tolist() == [[0, 0], [0, 0]]  # the first shard has none before it
    assert results[1]["before"].tolist() == [[1, 2], [0, 1]]  # the second, the first shard's
