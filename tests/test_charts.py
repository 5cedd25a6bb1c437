"""Charts that tell the truth at a glance: what each figure's spec says (layers, legend
names, lanes, units, colours per chunk, memory panel, capacity line, OOM marks,
topology layout), checked against hand calculations on small inputs."""

from __future__ import annotations

import re

import pytest

from pipesim import api
from pipesim.cli.compare import chart_summaries
from pipesim.cli.topology import graph_lists
from pipesim.sim.comparison import compare, report_lines
from schedules.trace import Trace, TraceEvent
from schedules.units import number
from tests.test_viz import event, two_rank_step
from viz.colors import KIND_COLORS, STEP_STREAM_STYLES, chunk_color
from viz.gantt import gantt_figure
from viz.lanes import COMPUTE_LANE, HELD_DP_LABEL, STREAM_LABELS, dp_label
from viz.sweep import OOM_NAME, sweep_figure
from viz.topology import TITLE_WIDTH, positions, topology_figure
from viz.transfers import as_transfers

BUBBLE, EXPOSED = STREAM_LABELS["bubble"], STREAM_LABELS["recv"]


def scaled(trace: Trace, factor: float, **meta) -> Trace:
    """``trace`` with every time multiplied by ``factor`` and ``meta`` added."""
    events = [e._replace(start=e.start * factor, end=e.end * factor) for e in trace.events]
    return Trace(events, {**trace.meta, **meta})


def layer(fig, name: str):
    return next(t for t in fig.data if t.name == name)


# -- Gantt: chunks ----------------------------------------------------------------------


def test_interleaved_chunks_have_their_own_shade_texture_and_legend_entry():
    schedule = api.schedule("interleaved-1f1b", pp=2, microbatches=4, virtual_stages=2)
    result = api.simulate(schedule)
    fig = gantt_figure([result.trace])
    names = {t.name for t in fig.data}
    for kind in ("F forward", "B backward"):
        assert {f"{kind} · chunk 0", f"{kind} · chunk 1"} <= names
        assert kind not in names
    first, second = layer(fig, "F forward · chunk 0"), layer(fig, "F forward · chunk 1")
    assert first.marker.color == KIND_COLORS["F"]
    # chunk 1: each channel of #4C78A8 moved 32% towards black, by hand: 4C->34, 78->52, A8->72
    assert second.marker.color == chunk_color("F", 1) == "#345272"
    assert second.marker.pattern.shape == "x" and not first.marker.pattern.shape
    # pp=2, v=2: stages 2 and 3 are chunk 1; one forward per microbatch per chunk per rank
    assert sorted({row[2] for row in second.customdata}) == [2, 3]
    assert len(second.x) == 2 * 4 and len(first.x) == 2 * 4


def test_v_placement_chunks_follow_stage_over_pp():
    # V-shaped: rank 0 holds stages 0 and 3 of pp=2, v=2; stage 3 // 2 = chunk 1.
    events = [event(0, "0F0", 0.0, 1e-3), event(1, "1F0", 1e-3, 2e-3), event(1, "2F0", 2e-3, 3e-3),
              event(0, "3F0", 3e-3, 4e-3)]
    fig = gantt_figure([Trace(events, {"pp": 2, "virtual_stages": 2})])
    chunk1 = layer(fig, "F forward · chunk 1")
    assert sorted((row[0], row[1]) for row in chunk1.customdata) == [("2F0", 1), ("3F0", 0)]


# -- Gantt: idle, step end, units, title --------------------------------------------------


def test_idle_after_a_ranks_last_action_is_drawn_to_the_step_end():
    fig = gantt_figure([two_rank_step()])
    idle = layer(fig, STEP_STREAM_STYLES["idle"][0])
    # rank 1's last event (1SEND_B0) ends at 7.2 ms, the step at 9.2 ms; rank 0 ends it
    assert list(idle.y) == [pytest.approx(1 + COMPUTE_LANE[0])]
    assert idle.base[0] == pytest.approx(7.2) and idle.x[0] == pytest.approx(2.0)
    assert idle.marker.pattern.shape == "."
    lines = [shape for shape in fig.layout.shapes if shape.type == "line"]
    assert [shape.x0 for shape in lines] == [pytest.approx(9.2)]


