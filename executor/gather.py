"""Collect every rank's timed events on rank 0 as numbers, not pickles.

Each rank's program is known to every rank (it comes from the schedule), so a rank only
has to send, per event, the index of the action in its program, its start and end and
its stream: one float64 tensor that any backend can all-gather, with no object
serialisation on the way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from schedules.action import Action
from schedules.schedule import Schedule
from schedules.trace import STREAMS, TraceEvent


def encode(program: tuple[Action, ...], events: list[TraceEvent]) -> torch.Tensor:
    """Events as rows ``(index in program, start, end, stream)``."""
    position = {action: index for index, action in enumerate(program)}
    rows = [(position[Action(e.stage, e.kind, e.microbatch)], e.start, e.end, STREAMS.index(e.stream)) for e in events]
    return torch.tensor(rows, dtype=torch.float64).reshape(len(rows), 4)


def decode(rank: int, program: tuple[Action, ...], rows: torch.Tensor) -> list[TraceEvent]:
    return [TraceEvent.of(rank, program[int(index)], start, end, STREAMS[int(stream)])
            for index, start, end, stream in rows.tolist()]


def gather_events(schedule: Schedule, rank: int, events: list[TraceEvent], device: torch.device) -> list[TraceEvent]:
    """All ranks' events (on every rank; rank 0 is the one that writes them out)."""
    world = dist.get_world_size()
    rows = encode(schedule.programs[rank], events).to(device)
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([rows.shape[0]], dtype=torch.int64, device=device))
    longest = max(int(count.item()) for count in counts)
    padded = torch.zeros(longest, 4, dtype=torch.float64, device=device)
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    gathered: list[TraceEvent] = []
    for peer, (count, part) in enumerate(zip(counts, parts, strict=True)):
        gathered.extend(decode(peer, schedule.programs[peer], part[: int(count.item())].cpu()))
    return gathered
