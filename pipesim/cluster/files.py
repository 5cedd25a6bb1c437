"""User topology files (YAML or JSON), and the one function that turns a
``--topology`` value (a preset name or a file) into a ``Topology``.

Minimal form::

    devices: [{name: g0, memory_bytes: 80e9}, {name: g1, memory_bytes: 80e9}]
    links:   [{src: g0, dst: g1, bandwidth: 10e9, latency: 1e-3}]

Optional: ``switches: [{name: sw0, kind: pcie_switch}]``; per link ``efficiency``
(default 1), ``medium``, ``directed: true`` (one direction only); per device
``peak_flops``, ``memory_bandwidth`` (HBM bytes/s), or ``gpu: h100`` (a name from
``pipesim.hardware.gpus``) for that model's figures, which the explicit fields then override,
and ``node`` (the server it sits in: node-limited expert routing and NCCL's channel
counts read it; without it every device counts as a node of its own);
``mapping: [g1, g0]`` (rank r runs on mapping[r]; default: file order);
``collectives: [{operation: all_to_all, ranks: 2, bandwidth: 2e9, latency: 1e-3}]``
(a collective measured as the backend runs it, over groups of ``ranks``; ``bench-comm``
writes them for ``all_to_all`` and ``ring_exchange``, ``compare --topology-out`` also for
the tp ``all_reduce`` it calibrates: ``S / bandwidth + latency`` for a message of S bytes
per rank, in place of the links' price). ``topology_to_dict`` writes a ``Topology`` back
in this form. Every number must be finite: NaN, inf, null and
negative values are errors naming the entry and the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pipesim.cluster.presets import PRESETS
from pipesim.cluster.topology import Topology, TopologyError, add_link
from pipesim.hardware.gpus import GPUS
from schedules.textfile import describe_yaml_error, read_text, write_text_whole


def _number(where: str, entry: dict, key: str, default: float | None = None, positive: bool = False) -> float:
    if key not in entry:
        if default is None:
            raise TopologyError(f"{where} is missing '{key}'")
        return default
    raw = entry[key]
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise TopologyError(f"{where}: '{key}' must be a number, got {raw!r}")
    try:
        value = float(raw)
    except (TypeError, ValueError) as error:
        raise TopologyError(f"{where}: '{key}' must be a number, got {raw!r}") from error
    if not math.isfinite(value):
        raise TopologyError(f"{where}: '{key}' must be a finite number, got {raw!r}")
    if value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise TopologyError(f"{where}: '{key}' must be {bound}, got {entry[key]!r}")
    return value


def topology_from_dict(data: object, name: str = "custom") -> Topology:
    """Build a topology from parsed YAML/JSON; errors name the entry and the field."""
    if not isinstance(data, dict):
        raise TopologyError(f"{name}: expected a mapping with 'devices' and 'links'")
    devices = data.get("devices")
    if not isinstance(devices, list) or not devices:
        raise TopologyError(f"{name}: 'devices' must be a non-empty list")
    import networkx as nx

    graph = nx.DiGraph()
    order = []
    for index, device in enumerate(devices):
        where = f"{name}: devices[{index}]"
        if not isinstance(device, dict) or "name" not in device:
            raise TopologyError(f"{where} needs a 'name'")
        device_name = str(device["name"])
        if device_name in graph:
            raise TopologyError(f"{where}: device {device_name!r} is listed twice")
        memory, flops, bandwidth = math.inf, math.inf, math.inf
        named = {}
        if device.get("gpu") is not None:
            gpu = GPUS.get(str(device["gpu"]).lower())
            if gpu is None:
                raise TopologyError(f"{where}: unknown gpu {device['gpu']!r} (known: {', '.join(GPUS)})")
            memory, flops, bandwidth = gpu.memory_bytes, gpu.bf16_flops, gpu.memory_bandwidth
            named = {"gpu": gpu.name}  # its kernels time a model's compute (pipesim.model.compute_model)
        if device.get("node") is not None:  # node-limited expert routing and NCCL's channels count nodes
            if not isinstance(device["node"], (str, int)) or isinstance(device["node"], bool):
                raise TopologyError(f"{where}: 'node' must be a name or a whole number, not {device['node']!r}")
            named["node"] = str(device["node"])
        graph.add_node(
            device_name,
            kind="gpu",
            **named,
            memory_bytes=_number(where, device, "memory_bytes", memory, positive=True),
            peak_flops=_number(where, device, "peak_flops", flops, positive=True),
            memory_bandwidth=_number(where, device, "memory_bandwidth", bandwidth, positive=True),
        )
        order.append(device_name)
    for index, switch in enumerate(data.get("switches") or []):
        if not isinstance(switch, dict) or "name" not in switch:
            raise TopologyError(f"{name}: switches[{index}] needs a 'name'")
        if str(switch["name"]) in graph:
            raise TopologyError(f"{name}: switches[{index}]: name {switch['name']!r} is already used")
        graph.add_node(str(switch["name"]), kind=str(switch.get("kind", "switch")))
    links = data.get("links")
    if not isinstance(links, list) or not links:
        if len(order) > 1:
            raise TopologyError(f"{name}: 'links' must be a non-empty list when there are several devices")
        links = []
    for index, link in enumerate(links):
        where = f"{name}: links[{index}]"
        if not isinstance(link, dict):
            raise TopologyError(f"{where} must be a mapping with src, dst, bandwidth, latency")
        for end in ("src", "dst"):
            if end not in link:
                raise TopologyError(f"{where} is missing '{end}'")
            if str(link[end]) not in graph:
                known = ", ".join(list(graph.nodes)[:12])
                raise TopologyError(f"{where}: unknown device or switch {link[end]!r} (known: {known})")
        efficiency = _number(where, link, "efficiency", 1.0, positive=True)
        if efficiency > 1:
            raise TopologyError(f"{where}: 'efficiency' is a fraction of bandwidth in (0, 1], got {efficiency}")
        add_link(
            graph,
            str(link["src"]),
            str(link["dst"]),
            bandwidth=_number(where, link, "bandwidth", positive=True),
            latency=_number(where, link, "latency"),
            efficiency=efficiency,
            medium=str(link.get("medium", "")),
            directed=bool(link.get("directed", False)),
        )
    mapping = data.get("mapping")
    if mapping is not None:
        if not isinstance(mapping, list) or not mapping:
            raise TopologyError(f"{name}: 'mapping' must be a list of device names, one per rank")
        for rank, device_name in enumerate(mapping):
            if str(device_name) not in order:
                raise TopologyError(f"{name}: mapping[{rank}] names unknown device {device_name!r}")
        order = [str(device_name) for device_name in mapping]
    calibration = data.get("calibration")
    backend = calibration.get("backend") if isinstance(calibration, dict) else None
    topology = Topology(name, graph, order, description=str(data.get("description", "")),
                        backend=str(backend) if backend else None, measured_collectives=_collectives(name, data))
    _require_connected(topology)
    return topology


def _collectives(name: str, data: dict) -> dict[tuple[str, int], tuple[float, float]]:
    """The file's ``collectives`` as ``Topology.measured_collectives``; errors name the entry."""
    from pipesim.cluster.comm_fit import FILE_COLLECTIVES  # noqa: PLC0415

    entries = data.get("collectives") or []
    if not isinstance(entries, list):
        raise TopologyError(f"{name}: 'collectives' must be a list of mappings with operation, ranks, bandwidth, "
                            "latency")
    measured = {}
    for index, entry in enumerate(entries):
        where = f"{name}: collectives[{index}]"
        if not isinstance(entry, dict):
            raise TopologyError(f"{where} must be a mapping with operation, ranks, bandwidth, latency")
        operation = entry.get("operation")
        if operation not in FILE_COLLECTIVES:
            raise TopologyError(f"{where}: 'operation' {operation!r} is not one of {', '.join(FILE_COLLECTIVES)}")
        ranks = _number(where, entry, "ranks")
        if ranks != int(ranks) or ranks < 2:
            raise TopologyError(f"{where}: 'ranks' must be a whole number >= 2, got {entry['ranks']!r}")
        measured[operation, int(ranks)] = (_number(where, entry, "bandwidth", positive=True),
                                           _number(where, entry, "latency"))
    return measured