@pytest.mark.parametrize(("factor", "meta", "unit", "scale"), [
    (1.0, {}, "ms", 1e3),  # a 9.2 ms step
    (1e3 / 2, {}, "ms", 1e3),  # 4.6 s: ms below 10 s (schedules.units)
    (2e3, {}, "s", 1.0),  # 18.4 s
    (1e-2, {}, "ms", 1e3),  # 92 µs, as 0.092 ms
    (1e3, {"time_unit": "units"}, "units", 1.0),  # unit costs: F = 1, B = 2 -> 9.2 units
])
def test_times_in_the_unit_that_fits(factor, meta, unit, scale):
    trace = scaled(two_rank_step(), factor, **meta)
    fig = gantt_figure([trace])
    assert fig.layout.xaxis.title.text == f"time since step start ({unit})"
    forward = layer(fig, "F forward")
    first = next(e for e in trace.events if e.action == "0F1")
    index = [row[0] for row in forward.customdata].index("0F1")
    assert forward.base[index] == pytest.approx(first.start * scale, rel=1e-6)
    assert forward.x[index] == pytest.approx(first.duration * scale, rel=1e-6)
    title = fig.layout.annotations[0].text
    assert f"makespan {number(9.2e-3 * factor * scale)} {unit}" in title
    assert f"duration %{{customdata[6]:.3f}} {unit}" in forward.hovertemplate
    if unit == "units":
        assert " ms" not in title


def test_title_names_schedule_shape_parallelism_model_and_topology():
    trace = two_rank_step()
    trace.meta.update(virtual_stages=2, dp=2, tp=4, model="gpt3-13b", topology="ib")
    title = gantt_figure([trace], titles=["predicted"]).layout.annotations[0].text
    assert title.startswith("<b>predicted</b>")
    for part in ("gpipe", "pp=2 m=2 v=2", "dp=2 tp=4", "model gpt3-13b", "on ib"):
        assert part in title
    assert "<br>makespan 9.2 ms" in title  # the metrics on their own line
    measured = two_rank_step(source="measured")
    measured.meta.update(backend="gloo", dp=1, tp=1)
    assert "· on gloo" in gantt_figure([measured]).layout.annotations[0].text


def test_simulated_trace_meta_carries_dp_tp_and_the_cli_adds_the_model(tmp_path):
    result = api.simulate(api.schedule("1f1b", pp=2, microbatches=2), dp=2, tp=2, topology="nvlink")
    assert (result.trace.meta["dp"], result.trace.meta["tp"]) == (2, 2)
    from pipesim.cli import main

    out = tmp_path / "t.json"
    assert main(["simulate", "--pp", "2", "--microbatches", "2", "--model", "gpt3-1.3b", "--topology", "nvlink",
                 "--trace", str(out)]) == 0
    assert Trace.load(out).meta["model"] == "gpt3-1.3b"


def test_show_draws_unit_costs_in_units(tmp_path):
    from pipesim.cli import main

    out = tmp_path / "show.html"
    assert main(["show", "--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--html", str(out),
                 "--plotly", "cdn"]) == 0
    html = out.read_text(encoding="utf-8")
    # 1F1B, pp=2, m=2 with F = 1, B = 2: (m + p - 1)(F + B) = 9 units
    assert "time since step start (units)" in html and "makespan 9 units" in html
    assert "9,000 ms" not in html


# -- Gantt: step-level parts in the rank's own lane ---------------------------------------


def test_tp_dp_optimizer_and_waits_sit_in_the_compute_lane():
    trace = two_rank_step()
    ms = 1e-3
    trace.events += [
        TraceEvent(1, "TP(1F0)", "TP", 1, 0, 2.1 * ms, 2.2 * ms, "tp"),
        TraceEvent(0, "0ALLREDUCE_DP", "ALLREDUCE_DP", 0, -1, 9.2 * ms, 9.6 * ms, "dp"),
        TraceEvent(0, "OPTIMIZER", "OPTIMIZER", -1, -1, 9.6 * ms, 9.9 * ms, "step"),
        TraceEvent(1, "1SEND_B0", "SEND_B", 1, 0, 7.2 * ms, 7.5 * ms, "wait"),
    ]
    fig = gantt_figure([trace])
    order = [t.name for t in fig.data]
    for stream in ("tp", "dp", "step"):
        drawn = layer(fig, STEP_STREAM_STYLES[stream][0])
        assert all(y == pytest.approx(round(y)) for y in drawn.y)  # centred on its rank's row
        assert drawn.width == pytest.approx(COMPUTE_LANE[1])
        assert drawn.marker.color == STEP_STREAM_STYLES[stream][1]
    # the all-reduce is drawn under compute (what shows is what compute did not hide)
    assert order.index(STEP_STREAM_STYLES["dp"][0]) < order.index("F forward")
    assert order.index(STEP_STREAM_STYLES["tp"][0]) > order.index("B backward")
    # parts of no microbatch do not hover "microbatch -1"
    assert "microbatch" not in layer(fig, STEP_STREAM_STYLES["dp"][0]).hovertemplate
    assert "microbatch" in layer(fig, STEP_STREAM_STYLES["tp"][0]).hovertemplate
    # the end-of-step wait (7.2 to 7.5 ms on rank 1) is drawn in rank 1's compute lane,
    # in its bubble and exposed-communication pieces, which together cover it
    pieces = [(t.base[i], t.x[i], t.y[i]) for t in fig.data if t.name in (BUBBLE, EXPOSED)
              for i, row in enumerate(t.customdata) if row[0] == "1SEND_B0"]
    assert pieces and all(y == pytest.approx(1 + COMPUTE_LANE[0]) for _, _, y in pieces)
    assert min(base for base, _, _ in pieces) == pytest.approx(7.2)
    assert sum(width for _, width, _ in pieces) == pytest.approx(0.3)


