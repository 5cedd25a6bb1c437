"""Draw a cluster topology as a self-contained plotly HTML page.

Takes plain node and edge lists (no simulator objects) so the drawing stays in
``viz`` without simpy: nodes ``{"name", "kind"}``, edges ``{"src", "dst",
"bandwidth", "latency", "medium"}`` (one per linked pair is enough).

Layout: nodes sit in tiers by kind (GPUs at the bottom, then NVSwitch/PCIe switches,
NICs, hosts, then the fabric), empty tiers dropped. GPUs are ordered by machine (the
``n0.`` prefix of their name) with a gap between machines, and every node above them
sits over the mean of the nodes it links to below, so a switch is drawn over its
GPUs and a NIC over the GPU it serves. Each machine is a shaded box named once, beneath
it, so labels inside it drop the prefix. Labels carry a white background, so links never
run through them; bandwidth is written on one link per (machine, medium, bandwidth),
once for the links between machines, and in the legend; every link answers a hover.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio

from viz.colors import stable_pick
from viz.html import include_plotlyjs, with_offline_notice

TIERS = {"gpu": 0, "nvswitch": 1, "pcie_switch": 1, "nic": 2, "host": 3}
FABRIC_TIER = 4  # anything else: IB/Ethernet switches, unknown kinds
NODE_COLORS = {"gpu": "#2e7d32", "nic": "#8d6e63", "nvswitch": "#1565c0", "pcie_switch": "#6a1b9a",
               "host": "#455a64"}
MEDIUM_COLORS = {"nvlink": "#1e88e5", "pcie": "#8e24aa", "upi": "#546e7a", "ib": "#e53935", "ethernet": "#fb8c00"}
_PALETTE = ("#00897b", "#c0ca33", "#5e35b1", "#d81b60", "#3949ab")
LABEL_LIMIT = 64  # nodes beyond which names are left to the hover
MIN_GAP = 0.9  # least horizontal distance between two nodes of one tier, in GPU slots
TITLE_WIDTH = 110  # characters per title line before it wraps


def machine_of(name: str) -> str:
    """The machine a node belongs to: the prefix before the first dot (``n0.gpu3`` ->
    ``n0``), or '' for nodes shared by all (the fabric, or a one-machine preset)."""
    return name.split(".", 1)[0] if "." in name else ""


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _tier(kind: str) -> int:
    return TIERS.get(kind, FABRIC_TIER)


def positions(nodes: list[dict], edges: list[dict]) -> dict[str, tuple[float, float]]:
    """x, y of every node (see the module docstring); y is the tier, compacted."""
    used = sorted({_tier(node.get("kind", "")) for node in nodes})
    level = {tier: index for index, tier in enumerate(used)}
    by_level: dict[int, list[str]] = {}
    for node in nodes:
        by_level.setdefault(level[_tier(node.get("kind", ""))], []).append(node["name"])
    neighbours: dict[str, set[str]] = {}
    for edge in edges:
        neighbours.setdefault(edge["src"], set()).add(edge["dst"])
        neighbours.setdefault(edge["dst"], set()).add(edge["src"])
    x: dict[str, float] = {}
    bottom = sorted(by_level.get(0, []), key=lambda name: (_natural(machine_of(name)), _natural(name)))
    machines = list(dict.fromkeys(machine_of(name) for name in bottom))
    for index, name in enumerate(bottom):
        x[name] = index + machines.index(machine_of(name))  # one empty slot between machines
    for tier in range(1, len(used)):
        names = sorted(by_level.get(tier, []), key=_natural)
        for name in names:
            below = [x[other] for other in neighbours.get(name, ()) if other in x]
            x[name] = sum(below) / len(below) if below else float("nan")
        placed = [x[name] for name in names if x[name] == x[name]]
        centre = sum(placed) / len(placed) if placed else (max(x.values(), default=0.0) / 2)
        for offset, name in enumerate(name for name in names if x[name] != x[name]):
            x[name] = centre + offset  # linked to nothing below: spread from the middle
        _spread(names, x)
    return {node["name"]: (x[node["name"]], float(level[_tier(node.get("kind", ""))])) for node in nodes}


def _spread(names: list[str], x: dict[str, float]) -> None:
    """Push apart nodes of one tier closer than ``MIN_GAP``, keeping their mean."""
    ordered = sorted(names, key=lambda name: (x[name], _natural(name)))
    if len(ordered) < 2:
        return
    before = sum(x[name] for name in ordered) / len(ordered)
    for left, right in zip(ordered, ordered[1:], strict=False):
        x[right] = max(x[right], x[left] + MIN_GAP)
    shift = before - sum(x[name] for name in ordered) / len(ordered)
    for name in ordered:
        x[name] += shift


def _gbps(bandwidth: float) -> str:
    return f"{bandwidth / 1e9:.3g} GB/s"


def _machine_boxes(figure: go.Figure, nodes: list[dict], where: dict[str, tuple[float, float]]) -> None:
    """A shaded box around each machine's nodes, named beneath it."""
    members: dict[str, list[tuple[float, float]]] = {}
    for node in nodes:
        machine = machine_of(node["name"])
        if machine:
            members.setdefault(machine, []).append(where[node["name"]])
    if len(members) < 2 and not any(machine_of(node["name"]) == "" for node in nodes):
        return
    for machine, points in members.items():
        xs, ys = [x for x, _ in points], [y for _, y in points]
        figure.add_shape(type="rect", x0=min(xs) - 0.55, x1=max(xs) + 0.55, y0=min(ys) - 0.45, y1=max(ys) + 0.4,
                         line={"color": "#B0BEC5", "width": 1}, fillcolor="rgba(236, 239, 241, 0.6)", layer="below")
        # Named under its box, where no link runs and no other label sits.
        figure.add_annotation(x=(min(xs) + max(xs)) / 2, y=min(ys) - 0.45, text=f"<b>node {machine}</b>",
                              showarrow=False, xanchor="center", yanchor="top", font={"size": 11, "color": "#455A64"})


