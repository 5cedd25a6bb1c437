"""The plan page answers "which layout, and why": axes fitted to the feasible layouts,
the rest counted, one colour and marker per schedule, tied series merged and named, a
table and side-by-side breakdowns of the top layouts."""

from __future__ import annotations

import pytest

from schedules.generators import SCHEDULE_NAMES
from viz.colors import NO_PIPELINE, schedule_color, schedule_symbol
from viz.plan import layout_name, merged_series, plan_figure, step_parts, top_table, why_figure


def row(schedule: str, pp: int, peak_gb: float, tokens: float, step: float = 1.0, **extra) -> dict:
    zero = extra.pop("zero", 0)
    return {"schedule": schedule, "pp": pp, "zero": zero, "peak_memory_bytes": peak_gb * 1e9,
            "tokens_per_second": tokens, "step_time": step, "bubble_fraction": 0.1, "idle_fraction": 0.25,
            "exposed_comm": 0.05 * step, "mfu": 0.4, "capacity_bytes": 80e9, "usable_bytes": 72e9,
            "memory_headroom": "10%", "oom": False,
            "layout": f"{schedule} pp{pp} tp1 dp{8 // pp}" + (f" zero{zero}" if zero else ""), **extra}


def test_every_schedule_has_its_own_colour_and_marker():
    names = [*SCHEDULE_NAMES, NO_PIPELINE]
    assert len({schedule_color(name) for name in names}) == len(names)
    assert len({schedule_symbol(name) for name in names}) == len(names)


def test_series_on_the_same_points_are_merged_and_said():
    rows = [row("zb-h1", 4, 30, 1000), row("zb-h1", 2, 40, 900), row("zb-auto", 4, 30, 1000),
            row("zb-auto", 2, 40, 900), row("zbv", 4, 30, 1100)]
    series = merged_series(rows)
    assert set(series) == {"zb-auto = zb-h1 (same points)", "zbv"}
    assert len(series["zb-auto = zb-h1 (same points)"]) == 4


def test_pp1_is_no_pipeline_and_zero3_is_named():
    best = row("1f1b", 1, 18.4, 496_116, zero=3)
    assert set(merged_series([best])) == {NO_PIPELINE}
    assert layout_name(best) == "no pipeline (pp1) tp1 dp8 ZeRO-3 (sharded params)"


def test_axes_fit_the_feasible_layouts_and_the_rest_is_counted():
    rows = [row("1f1b", 4, 20, 1000), row("zbv", 4, 36, 1200), row("gpipe", 8, 30, 900)]
    others = [{"layout": "gpipe pp2", "bucket": "rejected before simulation", "cause": "out of memory",
               "peak_memory_bytes": 1221e9, "tokens_per_second": 1500},
              {"layout": "1f1b pp8", "bucket": "pruned", "cause": "bound", "peak_memory_bytes": 25e9,
               "tokens_per_second": 950}]
    fig = plan_figure(rows, rows[:1], others=others)
    low, high = fig.layout.xaxis.range
    assert low == 0 and 36 < high < 100  # the 72 GB usable limit is near enough to draw; 1,221 GB is not
    assert fig.layout.yaxis.range[0] < 900 and fig.layout.yaxis.range[1] > 1200
    drawn = [point for trace in fig.data if trace.mode == "markers" for point in trace.x]
    assert 1221 not in drawn and 25 in drawn
    notes = [annotation.text for annotation in fig.layout.annotations if "not drawn" in (annotation.text or "")]
    assert notes and "1 rejected: out of memory at its floor (1,221 GB to 1,221 GB" in notes[0]
    limits = sorted(shape.x0 for shape in fig.layout.shapes)
    assert limits == [pytest.approx(72.0), pytest.approx(80.0)]


def test_a_far_limit_is_said_not_squeezed():
    rows = [row("1f1b", 4, 2, 1000), row("zbv", 4, 3, 1200)]  # 3 GB of 72 usable
    fig = plan_figure(rows, rows[:1])
    assert fig.layout.xaxis.range[1] < 10
    assert any("right of the axes" in (annotation.text or "") for annotation in fig.layout.annotations)


def test_step_parts_sum_to_the_step():
    # step 2 s, idle 25% -> compute 1.5 s; bubble 10% -> 0.2 s; exposed 5% -> 0.1 s; other 0.2 s
    parts = step_parts(row("1f1b", 4, 20, 1000, step=2.0))
    assert parts == pytest.approx({"compute": 1.5, "bubble": 0.2, "exposed_comm": 0.1, "other": 0.2})
    split = step_parts(row("1f1b", 4, 20, 1000, step=2.0, dp=0.1, optimizer=0.05))
    assert split["other"] == pytest.approx(0.05) and sum(split.values()) == pytest.approx(2.0)


