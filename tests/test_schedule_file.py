"""``--schedule-file`` through the command line: ``simulate``, ``sweep``, ``run``,
``profile`` and ``compare`` take a schedule CSV, so an order written by hand is
predicted, executed and compared; flags the file already fixes are refused."""

from __future__ import annotations

import json

import pytest

from executor.config import RunConfig
from executor.reference import reference_run
from pipesim.cli import main
from schedules.csv_io import schedule_from_csv
from schedules.generators import generate

pytestmark = pytest.mark.timeout(300)

# A split backward on 2 ranks, 2 microbatches (each W put off behind the next I).
SPLIT = "0F0,0F1,0I0,0I1,0W0,0W1\n1F0,1I0,1F1,1I1,1W0,1W1\n"
# A V-shaped order: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2; backward split.
V_SHAPE = ("0F0,0F1,3F0,3I0,3F1,3I1,0I0,3W0,0I1,3W1,0W0,0W1\n"
           "1F0,2F0,1F1,2F1,2I0,1I0,2I1,1I1,2W0,1W0,2W1,1W1\n")
# Stage 1 and 2 both on rank 1: the executor needs as many stages on every rank.
UNEVEN = "0F0,0B0\n1F0,2F0,2B0,1B0\n"


def run_cli(*argv) -> int:
    return main([str(arg) for arg in argv])


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("command", ["simulate", "sweep", "run", "profile", "compare"])
@pytest.mark.parametrize("flag,value", [("--schedule", "1f1b"), ("--pp", "2"), ("--microbatches", "2"),
                                        ("-m", "2"), ("--virtual-stages", "2"), ("-v", "1")])
def test_flags_the_file_fixes_are_refused_by_name(tmp_path, capsys, command: str, flag: str, value: str) -> None:
    path = write(tmp_path, "split.csv", SPLIT)
    extra = ["--out", tmp_path / "c.json"] if command == "profile" else []
    assert run_cli(command, "--schedule-file", path, flag, value, *extra) == 2
    error = capsys.readouterr().err
    long_flag = {"-m": "--microbatches", "-v": "--virtual-stages"}.get(flag, flag)
    assert f"{long_flag} conflicts with --schedule-file {path}" in error
    assert "Traceback" not in error and not (tmp_path / "c.json").exists()


def test_run_refuses_a_file_with_uneven_stages_per_rank(tmp_path, capsys) -> None:
    path = write(tmp_path, "uneven.csv", UNEVEN)
    assert run_cli("run", "--schedule-file", path, "--layers", 3) == 2
    assert "same number of stages on every rank" in capsys.readouterr().err


def test_missing_schedule_file_is_one_line(tmp_path, capsys) -> None:
    assert run_cli("sweep", "--schedule-file", tmp_path / "nope.csv") == 2
    error = capsys.readouterr().err
    assert "nope.csv" in error and "Traceback" not in error


def test_sweep_compares_schedule_files_one_row_each(tmp_path) -> None:
    one_f_one_b = tmp_path / "1f1b.csv"
    assert run_cli("export", "--schedule", "1f1b", "--pp", 4, "--microbatches", 8, "--out", one_f_one_b) == 0
    split = write(tmp_path, "split.csv", SPLIT)
    assert run_cli("sweep", "--schedule-file", one_f_one_b, "--schedule-file", split, "--fwd", 1, "--bwd", 2,
                   "--wgrad", 1, "--json", tmp_path / "s.json", "--quiet") == 0
    rows = {row["schedule"]: row for row in json.loads((tmp_path / "s.json").read_text())}
    assert set(rows) == {"1f1b", "split"}
    assert (rows["1f1b"]["pp"], rows["1f1b"]["microbatches"]) == (4, 8)
    assert rows["1f1b"]["makespan"] == pytest.approx((8 + 4 - 1) * 3)  # 1F1B closed form (m + p - 1)(F + B)
    # by hand (tests/test_cli.py): rank 1 ends W1 at 7, rank 0 at 8
    assert rows["split"]["makespan"] == pytest.approx(8.0)


