"""Activation recompute (``--recompute full|selective|per-op|norm-mla-up``), applied to a stage's blocks with
``torch.utils.checkpoint``, as torchtitan's ``apply_ac`` does: the model never knows.

- ``full`` (Megatron's full recompute): each block keeps only its input; its forward runs
  again in the backward to rebuild what the backward needs. Activation memory per layer
  falls to the input, at the cost of a second forward of every block.
- ``selective`` (Korthikanti et al. 2022, "selective activation recompute"): only the
  attention core, the softmax(QK^T)V that grows with the square of the sequence, is
  recomputed; every other op's output is kept. Each block's forward runs under a torch
  function mode that sends every ``scaled_dot_product_attention`` call through the
  checkpoint, so any block built on torch's attention is covered, and the executor's
  written-out core (gpt-oss's sinks, Gemma 2's soft-capped scores) too.

- ``per-op`` (torchtitan's ``SelectiveAC``, ``executor.per_op_recompute``): each block
  checkpointed with torch's selective policy: matmul, attention and reduce-scatter outputs
  kept except every second matmul, every other op recomputed. It cannot run a split
  backward (below), so ``RunConfig.check`` refuses it with one.
- ``norm-mla-up`` (DeepSeek-V3's, report section 3.2.3): every norm's output, and latent
  attention's Q, K and V with what the up-projections made on the way, are dropped after
  the forward and rebuilt just before the backward that reads them
  (``executor.rebuilt_activations``). Not a checkpoint: the GEMMs that read a norm's
  output are not re-run. The blocks do it themselves (``recompute_norms``, a latent
  attention's ``recompute_up``), switched on here.

``full`` and ``selective`` use the non-reentrant checkpoint, which works with ``autograd.grad`` (the split
backward's ``I``) and keeps the parameters' gradients flowing to ``.grad`` as usual.
Why not torch's selective activation checkpointing (``create_selective_checkpoint_contexts``
with a policy that recomputes the attention kernels): it allows one backward through a
region ("Trying to backward an extra time"), and a split backward goes through it twice,
once for ``I`` and once for ``W``: that is the error torchtitan's default selective
recompute hits on every zero-bubble schedule.
"""

from __future__ import annotations

import functools

import torch.nn.functional as F  # noqa: N812 - the usual torch spelling
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from executor.architectures.layers import FeedForward, written_out_attention
from executor.architectures.moe import MixtureOfExperts
from executor.architectures.mtp import prediction_blocks
from executor.config import NORM_MLA_UP, RECOMPUTE_MODES
from executor.per_op_recompute import per_op_checkpointed

ATTENTION_CORES = (F.scaled_dot_product_attention, written_out_attention)


class AttentionRecompute(TorchFunctionMode):
    """While active, each attention core is checkpointed: torch's
    ``scaled_dot_product_attention`` and the executor's written-out core (attention
    sinks, soft-capped scores: ``executor.architectures.layers.written_out_attention``).
    The output is kept, the internals (the written-out core's ``s x s`` scores, mask and
    softmax) are recomputed in the backward."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in ATTENTION_CORES:
            return checkpoint(func, *args, use_reentrant=False, **kwargs)
        return func(*args, **kwargs)


def attention_checkpointed(forward, *args, **kwargs):
    """``forward(*args, **kwargs)`` with its attention cores checkpointed."""
    with AttentionRecompute():
        return forward(*args, **kwargs)


def checkpointed(block: nn.Module, mode: str):
    """``block.forward`` with activation recompute ``mode`` applied."""
    if mode == "full":
        return functools.partial(checkpoint, block.forward, use_reentrant=False)
    if mode == "per-op":
        return per_op_checkpointed(block)
    return functools.partial(attention_checkpointed, block.forward)


def apply_recompute(stage: nn.Module, mode: str, moe_act: bool = False) -> None:
    """Wrap each block of ``stage`` (its ``blocks`` list) in activation checkpointing;
    parameter names and the module tree stay as they are. ``moe_act`` (``--recompute-moe-act``)
    switches on the routed experts' own recompute of their activation
    (``FeedForward.recompute_activation``), beside any mode but ``full`` and ``per-op``
    (``executor.config.check_moe_act_recompute``)."""
    if moe_act:
        recompute_experts_activation(stage)
    if mode == "none":
        return
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"--recompute {mode!r} is not one of: {', '.join(RECOMPUTE_MODES)}")
    blocks = getattr(stage, "blocks", None)
    if blocks is None:
        raise ValueError(f"--recompute {mode} wraps a stage's blocks, but {type(stage).__name__} has no "
                         "`blocks` list")
    for block in [*blocks, *prediction_blocks(stage)]:  # DeepSeek-V3's MTP blocks as the model's
        if mode == NORM_MLA_UP:
            recompute_norms_and_up_projections(block)
        else:
            block.forward = checkpointed(block, mode)
            if mode in ("full", "per-op"):
                # the block's forward runs again inside the backward: what it saves is rebuilt by
                # the checkpoint, and a gathered copy dropped in that re-run would never be refilled
                # (the block's own, and the shared expert's of a mixture of experts routing its shard)
                for module in block.modules():
                    if hasattr(module, "regather_shards"):
                        module.regather_shards = False


def recompute_norms_and_up_projections(block: nn.Module) -> None:
    """Switch on a block's own dropping and rebuilding of its norms' outputs and its
    latent attention's up-projections (``--recompute norm-mla-up``)."""
    if not hasattr(block, "recompute_norms"):
        raise ValueError(f"--recompute {NORM_MLA_UP} recomputes a block's norm outputs, but {type(block).__name__} "
                         "has no norms it knows how to recompute (no `recompute_norms` switch)")
    block.recompute_norms = True
    for module in block.modules():
        if hasattr(module, "recompute_up"):
            module.recompute_up = True


def recompute_experts_activation(stage: nn.Module) -> None:
    """Each routed expert of ``stage``'s mixture-of-experts layers keeps its activation's
    inputs alone (Megatron-Core's ``moe_act``); the shared experts keep theirs, as
    ``moe_act`` leaves them (their own module is ``shared_experts``). A stage without such
    layers (a dense first stage) is left as it is."""
    for module in stage.modules():
        if isinstance(module, MixtureOfExperts):
            # a list, or under expert parallelism a dict of this rank's experts (executor.expert_parallel)
            for expert in module.experts.modules():
                if isinstance(expert, FeedForward):
                    expert.recompute_activation = True
