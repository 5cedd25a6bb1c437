"""Gantt charts of pipeline steps: one row per rank, a bar per action.

Several traces (say a prediction and a measurement) are stacked on one shared time
axis, each shifted so its step starts at 0, so their shapes and makespans line up.
Small steps are drawn as SVG bars with microbatch labels; past ``BAR_LIMIT`` events
the same layers become WebGL line segments, which a browser still pans smoothly at
hundreds of thousands of events.
"""

from __future__ import annotations

import math
from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from schedules.metrics import StepMetrics, makespan, step_metrics
from schedules.trace import Trace, TraceEvent
from schedules.units import number
from schedules.units import time_unit as unit_of_times
from viz.html import include_plotlyjs, with_offline_notice
from viz.lanes import Layer, layers_of
from viz.limits import OOM_COLOR
from viz.measured_memory import has_measured_memory, measured_memory_figure
from viz.memory import has_memory_timeline, memory_figure
from viz.transfers import as_transfers

BAR_LIMIT = 20_000  # events per figure; SVG bars beyond this make the page crawl
LABEL_LIMIT = 1_500  # compute bars per figure that get a microbatch label
TIME_DIGITS = 4  # decimals of a millisecond kept in the chart (0.1 µs), scaled per unit
TOP_AXIS_PX = 900  # charts taller than this also label the time axis at the top
TITLE_GAP_PX = 64  # room between stacked subplots for a two-line title
LEGEND_ENTRY_PX = 24  # a legend line with its gap: a short chart grows to show every entry

HOVER = (
    "<b>%{{customdata[0]}}</b><br>"
    "rank %{{customdata[1]}} · stage %{{customdata[2]}} · microbatch %{{customdata[3]}}<br>"
    "start %{{customdata[4]:.3f}} {unit} · end %{{customdata[5]:.3f}} {unit}<br>"
    "duration %{{customdata[6]:.3f}} {unit}"
)
HOVER_STEP = (  # events of no microbatch (all-reduce, optimizer, idle)
    "<b>%{{customdata[0]}}</b><br>rank %{{customdata[1]}}<br>"
    "start %{{customdata[4]:.3f}} {unit} · end %{{customdata[5]:.3f}} {unit}<br>"
    "duration %{{customdata[6]:.3f}} {unit}"
)


def time_unit(traces: list[Trace]) -> tuple[str, float]:
    """The unit the chart's times are written in and the factor from seconds.

    A trace whose ``meta["time_unit"]`` is ``"units"`` (``pipesim show`` simulates with
    unit costs, F = 1 and B = 2) is in abstract units; anything else is in seconds and
    gets the one unit rule of every pipesim output (``schedules.units``): ms below 10 s,
    s from there."""
    if any(trace.meta.get("time_unit") == "units" for trace in traces):
        return "units", 1.0
    return unit_of_times(max((makespan(trace) for trace in traces), default=0.0))


def format_time(seconds: float, unit: str, scale: float) -> str:
    return f"{number(seconds * scale)} {unit}"


def describe(meta: dict, known: str = "") -> str:
    """What the step is, from its ``meta``: schedule, pp/m/v, dp/tp, model, topology
    (or, for a measured step, the backend).
    Parts already in ``known`` (a caller's title) are left out."""
    parts = []
    if meta.get("schedule") and str(meta["schedule"]) not in known:
        parts.append(str(meta["schedule"]))
    shape = [f"{name}={meta[key]}" for key, name in (("pp", "pp"), ("microbatches", "m"), ("virtual_stages", "v"))
             if key in meta and not (key == "virtual_stages" and int(meta[key] or 1) == 1)]
    if shape:
        parts.append(" ".join(shape))
    parallel = [f"{key}={meta[key]}" for key in ("dp", "tp") if meta.get(key) is not None]
    if parallel:
        parts.append(" ".join(parallel))
    if meta.get("model") and str(meta["model"]) not in known:
        parts.append(f"model {meta['model']}")
    if meta.get("topology") and str(meta["topology"]) not in known:
        parts.append(f"on {meta['topology']}")
    elif meta.get("backend") and not meta.get("topology"):
        parts.append(f"on {meta['backend']}")  # a measured step: the backend it ran on
    return " · ".join(parts)


def default_title(trace: Trace, index: int) -> str:
    """A subplot title from what the trace says about itself."""
    return str(trace.meta.get("source", f"trace {index}"))


