"""CSV import and export in the format ``torch.distributed.pipelining`` dumps and loads.

One row per rank, one action per cell in program order (``0F0``, ``3SEND_F1``), an
empty cell for an idle step. In a lowered schedule a cell may hold a P2P group, the
transfers posted together, joined by ``+`` (``1SEND_F3+1RECV_B1``): pipesim's own form.
torch's form has no groups and holds torch's step-level cells (``0REDUCE_GRAD``,
``0UNSHARD``, ``0RESHARD``, ``schedules.torch_steps``), which the reader keeps aside. There is no header
and no placement column: on import the
placement is inferred from which rank's row holds which stage, the microbatch count
from the largest microbatch seen, and the rank count from the number of rows. So a
schedule drawn up in torch (or by hand in a spreadsheet) can be checked and simulated
here, and one built here can be loaded there.
"""

from __future__ import annotations

import csv
import io
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from schedules.action import Action, ActionKind, ActionParseError, parse_group, parse_overlap
from schedules.schedule import Schedule
from schedules.textfile import read_text, write_whole
from schedules.torch_steps import STEP_CELLS, parse_step_cell, torch_cells


class ScheduleCsvError(ValueError):
    """A CSV file that does not describe a schedule; the message names file, row and cell."""


def schedule_to_csv(schedule: Schedule, path_or_file: str | Path | IO[str], groups: bool = True,
                    fsdp: bool = False) -> None:
    """Write one row per rank, one action per cell (no idle cells: programs are dense).

    ``groups``: each P2P group in one cell, joined by ``+`` (pipesim's own form).
    ``groups=False`` writes the form torch.distributed.pipelining's runtime runs as
    written: it has no P2P groups (read back, every transfer is alone), and a lowered
    schedule gets torch's ``REDUCE_GRAD`` after each stage's last backward (and with
    ``fsdp`` its ``UNSHARD``/``RESHARD``), where torch's own lowering puts them
    (``schedules.torch_steps``)."""
    if fsdp and groups:
        raise ValueError("fsdp=True writes torch's UNSHARD/RESHARD, which only the torch form (groups=False) holds")
    if isinstance(path_or_file, (str, Path)):
        write_whole(path_or_file, lambda handle: _write(schedule, handle, groups, fsdp))
    else:
        _write(schedule, path_or_file, groups, fsdp)


def _write(schedule: Schedule, handle: IO[str], groups: bool, fsdp: bool) -> None:
    if schedule.copies > 1:  # read back, its seams would carry data: another schedule
        raise ValueError(f"{schedule.name} holds {schedule.copies} copies of the model, which the CSV form "
                         f"(torch.distributed.pipelining's) cannot say; it has no file form")
    writer = csv.writer(handle)
    for rank in range(schedule.pp):
        if groups:
            writer.writerow(schedule.program_text(rank))
        else:
            writer.writerow(torch_cells(schedule, rank, fsdp))


def schedule_from_csv(
    path: str | Path | IO[str], name: str | None = None, microbatches: int | None = None
) -> Schedule:
    """Read a schedule; ``name`` defaults to the file's name without its extension.

    ``microbatches`` is the step's microbatch count; ``None`` takes the number of
    distinct microbatches per stage. Raises ``ScheduleCsvError`` for a cell that is not
    an action, a stage held by two ranks, a gap in the stages, or a microbatch index
    out of ``0 … microbatches-1`` or missing from a stage. The result is not validated
    otherwise: call ``validate`` for completeness, order and deadlocks.
    """
    if isinstance(path, (str, Path)):
        label = str(path)
        rows = list(csv.reader(io.StringIO(read_text(path, "schedule CSV"), newline="")))
        default_name = Path(path).stem
    else:
        label = getattr(path, "name", "<csv>")
        rows = list(csv.reader(path))
        default_name = Path(label).stem if label != "<csv>" else "csv"
    parsed = [_parse_row(label, rank, row) for rank, row in enumerate(rows)]
    programs = [program for program, _, _, _ in parsed]
    joins = [joined for _, joined, _, _ in parsed]
    fused = tuple(frozenset(pairs) for _, _, pairs, _ in parsed)
    step_cells = tuple(tuple(steps) for _, _, _, steps in parsed)
    if not programs:
        raise ScheduleCsvError(f"{label}: the file is empty; expected one row of actions per rank")
    placement = _infer_placement(label, programs)
    if not any(programs):
        raise ScheduleCsvError(f"{label}: no row holds any action; expected one row of actions per rank")
    microbatches = _check_microbatches(label, programs, microbatches)
    return Schedule(
        pp=len(programs),
        microbatches=microbatches,
        placement=placement,
        programs=programs,
        name=name if name is not None else default_name,
        joins=joins,
        fused=fused,
        meta={STEP_CELLS: step_cells} if any(step_cells) else {},
    )


