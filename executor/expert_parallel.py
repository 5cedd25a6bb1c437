"""Expert parallelism: each MoE layer's routed experts split over an ep group, tokens
sent to their experts' ranks by all-to-all and their outputs sent back by a second one.

The groups are the ones ``pipesim simulate --ep`` models (``pipesim.cluster.mapping``,
Megatron-Core's expert ranks): the dp x cp ranks that hold one (pp, tp) shard, in
global-rank order, are cut into ep groups of ``ep`` consecutive members; member ``i`` of a group holds the
experts ``[i * E/ep, (i+1) * E/ep)``. Members at the same place of every ep group hold
the same experts and reduce those experts' gradients together (the expert data-parallel
group, ``dp * cp / ep`` ranks); every other parameter is reduced over dp (x cp) as before.

Why the gradients come out right: each replica's loss is the mean over its own slice of
the batch, and the combine all-to-all's backward returns to an expert's rank the
gradient of every ep peer's loss for the copies it computed; summing over the expert dp
group then covers all ``dp`` replicas (and their cp ranks, whose losses are parts of
their replica's), and dividing by ``dp`` (as for the dense parameters) gives the
gradient of the global mean.

A routed copy (token, choice) leaves its rank in expert order; each side learns the
other's counts by an all-to-all of ``ep`` integers and the expert of every row it
receives by a third, untracked, all-to-all. The rows travel through
``executor.inside_timing.timed_all_to_all`` (as ``torch.distributed.nn.functional.
all_to_all_single``: its backward is the all-to-all with the splits swapped; each one
timed, for ``pipesim compare`` to price from the links), so the backward (also a zero-bubble schedule's input-gradient
pass) trades the gradients the same way. Every ep peer runs the same program on the same
layers, so the collectives line up.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from executor.architectures.moe import MixtureOfExperts, combine_dtype
from executor.inside_timing import CollectiveTimer, timed_all_to_all
from executor.mesh import MeshPosition
from executor.routed_rows import ROUTED_ROWS
from executor.shard_routing import RowsOverTp


def expert_range(experts: int, ep: int, ep_index: int) -> range:
    """The experts member ``ep_index`` of an ep group of ``ep`` holds (``ep`` divides ``experts``)."""
    share = experts // ep
    return range(ep_index * share, (ep_index + 1) * share)


def expert_groups_of(position: MeshPosition, ep: int, copies: int = 1, folded: bool = False
                     ) -> tuple[list[list[int]], list[list[int]]]:
    """Every ep group and every expert data-parallel group of the job, as global ranks,
    in an order all processes share (``new_group`` must be called alike everywhere). With
    DualPipe's two copies of the model (``executor.copies``) a stage's experts are also
    held by the mirror pipeline rank ``pp - 1 - r`` (the other copy of the same layers):
    its expert data-parallel group holds both ranks' members at the same place.

    Under parallel folding (``folded``: the experts whole on every rank, Megatron-Core's
    ``--expert-tensor-parallel-size 1``) the groups are cut from every rank of a stage,
    its tp x cp x dp ranks in global-rank order, as the simulator's expert mesh orders
    them (``pipesim.cluster.mapping``: etp innermost, then ep, then expert dp)."""
    ep_groups, expert_dp_groups = [], []
    shards = 1 if folded else position.tp  # tp shards of an expert
    members_of = {(pp_index, tp_index): sorted(position.rank_at(pp_index, dp_index, cp_index, tp_index + member)
                                               for dp_index in range(position.dp) for cp_index in range(position.cp)
                                               for member in range(position.tp // shards))
                  for pp_index in range(position.pp) for tp_index in range(shards)}
    for pp_index in range(position.pp):
        for tp_index in range(shards):
            members = members_of[pp_index, tp_index]
            ep_groups += [members[first:first + ep] for first in range(0, len(members), ep)]
            if copies == 1:
                expert_dp_groups += [members[offset::ep] for offset in range(ep)]
            elif pp_index < position.pp // 2:  # one group per mirror pair
                mirror = members_of[position.pp - 1 - pp_index, tp_index]
                expert_dp_groups += [members[offset::ep] + mirror[offset::ep] for offset in range(ep)]
    return ep_groups, expert_dp_groups


@dataclass
class ExpertGroups:
    """This process's ep group (where its tokens' experts live), its expert data-parallel
    group (the ranks holding its experts) and its place ``ep_index`` in the ep group."""

    ep: int
    ep_index: int
    ep_group: dist.ProcessGroup
    expert_dp_group: dist.ProcessGroup

    @classmethod
    def build(cls, rank: int, position: MeshPosition, ep: int, timeout: float, copies: int = 1,
              folded: bool = False) -> ExpertGroups:
        ep_groups, expert_dp_groups = expert_groups_of(position, ep, copies, folded)
        mine = {}
        for kind, groups in (("ep", ep_groups), ("expert_dp", expert_dp_groups)):
            for members in groups:
                group = dist.new_group(members, timeout=timedelta(seconds=timeout))
                if rank in members:
                    mine[kind] = group
        place = position.dp_index * position.cp + position.cp_index  # in the stage's members, global-rank order
        if folded:
            place = place * position.tp + position.tp_index
        return cls(ep, place % ep, mine["ep"], mine["expert_dp"])


class ExpertDispatcher:
    """The routed part of a ``MixtureOfExperts`` under expert parallelism (the
    ``dispatcher`` it calls instead of running every expert itself)."""

    def __init__(self, groups: ExpertGroups, experts: int, timer: CollectiveTimer | None = None) -> None:
        self.groups = groups
        self.share = experts // groups.ep
        self.timer = timer  # times the dispatch and combine all-to-alls (executor.inside_timing)

    def __call__(self, tokens: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, keep: torch.Tensor,
                 experts: nn.ModuleDict, weighted_input: bool = False, expert_tp: RowsOverTp | None = None
                 ) -> torch.Tensor:
        """The routed experts' weighted sum per token (``keep``: the copies the capacity
        kept). With ``expert_tp`` (experts split over tp, each tp rank routing its own
        sequence shard: ``executor.shard_routing``) the rows this rank received are
        gathered over tp before the experts and their partial outputs reduce-scattered
        back after them, as Megatron-Core's all-to-all dispatcher runs them."""
        group = self.groups.ep_group
        token, slot = torch.nonzero(keep, as_tuple=True)
        expert = chosen[token, slot]
        order = torch.argsort(expert, stable=True)  # grouped by destination rank, then expert
        token, slot, expert = token[order], slot[order], expert[order]
        send_counts = torch.bincount(expert // self.share, minlength=self.groups.ep)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        sends, receives = send_counts.tolist(), recv_counts.tolist()
        received_experts = expert.new_empty(sum(receives))
        dist.all_to_all_single(received_experts, expert, receives, sends, group=group)
        weight = weights[token, slot].unsqueeze(-1)
        sent = tokens[token] * weight.to(tokens.dtype) if weighted_input else tokens[token]  # Llama 4: scaled first
        rows = timed_all_to_all(sent, sum(receives), receives, sends, group, self.timer)
        if expert_tp is None:
            outputs = run_experts(rows, received_experts, experts)
        else:
            every_rows, every_experts, counts = expert_tp.gather(rows, received_experts)
            outputs = expert_tp.scatter(run_experts(every_rows, every_experts, experts), counts)
        back = timed_all_to_all(outputs, len(token), sends, receives, group, self.timer)
        combined = combine_dtype(tokens, weights)
        weighted = back.to(combined) if weighted_input else back.to(combined) * weight.to(combined)
        return tokens.new_zeros(tokens.shape, dtype=combined).index_add(0, token, weighted)


def run_experts(rows: torch.Tensor, row_experts: torch.Tensor, experts: nn.ModuleDict) -> torch.Tensor:
    """Each of ``rows`` through its expert (``row_experts``, global indices; ``experts``
    keyed by them). An expert that received no rows still runs, on none: a zero
    gradient, not none."""
    ROUTED_ROWS.add(len(rows))  # what this rank's experts keep follows the routing (executor.routed_rows)
    outputs = torch.zeros_like(rows)
    for name, module in experts.items():
        (at,) = torch.nonzero(row_experts == int(name), as_tuple=True)
        outputs = outputs.index_copy(0, at, module(rows[at]).to(rows.dtype))
    return outputs


def shard_experts(stage: nn.Module, groups: ExpertGroups, timer: CollectiveTimer | None = None) -> None:
    """Keep only this rank's experts in every MoE layer of ``stage`` (under their global
    indices, so parameter names stay those of the whole model) and route through the
    ep group, the dispatch and combine timed by ``timer`` where given."""
    if groups.ep == 1:  # parallel folding at ep 1: every expert here, only the gradients' group is new
        return
    for module in stage.modules():
        if isinstance(module, MixtureOfExperts):
            mine = expert_range(module.num_experts, groups.ep, groups.ep_index)
            module.experts = nn.ModuleDict({str(index): module.experts[index] for index in mine})
            module.dispatcher = ExpertDispatcher(groups, module.num_experts, timer)


def expert_parameters(stages: dict[int, nn.Module]) -> set[int]:
    """``id`` of every routed expert's parameter in ``stages`` (reduced over the expert
    data-parallel group rather than dp)."""
    return {id(param) for stage in stages.values() for module in stage.modules()
            if isinstance(module, MixtureOfExperts) for param in module.experts.parameters()}


class ExpertAwareAverager:
    """Data-parallel gradient averaging under expert parallelism: the dense parameters'
    buckets reduced over ``dp_group`` (dp, or dp x cp), the experts' over the expert
    data-parallel group, both divided by ``dp`` (see the module), each bucket reduced as
    soon as the backward fills it. Under ZeRO 1/2 each part shards its parameters'
    optimizer state (and gradients) over its own group, as Megatron-Core's distributed
    optimizer shards the experts over the expert data-parallel group; the worker sees
    one averager, its calls handed to both parts."""

    def __init__(self, stages: dict[int, nn.Module], program, dp_group: dist.ProcessGroup,
                 groups: ExpertGroups, dp: int, bucket_bytes: float, reduce_dtype: torch.dtype | None,
                 zero: int = 0, alone: Collection[int] = ()) -> None:
        from executor.data_parallel import GradientAverager  # noqa: PLC0415 - beside its one user

        routed = expert_parameters(stages)
        self.parts = [
            GradientAverager(stages, program, dp_group, dp, bucket_bytes, reduce_dtype, zero,
                             keep=lambda param: id(param) not in routed, alone=alone),
            GradientAverager(stages, program, groups.expert_dp_group, dp, bucket_bytes, reduce_dtype, zero,
                             keep=lambda param: id(param) in routed),
        ]

    def before_action(self, action) -> None:
        for part in self.parts:
            part.before_action(action)

    def after_action(self, action) -> None:
        for part in self.parts:
            part.after_action(action)

    def finish(self) -> list[tuple]:
        return [timing for part in self.parts for timing in part.finish()]

    # -- ZeRO 1/2: what the worker asks of the sharded optimizer, from both parts ---------

    def optimizer_tensors(self) -> tuple[list[torch.Tensor], set[int]]:
        tensors, matrices = [], set()
        for part in self.parts:
            mine, decaying = part.optimizer_tensors()
            tensors += mine
            matrices |= decaying
        return tensors, matrices

    def stepped_gradients(self) -> list[tuple[torch.Tensor, nn.Parameter, int]]:
        return [entry for part in self.parts for entry in part.stepped_gradients()]

    def shard_grads(self) -> list[torch.Tensor]:
        return [grad for part in self.parts for grad in part.shard_grads()]

    def held_shards(self) -> list[torch.Tensor]:
        return [shard for part in self.parts for shard in part.held_shards()]

    def gather_parameters(self) -> list[tuple]:
        return [timing for part in self.parts for timing in part.gather_parameters()]

    def full_gradients(self) -> None:
        for part in self.parts:
            part.full_gradients()

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()
