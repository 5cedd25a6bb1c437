"""Time single kernels on this device: GEMMs and causal attention of given shapes, for
``pipesim profile --compute-model`` to fit a compute model on the user's GPU.

Each measurement runs the kernel ``repeats`` times back to back after ``warmup`` calls
and divides, in three rounds, keeping the least: on a GPU between two CUDA events on
the stream, so the host launches ahead of the device as it does in training and the
time is the device's, not one launch's; on a CPU by the thread's CPU time
(``executor.profile.clock_for_compute``). A GEMM is timed in the layouts a linear layer
runs it (``torch.nn.Linear``, ``F.linear``: the weight stored ``n x k``): the forward
``x @ w^T``, the backward's input gradient ``dy @ w`` and weight gradient ``dy^T @ x``.
The layout matters on a GPU: on an H200, ``x @ w^T`` at 8192 x 1024 x 4096 ran at 427
TFLOP/s where ``x @ w`` with the weight stored ``k x n`` ran at 558 (docs/cluster-model.md,
FP8 GEMMs), so a model fitted to the other layout predicts training's GEMMs fast.
Attention is
``scaled_dot_product_attention`` with a causal mask, forward alone and forward +
backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as functional

from executor.profile import clock_for_compute


def _seconds_per_call(run: Callable[[], object], device: torch.device, warmup: int, repeats: int,
                      rounds: int = 3) -> float:
    """The least, over ``rounds``, of the mean time of ``repeats`` calls: what the kernel
    costs when nothing else interrupts it (as ``timeit`` reports), so that a shared
    machine's noise does not make a forward outlast its forward + backward."""
    for _ in range(warmup):
        run()
    now = clock_for_compute(device)
    best = float("inf")
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = now()
        for _ in range(repeats):
            run()
        best = min(best, (now() - start) / repeats)
    return best


def time_gemms(shapes: Sequence[tuple[int, int, int]], device: torch.device, dtype: torch.dtype,
               warmup: int = 3, repeats: int = 10) -> list[tuple[float, float]]:
    """(forward, backward) seconds of a linear layer's GEMMs for each ``(m, k, n)`` in
    ``shapes``: ``m`` rows of ``k`` inputs to ``n`` outputs (see the module)."""
    timings = []
    for m, k, n in shapes:
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype)  # as nn.Linear stores its weight
        dy = torch.randn(m, n, device=device, dtype=dtype)
        forward = _seconds_per_call(lambda x=x, w=w: x @ w.T, device, warmup, repeats)
        backward = _seconds_per_call(lambda x=x, w=w, dy=dy: (dy @ w, dy.T @ x), device, warmup, repeats)
        timings.append((forward, backward))
        del x, w, dy
    return timings


def time_attention(shapes: Sequence[tuple[int, int, int, int]], device: torch.device, dtype: torch.dtype,
                   warmup: int = 3, repeats: int = 10) -> list[tuple[float, float]]:
    """(forward, forward + backward) seconds of causal attention for each
    ``(batch, heads, seq, head_dim)`` in ``shapes``."""
    timings = []
    for batch, heads, seq, head_dim in shapes:
        q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype)

        def forward(q=q, k=k, v=v):
            with torch.no_grad():
                return functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        def forward_backward(q=q, k=k, v=v, grad=grad):
            out = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return torch.autograd.grad(out, (q, k, v), grad)

        timings.append((_seconds_per_call(forward, device, warmup, repeats),
                        _seconds_per_call(forward_backward, device, warmup, repeats)))
        del q, k, v, grad
    return timings
