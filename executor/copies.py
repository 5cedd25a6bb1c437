"""DualPipe's two copies of the model: which model stage a pipeline stage runs, and each
stage's gradient summed with its other copy's.

DualPipe (``schedules.generators.dualpipe``) runs copy 0 of the model from rank 0 to
rank ``pp - 1`` and copy 1 the other way, half of the microbatches each: pipeline stage
``s`` is model stage ``s mod pp`` of copy ``s // pp``, so rank ``r`` holds model stage
``r`` of copy 0 and model stage ``pp - 1 - r`` of copy 1, and rank ``pp - 1 - r`` the
same two model stages of the other copies. Both copies start from the same weights
(a model stage is built the same whatever copy asks for it) and stay equal: before the
optimizer step each rank adds its gradients to its mirror rank's, one all-reduce over
the pair of both stages' gradients, so each copy steps with the whole batch's gradient,
as the one-process reference does (with data parallelism, after the replicas' average).
Here the all-reduce follows the rank's program; the simulator may overlap it with the
backward (its dp stream), as DeepSeek's runs do.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from executor.mesh import MeshPosition
from schedules.schedule import Schedule


def model_stage(schedule: Schedule, stage: int) -> int:
    """The model stage pipeline stage ``stage`` runs (itself without copies)."""
    return stage % schedule.copy_stages


def copy_of(schedule: Schedule, stage: int) -> int:
    """Which copy of the model pipeline stage ``stage`` belongs to."""
    return stage // schedule.copy_stages


def data_index(schedule: Schedule, stage: int, microbatch: int) -> int:
    """Which of the step's microbatches ``microbatch`` of ``stage``'s copy of the model
    is: copy ``c`` takes the ``c``-th share of them (one copy: the same index)."""
    return copy_of(schedule, stage) * schedule.microbatches + microbatch


class CopyReducer:
    """The all-reduce of a rank's stages' gradients with its mirror rank's in its own
    pipeline (pipeline rank ``pp - 1 - r``, at the same dp position): one process group
    per pair, made alike on every rank. With data parallelism it follows the replicas'
    average, so each copy steps with the mean over replicas of both copies' sums."""

    def __init__(self, schedule: Schedule, position: MeshPosition, stages: dict[int, nn.Module],
                 timeout: float) -> None:
        pp = schedule.pp
        self.group = None
        for dp_index in range(position.dp):  # new_group is called alike on every rank, in one order
            for first in range(pp // 2):
                pair = [position.rank_at(index, dp_index, position.cp_index, position.tp_index)
                        for index in (first, pp - 1 - first)]
                group = dist.new_group(pair, timeout=timedelta(seconds=timeout))
                if dp_index == position.dp_index and position.pp_index in (first, pp - 1 - first):
                    self.group = group
        # both ranks of a pair list the same model stages' parameters in the same order
        self.order = sorted(stages, key=lambda stage: model_stage(schedule, stage))
        self.stages = stages

    def reduce(self) -> tuple[float, float]:
        """Sum every parameter's gradient with its other copy's; (start, end) host seconds."""
        params = [param for stage in self.order for param in self.stages[stage].parameters()]
        start = time.perf_counter()
        grads = [param.grad if param.grad is not None else torch.zeros_like(param) for param in params]
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        dist.all_reduce(flat, group=self.group)
        for param, grad, summed in zip(params, grads, flat.split([grad.numel() for grad in grads]), strict=True):
            param.grad = grad.copy_(summed.view_as(grad))  # back into the gradient's own storage
        return start, time.perf_counter()
