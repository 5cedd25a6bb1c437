"""The measured memory panel under ``pipesim run --html``'s Gantt (``viz.measured_memory``):
per rank, the measured peak stacked from its parts, the predicted peak beside it with the
error in its hover, the allocator's peak alone on a GPU; the run's memory rows turned into
the Trace's ``meta["memory"]`` (``pipesim.cli.chart_data.measured_memory_meta``). Expected
heights are the hand-made rows' bytes over 2**20 (MiB), or 1e9 (GB) past a gigabyte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.cli.chart_data import measured_memory_meta
from schedules.trace import Trace, TraceEvent
from viz.gantt import write_gantt_html
from viz.measured_memory import has_measured_memory, measured_memory_figure
from viz.memory import ACTIVATION_COLOR, PART_COLORS, has_memory_timeline

MIB = 2**20
PARTS = ("weights", "gradients", "optimizer state", "buffers", "activations")


def run_row(rank: int, params: float, grads: float, optimizer: float, activations: float, buffers: float,
            predicted: float | None = None) -> dict:
    """One row of ``pipesim run --json``'s ``memory`` as the executor writes it (CPU)."""
    row = {"rank": rank, "source": "tracked", "peak": params + grads + optimizer + activations + buffers,
           "params": params, "grads": grads, "optimizer": optimizer, "activations": activations,
           "buffers": buffers, "activations_peak": activations, "static": params + grads + optimizer,
           "unsharded_params": params}
    if predicted is not None:
        row.update(predicted_peak=predicted, predicted_activations=activations * 0.9,
                   predicted_static=params + grads + optimizer)
    return row


def measured_trace(rows: list[dict], why: str | None = None) -> Trace:
    events = [TraceEvent(0, "0F0", "F", 0, 0, 0.0, 1e-3, "compute"),
              TraceEvent(1, "1F0", "F", 1, 0, 1e-3, 2e-3, "compute")]
    meta = {"pp": 2, "schedule": "gpipe", "microbatches": 1, "source": "measured"}
    meta.update(measured_memory_meta(rows, why))
    return Trace(events, meta)


def bars(fig, name: str):
    return next(trace for trace in fig.data if trace.name == name)


def test_meta_carries_the_rows_parts_and_prediction_in_the_simulated_panels_shape():
    rows = [run_row(0, 1 * MIB, 1 * MIB, 2 * MIB, 3 * MIB, 0.5 * MIB, predicted=6.25 * MIB)]
    (rank,) = measured_memory_meta(rows)["memory"]
    assert rank["peak_bytes"] == 7.5 * MIB
    assert rank["parts"] == {"weights": MIB, "gradients": MIB, "optimizer state": 2 * MIB, "buffers": 0.5 * MIB}
    assert rank["activations_at_peak"] == 3 * MIB and rank["activations"] == []
    assert rank["predicted_peak_bytes"] == 6.25 * MIB and rank["predicted_static_bytes"] == 4 * MIB
    assert rank["not_predicted"] is None and rank["source"] == "tracked" and not rank["oom"]
    trace = measured_trace(rows)
    # the measured panel, not the simulated one (which needs an activations timeline)
    assert has_measured_memory(trace) and not has_memory_timeline(trace)
    assert measured_memory_meta(None) == {} and measured_memory_meta([]) == {}


def test_one_bar_per_part_per_rank_stacked_to_the_measured_peak():
    rows = [run_row(0, 1 * MIB, 1 * MIB, 2 * MIB, 3 * MIB, 0.5 * MIB, predicted=6.25 * MIB),
            run_row(1, 1.5 * MIB, 0.0, 3 * MIB, 1 * MIB, 0.25 * MIB, predicted=6.0 * MIB)]
    fig = measured_memory_figure(measured_trace(rows))
    expected = {"weights": [1.0, 1.5], "gradients": [1.0, 0.0], "optimizer state": [2.0, 3.0],
                "buffers": [0.5, 0.25], "activations": [3.0, 1.0]}
    below = [0.0, 0.0]
    for part in PARTS:  # bottom up, in the simulated panel's order and colours
        drawn = bars(fig, part)
        assert list(drawn.x) == ["rank 0", "rank 1"]
        assert list(drawn.y) == pytest.approx(expected[part])
        assert list(drawn.base) == pytest.approx(below)
        assert drawn.offsetgroup == "measured"
        assert drawn.marker.color == (ACTIVATION_COLOR if part == "activations" else PART_COLORS[part])
        below = [b + v for b, v in zip(below, expected[part], strict=True)]
    assert below == pytest.approx([7.5, 5.75])  # the measured peaks: 1+1+2+0.5+3 and 1.5+0+3+0.25+1 MiB
    assert fig.layout.yaxis.title.text == "MiB"


