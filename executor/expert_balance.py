"""DeepSeek-V3's auxiliary-loss-free load balancing: after each step, every expert's
selection bias moves by ``rate`` towards balance.

DeepSeek-V3 (technical report, section 2.1.2) picks a token's experts by score plus a
per-expert bias that the gradient never touches: "at the end of each step, we will
decrease the bias term by γ if its corresponding expert is overloaded, and increase it
by γ if its corresponding expert is underloaded", γ = 0.001. Megatron-Core runs the
same rule (``--moe-router-enable-expert-bias``, ``--moe-router-bias-update-rate``
1e-3): each expert's load is the copies routed to it over the whole step, summed over
every rank that routes tokens through the layer, and the bias moves by
``rate * sign(mean load - load)``.

Here each router counts the copies it picked during the step (``Router.expert_load``,
once a forward, never in a recompute), and one all-reduce over every rank sums them
per layer: data-parallel replicas, cp ranks and ep ranks route different tokens; the
tensor-parallel ranks of a stage route the same ones, which multiplies a layer's every
count alike and leaves each sign as it was (where each routes its own sequence shard,
``executor.shard_routing``, the sum is the whole count); DualPipe's two copies of a layer route
one direction's microbatches each. Counts are integers, so the sign (and the bias) is
exactly the one-process reference's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from executor.architectures.build import is_architecture, run_spec
from executor.architectures.moe import Router
from executor.config import RunConfig

DEFAULT_RATE = 1e-3  # DeepSeek-V3's γ, Megatron-Core's --moe-router-bias-update-rate


def routers_of(modules: Iterable[nn.Module]) -> list[Router]:
    """Every router in ``modules`` (a rank's stages)."""
    return [module for stage in modules for module in stage.modules() if isinstance(module, Router)]


def start_counting(routers: Iterable[Router]) -> None:
    """Forget the loads counted so far (a profile's forwards, the last step's)."""
    for router in routers:
        router.expert_load.zero_()


def update_selection_biases(routers: list[Router], rate: float, shape: tuple[int, int], device: torch.device,
                            all_reduce: Callable[[torch.Tensor], object] | None = None) -> torch.Tensor:
    """Move each balanced router's bias by ``rate * sign(mean load - load)`` from the
    step's loads summed by ``all_reduce`` (None: this process routed every token),
    then start counting again. Returns the summed loads (``layers x experts``)."""
    loads = torch.zeros(shape, dtype=torch.int64, device=device)
    for router in routers:
        loads[router.layer] += router.expert_load
    if all_reduce is not None:
        all_reduce(loads)
    for router in routers:
        if router.selection_bias is not None:
            load = loads[router.layer]
            below_mean = torch.sign(load.sum() - load * load.numel())  # mean - load, times the experts
            router.selection_bias += rate * below_mean.to(router.selection_bias.dtype)
    start_counting(routers)
    return loads


def selection_biases(stages: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
    """Every selection bias of ``stages`` (by model stage), named ``"{stage}.{buffer}"``
    as a run's weights are: a run is only the reference's if its biases moved alike."""
    return {f"{stage}.{name}": buffer.detach().cpu().clone() for stage, module in stages.items()
            for name, buffer in module.named_buffers() if name.endswith("selection_bias")}


class ExpertBalance:
    """One process's routers and the step's balancing: counting starts with the step,
    the biases move at its end (a no-op where the model balances nothing, on every rank
    alike, so no rank waits in an all-reduce the others skip)."""

    def __init__(self, config: RunConfig, stages: Iterable[nn.Module], device: torch.device) -> None:
        self.routers, self.device = routers_of(stages), device
        # --expert-bias-rate, else DeepSeek's 0.001 where the model has a selection bias
        # (DeepSeek-V3's sigmoid router); the loads as one layers x experts tensor that every
        # rank all-reduces, or None where nothing is balanced (the same on every rank)
        spec = run_spec(config) if is_architecture(config.model) else None
        moe = spec.moe if spec is not None else None
        self.rate, self.shape = 0.0, None
        if moe is not None and moe.balanced_by_bias:
            self.rate = DEFAULT_RATE if config.expert_bias_rate is None else config.expert_bias_rate
        if self.rate:  # the MTP modules' blocks are the layers after the model's last
            self.shape = (config.layers + spec.mtp_depth, moe.experts)

    @property
    def active(self) -> bool:
        return self.shape is not None

    def start_step(self) -> None:
        start_counting(self.routers)

    def end_step(self, all_reduce: Callable[[torch.Tensor], object] | None = None) -> None:
        if self.shape is not None:
            update_selection_biases(self.routers, self.rate, self.shape, self.device, all_reduce)
