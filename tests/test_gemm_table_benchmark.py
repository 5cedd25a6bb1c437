"""``benchmarks/gemm_table.py``, the built-in GEMM table timed again in nn.Linear's
layouts: on a CPU its code path (a GPU times the whole table), and its fit, which on the
built-in table must give the built-in model's figures back."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

from pipesim.model.compute_model import H200_GEMM_FIT

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gemm_table.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gemm_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fitting_the_built_in_table_gives_the_built_in_model() -> None:
    script = load_script()
    fit = script.fitted(script.table_rows())
    assert fit["efficiency"] == pytest.approx(H200_GEMM_FIT["efficiency"], abs=5e-5)
    assert fit["k_overhead"] == H200_GEMM_FIT["k_overhead"]
    assert fit["launch_seconds"] == pytest.approx(H200_GEMM_FIT["launch_seconds"], rel=1e-3)


def test_the_table_is_timed_again_row_for_row(tmp_path, capsys) -> None:
    script = load_script()
    out = tmp_path / "linear.csv"
    assert script.main(["--limit", "2", "--device", "cpu", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    built_in = script.table_rows()[:2]
    assert [(row["gemm"], row["m"], row["k"], row["n"]) for row in rows] == \
        [(row["gemm"], row["m"], row["k"], row["n"]) for row in built_in]
    for row in rows:  # the throughput columns follow from the times: 2mkn forward, twice it backward
        flops = 2.0 * int(row["m"]) * int(row["k"]) * int(row["n"])
        assert float(row["fwd_tflops"]) == pytest.approx(flops / float(row["fwd_s"]) / 1e12, rel=1e-9)
        assert float(row["bwd_tflops"]) == pytest.approx(2 * flops / float(row["bwd_s"]) / 1e12, rel=1e-9)
    printed = capsys.readouterr().out
    assert "| qkv |" in printed and "| attn_out |" in printed


def test_bad_input_is_refused_in_one_line(capsys, tmp_path) -> None:
    script = load_script()
    assert script.main(["--limit", "0", "--device", "cpu"]) == 2
    assert "--limit must be at least 1, got 0" in capsys.readouterr().err
    assert script.main(["--limit", "-3", "--device", "cpu"]) == 2
    assert "--limit must be at least 1, got -3" in capsys.readouterr().err
    for out in (tmp_path, tmp_path / "missing" / "t.csv"):  # a directory, a folder that does not exist
        assert script.main(["--limit", "1", "--device", "cpu", "--out", str(out)]) == 2
        error = capsys.readouterr().err.strip()
        assert error.startswith("gemm_table: ") and "--out" in error and "\n" not in error
    assert script.main(["--limit", "1", "--device", "nowhere"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("gemm_table: ") and "nowhere" in error and "\n" not in error
