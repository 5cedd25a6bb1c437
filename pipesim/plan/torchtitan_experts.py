"""Where torchtitan 0.3 puts a mixture of experts' routed experts, as one rule that both
``plan --torchtitan`` (``pipesim.plan.layouts``) and the writer of torchtitan's config
(``pipesim.cli.torchtitan.check_experts``) apply.

torchtitan 0.3 folds the routed experts whenever ep > 1: its sparse mesh puts every
expert whole on each rank and cuts ep from the data-parallel shard x cp x tp ranks
(``efsdp * ep = dp_shard * cp * tp``, ``torchtitan/config/configs.py``); at ep 1 it
splits them over tp. So with tp > 1 a layout runs as priced only when it is folded
(``etp`` 1) exactly when ep > 1, and ep must divide the FSDP shard x cp x tp ranks (the
replicas of DDP, ``data_parallel_replicate``, are outside them).
"""

from __future__ import annotations

TORCHTITAN_FOLDS = "torchtitan folds the experts whenever ep > 1, and only then (its expert mesh)"
TORCHTITAN_EXPERT_MESH = "ep does not divide torchtitan's FSDP shard x cp x tp ranks (its expert mesh)"
# why neither ``plan --torchtitan`` nor ``export --torchtitan`` takes ``--recompute-moe-act``
TORCHTITAN_NO_MOE_ACT = ("torchtitan 0.3 has no recompute of the routed experts' activation alone "
                         "(Megatron-Core's moe_act)")


def torchtitan_expert_cause(dp: int, tp: int, cp: int, ep: int, etp: int, fsdp: bool) -> str | None:
    """Why torchtitan would not run these experts as priced (``etp``: 1 folded, 0 split
    over tp; ``fsdp``: its replicas shard with FSDP, else DDP), None if it would."""
    if tp > 1 and (ep > 1) != bool(etp):
        return TORCHTITAN_FOLDS
    shard = dp if fsdp else 1
    if ep > 1 and (shard * cp * tp) % ep:
        return TORCHTITAN_EXPERT_MESH
    return None
