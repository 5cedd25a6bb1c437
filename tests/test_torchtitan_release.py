"""torchtitan itself reads what pipesim writes for it: torch 2.13.0 and torchtitan 0.3.0
(with ``triton``, which it needs and does not declare) in a virtual environment of this
test's own, made once under a cache folder and reused; then torchtitan's config parser on
every ``torchtitan.args`` pipesim writes for the rows of a plan (and for the recompute,
sequence-parallel and placement choices a plan can make), and the CSVs run through
torchtitan's own placement of the stages, FSDP and schedule builder on gloo
(``tests/torchtitan_stage_builder.py``) against a one-process reference.

Deselect with ``-m "not torchtitan"``. Skipped only when the package index cannot be
reached (a pip failure that says so); any other failure to install fails the test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipesim.cli import main
from pipesim.cli.torchtitan import TorchtitanLayout, write_torchtitan
from schedules.generators import MULTI_CHUNK, generate

pytestmark = [pytest.mark.torchtitan, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[1]
PINS = ("torch==2.13.0", "torchtitan==0.3.0")
UNREACHABLE = ("NewConnectionError", "Network is unreachable", "Temporary failure in name resolution",
               "Max retries exceeded", "No matching distribution found for torchtitan",
               "Could not find a version that satisfies the requirement torchtitan")
TOLERANCE = 1e-10


def venv_folder() -> Path:
    """``$PIPESIM_CACHE`` (default ``~/.cache/pipesim``)/torch-2.13.0-torchtitan-0.3.0."""
    cache = Path(os.environ.get("PIPESIM_CACHE") or Path.home() / ".cache" / "pipesim")
    return cache / "-".join(pin.replace("==", "-") for pin in PINS)


def install(folder: Path) -> None:
    """torch first (pip then keeps the CPU wheel), then torchtitan and triton with torch pinned."""
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True, timeout=300)
    python = str(folder / "bin" / "python")
    for packages in ([PINS[0]], [PINS[1], "triton", PINS[0]]):
        done = subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *packages],
                              capture_output=True, text=True, timeout=1200, check=False)
        if done.returncode:
            said = done.stdout + done.stderr
            shutil.rmtree(folder, ignore_errors=True)
            if any(sign in said for sign in UNREACHABLE):
                pytest.skip(f"the package index cannot be reached to install {' '.join(packages)}: "
                            f"{said.strip().splitlines()[-1]}")
            pytest.fail(f"pip install {' '.join(packages)} failed:\n{said[-2000:]}")


@pytest.fixture(scope="session")
def torchtitan_python() -> str:
    """The Python of the environment with the pinned torch and torchtitan (made on first use)."""
    folder = venv_folder()
    ready = folder / "pipesim-ready"
    if not ready.exists():
        shutil.rmtree(folder, ignore_errors=True)
        folder.parent.mkdir(parents=True, exist_ok=True)
        install(folder)
        ready.write_text(" ".join(PINS) + "\n")
    python = str(folder / "bin" / "python")
    versions = subprocess.run([python, "-c", "import importlib.metadata as m; "
                               "print(m.version('torch').split('+')[0], m.version('torchtitan'))"],
                              capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert versions == [pin.split("==")[1] for pin in PINS]
    return python


def launch(*argv: str, python: str = sys.executable, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([python, *argv], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def plan_rows(tmp_path_factory) -> list[Path]:
    """``torchtitan.args`` for the three best rows of a plan (llama3-8b on 16 GPUs, the
    recompute modes torchtitan has a knob for), and for layouts with each choice a plan
    can make that the rows may not have: full and per-op recompute, sequence
    parallelism, DDP, more than two stages per rank, V, and a mixture of experts folded
    beside tp (Mixtral, tp 2, ep 8)."""
    folder = tmp_path_factory.mktemp("titan")
    plan = folder / "plan.json"
    common = ["--model", "llama3-8b", "--seq-len", "2048", "--topology", "ib"]
    assert main(["plan", *common, "--gpus", "16", "--global-batch", "64", "--top", "3", "--workers", "1",
                 "--recompute", "none,full", "--json", str(plan), "--quiet"]) == 0
    paths = []
    for rank in (1, 2, 3):
        out = folder / f"row{rank}"
        assert main(["export", *common, "--nodes", "2", "--from-plan", str(plan), "--plan-rank", str(rank),
                     "--fsdp", "--torchtitan", str(out)]) == 0
        paths.append(out / "torchtitan.args")
    for name, extra in [("zbv", ["--recompute", "full", "--tp", "2", "--sequence-parallel", "--fsdp", "--dp", "2"]),
                        ("interleaved-1f1b", ["-v", "4", "--layers", "32"]),
                        ("dualpipev", ["--dp", "2", "--fsdp"])]:
        out = folder / name
        chunks = [] if "-v" in extra else ["-v", "2"] if name in MULTI_CHUNK else []
        assert main(["export", "--schedule", name, "--pp", "4", "-m", "8", *chunks, *extra,
                     "--torchtitan", str(out)]) == 0, name
        paths.append(out / "torchtitan.args")
    # a mixture of experts as torchtitan runs it: folded (ep 8 cut from FSDP x tp) beside tp 2
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "32", "--global-batch", "64", "--seq-len", "1024",
                 "--schedules", "1f1b", "--constraint", "tp=2", "--constraint", "ep=8", "--top", "1", "--workers", "1",
                 "--torchtitan", str(folder / "moe"), "--fsdp", "--quiet"]) == 0
    paths.append(folder / "moe" / "torchtitan.args")
    # per-op (torchtitan's selective) as export writes it, where simulate's --recompute lacks it
    write_torchtitan(folder / "1f1b-per-op", generate("1f1b", 4, 8), TorchtitanLayout(dp=4, recompute="per-op"))
    paths.append(folder / "1f1b-per-op" / "torchtitan.args")
    return paths


def test_torchtitans_parser_reads_every_file_pipesim_writes(torchtitan_python, plan_rows):
    done = launch("-m", "executor.torchtitan_launch", "--check", *map(str, plan_rows), "--python", torchtitan_python)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == len(plan_rows)
    for line, path in zip(lines, plan_rows, strict=True):
        assert line.startswith("ok: ") and str(path) in line and "torchtitan 0.3.0's parser reads all" in line


@pytest.mark.parametrize(("replace", "expected"), [
    ("--training.local_batch_size", "--parallelism.num_pp_microbatches"),  # the keys 0.2.x-era files carried
    ("--training.seq_len", "--training.num_tokens_per_microbatch_per_dp_rank"),
])
def test_keys_torchtitan_rejects_are_caught_by_its_parser(torchtitan_python, plan_rows, tmp_path, replace, expected):
    """The check is torchtitan's: a key 0.3 does not know is refused, naming it."""
    source = plan_rows[0].read_text()
    assert replace in source
    path = tmp_path / "torchtitan.args"
    path.write_text(source.replace(replace, f"{expected} 8 {replace}"))
    done = launch("-m", "executor.torchtitan_launch", "--check", str(path), "--python", torchtitan_python)
    assert done.returncode == 2 and done.stdout == ""
    assert f"torchtitan's config parser refuses it: Unrecognized options: {expected}" in done.stderr


