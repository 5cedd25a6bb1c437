"""How long fused (flash) attention takes, from measured throughput by shape.

A flash-attention kernel runs one block of queries per SM at a time, walking the keys, so
its throughput grows with the work in flight (sequences x heads on a rank) and with the
sequence (a longer walk per block): the H200 table (``pipesim/model/data``) has causal
forward + backward at 87 TFLOP/s for 8 heads of 2048 tokens and 529 for 64 heads of 8192.
Rather than a kernel model with its own unknowns, the measured throughput is interpolated
(bilinear in log sequence and log parallel heads, clamped at the edges of the grid:
beyond its largest shapes a kernel's throughput has levelled off). Causal kernels skip the
masked half, so their work is half of QK^T and PV; the backward is 2.5x the forward's
FLOPs (recomputing the scores, then dV, dP, dQ, dK), the convention the table is written in.
"""

from __future__ import annotations

import bisect
import csv
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pipesim.model.operations import FlashAttention

BACKWARD_FLOPS = 2.5  # the backward's FLOPs over the forward's (the table's convention)


class AttentionTableError(ValueError):
    """Attention timings that do not make a table."""


@dataclass(frozen=True)
class AttentionTiming:
    """One measured causal attention: ``batch`` sequences of ``seq`` tokens, ``heads``
    heads of ``head_dim``; forward seconds and forward + backward seconds."""

    seq: int
    heads: int
    head_dim: int
    batch: int
    forward_seconds: float
    forward_backward_seconds: float

    @property
    def forward_flops(self) -> float:
        """QK^T and PV over the causal half: ``2 b a s^2 d``."""
        return 2.0 * self.batch * self.heads * self.seq * self.seq * self.head_dim


@dataclass(frozen=True)
class AttentionTable:
    """Forward and backward FLOP/s of causal flash attention on a grid of sequence
    lengths x parallel heads (``batch * heads``), from measured timings."""

    seqs: tuple[int, ...]
    heads: tuple[float, ...]
    forward_rate: tuple[tuple[float, ...], ...]  # [seq][heads], FLOP/s
    backward_rate: tuple[tuple[float, ...], ...]

    @classmethod
    def from_timings(cls, timings: Iterable[AttentionTiming], where: str = "attention timings") -> AttentionTable:
        """The table of ``timings``, which must cover every (sequence, heads) pair of a grid."""
        cells: dict[tuple[int, float], tuple[float, float]] = {}
        for timing in timings:
            if not (0 < timing.forward_seconds < timing.forward_backward_seconds
                    and math.isfinite(timing.forward_backward_seconds)):
                raise AttentionTableError(f"{where}: seq {timing.seq}, heads {timing.heads}: forward "
                                          f"{timing.forward_seconds} s must be > 0 and below forward + backward "
                                          f"{timing.forward_backward_seconds} s")
            backward = timing.forward_backward_seconds - timing.forward_seconds
            cells[timing.seq, float(timing.batch * timing.heads)] = (
                timing.forward_flops / timing.forward_seconds,
                BACKWARD_FLOPS * timing.forward_flops / backward)
        if not cells:
            raise AttentionTableError(f"{where}: no attention timings")
        seqs = tuple(sorted({seq for seq, _ in cells}))
        heads = tuple(sorted({count for _, count in cells}))
        missing = [(seq, count) for seq in seqs for count in heads if (seq, count) not in cells]
        if missing:
            raise AttentionTableError(f"{where}: timings must cover a grid of sequences x heads; missing "
                                      f"seq {missing[0][0]} with {missing[0][1]:g} heads")
        return cls(seqs, heads,
                   tuple(tuple(cells[seq, count][0] for count in heads) for seq in seqs),
                   tuple(tuple(cells[seq, count][1] for count in heads) for seq in seqs))

    def rates(self, seq: float, parallel_heads: float) -> tuple[float, float]:
        """(forward, backward) FLOP/s at ``seq`` tokens and ``parallel_heads``."""
        row, row_weight = _position(self.seqs, seq)
        column, column_weight = _position(self.heads, parallel_heads)
        return (_bilinear(self.forward_rate, row, row_weight, column, column_weight),
                _bilinear(self.backward_rate, row, row_weight, column, column_weight))

    def seconds(self, attention: FlashAttention, rate_scale: float = 1.0) -> tuple[float, float]:
        """(forward, backward) seconds of ``attention`` on a GPU ``rate_scale`` times as fast
        as the one measured."""
        work = attention.flops / 2 if attention.causal else attention.flops  # flops counts the whole square
        forward_rate, backward_rate = self.rates(attention.seq, attention.batch * attention.heads)
        return work / (forward_rate * rate_scale), BACKWARD_FLOPS * work / (backward_rate * rate_scale)


def _position(grid: tuple, value: float) -> tuple[int, float]:
    """Index of the grid cell holding ``value`` and its weight toward the next point, in
    log space; clamped to the grid."""
    if len(grid) == 1 or value <= grid[0]:
        return 0, 0.0
    if value >= grid[-1]:
        return len(grid) - 2, 1.0
    index = bisect.bisect_right(grid, value) - 1
    return index, math.log(value / grid[index]) / math.log(grid[index + 1] / grid[index])


def _bilinear(values: tuple[tuple[float, ...], ...], row: int, row_weight: float, column: int,
              column_weight: float) -> float:
    """Interpolate ``log(values)`` between the four corners of a cell."""
    def at(i: int, j: int) -> float:
        return math.log(values[min(i, len(values) - 1)][min(j, len(values[0]) - 1)])

    top = (1 - column_weight) * at(row, column) + column_weight * at(row, column + 1)
    bottom = (1 - column_weight) * at(row + 1, column) + column_weight * at(row + 1, column + 1)
    return math.exp((1 - row_weight) * top + row_weight * bottom)


def read_attention_csv(path: Path) -> AttentionTable:
    """The table of a CSV with ``seq, heads, head_dim, batch, fwd_s, fwd_bwd_s`` columns."""
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    try:
        timings = [AttentionTiming(int(row["seq"]), int(row["heads"]), int(row["head_dim"]), int(row["batch"]),
                                   float(row["fwd_s"]), float(row["fwd_bwd_s"])) for row in rows]
    except (KeyError, ValueError) as error:
        raise AttentionTableError(f"{path}: needs numeric seq, heads, head_dim, batch, fwd_s, fwd_bwd_s columns "
                                  f"({error})") from None
    return AttentionTable.from_timings(timings, str(path))
