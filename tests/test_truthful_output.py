"""What the command line shows is what it simulates: ``show``'s step is ``simulate``'s at
the same unit costs, split-backward schedules draw their W passes by a stated default, and
the numbers hold the closed forms of the schedules they draw."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipesim.cli import main
from pipesim.model.spec import BUNDLED_CONFIGS
from schedules.generators import MULTI_CHUNK, SCHEDULE_NAMES


def run_cli(*argv) -> int:
    return main([str(arg) for arg in argv])


def shown_step(capsys, schedule: str, *extra) -> float:
    """The step length ``show`` prints at the end of its timeline's axis."""
    assert run_cli("show", "--schedule", schedule, "--pp", 4, "-m", 8, *extra) == 0
    axis = next(line.split() for line in capsys.readouterr().out.splitlines()[::-1]
                if line.split()[:1] == ["0"] and line.endswith(" units"))
    return float(axis[-2].replace(",", ""))


def simulated_step(tmp_path, schedule: str, *extra) -> float:
    out = tmp_path / f"{schedule}.json"
    assert run_cli("simulate", "--schedule", schedule, "--pp", 4, "-m", 8, "--fwd", 1, "--bwd", 2,
                   "--json", out, *extra) == 0
    return json.loads(out.read_text())["makespan"]


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_show_draws_the_step_simulate_predicts(schedule, tmp_path, capsys):
    chunks = ("--virtual-stages", 2) if schedule in MULTI_CHUNK else ()
    assert shown_step(capsys, schedule, *chunks) == pytest.approx(simulated_step(tmp_path, schedule, *chunks))


# p = 4, m = 8, F = 1, B = 2 (split: I = W = 1). Qi et al. (their B is our I): GPipe and 1F1B
# (m + p - 1)(F + B); ZB-H1 m(F + I + W) + (p - 1)(F + I - W); interleaved 1F1B with v = 2:
# m(F + B) + (p - 1)(F + B) / v.
CLOSED_FORMS = {
    "gpipe": 11 * 3, "1f1b": 11 * 3, "zb-h1": 8 * 3 + 3 * 1,
    "interleaved-1f1b": 8 * 3 + 3 * 3 / 2,
}


@pytest.mark.parametrize("schedule", sorted(CLOSED_FORMS))
def test_show_holds_the_closed_forms(schedule, capsys):
    chunks = ("--virtual-stages", 2) if schedule in MULTI_CHUNK else ()
    assert shown_step(capsys, schedule, *chunks) == pytest.approx(CLOSED_FORMS[schedule])


def test_split_backward_default_is_stated_and_drawn(capsys):
    assert run_cli("show", "--schedule", "zb-h1", "--pp", 2, "-m", 2) == 0
    captured = capsys.readouterr()
    assert "without --wgrad W is 50% of --bwd" in captured.err
    timeline = captured.out.split("\n\n")[-1]
    assert timeline.count("W") == 4  # every W pass drawn: 2 ranks x 2 microbatches


def test_explicit_wgrad_is_taken_as_given(tmp_path, capsys):
    # W = 0: I takes the whole backward, zb-h1 runs as 1F1B (m + p - 1)(F + B) = 33
    assert simulated_step(tmp_path, "zb-h1", "--wgrad", 0) == pytest.approx(33)
    assert "without --wgrad" not in capsys.readouterr().err


# -- memory: judged on every topology, drawn at the limit judged against --------------------