def topology_figure(nodes: list[dict], edges: list[dict], title: str = "") -> go.Figure:
    """Nodes as markers (colour by kind) grouped by machine, links as lines (colour by
    medium, bandwidth in the legend and on one link per machine and medium) with
    bandwidth and latency on hover."""
    where = positions(nodes, edges)
    figure = go.Figure()
    _machine_boxes(figure, nodes, where)
    by_medium: dict[str, list[dict]] = {}
    for edge in edges:
        by_medium.setdefault(edge.get("medium") or "link", []).append(edge)
    labelled: set[tuple] = set()
    for medium, group in sorted(by_medium.items()):
        xs: list[float | None] = []
        ys: list[float | None] = []
        hover_x, hover_y, hover_text = [], [], []
        for edge in group:
            (x0, y0), (x1, y1) = where[edge["src"]], where[edge["dst"]]
            xs += [x0, x1, None]
            ys += [y0, y1, None]
            hover_x.append((x0 + x1) / 2)
            hover_y.append((y0 + y1) / 2)
            hover_text.append(f"{edge['src']} - {edge['dst']}: {_gbps(edge['bandwidth'])} per direction, "
                              f"{edge['latency'] * 1e6:g} µs, {medium}")
        color = MEDIUM_COLORS.get(medium, stable_pick(medium, _PALETTE))
        speeds = " / ".join(dict.fromkeys(_gbps(edge["bandwidth"]) for edge in group))
        figure.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line={"color": color, "width": 1.5},
                                    name=f"{medium}: {speeds}", hoverinfo="skip"))
        figure.add_trace(go.Scatter(x=hover_x, y=hover_y, mode="markers", marker={"size": 4, "color": color},
                                    hovertext=hover_text, hoverinfo="text", showlegend=False))
        # One written bandwidth per machine and speed: the first link of that set (the
        # outermost, where fewest other links cross).
        sets: dict[tuple, list[int]] = {}
        for index, edge in enumerate(group):
            inside = machine_of(edge["src"]) if machine_of(edge["src"]) == machine_of(edge["dst"]) else ""
            key = (inside, edge["bandwidth"])  # links between machines (the fabric) once in all
            sets.setdefault(key, []).append(index)
        for key, indices in sets.items():
            index = indices[0]
            if (medium, *key) in labelled:
                continue
            labelled.add((medium, *key))
            (x0, y0), (x1, y1) = where[group[index]["src"]], where[group[index]["dst"]]
            if y1 < y0:
                (x0, y0), (x1, y1) = (x1, y1), (x0, y0)
            share = 0.5 if key[0] else 0.75  # a fabric link's label near the switch, clear of the boxes
            figure.add_annotation(x=x0 + (x1 - x0) * share, y=y0 + (y1 - y0) * share,
                                  text=_gbps(group[index]["bandwidth"]),
                                  showarrow=False, font={"size": 10, "color": color},
                                  bgcolor="rgba(255,255,255,0.9)", borderpad=1)
    by_kind: dict[str, list[dict]] = {}
    for node in nodes:
        by_kind.setdefault(node.get("kind") or "node", []).append(node)
    for kind, group in sorted(by_kind.items()):
        figure.add_trace(go.Scatter(
            x=[where[node["name"]][0] for node in group],
            y=[where[node["name"]][1] for node in group],
            mode="markers",
            hovertext=[node.get("hover", node["name"]) for node in group],
            hoverinfo="text",
            marker={"size": 12 if kind == "gpu" else 16, "color": NODE_COLORS.get(kind, stable_pick(kind, _PALETTE)),
                    "symbol": "square" if kind == "gpu" else "diamond"},
            name=kind,
        ))
    if len(nodes) <= LABEL_LIMIT:
        for node in nodes:
            x, y = where[node["name"]]
            short = node["name"].split(".", 1)[1] if machine_of(node["name"]) else node["name"]
            figure.add_annotation(x=x, y=y, text=short, showarrow=False, yshift=-16 if y == 0 else 16,
                                  font={"size": 10}, bgcolor="rgba(255,255,255,0.85)", borderpad=1)
    levels = max((y for _, y in where.values()), default=0.0)
    wrapped = "<br>".join(textwrap.wrap(title, TITLE_WIDTH)) if title else ""
    figure.update_layout(title={"text": wrapped, "x": 0.01, "xanchor": "left", "font": {"size": 15}},
                         template="plotly_white", height=int(260 + 120 * levels),
                         margin={"t": 60 + 20 * wrapped.count("<br>"), "l": 20, "r": 20, "b": 20},
                         xaxis={"visible": False}, yaxis={"visible": False, "range": [-1.0, levels + 0.6]},
                         hovermode="closest")
    return figure


def write_topology_html(nodes: list[dict], edges: list[dict], path: str | Path, title: str = "",
                        plotly: str = "inline") -> Path:
    """Write the drawing as one HTML file with plotly.js embedded (opens offline)."""
    path = Path(path)
    html = pio.to_html(topology_figure(nodes, edges, title), include_plotlyjs=include_plotlyjs(plotly), full_html=True,
                       config={"displaylogo": False})
    path.write_text(with_offline_notice(html, plotly), encoding="utf-8")
    return path
