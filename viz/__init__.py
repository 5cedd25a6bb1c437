"""Charts of pipeline steps: Gantt timelines, sweep charts and Chrome/Perfetto export.

Reads Traces and result rows only (plotly and ``schedules``; never torch or simpy),
so a chart can be drawn on a laptop from files a cluster run left behind.
"""

from viz.chrome_trace import to_chrome_trace, write_chrome_trace
from viz.colors import KIND_COLORS, kind_color, schedule_color, stream_color
from viz.gantt import gantt_figure, write_gantt_html
from viz.sweep import sweep_figure, write_sweep_html

__all__ = [
    "KIND_COLORS",
    "gantt_figure",
    "kind_color",
    "schedule_color",
    "stream_color",
    "sweep_figure",
    "to_chrome_trace",
    "write_chrome_trace",
    "write_gantt_html",
    "write_sweep_html",
]
