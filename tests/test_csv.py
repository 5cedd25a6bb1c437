"""CSV import/export: exact round trips, placement inference, messages that point at the
bad cell, and compatibility with torch.distributed.pipelining's own reader."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from schedules import (
    ScheduleCsvError,
    generate,
    lower,
    parse_action,
    schedule_from_csv,
    schedule_to_csv,
    v_shape_placement,
    validate,
)
from schedules.schedule import Schedule


def same_schedule(left: Schedule, right: Schedule) -> bool:
    return (left.pp, left.microbatches, left.placement, left.programs) == (
        right.pp, right.microbatches, right.placement, right.programs
    )


def write(tmp_path: Path, text: str, name: str = "order.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("name", "pp", "microbatches", "virtual_stages"),
    [("gpipe", 3, 5, 1), ("1f1b", 4, 8, 1), ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 2, 3, 3)],
)
@pytest.mark.parametrize("lowered", [False, True])
def test_round_trip_through_a_file(tmp_path, name, pp, microbatches, virtual_stages, lowered):
    schedule = generate(name, pp, microbatches, virtual_stages)
    if lowered:
        schedule = lower(schedule)
    path = tmp_path / "schedule.csv"
    schedule_to_csv(schedule, path)
    loaded = schedule_from_csv(path)
    assert same_schedule(loaded, schedule)
    assert loaded.name == "schedule"
    assert schedule_from_csv(path, name="mine").name == "mine"


def test_a_file_is_replaced_whole_never_seen_truncated(tmp_path):
    """Each spawned rank of a user's script re-runs its top level, so several processes
    save and load the same file at once: a reader must never see it empty or half written.
    Another process rewrites the file in a loop while this one reads it."""
    import multiprocessing
    import os

    schedule = generate("1f1b", 4, 8)
    path = tmp_path / "1f1b.csv"
    schedule_to_csv(schedule, path)
    writer = multiprocessing.get_context("spawn").Process(target=_rewrite, args=(path, 400), daemon=True)
    writer.start()
    try:
        reads = 0
        while writer.is_alive() or reads < 50:
            assert same_schedule(schedule_from_csv(path), schedule)
            reads += 1
    finally:
        writer.join(timeout=60)
    assert writer.exitcode == 0
    assert [entry.name for entry in tmp_path.iterdir()] == ["1f1b.csv"]  # no sibling left behind
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~_umask()


def _rewrite(path: Path, times: int) -> None:
    schedule = generate("1f1b", 4, 8)
    for _ in range(times):
        schedule_to_csv(schedule, path)


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_failed_write_leaves_the_old_file_and_no_sibling(tmp_path):
    path = tmp_path / "two.csv"
    schedule_to_csv(generate("1f1b", 2, 4), path)
    before = path.read_text()
    with pytest.raises(ValueError, match="copies of the model"):
        schedule_to_csv(generate("dualpipe", 4, 8, 2), path)
    assert path.read_text() == before
    assert [entry.name for entry in tmp_path.iterdir()] == ["two.csv"]


def test_writing_into_a_missing_folder_names_the_file(tmp_path):
    target = tmp_path / "nowhere" / "s.csv"
    with pytest.raises(FileNotFoundError) as raised:
        schedule_to_csv(generate("1f1b", 2, 4), target)
    assert raised.value.filename == str(target)


def test_round_trip_through_a_file_object():
    schedule = lower(generate("1f1b", 3, 4))
    buffer = io.StringIO()
    schedule_to_csv(schedule, buffer)
    assert buffer.getvalue().splitlines()[0].startswith("0F0,0SEND_F0,0F1,0SEND_F1")
    buffer.seek(0)
    assert same_schedule(schedule_from_csv(buffer), schedule)


def test_v_shaped_placement_is_inferred_from_rows(tmp_path):
    placement = v_shape_placement(2, 2)  # stages 0,1,2,3 on ranks 0,1,1,0
    programs = [
        [parse_action(text) for text in "0F0 3F0 3B0 0B0".split()],
        [parse_action(text) for text in "1F0 2F0 2B0 1B0".split()],
    ]
    schedule = Schedule(2, 1, placement, programs)
    validate(schedule)
    path = tmp_path / "v.csv"
    schedule_to_csv(schedule, path)
    loaded = schedule_from_csv(path)
    assert loaded.placement == (0, 1, 1, 0)
    assert same_schedule(loaded, schedule)


def test_empty_cells_are_idle_steps(tmp_path):
    path = write(tmp_path, "0F0,,0F1,,0B0,0B1\n,1F0,1B0,1F1,1B1,\n")
    loaded = schedule_from_csv(path)
    assert [str(action) for action in loaded.programs[0]] == ["0F0", "0F1", "0B0", "0B1"]
    assert [str(action) for action in loaded.programs[1]] == ["1F0", "1B0", "1F1", "1B1"]
    assert (loaded.pp, loaded.microbatches, loaded.placement) == (2, 2, (0, 1))


def test_microbatches_and_pp_are_inferred(tmp_path):
    loaded = schedule_from_csv(write(tmp_path, "0F0,0F1,0F2,0B0,0B1,0B2\n1F0,1F1,1F2,1B0,1B1,1B2\n\n"))
    assert loaded.microbatches == 3
    assert loaded.pp == 3  # the empty last row is an idle third rank
    assert loaded.programs[2] == ()


def test_bad_cell_names_file_row_rank_column_and_text(tmp_path):
    path = write(tmp_path, "0F0,0B0\n1F0,1X0\n", name="bad.csv")
    with pytest.raises(ScheduleCsvError) as caught:
        schedule_from_csv(path)
    text = str(caught.value)
    assert str(path) in text
    assert "row 2 (rank 1), column 2: cell '1X0' has unknown kind 'X'; valid kinds:" in text


def test_garbage_cell(tmp_path):
    path = write(tmp_path, "0F0,forward,0B0\n")
    with pytest.raises(ScheduleCsvError, match=r"row 1 \(rank 0\), column 2: cell 'forward' is not an action"):
        schedule_from_csv(path)


def test_stage_on_two_ranks_is_named(tmp_path):
    path = write(tmp_path, "0F0,1F0,0B0\n1F0,1B0\n")
    with pytest.raises(ScheduleCsvError) as caught:
        schedule_from_csv(path)
    assert "stage 1 is held by two ranks: rank 0 (row 1) and rank 1 (row 2" in str(caught.value)


def test_stage_held_by_nobody_is_named(tmp_path):
    path = write(tmp_path, "0F0,0B0\n2F0,2B0\n")
    with pytest.raises(ScheduleCsvError, match="stage 1 appears in no row, but stages up to 2 do"):
        schedule_from_csv(path)


def test_empty_file(tmp_path):
    with pytest.raises(ScheduleCsvError, match="the file is empty"):
        schedule_from_csv(write(tmp_path, ""))


# --- torch.distributed.pipelining reads what we write ----------------------------------

@pytest.fixture
def torch_schedules():
    """torch's pipelining schedules, or a skip of only the tests that ask for them (a
    module-level importorskip would skip the torch-free tests above too)."""
    return pytest.importorskip("torch.distributed.pipelining.schedules")


def bare_torch_schedule(cls, schedule: Schedule):
    """A torch schedule object with just what its CSV loader needs (no process group,
    no model stages): its loader is what is under test."""
    loader = object.__new__(cls)
    loader.pipeline_order = {}
    loader.pp_group_size = schedule.pp
    loader._num_stages = schedule.num_stages
    loader._n_microbatches = schedule.microbatches
    loader._stages = []
    return loader


@pytest.mark.parametrize(
    ("name", "pp", "microbatches", "virtual_stages"),
    [("gpipe", 3, 5, 1), ("1f1b", 4, 8, 1), ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 3, 2, 2)],
)
def test_torch_loads_our_compute_only_csv(tmp_path, torch_schedules, name, pp, microbatches, virtual_stages):
    schedule = generate(name, pp, microbatches, virtual_stages)
    path = tmp_path / "order.csv"
    schedule_to_csv(schedule, path)
    for row in path.read_text().splitlines():
        for cell in row.split(","):
            assert str(torch_schedules._Action.from_str(cell)) == cell
    loader = bare_torch_schedule(torch_schedules.PipelineScheduleMulti, schedule)
    loader._load_csv(str(path))  # runs torch's own order checks and placement inference
    assert loader.stage_index_to_group_rank == dict(enumerate(schedule.placement))
    assert [[str(action) for action in loader.pipeline_order[rank]] for rank in range(pp)] == [
        [str(action) for action in program] for program in schedule.programs
    ]


@pytest.mark.parametrize(("name", "pp", "microbatches", "virtual_stages"),
                         [("1f1b", 4, 6, 1), ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 4, 2, 3)])
def test_torch_loads_and_simulates_our_lowered_csv(tmp_path, torch_schedules, name, pp, microbatches,
                                                  virtual_stages):
    schedule = lower(generate(name, pp, microbatches, virtual_stages))
    path = tmp_path / "lowered.csv"
    schedule_to_csv(schedule, path, groups=False)  # torch has no P2P groups
    loader = bare_torch_schedule(torch_schedules._PipelineScheduleRuntime, schedule)
    loader._load_csv(str(path), format="compute_comms")
    order = loader.pipeline_order_with_comms
    loaded = [[str(action) for action in order[rank]] for rank in range(pp)]
    assert loaded == [row.split(",") for row in path.read_text().splitlines()]
    # every action of ours, in our order, plus torch's step-level REDUCE_GRAD of each stage
    assert [[cell for cell in row if not cell.endswith("REDUCE_GRAD")] for row in loaded] == [
        [str(action) for action in program] for program in schedule.programs
    ]
    assert sorted(cell for row in loaded for cell in row if cell.endswith("REDUCE_GRAD")) == sorted(
        f"{stage}REDUCE_GRAD" for stage in range(schedule.num_stages))
    # torch's dry-run raises "Schedule is not progressing" on a deadlock; it agrees ours has none.
    torch_schedules._simulate_comms_compute(without_step_actions(torch_schedules, order),
                                            lambda stage: schedule.placement[stage], schedule.num_stages)


def without_step_actions(torch_schedules, order: dict) -> dict:
    """``order`` without REDUCE_GRAD: torch's dry run moves only data and knows no
    step-level action (it refuses the REDUCE_GRAD of its own lowering too)."""
    return {rank: [action for action in actions if action.computation_type != torch_schedules.REDUCE_GRAD]
            for rank, actions in order.items()}


def test_torch_simulator_also_finds_our_deadlock(tmp_path, capsys, torch_schedules):
    programs = [[parse_action(text) for text in row.split()] for row in ["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"]]
    schedule = lower(Schedule(2, 2, (0, 1), programs))
    path = tmp_path / "deadlock.csv"
    schedule_to_csv(schedule, path, groups=False)
    loader = bare_torch_schedule(torch_schedules._PipelineScheduleRuntime, schedule)
    loader._load_csv(str(path), format="compute_comms")
    with pytest.raises(ValueError, match="not progressing"):
        torch_schedules._simulate_comms_compute(
            without_step_actions(torch_schedules, loader.pipeline_order_with_comms),
            lambda stage: schedule.placement[stage], schedule.num_stages,
        )