def test_gpu_capacity_holds_on_the_ideal_topology(tmp_path, capsys):
    """Llama 3 8B on four H100s, GPipe holding all 16 microbatches' activations: well over
    an H100's 81559 MiB, on free links too. Rank 0 may use 82.27 GB of it by the headroom
    rule: less the CUDA context (426 MiB) and its one pipeline neighbour's NCCL buffers (32
    channels x 10 MiB), over 1.03 for fragmentation."""
    out, html = tmp_path / "r.json", tmp_path / "g.html"
    status = run_cli("simulate", "--model", "llama3-8b", "--gpu", "h100", "--pp", 4, "-m", 16, "--schedule", "gpipe",
                     "--json", out, "--html", html, "--fail-on-oom")
    assert status == 3
    captured = capsys.readouterr()
    assert "out of memory" in captured.err and "82.27 GB of it usable" in captured.err
    ranks = json.loads(out.read_text())["ranks"]
    assert [rank["memory"]["capacity_bytes"] for rank in ranks] == [81559 * 2**20] * 4
    assert all(rank["memory"]["oom"] for rank in ranks)
    page = html.read_text(encoding="utf-8")
    assert "out of memory: ranks 0, 1, 2, 3 (peak " in page and "82.3 GB usable" in page  # rank 3, the fullest


def test_ideal_topology_without_gpu_stays_unbounded(tmp_path):
    out = tmp_path / "r.json"
    assert run_cli("simulate", "--model", "llama3-8b", "--pp", 4, "-m", 16, "--schedule", "gpipe", "--json", out) == 0
    assert all(rank["memory"]["capacity_bytes"] is None for rank in json.loads(out.read_text())["ranks"])


def test_gantt_marks_only_the_ranks_out_of_memory():
    from schedules.trace import Trace, TraceEvent
    from viz.gantt import gantt_spec

    events = [TraceEvent(rank, "0F0", "F", rank, 0, 0.0, 1.0, "compute") for rank in range(3)]
    memory = [{"rank": 0, "peak_bytes": 50e9, "usable_bytes": 72e9, "capacity_bytes": 80e9, "oom": False},
              {"rank": 1, "peak_bytes": 75e9, "usable_bytes": 72e9, "capacity_bytes": 80e9, "oom": True},
              {"rank": 2, "peak_bytes": 90e9, "usable_bytes": 72e9, "capacity_bytes": 80e9, "oom": True}]
    spec = gantt_spec(Trace(events, {"memory": memory}))
    ticks = spec["layout"]["yaxis"]["ticktext"]
    assert ticks[0] == "rank 0" and all("✕ OOM" in tick for tick in ticks[1:])
    title = spec["layout"]["annotations"][0]["text"]
    assert "out of memory: ranks 1, 2 (peak 90.0 GB > 72.0 GB usable)" in title


def test_sweep_rows_carry_the_usable_limit(tmp_path):
    out = tmp_path / "rows.json"
    assert run_cli("sweep", "--model", "gpt3-1.3b", "--topology", "nvlink", "--schedule", "gpipe", "--pp", 2,
                   "-m", 2, "--memory-headroom", "6", "--quiet", "--json", out) == 0
    row = json.loads(out.read_text())[0]
    assert row["capacity_bytes"] == 81559 * 2**20 and row["usable_bytes"] == pytest.approx(81559 * 2**20 - 6e9)


# -- every moment of a rank's row labelled --------------------------------------------------

def visible_seconds(spec: dict, rank: int, axis: str = "y") -> dict[str, float]:
    """Per legend label, the time of ``rank``'s own lane (the wide middle one) that the
    label's bars show on top, painted in the chart's drawing order; '' for white."""
    from viz.lanes import COMPUTE_LANE

    bars = [(base, base + width, layer["name"]) for layer in spec["data"]
            if layer.get("yaxis", "y") == axis and layer.get("width") == COMPUTE_LANE[1]
            for y, base, width in zip(layer["y"], layer["base"], layer["x"], strict=True) if y == rank]
    step_end = max(end for trace_layer in spec["data"] if trace_layer.get("yaxis", "y") == axis
                   for end in (b + w for b, w in zip(trace_layer["base"], trace_layer["x"], strict=True)))
    moments = sorted({0.0, step_end, *(moment for bar in bars for moment in bar[:2])})
    seconds: dict[str, float] = {}
    for low, high in zip(moments, moments[1:], strict=False):
        middle = (low + high) / 2
        on_top = [label for start, end, label in bars if start <= middle < end]
        label = on_top[-1] if on_top else ""
        seconds[label] = seconds.get(label, 0.0) + high - low
    return seconds


