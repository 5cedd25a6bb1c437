"""Data parallelism: average each stage's gradients across its dp replicas once a step.

Every replica runs the same pipeline on its own slice of the global batch and
accumulates its stages' gradients over its microbatches. A stage's gradients are final
once its *last* backward (``B``, or ``W`` when backward is split) has run, so that is
when its reduction starts: the gradients are flattened into DDP-style buckets (25 MiB by
default, in reverse parameter order, as DDP orders them) and each bucket is all-reduced
asynchronously on the dp group of the mesh while the rank goes on with the rest of its
program (on an interleaved schedule, the backward of its other stages). The step waits
for the reductions just before the optimizer. This is the overlap rule the simulator
charges (``pipesim.sim.parallel``: a stage's dp all-reduce starts when its last backward
ends).

Why not torch's wrappers: on torch 2.13 ``DistributedDataParallel`` cannot wrap a
stage whose parameters are DTensors (after ``parallelize_module`` for tp, its
constructor fails with "aten.cat.default got mixed torch.Tensor and DTensor"). The
composable ``replicate`` (FSDP2-based, ``replicate_with_fsdp``) does accept a tp-split
block on a dp sub-mesh on gloo, but like DDP it reduces inside the backward call and
waits for its buckets at that call's end, so a stage's reduction could not overlap the
rank's other stages, and its per-forward hooks would have to be steered through every
microbatch and the I/W split. The reduction here is the same bucketed ``all_reduce``
DDP issues, on the DTensors' local shards: a tp shard is averaged with the same shard
of every other replica, which is exactly the dp sub-mesh of the (dp, pp, tp) mesh.

The reduction's type (``--grad-reduce-dtype``) is the master gradients' type by default
(float32), as DDP reduces in the gradients' own type; ``bfloat16`` halves the bytes on
the wire at the cost of rounding each replica's gradient and the sum, which is what
Megatron-LM's ``--grad-reduce-in-bf16`` does. The bucket is cast to that type before the
all-reduce and the average is written back into the float32 gradients.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from schedules.action import WEIGHT_GRAD_DONE_KINDS, Action

DEFAULT_BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb=25


class BucketReduction(NamedTuple):
    """One bucket in flight: its flat buffer, the gradients it came from, the work
    handle, and ``times = [start, end]`` in ``time.perf_counter`` seconds."""

    stage: int
    flat: torch.Tensor
    grads: list[torch.Tensor]
    work: dist.Work
    times: list[float]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor (the tensor itself when it is a plain one)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def bucket_parameters(module: nn.Module, bucket_bytes: float,
                      keep: Callable[[nn.Parameter], bool] | None = None) -> list[list[nn.Parameter]]:
    """Parameters in reverse order (the order backward produces their gradients),
    packed into buckets of at most ``bucket_bytes`` (a larger parameter gets its own);
    only those ``keep`` accepts, when given."""
    buckets: list[list[nn.Parameter]] = []
    size = 0.0
    for param in reversed([p for p in module.parameters() if p.requires_grad and (keep is None or keep(p))]):
        nbytes = local_tensor(param.detach()).numel() * param.element_size()
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0.0
        buckets[-1].append(param)
        size += nbytes
    return buckets


class GradientAverager:
    """Starts each stage's bucketed gradient all-reduce after its last backward and
    finishes them all (divide by dp, copy back) before the optimizer step."""

    def __init__(self, stages: dict[int, nn.Module], program: tuple[Action, ...], group: dist.ProcessGroup,
                 replicas: int, bucket_bytes: float = DEFAULT_BUCKET_BYTES,
                 reduce_dtype: torch.dtype | None = None, keep: Callable[[nn.Parameter], bool] | None = None) -> None:
        # ``keep``: the parameters this averager reduces (expert parallelism reduces the
        # experts' over another group, executor.expert_parallel); None: all of them.
        self.group = group
        self.replicas = replicas
        self.reduce_dtype = reduce_dtype  # None: the gradients' own type
        self.last_backward = {action.stage: action for action in program if action.kind in WEIGHT_GRAD_DONE_KINDS}
        self.buckets = {stage: bucket_parameters(module, bucket_bytes, keep) for stage, module in stages.items()}
        self.in_flight: list[BucketReduction] = []

    def after_action(self, action: Action) -> None:
        """Runtime hook: start a stage's reduction as soon as its last backward is done."""
        if self.last_backward.get(action.stage) == action:
            self.start(action.stage)

    def start(self, stage: int) -> None:
        """Post one asynchronous all-reduce per bucket of ``stage``'s gradients."""
        for bucket in self.buckets[stage]:
            grads = []
            for param in bucket:
                if param.grad is None:  # unused in this step: contribute zeros like DDP
                    param.grad = torch.zeros_like(param)
                grads.append(local_tensor(param.grad))
            flat = torch.cat([grad.reshape(-1) for grad in grads])
            if self.reduce_dtype is not None:
                flat = flat.to(self.reduce_dtype)
            times = [time.perf_counter()]
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            work.get_future().add_done_callback(lambda _future, times=times: times.append(time.perf_counter()))
            self.in_flight.append(BucketReduction(stage, flat, grads, work, times))

    def finish(self) -> list[tuple[int, float, float]]:
        """Wait for every reduction, write the averaged gradients back, and return
        ``(stage, start, end)`` per bucket (``time.perf_counter`` seconds)."""
        started = {reduction.stage for reduction in self.in_flight}
        for stage in self.buckets:
            if stage not in started:  # a stage with no backward here: still reduce it
                self.start(stage)
        timings = []
        with torch.no_grad():
            for reduction in self.in_flight:
                reduction.work.wait()
                if len(reduction.times) < 2:
                    reduction.times.append(time.perf_counter())
                # Average in the gradients' own type, whatever type the sum travelled in.
                flat = reduction.flat.to(reduction.grads[0].dtype).div_(self.replicas)
                offset = 0
                for grad in reduction.grads:
                    count = grad.numel()
                    grad.copy_(flat[offset:offset + count].view_as(grad))
                    offset += count
                timings.append((reduction.stage, reduction.times[0], reduction.times[1]))
        self.in_flight = []
        return timings