def _require_connected(topology: Topology) -> None:
    """Every device must reach every other, or ranks on them could never exchange data."""
    import networkx as nx  # only where a graph is built or walked (pipesim.cluster.topology says why)

    first = topology.devices[0]
    # what the first device reaches and what reaches it: one walk each way, whatever the size
    reachable = nx.descendants(topology.graph, first) | {first}
    reaching = nx.ancestors(topology.graph, first) | {first}
    for device in topology.devices[1:]:
        if device not in reachable or device not in reaching:
            raise TopologyError(f"{topology.name}: device {device!r} is not connected to {first!r} in both directions")


DEVICE_FIGURES = ("memory_bytes", "peak_flops", "memory_bandwidth")


def topology_to_dict(topology: Topology) -> dict:
    """``topology`` in the file form ``topology_from_dict`` reads, so that reading it back
    gives the same devices, links, mapping, measured collectives and backend: what
    ``compare --topology-out`` writes of the links and collectives it calibrated. Each
    link both ways with the same figures is written once, any other direction
    ``directed``; a figure the topology does not know (unbounded) is left out, as a file
    leaves it out. An ideal topology has no links to write: its name, ``ideal``, is the
    preset that gives it back."""
    if topology.ideal:
        raise TopologyError("an ideal topology has free links and no file form; give --topology ideal instead")
    graph = topology.graph
    devices, switches = [], []
    for name, data in graph.nodes(data=True):
        if data.get("kind") != "gpu":
            switches.append({"name": name, "kind": data.get("kind", "switch")})
            continue
        device = {"name": name}
        if topology.device_gpu(name):
            device["gpu"] = topology.device_gpu(name)
        device.update({key: topology.device_figure(name, key) for key in DEVICE_FIGURES
                       if math.isfinite(topology.device_figure(name, key))})
        if topology.node_of(name) is not None:
            device["node"] = topology.node_of(name)
        devices.append(device)
    links, written = [], set()
    for src, dst, data in graph.edges(data=True):
        if (src, dst) in written:
            continue
        figures = {key: data[key] for key in ("bandwidth", "latency")}
        figures.update(efficiency=data.get("efficiency", 1.0), medium=data.get("medium", ""))
        both = graph.has_edge(dst, src) and dict(graph.edges[dst, src]) == dict(data)
        links.append({"src": src, "dst": dst, **figures, **({} if both else {"directed": True})})
        written.update({(src, dst), (dst, src)} if both else {(src, dst)})
    document: dict = {"description": topology.description, "devices": devices}
    if switches:
        document["switches"] = switches
    document["links"] = links
    document["mapping"] = list(topology.devices)
    if topology.backend:
        document["calibration"] = {"backend": topology.backend}
    if topology.measured_collectives:
        document["collectives"] = [{"operation": operation, "ranks": ranks, "bandwidth": bandwidth, "latency": latency}
                                   for (operation, ranks), (bandwidth, latency)
                                   in sorted(topology.measured_collectives.items())]
    return document


