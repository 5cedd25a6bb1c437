"""Collect every rank's timed events on rank 0 as numbers, not pickles.

Each rank's program is known to every rank (it comes from the schedule), so a rank only
has to send, per event, the index of the action in its program, its start and end and
its stream: one float64 tensor that any backend can all-gather, with no object
serialisation on the way. Collective events that are not program actions (a stage's dp
bucket: all-reduce, reduce-scatter or parameter all-gather; a tp collective, an ep
all-to-all or a ring attention's wait for a block inside a compute action) travel as
index -1 with a kind code, their stage, microbatch and bucket (the step's tail after the
pipeline, ``executor.step_tail``, with its kind's code alone); ZeRO-3's (FSDP2's) gathers
and reduce-scatters as dp events with their unit in the bucket's place and the kind of
the action they serve in a column of their own.

With dp or tp > 1 the gather runs along one pipeline (the pp group of the mesh): the
Trace shows one replica's pipeline, as the simulator does, with its dp and tp streams.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from executor.data_parallel import ALL_REDUCE, PARAM_GATHER, REDUCE_SCATTER
from executor.inside_timing import CP_KIND, EP_KIND
from executor.step_tail import TAIL_KINDS, tail_event
from schedules.action import COMPUTE_KINDS, Action, parse_action
from schedules.schedule import Schedule
from schedules.trace import STREAMS, TraceEvent

# Streams and kinds beyond a program's actions, named as the simulator names them.
ALL_STREAMS = (*STREAMS, "dp", "tp", "ep", "cp", "step")
DP_KIND, TP_KIND = ALL_REDUCE, "TP"
DP_KINDS = (ALL_REDUCE, REDUCE_SCATTER, PARAM_GATHER)  # a dp event's code is minus the index of its kind
# collectives inside a compute action, by kind, and the stream each is drawn on
INSIDE_STREAMS = {TP_KIND: "tp", EP_KIND: "ep", CP_KIND: "cp"}
INSIDE_KINDS = tuple(INSIDE_STREAMS)
# FSDP's unit that is a stage itself (embedding, final norm, head), beside its blocks' 0, 1, ...
ROOT_UNIT = -1
# an inside event's code is 1 + the index of its action's kind in COMPUTE_KINDS, plus
# len(COMPUTE_KINDS) times the index of its own kind in INSIDE_KINDS
COLUMNS = 9  # index, start, end, stream, extra code, stage, microbatch, bucket, served kind
# the step's tail (executor.step_tail): codes after the inside collectives', one per kind
TAIL_CODE = 1 + len(COMPUTE_KINDS) * len(INSIDE_KINDS)


def dp_event(rank: int, stage: int, start: float, end: float, kind: str = ALL_REDUCE,
             bucket: int = 0) -> TraceEvent:
    """One bucket of ``stage``'s gradient reduction (or, under ZeRO, of its parameter
    all-gather) on the ``dp`` stream, named as the simulator names it: ``0ALLREDUCE_DP[1]``."""
    return TraceEvent(rank, f"{stage}{kind}[{bucket}]", kind, stage, -1, start, end, "dp")


def bucket_of(event: TraceEvent) -> int:
    """The bucket index in a dp event's name (``0ALLREDUCE_DP[1]`` -> 1)."""
    return int(event.action.rsplit("[", 1)[1].rstrip("]"))


def fsdp_event(rank: int, kind: str, unit: int, action: Action, start: float, end: float) -> TraceEvent:
    """One of FSDP2's collectives (ZeRO-3) for compute ``action`` on the ``dp`` stream: unit
    ``unit``'s parameter all-gather (``0ALLGATHER_PARAMS[L1](0F2)``, as the simulator names
    ZeRO-3's gathers) or its gradient reduce-scatter (``0REDUCE_SCATTER_DP[L1](0B2)``); the
    stage's own unit (``ROOT_UNIT``) is ``root``."""
    name = "root" if unit == ROOT_UNIT else f"L{unit}"
    return TraceEvent(rank, f"{action.stage}{kind}[{name}]({action})", kind, action.stage, action.microbatch,
                      start, end, "dp")


def is_fsdp(event: TraceEvent) -> bool:
    """Whether a dp event is one of FSDP2's, which serve an action (ZeRO-1/2's buckets serve the step)."""
    return event.kind in DP_KINDS and event.action.endswith(")")


def _fsdp_fields(event: TraceEvent) -> tuple[int, Action]:
    """The unit and the served action in an FSDP event's name."""
    unit, served = event.action.split("[", 1)[1].split("](", 1)
    return (ROOT_UNIT if unit == "root" else int(unit[1:])), parse_action(served[:-1])