def test_modelled_overhead_is_drawn_and_every_moment_labelled(tmp_path):
    from schedules.trace import Trace
    from viz.gantt import gantt_spec
    from viz.lanes import OVERHEAD_LABEL

    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"stages": [{"fwd": 1e-3, "bwd": 2e-3, "act_bytes": 1e6}],
                                 "action_overhead": 2e-4, "comm_overhead": 1e-4, "step_overhead": 5e-4}))
    trace_path, out = tmp_path / "t.json", tmp_path / "r.json"
    assert run_cli("simulate", "--costs", costs, "--pp", 2, "-m", 4, "--topology", "nvlink",
                   "--trace", trace_path, "--json", out) == 0
    result = json.loads(out.read_text())
    spec = gantt_spec(Trace.load(trace_path))
    for rank in result["ranks"]:
        seconds = visible_seconds(spec, rank["rank"])
        assert seconds.pop("", 0.0) < 1e-9  # no white (beyond the chart's rounding to 0.1 µs)
        assert sum(seconds.values()) == pytest.approx(result["makespan"] * 1e3)  # the chart is in ms
        assert rank["overhead"] > 0
        assert seconds[OVERHEAD_LABEL] == pytest.approx(rank["overhead"] * 1e3)


def test_fill_before_a_ranks_first_event_is_labelled_bubble():
    from schedules.trace import Trace, TraceEvent
    from viz.gantt import gantt_spec
    from viz.lanes import OVERHEAD_LABEL, STREAM_LABELS

    # rank 1 starts at 1 s (nothing recorded before: its fill), rank 0 has a 0.5 s gap between F and B
    events = [TraceEvent(0, "0F0", "F", 0, 0, 0.0, 1.0, "compute"),
              TraceEvent(0, "0B0", "B", 0, 0, 1.5, 3.5, "compute"),
              TraceEvent(1, "1F0", "F", 1, 0, 1.0, 2.0, "compute"),
              TraceEvent(1, "1B0", "B", 1, 0, 2.0, 3.5, "compute")]
    spec = gantt_spec(Trace(events, {}))  # a 3.5 s step, drawn in ms
    assert visible_seconds(spec, 0) == pytest.approx({"F forward": 1e3, OVERHEAD_LABEL: 500, "B backward": 2e3})
    assert visible_seconds(spec, 1) == pytest.approx({STREAM_LABELS["bubble"]: 1e3, "F forward": 1e3,
                                                      "B backward": 1.5e3})


def test_measured_gaps_are_labelled():
    """A measured 1F1B step (pp 2, m 4, gloo; ``pipesim run --pp 2 -m 4 --trace``): the
    executor's time between actions is drawn as overhead, and no moment is white."""
    from pathlib import Path

    from schedules.accounting import time_accounting
    from schedules.metrics import makespan
    from schedules.trace import Trace
    from viz.gantt import gantt_spec
    from viz.lanes import OVERHEAD_LABEL

    trace = Trace.load(Path(__file__).parent / "data" / "measured_1f1b_pp2_gloo.json")
    spec = gantt_spec(trace)
    for rank, accounted in enumerate(time_accounting(trace)):
        seconds = visible_seconds(spec, rank)
        assert seconds.pop("", 0.0) < 1e-9
        assert sum(seconds.values()) == pytest.approx(makespan(trace) * 1e3, abs=1e-4)  # drawn to 0.1 µs
        assert seconds[OVERHEAD_LABEL] > 0.1 * sum(seconds.values())  # gloo's host time is no small share
        assert seconds[OVERHEAD_LABEL] == pytest.approx(accounted.overhead * 1e3, abs=0.01)