def summary(trace: Trace, metrics: StepMetrics | None = None, unit: str = "ms", scale: float = 1e3) -> str:
    """Makespan, bubble fraction, and the worst rank's bubble and exposed communication
    time, for the subplot title (from ``metrics`` when the caller already computed them),
    in the chart's unit."""
    metrics = metrics or step_metrics(trace)
    exposed = max((rank.exposed_comm for rank in metrics.ranks), default=0.0)
    waiting = max((rank.bubble for rank in metrics.ranks), default=0.0)
    return (
        f"makespan {format_time(metrics.makespan, unit, scale)} · bubble {metrics.bubble_fraction:.1%}"
        f" ({format_time(waiting, unit, scale)} worst rank) · exposed comm (worst rank)"
        f" {format_time(exposed, unit, scale)}"
    )


def out_of_memory(trace: Trace) -> dict[int, dict]:
    """The ranks ``meta["memory"]`` judges out of memory, with their figures."""
    return {int(rank["rank"]): rank for rank in trace.meta.get("memory") or () if rank.get("oom")}


def rank_ticks(trace: Trace, ranks: int) -> list[str]:
    """One tick label per rank, with the device it ran on under it where the cluster
    names devices (not on free links); a rank out of memory is marked on it, in red."""
    marked = out_of_memory(trace)
    devices = trace.meta.get("devices") or []
    placed = trace.meta.get("topology") not in (None, "ideal") and len(devices) >= ranks
    ticks = []
    for rank in range(ranks):
        tick = f"<span style='color:{OOM_COLOR}'><b>rank {rank} ✕ OOM</b></span>" if rank in marked else f"rank {rank}"
        if placed:
            tick += f"<br><span style='font-size:9px;color:#777'>{devices[rank]}</span>"
        ticks.append(tick)
    return ticks


def memory_verdict(trace: Trace) -> str:
    """``out of memory: ranks 0, 3 (peak 230.1 GB > 72.0 GB usable)`` or ''."""
    marked = out_of_memory(trace)
    if not marked:
        return ""
    worst = max(marked.values(), key=lambda rank: rank["peak_bytes"])
    limit = worst.get("usable_bytes")
    against = f" > {limit / 1e9:,.1f} GB usable" if limit else ""
    return (f"<span style='color:{OOM_COLOR}'>out of memory: rank{'s' if len(marked) > 1 else ''} "
            f"{', '.join(map(str, sorted(marked)))} (peak {worst['peak_bytes'] / 1e9:,.1f} GB{against})</span>")


def _hover_row(event: TraceEvent, t0: float, scale: float, digits: int) -> list:
    """Action, rank, stage, microbatch, start, end, duration; times in the chart's unit
    rounded to 0.1 µs (finer than any clock we read, and it keeps large files smaller)."""
    start = round((event.start - t0) * scale, digits)
    end = round((event.end - t0) * scale, digits)
    return [event.action, event.rank, event.stage, event.microbatch, start, end, round(end - start, digits)]


def _pattern(layer: Layer) -> dict | None:
    if layer.is_compute and layer.pattern:  # a chunk's texture over its shade
        return {"shape": layer.pattern, "fillmode": "overlay", "fgcolor": "white", "fgopacity": 0.45,
                "size": 7, "solidity": 0.25}
    if layer.textured:
        return {"shape": layer.pattern or "/", "fgcolor": layer.pattern_color or layer.color, "bgcolor": "white",
                "solidity": 0.5}
    return None


def _bars(layer: Layer, t0: float, labelled: bool, scale: float, digits: int) -> dict:
    """Horizontal bars: ``base`` is the start, ``x`` the duration, both in the chart's unit."""
    offset, height = layer.lane
    hover = [_hover_row(event, t0, scale, digits) for event in layer.events]
    marker: dict = {"color": layer.color, "line": {"width": 0}}
    pattern = _pattern(layer)
    if pattern:
        marker["pattern"] = pattern
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


def _segments(layer: Layer, t0: float, row_px: float, scale: float, digits: int) -> dict:
    """WebGL line segments (start, end, gap): one vertex pair per event, each vertex
    carrying the event's hover data so either end of a long bar answers a hover.
    WebGL has no fill patterns, so a textured layer is drawn as a dotted line: it stays
    striped, in its own colour, however many events there are."""
    offset, height = layer.lane
    xs: list[float | None] = []
    ys: list[float | None] = []
    hover: list[list | None] = []
    for event in layer.events:
        row = _hover_row(event, t0, scale, digits)
        y = event.rank + offset
        xs += (row[4], row[5], None)
        ys += (y, y, None)
        hover += (row, row, None)
    return {
        "type": "scattergl",
        "x": xs,
        "y": ys,
        "mode": "lines",
        "line": {"color": layer.color, "width": max(1.0, height * row_px), "dash": _dash(layer)},
        "customdata": hover,
    }


