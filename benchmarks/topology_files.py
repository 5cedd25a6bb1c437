"""Topology files of any size, for timing ``--topology FILE`` against the presets.

``python benchmarks/topology_files.py --nodes 256 --out ib256.json`` writes the ``ib``
preset's cluster (``--nodes`` nodes of 8 GPUs, NVSwitch inside, one NIC per GPU into one
InfiniBand fabric switch) as a topology file: every device, switch and link the preset
holds, with the preset's figures, so a simulation on the file and on the preset describe
the same cluster and must predict the same step. ``--preset`` picks another multi-node
preset (``ethernet``); ``--gpu`` the device.

``--bench 256,2048`` times a whole ``pipesim simulate`` (a new process, wall seconds,
llama3-8b 1f1b pp 8 m 16 with dp filling the cluster) on the file and on the preset
for each node count, the table docs/cluster-model.md quotes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipesim.cluster.files import load_topology
from pipesim.cluster.topology import Topology


def topology_document(topology: Topology) -> dict:
    """``topology`` as the mapping a topology file holds (devices in rank order with
    their node, every switch, every linked pair once with its figures)."""
    graph = topology.graph
    devices, switches = [], []
    for name, data in graph.nodes(data=True):
        if data.get("kind") == "gpu":
            entry = {"name": name}
            node = topology.node_of(name)  # the node a device sits in decides NCCL's channels (memory headroom)
            if node is not None:
                entry["node"] = node
            if data.get("gpu"):
                entry["gpu"] = data["gpu"]
            for key in ("memory_bytes", "peak_flops", "memory_bandwidth"):
                value = data.get(key)
                if value is not None and math.isfinite(value):
                    entry[key] = value
            devices.append(entry)
        else:
            switches.append({"name": name, "kind": data.get("kind", "switch")})
    links, seen = [], set()
    for src, dst, data in graph.edges(data=True):
        if (dst, src) in seen:
            continue
        seen.add((src, dst))
        link = {"src": src, "dst": dst, "bandwidth": data["bandwidth"], "latency": data["latency"],
                "efficiency": data.get("efficiency", 1.0), "medium": data.get("medium", "")}
        if not graph.has_edge(dst, src):
            link["directed"] = True
        links.append(link)
    order = {name: position for position, name in enumerate(topology.devices)}
    devices.sort(key=lambda entry: order.get(entry["name"], len(order)))
    return {"description": topology.description, "devices": devices, "switches": switches, "links": links}


def simulate_seconds(topology: list[str], nodes: int) -> float:
    """Wall seconds of one ``pipesim simulate`` in a new process (start-up included)."""
    command = [sys.executable, "-m", "pipesim", "simulate", *topology, "--schedule", "1f1b", "--pp", "8",
               "--dp", str(nodes), "--microbatches", "16", "--model", "llama3-8b"]
    root = str(Path(__file__).resolve().parents[1])
    environment = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=environment)
    return time.perf_counter() - start


def bench(node_counts: list[int], preset: str) -> None:
    """The file against the preset, one row per cluster size."""
    print(f"{'GPUs':>7} {'links':>7} {'file s':>7} {'preset s':>9}")
    with tempfile.TemporaryDirectory() as folder:
        for nodes in node_counts:
            path = Path(folder) / f"{preset}{nodes}.json"
            document = topology_document(load_topology(preset, nodes))
            path.write_text(json.dumps(document))
            from_file = simulate_seconds(["--topology", str(path)], nodes)
            from_preset = simulate_seconds(["--topology", preset, "--nodes", str(nodes)], nodes)
            print(f"{8 * nodes:>7,} {len(document['links']):>7,} {from_file:>7.2f} {from_preset:>9.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="ib", help="multi-node preset to write out (ib, ethernet)")
    parser.add_argument("--nodes", type=int, default=256, help="nodes of 8 GPUs")
    parser.add_argument("--gpu", default=None, help="device of the preset (default h100)")
    parser.add_argument("--out", help="the JSON file to write")
    parser.add_argument("--bench", help="node counts to time simulate on, comma-separated (e.g. 256,2048)")
    args = parser.parse_args(argv)
    if args.bench:
        bench([int(count) for count in args.bench.split(",")], args.preset)
        return 0
    if not args.out:
        parser.error("--out FILE (or --bench NODES) is required")
    topology = load_topology(args.preset, args.nodes, gpu=args.gpu)
    document = topology_document(topology)
    Path(args.out).write_text(json.dumps(document))
    print(f"wrote {args.out}: {len(document['devices'])} devices, {len(document['switches'])} switches, "
          f"{len(document['links'])} links")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