@pytest.mark.parametrize("argv", [
    ("--schedule", "zbv", "--pp", 2, "-m", 4, "--model", "gpt3-1.3b", "--topology", "nvlink", "--dp", 2, "--tp", 2),
    ("--schedule", "interleaved-1f1b", "--pp", 2, "-m", 4, "--model", "gpt3-1.3b", "--topology", "ib", "--nodes", 2,
     "--dp", 2, "--zero", 3, "--no-dp-overlap"),
    ("--schedule", "1f1b", "--pp", 2, "-m", 4, "--model", "mixtral-8x7b", "--seq-len", 4096, "--topology", "nvlink",
     "--dp", 2, "--ep", 2, "--cp", 2),
])
def test_predicted_step_parts_fill_every_rank(argv, tmp_path):
    from schedules.trace import Trace
    from viz.colors import STEP_STREAM_STYLES
    from viz.gantt import gantt_spec

    trace_path, out = tmp_path / "t.json", tmp_path / "r.json"
    assert run_cli("simulate", *argv, "--trace", trace_path, "--json", out) == 0
    result = json.loads(out.read_text())
    trace = Trace.load(trace_path)
    spec = gantt_spec(trace)
    scale = {"s": 1.0, "ms": 1e3, "µs": 1e6}[spec["layout"]["xaxis"]["title"]["text"].split("(")[-1][:-1]]
    for rank in result["ranks"]:
        seconds = visible_seconds(spec, rank["rank"])
        assert seconds.pop("", 0.0) < 1e-9 * scale
        assert sum(seconds.values()) == pytest.approx(result["makespan"] * scale)
        for part in ("tp", "ep", "cp", "optimizer"):  # each part the step has, in a lane of its own, named
            if rank[part]:
                label = STEP_STREAM_STYLES["step" if part == "optimizer" else part][0]
                assert seconds[label] > 0, (part, seconds)


# -- defaults that show the thing -------------------------------------------------------------

def test_placement_is_printed_and_drawn_and_empty_transfers_hinted(tmp_path, capsys):
    from schedules.trace import Trace
    from viz.gantt import gantt_spec

    trace_path = tmp_path / "t.json"
    assert run_cli("simulate", "--topology", "ib", "--nodes", 2, "--pp", 8, "--trace", trace_path) == 0
    captured = capsys.readouterr()
    # 8 pipeline ranks, rank order tp-dp-pp with dp = tp = 1: all on the first node's 8 GPUs
    assert "placed: n0 gpu0 gpu1 gpu2 gpu3 gpu4 gpu5 gpu6 gpu7 <- ranks 0-7" in captured.out
    assert "transfers carry no bytes (--act-bytes 0)" in captured.err
    ticks = gantt_spec(Trace.load(trace_path))["layout"]["yaxis"]["ticktext"]
    assert ticks[0].startswith("rank 0<br>") and "n0.gpu0" in ticks[0] and "n0.gpu7" in ticks[7]
    assert run_cli("simulate", "--topology", "ib", "--nodes", 2, "--pp", 8, "--dp", 2) == 0
    assert "n0 gpu0 gpu2 gpu4 gpu6 <- ranks 0-3; n1 gpu0 gpu2 gpu4 gpu6 <- ranks 4-7" in capsys.readouterr().out


def test_no_hint_where_transfers_carry_bytes_or_links_are_free(capsys):
    assert run_cli("simulate", "--topology", "ib", "--nodes", 2, "--pp", 2, "--act-bytes", 1e6) == 0
    assert run_cli("simulate", "--pp", 2) == 0
    captured = capsys.readouterr()
    assert "carry no bytes" not in captured.err and captured.out.count("placed:") == 1
    # one pipeline rank sends nothing to another: no bytes is the truth, not a default to hint at
    assert run_cli("simulate", "--topology", "ib", "--nodes", 2, "--pp", 1, "--dp", 16) == 0
    assert "carry no bytes" not in capsys.readouterr().err


# -- text: one unit rule, tables that say something, a legible timeline --------------------

