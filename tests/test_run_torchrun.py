"""``pipesim run`` started by torchrun: each process is one rank of one job (not a whole
job of its own), only rank 0 writes, and a world size that does not fit is refused in
one line. The ranks are started as torchrun starts them: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT in each process's environment."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from executor.config import RunConfig
from executor.reference import reference_run

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_ranks(world: int, flags: list[str], cwd: Path) -> list[subprocess.CompletedProcess]:
    """``pipesim run FLAGS`` in ``world`` processes with torchrun's environment."""
    port = free_port()
    processes = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        processes.append(subprocess.Popen([sys.executable, "-m", "pipesim", "run", *flags], cwd=cwd, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = []
    for process in processes:
        out, err = process.communicate(timeout=100)
        done.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return done


def test_two_torchrun_ranks_run_one_job_and_only_rank_0_writes(tmp_path: Path) -> None:
    flags = ["--pp", "2", "-m", "2", "--steps", "2", "--dtype", "float64", "--model", "gpt", "--layers", "2",
             "--hidden", "8", "--heads", "2", "--seq-len", "4", "--vocab", "11", "--batch-size", "4",
             "--json", "run.json", "--trace", "trace.json", "--quiet"]
    rank0, rank1 = start_ranks(2, flags, tmp_path)
    assert (rank0.returncode, rank1.returncode) == (0, 0), rank0.stderr + rank1.stderr
    assert "world 2" in rank0.stdout and rank1.stdout == ""
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run.json", "trace.json"]
    document = json.loads((tmp_path / "run.json").read_text())
    assert (document["pp"], document["world_size"]) == (2, 2)
    # One job of two ranks: the pipelined losses of the model split over both processes.
    reference = reference_run(RunConfig(pp=2, microbatches=2, steps=2, dtype="float64", model="gpt", layers=2,
                                        hidden=8, heads=2, seq_len=4, vocab=11, batch_size=4))
    assert document["losses"] == pytest.approx(reference["losses"], abs=1e-10, rel=0)
    ranks = {event["rank"] for event in json.loads((tmp_path / "trace.json").read_text())["events"]}
    assert ranks == {0, 1}


def test_a_world_size_that_does_not_fit_is_refused_in_one_line(tmp_path: Path) -> None:
    rank0, rank1 = start_ranks(2, ["--pp", "4", "--json", "run.json"], tmp_path)
    assert (rank0.returncode, rank1.returncode) == (2, 2)
    lines = rank0.stderr.strip().splitlines()
    assert lines == ["pipesim run: error: torchrun started 2 processes, but dp=1 x pp=4 x tp=1 x cp=1 is 4 ranks: "
                     "use torchrun --nproc-per-node 4 (one node), or change --dp/--pp/--tp/--cp"]
    assert rank1.stderr == "" and rank1.stdout == "" and not list(tmp_path.iterdir())
