"""Bidirectional DualPipe executed: two copies of the model along one pipeline, fed from
both ends (``executor.copies``). For pp in {2, 4} on gloo, float64, with an uneven batch
and an uneven layer split, pp 2 beside dp 2, ZeRO-1 and 2 (the optimizer sharded over
both copies' holders, alone and beside dp 2), tp 2 (with sequence parallelism and ZeRO-1),
cp 2 (with ZeRO-2) and a shrunk Mixtral's ep 2 beside dp 2 (with ZeRO-1): every step's loss, every gradient and the
weights after the last step equal the one-process reference to 1e-10 (each copy sees
half the microbatches; the reduction over both copies' holders gives each the whole
batch's gradient), each rank runs exactly its program, each stage's reduction is posted
during its last backward, and the memory it holds is what ``run`` predicts within 10%.
``profile`` refuses it in one line."""

from __future__ import annotations

import dataclasses
import json

import pytest

from executor.config import RunConfig, build_schedule
from executor.copies import check_mirrored, data_index, model_stage, reducing_order
from executor.expert_parallel import expert_groups_of
from executor.launch import launch
from executor.mesh import MeshPosition
from executor.reference import reference_run
from pipesim.cli import main
from pipesim.cli.run import predict_static_memory
from pipesim.cli.run_memory import peak_lines
from schedules import generate
from schedules.trace import Trace
from tests.program_checks import assert_each_rank_ran_its_program

pytestmark = pytest.mark.timeout(300)

TP2, SP = ("tp", 2), ("sequence_parallel", True)
CP2 = (("cp", 2), ("hidden", 16), ("heads", 4), ("kv_heads", 2), ("seq_len", 8))  # ring attention: a rotary model
EP2 = (("ep", 2), ("hidden", 16), ("heads", 4), ("kv_heads", 2), ("experts", 4), ("seq_len", 8), ("vocab", 37))
# (pp, model, dp[, zero[, other RunConfig fields]])
CASES = [(2, "mlp", 1), (4, "mlp", 1), (2, "gpt", 1), (2, "gpt", 2), (2, "gpt", 1, 1), (2, "gpt", 1, 2),
         (4, "mlp", 1, 2), (2, "gpt", 2, 1), (2, "gpt", 2, 2), (2, "gpt", 1, 0, (TP2,)), (2, "gpt", 1, 1, (TP2, SP)),
         (2, "llama3-8b", 1, 0, CP2), (2, "llama3-8b", 1, 2, CP2), (2, "mixtral-8x7b", 2, 0, EP2),
         (2, "mixtral-8x7b", 2, 1, EP2)]
_launched: dict[tuple, dict] = {}


def case_config(pp: int, model: str, dp: int = 1, zero: int = 0, fields: tuple = ()) -> RunConfig:
    """4p microbatches (2p from each end, dualpipe's least) over a batch of 8p + 1 per
    replica, uneven (dp 2: one more sequence to split), one layer more than stages (an
    uneven split), AdamW over 3 steps."""
    microbatches = 4 * pp
    shape = {"hidden": 8, "heads": 2, "seq_len": 4, "vocab": 11, **dict(fields)}
    return RunConfig(schedule="dualpipe", pp=pp, dp=dp, microbatches=microbatches, virtual_stages=2, model=model,
                     layers=pp + 1, batch_size=dp * (2 * microbatches + 1), steps=3, dtype="float64",
                     optimizer="adamw", lr=0.05, return_grads=True, zero=zero, **shape)


def result_of(case: tuple) -> dict:
    if case not in _launched:
        (_launched[case],) = launch([case_config(*case)])
    return _launched[case]


def case_id(case: tuple) -> str:
    extra = case[4] if len(case) > 4 else ()
    fields = "".join(f"-{name}{value if value is not True else ''}" for name, value in extra
                     if name in ("tp", "cp", "ep", "sequence_parallel"))
    return f"p{case[0]}-{case[1]}-dp{case[2]}" + (f"-zero{case[3]}" if len(case) > 3 else "") + fields


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_dualpipe_matches_one_process_reference(case: tuple) -> None:
    config = case_config(*case)
    result, reference = result_of(case), reference_run(config)
    assert result["losses"] == pytest.approx(reference["losses"], abs=1e-10, rel=0)
    assert sorted(result["grads"]) == sorted(reference["grads"])  # model stages, both copies named alike
    for name, grad in reference["grads"].items():
        assert (result["grads"][name] - grad).abs().max().item() < 1e-10, name
    for name, weight in reference["params"].items():
        assert (result["params"][name] - weight).abs().max().item() < 1e-10, name


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_each_rank_runs_its_program(case: tuple) -> None:
    """(The reductions over both copies' holders are on the dp lane, and tp's and cp's
    collectives inside the actions on lanes of their own: none is an action of it.)"""
    trace = result_of(case)["trace"]
    actions = Trace([event for event in trace.events if event.stream not in ("dp", "tp", "cp", "ep")], trace.meta)
    assert_each_rank_ran_its_program(build_schedule(case_config(*case)), actions)