def test_text_timeline_tells_chunks_apart_and_names_its_unit(capsys):
    assert run_cli("show", "--schedule", "interleaved-1f1b", "--pp", 2, "-m", 2, "-v", 2, "--width", 200) == 0
    lines = capsys.readouterr().out.rstrip().splitlines()
    rank0 = next(line for line in lines[::-1] if line.startswith("rank 0:"))
    # interleaved 1F1B, p = 2, m = 2, v = 2: rank 0 runs chunk 0's F0 F1, then chunk 1's f0 f1 first
    assert rank0.split()[2:6] == ["F0", "F1", "f0", "f1"]
    assert lines[-2].split()[-2:] == ["7.5", "units"]  # m(F+B) + (p-1)(F+B)/v = 6 + 3/2 at unit costs
    assert "chunk 0 F3, chunk 1 f3" in lines[-1]


def test_units_rule():
    from schedules.units import count, duration, number, percent, size

    assert duration(3.5329) == "3,533 ms" and duration(27.5) == "27.5 s" and duration(0.01733e-3) == "0.01733 ms"
    assert duration(9.999) == "9,999 ms" and duration(10.0) == "10 s"
    assert percent(0.27272) == "27.3%" and count(385_400.4) == "385,400" and number(1234.5) == "1,234"
    assert size(1.049e6) == "1.049 MB" and size(230.13e9) == "230.1 GB" and size(12.288e9) == "12.29 GB"


def test_simulate_prints_no_all_zero_table(capsys):
    assert run_cli("simulate", "--pp", 2, "-m", 4) == 0
    out = capsys.readouterr().out
    assert "0/0" not in out and "collectives" not in out and "memory           n/a" in out
    assert run_cli("simulate", "--model", "gpt3-1.3b", "--pp", 2, "-m", 4, "--dp", 2, "--topology", "nvlink") == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.split()[:1] == ["rank"] and "peak mem" in line)
    assert header.split()[1] == "dp" and "tp" not in header.split()  # the collectives this step has


# -- bad input: one clear line, at once ------------------------------------------------------

