"""ZeRO-3 (``--zero 3``): each pipeline stage sharded over its dp replicas with FSDP2's
``fully_shard``, torch's own building block, as torchtitan's ``apply_fsdp`` applies it.

Each block of a stage is its own FSDP unit and the stage (embedding, head and whatever
else it holds) the root: a block's parameters are all-gathered just before its forward
and again before its backward and freed after each (``reshard_after_forward``), and its
gradient is reduce-scattered (averaged over dp) as its backward produces it, every
microbatch: the rule the simulator charges for ``--zero 3`` (``pipesim.sim.parallel``).
The parameters, gradients and optimizer state of a replica are its ``1/dp`` shards
(DTensors sharded on dim 0 over the dp mesh axis). The data-parallel averager does not
run: FSDP reduces the gradients itself.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard


def shard_stage(stage: nn.Module, mesh: DeviceMesh) -> None:
    """``fully_shard`` each block of ``stage`` over ``mesh`` (the dp axis), then the stage."""
    for block in getattr(stage, "blocks", ()):
        fully_shard(block, mesh=mesh)
    fully_shard(stage, mesh=mesh)
