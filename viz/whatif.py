"""What-if charts: a step-time distribution and the steps at its median and tail.

One page: the histogram of the sampled step times and their empirical CDF side by side,
with the deterministic step and the p50/p90/p99 marked, then the Gantts of the median
and the p99 sample on one time axis, so what made the tail slow is visible next to a
typical step. Reads numbers and Traces only.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from schedules.trace import Trace
from schedules.units import time_unit as seconds_unit
from viz.gantt import gantt_spec
from viz.html import include_plotlyjs

MARKS = {"deterministic": "#555555", "p50": "#1F77B4", "p90": "#FF7F0E", "p99": "#C0392B"}


def distribution_figure(step_times: Sequence[float], deterministic: float, quantiles: Mapping[str, float],
                        title: str | None = None) -> go.Figure:
    """Histogram (left) and empirical CDF (right) of ``step_times``, with vertical lines
    at the ``deterministic`` step and at each of ``quantiles`` (``{"p99": seconds}``)."""
    times = np.sort(np.asarray(step_times, dtype=float))
    if not len(times):
        raise ValueError("a step-time distribution needs at least one sample")
    unit, scale = seconds_unit(float(times.max()))
    figure = make_subplots(rows=1, cols=2, subplot_titles=("histogram", "cumulative distribution"))
    figure.add_trace(go.Histogram(x=times * scale, name="samples", marker_color="#7F7F7F", showlegend=False,
                                  hovertemplate=f"%{{x}} {unit}: %{{y}} samples<extra></extra>"), row=1, col=1)
    share = np.arange(1, len(times) + 1) / len(times)
    figure.add_trace(go.Scatter(x=times * scale, y=share, mode="lines", line={"shape": "hv", "color": "#333333"},
                                name="CDF", showlegend=False,
                                hovertemplate=f"%{{x:.4g}} {unit}: %{{y:.1%}} of steps<extra></extra>"), row=1, col=2)
    for name, seconds in {"deterministic": deterministic, **quantiles}.items():
        for col in (1, 2):
            figure.add_vline(x=seconds * scale, line={"color": MARKS.get(name, "#000000"), "dash": "dash"},
                             row=1, col=col)
        figure.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name=f"{name} {seconds * scale:.4g} {unit}",
                                    line={"color": MARKS.get(name, "#000000"), "dash": "dash"}), row=1, col=2)
    figure.update_xaxes(title_text=f"step time ({unit})")
    figure.update_yaxes(title_text="samples", row=1, col=1)
    figure.update_yaxes(title_text="share of steps", tickformat=".0%", row=1, col=2)
    figure.update_layout(height=380, plot_bgcolor="white", margin={"l": 70, "r": 20, "t": 70, "b": 50},
                         title={"text": title or f"step time over {len(times)} samples", "x": 0.0})
    return figure


def write_whatif_html(step_times: Sequence[float], deterministic: float, quantiles: Mapping[str, float],
                      traces: Sequence[Trace], titles: Sequence[str], path: str | Path, title: str | None = None,
                      plotly: str = "inline") -> Path:
    """The distribution chart and the Gantts of ``traces`` (the median and the p99
    sample) on one page."""
    first = pio.to_html(distribution_figure(step_times, deterministic, quantiles, title), full_html=False,
                        include_plotlyjs=include_plotlyjs(plotly), config={"displaylogo": False})
    gantt = pio.to_html(gantt_spec(list(traces), list(titles)), full_html=False, include_plotlyjs=False,
                        validate=False, config={"displaylogo": False, "scrollZoom": True})
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title or 'pipesim what-if')}"
            f"</title></head><body>{first}{gantt}</body></html>")
    path = Path(path)
    path.write_text(page, encoding="utf-8")
    return path
