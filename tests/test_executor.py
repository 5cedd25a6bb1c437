"""Numerics of the executor: pipelined steps on gloo equal the one-process reference.

One launch per pipeline size runs every schedule and microbatch count in a single
process group (spawning ranks dominates the cost on a 2-core CI machine), and each
parametrised test reads its own config's result from that launch.
"""

from __future__ import annotations

from collections import Counter

import pytest

from executor.config import RunConfig
from executor.launch import launch
from executor.reference import reference_run
from executor.worker import build_schedule
from schedules.action import Action, ActionKind
from schedules.generators import ScheduleUnavailableError, generate

pytestmark = pytest.mark.timeout(150)


def split_backward(schedule):
    """The schedule with every B split into I at its place and W at the program's end."""
    programs = []
    for program in schedule.programs:
        inputs = [Action(a.stage, ActionKind.I, a.microbatch) if a.kind == ActionKind.B else a for a in program]
        weights = [Action(a.stage, ActionKind.W, a.microbatch) for a in program if a.kind == ActionKind.B]
        programs.append(inputs + weights)
    return schedule.with_programs(programs)


def case_config(pp: int, schedule: str, microbatches: int, model: str = "mlp", variant: str = "") -> RunConfig:
    """A tiny float64 run: odd layer counts (uneven split) and a batch of 2m+1 (uneven
    microbatches). ``variant``: ``"IW"`` splits every B into I and W, ``"in-order"`` posts
    receives in program order (as on NCCL) instead of prefetching them, ``"empty-ends"``
    gives the first stage only the embedding and the last only the head."""
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    stages = pp * virtual
    sizes = {"hidden": 8, "layers": stages + 1} if model == "mlp" else \
        {"hidden": 8, "heads": 2, "layers": stages + 1, "seq_len": 4, "vocab": 11}
    custom = split_backward(generate(schedule, pp, microbatches, virtual)) if variant == "IW" else None
    layout = None
    if variant == "empty-ends":  # the first stage holds only the embedding, the last only the head (Meta's split)
        inner = max(stages - 2, 1)  # the stages between; at two stages the last holds every layer and the head
        middle = [sizes["layers"] // inner + (index < sizes["layers"] % inner) for index in range(inner)]
        layout = (0, *middle, 0) if stages > 2 else (0, sizes["layers"])
    return RunConfig(schedule=schedule, pp=pp, microbatches=microbatches, virtual_stages=virtual, model=model,
                     batch_size=2 * microbatches + 1, steps=3, dtype="float64", optimizer="adamw", lr=0.05,
                     return_grads=True, custom_schedule=custom, prefetch_recvs=variant != "in-order", layout=layout,
                     **sizes)


def cases(pp: int) -> list[tuple]:
    """(pp, schedule, m, model, variant) for every schedule that exists at these sizes."""
    found = []
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        for microbatches in (1, pp, 2 * pp + 1):
            try:
                generate(schedule, pp, microbatches, 2 if schedule == "interleaved-1f1b" else 1)
            except ScheduleUnavailableError:
                continue
            found.append((pp, schedule, microbatches, "mlp", ""))
    found.append((pp, "1f1b", pp, "gpt", ""))
    found.append((pp, "interleaved-1f1b", pp, "gpt", ""))
    found.append((pp, "1f1b", pp, "gpt", "empty-ends"))
    found.append((pp, "1f1b", pp, "mlp", "IW"))
    found.append((pp, "interleaved-1f1b", 2 * pp, "mlp", "in-order"))
    return found


CASES = cases(2) + cases(4)
_launched: dict[int, dict] = {}


def result_of(case: tuple) -> dict:
    """The result of one case, launching its pipeline size's job on first use."""
    pp = case[0]
    if pp not in _launched:
        own = [c for c in CASES if c[0] == pp]
        results = launch([case_config(*c) for c in own])
        _launched[pp] = dict(zip(own, results, strict=True))
    return _launched[pp][case]


def case_id(case: tuple) -> str:
    pp, schedule, microbatches, model, variant = case
    return f"p{pp}-{schedule}-m{microbatches}-{model}" + (f"-{variant}" if variant else "")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_step_matches_one_process_reference(case: tuple) -> None:
    config = case_config(*case)
    result, reference = result_of(case), reference_run(config)
    assert result["losses"][0] == pytest.approx(reference["losses"][0], abs=1e-10, rel=0)
    assert sorted(result["grads"]) == sorted(reference["grads"])
    for name, grad in reference["grads"].items():
        assert (result["grads"][name] - grad).abs().max().item() < 1e-10, name
    assert result["losses"] == pytest.approx(reference["losses"], abs=1e-10, rel=0)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_trace_holds_exactly_each_rank_program(case: tuple) -> None:
    config = case_config(*case)
    result, schedule = result_of(case), build_schedule(config)
    trace = result["trace"]
    assert trace.meta["source"] == "measured"
    assert (trace.meta["pp"], trace.meta["virtual_stages"]) == (config.pp, config.virtual_stages)
    for rank, program in enumerate(schedule.programs):
        events = [event for event in trace.of_rank(rank) if event.stream != "step"]
        # after the program: the optimizer step and the loss all-reduce, in that order (executor.step_tail)
        tail = [event for event in trace.of_rank(rank) if event.stream == "step"]
        assert [event.action for event in tail] == ["OPTIMIZER", "LOSS_ALLREDUCE"]
        assert tail[0].start >= max(event.end for event in events)
        assert Counter(event.action for event in events) == Counter(str(action) for action in program)
        compute = [e.action for e in sorted(events, key=lambda e: e.start) if e.stream == "compute"]
        assert compute == [str(a) for a in program if a.is_compute]
        assert all(event.end >= event.start >= 0 for event in events)
