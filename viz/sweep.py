"""Sweep charts: how step time, bubble and memory move with the microbatch count.

The trade-off a user picks a schedule by: more microbatches shrink the bubble but,
for GPipe, hold more activations. Three panels side by side, one line per schedule,
each schedule in the same colour in every panel.
"""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from viz.colors import schedule_color
from viz.html import include_plotlyjs

REQUIRED = ("schedule", "microbatches", "makespan", "bubble_fraction", "peak_inflight_microbatches")
DASHES = ("solid", "dash", "dot", "dashdot", "longdash")  # told apart: same schedule, other v


def series_label(row: dict, several_pp: bool) -> str:
    """The legend name of the line ``row`` belongs to: schedule, chunks and, when the
    rows mix pipeline sizes, pp."""
    label = str(row["schedule"])
    chunks = int(row.get("virtual_stages") or 1)
    if chunks > 1:
        label += f" v={chunks}"
    if several_pp and row.get("pp") is not None:
        label += f" pp={row['pp']}"
    return label


def _check(rows: list[dict]) -> None:
    if not rows:
        raise ValueError("a sweep chart needs at least one result row")
    for index, row in enumerate(rows):
        missing = [key for key in REQUIRED if key not in row]
        if missing:
            raise ValueError(f"sweep row {index} lacks {', '.join(missing)}; each row needs {', '.join(REQUIRED)}")


def _is_power_of_two(count: int) -> bool:
    return count > 0 and count & (count - 1) == 0


def sweep_figure(rows: list[dict], peak_scope: str = "max over ranks") -> go.Figure:
    """Step time (ms), bubble fraction and peak in-flight microbatches against the
    microbatch count, one line per schedule (and per ``virtual_stages``/``pp`` where
    rows differ in them). ``peak_scope`` says which rank the peak was taken on, for the
    panel title. The x axis is log 2 when the counts are powers of two spanning 4× or more.
    """
    _check(rows)
    several_pp = len({row.get("pp") for row in rows}) > 1
    series: dict[str, list[dict]] = {}
    for row in rows:
        series.setdefault(series_label(row, several_pp), []).append(row)
    panels = (
        ("makespan", "step time (ms)", 1e3, ".3f"),
        ("bubble_fraction", "bubble fraction", 1.0, ".1%"),
        ("peak_inflight_microbatches", f"peak in-flight microbatches ({peak_scope})", 1.0, ".2f"),
    )
    fig = make_subplots(rows=1, cols=3, subplot_titles=[title for _, title, _, _ in panels], horizontal_spacing=0.07)
    dash_of: dict[str, int] = {}
    for label, points in series.items():
        points = sorted(points, key=lambda row: row["microbatches"])
        schedule = str(points[0]["schedule"])
        dash = DASHES[dash_of.setdefault(schedule, 0) % len(DASHES)]
        dash_of[schedule] += 1
        for col, (key, title, scale, fmt) in enumerate(panels, start=1):
            fig.add_trace(
                go.Scatter(
                    x=[row["microbatches"] for row in points],
                    y=[row[key] * scale for row in points],
                    mode="lines+markers",
                    name=label,
                    legendgroup=label,
                    showlegend=col == 1,
                    line={"color": schedule_color(schedule), "dash": dash},
                    hovertemplate=f"<b>{label}</b><br>microbatches %{{x}}<br>{title} %{{y:{fmt}}}<extra></extra>",
                ),
                row=1,
                col=col,
            )
    counts = sorted({int(row["microbatches"]) for row in rows})
    if all(_is_power_of_two(count) for count in counts) and counts[-1] >= 4 * counts[0]:
        fig.update_xaxes(type="log", tickvals=counts, ticktext=[str(count) for count in counts])
    fig.update_xaxes(title_text="microbatches")
    fig.update_yaxes(rangemode="tozero")
    fig.update_yaxes(tickformat=".0%", row=1, col=2)
    fig.update_layout(height=430, hovermode="closest", margin={"l": 60, "r": 20, "t": 80, "b": 50})
    return fig


def write_sweep_html(rows: list[dict], path: str | Path, title: str | None = None, plotly: str = "inline") -> Path:
    """Write a self-contained sweep chart page (plotly.js embedded, opens offline)."""
    fig = sweep_figure(rows)
    if title:
        fig.update_layout(title={"text": title, "x": 0.0, "xanchor": "left"})
    path = Path(path)
    fig.write_html(path, include_plotlyjs=include_plotlyjs(plotly), full_html=True, config={"displaylogo": False})
    return path