def test_zero_3_collectives_that_held_the_rank_are_drawn_over_its_compute():
    # a measured gloo run's FSDP2 gather inside the forward it serves held the rank there
    # (the run says so: dp_held_inside_actions): drawn over the F bar, as tp's are; the
    # same event in a simulated trace (prefetched beside the compute) stays beneath it
    ms = 1e-3
    gather = TraceEvent(0, "0ALLGATHER_PARAMS[L1](0F0)", "ALLGATHER_PARAMS", 0, 0, 0.2 * ms, 0.5 * ms, "dp")
    bucket = TraceEvent(0, "0REDUCE_SCATTER_DP[0]", "REDUCE_SCATTER_DP", 0, -1, 9.2 * ms, 9.6 * ms, "dp")
    for held, over in ((True, True), (False, False)):
        trace = two_rank_step()
        trace.meta = {**trace.meta, "source": "measured", "dp_held_inside_actions": held}
        trace.events += [gather, bucket]
        order = [drawn.name for drawn in gantt_figure([trace]).data]
        if over:
            assert order.index(HELD_DP_LABEL) > order.index("B backward")
            drawn = layer(gantt_figure([trace]), HELD_DP_LABEL)
            assert list(drawn.x) == [pytest.approx(0.3)] and list(drawn.base) == [pytest.approx(0.2)]
            # the step's bucket serves no action: beneath the compute, as before
            assert order.index(dp_label({"REDUCE_SCATTER_DP"})) < order.index("F forward")
        else:
            assert HELD_DP_LABEL not in order
            assert order.index(dp_label({"ALLGATHER_PARAMS", "REDUCE_SCATTER_DP"})) < order.index("F forward")


# -- Gantt: large schedules ------------------------------------------------------------


def test_webgl_keeps_colours_and_stripes():
    schedule = api.schedule("interleaved-1f1b", pp=2, microbatches=4, virtual_stages=2)
    trace = api.simulate(schedule, topology="nvlink").trace
    svg = {t.name: t for t in gantt_figure([trace]).data}
    gl = {t.name: t for t in gantt_figure([trace], bar_limit=5).data}
    assert {t.type for t in gl.values()} == {"scattergl"}
    assert set(gl) == set(svg)
    for name, drawn in gl.items():
        assert drawn.line.color == svg[name].marker.color
    assert gl["F forward · chunk 1"].line.dash == "dash" and gl["F forward · chunk 0"].line.dash == "solid"
    assert gl[BUBBLE].line.dash == "dot" and gl[EXPOSED].line.dash == "solid"
    assert gl[BUBBLE].line.color != gl[EXPOSED].line.color


def test_the_time_axis_is_on_top_of_a_64_rank_chart():
    events = [event(rank, f"{rank}F0", rank * 1e-3, (rank + 1) * 1e-3) for rank in range(64)]
    tall = gantt_figure([Trace(events, {"pp": 64})])
    assert tall.layout.xaxis.side == "top" and tall.layout.xaxis.showticklabels
    assert tall.layout.xaxis.title.text == "time since step start (ms)"
    assert tall.layout.annotations[0].yshift > 0  # the title sits above the axis labels
    small = gantt_figure([two_rank_step()])
    assert small.layout.xaxis.side != "top"