def test_predicted_bar_beside_at_the_predicted_peak_with_the_error_in_its_hover():
    rows = [run_row(0, 1 * MIB, 1 * MIB, 2 * MIB, 3 * MIB, 0.5 * MIB, predicted=6.25 * MIB),
            run_row(1, 1.5 * MIB, 0.0, 3 * MIB, 1 * MIB, 0.25 * MIB, predicted=6.0 * MIB)]
    predicted = bars(measured_memory_figure(measured_trace(rows)), "predicted peak")
    assert list(predicted.y) == pytest.approx([6.25, 6.0])
    assert predicted.offsetgroup == "predicted" and predicted.base is None
    assert all(text.startswith("predicted") for text in predicted.text)
    # 7.5 / 6.25 - 1 = +20.0%; 5.75 / 6.0 - 1 = -4.2%
    assert "error +20.0%" in predicted.hovertext[0] and "error -4.2%" in predicted.hovertext[1]
    assert "measured 7.500 MiB" in predicted.hovertext[0]


def test_a_rank_without_prediction_has_the_measured_bar_only_and_says_why():
    rows = [run_row(0, 1 * MIB, 1 * MIB, 2 * MIB, 3 * MIB, 0.0, predicted=8 * MIB),
            run_row(1, 1 * MIB, 1 * MIB, 2 * MIB, 1 * MIB, 0.0)]
    fig = measured_memory_figure(measured_trace(rows, "--model mlp has no transformer spec"))
    assert list(bars(fig, "predicted peak").x) == ["rank 0"]
    assert "--model mlp has no transformer spec" in bars(fig, "weights").hovertext[1]
    assert "no prediction: --model mlp has no transformer spec" in [trace.name for trace in fig.data]


def test_a_run_without_prediction_draws_no_predicted_bar():
    rows = [run_row(rank, 1 * MIB, 1 * MIB, 2 * MIB, 1 * MIB, 0.0) for rank in range(2)]
    fig = measured_memory_figure(measured_trace(rows, "float16 autocast is not described"))
    names = [trace.name for trace in fig.data]
    assert "predicted peak" not in names
    assert names == [*PARTS, "no prediction: float16 autocast is not described"]


def test_a_gpu_run_draws_the_allocators_peak_alone_in_gb_past_a_gigabyte():
    rows = [{"rank": rank, "source": "cuda", "peak": peak, "params": 1e9, "grads": 0.0, "optimizer": 0.0,
             "activations": 0.0, "buffers": 0.0, "activations_peak": 0.0, "static": 0.0, "unsharded_params": 1e9}
            for rank, peak in ((0, 3.5e9), (1, 2.25e9))]
    rows[0]["predicted_peak"] = 3.2e9  # the allocator's peak predicted (pipesim.cli.run_memory) for rank 0 only
    trace = measured_trace(rows, "--model mlp has no transformer spec")
    assert trace.meta["memory"][0]["parts"] == {} and trace.meta["memory"][0]["not_predicted"] is None
    assert trace.meta["memory"][1]["not_predicted"] == "--model mlp has no transformer spec"
    fig = measured_memory_figure(trace)
    assert [trace.name for trace in fig.data] == ["allocator peak", "predicted peak",
                                                  "no prediction: --model mlp has no transformer spec"]
    assert list(bars(fig, "allocator peak").y) == pytest.approx([3.5, 2.25])
    assert list(bars(fig, "predicted peak").y) == pytest.approx([3.2])
    assert fig.layout.yaxis.title.text == "GB"


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(*[st.integers(0, 2**31)] * 5), min_size=1, max_size=12))
def test_each_ranks_bars_stack_to_its_peak(parts):
    rows = [run_row(rank, *map(float, values)) for rank, values in enumerate(parts)]
    fig = measured_memory_figure(measured_trace(rows))
    drawn = {trace.name: trace for trace in fig.data}
    shown = [int(label.split()[1]) for label in drawn["weights"].x]  # past 8 ranks, the highest peaks
    assert len(shown) == min(len(rows), 8)
    unit = 1e9 if max(rows[rank]["peak"] for rank in shown) >= 1e9 else MIB
    for position, rank in enumerate(shown):
        top = drawn["activations"].base[position] + drawn["activations"].y[position]
        assert top == pytest.approx(rows[rank]["peak"] / unit)