def test_why_bars_and_table_show_the_top_layouts():
    rows = [row("1f1b", 1, 18.4, 496_116, step=0.1321, zero=3), row("zbv", 4, 20, 480_000, step=0.1365),
            row("1f1b", 2, 22, 470_000, step=0.1394), row("gpipe", 4, 30, 400_000, step=0.16)]
    fig = why_figure(rows)
    bars = [trace for trace in fig.data if trace.type == "bar"]
    assert len(bars[0].y) == 3 and bars[0].y[0].startswith("#1 no pipeline")
    totals = [sum(trace.x[index] for trace in bars) for index in range(3)]
    assert totals == pytest.approx([132.1, 136.5, 139.4])  # ms: every bar as long as its step
    table = top_table(rows, top=3)
    assert table.count("<tr>") == 4 and "496,116" in table and "132.1 ms" in table and "gpipe" not in table


def test_plan_page_has_the_table_why_and_a_zero3_legend(tmp_path):
    from pipesim.cli import main

    out = tmp_path / "plan.html"
    assert main(["plan", "--model", "gpt3-1.3b", "--topology", "nvlink", "--gpus", "8", "--global-batch", "16",
                 "--schedules", "1f1b", "--constraint", "pp=1", "--constraint", "zero=3", "--microbatch-sizes", "2",
                 "--top", "2", "--workers", "1", "--html", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    # three ranked: none, per-op (torchtitan's, searched for dense models) and selective
    assert "why this layout" in page and "top 3 layouts by step time" in page
    assert "no pipeline (pp1)" in page and "ZeRO-3" in page and "gradient all-reduce" not in page


def test_sweep_dodge_stays_within_a_third_of_a_tick_gap():
    from viz.sweep import sweep_figure

    rows = [{"schedule": f"s{index}", "microbatches": count, "makespan": 1.0 + index, "bubble_fraction": 0.1,
             "peak_inflight_microbatches": 1} for index in range(10) for count in (8, 16)]
    fig = sweep_figure(rows)
    at_8 = [trace.x[0] for trace in fig.data if trace.xaxis == "x"]
    assert len(at_8) == 10 and max(at_8) - min(at_8) <= 0.3 * 8 + 1e-9  # the gap between 8 and 16 is 8


def test_cdn_pages_say_why_they_are_blank_offline(tmp_path):
    from schedules.trace import Trace, TraceEvent
    from viz.gantt import write_gantt_html

    trace = Trace([TraceEvent(0, "0F0", "F", 0, 0, 0.0, 1.0, "compute")], {})
    cdn, inline = tmp_path / "cdn.html", tmp_path / "inline.html"
    write_gantt_html(trace, cdn, plotly="cdn")
    write_gantt_html(trace, inline)
    page = cdn.read_text(encoding="utf-8")
    assert "could not reach it" in page and "typeof Plotly === 'undefined'" in page
    assert "pipesim-no-plotly" not in inline.read_text(encoding="utf-8")


def test_a_short_gantt_is_tall_enough_for_its_legend():
    """Two ranks of an interleaved step with dp, tp and the optimizer: a dozen legend lines,
    which the rank rows' 330 px once cut off."""
    from schedules.trace import Trace, TraceEvent
    from viz.gantt import LEGEND_ENTRY_PX, gantt_spec

    events, moment = [], 0.0
    for rank in range(2):
        for stage in (rank, rank + 2):  # chunk 0 and chunk 1 of the rank
            for kind in ("F", "B"):
                events.append(TraceEvent(rank, f"{stage}{kind}0", kind, stage, 0, moment, moment + 1.0, "compute"))
                moment += 1.0
        for stream, kind in (("tp", "ALLREDUCE_TP"), ("dp", "ALLREDUCE_DP"), ("step", "OPTIMIZER")):
            events.append(TraceEvent(rank, kind, kind, -1, -1, moment, moment + 0.5, stream))
            moment += 0.5
    events.append(TraceEvent(0, "0SEND_F0", "SEND_F", 0, 0, 1.0, 1.5, "send"))
    events.append(TraceEvent(1, "1RECV_F0", "RECV_F", 1, 0, 0.0, 1.5, "recv"))
    spec = gantt_spec(Trace(events, {"virtual_stages": 2}))
    entries = sum(1 for layer in spec["data"] if layer.get("showlegend"))
    assert entries >= 10
    assert spec["layout"]["height"] >= entries * LEGEND_ENTRY_PX + 100 > 330
