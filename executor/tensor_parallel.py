"""Tensor parallelism: Megatron column/row splits of the gpt blocks, and timing of the
collectives they issue.

Each block's attention and MLP become a column-parallel GEMM followed by a row-parallel
one (``torch.distributed.tensor.parallel``): ``qkv`` and ``fc1`` are split by output
features (ColwiseParallel), ``proj`` and ``fc2`` by input features (RowwiseParallel),
so each pair needs one all-reduce in the forward (after the row-parallel GEMM) and one
in the backward (the input gradient of the column-parallel GEMM). The ``qkv`` output is
laid out head by head (``executor.models.Block``), so a contiguous column split hands
each tp rank whole heads. Norms, embeddings and the head stay replicated, and the
activations between stages are full (replicated) plain tensors: every tp rank sends its
copy to the same tp rank of the next stage, so pipeline shapes do not change with tp.

With ``sequence_parallel`` the norms run on sequence shards (SequenceParallel) and the
all-reduces become an all-gather before each column-parallel GEMM and a reduce-scatter
after each row-parallel one; the stage still takes and returns full activations.

The collectives run inside DTensor redistributions; ``TpTimer`` times them by wrapping
the functional collectives DTensor calls (``all_reduce``, ``all_gather_single``,
``reduce_scatter_single``) for the duration of a step, waiting for each at once so its
measured interval is the collective itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from executor.models import Block

TIMED_COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single")


def block_plan(sequence_parallel: bool) -> dict:
    """The Megatron plan of one ``Block`` (module name -> parallel style)."""
    if not sequence_parallel:
        return {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    return {
        "norm1": SequenceParallel(), "qkv": ColwiseParallel(input_layouts=Shard(1)),
        "proj": RowwiseParallel(output_layouts=Shard(1)),
        "norm2": SequenceParallel(), "fc1": ColwiseParallel(input_layouts=Shard(1)),
        "fc2": RowwiseParallel(output_layouts=Shard(1)),
    }


def parallelize_stage(stage: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> nn.Module:
    """Split every ``Block`` of ``stage`` across ``tp_mesh`` in place; return the stage."""
    for module in stage.modules():
        if isinstance(module, Block):
            parallelize_module(module, tp_mesh, block_plan(sequence_parallel))
            if sequence_parallel:
                # The residual stream is sequence-sharded inside the block; the stage
                # boundary (and the next block) sees the full, replicated activation.
                parallelize_module(module, tp_mesh, {
                    "": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                           use_local_output=True),
                })
                parallelize_module(module, tp_mesh, {
                    "": PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),),
                                            use_local_output=True),
                })
    return stage


class TpTimer:
    """Records ``(start, end)`` (``time.perf_counter``) of every tp collective issued
    while ``timing()`` is active, with the action the runtime was on."""

    def __init__(self, current_action: Callable[[], object]) -> None:
        self.current_action = current_action
        self.intervals: list[tuple[object, float, float]] = []

    def wrap(self, original: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = original(*args, **kwargs)
            if isinstance(result, funcol.AsyncCollectiveTensor):
                result = result.wait()
            self.intervals.append((self.current_action(), start, time.perf_counter()))
            return result

        return timed

    @contextmanager
    def timing(self) -> Iterator[None]:
        """Wrap the functional collectives for the duration of the block."""
        originals = {name: getattr(funcol, name) for name in TIMED_COLLECTIVES}
        for name, function in originals.items():
            setattr(funcol, name, self.wrap(function))
        try:
            yield
        finally:
            for name, function in originals.items():
                setattr(funcol, name, function)

    def take(self) -> list[tuple[object, float, float]]:
        """The intervals recorded since the last call."""
        intervals, self.intervals = self.intervals, []
        return intervals
