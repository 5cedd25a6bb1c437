"""ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models") and FSDP: what each stage shards over the data-parallel replicas, and
when its collectives run in a step.

Memory per parameter, with weights of ``w`` bytes, gradients of ``g`` and ``K`` bytes of
optimizer state (mixed-precision Adam: 2, 2, 12) over ``N_d`` replicas (the paper's
Table 1 and section 5: P_os, P_os+g, P_os+g+p):

    stage 0   w + g + K                      every replica holds everything
    stage 1   w + g + K / N_d                optimizer state sharded (Megatron's distributed optimizer)
    stage 2   w + (g + K) / N_d              gradients sharded too
    stage 3   (w + g + K) / N_d              parameters sharded too (FSDP's full sharding)

When the collectives run (``pipesim.sim.parallel`` prices and places them):

- stage 0: each stage's gradient is all-reduced in buckets during its last backward of
  the step (DDP); stage 1: reduce-scattered instead, and the updated parameters
  all-gathered after the optimizer step.
- stage 2: a replica keeps only its shard of the gradient, so it cannot accumulate a
  whole gradient over the step's microbatches: every backward's gradient is
  reduce-scattered in buckets as it is produced, each microbatch's (DeepSpeed: "for zero
  stage 2 (and 3), gradient reduction is required after every backward because of
  gradient partitioning", deepspeedai/DeepSpeed issue 2252). The parameters are
  all-gathered after the optimizer step, as under stage 1.
- stage 3: every layer's parameters are all-gathered before its forward and again
  before its backward, for every microbatch, and freed after use; the gradient of each
  layer is reduce-scattered as its backward produces it. With prefetching (FSDP's
  default) the next layer's gather runs during this layer's compute, so a compute
  action waits for its first layer's gather and, for each later layer, for whatever of
  its gather does not fit under the previous layer's compute (``exposed_gather_seconds``).
  Nothing is gathered after the optimizer step: the next step's forwards gather.

Where stage 3's collectives run (``ZERO3_COLLECTIVES``, ``charges_collectives``):
``overlapped`` (the default) as above, on their own streams beside the compute, as
FSDP2 on CUDA (its all-gather and reduce-scatter streams), torchtitan and
Megatron-Core run them. ``in-costs``: synchronous, each gather and reduce-scatter
holding the rank inside the action it serves, with its time already in the stage
costs given (FSDP2 on gloo: it issues them with ``async_op=False`` and the CPU rank is
blocked in them, so a run's measured F and B hold them; ``pipesim compare`` calibrates
on exactly such actions). Charging them again, prefetched or beside the backward, would
count them twice, so the simulator charges none of the stage's data-parallel
collectives beside the actions (no gather waits, no reduce-scatters on the dp channel,
hence no overlap slowdown). It is only right for costs that hold them.
"""

from __future__ import annotations

ZERO_STAGES = (0, 1, 2, 3)
ZERO3_OVERLAPPED = "overlapped"
ZERO3_IN_COSTS = "in-costs"
ZERO3_COLLECTIVES = (ZERO3_OVERLAPPED, ZERO3_IN_COSTS)
ZERO_MEANINGS = {0: "all-reduce, nothing sharded", 1: "optimizer state sharded",
                 2: "optimizer state and gradients sharded", 3: "parameters sharded too (FSDP)"}


def check_zero(stage: int) -> int:
    """``stage`` if pipesim models it; else a one-line error naming the valid ones."""
    if stage not in ZERO_STAGES:
        valid = "; ".join(f"{level} ({meaning})" for level, meaning in ZERO_MEANINGS.items())
        raise ValueError(f"--zero {stage} is not a ZeRO stage: use {valid}")
    return stage


def check_zero3_collectives(collectives: str, stage: int) -> str:
    """``collectives`` if it names a way ZeRO-3's collectives run (``ZERO3_COLLECTIVES``)
    and, when not the default, ``stage`` is 3; else a one-line error naming the flag."""
    if collectives not in ZERO3_COLLECTIVES:
        raise ValueError(f"--zero3-collectives {collectives!r} is not one of: {', '.join(ZERO3_COLLECTIVES)}")
    if collectives != ZERO3_OVERLAPPED and stage != 3:
        raise ValueError(f"--zero3-collectives {collectives} says where ZeRO-3's gathers and reduce-scatters run; "
                         f"this step is --zero {stage}: add --zero 3 or drop the flag")
    return collectives


def charges_collectives(stage: int, collectives: str = ZERO3_OVERLAPPED) -> bool:
    """Whether the simulator charges the data-parallel collectives of ZeRO ``stage``
    beside the compute actions: always, except ZeRO-3's ``in-costs`` (the module
    docstring: their time is already in the actions' costs)."""
    return not (stage == 3 and collectives == ZERO3_IN_COSTS)


def bytes_per_param_on_device(weights: float, grads: float, optimizer: float, dp: int, stage: int) -> float:
    """Bytes each parameter costs a device under ZeRO ``stage`` over ``dp`` replicas (the
    table above: Rajbhandari et al. 2020, Table 1)."""
    check_zero(stage)
    if stage == 3:
        return (weights + grads + optimizer) / dp
    if stage == 2:
        return weights + (grads + optimizer) / dp
    if stage == 1:
        return weights + grads + optimizer / dp
    return weights + grads + optimizer


def optimizer_bytes_per_param(weights: float, grads: float, optimizer: float, dp: int, stage: int) -> float:
    """Bytes per parameter the optimizer step reads and writes on a device: every
    parameter's weights, gradient and state without sharding; under any ZeRO stage only
    the replica's shard of them, ``(w + g + K) / N_d``, since each replica updates only
    the parameters whose optimizer state it holds (stages 1 and 2 then all-gather the
    updated weights)."""
    check_zero(stage)
    return weights + grads + optimizer if stage == 0 else (weights + grads + optimizer) / dp


def reduces_every_backward(stage: int) -> bool:
    """Whether gradients are reduced after every microbatch's backward (their shard is
    all a replica keeps), not once after the step's last backward."""
    return stage >= 2


def gathers_after_optimizer(stage: int) -> bool:
    """Whether the updated parameters are all-gathered after the optimizer step."""
    return stage in (1, 2)


def gathers_per_layer(stage: int) -> bool:
    """Whether each layer's parameters are gathered before its forward and backward."""
    return stage == 3


def gather_units(layers: int) -> int:
    """Units a stage's parameters are gathered in: one per layer; a stage of no layer (an
    embedding-only or head-only chunk) gathers its parameters as one."""
    return max(int(layers), 1)


def exposed_gather_seconds(units: int, gather: float, compute: float) -> float:
    """Seconds a compute action of ``units`` layers, each computing for ``compute``
    seconds, waits for parameter gathers of ``gather`` seconds each, the next layer's
    gather issued as this layer's compute starts (one ahead, on the data-parallel stream).

    The first gather is waited for whole; layer ``i + 1``'s gather starts with layer
    ``i``'s compute, so it adds ``max(0, gather - compute)``. The action then spans
    ``gather + (units - 1) max(compute, gather) + compute``, of which ``units * compute``
    is compute: ``gather + (units - 1) max(0, gather - compute)`` is waiting."""
    if gather <= 0:
        return 0.0
    return gather + (units - 1) * max(0.0, gather - compute)


def working_bytes(unit_params: float, weight_bytes: float, grad_bytes: float) -> float:
    """Stage 3's gathered working set on a device: the parameters of the layer computing
    and of the one prefetched, and the layer's whole gradient before it is
    reduce-scattered."""
    return unit_params * (2 * weight_bytes + grad_bytes)
