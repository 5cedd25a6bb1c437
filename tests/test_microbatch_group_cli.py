"""``--microbatch-group`` (interleaved-1f1b's N) on the command line: simulate, show,
export, sweep and run take it, refuse it with one line and exit status 2 where it cannot
apply, and a run with it computes the one-process gradients."""

from __future__ import annotations

import json

import pytest

from executor.config import RunConfig
from executor.launch import launch
from executor.reference import reference_run
from pipesim.cli import main
from tests.launched_cases import assert_equals_reference


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``pipesim ARGV`` (argparse's own refusals exit)."""
    try:
        status = main([str(arg) for arg in argv])
    except SystemExit as stop:
        status = stop.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize("argv, message", [
    (["--schedule", "1f1b", "--microbatch-group", "4"],
     "--microbatch-group 4 conflicts with --schedule 1f1b: only interleaved-1f1b"),
    (["--schedule", "interleaved-1f1b", "--microbatch-group", "2"],
     "--microbatch-group 2: interleaved-1f1b: microbatch group 2 must be between pp=4 and the 16 microbatches"),
    (["--schedule", "interleaved-1f1b", "--microbatch-group", "17"],
     "--microbatch-group 17: interleaved-1f1b: microbatch group 17 is more than the 16 microbatches"),
    (["--schedule", "interleaved-1f1b", "--microbatch-group", "7"],
     "--microbatch-group 7: interleaved-1f1b: microbatch group 7 leaves a last group of 2"),
    (["--schedule", "interleaved-1f1b", "--microbatch-group", "0"], "argument --microbatch-group: must be >= 1"),
])
@pytest.mark.parametrize("command", ["simulate", "show", "export"])
def test_bad_groups_are_one_line_and_exit_2(capsys, tmp_path, command, argv, message):
    out = ["--out", tmp_path / "order.csv"] if command == "export" else []
    status, _, err = run_cli(capsys, command, "--pp", 4, "-m", 16, *argv, *out)
    assert status == 2
    assert message in err.strip().splitlines()[-1]
    assert "Traceback" not in err


def test_simulate_reports_the_group_and_its_memory(capsys, tmp_path):
    # p = 4, v = 2, m = 16: rank 0 holds 2(p-1) + (v-1)N + 1 chunk stashes, halved to microbatches:
    # N = 4 -> 11/2 = 5.5, N = 16 -> 23/2 = 11.5; the step time is the same (free links).
    peaks = {}
    for group in (4, 16):
        path = tmp_path / f"n{group}.json"
        status, out, _ = run_cli(capsys, "simulate", "--schedule", "interleaved-1f1b", "--pp", 4, "-m", 16,
                                 "--microbatch-group", group, "--json", path)
        assert status == 0
        assert f"virtual stages=2 (microbatch group {group})" in out.splitlines()[0]
        document = json.loads(path.read_text())
        assert document["microbatch_group"] == group
        peaks[group] = (document["ranks"][0]["peak_inflight_microbatches"], document["makespan"])
    assert peaks[4][0] == 5.5 and peaks[16][0] == 11.5
    assert peaks[4][1] == pytest.approx(peaks[16][1])


def test_show_prints_megatrons_order(capsys):
    status, out, _ = run_cli(capsys, "show", "--schedule", "interleaved-1f1b", "--pp", 2, "-m", 5,
                             "--microbatch-group", 3)
    assert status == 0
    # Megatron-Core's PP2 N3 M5 VP2 example, derived in tests/test_microbatch_group.py
    assert "rank 0: 0F0 0F1 0F2 2F0 2F1 2F2 2B0 0F3 2B1 0F4 2B2 2F3 0B0 2F4 0B1 0B2 2B3 2B4 0B3 0B4" in out


def test_sweep_takes_a_list_and_notes_the_groups_out_of_range(capsys):
    status, out, _ = run_cli(capsys, "sweep", "--schedule", "1f1b,interleaved-1f1b", "--pp", 4, "-m", "8,16",
                             "--microbatch-group", "4,16", "--quiet")
    assert status == 0
    lines = [line.split() for line in out.splitlines() if line.startswith("interleaved-1f1b")]
    # (m, N) -> peak in-flight (rank 0: (2(p-1) + N + 1) / 2 microbatches); N = 16 > m = 8 is a noted row
    rows = {(int(row[2]), int(row[4])): row[5:] for row in lines}
    assert rows[(8, 4)][2] == "5.5" and rows[(16, 4)][2] == "5.5" and rows[(16, 16)][2] == "11.5"
    assert rows[(8, 16)][0] == "n/a:"
    assert [line for line in out.splitlines() if line.startswith("1f1b")]  # 1f1b rows once each, no N
    status, _, err = run_cli(capsys, "sweep", "--schedule", "1f1b", "--microbatch-group", "4", "--quiet")
    assert status == 2 and "--microbatch-group 4 conflicts with --schedule 1f1b" in err


def test_run_refuses_bad_groups(capsys):
    for argv, message in ((["--schedule", "1f1b", "--microbatch-group", "2"], "conflicts with --schedule 1f1b"),
                          (["--schedule", "interleaved-1f1b", "--microbatch-group", "1"],
                           "microbatch group 1 must be between pp=2")):
        status, _, err = run_cli(capsys, "run", "--pp", 2, "-m", 4, "--backend", "gloo", *argv)
        assert status == 2 and message in err


@pytest.mark.timeout(120)
def test_a_run_with_a_group_computes_the_one_process_gradients():
    """pp 2, v 2, m 5, N = 3 (Megatron's example: a last group of 2) under NCCL's ordering
    rules emulated on gloo; float64, loss and gradients within 1e-10 of one process."""
    config = RunConfig(schedule="interleaved-1f1b", pp=2, microbatches=5, virtual_stages=2, microbatch_group=3,
                       model="mlp", hidden=8, layers=5, batch_size=11, steps=1, dtype="float64", optimizer="sgd",
                       lr=0.05, return_grads=True, p2p="rendezvous", timeout=60)
    (result,) = launch([config])
    assert_equals_reference(result, reference_run(config))
    ranks = {event.rank: [] for event in result["trace"].events}
    for event in sorted(result["trace"].events, key=lambda event: event.start):
        if event.stream == "compute":
            ranks[event.rank].append(event.action)
    assert " ".join(ranks[0]) == "0F0 0F1 0F2 2F0 2F1 2F2 2B0 0F3 2B1 0F4 2B2 2F3 0B0 2F4 0B1 0B2 2B3 2B4 0B3 0B4"
