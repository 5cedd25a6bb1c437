"""The schedule object: per-rank programs plus the placement of stages on ranks.

A ``Schedule`` is plain data. Generators build one, passes (lowering, validation,
CSV) transform or check one, and the simulator and executor both walk the *same*
lowered programs, so what is predicted is exactly what is run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from typing import TypeVar

from schedules.action import COMM_KINDS, Action, format_group, format_overlap

T = TypeVar("T")


def looped_placement(pp: int, virtual_stages: int) -> tuple[int, ...]:
    """Stage ``s`` on rank ``s % pp`` (Megatron's interleaving): rank r holds r, r+pp, ..."""
    return tuple(stage % pp for stage in range(pp * virtual_stages))


def v_shape_placement(pp: int, virtual_stages: int) -> tuple[int, ...]:
    """Stages go down the ranks and back up (0..p-1, p-1..0, ...), as zero-bubble V
    schedules place them, so the last stage sits beside the first."""
    placement = []
    for chunk in range(virtual_stages):
        ranks = range(pp) if chunk % 2 == 0 else range(pp - 1, -1, -1)
        placement.extend(ranks)
    return tuple(placement)


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: which rank runs which action, in which order.

    ``placement[stage]`` is the rank that holds ``stage``; ``programs[rank]`` is that
    rank's ordered actions. ``name`` is the generator that built it (or the file it
    came from) and is carried into results so they say what they measured.

    ``joins[rank]`` holds the program positions whose communication action is posted in
    the same P2P group as the action just before it. A group (one ``batch_isend_irecv``,
    completing together) is a run of communication actions linked by joins; a
    communication action not joined to its predecessor starts a new group, so a lone
    SEND or RECV is a group of one. Groups are data, decided once by lowering (or written
    in a CSV), so the simulator and the executor post exactly the same batches.
    """

    pp: int
    microbatches: int
    placement: tuple[int, ...]
    programs: tuple[tuple[Action, ...], ...]
    name: str = "custom"
    meta: dict = field(default_factory=dict, compare=False, hash=False)
    joins: tuple[frozenset[int], ...] = ()
    # fused[rank]: positions of a B whose compute is overlapped with the F just before it
    # (DualPipe's OVERLAP_F_B pair: one step, one cost); empty for other schedules
    fused: tuple[frozenset[int], ...] = ()
    # copies of the model along the pipeline (DualPipe: 2), each its own chain of
    # num_stages / copies stages: data flows from stage s to s + 1 only inside one copy
    copies: int = 1

    def __post_init__(self) -> None:
        # Normalise lists handed in by callers so a Schedule is hashable, immutable data.
        object.__setattr__(self, "placement", tuple(self.placement))
        object.__setattr__(self, "programs", tuple(tuple(program) for program in self.programs))
        if self.pp < 1:
            raise ValueError(f"a schedule needs at least one pipeline rank, got pp={self.pp}")
        if self.microbatches < 1:
            raise ValueError(f"a schedule needs at least one microbatch, got {self.microbatches}")
        if len(self.programs) != self.pp:
            raise ValueError(f"pp={self.pp} ranks but {len(self.programs)} programs were given")
        if not self.placement:
            raise ValueError("a schedule needs at least one stage in its placement")
        if self.copies < 1 or len(self.placement) % self.copies:
            raise ValueError(f"{len(self.placement)} stages cannot be cut into {self.copies} copies of the model")
        for stage, rank in enumerate(self.placement):
            if not 0 <= rank < self.pp:
                raise ValueError(f"stage {stage} is placed on rank {rank}, outside 0..{self.pp - 1}")
        if not self.joins:
            object.__setattr__(self, "joins", tuple(frozenset() for _ in range(self.pp)))
        else:
            object.__setattr__(self, "joins", tuple(frozenset(joined) for joined in self.joins))
            self._check_joins()
        self._normalise_fused()

    def _check_joins(self) -> None:
        """A join links two neighbouring communication actions of one program."""
        if len(self.joins) != self.pp:
            raise ValueError(f"pp={self.pp} ranks but P2P groups were given for {len(self.joins)}")
        for rank, (program, joined) in enumerate(zip(self.programs, self.joins, strict=True)):
            if not joined:
                continue
            # the usual case at once (lowering joins ~100k positions of a large step), else each named
            if min(joined) >= 1 and max(joined) < len(program):
                kinds = {action[1] for action in map(program.__getitem__, joined)}
                kinds.update(action[1] for action in map(program.__getitem__, [position - 1 for position in joined]))
                if kinds <= COMM_KINDS:
                    continue
            for position in sorted(joined):
                if not 1 <= position < len(program):
                    raise ValueError(f"rank {rank}: a P2P group joins position {position}, outside the program")
                for action in (program[position - 1], program[position]):
                    if action.kind not in COMM_KINDS:
                        raise ValueError(
                            f"rank {rank}, position {position}: {action} is a compute action and cannot be "
                            f"part of a P2P group; groups hold SEND/RECV actions only"
                        )

    def _normalise_fused(self) -> None:
        """One frozenset per rank; each marks a backward right after a forward."""
        if not any(self.fused):
            object.__setattr__(self, "fused", tuple(frozenset() for _ in range(self.pp)))
            return
        object.__setattr__(self, "fused", tuple(frozenset(positions) for positions in self.fused))
        if len(self.fused) != self.pp:
            raise ValueError(f"pp={self.pp} ranks but overlapped pairs were given for {len(self.fused)}")
        for rank, (program, positions) in enumerate(zip(self.programs, self.fused, strict=True)):
            for position in positions:
                if not 1 <= position < len(program) or program[position - 1].kind != "F" or (
                        program[position].kind not in ("B", "I")):
                    shown = program[position] if 0 <= position < len(program) else "nothing"
                    raise ValueError(
                        f"rank {rank}, position {position}: an overlapped pair is a forward followed directly "
                        f"by a backward, but position {position} holds {shown}"
                    )

    def fused_pairs(self, rank: int) -> list[tuple[Action, Action]]:
        """``rank``'s overlapped (F, B) pairs, in program order."""
        program = self.programs[rank]
        return [(program[position - 1], program[position]) for position in sorted(self.fused[rank])]

    def with_fused_from(self, source: Schedule) -> Schedule:
        """This schedule with ``source``'s overlapped pairs marked at their positions here
        (found by the backward action, which is unique): how passes that insert or drop
        actions (lowering, ``compute_only``) carry the pairs along."""
        if not any(source.fused):
            return self
        fused = []
        for rank in range(self.pp):
            backwards = {backward for _, backward in source.fused_pairs(rank)}
            fused.append(frozenset(position for position, action in enumerate(self.programs[rank])
                                   if action in backwards))
        return dataclasses.replace(self, fused=tuple(fused), meta=dict(self.meta))

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def step_microbatches(self) -> int:
        """Microbatches of the whole step: ``microbatches`` go through each copy of the model
        (DualPipe feeds half of the step's from each end)."""
        return self.microbatches * self.copies

    @property
    def copy_stages(self) -> int:
        """Stages of one copy of the model (all of them unless the pipeline holds copies)."""
        return len(self.placement) // self.copies

    @property
    def first_stages(self) -> frozenset[int]:
        """Each copy's first stage, the one that reads the data (stage 0 without copies)."""
        return frozenset(copy * self.copy_stages for copy in range(self.copies))

    @property
    def last_stages(self) -> frozenset[int]:
        """Each copy's last stage, the one that takes the loss (the last stage without copies)."""
        return frozenset(stage + self.copy_stages - 1 for stage in self.first_stages)

    def same_copy(self, stage, other):
        """Whether stages ``stage`` and ``other`` (ints or numpy arrays) belong to one copy
        of the model, so data can flow between neighbours: the dataflow rule's one
        exception to ``s -> s + 1``, at the seam between two copies."""
        per_copy = len(self.placement) // self.copies
        return stage // per_copy == other // per_copy

    @property
    def virtual_stages(self) -> int:
        """Stages per rank (model chunks), when every rank holds the same number."""
        return self.num_stages // self.pp

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages held by ``rank``, ascending."""
        return tuple(stage for stage, owner in enumerate(self.placement) if owner == rank)

    @property
    def is_lowered(self) -> bool:
        """Whether the programs already carry their SEND/RECV actions (walked in C: a
        compute-only schedule has all of its actions looked at)."""
        return not COMM_KINDS.isdisjoint(map(attrgetter("kind"), chain.from_iterable(self.programs)))

    @property
    def num_actions(self) -> int:
        return sum(len(program) for program in self.programs)

    def program_items(self, rank: int) -> list[Action | tuple[Action, ...]]:
        """``rank``'s program as the runtime walks it: compute actions as they are, each
        P2P group as a tuple of its communication actions (a lone transfer is a group of
        one), in posting order. Built once per rank and kept: a schedule is immutable, and
        a planner simulates one lowered schedule for many layouts."""
        items = self.derived(f"program_items:{rank}", lambda schedule: tuple(schedule._build_program_items(rank)))
        return list(items)

    def __getstate__(self) -> dict:
        """Pickled without what ``derived`` kept: it is rebuilt where needed, and for a large
        schedule it is bigger than the schedule (the executor sends schedules to its ranks)."""
        state = dict(self.__dict__)
        state.pop("_derived", None)
        return state

    def derived(self, key: str, build: Callable[[Schedule], T]) -> T:
        """``build(self)``, computed once and kept with this schedule under ``key``.

        A schedule never changes after it is made, so what follows from it alone (its
        programs' groups, an engine's compiled form of them) can be kept; a planner
        simulates one lowered schedule for many layouts. Kept outside the dataclass
        fields: equality, hashing and ``replace`` ignore it."""
        cache = self.__dict__.get("_derived")
        if cache is None:
            cache = {}
            object.__setattr__(self, "_derived", cache)
        if key not in cache:
            cache[key] = build(self)
        return cache[key]

    def _build_program_items(self, rank: int) -> list[Action | tuple[Action, ...]]:
        joined = self.joins[rank]
        items: list[Action | tuple[Action, ...]] = []
        group: list[Action] = []
        for position, action in enumerate(self.programs[rank]):
            if action.kind in COMM_KINDS:
                if group and position not in joined:
                    items.append(tuple(group))
                    group = []
                group.append(action)
            else:
                if group:
                    items.append(tuple(group))
                    group = []
                items.append(action)
        if group:
            items.append(tuple(group))
        return items

    def program_text(self, rank: int) -> list[str]:
        """``rank``'s program in the text form, one cell per compute action or P2P group
        (``1SEND_F3+1RECV_B1``), an overlapped pair as one ``(F;B)OVERLAP_F_B`` cell: the
        cells of a CSV row."""
        fused = self.fused[rank]
        cells: list[str] = []
        position = 0
        for item in self.program_items(rank):
            if not isinstance(item, Action):
                cells.append(format_group(item))
                position += len(item)
                continue
            if position in fused:  # the forward just before it is the last cell
                cells[-1] = format_overlap(self.programs[rank][position - 1], item)
            else:
                cells.append(str(item))
            position += 1
        return cells

    def compute_only(self) -> Schedule:
        """The same schedule with communication actions removed."""
        programs = tuple(
            tuple(action for action in program if action.kind not in COMM_KINDS)
            for program in self.programs
        )
        return self.with_programs(programs)

    def with_programs(
        self, programs: Sequence[Sequence[Action]], joins: Sequence[frozenset[int]] = (),
        fused: Sequence[frozenset[int]] | None = None,
    ) -> Schedule:
        """A copy of this schedule with other programs (same ranks, stages, placement);
        ``joins`` gives the new programs' P2P groups (none: every transfer alone).

        Overlapped pairs belong to the programs: by default this schedule's pairs are
        carried to where their two actions now stand, and a pair the new programs no
        longer hold together (its backward gone, or not right after its forward) is an
        error naming it, never dropped in silence. ``fused`` gives the new programs' pairs
        instead (``()``: none, for a pass that pairs them again itself, as
        ``schedules.overlap.keep_pairs_together`` does after lowering)."""
        programs = tuple(tuple(program) for program in programs)
        if fused is None:
            fused = self._carried_pairs(programs) if any(self.fused) else ()
        return Schedule(
            pp=self.pp,
            microbatches=self.microbatches,
            placement=self.placement,
            programs=programs,
            name=self.name,
            meta=dict(self.meta),
            joins=tuple(joins),
            copies=self.copies,
            fused=tuple(fused),
        )

    def _carried_pairs(self, programs: tuple[tuple[Action, ...], ...]) -> tuple[frozenset[int], ...]:
        """This schedule's overlapped pairs at their positions in ``programs``; raise naming
        a pair they no longer hold together."""
        fused = []
        for rank, program in enumerate(programs):
            pairs = self.fused_pairs(rank) if rank < len(self.fused) else []
            position_of = {action: position for position, action in enumerate(program)} if pairs else {}
            kept = set()
            for forward, backward in pairs:
                position = position_of.get(backward)
                if position is None or position == 0 or program[position - 1] != forward:
                    raise ValueError(
                        f"rank {rank}: the new program does not hold the overlapped pair "
                        f"{format_overlap(forward, backward)} together ({backward} right after {forward}); "
                        f"keep them adjacent, or give the new pairs (fused=...) to drop or re-pair them")
                kept.add(position)
            fused.append(frozenset(kept))
        return tuple(fused)

    def describe(self) -> str:
        """A readable listing of every rank's program, one rank a line."""
        width = len(str(self.pp - 1))
        lines = [
            f"{self.name}: pp={self.pp}, stages={self.num_stages}, "
            f"microbatches={self.microbatches}, actions={self.num_actions}"
        ]
        for rank in range(self.pp):
            lines.append(f"rank {rank:>{width}}: " + " ".join(self.program_text(rank)))
        return "\n".join(lines)
