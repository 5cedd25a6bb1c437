"""Charts and exports: every number drawn is checked against the Trace it came from."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import plotly.graph_objects as go
import pytest

from schedules.action import parse_action
from schedules.metrics import step_metrics
from schedules.trace import Trace, TraceEvent
from viz import (
    KIND_COLORS,
    gantt_figure,
    schedule_color,
    sweep_figure,
    to_chrome_trace,
    write_chrome_trace,
    write_gantt_html,
    write_sweep_html,
)


def event(rank: int, text: str, start: float, end: float, stream: str = "compute") -> TraceEvent:
    action = parse_action(text)
    return TraceEvent(rank, text, action.kind, action.stage, action.microbatch, start, end, stream)


def two_rank_step(offset: float = 0.0, slow: float = 1.0, source: str = "simulated") -> Trace:
    """GPipe on 2 ranks, 2 microbatches, F = 1 ms, B = 2 ms, 0.1 ms links; rank 1
    waits on its first receive, so the step has one exposed-communication block."""
    ms = 1e-3 * slow
    t = offset
    events = [
        event(0, "0F0", t + 0 * ms, t + 1 * ms),
        event(0, "0SEND_F0", t + 1 * ms, t + 1.1 * ms, "send"),
        event(0, "0F1", t + 1 * ms, t + 2 * ms),
        event(0, "0SEND_F1", t + 2 * ms, t + 2.1 * ms, "send"),
        event(1, "1RECV_F0", t + 0 * ms, t + 1.1 * ms, "recv"),
        event(1, "1F0", t + 1.1 * ms, t + 2.1 * ms),
        event(1, "1F1", t + 2.1 * ms, t + 3.1 * ms),
        event(1, "1B1", t + 3.1 * ms, t + 5.1 * ms),
        event(1, "1SEND_B1", t + 5.1 * ms, t + 5.2 * ms, "send"),
        event(1, "1B0", t + 5.1 * ms, t + 7.1 * ms),
        event(1, "1SEND_B0", t + 7.1 * ms, t + 7.2 * ms, "send"),
        event(0, "0RECV_B1", t + 2 * ms, t + 5.2 * ms, "recv"),
        event(0, "0B1", t + 5.2 * ms, t + 7.2 * ms),
        event(0, "0B0", t + 7.2 * ms, t + 9.2 * ms),
    ]
    return Trace(events, {"pp": 2, "schedule": "gpipe", "microbatches": 2, "source": source})


def drawn_events(fig) -> dict[str, tuple]:
    """action -> (trace, index) for every drawn bar, from its hover data."""
    found = {}
    for trace in fig.data:
        for index, row in enumerate(trace.customdata or ()):
            if row is not None:
                found[row[0]] = (trace, index)
    return found


def test_one_row_per_rank_rank_zero_on_top():
    fig = gantt_figure([two_rank_step()])
    assert list(fig.layout.yaxis.tickvals) == [0, 1]
    assert list(fig.layout.yaxis.ticktext) == ["rank 0", "rank 1"]
    low, high = fig.layout.yaxis.range
    assert low > high  # reversed, so rank 0 is the top row


def test_every_compute_event_is_a_bar_with_its_start_and_duration():
    trace = two_rank_step()
    fig = gantt_figure([trace])
    drawn = drawn_events(fig)
    compute = [e for e in trace.events if e.stream == "compute"]
    bars = [t for t in fig.data if t.type == "bar" and t.marker.color in KIND_COLORS.values()]
    assert sum(len(t.x) for t in bars) == len(compute)
    for e in compute:
        bar, index = drawn[e.action]
        assert bar.type == "bar" and bar.orientation == "h"
        assert bar.base[index] == pytest.approx(e.start * 1e3, abs=1e-4)
        assert bar.x[index] == pytest.approx(e.duration * 1e3, abs=1e-4)
        assert bar.y[index] == pytest.approx(e.rank)
        assert bar.marker.color == KIND_COLORS[e.kind]
        assert bar.text[index] == str(e.microbatch)


def test_hover_names_the_action_and_its_details():
    fig = gantt_figure([two_rank_step()])
    bar, index = drawn_events(fig)["1B0"]
    assert "%{customdata[0]}" in bar.hovertemplate and "duration" in bar.hovertemplate
    action, rank, stage, microbatch, start, end, duration = bar.customdata[index]
    assert (action, rank, stage, microbatch) == ("1B0", 1, 1, 0)
    assert (start, end, duration) == pytest.approx((5.1, 7.1, 2.0), abs=1e-4)


def test_communication_lanes_send_thin_recv_wait_split_into_bubble_and_exposed_comm():
    fig = gantt_figure([two_rank_step()])
    by_name = {t.name: t for t in fig.data}
    recv = by_name["exposed comm (wait, data in flight)"]
    bubble = by_name["bubble (wait for a peer)"]
    send = by_name["send (posted to arrival)"]
    assert recv.marker.color == "#D62728" and bubble.marker.pattern.shape == "/"
    assert bubble.marker.color != recv.marker.color
    # 1RECV_F0 waits 0..1.1 ms, its send is posted at 1 ms: 1 ms bubble, 0.1 ms in flight;
    # 0RECV_B1 waits 2..5.2 ms, its send is posted at 5.1 ms: 3.1 ms bubble, 0.1 ms in flight.
    exposed = {row[0]: (row[4], row[5]) for row in recv.customdata}
    waited = {row[0]: (row[4], row[5]) for row in bubble.customdata}
    assert exposed["1RECV_F0"] == pytest.approx((1.0, 1.1)) and exposed["0RECV_B1"] == pytest.approx((5.1, 5.2))
    assert waited["1RECV_F0"] == pytest.approx((0.0, 1.0)) and waited["0RECV_B1"] == pytest.approx((2.0, 5.1))
    assert len(send.x) == 4 and send.width < by_name["F forward"].width
    assert all(abs(y - round(y)) > 0.2 for y in send.y)  # in its own lane, off the rank's centre


def test_unknown_stream_gets_its_own_layer():
    trace = two_rank_step()
    trace.events.append(TraceEvent(0, "0F0", "F", 0, 0, 0.0095, 0.0099, "nvtx"))
    fig = gantt_figure([trace])
    layer = next(t for t in fig.data if t.name == "nvtx")
    assert list(layer.y) == [pytest.approx(-0.37)]  # the thin lane above rank 0's compute


def test_predicted_and_measured_share_one_time_axis():
    predicted = two_rank_step()
    measured = two_rank_step(offset=123.0, slow=1.2, source="measured")  # a wall-clock origin
    fig = gantt_figure([predicted, measured], titles=["predicted", "measured"])
    assert fig.layout.xaxis.range == fig.layout.xaxis2.range
    assert fig.layout.xaxis.range[1] >= 9.2 * 1.2
    assert fig.layout.xaxis.matches == "x2" or fig.layout.xaxis2.matches == "x"
    titles = [a.text for a in fig.layout.annotations]
    assert titles[0].startswith("<b>predicted</b>") and titles[1].startswith("<b>measured</b>")
    bar, index = drawn_events(fig)["0F0"]  # the measured one is drawn last
    assert bar.yaxis == "y2" and bar.base[index] == pytest.approx(0.0, abs=1e-4)


def test_subplot_title_carries_makespan_and_bubble():
    trace = two_rank_step()
    metrics = step_metrics(trace)
    title = gantt_figure([trace]).layout.annotations[0].text
    assert f"makespan {metrics.makespan * 1e3:.4g} ms" in title  # 9.2 ms: four significant digits at most
    assert f"{metrics.bubble_fraction:.1%}" in title


def test_labels_dropped_above_label_limit():
    fig = gantt_figure([two_rank_step()], label_limit=3)
    assert all(t.text is None for t in fig.data)


def test_large_traces_become_webgl_segments_with_the_same_times():
    trace = two_rank_step()
    fig = gantt_figure([trace], bar_limit=5)
    assert {t.type for t in fig.data} == {"scattergl"}
    forward = next(t for t in fig.data if t.name == "F forward")
    starts_ends = [(forward.x[i], forward.x[i + 1]) for i in range(0, len(forward.x), 3)]
    expected = [(e.start * 1e3, e.end * 1e3) for e in trace.events if e.kind == "F"]
    assert starts_ends == [pytest.approx(pair, abs=1e-4) for pair in expected]
    assert all(forward.x[i] is None for i in range(2, len(forward.x), 3))
    go.Figure(fig.to_dict())  # large figures skip validation when built; they must still pass it


def test_gantt_html_is_self_contained(tmp_path):
    path = write_gantt_html([two_rank_step(), two_rank_step(source="measured")], tmp_path / "step.html", title="demo")
    html = path.read_text(encoding="utf-8")
    # No script is fetched from anywhere (plotly.js mentions a CDN only as its map
    # topojson default, which a Gantt chart never loads).
    assert '<script src="http' not in html and not re.search(r"<script[^>]*\bsrc=", html)
    assert "plotly.js v" in html and len(html) > 1_000_000  # the library itself is inline
    assert "1B0" in html and "demo" in html


def test_titles_must_match_traces():
    with pytest.raises(ValueError, match="one title per trace"):
        gantt_figure([two_rank_step()], titles=["a", "b"])


def test_chrome_trace_events_and_times_in_microseconds(tmp_path):
    trace = two_rank_step(offset=2.0)
    exported = to_chrome_trace(trace)
    complete = [e for e in exported["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(trace.events)
    for source, out in zip(trace.events, complete, strict=True):
        assert out["name"] == source.action and out["pid"] == source.rank
        assert out["ts"] == pytest.approx(source.start * 1e6)
        assert out["dur"] == pytest.approx(source.duration * 1e6)
        assert out["args"] == {"stage": source.stage, "microbatch": source.microbatch, "kind": source.kind}
    meta = [e for e in exported["traceEvents"] if e["ph"] == "M"]
    processes = {(e["pid"], e["args"]["name"]) for e in meta if e["name"] == "process_name"}
    assert processes == {(0, "rank 0"), (1, "rank 1")}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert threads[(0, 0)] == "compute" and threads[(0, 1)] == "send" and threads[(1, 2)] == "recv"
    path = write_chrome_trace(trace, tmp_path / "step.json")
    assert json.loads(path.read_text())["otherData"]["schedule"] == "gpipe"


def sweep_rows() -> list[dict]:
    rows = []
    for schedule, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)):
        for m in (4, 8, 16, 32):
            rows.append(
                {
                    "schedule": schedule,
                    "microbatches": m,
                    "virtual_stages": chunks,
                    "pp": 4,
                    "makespan": (m + 3 / chunks) * 3e-3,
                    "bubble_fraction": (3 / chunks) / (m + 3 / chunks),
                    "peak_inflight_microbatches": m if schedule == "gpipe" else 4,
                }
            )
    return rows


def test_sweep_has_one_line_per_schedule_per_panel(tmp_path):
    fig = sweep_figure(sweep_rows())
    for axis in ("x", "x2", "x3"):
        lines = [t for t in fig.data if t.xaxis == axis]
        assert sorted(t.name for t in lines) == ["1f1b", "gpipe", "interleaved-1f1b v=2"]
        for line in lines:
            assert list(line.customdata) == [4, 8, 16, 32]  # the true counts; x is dodged a little
            assert all(abs(x / m - 1) < 0.1 for x, m in zip(line.x, line.customdata, strict=True))
            assert line.line.color == schedule_color(line.name.split()[0])
    gpipe_time = next(t for t in fig.data if t.name == "gpipe" and t.xaxis == "x")
    assert gpipe_time.y[0] == pytest.approx((4 + 3) * 3.0)  # step time in ms
    assert fig.layout.xaxis.type == "log" and list(fig.layout.xaxis.tickvals) == [4, 8, 16, 32]
    assert any("max over ranks" in a.text for a in fig.layout.annotations)
    html = write_sweep_html(sweep_rows(), tmp_path / "sweep.html").read_text(encoding="utf-8")
    assert '<script src="http' not in html


def test_sweep_rejects_rows_missing_fields():
    with pytest.raises(ValueError, match="lacks makespan"):
        sweep_figure(
            [{"schedule": "gpipe", "microbatches": 4, "bubble_fraction": 0.1, "peak_inflight_microbatches": 2}]
        )


def test_viz_imports_neither_torch_nor_simpy():
    code = "import sys, viz; assert not {'torch', 'simpy'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
