"""Draw a cluster topology as a self-contained plotly HTML page.

Takes plain node and edge lists (no simulator objects) so the drawing stays in
``viz`` without simpy: nodes ``{"name", "kind"}``, edges ``{"src", "dst",
"bandwidth", "latency", "medium"}`` (one per linked pair is enough). Nodes sit in tiers
by kind: GPUs at the bottom, then their switches and NICs, hosts, then the fabric.
"""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio

from viz.colors import stable_pick
from viz.html import include_plotlyjs

TIERS = {"gpu": 0, "nic": 1, "nvswitch": 1, "pcie_switch": 1, "host": 2}
NODE_COLORS = {"gpu": "#2e7d32", "nic": "#8d6e63", "nvswitch": "#1565c0", "pcie_switch": "#6a1b9a",
               "host": "#455a64"}
MEDIUM_COLORS = {"nvlink": "#1e88e5", "pcie": "#8e24aa", "upi": "#546e7a", "ib": "#e53935", "ethernet": "#fb8c00"}
_PALETTE = ("#00897b", "#c0ca33", "#5e35b1", "#d81b60", "#3949ab")


def _positions(nodes: list[dict]) -> dict[str, tuple[float, float]]:
    tiers: dict[int, list[str]] = {}
    for node in nodes:
        tiers.setdefault(TIERS.get(node.get("kind", ""), 3), []).append(node["name"])
    positions = {}
    for tier, names in tiers.items():
        for index, name in enumerate(names):
            positions[name] = ((index + 0.5) / len(names), float(tier))
    return positions


def topology_figure(nodes: list[dict], edges: list[dict], title: str = "") -> go.Figure:
    """Nodes as markers (colour by kind), links as lines (colour by medium) with their
    bandwidth and latency on hover."""
    positions = _positions(nodes)
    figure = go.Figure()
    by_medium: dict[str, list[dict]] = {}
    for edge in edges:
        by_medium.setdefault(edge.get("medium") or "link", []).append(edge)
    for medium, group in sorted(by_medium.items()):
        xs: list[float | None] = []
        ys: list[float | None] = []
        hover_x, hover_y, hover_text = [], [], []
        for edge in group:
            (x0, y0), (x1, y1) = positions[edge["src"]], positions[edge["dst"]]
            xs += [x0, x1, None]
            ys += [y0, y1, None]
            hover_x.append((x0 + x1) / 2)
            hover_y.append((y0 + y1) / 2)
            hover_text.append(f"{edge['src']} - {edge['dst']}: {edge['bandwidth'] / 1e9:g} GB/s per direction, "
                              f"{edge['latency'] * 1e6:g} us, {medium}")
        color = MEDIUM_COLORS.get(medium, stable_pick(medium, _PALETTE))
        figure.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line={"color": color, "width": 1.5}, name=medium,
                                    hoverinfo="skip"))
        figure.add_trace(go.Scatter(x=hover_x, y=hover_y, mode="markers", marker={"size": 4, "color": color},
                                    hovertext=hover_text, hoverinfo="text", showlegend=False))
    by_kind: dict[str, list[dict]] = {}
    for node in nodes:
        by_kind.setdefault(node.get("kind") or "node", []).append(node)
    for kind, group in sorted(by_kind.items()):
        figure.add_trace(go.Scatter(
            x=[positions[node["name"]][0] for node in group],
            y=[positions[node["name"]][1] for node in group],
            mode="markers+text" if len(nodes) <= 48 else "markers",
            text=[node["name"] for node in group],
            textposition="top center",
            hovertext=[node.get("hover", node["name"]) for node in group],
            hoverinfo="text",
            marker={"size": 12 if kind == "gpu" else 16, "color": NODE_COLORS.get(kind, stable_pick(kind, _PALETTE)),
                    "symbol": "square" if kind == "gpu" else "diamond"},
            name=kind,
        ))
    figure.update_layout(title={"text": title, "x": 0.0}, template="plotly_white", height=520,
                         xaxis={"visible": False}, yaxis={"visible": False}, hovermode="closest")
    return figure


def write_topology_html(nodes: list[dict], edges: list[dict], path: str | Path, title: str = "",
                        plotly: str = "inline") -> Path:
    """Write the drawing as one HTML file with plotly.js embedded (opens offline)."""
    path = Path(path)
    html = pio.to_html(topology_figure(nodes, edges, title), include_plotlyjs=include_plotlyjs(plotly), full_html=True,
                       config={"displaylogo": False})
    path.write_text(html, encoding="utf-8")
    return path
