"""Sweep charts: how step time, throughput, bubble and memory move with the microbatch
count.

The trade-off a user picks a schedule by: more microbatches shrink the bubble but,
for GPipe, hold more activations. Panels: step time, throughput and bubble fraction
on top; peak memory per GPU (with the device's capacity and the points that do not
fit) and peak in-flight microbatches below. One line per schedule, each schedule in
the same colour in every panel.

Schedules often tie (GPipe and 1F1B take the same step time with uniform costs), and a
tied line would hide under the other. So every series has its own marker symbol and
dash, and series are nudged sideways a few percent of a tick apart (a dodge, as in a
grouped bar chart); the hover gives each point's exact microbatch count and value.
"""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from schedules.units import time_unit
from viz.colors import schedule_color
from viz.html import include_plotlyjs, with_offline_notice
from viz.limits import OOM_COLOR, memory_lines

REQUIRED = ("schedule", "microbatches", "makespan", "bubble_fraction", "peak_inflight_microbatches")
DASHES = ("solid", "dash", "dot", "dashdot", "longdash")  # told apart: same schedule, other v
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "triangle-down", "cross", "star", "hexagon")
DODGE = 0.07  # sideways nudge between neighbouring series, as a fraction of the gap between ticks
MAX_SPREAD = 0.3  # ... and at most this much for all series together (ten series would take 63%)


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


def throughput(row: dict) -> tuple[float, str]:
    """The row's throughput and its unit: tokens/s when the row says how many tokens it
    moves (``tokens_per_second`` or ``tokens_per_microbatch``), else microbatches/s,
    which is proportional to tokens/s at a fixed microbatch size (steps/s is not: a
    step of more microbatches carries more tokens)."""
    if row.get("tokens_per_second") is not None:
        return float(row["tokens_per_second"]), "tokens/s"
    makespan = float(row["makespan"])
    if row.get("tokens_per_microbatch") is not None and makespan > 0:
        return float(row["tokens_per_microbatch"]) * row["microbatches"] / makespan, "tokens/s"
    return (row["microbatches"] / makespan if makespan > 0 else 0.0), "microbatches/s"


def _check(rows: list[dict]) -> None:
    if not rows:
        raise ValueError("a sweep chart needs at least one result row")
    for index, row in enumerate(rows):
        missing = [key for key in REQUIRED if key not in row]
        if missing:
            raise ValueError(f"sweep row {index} lacks {', '.join(missing)}; each row needs {', '.join(REQUIRED)}")


def _is_power_of_two(count: int) -> bool:
    return count > 0 and count & (count - 1) == 0


def dodge_step(series: int) -> float:
    """The nudge between neighbouring series: ``DODGE``, less where ``series`` of them
    would spread one microbatch count over more than ``MAX_SPREAD`` of a tick gap."""
    return min(DODGE, MAX_SPREAD / max(series - 1, 1))


def _dodged(counts: list[int], position: float, log_axis: bool, all_counts: list[int],
            step: float = DODGE) -> list[float]:
    """``counts`` nudged by ``position`` dodge steps of ``step`` (see the module docstring)."""
    if log_axis:
        ratio = min((b / a for a, b in zip(all_counts, all_counts[1:], strict=False)), default=2.0)
        return [count * ratio ** (step * position) for count in counts]
    gap = min((b - a for a, b in zip(all_counts, all_counts[1:], strict=False)), default=1)
    return [count + gap * step * position for count in counts]