def save_topology(topology: Topology, path: str | Path) -> None:
    """Write ``topology`` as a JSON topology file (``topology_to_dict``)."""
    write_text_whole(path, json.dumps(topology_to_dict(topology), indent=2) + "\n")


def load_topology_file(path: str | Path) -> Topology:
    """Read a YAML or JSON topology file."""
    path = Path(path)
    text = read_text(path, "topology file (YAML or JSON)")
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:  # libyaml's parser where installed: 3.5x faster than the pure-Python one on large clusters
            data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 (a safe loader)
        except yaml.YAMLError as error:
            raise TopologyError(f"{path}: not valid YAML ({describe_yaml_error(error)})") from error
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise TopologyError(f"{path}: not valid JSON ({error})") from error
    return topology_from_dict(data, name=str(path))


def load_topology(spec: str, nodes: int | None = None, gpu: str | None = None) -> Topology:
    """``spec`` is a preset name (``ideal``, ``nvlink``, ``pcie``, ``pcie5``, ``ib``,
    ``nvl72``, ``ethernet``) or a path to a YAML/JSON file. ``nodes`` sizes multi-node
    presets (default 2 nodes, 1 NVL72 rack); ``gpu`` (a ``pipesim.hardware.gpus`` name)
    picks the presets' devices (default H100; GB200 on ``nvl72``)."""
    preset = PRESETS.get(spec)
    if preset is not None:  # without --nodes, the preset's own default (2 nodes, 1 NVL72 rack, 1 for the others)
        return preset(gpu=gpu) if nodes is None else preset(nodes, gpu=gpu)
    path = Path(spec)
    if path.suffix.lower() in (".yaml", ".yml", ".json") or path.exists():
        if nodes not in (None, 1):
            raise TopologyError("--nodes sizes the built-in multi-node presets, not a topology file")
        if gpu is not None:
            raise TopologyError("--gpu picks the devices of the built-in presets; a topology file names its own "
                                "(devices[i].gpu)")
        return load_topology_file(path)
    raise TopologyError(f"unknown topology {spec!r}: use one of {', '.join(PRESETS)} or a .yaml/.json file")
