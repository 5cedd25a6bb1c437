"""Gantt charts of pipeline steps: one row per rank, a bar per action.

Several traces (say a prediction and a measurement) are stacked on one shared time
axis, each shifted so its step starts at 0, so their shapes and makespans line up.
Small steps are drawn as SVG bars with microbatch labels; past ``BAR_LIMIT`` events
the same layers become WebGL line segments, which a browser still pans smoothly at
hundreds of thousands of events.
"""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from schedules.metrics import StepMetrics, step_metrics
from schedules.trace import Trace, TraceEvent
from viz.html import include_plotlyjs
from viz.lanes import Layer, layers_of

BAR_LIMIT = 20_000  # events per figure; SVG bars beyond this make the page crawl
LABEL_LIMIT = 1_500  # compute bars per figure that get a microbatch label
TIME_DIGITS = 4  # decimals of a millisecond kept in the chart

HOVER = (
    "<b>%{customdata[0]}</b><br>"
    "rank %{customdata[1]} · stage %{customdata[2]} · microbatch %{customdata[3]}<br>"
    "start %{customdata[4]:.3f} ms · end %{customdata[5]:.3f} ms<br>"
    "duration %{customdata[6]:.3f} ms"
)


def default_title(trace: Trace, index: int) -> str:
    """A subplot title from what the trace says about itself."""
    meta = trace.meta
    parts = [str(meta.get("source", f"trace {index}"))]
    if "schedule" in meta:
        parts.append(str(meta["schedule"]))
    for key, name in (("pp", "pp"), ("microbatches", "m"), ("virtual_stages", "v")):
        if key in meta and not (key == "virtual_stages" and int(meta[key]) == 1):
            parts.append(f"{name}={meta[key]}")
    return " ".join(parts)


def summary(trace: Trace, metrics: StepMetrics | None = None) -> str:
    """Makespan, bubble fraction, and the worst rank's bubble and exposed communication
    seconds, for the subplot title (from ``metrics`` when the caller already computed them)."""
    metrics = metrics or step_metrics(trace)
    exposed = max((rank.exposed_comm for rank in metrics.ranks), default=0.0)
    waiting = max((rank.bubble for rank in metrics.ranks), default=0.0)
    return (
        f"makespan {metrics.makespan * 1e3:.3f} ms · bubble {metrics.bubble_fraction:.1%}"
        f" ({waiting * 1e3:.3f} ms worst rank) · exposed comm (worst rank) {exposed * 1e3:.3f} ms"
    )


def _hover_row(event: TraceEvent, t0: float) -> list:
    """Action, rank, stage, microbatch, start, end, duration; times in ms rounded to
    0.1 µs (finer than any clock we read, and it keeps large files smaller)."""
    start = round((event.start - t0) * 1e3, TIME_DIGITS)
    end = round((event.end - t0) * 1e3, TIME_DIGITS)
    return [event.action, event.rank, event.stage, event.microbatch, start, end, round(end - start, TIME_DIGITS)]


def _bars(layer: Layer, t0: float, labelled: bool) -> dict:
    """Horizontal bars: ``base`` is the start, ``x`` the duration, both in ms."""
    offset, height = layer.lane
    hover = [_hover_row(event, t0) for event in layer.events]
    marker: dict = {"color": layer.color, "line": {"width": 0}}
    if layer.hatched:
        marker["pattern"] = {"shape": "/", "fgcolor": layer.color, "bgcolor": "white", "solidity": 0.5}
    bars = {
        "type": "bar",
        "orientation": "h",
        "y": [event.rank + offset for event in layer.events],
        "base": [row[4] for row in hover],
        "x": [row[6] for row in hover],
        "width": height,
        "marker": marker,
        "customdata": hover,
    }
    if labelled and layer.is_compute:
        bars.update(
            text=[str(event.microbatch) for event in layer.events],
            textposition="inside",
            insidetextanchor="middle",
            textangle=0,
            textfont={"color": "white"},
        )
    return bars


def _segments(layer: Layer, t0: float, row_px: float) -> dict:
    """WebGL line segments (start, end, gap): one vertex pair per event, each vertex
    carrying the event's hover data so either end of a long bar answers a hover."""
    offset, height = layer.lane
    xs: list[float | None] = []
    ys: list[float | None] = []
    hover: list[list | None] = []
    for event in layer.events:
        row = _hover_row(event, t0)
        y = event.rank + offset
        xs += (row[4], row[5], None)
        ys += (y, y, None)
        hover += (row, row, None)
    return {
        "type": "scattergl",
        "x": xs,
        "y": ys,
        "mode": "lines",
        "line": {"color": layer.color, "width": max(1.0, height * row_px)},
        "opacity": 0.75 if layer.hatched else 1.0,
        "customdata": hover,
    }


def _row_px(ranks: int) -> float:
    """Pixels per rank row: roomy for a few ranks, compact for 64."""
    return 40.0 if ranks <= 8 else 26.0 if ranks <= 32 else 14.0


