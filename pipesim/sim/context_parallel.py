"""Context parallelism in a step: the keys and values a rank's attention needs from the
other ranks of its sequence.

Over ``cp`` context-parallel ranks each holds ``s / cp`` tokens of every sequence (with
Megatron-Core's causal load balancing, chunks ``i`` and ``2 cp - 1 - i`` of ``2 cp``), so
every layer's attention needs the other ranks' keys and values. Two ways, as
Transformer Engine implements them for Megatron-Core (``--cp-comm-type``):

**Ring (``p2p``, the default; ring attention).** Attention runs in ``cp`` steps, the
rank's queries against one block of keys and values each, and the blocks travel around
the ring (``AttnFuncWithCPAndKVP2P``): while step ``i`` computes, the block for step
``i + 1`` is in flight, so a step lasts the longer of its compute and its transfer. With
``S`` the bytes of one rank's keys and values (``kv_bytes``), ``t(S) = S/B + alpha`` one
ring exchange (``pipesim.cluster.collectives.ring_exchange``) and ``c = A / cp`` one
step's share of the attention core's ``A`` seconds (every step the same work under load
balancing), per layer:

    forward   c + (cp - 1) max(c, t(S))
    backward  max(c, t(S)) + (cp - 2) max(c, t(2S)) + max(c, t(S))

The backward (``cp >= 2`` steps) sends the keys and values on at its first step, the
keys and values *and* the gradients accumulated for them at the middle steps, and the
gradients home at its last: that is Transformer Engine's backward. What the compute does
not hide, ``(cp - 1) max(0, t(S) - c)`` forward and ``2 max(0, t(S) - c) + (cp - 2)
max(0, t(2S) - c)`` backward, holds the rank after the compute action (the attention is
on the layer's critical path) and counts as ``cp`` in the step's time accounting; the
compute itself is in the stage's ``fwd`` and ``bwd``. A transfer beside a step's compute
slows it (``pipesim.sim.comm_overlap``): with the default slowdown each step's
``max(c, t)`` becomes ``overlapped_seconds(c, t)``.

**All-gather (``all-gather``; Llama 3's choice).** The keys and values of the whole
sequence are all-gathered before the attention and the gradients reduce-scattered after
its backward (``AttnFuncWithCPAndKVAllGather``, which gathers them again in the backward
rather than keeping them), none of it overlapped: forward ``all_gather(cp S)``, backward
``all_gather(cp S) + reduce_scatter(cp S)`` per layer, all exposed. Dubey et al. 2024
(section 3.3.2) chose it because with grouped-query attention the keys and values are
small next to the queries.

Full recompute re-runs the forward, its exchanges included, inside the backward. The
ring's transfers are priced over the ring's slowest neighbour route, as the ring
collectives are; like the tp collectives (unlike the gradient reductions, which hold their
links in the engine's walk) they do not contend with P2P traffic or the other shards' rings.
"""

from __future__ import annotations

from pipesim.cluster.collectives import all_gather, reduce_scatter, ring_exchange
from pipesim.cluster.mapping import RankMapping
from pipesim.cluster.topology import Topology
from pipesim.model.costs import Costs, StageCost
from pipesim.model.ring_merge import CP_COMMS
from pipesim.sim.comm_overlap import OVERLAP_SLOWDOWN, exposed_seconds
from schedules.action import ActionKind
from schedules.schedule import Schedule

CP_KIND = "CP_KV"


def check_cp_comm(comm: str) -> str:
    """``comm`` if it names a way to exchange keys and values, else a one-line error."""
    if comm not in CP_COMMS:
        raise ValueError(f"--cp-comm {comm!r}: use one of {', '.join(CP_COMMS)} (p2p: the K/V ring overlapped with "
                         f"attention; all-gather: gathered before it, as Llama 3)")
    return comm


def ring_attention_exposed(cp: int, compute_forward: float, compute_backward: float, one_block: float,
                           two_blocks: float, slowdown: float = 0.0) -> tuple[float, float]:
    """Per layer, the (forward, backward) seconds ring attention's transfers add to its
    compute: ``cp`` steps of ``compute_forward / cp`` (``compute_backward / cp``) seconds,
    a block exchange taking ``one_block`` seconds (``two_blocks`` for the backward's
    middle steps, which carry the gradients too; see the module), each step's transfer
    beside its compute (``pipesim.sim.comm_overlap.exposed_seconds``: with ``slowdown``
    0, ``max(0, transfer - compute)``; above it the transfer slows the compute too)."""
    if cp == 1:
        return 0.0, 0.0
    step_forward, step_backward = compute_forward / cp, compute_backward / cp
    forward = (cp - 1) * exposed_seconds(step_forward, one_block, slowdown)
    backward = (2 * exposed_seconds(step_backward, one_block, slowdown)
                + (cp - 2) * exposed_seconds(step_backward, two_blocks, slowdown))
    return forward, backward


def layer_exchange_seconds(cost: StageCost, topology: Topology, group: list[str], comm: str,
                           slowdown: float = 0.0) -> tuple[float, float]:
    """Per layer of a stage, the (forward, backward) seconds its K/V exchanges hold the
    rank (the ring's with ``slowdown``, see ``ring_attention_exposed``)."""
    cp = len(group)
    if comm == "all-gather":
        gathered = cp * cost.kv_bytes
        gather = all_gather(topology, group, gathered)
        return gather, gather + reduce_scatter(topology, group, gathered)
    return ring_attention_exposed(cp, cost.attention_fwd, cost.attention_bwd,
                                  ring_exchange(topology, group, cost.kv_bytes),
                                  ring_exchange(topology, group, 2 * cost.kv_bytes), slowdown)


def cp_collective_seconds(schedule: Schedule, costs: Costs, topology: Topology, mapping: RankMapping,
                          comm: str = "p2p", slowdown: float = OVERLAP_SLOWDOWN) -> dict[tuple[int, str], float]:
    """Seconds of context-parallel K/V exchanges after each (stage, compute kind); the
    ring's transfers slow the attention beside them by ``slowdown``
    (``pipesim.sim.comm_overlap``)."""
    check_cp_comm(comm)
    seconds: dict[tuple[int, str], float] = {}
    if mapping.cp == 1:
        return seconds
    for stage, cost in enumerate(costs.stages):
        if not (cost.attention_layers and cost.kv_bytes):
            continue
        group = mapping.cp_group(0, schedule.placement[stage], 0)
        forward, backward = layer_exchange_seconds(cost, topology, group, comm, slowdown)
        layers = cost.attention_layers
        if forward > 0:
            seconds[stage, ActionKind.F] = layers * forward
        recomputed = forward if cost.recompute_layers else 0.0
        if backward + recomputed > 0:
            for kind in (ActionKind.B, ActionKind.I):
                seconds[stage, kind] = layers * (backward + recomputed)
    return seconds
