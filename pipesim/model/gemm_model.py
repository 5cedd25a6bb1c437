"""How long a GEMM takes on a GPU, from its shape, and fitting that model to timings.

A GEMM ``C = A B`` (``m x k`` by ``k x n``) is cut into output tiles of ``tm x tn``; each
streaming multiprocessor (SM) computes one tile at a time, walking the ``k`` dimension
(NVIDIA, *Deep Learning Performance Guide*, "Matrix Multiplication Background": tile and
wave quantization). So a GEMM of a given FLOP count is slower when

- its edges do not fill whole tiles (**tile quantisation**: ``ceil(m/tm) * ceil(n/tn)``
  tiles, the last ones padded);
- its tiles do not fill whole waves of SMs (**wave quantisation**: ``ceil(tiles / sms)``
  waves, the last one leaving SMs idle) — what makes a layer's GEMMs sharded over 8
  tensor-parallel ranks run far below the same layer on one;
- its ``k`` is short: every tile pays a fixed prologue and epilogue, ``k_overhead``
  elements' worth of its ``k`` loop;

and none is faster than the bytes it moves (A and B read, C written once at HBM bandwidth)
or than the host can launch it (``launch_seconds``). A full wave of long tiles reaches
``efficiency`` of the datasheet peak (sustained clocks under load, instruction overheads).
The library picks its tile; the model takes the fastest of ``TILES``, cuBLAS's common
CTA tiles on Ampere and Hopper::

    time = max(waves * 2 tm tn (k + k_overhead) / (efficiency * peak / sms),
               bytes / (HBM bandwidth * HBM efficiency), launch_seconds)

A GEMM whose ``k`` loop runs ``mainloop_speedup`` times as fast (FP8 tensor cores,
``pipesim.model.compute_model``) speeds up only that loop: the prologue and epilogue
(``k_overhead``, in BF16's units of ``k``) stay as they were, so ``k`` becomes
``k / mainloop_speedup + k_overhead`` and a short-``k`` GEMM gains less than a long one.

``fit_gemm_model`` finds ``efficiency``, ``k_overhead`` and ``launch_seconds`` from measured
GEMM timings: the shipped H200 table (``pipesim/model/data``) and ``pipesim profile
--compute-model`` on the user's own GPU both go through it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipesim.model import memory_traffic

TILES = ((256, 128), (128, 256), (128, 128), (256, 64), (64, 256), (128, 64), (64, 128), (64, 64))
KERNEL_BOUND = 3.0  # timings at least this many launch floors long say something about the kernel
K_OVERHEAD_GRID = tuple(range(0, 1025, 16))
EFFICIENCY_RANGE = (0.001, 1.0)


class GemmFitError(ValueError):
    """Timings that cannot determine a GEMM model."""


@dataclass(frozen=True)
class GemmModel:
    """One GPU's GEMMs: its figures (``peak_flops``, HBM ``memory_bandwidth``, ``sms``)
    and the three fitted numbers (see the module docstring)."""

    peak_flops: float
    memory_bandwidth: float
    sms: int
    efficiency: float
    k_overhead: float
    launch_seconds: float
    mainloop_speedup: float = 1.0  # the k loop's speed over BF16's (FP8: pipesim.model.compute_model)

    def seconds(self, m: float, k: float, n: float, count: float = 1, element_bytes: int = 2,
                output_bytes: int | None = None) -> float:
        """Seconds of ``count`` ``m x k`` by ``k x n`` products run as one batched kernel,
        the operands ``element_bytes`` wide and the output ``output_bytes`` (default: the same)."""
        k_loop = k / self.mainloop_speedup + self.k_overhead
        compute = tile_seconds(m, n, count, self.peak_flops, self.sms) * k_loop / self.efficiency
        output = element_bytes if output_bytes is None else output_bytes
        memory = memory_traffic.memory_seconds(count * (element_bytes * (m * k + k * n) + output * m * n),
                                               self.memory_bandwidth)
        return max(compute, memory, self.launch_seconds)


def tile_seconds(m: float, n: float, count: float, peak_flops: float, sms: int) -> float:
    """Seconds per unit of ``k`` at full peak of the best tiling of an ``m x n`` output
    (``count`` of them): waves x one tile's FLOPs per ``k`` / one SM's peak. The best tile
    does not depend on ``k``, the efficiency or the overhead, so fitting can compute it once."""
    per_sm = peak_flops / sms
    best = math.inf
    for tile_m, tile_n in TILES:
        tiles = math.ceil(count * math.ceil(m / tile_m) * math.ceil(n / tile_n))
        best = min(best, math.ceil(tiles / sms) * 2.0 * tile_m * tile_n / per_sm)
    return best


@dataclass(frozen=True)
class GemmTiming:
    """A measured time of GEMMs run back to back (``shapes``: ``(m, k, n)`` each): a
    forward ``x @ w`` is one, a backward its input- and weight-gradient GEMMs."""

    shapes: tuple[tuple[float, float, float], ...]
    seconds: float


def backward_shapes(m: float, k: float, n: float) -> tuple[tuple[float, float, float], ...]:
    """The two GEMMs of ``m x k`` by ``k x n``'s backward: the input gradient
    (``m x n`` by ``n x k``) and the weight gradient (``k x m`` by ``m x n``)."""
    return ((m, n, k), (k, m, n))


def fit_gemm_model(timings: Sequence[GemmTiming], peak_flops: float, memory_bandwidth: float, sms: int,
                   element_bytes: int = 2) -> GemmModel:
    """The GEMM model of a GPU (``peak_flops``, ``memory_bandwidth``, ``sms``) that best
    explains ``timings``.

    ``launch_seconds`` is the shortest time per GEMM measured (what the smallest shapes
    show is the host, not the GPU). ``k_overhead`` and ``efficiency`` minimise the mean
    squared log error over the timings at least ``KERNEL_BOUND`` launch floors long,
    searched on a grid (steps of 16 elements, and of 0.1% in efficiency from 0.001 to 1)."""
    import numpy as np

    if not timings:
        raise GemmFitError("no GEMM timings to fit")
    for timing in timings:
        if not (math.isfinite(timing.seconds) and timing.seconds > 0) or not timing.shapes:
            raise GemmFitError(f"a GEMM timing must be a positive number of seconds of one or more GEMMs, "
                               f"got {timing}")
    launch = min(timing.seconds / len(timing.shapes) for timing in timings)
    kept = [timing for timing in timings if timing.seconds >= KERNEL_BOUND * launch * len(timing.shapes)]
    if len(kept) < 3:
        raise GemmFitError(f"only {len(kept)} of {len(timings)} GEMM timings are {KERNEL_BOUND:g}x longer than the "
                           f"launch floor ({launch * 1e6:.1f} us): measure larger shapes")
    owner, unit, k_values, memory = [], [], [], []
    for index, timing in enumerate(kept):
        for m, k, n in timing.shapes:
            owner.append(index)
            unit.append(tile_seconds(m, n, 1, peak_flops, sms))
            k_values.append(k)
            memory.append(memory_traffic.memory_seconds(element_bytes * (m * k + k * n + m * n), memory_bandwidth))
    owner_array, unit_array = np.array(owner), np.array(unit)
    k_array, memory_array = np.array(k_values, dtype=float), np.array(memory)
    measured = np.log([timing.seconds for timing in kept])

    def search(efficiencies: np.ndarray, k_overheads: Sequence[float]) -> tuple[float, float, float]:
        best = (math.inf, 0.0, 0.0)
        for k_overhead in k_overheads:
            compute = unit_array * (k_array + k_overhead) / efficiencies[:, None]  # (efficiencies, shapes)
            per_shape = np.maximum(np.maximum(compute, memory_array), launch)
            predicted = np.zeros((len(efficiencies), len(kept)))
            np.add.at(predicted.T, owner_array, per_shape.T)
            errors = np.mean((np.log(predicted) - measured) ** 2, axis=1)
            row = int(np.argmin(errors))
            if errors[row] < best[0]:
                best = (float(errors[row]), float(efficiencies[row]), float(k_overhead))
        return best

    # coarse (5% steps from 0.1% of peak, for a device far from its datasheet figure), then fine (0.1%)
    _, coarse, _ = search(np.geomspace(EFFICIENCY_RANGE[0], EFFICIENCY_RANGE[1], 142), K_OVERHEAD_GRID)
    fine = np.clip(coarse * np.geomspace(1 / 1.06, 1.06, 117), EFFICIENCY_RANGE[0], EFFICIENCY_RANGE[1])
    best = search(fine, K_OVERHEAD_GRID)
    _, efficiency, k_overhead = best
    return GemmModel(peak_flops, memory_bandwidth, sms, efficiency, k_overhead, launch)
