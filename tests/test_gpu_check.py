"""``scripts/gpu-check.sh`` in its CPU mode (``GPU_CHECK_DRY_RUN=1``: the same Python entry
points on CPU and gloo, tiny sizes): a check runs and lands in the table, a budget too
small cuts every check and fails the script, and a check fails on a difference above its
bound. What only a GPU can show (CUDA numerics, streams that overlap) is the script's
to run on one."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DRY_RUN": "1",
                   "GPU_CHECK_OUT": str(tmp_path / "out"), **env}
    return subprocess.run(["bash", str(SCRIPT)], env=environment, capture_output=True, text=True, timeout=170)


def table(output: str) -> dict[str, list[str]]:
    """The summary table's rows by check name."""
    lines = output[output.index("check                      status"):].splitlines()[1:]
    return {line.split()[0]: line.split() for line in lines if line and not line.startswith(("total", "gpu-check"))}


@pytest.mark.timeout(180)
def test_cpu_mode_runs_a_check_through_the_script_and_tabulates_it(tmp_path):
    """ZeRO-1, 2 and 3 on a one-rank gloo group (NCCL's on a GPU), and ZeRO-3 under zb-h1's
    split backward, float64 against the one-process reference: the row passes, the
    script exits 0, the check's log is kept."""
    done = run_script(tmp_path, GPU_CHECK_ONLY="zero-one-rank")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = table(done.stdout)
    assert list(rows) == ["zero-one-rank"]
    assert rows["zero-one-rank"][1] == "PASS"
    assert "4 of 4 within 1e-09 of the CPU float64 reference" in done.stdout
    log = (tmp_path / "out" / "zero-one-rank.log").read_text()
    assert all(f"gpt 1f1b --zero {stage} on a one-rank gloo group" in log for stage in (1, 2, 3))
    assert "gpt zb-h1 --zero 3 on a one-rank gloo group" in log
    assert "gpu-check: all checks passed" in done.stdout


@pytest.mark.timeout(60)
def test_a_budget_too_small_cuts_every_check_and_fails(tmp_path):
    done = run_script(tmp_path, GPU_CHECK_BUDGET="0")
    assert done.returncode == 1
    rows = table(done.stdout)
    names = {"numerics-cuda-vs-cpu", "architectures", "recompute", "zero-one-rank", "tp-cp-ep-degree-one",
             "dualpipev-stream-pairs", "memory-vs-predicted", "profile-simulate-run", "bf16-vs-fp32",
             "tensor-parallel-tp2"}
    assert names <= set(rows)
    assert all(rows[name][1] == "CUT" for name in names)
    assert rows["compare-pp2"][1] == "FAIL"  # nothing profiled before it
    assert "gpu-check: FAILED" in done.stderr


def test_a_check_fails_above_its_bound_and_names_the_case(capsys):
    gpu_check = gpu_check_module()
    reference = {"losses": [1.0, 0.5], "grads": {"0.weight": torch.zeros(3, dtype=torch.float64)}}
    close = {"losses": [1.0 + 1e-12, 0.5], "grads": {"0.weight": torch.full((3,), 1e-12, dtype=torch.float64)}}
    far = {"losses": [1.0, 0.5], "grads": {"0.weight": torch.tensor([0.0, 2e-9, 0.0], dtype=torch.float64)}}
    assert gpu_check.against_reference([("close", close, reference)]) == 0
    assert gpu_check.against_reference([("close", close, reference), ("far", far, reference)]) == 1
    printed = capsys.readouterr().out
    assert "far" in printed and "FAILED" in printed and "1 of 2 within 1e-09" in printed
    missing = {"losses": [1.0, 0.5], "grads": {}}
    assert gpu_check.differences(missing, reference) == (0.0, math.inf)


@pytest.mark.timeout(180)
def test_cpu_mode_runs_the_folding_check(tmp_path):
    """Parallel folding (tp 2, etp 1, ep 2, clipped) through the script on gloo: the row
    passes against the CPU float64 reference (two GPUs on a GPU machine)."""
    done = run_script(tmp_path, GPU_CHECK_ONLY="folding-tp2-etp1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert table(done.stdout)["folding-tp2-etp1"][1] == "PASS"
    assert "tp 2 sequence parallel etp 1 ep 2 on gloo" in (tmp_path / "out" / "folding-tp2-etp1.log").read_text()
