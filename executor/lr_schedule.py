"""The learning rate over a run's steps: a linear warm-up, then a constant, linear or
cosine decay, as the training stacks schedule it (``--lr-warmup``, ``--lr-decay``,
``--min-lr-ratio``).

Megatron-LM (``OptimizerParamScheduler``) and torchtitan (``lr_scheduler``) both warm the
rate up linearly and then decay it, linearly or along a half cosine, to a floor. The
factor of step ``s`` (0-based) of ``S`` here, times ``--lr``, is torchtitan's
``linear_warmup_stable_decay`` with its decay over every step after the warm-up:

- warm-up, ``s < w``: ``(s + 1) / (w + 1)`` (Megatron's starts at 0 and so wastes its
  first step);
- decay, ``s >= w``: ``p = (s + 1 - w) / (S - w + 1)``, then ``linear`` ``1 - p``,
  ``cosine`` ``(1 + cos(pi p)) / 2``, ``none`` 1, scaled into ``[r, 1]`` as ``r + (1 - r)
  x``, ``r`` the floor as a share of ``--lr`` (torchtitan's ``lr_min``; Megatron-LM's
  ``--min-lr`` over ``--lr``).

The factor is the rate of the step about to be taken: the schedule moves once a step,
after the optimizer, also on a step fp16's loss scaling skipped (the step count is the
run's, as Megatron's iteration count). Every rank and the one-process reference build
the same schedule, so a pipelined run's weights stay the reference's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is loaded by the run, not by the config's checks (which read LR_DECAYS)
    import torch

    from executor.config import RunConfig

LR_DECAYS = ("none", "linear", "cosine")


def lr_factor(step: int, steps: int, warmup: int = 0, decay: str = "none", min_ratio: float = 0.0) -> float:
    """The learning rate's factor at step ``step`` (0-based) of ``steps`` (see the module)."""
    step = min(step, steps)  # the rate after the last step (a scheduler's final move) stays defined
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if decay == "none":
        return 1.0
    progress = (step + 1 - warmup) / (steps - warmup + 1)
    left = 1.0 - progress if decay == "linear" else (1.0 + math.cos(math.pi * progress)) / 2
    return min_ratio + (1.0 - min_ratio) * left


def attach_schedule(optimizer: torch.optim.Optimizer, config: RunConfig) -> torch.optim.lr_scheduler.LambdaLR | None:
    """The schedule ``config`` asks for over ``optimizer``'s rate (``step()`` it after each
    optimizer step); None where the rate stays constant."""
    if config.lr_warmup == 0 and config.lr_decay == "none":
        return None
    import torch  # noqa: PLC0415 - see above

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(
        step, config.steps, config.lr_warmup, config.lr_decay, config.min_lr_ratio))
