"""What ``pipesim simulate`` says beside its numbers, so that a default or an input that
changes their meaning is seen: where the pipeline's ranks landed, links that cannot
matter because transfers carry no bytes, and figures that cannot be physical (tokens a
capacity factor drops, an MFU over 100%)."""

from __future__ import annotations

from pipesim.cluster.presets import NVL72_GPU, NVL72_GPUS
from schedules.units import percent


def placement_line(result, rank_order: str | None) -> str | None:
    """Where the pipeline's ranks run (replica 0's, the one simulated), node by node:
    ``placed: n0 gpu0 gpu2 <- ranks 0-1; n1 gpu0 gpu2 <- ranks 2-3``; None on free links,
    whose devices are names only."""
    if result.topology.ideal or not result.devices:
        return None
    nodes: dict[str, list[tuple[int, str]]] = {}
    for rank, device in enumerate(result.devices):
        node, _, gpu = device.rpartition(".")
        nodes.setdefault(node or "-", []).append((rank, gpu or device))
    parts = []
    for node, held in nodes.items():
        ranks = [rank for rank, _ in held]
        span = f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1 \
            else ",".join(map(str, ranks))
        parts.append(f"{node} {' '.join(gpu for _, gpu in held)} <- rank{'s' if len(ranks) > 1 else ''} {span}")
    return "  placed: " + "; ".join(parts) + (f" (--rank-order {rank_order})" if rank_order else "")


def bytes_hint(result) -> str | None:
    """A hint when the links cannot matter: a cluster with links, and transfers of no bytes
    (none at pp 1, where no stage sends to another rank and no bytes are the truth)."""
    if result.topology.ideal or result.schedule.pp == 1 or any(stage.act_bytes for stage in result.costs.stages):
        return None
    return (f"note: transfers carry no bytes (--act-bytes 0), so topology {result.topology.name}'s links cost only "
            "their latency; give --act-bytes, or --model to size them")


def rack_hint(result) -> str | None:
    """A hint when GB200s are placed in nodes of another preset whose network joins them:
    the part comes in NVL72 racks, where one NVLink domain holds 72 of them."""
    topology = result.topology
    devices = result.mapping.devices if result.mapping is not None else result.devices  # every rank's, every replica's
    if topology.ideal or topology.name == "nvl72" or not devices:
        return None
    if not any(topology.device_gpu(device) == NVL72_GPU for device in devices):
        return None
    nodes = {topology.node_of(device) for device in devices}
    if len(nodes) < 2:
        return None
    return (f"note: the {NVL72_GPU} ranks span {len(nodes)} nodes of topology {topology.name}, joined by its network; "
            f"GB200s come in NVL72 racks, {NVL72_GPUS} GPUs on one NVLink domain: --topology nvl72")


def impossible_notes(spec, figures: dict) -> list[str]:
    """What the figures cannot be taken for: routed tokens a capacity factor below 1 drops
    (the throughput counts tokens, not all of them computed by their experts), and an MFU
    over 100% (a physically impossible step: costs faster than the device)."""
    notes = []
    dropped = spec.moe.dropped_share if spec.moe is not None else 0.0
    if dropped > 0:
        notes.append(f"warning: --capacity-factor {spec.moe.capacity_factor:g} drops at least {percent(dropped)} of "
                     "the routed token copies (each expert computes that share of its balanced load); MFU counts "
                     "only the computed ones, tokens/s counts every token")
    if figures.get("mfu") is not None and figures["mfu"] > 1:
        notes.append(f"warning: MFU {percent(figures['mfu'])} exceeds 100%: the step is faster than the devices' "
                     "peak allows, so its costs are not physical (check --mfu and the GPU's peak)")
    return notes
