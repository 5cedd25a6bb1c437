"""Gradient clipping by the global norm (``--clip-grad``), as every training stack runs
it (Megatron-LM's ``--clip-grad``, torchtitan's ``max_norm``, DeepSeek-V3: 1.0).

The norm is the whole model's: ``sqrt(sum of every gradient element squared)``, each
element counted once. A pipelined job holds the gradient spread over its ranks and in
places more than once, so each rank sums the squares of what its optimizer steps, each
tensor divided by how many ranks hold that same tensor, and one all-reduce over every
rank adds them up:

- a stage's gradient lives on its pipeline rank only;
- a tensor-parallel split (a DTensor sharded on the ``tp`` axis) is a different piece on
  each tp rank; a parameter tp leaves whole (norms, embeddings) is held by every tp rank;
- averaged by data parallelism without ZeRO, a gradient is held by every member of the
  group that averaged it (dp, with cp dp x cp, with DualPipe both copies' holders, for
  routed experts their expert data-parallel group); under ZeRO-1/2 each member steps its
  own shard, under ZeRO-3 FSDP's local shard, held once;
- a tied model's two embedding copies hold one gradient (``executor.tied_embeddings``).

Then, as ``torch.nn.utils.clip_grad_norm_``: every gradient the optimizer steps is
multiplied by ``min(1, max_norm / (norm + 1e-6))``. The one-process reference runs the
same function on its own gradients (no reduction), so a run clips by the reference's
factor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from executor.data_parallel import local_tensor

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def tp_copies(param: nn.Parameter, tp: int) -> int:
    """Ranks of one tp group holding ``param``'s whole gradient: 1 where tensor
    parallelism splits it (a DTensor sharded on a ``tp`` mesh axis), else ``tp``."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is not None:
        for name, placement in zip(mesh.mesh_dim_names or (), param.placements, strict=False):
            if name == "tp" and placement.is_shard():
                return 1
    return tp


def clip_gradients(entries: list[tuple[torch.Tensor, float]], max_norm: float,
                   all_reduce: Callable[[torch.Tensor], object] | None = None) -> float:
    """Scale the gradients ``entries`` holds (each with the number of ranks holding the
    same tensor) by ``min(1, max_norm / (norm + 1e-6))``; return the global norm before."""
    device = entries[0][0].device if entries else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for grad, copies in entries:
        total += local_tensor(grad).detach().double().pow(2).sum() / copies
    if all_reduce is not None:
        all_reduce(total)
    norm = total.sqrt().item()
    factor = min(1.0, max_norm / (norm + EPS))
    if factor < 1.0:
        with torch.no_grad():
            for grad, _ in entries:
                local_tensor(grad).mul_(factor)
    return norm
