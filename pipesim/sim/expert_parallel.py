"""Expert parallelism in a step: the all-to-alls of every mixture-of-experts layer.

Over ``ep`` expert-parallel ranks each holds ``E / ep`` of a layer's routed experts
(``pipesim.cluster.mapping`` says which ranks form a group), so a token's hidden state
travels to the ranks of the experts it is routed to and back, as Megatron-Core's
all-to-all token dispatcher moves it:

- forward: *dispatch* (each rank sends its routed token copies to the experts' ranks)
  and *combine* (the experts' outputs come back): two all-to-alls of the rank's routed
  copies (``MixtureOfExperts.dispatch_bytes``: ``C k`` copies of each of its tokens,
  ``h`` wide), the dispatch of ``dispatch_bytes``, the combine of ``combine_bytes``;
- input-gradient backward (``B``, or ``I`` when split): the same two in reverse, the
  combine's gradient out toward the experts (``dispatch_bytes``) and the dispatch's back
  (``combine_bytes``); the weight-gradient pass (``W``) has none;
- full recompute re-runs the forward, its two all-to-alls included, inside the backward.

Each all-to-all is on the layer's critical path (the experts need their tokens, the
next layer the combined output), so its seconds hold the rank after the compute
action, as tensor-parallel collectives do, and count as ``ep`` in the step's time
accounting. It is priced over the stage's ep group at the pace of its most loaded link
(``pipesim.cluster.collectives.all_to_all``), with every other ep group of that pipeline
rank (the other tp shards', the other replicas') exchanging at the same moment on the
links they share: all of them run the same layer in lockstep. Node-limited routing
(DeepSeek-V3: a token's experts on at most ``M`` nodes, sent once to each) cuts the
pieces between nodes to ``min(M, nodes) / k`` of their bytes
(``pipesim.model.experts.node_limited_share``). Under DeepSeek-V3's FP8 recipe the
all-to-all toward the experts carries FP8 with a scale per 128 elements and the one back
BF16 (section 3.3.3), so each pass pays one of each size
(``pipesim.model.spec.ModelSpec.dispatch_element_bytes``). DualPipeV's overlapped
pairs hide a half's all-to-alls under the other half's compute (``pipesim.sim.overlap``).
"""

from __future__ import annotations

from pipesim.cluster.collectives import all_to_all
from pipesim.cluster.mapping import RankMapping
from pipesim.cluster.topology import Topology
from pipesim.model.costs import Costs
from pipesim.model.experts import node_limited_share
from schedules.action import ActionKind
from schedules.schedule import Schedule

EP_KIND = "ALLTOALL_EP"


def ep_collective_seconds(schedule: Schedule, costs: Costs, topology: Topology,
                          mapping: RankMapping) -> dict[tuple[int, str], float]:
    """Seconds of expert-parallel all-to-alls after each (stage, compute kind)."""
    seconds: dict[tuple[int, str], float] = {}
    if mapping.ep == 1:
        return seconds
    for stage, cost in enumerate(costs.stages):
        if not (cost.moe_layers and cost.dispatch_bytes):
            continue
        groups = stage_ep_groups(mapping, schedule.placement[stage])
        nodes = len({topology.node_of(device) for device in groups[0]})
        share = node_limited_share(cost.dispatch_node_limit, cost.dispatch_copies, nodes)
        per_pass = cost.moe_layers * sum(all_to_all(topology, groups[0], size, groups[1:], share)
                                         for size in cost.all_to_all_bytes)  # dispatch and combine
        if per_pass <= 0:
            continue
        seconds[stage, ActionKind.F] = per_pass
        recomputed = per_pass if cost.recompute_layers else 0.0
        for kind in (ActionKind.B, ActionKind.I):
            seconds[stage, kind] = per_pass + recomputed
    return seconds


def stage_ep_groups(mapping: RankMapping, pipeline_rank: int) -> list[list[str]]:
    """The ep groups of pipeline rank ``pipeline_rank`` that exchange at once: the
    simulated pipeline's first, then every other group of every expert tensor-parallel
    shard (the tp shards unless parallel folding gives the experts their own)."""
    groups = [group for shard in range(mapping.expert_tp) for group in mapping.ep_groups(pipeline_rank, shard)]
    return groups