def test_run_executes_a_v_shaped_split_file_exactly(tmp_path, capsys) -> None:
    path = write(tmp_path, "vshape.csv", V_SHAPE)
    assert run_cli("run", "--schedule-file", path, "--layers", 5, "--hidden", 8, "--batch-size", 5, "--steps", 2,
                   "--dtype", "float64", "--optimizer", "adamw", "--lr", 0.05, "--json", tmp_path / "r.json",
                   "--trace", tmp_path / "t.json") == 0
    document = json.loads((tmp_path / "r.json").read_text())
    assert (document["schedule"], document["pp"], document["microbatches"], document["virtual_stages"]) == \
        ("vshape", 2, 2, 2)
    reference = reference_run(RunConfig(pp=2, virtual_stages=2, microbatches=2, layers=5, hidden=8, batch_size=5,
                                        steps=2, dtype="float64", optimizer="adamw", lr=0.05))
    # the second step's loss depends on the first step's gradients
    assert document["losses"] == pytest.approx(reference["losses"], abs=1e-10, rel=0)
    trace = json.loads((tmp_path / "t.json").read_text())
    compute = {rank: [e["action"] for e in sorted(trace["events"], key=lambda e: e["start"])
                      if e["rank"] == rank and e["stream"] == "compute"] for rank in (0, 1)}
    assert compute == {rank: [str(a) for a in program]
                       for rank, program in enumerate(schedule_from_csv(path).programs)}


def test_profile_and_compare_take_the_files_placement(tmp_path, capsys) -> None:
    path = write(tmp_path, "vshape.csv", V_SHAPE)
    costs = tmp_path / "costs.json"
    model = ["--layers", 5, "--hidden", 8, "--batch-size", 4]
    assert run_cli("profile", "--schedule-file", path, *model, "--warmup", 0, "--repeats", 2, "--min-time", 0,
                   "--out", costs) == 0
    document = json.loads(costs.read_text())
    assert [entry["stage"] for entry in document["stages"]] == [0, 1, 2, 3]
    assert (document["meta"]["schedule"], document["meta"]["pp"], document["meta"]["virtual_stages"]) == \
        ("vshape", 2, 2)
    assert run_cli("compare", "--schedule-file", path, *model, "--costs", costs, "--topology", "ideal",
                   "--steps", 2, "--json", tmp_path / "cmp.json", "--predicted-trace", tmp_path / "p.json") == 0
    predicted = json.loads((tmp_path / "p.json").read_text())
    compute = sorted(e["action"] for e in predicted["events"] if e["stream"] == "compute")
    assert compute == sorted(str(a) for program in schedule_from_csv(path).programs for a in program)
    comparison = json.loads((tmp_path / "cmp.json").read_text())
    assert comparison["measured_step_time"] > 0 and comparison["predicted_step_time"] > 0


def test_simulate_file_equals_the_generated_schedule(tmp_path) -> None:
    path = tmp_path / "interleaved.csv"
    assert run_cli("export", "--schedule", "interleaved-1f1b", "--pp", 2, "-m", 4, "-v", 2, "--out", path) == 0
    assert schedule_from_csv(path).programs == generate("interleaved-1f1b", 2, 4, 2).programs
    assert run_cli("simulate", "--schedule-file", path, "--fwd", 1, "--bwd", 2, "--json", tmp_path / "f.json") == 0
    assert run_cli("simulate", "--schedule", "interleaved-1f1b", "--pp", 2, "-m", 4, "-v", 2, "--fwd", 1, "--bwd", 2,
                   "--json", tmp_path / "g.json") == 0
    from_file = json.loads((tmp_path / "f.json").read_text())["makespan"]
    assert from_file == pytest.approx(json.loads((tmp_path / "g.json").read_text())["makespan"])
    # interleaved closed form with free links: m(F+B) + (p-1)(F+B)/v, costs per chunk = per rank / v
    assert from_file == pytest.approx(4 * 3 + (2 - 1) * 3 / 2)


def test_zb_auto_is_exported_from_costs_then_run_from_its_file(tmp_path, capsys) -> None:
    """zb-auto needs stage costs: ``run --schedule zb-auto`` says how to get there, and
    the order ``export`` writes from costs runs exactly."""
    assert run_cli("run", "--schedule", "zb-auto", "--pp", 2, "-m", 4) == 2
    assert "pipesim export --schedule zb-auto --pp 2 -m 4 --costs" in capsys.readouterr().err
    path = tmp_path / "zb-auto.csv"
    assert run_cli("export", "--schedule", "zb-auto", "--pp", 2, "-m", 4, "--fwd", 1, "--bwd", 2, "--wgrad", 1,
                   "--out", path) == 0
    assert {a.kind for program in schedule_from_csv(path).programs for a in program} == {"F", "I", "W"}
    assert run_cli("run", "--schedule-file", path, "--layers", 3, "--hidden", 8, "--batch-size", 9, "--steps", 2,
                   "--dtype", "float64", "--optimizer", "adamw", "--lr", 0.05, "--json", tmp_path / "r.json") == 0
    reference = reference_run(RunConfig(pp=2, microbatches=4, layers=3, hidden=8, batch_size=9, steps=2,
                                        dtype="float64", optimizer="adamw", lr=0.05))
    losses = json.loads((tmp_path / "r.json").read_text())["losses"]
    assert losses == pytest.approx(reference["losses"], abs=1e-10, rel=0)