def test_the_gantt_page_has_the_panel_and_a_saved_trace_keeps_it(tmp_path):
    rows = [run_row(0, 1 * MIB, 1 * MIB, 2 * MIB, 3 * MIB, 0.0, predicted=6.0 * MIB)]
    trace = measured_trace(rows)
    trace.save(tmp_path / "trace.json")
    loaded = Trace.load(tmp_path / "trace.json")
    assert loaded.meta["memory"] == trace.meta["memory"]
    page = write_gantt_html([loaded], tmp_path / "run.html", plotly="cdn").read_text()
    assert "measured peak memory of the last step (MiB per rank)" in page


@pytest.mark.timeout(120)
def test_a_real_two_rank_run_draws_its_json_memory(tmp_path):
    """``pipesim run`` on 2 gloo ranks: the saved Trace's panel is the run's ``--json`` rows."""
    command = [sys.executable, "-m", "pipesim", "run", "--pp", "2", "-m", "2", "--model", "gpt", "--layers", "2",
               "--hidden", "16", "--heads", "2", "--batch-size", "2", "--optimizer", "adamw", "--steps", "2",
               "--json", str(tmp_path / "run.json"), "--trace", str(tmp_path / "trace.json"),
               "--html", str(tmp_path / "run.html"), "--plotly", "cdn", "--quiet"]
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(command, capture_output=True, text=True, timeout=110, env=environment)
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "run.json").read_text())["memory"]
    trace = Trace.load(tmp_path / "trace.json")
    fig = measured_memory_figure(trace)
    for position, row in enumerate(rows):
        assert bars(fig, "weights").y[position] == pytest.approx(row["params"] / MIB)
        assert bars(fig, "activations").y[position] == pytest.approx(row["activations"] / MIB)
        assert bars(fig, "activations").base[position] + bars(fig, "activations").y[position] == pytest.approx(
            row["peak"] / MIB)
        assert bars(fig, "predicted peak").y[position] == pytest.approx(row["predicted_peak"] / MIB)
        error = row["peak"] / row["predicted_peak"] - 1
        assert f"error {error:+.1%}" in bars(fig, "predicted peak").hovertext[position]
    assert "measured peak memory of the last step" in (tmp_path / "run.html").read_text()


def test_run_and_compare_put_the_prediction_beside_the_measured_rows_in_the_trace():
    """``memory_beside_prediction`` (``pipesim run``'s report and ``compare``'s chart):
    the gpt toy gets the memory model's peaks; the mlp toy the reason it has none."""
    from executor.config import RunConfig
    from pipesim.cli.run import memory_beside_prediction
    from pipesim.cli.run_memory import predicted_peaks

    rows = [run_row(rank, 1 * MIB, 1 * MIB, 2 * MIB, 1 * MIB, 0.0) for rank in range(2)]
    gpt = RunConfig(model="gpt", pp=2, microbatches=2, layers=2, hidden=16, heads=2, batch_size=2,
                    optimizer="adamw", steps=2)
    result = {"trace": measured_trace([])}
    lines = memory_beside_prediction(result, {"memory": [dict(row) for row in rows]}, gpt)
    expected = predicted_peaks(gpt)
    drawn = result["trace"].meta["memory"]
    assert [rank["predicted_peak_bytes"] for rank in drawn] == [rank["predicted_peak"] for rank in expected]
    assert all(rank["not_predicted"] is None for rank in drawn) and any("predicted" in line for line in lines)
    mlp = RunConfig(model="mlp", pp=2, microbatches=2, layers=2, hidden=16, batch_size=2, steps=2)
    result = {"trace": measured_trace([])}
    memory_beside_prediction(result, {"memory": [dict(row) for row in rows]}, mlp)
    assert [rank["not_predicted"] for rank in result["trace"].meta["memory"]] == [
        "--model mlp has no transformer spec"] * 2
    assert "predicted peak" not in [trace.name for trace in measured_memory_figure(result["trace"]).data]
