"""The ``bench-comm`` chart: time and bus bandwidth against message size, one line per
operation, with the fitted alpha-beta model dotted beside the measurement so a user sees
where the line model holds and where it does not (small messages on a CPU backend)."""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from viz.html import include_plotlyjs, with_offline_notice

COLORS = {"sendrecv": "#1f77b4", "all_reduce": "#d62728", "all_gather": "#2ca02c", "reduce_scatter": "#9467bd"}


def comm_bench_figure(rows: list[dict], fits: dict[str, dict]) -> go.Figure:
    """Two panels: seconds per operation (log-log), bus bandwidth in GB/s."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("time", "bus bandwidth (nccl-tests busbw)"))
    for operation in dict.fromkeys(row["operation"] for row in rows):
        points = sorted((row["bytes"], row["seconds"], row["busbw"]) for row in rows if row["operation"] == operation)
        color = COLORS.get(operation, "#7f7f7f")
        sizes = [size for size, _, _ in points]
        fig.add_trace(go.Scatter(x=sizes, y=[seconds for _, seconds, _ in points], name=operation,
                                 mode="lines+markers", line={"color": color}, legendgroup=operation), 1, 1)
        fig.add_trace(go.Scatter(x=sizes, y=[busbw / 1e9 for _, _, busbw in points], name=operation,
                                 mode="lines+markers", line={"color": color}, legendgroup=operation,
                                 showlegend=False), 1, 2)
        fit = fits.get(operation)
        if fit:
            fig.add_trace(go.Scatter(x=sizes, y=[fit["alpha"] + fit["beta"] * size for size in sizes],
                                     name=f"{operation} fit", mode="lines", legendgroup=operation,
                                     line={"color": color, "dash": "dot"}), 1, 1)
    fig.update_xaxes(type="log", title_text="message bytes")
    fig.update_yaxes(type="log", title_text="seconds", row=1, col=1)
    fig.update_yaxes(title_text="GB/s", row=1, col=2)
    return fig


def write_comm_bench_html(rows: list[dict], fits: dict[str, dict], path: str | Path, title: str = "",
                          plotly: str = "inline") -> Path:
    """Write the chart as a self-contained page (plotly.js embedded)."""
    fig = comm_bench_figure(rows, fits)
    if title:
        fig.update_layout(title={"text": title, "x": 0.0, "xanchor": "left"})
    path = Path(path)
    html = pio.to_html(fig, include_plotlyjs=include_plotlyjs(plotly), full_html=True, config={"displaylogo": False})
    path.write_text(with_offline_notice(html, plotly), encoding="utf-8")
    return path
