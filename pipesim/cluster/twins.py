"""The P2P traffic of the pipelines the engine does not simulate.

The engine simulates one pipeline: data-parallel replica 0, tensor-parallel shard 0.
Every other (replica, shard) runs the same program in lockstep on its own devices
and sends the same transfers at the same moments (Megatron-LM sends each tp shard's
full activation to its counterpart on the next stage). Where their routes cross a
link that another pipeline also uses, say two GPUs behind one PCIe switch, those
transfers share the link with the simulated one. Rather than simulate every
pipeline, each simulated send also reserves the links for its *twins* (the same
send of the pipelines whose routes meet another's), and its data counts as arrived
when the last twin's has: the shards of a stage wait for each other at their next
tensor-parallel collective, and replicas stay in step through the gradient reduction.

Twins whose routes share no link with any other pipeline's change nothing and are
left out, so on NVSwitch and rail-optimised InfiniBand presets (one link per GPU)
the simulation costs what it did; there, every link being one device's
(``Topology.private_links``), that is known without routing any pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipesim.cluster.topology import Topology
from schedules.action import ActionKind
from schedules.dataflow import crossing_boundaries, output_stage
from schedules.schedule import Schedule

DevicePair = tuple[str, str]


def boundary_rank_pairs(schedule: Schedule) -> set[tuple[int, int]]:
    """(sender, receiver) pipeline ranks of every transfer: neighbouring stages on
    different ranks, both directions (activations forward, gradients back)."""
    placement = schedule.placement
    pairs = set()
    for stage in crossing_boundaries(placement):
        following = output_stage(stage, ActionKind.F)
        if not schedule.same_copy(stage, following):  # nothing crosses a seam between copies
            continue
        left, right = placement[stage], placement[following]
        pairs.update(((left, right), (right, left)))
    return pairs


def _disjoint(pipelines: Sequence[Sequence[str]]) -> bool:
    """Whether no device is in two pipelines (each is on its own GPUs in any mapping)."""
    return len({device for devices in pipelines for device in devices}) == sum(map(len, pipelines))


def twin_transfers(schedule: Schedule, topology: Topology, pipelines: Sequence[Sequence[str]]
                   ) -> dict[DevicePair, list[DevicePair]]:
    """For each (source, destination) device pair of ``pipelines[0]`` (the simulated
    one), the device pairs of the other pipelines' same transfer, for the pipelines
    whose routes use a link that another pipeline's routes also use. Empty when no
    two pipelines share a link."""
    if len(pipelines) < 2 or (topology.private_links() and _disjoint(pipelines)):
        return {}  # the second: no route of one pipeline can reach another's links
    pairs = sorted(boundary_rank_pairs(schedule))
    users: dict[tuple[str, str], set[int]] = {}
    for index, devices in enumerate(pipelines):
        for sender, receiver in pairs:
            for link in topology.route(devices[sender], devices[receiver]).links:
                users.setdefault(link, set()).add(index)
    contending = sorted({index for indices in users.values() if len(indices) > 1 for index in indices} - {0})
    if not contending:
        return {}
    simulated = pipelines[0]
    return {
        (simulated[sender], simulated[receiver]): [(pipelines[index][sender], pipelines[index][receiver])
                                                   for index in contending]
        for sender, receiver in pairs
    }
