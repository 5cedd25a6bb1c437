"""Tied input and output embeddings across a pipeline, kept as Megatron-LM keeps them.

A tied model (GPT-2, Qwen3-0.6B, Gemma: ``tie_word_embeddings``) multiplies its final
hidden states by the token embedding table. Under pipelining the table lives on the
first stage and the output layer on the last, usually different ranks, so Megatron-LM
keeps a copy of the table on the last stage, initialised from the same weights, and
after each backward sums the two copies' gradients over the "embedding group" (the
first and last stage's ranks at one data/tensor/context-parallel place:
``_allreduce_word_embedding_grads``). Both copies then take the same optimizer step
from the same state and stay equal: the model is the tied one, whose gradient is the
sum of the table's two uses.

Here the output layer's weight starts as a copy of the table (``SpecModel.make_head``)
and ``TiedEmbeddings.sum_gradients`` runs after the step's data-parallel reduction and
before the optimizer: a rank holding both copies (one pipeline stage; V-shaped
placements, whose rank 0 holds the first and last stages; DualPipe, whose ranks hold one
copy's first stage and the other's last) adds them in place; otherwise one all-reduce
over the pair. Summing after the data-parallel average is the same sum (both are
linear). The gradient summed is what the optimizer steps: the whole reduced gradient,
or under ZeRO-1/2 this replica's shard (the table is kept alone in its bucket at both
ends, so the two shards cover the same rows), or under ZeRO-3 FSDP's local shard (both
copies sharded by rows over the same replicas).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from executor.architectures.mtp import prediction_tables
from executor.data_parallel import GradientAverager, local_tensor
from executor.mesh import MeshPosition
from pipesim.model.spec import ModelSpec
from schedules.schedule import Schedule


def is_tied(model: object) -> bool:
    """Whether ``model`` is an architecture with copies of its embedding table to keep
    equal: a tied output layer, or DeepSeek-V3's multi-token prediction modules, which
    embed with the model's table (the toys have neither)."""
    spec = getattr(model, "spec", None)
    return spec is not None and (spec.tied_embeddings or spec.mtp_depth > 0)


def table_of(stage: nn.Module) -> nn.Parameter | None:
    """The token embedding table of a first stage, else None."""
    embed = getattr(stage, "embed", None)
    return embed.tokens.weight if embed is not None and hasattr(embed, "tokens") else None


def output_weight_of(stage: nn.Module) -> nn.Parameter | None:
    """The output layer's weight of a last stage (its head: final norm, then the output
    linear), else None."""
    head = getattr(stage, "head", None)
    return head[-1].weight if head is not None else None


def copies_on_rank(stages: dict[int, nn.Module], tied: bool = True) -> list[nn.Parameter]:
    """This rank's copies of the table: first stages' tables, last stages' tied output
    weights (``tied``) and MTP modules' embeddings (DualPipe's ranks hold one copy's
    first stage and the other's last)."""
    tables = [table for stage in stages.values() if (table := table_of(stage)) is not None]
    outputs = [weight for stage in stages.values() if (weight := output_weight_of(stage)) is not None] if tied else []
    return tables + outputs + [table for stage in stages.values() for table in prediction_tables(stage)]


def embedding_group(schedule: Schedule, position: MeshPosition, timeout: float) -> dist.ProcessGroup | None:
    """The pair of ranks holding the first and the last stage at this process's dp, cp
    and tp place, where those are different pipeline ranks (one group per place, made
    alike on every rank: ``new_group`` is collective); None where one rank holds both."""
    first, last = schedule.placement[0], schedule.placement[-1]
    if schedule.copies > 1 or first == last:
        return None
    mine = None
    for dp_index in range(position.dp):
        for cp_index in range(position.cp):
            for tp_index in range(position.tp):
                pair = [position.rank_at(index, dp_index, cp_index, tp_index) for index in (first, last)]
                group = dist.new_group(sorted(pair), timeout=timedelta(seconds=timeout))
                if (dp_index, cp_index, tp_index) == (position.dp_index, position.cp_index, position.tp_index):
                    mine = group
    return mine if position.pp_index in (first, last) else None


class TiedEmbeddings:
    """This rank's share of keeping a model's copies of its embedding table equal: a
    tied output layer's, DeepSeek-V3's MTP modules' (``spec`` says which it has)."""

    def __init__(self, stages: dict[int, nn.Module], group: dist.ProcessGroup | None, spec: ModelSpec) -> None:
        self.held = copies_on_rank(stages, spec.tied_embeddings)  # a ZeRO averager keeps each alone in its bucket
        self.group = group
        self.copies = 1 + int(spec.tied_embeddings) + spec.mtp_depth  # in one model: the table, the output, MTP
        first = any(table_of(stage) is not None for stage in stages.values())
        last = any(getattr(stage, "head", None) is not None for stage in stages.values())
        if group is None and first != last:
            raise ValueError("a model's first and last stages, which hold copies of its embedding table, are on "
                             "different ranks, but no group joins them")

    def holders(self, param: nn.Parameter) -> int:
        """How many copies hold ``param``'s gradient: every copy of the table, else 1."""
        return self.copies if any(param is copy for copy in self.held) else 1

    def sum_gradients(self, averager: GradientAverager | None) -> None:
        """Every copy's gradient (what the optimizer steps: ``averager.stepped_gradients``,
        under ZeRO-1/2 one shard, each copy alone in its bucket) made their sum: this
        rank's copies added in place, then one all-reduce over the first and last stages'
        pair where they are on different ranks."""
        if not self.held:
            return
        if averager is None:
            grads = [local_tensor(param.grad) for param in self.held]
        else:
            stepped = {id(param): grad for grad, param, _ in averager.stepped_gradients()}
            grads = [stepped[id(param)] for param in self.held]
        with torch.no_grad():
            total = grads[0]
            for grad in grads[1:]:  # this rank's copies summed (a last stage's tied output and MTP tables)
                total.add_(grad)
            if self.group is not None:  # with the other end's
                dist.all_reduce(total, group=self.group)
            for grad in grads[1:]:
                grad.copy_(total)
