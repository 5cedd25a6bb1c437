"""Mixed precision as people train: low-precision compute over float32 master weights.

``--dtype bfloat16`` or ``float16`` keeps every weight, gradient and optimizer state in
float32 and runs each stage's forward (and so its backward) under ``torch.autocast``
in that type, as torch's AMP recipe does; the loss is computed from the head's output
cast back to float32 and accumulated in float32, as Megatron-LM does by default (its
``fp16_lm_cross_entropy`` is off). Activations and their gradients cross stages in the
low-precision type (half the bytes on the wire); the receiving stage casts them back up,
so the residual stream stays float32 except for that one rounding per stage boundary.

float16's narrow range needs dynamic loss scaling (Micikevicius et al., "Mixed Precision
Training", ICLR 2018): ``LossScaler`` follows ``torch.amp.GradScaler`` (initial scale
2^16, halve and skip the step on an inf/nan gradient, double after 2000 clean steps),
with one change a pipeline needs: the ranks hold different stages, so whether any
gradient overflowed is all-reduced over the whole job and every rank skips together.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from executor.config import MIXED_DTYPES, RunConfig
from executor.data_parallel import local_tensor


class Precision:
    """Where a step changes type: the stage's forward under autocast, its input cast up
    to the master type, its output cast down to the wire type, the loss in the master
    type. Outside bf16/fp16 (and for ``Precision()``) it changes nothing: stages run in
    the type they were built in, as a user's own stages may be."""

    def __init__(self, config: RunConfig | None = None, device: torch.device | None = None) -> None:
        mixed = config is not None and config.dtype in MIXED_DTYPES
        self.compute = getattr(torch, config.dtype) if mixed else None
        self.device_type = device.type if device is not None else "cpu"
        self.master = getattr(torch, config.master_dtype) if mixed else None
        self.wire = self.compute

    def forward(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``module(x)`` with a floating ``x`` cast up to the master type, under autocast."""
        if self.master is not None and x.is_floating_point() and x.dtype != self.master:
            x = x.to(self.master)
        if self.compute is None:
            return module(x)
        with torch.autocast(self.device_type, dtype=self.compute):
            return module(x)

    def for_loss(self, output: torch.Tensor) -> torch.Tensor:
        """The last stage's output as the loss sees it: in the master type, outside autocast."""
        return output if self.master is None else output.to(self.master)

    def to_wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """An activation as it leaves its stage (sent, or handed to a local stage)."""
        return tensor if self.wire is None else tensor.to(self.wire)


class LossScaler:
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s defaults and rules.

    The runtime multiplies the last stage's loss by ``scale`` before its backward, so
    every gradient of the step (those on the wire included) is scaled; ``unscale``
    divides them back and says whether any was inf/nan on *any* rank; ``update`` then
    halves the scale after an overflow, or doubles it after ``growth_interval`` clean
    steps in a row. A disabled scaler (bf16, fp32) keeps the scale at 1 and never skips.
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.clean_steps = 0

    def unscale(self, grads: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None) -> bool:
        """Divide ``grads`` by the scale in place; return whether any gradient of the
        job (all-reduced over ``group``, default the whole job) is inf or nan."""
        if not self.enabled:
            return False
        # GradScaler multiplies by the float32 reciprocal; the scale is a power of two,
        # so this is exact and the same bits as its kernel. One flag per rank, kept on
        # the gradients' device so the check adds no host sync per tensor.
        found = None
        with torch.no_grad():
            for grad in grads:
                if grad is None:
                    continue
                grad = local_tensor(grad)
                overflow = (~torch.isfinite(grad)).any()
                found = overflow if found is None else found | overflow
                grad.mul_(torch.tensor(1.0 / self.scale, dtype=torch.float32, device=grad.device))
        flag = torch.zeros(1) if found is None else found.float().reshape(1)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            if dist.get_backend(group) == "nccl" and flag.device.type != "cuda":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def update(self, found_inf: bool) -> None:
        """After a step: back off on overflow, grow after enough clean steps."""
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0