def sweep_figure(rows: list[dict], peak_scope: str = "max over ranks") -> go.Figure:
    """Step time (ms below 10 s, s from there: ``schedules.units``), throughput, bubble
    fraction, peak memory per GPU (GB; with the usable limit and capacity lines and the
    out-of-memory points, when rows carry ``peak_memory_bytes``, ``capacity_bytes``,
    ``usable_bytes`` and ``oom``: ``viz.limits``) and peak
    in-flight microbatches against the
    microbatch count, one line per schedule (and per ``virtual_stages``/``pp`` where rows
    differ in them). ``peak_scope`` says which rank the peaks were taken on, for the
    panel titles. The x axis is log 2 when the counts are powers of two spanning 4× or more.
    """
    _check(rows)
    several_pp = len({row.get("pp") for row in rows}) > 1
    series: dict[str, list[dict]] = {}
    for row in rows:
        series.setdefault(series_label(row, several_pp), []).append(row)
    rate_unit = throughput(rows[0])[1]
    if any(throughput(row)[1] != rate_unit for row in rows):
        rate_unit = "microbatches/s"
    has_memory = any(row.get("peak_memory_bytes") is not None for row in rows)
    unit, scale = time_unit(max(float(row["makespan"]) for row in rows))  # the one rule: ms below 10 s
    panels = {  # key -> (title, (row, col), value of a row, hover format)
        "makespan": (f"step time ({unit})", (1, 1), lambda row: row["makespan"] * scale, ".4g"),
        "throughput": (f"throughput ({rate_unit})", (1, 2),
                       lambda row: throughput(row)[0] if rate_unit != "microbatches/s"
                       else (row["microbatches"] / row["makespan"] if row["makespan"] else 0.0), ",.4g"),
        "bubble_fraction": ("bubble fraction", (1, 3), lambda row: row["bubble_fraction"], ".1%"),
        # beside the memory panel when there is one, else across the row (no empty cells)
        "peak_inflight_microbatches": (f"peak in-flight microbatches ({peak_scope})", (2, 3) if has_memory else (2, 1),
                                       lambda row: row["peak_inflight_microbatches"], ".2f"),
    }
    if has_memory:
        panels["peak_memory"] = (f"peak memory per GPU, GB ({peak_scope})", (2, 1),
                                 lambda row: (row.get("peak_memory_bytes") or 0.0) / 1e9, ".2f")
    slots = {(1, 1): 0, (1, 2): 1, (1, 3): 2, (2, 1): 3, **({(2, 3): 4} if has_memory else {})}
    titles = [""] * len(slots)
    for title, cell, _, _ in panels.values():
        titles[slots[cell]] = title
    below = [{"colspan": 2}, None, {}] if has_memory else [{"colspan": 3}, None, None]
    fig = make_subplots(rows=2, cols=3, specs=[[{}, {}, {}], below],
                        subplot_titles=titles, horizontal_spacing=0.07, vertical_spacing=0.16)
    counts = sorted({int(row["microbatches"]) for row in rows})
    log_axis = all(_is_power_of_two(count) for count in counts) and counts[-1] >= 4 * counts[0]
    dash_of: dict[str, int] = {}
    for index, (label, points) in enumerate(series.items()):
        points = sorted(points, key=lambda row: row["microbatches"])
        schedule = str(points[0]["schedule"])
        dash = DASHES[dash_of.setdefault(schedule, 0) % len(DASHES)]
        dash_of[schedule] += 1
        xs = _dodged([row["microbatches"] for row in points], index - (len(series) - 1) / 2, log_axis, counts,
                     dodge_step(len(series)))
        for key, (title, (row_at, col_at), value, fmt) in panels.items():
            kept = [(x, row) for x, row in zip(xs, points, strict=True)
                    if key != "peak_memory" or row.get("peak_memory_bytes") is not None]
            fig.add_trace(
                go.Scatter(
                    x=[x for x, _ in kept],
                    y=[value(row) for _, row in kept],
                    customdata=[row["microbatches"] for _, row in kept],
                    mode="lines+markers",
                    name=label,
                    legendgroup=label,
                    showlegend=key == "makespan",
                    line={"color": schedule_color(schedule), "dash": dash, "width": 2},
                    marker={"symbol": SYMBOLS[index % len(SYMBOLS)], "size": 8, "color": schedule_color(schedule)},
                    hovertemplate=f"<b>{label}</b><br>microbatches %{{customdata}}<br>{title} %{{y:{fmt}}}"
                                  "<extra></extra>",
                ),
                row=row_at,
                col=col_at,
            )
        if has_memory:
            _mark_oom(fig, label, xs, points, first=not any(t.name == OOM_NAME for t in fig.data))
    if has_memory:
        for position, line in zip(("bottom right", "top right"), memory_lines(rows), strict=False):
            fig.add_hline(y=line.gigabytes, line={"color": line.color, "dash": line.dash, "width": 1.5}, row=2, col=1,
                          annotation_text=line.label, annotation_position=position,
                          annotation_font_color=line.color)
    if log_axis:
        fig.update_xaxes(type="log", tickvals=counts, ticktext=[str(count) for count in counts])
    fig.update_xaxes(title_text="microbatches", gridcolor="#EEE")
    fig.update_yaxes(rangemode="tozero", gridcolor="#EEE")
    fig.update_yaxes(tickformat=".0%", row=1, col=3)
    fig.update_layout(height=760, hovermode="closest", plot_bgcolor="white",
                      margin={"l": 70, "r": 20, "t": 90, "b": 60})
    return fig


OOM_NAME = "out of memory (peak > usable limit)"


def _mark_oom(fig: go.Figure, label: str, xs: list[float], points: list[dict], first: bool) -> None:
    """A red ring over every point of ``label`` that does not fit its device."""
    marked = [(x, row) for x, row in zip(xs, points, strict=True)
              if row.get("oom") and row.get("peak_memory_bytes") is not None]
    if not marked:
        return
    fig.add_trace(go.Scatter(
        x=[x for x, _ in marked], y=[row["peak_memory_bytes"] / 1e9 for _, row in marked],
        customdata=[row["microbatches"] for _, row in marked],
        mode="markers", name=OOM_NAME, legendgroup=OOM_NAME, showlegend=first, legendrank=2000,
        marker={"symbol": "x-thin-open", "size": 16, "color": OOM_COLOR, "line": {"width": 3, "color": OOM_COLOR}},
        hovertemplate=f"<b>{label}</b><br>microbatches %{{customdata}}<br>%{{y:.2f}} GB: out of memory<extra></extra>",
    ), row=2, col=1)


def write_sweep_html(rows: list[dict], path: str | Path, title: str | None = None, plotly: str = "inline") -> Path:
    """Write a self-contained sweep chart page (plotly.js embedded, opens offline)."""
    fig = sweep_figure(rows)
    if title:
        fig.update_layout(title={"text": title, "x": 0.0, "xanchor": "left"})
    path = Path(path)
    html = pio.to_html(fig, include_plotlyjs=include_plotlyjs(plotly), full_html=True, config={"displaylogo": False})
    path.write_text(with_offline_notice(html, plotly), encoding="utf-8")
    return path
