"""The memory panel under a measured Gantt: each rank's measured peak beside the prediction.

Per rank, the peak of the last step (``pipesim run``) as a stacked bar of what it was
made of when it was reached (weights, gradients, optimizer state, buffers, activations:
the simulated panel's parts and colours, ``viz.memory``), and beside it an outlined bar
labelled "predicted", the simulator's peak for the same run, the error in its hover. On
a GPU the allocator's peak has no parts: one bar. A rank without a prediction has the
measured bar only, and its hover and the legend say why. Read from the Trace's
``meta["memory"]`` (``pipesim.cli.chart_data.measured_memory_meta``). There is no
timeline: the executor keeps the peak's parts, not the step's course.
"""

from __future__ import annotations

import plotly.graph_objects as go

from schedules.trace import Trace
from viz.memory import ACTIVATION_COLOR, PART_COLORS, drawn_ranks

MEASURED_SOURCES = ("tracked", "cuda")
ALLOCATOR_COLOR = "#72B7B2"
PREDICTED_COLOR = "#222222"
MIB = 2**20


def has_measured_memory(trace: Trace) -> bool:
    return any(rank.get("source") in MEASURED_SOURCES for rank in trace.meta.get("memory") or ())


def memory_unit(ranks: list[dict]) -> tuple[str, float]:
    """MiB (as ``pipesim run`` prints) below a gigabyte, GB (as the simulated panel) from there."""
    largest = max(max(rank["peak_bytes"], rank.get("predicted_peak_bytes") or 0.0) for rank in ranks)
    return ("GB", 1e9) if largest >= 1e9 else ("MiB", MIB)


def peak_parts(rank: dict) -> dict[str, float]:
    """What the measured peak was made of, bottom up; a GPU's allocator peak as one part."""
    if rank["source"] == "cuda":
        return {"allocator peak": rank["peak_bytes"]}
    return {**rank["parts"], "activations": rank["activations_at_peak"]}


def error_text(rank: dict) -> str:
    """The measured peak against the predicted one, as ``pipesim run`` prints it."""
    return f"{rank['peak_bytes'] / rank['predicted_peak_bytes'] - 1:+.1%}"


def measured_memory_figure(trace: Trace) -> go.Figure:
    """The panel (see the module)."""
    memory = trace.meta["memory"]
    shown = drawn_ranks(memory)
    unit, scale = memory_unit(shown)
    labels = [f"rank {rank['rank']}" for rank in shown]
    fig = go.Figure()
    parts = list(dict.fromkeys(part for rank in shown for part in peak_parts(rank)))
    base = [0.0] * len(shown)
    for part in parts:
        held = [peak_parts(rank).get(part, 0.0) / scale for rank in shown]
        hover = [f"{part}: {value:,.3f} {unit} of the measured peak {rank['peak_bytes'] / scale:,.3f} {unit}"
                 + (f"<br>{rank['not_predicted']}" if rank["not_predicted"] else "") for value, rank in zip(
                     held, shown, strict=True)]
        color = PART_COLORS.get(part, ACTIVATION_COLOR if part == "activations" else ALLOCATOR_COLOR)
        fig.add_trace(go.Bar(x=labels, y=held, base=list(base), name=part, offsetgroup="measured",
                             marker={"color": color}, hovertext=hover, hoverinfo="text"))
        base = [below + value for below, value in zip(base, held, strict=True)]
    predicted = [rank for rank in shown if rank.get("predicted_peak_bytes") is not None]
    if predicted:
        fig.add_trace(go.Bar(
            x=[f"rank {rank['rank']}" for rank in predicted],
            y=[rank["predicted_peak_bytes"] / scale for rank in predicted], offsetgroup="predicted",
            name="predicted peak", text=[f"predicted<br>measured {error_text(rank)}" for rank in predicted],
            textposition="inside",
            insidetextanchor="end", marker={"color": "white", "line": {"color": PREDICTED_COLOR, "width": 2}},
            hovertext=[prediction_hover(rank, unit, scale) for rank in predicted], hoverinfo="text"))
    for why in dict.fromkeys(rank["not_predicted"] for rank in shown if rank["not_predicted"]):
        fig.add_trace(go.Bar(x=[None], y=[None], name=f"no prediction: {why}",
                             marker={"color": "white", "line": {"color": "#BBBBBB", "width": 1}}))
    left_out = len(memory) - len(shown)
    title = f"measured peak memory of the last step ({unit} per rank)" + (
        f": the {len(shown)} ranks with the highest peaks of {len(memory)}" if left_out else "")
    fig.update_layout(title={"text": title, "x": 0.0, "xanchor": "left"}, barmode="group", height=420,
                      plot_bgcolor="white", margin={"l": 70, "r": 20, "t": 80, "b": 50},
                      legend={"traceorder": "normal"})
    fig.update_yaxes(title_text=unit, rangemode="tozero", gridcolor="#EEE")
    return fig


def prediction_hover(rank: dict, unit: str, scale: float) -> str:
    """The predicted peak, the measured one and the error; the activations beside theirs."""
    text = (f"predicted peak {rank['predicted_peak_bytes'] / scale:,.3f} {unit}, measured "
            f"{rank['peak_bytes'] / scale:,.3f} {unit}: error {error_text(rank)} (measured / predicted - 1)")
    if rank.get("predicted_activations_bytes") is not None and rank.get("most_activations_bytes") is not None:
        text += (f"<br>most activations at once: predicted {rank['predicted_activations_bytes'] / scale:,.3f} "
                 f"{unit}, measured {rank['most_activations_bytes'] / scale:,.3f} {unit}")
    return text