def one_line_error(capsys, *argv) -> str:
    """The command's stderr, which must be one error line (no usage), exit status 2."""
    assert run_cli(*argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "usage:" not in err[0], err
    return err[0]


def test_capacity_factor_below_one_says_it_drops_tokens_and_mfu_stays_physical(tmp_path, capsys):
    for factor in (0.25, 0.01):
        out = tmp_path / f"{factor}.json"
        assert run_cli("simulate", "--model", "mixtral-8x7b", "--pp", 4, "-m", 8, "--gpu", "h100",
                       "--capacity-factor", factor, "--json", out) == 0
        assert 0 < json.loads(out.read_text())["mfu"] <= 1.0
        assert f"drops at least {1 - factor:.1%} of the routed token copies" in capsys.readouterr().err


def test_computed_routed_slots_stop_at_the_capacity():
    from pipesim.model.spec import model_spec

    spec = model_spec("mixtral-8x7b")  # top 2 of 8 experts
    assert spec.with_capacity_factor(0.25).moe.routed_slots(padded=False) == pytest.approx(2 * 0.25)
    assert spec.with_capacity_factor(1.25).moe.routed_slots(padded=False) == pytest.approx(2.0)  # padding is no work
    assert spec.with_capacity_factor(1.25).moe.routed_slots() == pytest.approx(2.5)  # ... but takes the time


def test_huge_layer_counts_are_refused_before_work(tmp_path, capsys):
    import time

    config = json.loads((BUNDLED_CONFIGS / "llama-3.1-8b.json").read_text())
    config["num_hidden_layers"] = 10**9
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    started = time.monotonic()
    line = one_line_error(capsys, "simulate", "--model", path, "--pp", 4)
    assert "num_hidden_layers must be at most 100,000, got 1,000,000,000" in line
    assert "layers must be at most 100,000" in one_line_error(capsys, "simulate", "--model", "llama3-8b",
                                                              "--layers", 10**9)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("command", [["simulate", "--model", "{fifo}"], ["draw", "{fifo}", "--html", "{out}"]])
def test_special_files_are_refused_not_waited_on(command, tmp_path):
    import os
    import subprocess
    import sys

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    argv = [arg.format(fifo=fifo, out=tmp_path / "g.html") for arg in command]
    done = subprocess.run([sys.executable, "-m", "pipesim", *argv], capture_output=True, text=True, timeout=5,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert done.returncode == 2
    assert done.stderr.strip() == f"pipesim {argv[0]}: error: {fifo} is not a regular file (a pipe, device or " \
                                  f"socket); expected a " + ("model config (config.json)" if argv[0] == "simulate"
                                                             else "trace (pipesim Trace JSON)")


def test_overflowing_costs_negative_values_and_bad_lists_get_one_line(capsys):
    assert "--fwd 1e+308 is beyond what a step can cost" in one_line_error(capsys, "simulate", "--fwd", "1e308")
    assert one_line_error(capsys, "simulate", "--bwd", "-2e-3") == \
        "pipesim simulate: error: --bwd must be a finite number >= 0, got -0.002"
    assert one_line_error(capsys, "sweep", "--pp", "4,-2", "--quiet") == \
        "pipesim sweep: error: --pp 4,-2: -2 is not a whole number >= 1"
    assert "--microbatches 8,0: 0 is not" in one_line_error(capsys, "sweep", "-m", "8,0", "--quiet")


def test_csv_error_names_the_stage_that_differs(tmp_path, capsys):
    path = tmp_path / "odd.csv"  # stages 0 and 2 run microbatches 0, 1; stage 1 also a third
    path.write_text("0F0,0F1,0B0,0B1\n1F0,1F1,1F2,1B0,1B1,1B2\n2F0,2B0,2F1,2B1\n")
    line = one_line_error(capsys, "simulate", "--schedule-file", path)
    assert "stage 1 differs from the other 2 stages, which hold microbatches 0, 1: 1F2 (not on the others)" in line


def test_json_is_written_before_stdout_can_break(tmp_path, monkeypatch):
    import io
    import sys

    class GoneReader(io.StringIO):
        def write(self, text):
            raise BrokenPipeError

    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "stdout", GoneReader())
    plan = ["plan", "--model", "gpt3-1.3b", "--gpus", 8, "--global-batch", 16, "--topology", "nvlink",
            "--schedules", "1f1b", "--constraint", "pp=2", "--top", 1, "--workers", 1, "--quiet", "--json", out]
    for argv in (["simulate", "--pp", 2, "-m", 2, "--json", out], ["sweep", "--pp", 2, "-m", 2, "--json", out],
                 plan):
        out.unlink(missing_ok=True)
        assert run_cli(*argv) != 0 and json.loads(out.read_text())


# -- the memory panel --------------------------------------------------------------------------

@pytest.mark.parametrize(("extra", "optimizer_per_weight"), [((), 6.0), (("--dp", 2, "--zero", 1), 3.0)])
def test_memory_parts_follow_the_bytes_per_parameter(extra, optimizer_per_weight, tmp_path):
    """Default 2,2,12 bytes per parameter: gradients as large as the weights, the optimizer
    state six times them, halved by ZeRO-1 over dp 2; with the buffers and the activations
    at their highest the parts give the rank's peak."""
    from schedules.trace import Trace

    trace_path = tmp_path / "t.json"
    assert run_cli("simulate", "--model", "gpt3-1.3b", "--pp", 2, "-m", 4, "--topology", "nvlink", *extra,
                   "--trace", trace_path) == 0
    for rank in Trace.load(trace_path).meta["memory"]:
        parts = rank["parts"]
        assert parts["gradients"] == pytest.approx(parts["weights"])
        assert parts["optimizer state"] == pytest.approx(optimizer_per_weight * parts["weights"])
        highest = max(value for _, value in rank["activations"])
        assert sum(parts.values()) + highest == pytest.approx(rank["peak_bytes"])


def test_memory_panel_draws_parts_peak_limit_and_capacity(tmp_path):
    from schedules.trace import Trace
    from viz.memory import memory_figure

    trace_path, page = tmp_path / "t.json", tmp_path / "g.html"
    assert run_cli("simulate", "--model", "llama3-8b", "--gpu", "h100", "--pp", 4, "-m", 16, "--schedule", "gpipe",
                   "--trace", trace_path, "--html", page) == 0
    trace = Trace.load(trace_path)
    figure = memory_figure(trace, "ms", 1e3)
    assert {t.name for t in figure.data} >= {"weights", "gradients", "optimizer state", "buffers",
                                             "activations kept for the backward", "peak"}
    peaks = [t for t in figure.data if t.name == "peak"]
    assert [p.y[0] * 1e9 for p in peaks] == pytest.approx([rank["peak_bytes"] for rank in trace.meta["memory"]])
    lines = sorted({round(shape.y0, 6) for shape in figure.layout.shapes})
    # the usable limits by the headroom rule (a middle rank has two pipeline neighbours, an end
    # one: 32 channels x 10 MiB of NCCL buffers each), and the H100's capacity, 81559 MiB
    mib = 2**20
    assert lines == pytest.approx([(81559 - 426 - 640) * mib / 1.03e9, (81559 - 426 - 320) * mib / 1.03e9,
                                   81559 * mib / 1e9], abs=1e-6)
    assert all("out of memory" in annotation.text for annotation in figure.layout.annotations[:4])
    assert "memory over the step" in page.read_text(encoding="utf-8")


def test_thinned_timeline_keeps_the_peak():
    from pipesim.cli.chart_data import thinned

    points = [(float(time), float(time % 97)) for time in range(10_000)]
    kept = thinned(points, limit=100)
    assert len(kept) <= 100 and max(value for _, value in kept) == 96.0 and kept[0] == [0.0, 0.0]


def test_show_takes_the_split_it_says_it_can(capsys):
    # zb-h1 with W = 0: I takes the whole backward and the step is 1F1B's (m + p - 1)(F + B) = 33
    assert shown_step(capsys, "zb-h1", "--wgrad", 0) == pytest.approx(33)


def test_sweep_splits_each_schedule_as_simulate_does(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert run_cli("sweep", "--schedule", "1f1b,zb-h1", "--pp", 4, "-m", 8, "--fwd", 1, "--bwd", 2, "--quiet",
                   "--json", out) == 0
    steps = {row["schedule"]: row["makespan"] for row in json.loads(out.read_text())}
    assert steps == pytest.approx({"1f1b": 33.0, "zb-h1": 27.0})  # the closed forms, as show and simulate give
    err = capsys.readouterr().err
    assert "zb-h1 splits the backward" in err and "1f1b splits" not in err


def test_sweep_table_writes_times_in_one_unit_and_keeps_whole_reasons():
    """Steps of 33 ms and 25.5 ms read in ms (below 10 s), the bubble a percentage; a point
    that failed keeps every word of its reason (it was cut at 60 characters)."""
    from pipesim.plan.sweep import format_table

    point = {"pp": 4, "microbatches": 8, "virtual_stages": 1}
    reason = ("interleaved-1f1b needs the microbatch count to be a multiple of pp: 6 is not a multiple of 4, "
              "use 4, 8 or 12")
    rows = [{**point, "schedule": "1f1b", "makespan": 0.033, "bubble_fraction": 0.2727,
             "peak_inflight_microbatches": 4, "peak_memory_bytes": None, "oom": False},
            {**point, "schedule": "zbv", "makespan": 0.0255, "bubble_fraction": 0.0588,
             "peak_inflight_microbatches": 4, "peak_memory_bytes": None, "oom": False},
            {**point, "schedule": "interleaved-1f1b", "note": reason}]
    table = format_table(rows)
    assert "step time (ms)" in table.splitlines()[0]
    assert " 33 " in table and " 25.5 " in table and "27.3%" in table and "5.9%" in table
    assert " ".join(table.split()).count(" ".join(reason.split())) == 1
