"""Per-op selective activation checkpointing (``--recompute per-op``): torchtitan 0.3's
``SelectiveAC`` policy, run with torch's own ``create_selective_checkpoint_contexts``.

Each block is wrapped in the non-reentrant ``torch.utils.checkpoint`` (``early_stop``
off: the recompute reruns the whole block, as torchtitan runs it) and every aten op of
its forward is put to a policy, one policy per checkpointed call:

- the outputs of torch's compute-intensive ops (its partitioner's list: ``mm``,
  ``addmm``, ``bmm``, the flash/efficient attention kernels, ...), ``linear``, ``max``,
  ``topk`` and the ``reduce_scatter_tensor`` and ``all_to_all_single`` collectives are
  saved, because recomputing them costs FLOPs or communication;
- except every second matmul of the block's forward (counted per call): matmuls 1, 3,
  5, ... are saved, 2, 4, 6, ... recomputed, trading half the GEMM outputs' memory for
  their FLOPs (torch 2.13 asks the policy in the forward only and replays its answers in
  the recompute by index; an older torch asked again in the recompute, which is counted
  apart so that both agree, as torchtitan counts);
- the router's gate of a mixture of experts (a ``router.gate`` linear, torchtitan's
  ``force_recompute_mm_shapes_by_fqns`` default) is recomputed and not counted, matched
  by its weight's shape as torchtitan matches it;
- everything else (norms, rotary, activations, the SwiGLU product, adds, sequence-
  parallel all-gathers) is recomputed in the backward; a copy from the GPU to the host
  is saved (a recompute would synchronise again).

Matmuls are counted as torchtitan counts them, ``mm`` and ``linear``: a linear with a bias
reaches the dispatcher as ``addmm`` (for a 3-D input too: a view, then ``addmm``), which
is a compute-intensive op and so saved, and not counted; a biased model (the toy gpt)
recomputes none of its matmuls, as ``pipesim.model.per_op_checkpoint`` prices it. One
choice differs from the letter of torchtitan's code, so that the executor runs what the
simulator's ``per-op`` prices on every device: the CPU's attention kernel
(``_scaled_dot_product_flash_attention_for_cpu``), missing from torch's list, is saved
like the GPU kernels it stands for.

torch's selective checkpoint hands each saved output to one backward through the region
(it marks the entry consumed); a split backward (``I`` then ``W``) recomputes the block
twice and fails ("Trying to backward an extra time"), as torchtitan's run of a
zero-bubble schedule does: ``RunConfig.check`` refuses such a schedule with ``per-op``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten
MATMULS = (aten.mm.default, aten.linear.default)  # counted: every second one recomputed (addmm: saved, uncounted)
FORCED_RECOMPUTE = "router.gate"  # torchtitan's default force_recompute_mm_shapes_by_fqns, as our MoE names it


def saved_ops() -> frozenset:
    """The ops whose outputs the policy saves (matmuls subject to the every-second rule)."""
    # torch's partitioner pulls in inductor (a second to import): only when per-op is used
    from torch._functorch.partitioners import get_default_op_list  # noqa: PLC0415

    compute = {op.default for op in get_default_op_list().compute_intensive_ops}
    return frozenset(compute | {
        aten.linear.default, aten.max.default, aten.topk.default,
        aten._scaled_dot_product_attention_math.default, aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_fused_attention_overrideable.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        torch.ops._c10d_functional.all_to_all_single.default,
    })


def weight_shape(func, args: tuple) -> tuple[int, ...]:
    """The matmul's right-hand side as ``(in, out)``, whichever counted aten op carries it."""
    if func is aten.linear.default:
        return tuple(reversed(args[1].shape))
    return tuple(args[1].shape)


class PerOpPolicy:
    """The save-or-recompute decision for each op of one checkpointed call of a block."""

    def __init__(self, saved: frozenset, forced: frozenset) -> None:
        self.saved, self.forced = saved, forced
        self.matmuls = {False: 0, True: 0}  # counted in the forward and in the recompute apart

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func is aten._to_copy.default and args[0].device.type != "cpu" and \
                torch.device(kwargs.get("device", args[0].device)).type == "cpu":
            return CheckpointPolicy.MUST_SAVE
        if func in MATMULS:
            if weight_shape(func, args) in self.forced:
                return CheckpointPolicy.PREFER_RECOMPUTE
            self.matmuls[ctx.is_recompute] += 1
            odd = self.matmuls[ctx.is_recompute] % 2 == 1
            return CheckpointPolicy.MUST_SAVE if odd else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in self.saved else CheckpointPolicy.PREFER_RECOMPUTE


def forced_shapes(block: nn.Module) -> frozenset:
    """``(in, out)`` of every router gate in ``block``, whose matmuls are always recomputed."""
    return frozenset((module.in_features, module.out_features) for name, module in block.named_modules()
                     if name.endswith(FORCED_RECOMPUTE) and isinstance(module, nn.Linear))


# Who is told where each checkpointed call keeps its outputs. torch keeps them in the
# forward context's own store (op -> outputs), not through autograd's saved-tensor hooks,
# so what counts a microbatch's activations by those hooks (executor.memory, the
# profile's stash) would not see them.
_collectors: list[Callable[[dict], None]] = []


@contextmanager
def collecting_kept(collect: Callable[[dict], None]) -> Iterator[None]:
    """While active, ``collect`` receives the store of every per-op checkpointed call that
    starts; ``kept_tensors`` reads what it holds (the backward empties it)."""
    _collectors.append(collect)
    try:
        yield
    finally:
        _collectors.remove(collect)


def kept_tensors(store: dict) -> list[torch.Tensor]:
    """The outputs a call's store holds now."""
    leaves = (getattr(leaf, "val", leaf) for outputs in store.values() for leaf in tree_leaves(outputs))
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def per_op_contexts(saved: frozenset, forced: frozenset) -> tuple:
    """The forward and recompute contexts of one checkpointed call, its store reported."""
    forward, recompute = create_selective_checkpoint_contexts(PerOpPolicy(saved, forced))
    for collect in _collectors:
        collect(forward.storage)
    return forward, recompute


def per_op_checkpointed(block: nn.Module) -> Callable:
    """``block.forward`` under the per-op policy, a fresh policy (and counter) per call."""
    saved, forced = saved_ops(), forced_shapes(block)
    return functools.partial(checkpoint, block.forward, use_reentrant=False, early_stop=False,
                             context_fn=functools.partial(per_op_contexts, saved, forced))