def inside_event(rank: int, action: Action, start: float, end: float, kind: str = TP_KIND) -> TraceEvent:
    """One collective of ``kind`` (a tp collective, an ep all-to-all) issued inside compute
    ``action``, on its stream: ``TP(1F0)``, ``ALLTOALL_EP(1B2)``."""
    return TraceEvent(rank, f"{kind}({action})", kind, action.stage, action.microbatch, start, end,
                      INSIDE_STREAMS[kind])


def encode(program: tuple[Action, ...], events: list[TraceEvent]) -> torch.Tensor:
    """Events as rows ``(index in program or -1, start, end, stream, extra code, stage,
    microbatch, bucket, served kind)``; extra code ``-k`` is a dp event of kind
    ``DP_KINDS[k]`` (an FSDP one when its served kind, the index of its action's kind in
    COMPUTE_KINDS, is not -1; its unit is in the bucket's place), ``1 + k + j *
    len(COMPUTE_KINDS)`` a collective of kind ``INSIDE_KINDS[j]`` inside an action of kind
    ``COMPUTE_KINDS[k]``, ``TAIL_CODE + t`` the part ``TAIL_KINDS[t]`` of the step's tail."""
    position = {action: index for index, action in enumerate(program)}
    rows = []
    for e in events:
        stream = ALL_STREAMS.index(e.stream)
        if e.kind in TAIL_KINDS:
            rows.append((-1, e.start, e.end, stream, TAIL_CODE + TAIL_KINDS.index(e.kind), -1, -1, 0, -1))
        elif is_fsdp(e):
            unit, served = _fsdp_fields(e)
            rows.append((-1, e.start, e.end, stream, -DP_KINDS.index(e.kind), e.stage, e.microbatch, unit,
                         COMPUTE_KINDS.index(served.kind)))
        elif e.kind in DP_KINDS:
            rows.append((-1, e.start, e.end, stream, -DP_KINDS.index(e.kind), e.stage, e.microbatch, bucket_of(e), -1))
        elif e.kind in INSIDE_STREAMS:
            inner = e.action[len(e.kind) + 1:-1]
            code = 1 + COMPUTE_KINDS.index(parse_action(inner).kind) + len(COMPUTE_KINDS) * INSIDE_KINDS.index(e.kind)
            rows.append((-1, e.start, e.end, stream, code, e.stage, e.microbatch, 0, -1))
        else:
            index = position[Action(e.stage, e.kind, e.microbatch)]
            rows.append((index, e.start, e.end, stream, -1, e.stage, e.microbatch, 0, -1))
    return torch.tensor(rows, dtype=torch.float64).reshape(len(rows), COLUMNS)


def decode(rank: int, program: tuple[Action, ...], rows: torch.Tensor) -> list[TraceEvent]:
    events = []
    for index, start, end, stream, code, stage, microbatch, bucket, served in rows.tolist():
        if index >= 0:
            events.append(TraceEvent.of(rank, program[int(index)], start, end, ALL_STREAMS[int(stream)]))
        elif code <= 0 and served >= 0:
            action = Action(int(stage), COMPUTE_KINDS[int(served)], int(microbatch))
            events.append(fsdp_event(rank, DP_KINDS[-int(code)], int(bucket), action, start, end))
        elif code <= 0:
            events.append(dp_event(rank, int(stage), start, end, DP_KINDS[-int(code)], int(bucket)))
        elif code >= TAIL_CODE:
            events.append(tail_event(rank, TAIL_KINDS[int(code) - TAIL_CODE], start, end))
        else:
            inside, kind = divmod(int(code) - 1, len(COMPUTE_KINDS))
            action = Action(int(stage), COMPUTE_KINDS[kind], int(microbatch))
            events.append(inside_event(rank, action, start, end, INSIDE_KINDS[inside]))
    return events


def gather_events(schedule: Schedule, rank: int, events: list[TraceEvent], device: torch.device,
                  group: dist.ProcessGroup | None = None) -> list[TraceEvent]:
    """All pipeline ranks' events (on every member of ``group``, the pp group; rank 0
    of the job is the one that writes them out). ``rank`` is the pipeline rank."""
    world = dist.get_world_size(group)
    rows = encode(schedule.programs[rank], events).to(device)
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([rows.shape[0]], dtype=torch.int64, device=device), group=group)
    sizes = torch.cat(counts).tolist()  # one device-to-host copy for every rank's count
    longest = max(sizes)
    padded = torch.zeros(longest, COLUMNS, dtype=torch.float64, device=device)
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    gathered: list[TraceEvent] = []
    for peer, (size, part) in enumerate(zip(sizes, parts, strict=True)):
        gathered.extend(decode(peer, schedule.programs[peer], part[:size].cpu()))
    return gathered
