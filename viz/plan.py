"""The plan page: which layout, and why.

A planner's answer is a trade: the fastest layout may sit close to the memory limit,
and the front shows what each gigabyte buys. The page holds, top to bottom: tokens/s
against peak memory for every ranked layout (the Pareto front as a line, the chosen one
ringed, the usable memory limit and the capacity as labelled lines); why the top three
differ (their step time cut into compute, bubble, exposed communication and the rest,
side by side); a table of the top N; and the chosen layout's Gantt.

The scatter is fitted to the feasible layouts: the unranked ones (pruned by their
lower bound, rejected out of memory, simulated and not ranked) are drawn greyed only
where they fall inside those axes, and a line under the chart counts the rest by why
they were left out, so a layout at 1,221 GB does not push every feasible one into the
chart's left edge. Each schedule has its own colour and marker (``viz.colors``); a
layout of pp 1 is "no pipeline", whatever schedule name it was searched under; two
schedules whose layouts land on exactly the same points are one series, named as such.
"""

from __future__ import annotations

import html
from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio

from schedules.trace import Trace
from schedules.units import count, duration, percent, size, time_unit
from viz.colors import NO_PIPELINE, schedule_color, schedule_symbol
from viz.gantt import gantt_spec
from viz.html import include_plotlyjs, with_offline_notice
from viz.limits import memory_lines

UNRANKED = {  # bucket -> (legend, marker symbol)
    "pruned": ("pruned by lower bound (at most this fast)", "circle-open"),
    "rejected before simulation": ("rejected: out of memory at its floor", "x-thin-open"),
    "simulated": ("simulated, not ranked", "x"),
}
TOP_ROWS = 10  # rows of the table
WHY_ROWS = 3  # layouts compared side by side
# a step's parts in the "why" bars: key -> (legend, colour); rows that do not split the
# collectives and the optimizer leave them in "other"
PARTS = {
    "compute": ("compute", "#4C78A8"),
    "bubble": ("pipeline bubble", "#B0B0B0"),
    "exposed_comm": ("exposed p2p communication", "#D62728"),
    "dp": ("dp collectives (exposed)", "#8C564B"),
    "tp": ("tp collectives", "#17BECF"),
    "cp": ("cp K/V exchange", "#E377C2"),
    "ep": ("ep all-to-all", "#BCBD22"),
    "optimizer": ("optimizer step", "#7F7F7F"),
    "other": ("other: dp/tp/cp/ep collectives, optimizer, overhead", "#FDD0A2"),
}


def series_name(row: dict) -> str:
    """The legend entry a layout is drawn under: its schedule, or "no pipeline" at pp 1."""
    return NO_PIPELINE if int(row.get("pp") or 0) == 1 else str(row["schedule"])


def _points(rows: list[dict]) -> tuple:
    return tuple(sorted((round(row["peak_memory_bytes"]), round(row["tokens_per_second"], 6)) for row in rows))


