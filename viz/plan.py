"""The plan chart: every considered layout's throughput against its peak memory, the
Pareto front of the ranked ones, the device capacity, and the chosen layout's Gantt below.

A planner's answer is a trade: the fastest layout may sit close to the memory limit,
and the front shows what each gigabyte buys. The layouts that were not ranked are drawn
too, greyed, with why on hover: pruned ones at the throughput their lower bound allows
(they can only be slower) and their memory floor, those rejected before simulation at
their memory floor (above the device), those simulated out of memory at their peak.
"""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio

from schedules.trace import Trace
from viz.colors import schedule_color
from viz.gantt import gantt_spec
from viz.html import include_plotlyjs
from viz.limits import memory_lines

UNRANKED = {  # bucket -> (legend, marker symbol)
    "pruned": ("pruned by lower bound (at most this fast)", "circle-open"),
    "rejected before simulation": ("rejected: out of memory at its floor", "x-thin-open"),
    "simulated": ("simulated, not ranked", "x"),
}


def plan_figure(rows: list[dict], front: list[dict], title: str = "", others: list[dict] | None = None) -> go.Figure:
    """Tokens/s against peak memory (GB), one colour per schedule, the front as a line,
    the best row ringed and the smallest device capacity as a dashed vertical line; the
    ``others`` (unranked layouts with a ``bucket`` and ``cause``) in grey beneath."""
    if not rows:
        raise ValueError("a plan chart needs at least one simulated layout")
    fig = go.Figure()
    charted = [other for other in others or () if other.get("peak_memory_bytes") is not None
               and other.get("tokens_per_second")]
    for bucket, (legend, symbol) in UNRANKED.items():
        points = [other for other in charted if other["bucket"] == bucket]
        if points:
            fig.add_trace(go.Scatter(
                x=[other["peak_memory_bytes"] / 1e9 for other in points],
                y=[other["tokens_per_second"] for other in points], mode="markers", name=legend,
                marker={"color": "#b0b0b0", "size": 6, "symbol": symbol, "opacity": 0.6},
                text=[f"{other['layout']}<br>{bucket}: {other['cause']}" for other in points],
                hovertemplate="%{text}<br>%{y:,.0f} tokens/s<br>%{x:.1f} GB<extra></extra>",
            ))
    by_schedule: dict[str, list[dict]] = {}
    for row in rows:
        by_schedule.setdefault(str(row["schedule"]), []).append(row)
    for schedule, points in sorted(by_schedule.items()):
        fig.add_trace(go.Scatter(
            x=[row["peak_memory_bytes"] / 1e9 for row in points],
            y=[row["tokens_per_second"] for row in points],
            mode="markers", name=schedule, marker={"color": schedule_color(schedule), "size": 8, "opacity": 0.8},
            text=[row["layout"] for row in points],
            hovertemplate="%{text}<br>%{y:,.0f} tokens/s<br>%{x:.1f} GB<extra></extra>",
        ))
    fig.add_trace(go.Scatter(
        x=[row["peak_memory_bytes"] / 1e9 for row in front], y=[row["tokens_per_second"] for row in front],
        mode="lines", name="Pareto front", line={"color": "black", "width": 1.5, "shape": "hv"},
        hoverinfo="skip",
    ))
    best = rows[0]
    fig.add_trace(go.Scatter(
        x=[best["peak_memory_bytes"] / 1e9], y=[best["tokens_per_second"]], mode="markers",
        name=f"chosen: {best['layout']}",
        marker={"symbol": "circle-open", "size": 18, "color": "black", "line": {"width": 2}},
        hoverinfo="skip",
    ))
    for position, line in zip(("top left", "bottom right"), memory_lines(rows), strict=False):
        fig.add_vline(x=line.gigabytes, line_dash=line.dash, line_color=line.color, annotation_text=line.label,
                      annotation_position=position, annotation_font_color=line.color)
    fig.update_layout(
        title={"text": title, "x": 0.0, "xanchor": "left"}, height=520, plot_bgcolor="white",
        xaxis={"title": "peak memory per GPU (GB)", "gridcolor": "#eee"},
        yaxis={"title": "tokens per second", "gridcolor": "#eee", "range": _span([row["tokens_per_second"]
                                                                                  for row in rows])},
        legend={"orientation": "v"}, margin={"l": 80, "r": 20, "t": 70, "b": 60},
    )
    return fig


def _span(values: list[float]) -> list[float]:
    """An axis range around the ranked layouts' values (not from zero: the differences
    between good layouts are a few percent), with a margin; unranked points beyond it are
    reached by zooming out."""
    low, high = min(values), max(values)
    margin = (high - low) * 0.15 or high * 0.05 or 1.0
    return [low - margin, high + margin]


def write_plan_html(rows: list[dict], front: list[dict], trace: Trace, path: str | Path, title: str = "",
                    plotly: str = "inline", others: list[dict] | None = None) -> Path:
    """One page (plotly.js embedded once, or from the CDN): the plan chart, then the
    chosen layout's predicted Gantt."""
    scatter = pio.to_html(plan_figure(rows, front, title, others), include_plotlyjs=include_plotlyjs(plotly),
                          full_html=False, config={"displaylogo": False})
    spec = gantt_spec([trace], [f"predicted: {rows[0]['layout']}"])
    gantt = pio.to_html(spec, include_plotlyjs=False, full_html=False, validate=False,
                        config={"displaylogo": False, "scrollZoom": True})
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title></head>"
            f"<body>{scatter}{gantt}</body></html>")
    path = Path(path)
    path.write_text(page, encoding="utf-8")
    return path
