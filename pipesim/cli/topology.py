"""``pipesim topology show``: print a preset or topology file and draw it."""

from __future__ import annotations

import argparse

from pipesim.cluster.files import load_topology
from pipesim.cluster.presets import PRESETS
from pipesim.cluster.topology import Topology


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "topology", help="print or draw a cluster topology",
        description="Inspect the modelled cluster: devices, switches and links.",
    )
    actions = parser.add_subparsers(dest="topology_command", metavar="ACTION")
    actions.required = True
    show = actions.add_parser("show", help="print devices, switches and links; --html draws the graph",
                              description="Print a topology preset or file; optionally draw it as HTML.")
    show.add_argument("spec", metavar="PRESET|FILE", help=f"one of {', '.join(PRESETS)} or a YAML/JSON file")
    show.add_argument("--nodes", type=int, default=None, help="nodes for the multi-node presets (ib, ethernet)")
    show.add_argument("--html", help="write the graph as a self-contained HTML page")
    show.set_defaults(handler=handle_show)


def graph_lists(topology: Topology) -> tuple[list[dict], list[dict]]:
    """Plain node and edge lists for the drawing (one edge per linked pair)."""
    graph = topology.graph
    nodes = []
    for name, data in graph.nodes(data=True):
        hover = name + f" ({data.get('kind', '?')})"
        if data.get("memory_bytes"):
            hover += f", {data['memory_bytes'] / 1e9:g} GB"
        if data.get("peak_flops") and data["peak_flops"] != float("inf"):
            hover += f", {data['peak_flops'] / 1e12:g} TFLOP/s"
        nodes.append({"name": name, "kind": data.get("kind", ""), "hover": hover})
    edges = []
    seen = set()
    for src, dst, data in graph.edges(data=True):
        if (dst, src) in seen:
            continue
        seen.add((src, dst))
        edges.append({"src": src, "dst": dst, "bandwidth": data["bandwidth"], "latency": data["latency"],
                      "medium": data.get("medium", "")})
    return nodes, edges


def handle_show(args: argparse.Namespace) -> int:
    topology = load_topology(args.spec, args.nodes)
    print(topology.summary())
    if topology.devices:
        print("  devices (rank order): " + ", ".join(topology.devices))
    if args.html:
        from viz.topology import write_topology_html

        nodes, edges = graph_lists(topology)
        write_topology_html(nodes, edges, args.html, title=f"topology {topology.name}: {topology.description}",
                            plotly=args.plotly)
        print(f"wrote {args.html}")
    return 0