def merged_series(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows grouped by ``series_name``; series that land on exactly the same points (say
    zb-auto choosing zb-h1's order on every layout) merged into one, named
    ``zb-h1 = zb-auto (same points)``, so no series hides under another."""
    by_name: dict[str, list[dict]] = {}
    for row in rows:
        by_name.setdefault(series_name(row), []).append(row)
    merged: dict[tuple, list[str]] = {}
    for name in sorted(by_name):
        merged.setdefault(_points(by_name[name]), []).append(name)
    series = {}
    for names in merged.values():
        label = names[0] if len(names) == 1 else f"{' = '.join(names)} (same points)"
        series[label] = [row for name in names for row in by_name[name]]
    return series


def _span(values: list[float], floor_at_zero: bool = False) -> list[float]:
    """An axis range around ``values`` with a margin (not from zero for throughput: the
    differences between good layouts are a few percent)."""
    low, high = min(values), max(values)
    margin = (high - low) * 0.15 or abs(high) * 0.05 or 1.0
    return [0.0 if floor_at_zero else low - margin, high + margin]


def _inside(value: float, span: list[float]) -> bool:
    return span[0] <= value <= span[1]


def plan_figure(rows: list[dict], front: list[dict], title: str = "", others: list[dict] | None = None) -> go.Figure:
    """Tokens/s against peak memory (GB), fitted to the ranked layouts (see the module)."""
    if not rows:
        raise ValueError("a plan chart needs at least one simulated layout")
    fig = go.Figure()
    feasible = [row for row in rows if not row.get("oom")] or rows
    lines = memory_lines(rows)
    peaks = [row["peak_memory_bytes"] / 1e9 for row in feasible]
    # the usable limit is drawn when it does not squeeze the feasible layouts into a corner
    near = [line.gigabytes for line in lines if line.gigabytes <= 2.5 * max(peaks)]
    x_span = _span([*peaks, *near], floor_at_zero=True)
    y_span = _span([row["tokens_per_second"] for row in feasible])
    charted = [other for other in others or () if other.get("peak_memory_bytes") is not None
               and other.get("tokens_per_second")]
    drawn = [other for other in charted if _inside(other["peak_memory_bytes"] / 1e9, x_span)
             and _inside(other["tokens_per_second"], y_span)]
    for bucket, (legend, symbol) in UNRANKED.items():
        points = [other for other in drawn if other["bucket"] == bucket]
        if points:
            fig.add_trace(go.Scatter(
                x=[other["peak_memory_bytes"] / 1e9 for other in points],
                y=[other["tokens_per_second"] for other in points], mode="markers", name=legend,
                marker={"color": "#b0b0b0", "size": 6, "symbol": symbol, "opacity": 0.6},
                text=[f"{other['layout']}<br>{bucket}: {other['cause']}" for other in points],
                hovertemplate="%{text}<br>%{y:,.0f} tokens/s<br>%{x:.1f} GB<extra></extra>",
            ))
    for label, points in merged_series(rows).items():
        first = series_name(points[0])
        fig.add_trace(go.Scatter(
            x=[row["peak_memory_bytes"] / 1e9 for row in points],
            y=[row["tokens_per_second"] for row in points], mode="markers", name=label,
            marker={"color": schedule_color(first), "symbol": schedule_symbol(first), "size": 9, "opacity": 0.85},
            text=[layout_name(row) for row in points],
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
        name=f"chosen: {layout_name(best)}",
        marker={"symbol": "circle-open", "size": 20, "color": "black", "line": {"width": 2}},
        hoverinfo="skip",
    ))
    for position, line in zip(("top left", "bottom right"), lines, strict=False):
        if _inside(line.gigabytes, x_span):
            fig.add_vline(x=line.gigabytes, line_dash=line.dash, line_color=line.color, annotation_text=line.label,
                          annotation_position=position, annotation_font_color=line.color)
    notes = left_out(charted, drawn, len(others or ()) - len(charted))
    notes += [f"{line.label}: right of the axes" for line in lines if not _inside(line.gigabytes, x_span)]
    if notes:
        fig.add_annotation(text="<br>".join(notes), xref="paper", yref="paper", x=0.0, y=-0.16, showarrow=False,
                           xanchor="left", yanchor="top", align="left", font={"size": 11, "color": "#555"})
    fig.update_layout(
        title={"text": title, "x": 0.0, "xanchor": "left"}, height=560 + 16 * len(notes), plot_bgcolor="white",
        xaxis={"title": "peak memory per GPU (GB)", "gridcolor": "#eee", "range": x_span},
        yaxis={"title": "tokens per second", "gridcolor": "#eee", "range": y_span},
        legend={"orientation": "v"}, margin={"l": 80, "r": 20, "t": 70, "b": 90 + 16 * len(notes)},
    )
    return fig


def left_out(charted: list[dict], drawn: list[dict], unplaced: int) -> list[str]:
    """One line per bucket of unranked layouts outside the axes: how many, why, and how
    far their memory and throughput reach; and the ones with no figures to place."""
    shown = {id(other) for other in drawn}
    notes = []
    for bucket, (legend, _) in UNRANKED.items():
        outside = [other for other in charted if other["bucket"] == bucket and id(other) not in shown]
        if outside:
            memory = [other["peak_memory_bytes"] for other in outside]
            rates = [other["tokens_per_second"] for other in outside]
            notes.append(f"not drawn, outside the axes: {count(len(outside))} {legend} "
                         f"({size(min(memory))} to {size(max(memory))}, {count(min(rates))} to "
                         f"{count(max(rates))} tokens/s)")
    if unplaced:
        notes.append(f"not drawn: {count(unplaced)} unranked layouts with no memory or throughput to place")
    return notes


def layout_name(row: dict) -> str:
    """The row's layout as the plan names it, with pp 1 called "no pipeline" and ZeRO-3
    written out (its dp collectives are a reduce-scatter and parameter gathers, not the
    all-reduce)."""
    name = str(row.get("layout") or row["schedule"])
    if int(row.get("pp") or 0) == 1:
        name = name.replace(f"{row['schedule']} pp1", "no pipeline (pp1)", 1)
    return name.replace("zero3", "ZeRO-3 (sharded params)").replace("zero2", "ZeRO-2").replace("zero1", "ZeRO-1")


def step_parts(row: dict) -> dict[str, float]:
    """The row's step time cut into ``PARTS`` (seconds, mean per rank): compute is what
    is not idle, the bubble its fraction of the step, exposed p2p communication as the
    row gives it, dp/tp/cp/ep and the optimizer where the row has them, and what remains
    as "other"; the parts sum to the step time."""
    step = float(row["step_time"])
    parts = {"compute": (1.0 - float(row.get("idle_fraction", row["bubble_fraction"]))) * step,
             "bubble": float(row["bubble_fraction"]) * step, "exposed_comm": float(row.get("exposed_comm") or 0.0)}
    for key in ("dp", "tp", "cp", "ep", "optimizer"):
        if row.get(key):
            parts[key] = float(row[key])
    parts["other"] = max(0.0, step - sum(parts.values()))
    return parts


def why_figure(rows: list[dict]) -> go.Figure:
    """The top ``WHY_ROWS`` layouts' step time, side by side, cut into its parts."""
    top = rows[:WHY_ROWS]
    unit, scale = time_unit(max(float(row["step_time"]) for row in top))
    names = [f"#{index} {layout_name(row)}" for index, row in enumerate(top, start=1)]
    fig = go.Figure()
    cut = [step_parts(row) for row in top]
    for key, (legend, color) in PARTS.items():
        values = [parts.get(key, 0.0) * scale for parts in cut]
        if any(values):
            fig.add_trace(go.Bar(y=names, x=values, name=legend, orientation="h", marker={"color": color},
                                 hovertemplate=f"%{{y}}<br>{legend}: %{{x:,.4g}} {unit}<extra></extra>"))
    fig.update_layout(
        barmode="stack", height=140 + 60 * len(top), plot_bgcolor="white",
        title={"text": "why this layout: where each of the top layouts' step goes (mean per rank)", "x": 0.0,
               "xanchor": "left"},
        xaxis={"title": f"step time ({unit})", "gridcolor": "#eee"}, yaxis={"autorange": "reversed"},
        margin={"l": 20, "r": 20, "t": 60, "b": 50}, legend={"orientation": "h", "y": -0.35},
    )
    fig.update_yaxes(automargin=True)
    return fig


def _seconds_of(key: str):
    """A cell writer for the row's ``key`` seconds ('-' where the row has none)."""
    return lambda row: duration(float(row[key])) if row.get(key) is not None else "-"


TABLE_COLUMNS = (  # header -> how a row's cell is written
    ("layout", layout_name),
    ("step", lambda row: duration(float(row["step_time"]))),
    ("tokens/s", lambda row: count(float(row["tokens_per_second"]))),
    ("MFU", lambda row: percent(row["mfu"]) if row.get("mfu") is not None else "-"),
    ("peak memory", lambda row: size(float(row["peak_memory_bytes"]))),
    ("bubble", lambda row: percent(float(row["bubble_fraction"]))),
    ("exposed comm", lambda row: duration(float(row.get("exposed_comm") or 0.0))),
    *((key, _seconds_of(key)) for key in ("dp", "tp", "cp", "ep")),
)


def top_table(rows: list[dict], top: int = TOP_ROWS) -> str:
    """The top ``top`` layouts as an HTML table; the dp/tp/cp/ep columns only where some
    row carries them."""
    columns = [(header, cell) for header, cell in TABLE_COLUMNS
               if header not in ("dp", "tp", "cp", "ep") or any(row.get(header) is not None for row in rows[:top])]
    head = "".join(f"<th>{html.escape(header)}</th>" for header, _ in columns)
    body = "".join(
        f"<tr><td>{index}</td>" + "".join(f"<td>{html.escape(cell(row))}</td>" for _, cell in columns) + "</tr>"
        for index, row in enumerate(rows[:top], start=1))
    return ("<table style='border-collapse:collapse;font:13px sans-serif;margin:8px 0 16px 0' border='1' "
            f"cellpadding='4'><caption style='text-align:left'>top {min(top, len(rows))} layouts by step time"
            f"</caption><tr><th>#</th>{head}</tr>{body}</table>")


def write_plan_html(rows: list[dict], front: list[dict], trace: Trace, path: str | Path, title: str = "",
                    plotly: str = "inline", others: list[dict] | None = None) -> Path:
    """One page (plotly.js embedded once, or from the CDN): the plan chart, why the top
    three, the top layouts' table, then the chosen layout's predicted Gantt."""
    scatter = pio.to_html(plan_figure(rows, front, title, others), include_plotlyjs=include_plotlyjs(plotly),
                          full_html=False, config={"displaylogo": False})
    why = pio.to_html(why_figure(rows), include_plotlyjs=False, full_html=False, config={"displaylogo": False})
    spec = gantt_spec([trace], [f"predicted: {layout_name(rows[0])}"])
    gantt = pio.to_html(spec, include_plotlyjs=False, full_html=False, validate=False,
                        config={"displaylogo": False, "scrollZoom": True})
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body>{scatter}{why}{top_table(rows)}{gantt}</body></html>")
    path = Path(path)
    path.write_text(with_offline_notice(page, plotly), encoding="utf-8")
    return path