def _parse_row(label: str, rank: int, row: Iterable[str]
               ) -> tuple[list[Action], frozenset[int], list[int], list[tuple[int, str]]]:
    """Row ``rank`` as a program, its P2P groups (the positions joined to the action
    before them), its overlapped pairs (the positions of their backwards) and torch's
    step-level cells (``REDUCE_GRAD``, ``UNSHARD``, ``RESHARD``: kept aside with the
    program position they precede, since they move no data between ranks); empty
    cells (idle steps) are skipped. A cell is one action, a group of SEND/RECV actions
    joined by ``+`` (a transfer alone in its cell is posted alone), or torch's
    ``(F;B)OVERLAP_F_B`` pair."""
    program: list[Action] = []
    joined: set[int] = set()
    fused: list[int] = []
    steps: list[tuple[int, str]] = []
    for column, cell in enumerate(row):
        if not cell.strip():
            continue
        if parse_step_cell(cell) is not None:
            steps.append((len(program), cell.strip()))
            continue
        try:
            pair = parse_overlap(cell)
            if pair is not None:
                fused.append(len(program) + 1)
            group = pair if pair is not None else parse_group(cell)
        except ActionParseError as error:
            raise ScheduleCsvError(
                f"{label}: row {rank + 1} (rank {rank}), column {column + 1}: cell {error}"
            ) from error
        if pair is None:
            joined.update(range(len(program) + 1, len(program) + len(group)))
        program.extend(group)
    return program, frozenset(joined), fused, steps


def _infer_placement(label: str, programs: list[list[Action]]) -> tuple[int, ...]:
    """Stage -> rank from where each stage's actions sit; every stage 0..max on one rank."""
    owner: dict[int, tuple[int, int]] = {}  # stage -> (rank, column of first sighting)
    for rank, program in enumerate(programs):
        for index, action in enumerate(program):
            seen = owner.get(action.stage)
            if seen is None:
                owner[action.stage] = (rank, index)
            elif seen[0] != rank:
                raise ScheduleCsvError(
                    f"{label}: stage {action.stage} is held by two ranks: rank {seen[0]} (row {seen[0] + 1}) "
                    f"and rank {rank} (row {rank + 1}, action {action}); each stage lives on exactly one rank"
                )
    if not owner:
        return ()
    missing = [stage for stage in range(max(owner) + 1) if stage not in owner]
    if missing:
        raise ScheduleCsvError(
            f"{label}: stage {missing[0]} appears in no row, but stages up to {max(owner)} do; "
            f"every stage from 0 to {max(owner)} needs its actions on some rank"
            + (f" (also missing: {', '.join(map(str, missing[1:8]))})" if len(missing) > 1 else "")
        )
    return tuple(owner[stage][0] for stage in range(len(owner)))


def _check_majority(label: str, seen: dict[int, dict[int, Action]]) -> None:
    """Where most stages hold one set of microbatches and a few another, name the few:
    the odd stage is the one to fix, not the others (which the count, taken from the
    most microbatches on any stage, would otherwise blame for missing one)."""
    held = {stage: frozenset(by_microbatch) for stage, by_microbatch in seen.items()}
    majority, votes = Counter(held.values()).most_common(1)[0]
    odd = sorted(stage for stage, microbatches in held.items() if microbatches != majority)
    if not odd or votes <= len(odd):
        return
    stage = odd[0]
    extra = [seen[stage][microbatch] for microbatch in sorted(held[stage] - majority)]
    missing = [Action(stage, ActionKind.F, microbatch) for microbatch in sorted(majority - held[stage])]
    wrong = [f"{action} (not on the others)" for action in extra[:3]]
    wrong += [f"{action} (missing)" for action in missing[:3]]
    others = f"the other {votes} stages" if len(odd) == 1 else f"{votes} of the {len(held)} stages"
    raise ScheduleCsvError(
        f"{label}: stage {stage} differs from {others}, which hold microbatches {_numbers(sorted(majority))}: "
        f"{', '.join(wrong)}" + (f" (stages {', '.join(map(str, odd))} differ)" if len(odd) > 1 else ""))


def _numbers(values: list[int]) -> str:
    """``0 to 7`` for a run, else the list."""
    if values == list(range(values[0], values[-1] + 1)) and len(values) > 2:
        return f"{values[0]} to {values[-1]}"
    return ", ".join(map(str, values))


def _check_microbatches(label: str, programs: list[list[Action]], given: int | None) -> int:
    """The microbatch count: ``given``, or the most distinct microbatches any stage holds;
    then every stage must hold exactly microbatches ``0 … count-1``."""
    if given is not None and given < 1:
        raise ScheduleCsvError(f"{label}: the microbatch count must be at least 1, got {given}")
    seen: dict[int, dict[int, Action]] = {}  # stage -> microbatch -> first action naming it
    for program in programs:
        for action in program:
            seen.setdefault(action.stage, {}).setdefault(action.microbatch, action)
    if given is None:
        _check_majority(label, seen)
    count = given if given is not None else max(len(by_microbatch) for by_microbatch in seen.values())
    source = "as given" if given is not None else "the most distinct microbatches on one stage"
    problems = []
    for stage in sorted(seen):
        out_of_range = [action for microbatch, action in sorted(seen[stage].items()) if microbatch >= count]
        missing = [microbatch for microbatch in range(count) if microbatch not in seen[stage]]
        problems += [f"{action} (out of range)" for action in out_of_range[:3]]
        problems += [f"{Action(stage, ActionKind.F, microbatch)} (missing)" for microbatch in missing[:3]]
        if len(problems) >= 4:
            break
    if problems:
        raise ScheduleCsvError(
            f"{label}: {count} microbatches ({source}) must be numbered 0 to {count - 1} on every stage: "
            f"{', '.join(problems[:4])}"
        )
    return count