def _dash(layer: Layer) -> str:
    """WebGL's stand-in for a texture: chunks dashed, waits and idle time dotted."""
    if not layer.textured:
        return "solid"
    return "dash" if layer.is_compute else "dot"


def legend_height(entries: int) -> int:
    """Pixels a chart needs for ``entries`` legend lines beside it and its margins: a
    two-rank step with a dozen kinds of bars once cut its legend at 330 px."""
    return entries * LEGEND_ENTRY_PX + 150


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
    summaries: list[str] | None = None,
) -> dict:
    """The Gantt chart as a plain plotly figure dict (``{"data", "layout"}``).

    Kept as a dict because validating and copying hundreds of thousands of points
    through plotly's figure objects takes longer than everything else together;
    ``write_gantt_html`` serialises this dict directly. ``metrics`` (one per trace),
    when given, titles the subplots without computing them again; ``summaries`` (one
    per trace) replaces the metrics line outright, for a caller that reports its own
    numbers (``pipesim compare``) and wants the chart to say exactly the same.
    """
    if isinstance(traces, Trace):
        traces = [traces]
    if not traces:
        raise ValueError("a Gantt chart needs at least one Trace")
    if titles is not None and len(titles) != len(traces):
        raise ValueError(f"got {len(titles)} titles for {len(traces)} traces; give one title per trace")
    for name, given in (("metrics", metrics), ("summaries", summaries)):
        if given is not None and len(given) != len(traces):
            raise ValueError(f"got {len(given)} {name} for {len(traces)} traces; give one per trace")
    titles = titles or [default_title(trace, index) for index, trace in enumerate(traces)]
    metrics = metrics or [None] * len(traces)
    unit, scale = time_unit(traces)
    digits = max(0, TIME_DIGITS + round(math.log10(1e3 / scale))) if unit != "units" else 2 * TIME_DIGITS
    drawn = [as_transfers(trace) for trace in traces]
    # Metrics of what is drawn: given ones hold for a trace only if it was drawn as is.
    metrics = [known if redrawn is trace else None
               for trace, redrawn, known in zip(traces, drawn, metrics, strict=True)]
    traces = drawn
    if summaries is None:
        summaries = [summary(trace, known, unit, scale) for trace, known in zip(traces, metrics, strict=True)]
    summaries = [line + (f" · {verdict}" if (verdict := memory_verdict(trace)) else "")
                 for line, trace in zip(summaries, traces, strict=True)]

    ranks = [max(trace.num_ranks, 1) for trace in traces]
    use_webgl = sum(len(trace.events) for trace in traces) > bar_limit
    labelled = not use_webgl and (
        sum(1 for trace in traces for event in trace.events if event.stream == "compute") <= label_limit
    )
    row_px = _row_px(max(ranks))
    plot_px = sum(ranks) * row_px + 60 * len(traces)
    gap_px = TITLE_GAP_PX + 20
    height = int(plot_px + gap_px * (len(traces) - 1) + 190)

    frame = make_subplots(
        rows=len(traces),
        cols=1,
        shared_xaxes=True,
        row_heights=[float(count) for count in ranks],
        vertical_spacing=gap_px / (plot_px + gap_px * (len(traces) - 1)) if len(traces) > 1 else 0.0,
        subplot_titles=[
            f"<b>{title}</b>" + (f" · {shape}" if (shape := describe(trace.meta, title)) else "") + f"<br>{line}"
            for title, trace, line in zip(titles, traces, summaries, strict=True)
        ],
    )
    data: list[dict] = []
    shown: set[str] = set()
    span = 0.0
    for row, trace in enumerate(traces, start=1):
        t0 = min((event.start for event in trace.events), default=0.0)
        trace_span = max((event.end - t0 for event in trace.events), default=0.0) * scale
        span = max(span, trace_span)
        for layer in layers_of(trace):
            if use_webgl:
                drawn = _segments(layer, t0, row_px, scale, digits)
            else:
                drawn = _bars(layer, t0, labelled, scale, digits)
            template = HOVER if layer.events[0].microbatch >= 0 else HOVER_STEP
            drawn.update(
                name=layer.label,
                legendgroup=layer.label,
                showlegend=layer.label not in shown,
                hovertemplate=template.format(unit=unit) + f"<extra>{layer.label}</extra>",
                xaxis="x" if row == 1 else f"x{row}",
                yaxis="y" if row == 1 else f"y{row}",
            )
            shown.add(layer.label)
            data.append(drawn)
        if trace.events:
            frame.add_vline(x=trace_span, line={"color": "#555555", "width": 1, "dash": "dash"}, row=row, col=1,
                           exclude_empty_subplots=False)
        frame.update_yaxes(
            row=row,
            col=1,
            tickvals=list(range(ranks[row - 1])),
            ticktext=rank_ticks(trace, ranks[row - 1]),
            range=[ranks[row - 1] - 0.5, -0.5],  # reversed: rank 0 on top
            showgrid=False,
            zeroline=False,
        )
    axis_title = f"time since step start ({unit})"
    frame.update_xaxes(range=[0.0, span * 1.01 or 1.0], showgrid=True, gridcolor="#E5E5E5")
    frame.update_xaxes(title_text=axis_title, row=len(traces), col=1)
    top = 100
    if height > TOP_AXIS_PX:
        # A tall chart (dozens of ranks) scrolls: label the time axis on top as well, so
        # it is on screen when the page opens.
        frame.update_xaxes(showticklabels=True, side="top", row=1, col=1)
        if len(traces) == 1:
            frame.update_xaxes(title_text=axis_title, title_standoff=4, row=1, col=1)
        top = 170
        frame.layout.annotations[0].yshift = 56  # the first title above the top axis labels
    frame.update_layout(
        barmode="overlay",
        hovermode="closest",
        # labels that do not fit a bar are dropped; down to 6 px, so two-digit microbatches keep theirs on narrow bars
        uniformtext={"minsize": 6, "mode": "hide"},
        height=max(height + (top - 100), legend_height(len(shown))),
        legend={"tracegroupgap": 4},
        margin={"l": 70, "r": 20, "t": top, "b": 50},
        plot_bgcolor="white",
    )
    return {"data": data, "layout": frame.layout.to_plotly_json()}


