"""The memory panel under a Gantt chart: what each rank holds over the step.

Per rank, stacked: weights, gradients, optimizer state and buffers (fixed over the step)
and the activations kept for the backward (rising with each forward's stash, falling
with each backward), the peak marked, the usable limit (capacity less the headroom: what
out of memory is judged against) and the capacity drawn and labelled. Read from the
Trace's ``meta["memory"]`` (``pipesim.cli.chart_data``), on the Gantt's time axis.
Past ``RANK_LIMIT`` ranks only the ranks with the highest peaks are drawn, and the panel
says which.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from schedules.trace import Trace
from viz.limits import memory_lines

RANK_LIMIT = 8
PART_COLORS = {"weights": "#4C78A8", "gradients": "#F58518", "optimizer state": "#B279A2", "buffers": "#9D9D9D"}
ACTIVATION_COLOR = "#54A24B"


def has_memory_timeline(trace: Trace) -> bool:
    return any(rank.get("activations") for rank in trace.meta.get("memory") or ())


def drawn_ranks(memory: list[dict]) -> list[dict]:
    """Every rank, or past ``RANK_LIMIT`` the ones with the highest peaks, in rank order."""
    if len(memory) <= RANK_LIMIT:
        return memory
    highest = sorted(memory, key=lambda rank: rank["peak_bytes"], reverse=True)[:RANK_LIMIT]
    return sorted(highest, key=lambda rank: rank["rank"])


def memory_figure(trace: Trace, unit: str, scale: float) -> go.Figure:
    """The panel (see the module) with times in the Gantt's ``unit`` (``scale`` per second)."""
    memory = trace.meta["memory"]
    shown = drawn_ranks(memory)
    step_end = max((event.end for event in trace.events), default=0.0)
    t0 = min((event.start for event in trace.events), default=0.0)
    fig = make_subplots(rows=len(shown), cols=1, shared_xaxes=True, vertical_spacing=0.04,
                        subplot_titles=[f"rank {rank['rank']}: peak {rank['peak_bytes'] / 1e9:,.1f} GB"
                                        + (" ✕ out of memory" if rank.get("oom") else "") for rank in shown])
    for row, rank in enumerate(shown, start=1):
        fixed = 0.0
        for part, held in rank["parts"].items():
            level = fixed + held
            fig.add_trace(go.Scatter(
                x=[0.0, (step_end - t0) * scale], y=[level / 1e9] * 2, mode="lines", fill="tonexty" if fixed else
                "tozeroy", line={"color": PART_COLORS.get(part, "#777"), "width": 0.5}, name=part, legendgroup=part,
                showlegend=row == 1, hovertemplate=f"{part}: {held / 1e9:,.2f} GB<extra>rank {rank['rank']}</extra>",
            ), row=row, col=1)
            fixed = level
        times = [(time - t0) * scale for time, _ in rank["activations"]] + [(step_end - t0) * scale]
        held = [fixed + value for _, value in rank["activations"]]
        held.append(held[-1] if held else fixed)
        fig.add_trace(go.Scatter(
            x=times, y=[value / 1e9 for value in held], mode="lines", line={"shape": "hv", "color": ACTIVATION_COLOR},
            fill="tonexty", name="activations kept for the backward", legendgroup="activations", showlegend=row == 1,
            hovertemplate="%{y:,.2f} GB at %{x:.3f} " + unit + f"<extra>rank {rank['rank']}</extra>",
        ), row=row, col=1)
        peak_at = max(range(len(held)), key=held.__getitem__)
        fig.add_trace(go.Scatter(
            x=[times[peak_at]], y=[held[peak_at] / 1e9], mode="markers+text", text=["peak"],
            textposition="top center", marker={"symbol": "triangle-down", "size": 10, "color": "black"},
            name="peak", legendgroup="peak", showlegend=row == 1, hoverinfo="skip",
        ), row=row, col=1)
        for position, line in zip(("top left", "bottom left"), memory_lines([rank]), strict=False):
            fig.add_hline(y=line.gigabytes, line={"color": line.color, "dash": line.dash, "width": 1.2}, row=row,
                          col=1, annotation_text=line.label, annotation_position=position,
                          annotation_font={"color": line.color, "size": 10})
    left_out = len(memory) - len(shown)
    title = "memory over the step (GB per rank)" + (
        f": the {len(shown)} ranks with the highest peaks of {len(memory)}" if left_out else "")
    fig.update_layout(title={"text": title, "x": 0.0, "xanchor": "left"}, height=140 + 150 * len(shown),
                      plot_bgcolor="white", margin={"l": 70, "r": 20, "t": 80, "b": 50})
    fig.update_xaxes(range=[0.0, (step_end - t0) * scale * 1.01 or 1.0], gridcolor="#E5E5E5")
    fig.update_xaxes(title_text=f"time since step start ({unit})", row=len(shown), col=1)
    fig.update_yaxes(rangemode="tozero", gridcolor="#EEE")
    return fig