# -- compare: measured sends and one set of numbers ---------------------------------------


def measured_step() -> Trace:
    """A measured 2-rank step whose send stamps come late (the executor polls them)."""
    ms = 1e-3
    events = [
        event(0, "0F0", 0.0, 0.1 * ms),
        event(0, "0SEND_F0", 0.1 * ms, 3.7 * ms, "send"),  # stamped late
        event(1, "1RECV_F0", 0.0, 0.4 * ms, "recv"),  # ... but the data was there at 0.4 ms
        event(1, "1F0", 0.4 * ms, 0.5 * ms),
        event(1, "1B0", 0.5 * ms, 0.7 * ms),
        event(1, "1SEND_B0", 0.7 * ms, 6.5 * ms, "send"),  # drained at the end of the step
        event(0, "0RECV_B0", 0.1 * ms, 0.65 * ms, "recv"),  # ended before 0.7: the clocks differ
        event(0, "0B0", 0.8 * ms, 1.0 * ms),
    ]
    return Trace(events, {"pp": 2, "schedule": "gpipe", "microbatches": 1, "source": "measured"})


def test_measured_sends_end_when_their_receiver_had_the_data():
    drawn = as_transfers(measured_step())
    by_key = {(e.action, e.stream): e for e in drawn.events}
    assert by_key["0SEND_F0", "send"].end == pytest.approx(0.4e-3)
    assert by_key["1SEND_B0", "send"].end == pytest.approx(0.7e-3)  # an instant: arrival precedes posting
    # rank 1 stayed in the step until 6.5 ms only to see its send complete: an end-of-step wait
    wait = by_key["1SEND_B0", "wait"]
    assert (wait.rank, wait.start, wait.end) == (1, pytest.approx(0.7e-3), pytest.approx(6.5e-3))
    assert max(e.end for e in drawn.events) == pytest.approx(6.5e-3)  # the step keeps its length
    predicted = two_rank_step()
    assert as_transfers(predicted) is predicted


def test_measured_send_bars_in_the_chart_are_transfers():
    fig = gantt_figure([measured_step()])
    send = layer(fig, STREAM_LABELS["send"])
    durations = {row[0]: row[6] for row in send.customdata}
    assert durations == {"0SEND_F0": pytest.approx(0.3), "1SEND_B0": pytest.approx(0.0)}


def test_compare_chart_and_terminal_print_the_same_numbers():
    measured = measured_step()
    predicted = scaled(two_rank_step(), 0.5)
    step_times = [0.020, 0.008, 0.007, 0.009]
    document = compare(measured, step_times, predicted, 4.6e-3, warmup_steps=1)
    terminal = "\n".join(report_lines(document))
    measured_line, predicted_line = chart_summaries(document, drawn_step=3, drawn_span=6.5e-3)
    # by hand: median of 8, 7, 9 ms = 8 ms; busy 0.1 + 0.2 (rank 0) and 0.1 + 0.2 (rank 1) ms
    # of the drawn (last) step, whose own time is 9 ms
    assert "8.00 ms" in measured_line and "median of 3 steps" in measured_line
    assert "drawn: step 3, its actions 6.5 ms long" in measured_line  # the drawn bars' own length, said apart
    assert f"idle {1 - 0.6e-3 / (2 * 9e-3):.1%} (of the drawn step's 9.00 ms)" in measured_line  # 96.7%
    for line in (measured_line.replace(", its actions 6.5 ms long", ""), predicted_line):
        for figure in re.findall(r"[-+]?\d+\.\d+%?", line):
            assert figure in terminal, (figure, terminal)
    fig = gantt_figure([measured, predicted], titles=["measured", "predicted"],
                       summaries=[measured_line, predicted_line])
    titles = [a.text for a in fig.layout.annotations if a.text and a.text.startswith("<b>")]
    assert titles[0].endswith(measured_line) and titles[1].endswith(predicted_line)
    assert "makespan" not in titles[0]


# -- sweep -----------------------------------------------------------------------------