def test_the_csvs_run_in_torchtitans_stage_builder_as_the_reference(torchtitan_python, tmp_path):
    """pp 2 on gloo, float64: each file through torchtitan's placement, its activation
    checkpointing (full recompute round each stage of a split-backward order), FSDP
    (one-rank mesh) and ``_build_pipeline_schedule``; losses of two steps and the first
    step's gradients equal the one-process reference. Compute-only files as torchtitan
    loads them, lowered ones (UNSHARD/RESHARD/REDUCE_GRAD written by pipesim) through
    ``executor.torchtitan_launch``'s loader; 1f1b with torchtitan's selective (per-op)
    checkpointing, SelectiveAC itself. (With selective checkpointing, the zbv file fails in
    torchtitan with "Trying to backward an extra time", which is why export refuses that
    combination.)"""
    paths = []
    for folder, name, layers, extra in (("1f1b", "1f1b", 2, []), ("zbv", "zbv", 4, []),
                                        ("zbv-full", "zbv", 4, ["--recompute", "full"]),
                                        ("interleaved-1f1b", "interleaved-1f1b", 4, []),
                                        ("dualpipev", "dualpipev", 4, [])):
        out = tmp_path / folder
        chunks = ["-v", "2"] if name in MULTI_CHUNK else []
        assert main(["export", "--schedule", name, "--pp", "2", "-m", "4", *chunks, "--microbatch-size", "2",
                     "--layers", str(layers), *extra, "--torchtitan", str(out)]) == 0
        paths.append(out / "torchtitan.args")
        if folder in ("zbv", "dualpipev"):  # the lowered file, as docs/interop.md launches it
            lowered = out / "lowered.args"
            lowered.write_text((out / "torchtitan.args").read_text().replace("/schedule.csv", "/schedule-lowered.csv"))
            paths.append(lowered)
    assert (tmp_path / "zbv-full" / "torchtitan.args").read_text().split()[-1] == "activation_checkpoint:full"
    write_torchtitan(tmp_path / "1f1b-per-op", generate("1f1b", 2, 4),
                     TorchtitanLayout(microbatch_size=2, layers=2, recompute="per-op"))
    paths.append(tmp_path / "1f1b-per-op" / "torchtitan.args")
    assert paths[-1].read_text().split()[-1] == "activation_checkpoint:selective"
    done = launch("tests/torchtitan_stage_builder.py", *map(str, paths), python=torchtitan_python)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(report) == sorted(map(str, paths))
    for path, errors in report.items():
        assert errors["steps"] == 2 and errors["grads"] == errors["grads_run"] > 0, path
        assert errors["loss_error"] < TOLERANCE and errors["grad_error"] < TOLERANCE, (path, errors)