def gantt_spec(
    traces: list[Trace] | Trace,
    titles: list[str] | None = None,
    *,
    bar_limit: int = BAR_LIMIT,
    label_limit: int = LABEL_LIMIT,
    metrics: list[StepMetrics] | None = None,
) -> dict:
    """The Gantt chart as a plain plotly figure dict (``{"data", "layout"}``).

    Kept as a dict because validating and copying hundreds of thousands of points
    through plotly's figure objects takes longer than everything else together;
    ``write_gantt_html`` serialises this dict directly. ``metrics`` (one per trace),
    when given, titles the subplots without computing them again.
    """
    if isinstance(traces, Trace):
        traces = [traces]
    if not traces:
        raise ValueError("a Gantt chart needs at least one Trace")
    if titles is not None and len(titles) != len(traces):
        raise ValueError(f"got {len(titles)} titles for {len(traces)} traces; give one title per trace")
    titles = titles or [default_title(trace, index) for index, trace in enumerate(traces)]
    metrics = metrics or [None] * len(traces)
    if len(metrics) != len(traces):
        raise ValueError(f"got {len(metrics)} metrics for {len(traces)} traces; give one per trace")

    ranks = [max(trace.num_ranks, 1) for trace in traces]
    use_webgl = sum(len(trace.events) for trace in traces) > bar_limit
    labelled = not use_webgl and (
        sum(1 for trace in traces for event in trace.events if event.stream == "compute") <= label_limit
    )
    row_px = _row_px(max(ranks))

    frame = make_subplots(
        rows=len(traces),
        cols=1,
        shared_xaxes=True,
        row_heights=[float(count) for count in ranks],
        vertical_spacing=min(0.08, 0.4 / len(traces)) if len(traces) > 1 else 0.0,
        subplot_titles=[
            f"{title} — {summary(trace, known)}" for title, trace, known in zip(titles, traces, metrics, strict=True)
        ],
    )
    data: list[dict] = []
    shown: set[str] = set()
    span_ms = 0.0
    for row, trace in enumerate(traces, start=1):
        t0 = min((event.start for event in trace.events), default=0.0)
        span_ms = max(span_ms, max((event.end - t0 for event in trace.events), default=0.0) * 1e3)
        for layer in layers_of(trace):
            drawn = _segments(layer, t0, row_px) if use_webgl else _bars(layer, t0, labelled)
            drawn.update(
                name=layer.label,
                legendgroup=layer.label,
                showlegend=layer.label not in shown,
                hovertemplate=HOVER + f"<extra>{layer.label}</extra>",
                xaxis="x" if row == 1 else f"x{row}",
                yaxis="y" if row == 1 else f"y{row}",
            )
            shown.add(layer.label)
            data.append(drawn)
        frame.update_yaxes(
            row=row,
            col=1,
            tickvals=list(range(ranks[row - 1])),
            ticktext=[f"rank {rank}" for rank in range(ranks[row - 1])],
            range=[ranks[row - 1] - 0.5, -0.5],  # reversed: rank 0 on top
            showgrid=False,
            zeroline=False,
        )
    frame.update_xaxes(range=[0.0, span_ms * 1.01 or 1.0], showgrid=True, gridcolor="#E5E5E5")
    frame.update_xaxes(title_text="time since step start (ms)", row=len(traces), col=1)
    frame.update_layout(
        barmode="overlay",
        hovermode="closest",
        uniformtext={"minsize": 8, "mode": "hide"},  # drop labels that do not fit a bar
        height=int(sum(ranks) * row_px + 110 * len(traces) + 80),
        legend={"tracegroupgap": 4},
        margin={"l": 70, "r": 20, "t": 100, "b": 50},
        plot_bgcolor="white",
    )
    return {"data": data, "layout": frame.layout.to_plotly_json()}


def gantt_figure(
    traces: list[Trace] | Trace,
    titles: list[str] | None = None,
    *,
    bar_limit: int = BAR_LIMIT,
    label_limit: int = LABEL_LIMIT,
) -> go.Figure:
    """One Gantt subplot per trace, stacked on a shared time axis in milliseconds.

    Each subplot's y axis has one tick per rank (rank 0 on top); compute bars are
    coloured by kind, sends sit in a thin lane under them, receive waits sit in the
    compute lane: hatched grey while the producer had not finished (bubble), red while
    the data was in flight (exposed communication). ``titles`` name the subplots (default: source, schedule
    and shape from ``meta``); the metrics summary is appended to each. Past
    ``bar_limit`` events the bars become WebGL segments; only up to ``label_limit``
    compute bars are labelled with their microbatch.
    """
    if isinstance(traces, Trace):
        traces = [traces]
    spec = gantt_spec(traces, titles, bar_limit=bar_limit, label_limit=label_limit)
    # Large figures skip plotly's per-point validation (seconds at 400k events);
    # the spec is built here, so it is valid by construction.
    small = sum(len(trace.events) for trace in traces) <= bar_limit
    return go.Figure(spec, _validate=small)


def write_gantt_html(
    traces: list[Trace] | Trace,
    path: str | Path,
    titles: list[str] | None = None,
    title: str | None = None,
    metrics: list[StepMetrics] | None = None,
    plotly: str = "inline",
) -> Path:
    """Write a Gantt HTML page; ``plotly="inline"`` embeds plotly.js (opens offline),
    ``"cdn"`` loads it from the network (see ``viz.html``)."""
    spec = gantt_spec(traces, titles, metrics=metrics)
    if title:
        spec["layout"]["title"] = {"text": title, "x": 0.0, "xanchor": "left"}
    path = Path(path)
    html = pio.to_html(
        spec, include_plotlyjs=include_plotlyjs(plotly), full_html=True, validate=False,
        config={"displaylogo": False, "scrollZoom": True},
    )
    path.write_text(html, encoding="utf-8")
    return path