def sweep_rows(memory: bool = True) -> list[dict]:
    """pp=4, F + B = 3 ms: GPipe and 1F1B tie on time, (m + 3) * 3 ms; GPipe stashes m
    microbatches of 10 GB on 1 GB of weights, 1F1B at most 4; the device holds 80 GB."""
    rows = []
    for schedule in ("gpipe", "1f1b"):
        for m in (4, 8, 16):
            inflight = m if schedule == "gpipe" else 4
            row = {"schedule": schedule, "microbatches": m, "virtual_stages": 1, "pp": 4,
                   "makespan": (m + 3) * 3e-3, "bubble_fraction": 3 / (m + 3), "peak_inflight_microbatches": inflight}
            if memory:
                peak = 1e9 + inflight * 10e9
                row.update(peak_memory_bytes=peak, oom=peak > 80e9, capacity_bytes=80e9)
            rows.append(row)
    return rows


def test_tied_series_stay_visible():
    fig = sweep_figure(sweep_rows())
    gpipe, one_f = (next(t for t in fig.data if t.name == name and t.xaxis == "x") for name in ("gpipe", "1f1b"))
    assert list(gpipe.y) == pytest.approx(list(one_f.y))  # the same step times ...
    assert all(a != b for a, b in zip(gpipe.x, one_f.x, strict=True))  # ... drawn side by side
    assert gpipe.marker.symbol != one_f.marker.symbol
    assert list(gpipe.customdata) == list(one_f.customdata) == [4, 8, 16]


def test_memory_panel_with_capacity_line_and_oom_marks():
    fig = sweep_figure(sweep_rows())
    titles = [a.text for a in fig.layout.annotations]
    assert "peak memory per GPU, GB (max over ranks)" in titles
    memory_axis = next(t.xaxis for t in fig.data if t.name == "gpipe" and t.y[-1] == pytest.approx(161.0))
    oom = next(t for t in fig.data if t.name == OOM_NAME)
    # only GPipe at m=8 (81 GB) and m=16 (161 GB) exceed 80 GB
    assert list(oom.customdata) == [8, 16] and list(oom.y) == pytest.approx([81.0, 161.0])
    assert oom.xaxis == memory_axis and oom.showlegend
    capacity = [s for s in fig.layout.shapes if s.type == "line" and s.y0 == s.y1]
    assert [s.y0 for s in capacity] == [pytest.approx(80.0)]
    assert capacity[0].xref == memory_axis + " domain" or capacity[0].xref.startswith(memory_axis)
    assert any(a.text == "device capacity 80.0 GB (usable limit not given)" for a in fig.layout.annotations)


def test_memory_panel_draws_the_usable_limit_judged_against_and_the_capacity():
    rows = sweep_rows()
    for row in rows:  # 80 GB less a 10% headroom: judged against 72 GB
        row.update(usable_bytes=72e9, memory_headroom="10%", oom=row["peak_memory_bytes"] > 72e9)
    fig = sweep_figure(rows)
    lines = sorted(s.y0 for s in fig.layout.shapes if s.type == "line" and s.y0 == s.y1)
    assert lines == [pytest.approx(72.0), pytest.approx(80.0)]
    labels = {a.text for a in fig.layout.annotations}
    assert "usable limit 72.0 GB (capacity less 10% headroom): above it, out of memory" in labels
    assert "device capacity 80.0 GB" in labels
    oom = next(t for t in fig.data if t.name == OOM_NAME)
    assert min(oom.y) > 72.0  # every ✕ above the drawn limit, none below it


def test_no_memory_panel_without_memory_columns():
    fig = sweep_figure(sweep_rows(memory=False))
    assert not any("peak memory" in (a.text or "") for a in fig.layout.annotations)
    assert not any(t.name == OOM_NAME for t in fig.data)
    # no empty cell: every subplot of the grid holds lines (four panels, in-flight across the lower row)
    axes = {key for key in fig.layout.to_plotly_json() if key.startswith("xaxis")}
    drawn = {"xaxis" + t.xaxis[1:] for t in fig.data}
    assert axes == drawn and len(axes) == 4


def test_throughput_beside_step_time():
    rows = sweep_rows()
    fig = sweep_figure(rows)
    assert "throughput (microbatches/s)" in [a.text for a in fig.layout.annotations]
    rate = next(t for t in fig.data if t.name == "gpipe" and t.xaxis == "x2")
    assert list(rate.y) == pytest.approx([m / ((m + 3) * 3e-3) for m in (4, 8, 16)])
    for row in rows:
        row["tokens_per_microbatch"] = 2048
    fig = sweep_figure(rows)
    assert "throughput (tokens/s)" in [a.text for a in fig.layout.annotations]
    rate = next(t for t in fig.data if t.name == "gpipe" and t.xaxis == "x2")
    assert rate.y[0] == pytest.approx(2048 * 4 / (7 * 3e-3))