def test_the_copies_map_to_model_stages_and_halves_of_the_batch() -> None:
    """pp 4: pipeline stages 0-3 are copy 0's model stages 0-3, stages 4-7 copy 1's;
    copy 1's microbatch i is the step's microbatch 8 + i (8 from each end)."""
    schedule = build_schedule(case_config(4, "mlp"))  # (one replica's pipeline)
    assert [model_stage(schedule, stage) for stage in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert schedule.microbatches == 8 and data_index(schedule, 5, 3) == 11 and data_index(schedule, 2, 3) == 3
    assert schedule.first_stages == {0, 4} and schedule.last_stages == {3, 7}  # each copy reads data, takes a loss
    # rank r holds model stage r of copy 0 and model stage pp - 1 - r of copy 1
    assert [sorted(model_stage(schedule, stage) for stage in schedule.stages_of(rank)) for rank in range(4)] == \
        [[0, 3], [1, 2], [1, 2], [0, 3]]


def test_the_copies_gradient_all_reduce_is_on_the_dp_lane_and_memory_is_predicted() -> None:
    result = result_of((2, "gpt", 1))
    trace = result["trace"]
    reductions = [event for event in trace.events if event.stream == "dp"]
    assert sorted({event.rank for event in reductions}) == [0, 1] and len(reductions) == 4  # two stages a rank
    assert trace.meta["copies"] == 2
    # the optimizer state and, under ZeRO-2, the gradients sharded over both copies' holders
    # (the routed experts' over both copies' expert data-parallel ranks: predicted 11-13%
    # low when they were counted as sharded like the rest)
    for case in ((2, "gpt", 1), (2, "gpt", 1, 1), (2, "gpt", 1, 2), (2, "gpt", 2, 1), (2, "gpt", 2, 2),
                 (2, "mixtral-8x7b", 2, 1, EP2)):
        lines = peak_lines({"memory": result_of(case)["memory"]}, case_config(*case))
        errors = [float(line.split("(")[1].split("%")[0]) for line in lines if "peak measured" in line]
        assert len(errors) == 2 * case[2] and all(abs(error) <= 10 for error in errors), (case, lines)


def test_the_static_memory_line_shards_over_both_copies_holders() -> None:
    """ZeRO-1 at dp 1 shards AdamW's two float64 moments (16 bytes a parameter) over the
    two copies' holders: 8 + 8 + 16/2 = 24 bytes a parameter, what each rank holds after
    the step (the line said dp 1 and 32 bytes before)."""
    case = (2, "gpt", 1, 1)
    document = {"memory": [dict(row) for row in result_of(case)["memory"]]}
    lines = predict_static_memory(document, case_config(*case))
    assert "ZeRO 1 over dp 1 and both copies' holders, 2 ranks: 24 bytes per parameter" in lines[0]
    for row in document["memory"]:  # to a bucket's padding to a multiple of the 2 shards (8 bytes here)
        assert abs(row["static"] - row["predicted_static"]) <= 8 * 2


def test_each_stage_reduction_is_posted_during_its_last_backward() -> None:
    """As the simulator's dp stream charges it: a stage's buckets leave while the rank's
    program goes on, not after it. Each reduction over both copies' holders (``dp``
    events, one bucket a stage here) starts between the start and the end of the stage's
    last ``B`` or ``W``; under ZeRO-1 the reduce-scatters do, and the parameter
    all-gathers follow the optimizer."""
    for case, kind in (((2, "gpt", 1), "ALLREDUCE_DP"), ((2, "gpt", 2, 1), "REDUCE_SCATTER_DP")):
        trace = result_of(case)["trace"]
        last = {}
        for event in trace.events:
            if event.stream == "compute" and event.kind in ("B", "W"):
                last[event.stage] = event  # the trace lists a rank's actions in program order
        posted = {event.stage: event for event in trace.events if event.stream == "dp" and event.kind == kind}
        assert sorted(posted) == [0, 1, 2, 3]
        for stage, event in posted.items():
            assert last[stage].start <= event.start <= last[stage].end + 1e-3, (case, stage)
        if len(case) > 3:
            gathers = [event for event in trace.events if event.kind == "ALLGATHER_PARAMS"]
            assert len(gathers) == 4 and all(event.start >= max(e.end for e in last.values()) for event in gathers)


def test_a_stages_experts_reduce_over_both_copies_expert_data_parallel_ranks() -> None:
    """dp 2, pp 4, ep 2 (ranks pp-major, then dp: pipeline rank p holds ranks 2p and
    2p + 1): the ep groups are each pipeline rank's, as without copies; the expert data
    parallel groups join the members at one place of rank p and of its mirror 3 - p."""
    position = MeshPosition.of_rank(0, dp=2, pp=4, tp=1)
    ep_groups, expert_dp_groups = expert_groups_of(position, ep=2, copies=2)
    assert ep_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert expert_dp_groups == [[0, 6], [1, 7], [2, 4], [3, 5]]
    assert expert_groups_of(position, ep=2)[1] == [[0], [1], [2], [3], [4], [5], [6], [7]]


def test_programs_that_are_not_mirror_images_are_refused_naming_the_ranks() -> None:
    """Ranks 0 and 1 hold model stages 0 and 1 of both copies; their reductions over one
    group pair a stage with its other copy only if both complete them in one order."""
    schedule = generate("dualpipe", 2, 4, 2)
    assert reducing_order(schedule, 0) == reducing_order(schedule, 1) == [("B", 1), ("B", 0), ("B", 1), ("W", 0)]
    check_mirrored(schedule)
    program = list(schedule.programs[1])
    program[-3], program[-1] = program[-1], program[-3]  # rank 1: its last W before copy 0's last B
    edited = dataclasses.replace(schedule, programs=(schedule.programs[0], tuple(program)))
    with pytest.raises(ValueError, match="^ranks 0 and 1 hold the same two model stages but complete their gradients "
                                         "in different orders"):
        check_mirrored(edited)


def test_profile_refuses_it_in_one_line(capsys, tmp_path) -> None:
    assert main(["profile", "--schedule", "dualpipe", "--pp", "2", "-m", "4", "--model", "gpt", "--layers", "2",
                 "--hidden", "8", "--heads", "2", "--seq-len", "4", "--batch-size", "8", "--backend", "gloo",
                 "--out", str(tmp_path / "costs.json")]) == 2
    error = capsys.readouterr().err.strip()
    assert "profile --schedule dualpipe: profile measures the stages of one copy of the model" in error
    assert "pipesim compare --schedule dualpipe" in error and "\n" not in error


def test_compare_predicts_it_with_the_copies_reduction_timed_on_the_run(tmp_path) -> None:
    """``compare`` times each of the 2pp stages in its own calibration steps and prices the
    reduction over both copies' holders (a group of 2 at dp 1) at what those steps timed."""
    out = tmp_path / "compare.json"
    assert main(["compare", "--schedule", "dualpipe", "--pp", "2", "-m", "4", "--model", "gpt", "--layers", "2",
                 "--hidden", "8", "--heads", "2", "--seq-len", "4", "--batch-size", "8", "--backend", "gloo",
                 "--quiet", "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    assert len(document["costs"]["stages"]) == 4  # every pipeline stage, each copy's
    last = [stage["act_bytes"] for stage in document["costs"]["stages"]]
    assert last[1] == last[3] == 0 and last[0] == last[2] > 0  # each copy's last stage sends nothing
    pace = document["calibrated_collectives"]["all_reduce"]
    assert pace["group"] == "dp" and pace["ranks"] == 2
    assert document["predicted_step_time"] > 0 and document["measured_step_time"] > 0


def test_under_zero3_every_compute_action_must_pair_with_the_mirror_ranks() -> None:
    """ZeRO-3's gathers serve F and I too: a swap of two forwards leaves the reductions'
    order alone (rank 1's F0 of each copy swapped) but pairs different model stages'
    gathers, so only the every-action check refuses it."""
    schedule = generate("dualpipe", 2, 4, 2)
    check_mirrored(schedule, every_compute=True)
    program = list(schedule.programs[1])
    first, second = [index for index, action in enumerate(program) if action.kind == "F"][:2]
    assert {model_stage(schedule, program[first].stage), model_stage(schedule, program[second].stage)} == {0, 1}
    program[first], program[second] = program[second], program[first]
    edited = dataclasses.replace(schedule, programs=(schedule.programs[0], tuple(program)))
    check_mirrored(edited)
    with pytest.raises(ValueError, match="^ranks 0 and 1 hold the same two model stages but run their compute "
                                         "actions in different orders"):
        check_mirrored(edited, every_compute=True)
