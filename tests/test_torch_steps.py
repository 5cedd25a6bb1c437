"""torch's step-level actions in the lowered files pipesim writes (schedules.torch_steps):
REDUCE_GRAD after each stage's last backward and, for FSDP, UNSHARD/RESHARD, exactly where
torch's own lowering of the same compute order puts them (torch's functions are the
oracle), by hand on small cases, and read back by both readers."""

from __future__ import annotations

import pytest

from schedules.action import COMM_KINDS, parse_action
from schedules.csv_io import schedule_from_csv, schedule_to_csv
from schedules.generators import GENERATORS, MULTI_CHUNK, generate, interleaved_auto, zb_auto, zbv_auto
from schedules.lowering import lower
from schedules.schedule import Schedule
from schedules.torch_steps import STEP_CELLS, parse_step_cell, torch_cells

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

# dualpipe: no file form
SCHEDULES = [*(name for name in GENERATORS if name != "dualpipe"), "zb-auto", "zbv-auto", "interleaved-auto"]
_TRANSFERS = {"SEND_F", "RECV_F", "SEND_B", "RECV_B"}


def build(name: str, pp: int, microbatches: int) -> Schedule:
    if name == "zb-auto":
        return zb_auto(pp, microbatches, 1.0, 1.0, 0.5, 0.1, 2 * pp - 1)
    if name == "zbv-auto":
        return zbv_auto(pp, microbatches, 1.0, 1.0, 0.5, 0.1)
    if name == "interleaved-auto":  # below Megatron's memory: a searched order
        return interleaved_auto(pp, microbatches, 2, 0.5, 1.0, 0.1, memory_limit=pp + 1)
    return generate(name, pp, microbatches, 2 if name in MULTI_CHUNK else 1)


def without_transfers(cells: list[str]) -> list[str]:
    return [cell for cell in cells if torch_schedules._Action.from_str(cell).computation_type.value not in _TRANSFERS]


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
@pytest.mark.parametrize(("pp", "microbatches"), [(2, 4), (4, 8), (3, 6)])
@pytest.mark.parametrize("name", SCHEDULES)
def test_step_actions_sit_where_torchs_own_lowering_puts_them(name, pp, microbatches, fsdp):
    schedule = build(name, pp, microbatches)
    lowered = lower(schedule)
    for rank in range(pp):
        compute = [torch_schedules._Action.from_str(cell) for cell in torch_cells(schedule, rank)]
        if fsdp:
            compute = torch_schedules._add_unshard_reshard(compute)
        theirs = [str(action) for action in torch_schedules._add_reduce_grad(compute, microbatches)]
        assert without_transfers(torch_cells(lowered, rank, fsdp)) == theirs, f"rank {rank}"


def test_reduce_grad_after_each_stages_last_backward_by_hand():
    """1F1B, 2 ranks, 3 microbatches; and a split backward, where W completes a gradient."""
    one_f_one_b = lower(generate("1f1b", 2, 3))
    assert torch_cells(one_f_one_b, 0) == ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0F2",
                                           "0SEND_F2", "0RECV_B1", "0B1", "0RECV_B2", "0B2", "0REDUCE_GRAD"]
    programs = [[parse_action(text) for text in row.split()] for row in
                ("0F0 0F1 0I0 0I1 0W0 0W1", "1F0 1I0 1F1 1I1 1W1 1W0")]
    split = lower(Schedule(2, 2, (0, 1), programs))
    rows = [without_transfers(torch_cells(split, rank)) for rank in range(2)]
    assert rows == [["0F0", "0F1", "0I0", "0I1", "0W0", "0W1", "0REDUCE_GRAD"],
                    ["1F0", "1I0", "1F1", "1I1", "1W1", "1W0", "1REDUCE_GRAD"]]


def test_unshard_reshard_by_hand():
    """Interleaved on 2 ranks, 2 chunks each, 2 microbatches: rank 0 computes 0F0 0F1 2F0
    2F1 2B0 2B1 0B0 0B1. Both its stages are among the next three it computes from the
    start, so both are gathered before 0F0; once only stage 0 is ahead (before 0B0),
    stage 2 is released, right after its gradients are reduced; stage 0 is released at
    the end."""
    cells = without_transfers(torch_cells(lower(generate("interleaved-1f1b", 2, 2, 2)), 0, fsdp=True))
    assert cells == ["0UNSHARD", "2UNSHARD", "0F0", "0F1", "2F0", "2F1", "2B0", "2B1", "2REDUCE_GRAD",
                     "2RESHARD", "0B0", "0B1", "0REDUCE_GRAD", "0RESHARD"]


def test_compute_only_rows_hold_compute_cells_only():
    """torch refuses anything but compute in a compute-only file, and lowers it itself."""
    schedule = generate("dualpipev", 2, 4, 2)
    for rank in range(2):
        for cell in torch_cells(schedule, rank, fsdp=True):
            assert torch_schedules._Action.from_str(cell).is_compute_op


@pytest.mark.parametrize("name", ["zbv", "interleaved-1f1b", "dualpipev"])
def test_torch_form_reads_back_with_its_step_cells(tmp_path, name):
    lowered = lower(build(name, 2, 4))
    path = tmp_path / "lowered.csv"
    schedule_to_csv(lowered, path, groups=False, fsdp=True)
    back = schedule_from_csv(path)
    assert back.programs == lowered.programs
    assert back.fused == lowered.fused
    assert not any(back.joins)  # a flat file has every transfer alone
    rows = [row.split(",") for row in path.read_text().splitlines()]
    for rank, (row, steps) in enumerate(zip(rows, back.meta[STEP_CELLS], strict=True)):
        assert [cell for _, cell in steps] == [cell for cell in row if parse_step_cell(cell)], rank
        for position, cell in steps:  # each REDUCE_GRAD follows every backward of its stage
            stage = parse_step_cell(cell)[0]
            if cell.endswith("REDUCE_GRAD"):
                assert all(action.stage != stage or action.kind in COMM_KINDS or action.kind in "FI"
                           for action in back.programs[rank][position:])


def test_groups_and_fsdp_cannot_be_combined(tmp_path):
    with pytest.raises(ValueError, match="only the torch form"):
        schedule_to_csv(lower(generate("1f1b", 2, 2)), tmp_path / "x.csv", groups=True, fsdp=True)


def test_the_torch_facing_schedule_modules_import_no_torch():
    """They describe torch's rules as data, so the simulator and the CLI use them without
    loading torch (schedules depends on networkx only)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, schedules.torch_steps, schedules.torch_compat, schedules.torch_runtime; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'simpy', 'pipesim', 'executor'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