def test_sweep_step_time_in_seconds_for_long_steps():
    rows = [dict(row, makespan=row["makespan"] * 1000) for row in sweep_rows()]  # up to 57 s: s from 10 s
    fig = sweep_figure(rows)
    assert "step time (s)" in [a.text for a in fig.layout.annotations]
    assert next(t for t in fig.data if t.name == "gpipe").y[0] == pytest.approx(7 * 3)


def test_sweep_rows_carry_capacity():
    from pipesim.cluster.files import load_topology
    from pipesim.model.costs import uniform_costs
    from pipesim.plan.sweep import run_sweep, sweep_points

    topology = load_topology("nvlink")
    rows = run_sweep(sweep_points(["1f1b"], [2], [2], 1), lambda s: uniform_costs(s, 1e-3, 2e-3), topology,
                     progress=False)
    gpus = [data["memory_bytes"] for _, data in topology.graph.nodes(data=True) if data.get("kind") == "gpu"]
    assert rows[0]["capacity_bytes"] == pytest.approx(min(gpus))


# -- topology ----------------------------------------------------------------------------


def test_topology_groups_machines_and_places_switches_over_their_gpus():
    from pipesim.cluster.files import load_topology

    nodes, edges = graph_lists(load_topology("ib", 2))
    where = positions(nodes, edges)
    n0 = [where[n["name"]][0] for n in nodes if n["name"].startswith("n0.")]
    n1 = [where[n["name"]][0] for n in nodes if n["name"].startswith("n1.")]
    assert max(n0) < min(n1)  # one machine, then the other
    gpus = [f"n0.gpu{i}" for i in range(8)]
    assert where["n0.nvswitch"][0] == pytest.approx(sum(where[g][0] for g in gpus) / 8)
    for i in range(8):
        assert where[f"n0.nic{i}"][0] == pytest.approx(where[f"n0.gpu{i}"][0])  # a NIC over its GPU
    assert where["n0.gpu0"][1] < where["n0.nvswitch"][1] < where["n0.nic0"][1] < where["ib_switch"][1]
    for tier in {y for _, y in where.values()}:
        xs = sorted(x for x, y in where.values() if y == tier)
        assert all(b - a >= 0.9 - 1e-9 for a, b in zip(xs, xs[1:], strict=False))  # labels cannot overlap


def test_topology_figure_names_machines_and_bandwidths():
    from pipesim.cluster.files import load_topology

    nodes, edges = graph_lists(load_topology("ib", 2))
    title = "topology ib: " + "a long description " * 10
    fig = topology_figure(nodes, edges, title)
    texts = [a.text for a in fig.layout.annotations]
    assert "<b>node n0</b>" in texts and "<b>node n1</b>" in texts
    assert len([s for s in fig.layout.shapes if s.type == "rect"]) == 2
    # one written bandwidth per machine and medium, the fabric (between machines) once
    assert (texts.count("450 GB/s"), texts.count("63 GB/s"), texts.count("50 GB/s")) == (2, 2, 1)
    assert {"ib: 50 GB/s", "nvlink: 450 GB/s"} <= {t.name for t in fig.data}
    labels = [a for a in fig.layout.annotations if a.text == "gpu3"]
    assert len(labels) == 2 and all(a.bgcolor for a in labels)  # one per machine, on a white ground
    assert "<br>" in fig.layout.title.text
    assert all(len(line) <= TITLE_WIDTH for line in fig.layout.title.text.split("<br>"))


def test_sweep_with_a_model_charts_tokens_per_second(tmp_path):
    import json

    from pipesim.cli import main
    from pipesim.model.spec import model_spec

    out, page = tmp_path / "rows.json", tmp_path / "sweep.html"
    assert main(["sweep", "--schedule", "1f1b", "--pp", "2", "--microbatches", "2,4", "--model", "gpt3-1.3b",
                 "--dp", "2", "--topology", "nvlink", "--quiet", "--json", str(out), "--html", str(page),
                 "--plotly", "cdn"]) == 0
    spec = model_spec("gpt3-1.3b")
    rows = json.loads(out.read_text())
    # a step moves microbatches x dp x microbatch size x sequence length tokens
    assert all(row["tokens_per_microbatch"] == 2 * spec.microbatch_size * spec.seq_len for row in rows)
    html = page.read_text(encoding="utf-8").replace("\\u002f", "/")  # plotly escapes "/" in its JSON
    assert '"text":"throughput (tokens/s)"' in html