def gantt_figure(
    traces: list[Trace] | Trace,
    titles: list[str] | None = None,
    *,
    bar_limit: int = BAR_LIMIT,
    label_limit: int = LABEL_LIMIT,
    metrics: list[StepMetrics] | None = None,
    summaries: list[str] | None = None,
) -> go.Figure:
    """One Gantt subplot per trace, stacked on a shared time axis (s, ms, µs or
    ``units``, whichever fits; see ``time_unit``).

    Each subplot's y axis has one tick per rank (rank 0 on top); compute bars are
    coloured by kind (and shaded and textured by model chunk when ``v > 1``), sends sit
    in a thin lane under them; waits (receive and end-of-step: grey hatched while the
    peer had not sent, the bubble, red while the data was in flight, the exposed
    communication), collectives, the optimizer step and the idle tail share the compute
    lane (see ``viz.lanes``); a dashed line marks each step's end. ``titles`` name the subplots (default: the
    trace's source); schedule, shape, dp/tp, model and topology from ``meta`` follow,
    and the metrics summary (or ``summaries``) goes on a second line. Past
    ``bar_limit`` events the bars become WebGL segments; only up to ``label_limit``
    compute bars are labelled with their microbatch.
    """
    if isinstance(traces, Trace):
        traces = [traces]
    spec = gantt_spec(traces, titles, bar_limit=bar_limit, label_limit=label_limit, metrics=metrics,
                      summaries=summaries)
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
    summaries: list[str] | None = None,
) -> Path:
    """Write a Gantt HTML page; ``plotly="inline"`` embeds plotly.js (opens offline),
    ``"cdn"`` loads it from the network (see ``viz.html``)."""
    if isinstance(traces, Trace):
        traces = [traces]
    spec = gantt_spec(traces, titles, metrics=metrics, summaries=summaries)
    if title:
        spec["layout"]["title"] = {"text": title, "x": 0.0, "xanchor": "left"}
    path = Path(path)
    html = pio.to_html(
        spec, include_plotlyjs=include_plotlyjs(plotly), full_html=True, validate=False,
        config={"displaylogo": False, "scrollZoom": True},
    )
    # under the Gantt: what each rank holds over a simulated step, on its time unit; a
    # measured step's peak per rank beside its prediction
    figures = [memory_figure(trace, *time_unit(traces)) if has_memory_timeline(trace) else
               measured_memory_figure(trace)
               for trace in traces if has_memory_timeline(trace) or has_measured_memory(trace)]
    if figures:
        parts = [pio.to_html(figure, include_plotlyjs=False, full_html=False, config={"displaylogo": False})
                 for figure in figures]
        html = html.replace("</body>", "".join(parts) + "</body>", 1)
    path.write_text(with_offline_notice(html, plotly), encoding="utf-8")
    return path
