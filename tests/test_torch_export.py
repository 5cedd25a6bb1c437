"""``pipesim export`` for torch and torchtitan: the lowered file torch's runtime runs as
written, pipesim's grouped form, the flags that contradict each other, torchtitan's files
against the rules torch and torchtitan build stages by (torch's own mapping functions are
the oracle), ``--from-plan``, the config check, and every mismatch refused before torch's
loader runs."""

from __future__ import annotations

import json
import math
import sys

import pytest

from benchmarks.torch_orders import StandInStage
from pipesim.cli import main
from pipesim.cli.torchtitan import TorchtitanLayout, write_torchtitan
from pipesim.model.spec import RECOMPUTE
from schedules.action import COMM_KINDS
from schedules.csv_io import schedule_from_csv
from schedules.generators import GENERATORS, MULTI_CHUNK, generate
from schedules.lowering import lower
from schedules.torch_compat import TorchMismatchError
from schedules.torch_runtime import lower_for_torch_runtime

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping  # noqa: E402 - after the skip

from executor.torch_pipelining import load_schedule_csv  # noqa: E402
from executor.torchtitan_launch import check_config, checked_load_csv, read_args, supported_version  # noqa: E402
from executor.torchtitan_launch import main as launch_main  # noqa: E402


def run(*argv) -> int:
    return main([str(arg) for arg in argv])


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def bare_runtime(pp: int, num_stages: int, microbatches: int, stages: list[int], rank: int = 0):
    """A ``_PipelineScheduleRuntime`` holding stand-in stages ``stages`` of ``rank``, with
    what its CSV loader reads and nothing else (no process group, no model)."""
    runtime = object.__new__(torch_schedules._PipelineScheduleRuntime)
    runtime.pipeline_order = {}
    runtime.pp_group_size, runtime.rank = pp, rank
    runtime._num_stages, runtime._n_microbatches = num_stages, microbatches
    runtime._stages = [StandInStage(stage, num_stages, pp, rank) for stage in stages]
    runtime._defer_pp_recv = False
    return runtime


# --- the forms of a lowered file --------------------------------------------------------

def test_lowered_export_is_the_form_torch_runs_as_written(tmp_path):
    path = tmp_path / "lowered.csv"
    assert run("export", "--schedule", "interleaved-1f1b", "--pp", 4, "-v", 2, "-m", 8, "--lowered", "--out",
               path) == 0
    rows = [row.split(",") for row in path.read_text().splitlines()]
    assert not any("+" in cell for row in rows for cell in row)
    assert sorted(cell for row in rows for cell in row if cell.endswith("REDUCE_GRAD")) == sorted(
        f"{stage}REDUCE_GRAD" for stage in range(8))
    runtime = bare_runtime(4, 8, 8, [0, 4])
    load_schedule_csv(runtime, str(path))
    assert [[str(action) for action in runtime.pipeline_order_with_comms[rank]] for rank in range(4)] == rows
    expected = lower_for_torch_runtime(generate("interleaved-1f1b", 4, 8, 2))
    assert schedule_from_csv(path).programs == expected.programs


def test_groups_form_keeps_pipesims_groups(tmp_path):
    path = tmp_path / "grouped.csv"
    assert run("export", "--schedule", "1f1b", "--pp", 4, "-m", 8, "--lowered", "--groups", "--out", path) == 0
    assert "+" in path.read_text() and "REDUCE_GRAD" not in path.read_text()
    assert schedule_from_csv(path).joins == lower(generate("1f1b", 4, 8)).joins
    with pytest.raises(TorchMismatchError, match=r"P2P groups joined by '\+'.*export --lowered"):
        load_schedule_csv(bare_runtime(4, 4, 8, [0]), str(path))


def test_fsdp_adds_torchs_unshard_and_reshard(tmp_path):
    path = tmp_path / "fsdp.csv"
    assert run("export", "--schedule", "zbv", "--pp", 2, "-m", 4, "--lowered", "--fsdp", "--out", path) == 0
    first = path.read_text().splitlines()[0].split(",")
    assert first[:3] == ["0UNSHARD", "3UNSHARD", "0F0"] and first[-1].endswith("RESHARD")


@pytest.mark.parametrize(("argv", "expected"), [
    (["--lowered", "--flat", "--groups", "--out", "{out}"], "--groups conflicts with --flat"),
    (["--groups", "--out", "{out}"], "--groups describes how a lowered file holds its transfers; add --lowered"),
    (["--lowered", "--groups", "--fsdp", "--out", "{out}"], "--fsdp conflicts with --groups"),
    (["--fsdp", "--out", "{out}"], "--fsdp adds torch's UNSHARD/RESHARD to a lowered file"),
    (["--lowered", "--p2p", "buffered", "--out", "{out}"], "--p2p buffered checks pipesim's grouped form"),
    ([], "give --out FILE (a schedule CSV) or --torchtitan DIR"),
    (["--out", "{out}", "--torchtitan", "{dir}"], "--out conflicts with --torchtitan"),
    (["--lowered", "--torchtitan", "{dir}"], "--lowered conflicts with --torchtitan"),
    (["--zero", "1", "--torchtitan", "{dir}"], "torchtitan's sharded data parallelism is FSDP (ZeRO-3"),
    (["--torch-class", "1F1B", "--out", "{out}"], "--torch-class names the class torchtitan builds"),
    (["--layers-per-stage", "2,2,1,1", "--torchtitan", "{dir}"], "give --layers instead"),
])
def test_contradicting_flags_are_one_line_errors(tmp_path, capsys, argv, expected):
    filled = [arg.format(out=tmp_path / "x.csv", dir=tmp_path / "titan") for arg in argv]
    assert run("export", "--schedule", "1f1b", "--pp", 4, *filled) == 2
    assert expected in error_line(capsys)
    assert not (tmp_path / "titan").exists() and not (tmp_path / "x.csv").exists()


# --- torchtitan -------------------------------------------------------------------------

def torchtitan_stage_indices(class_name: str, pp: int, num_stages: int, rank: int) -> list[int]:
    """The stages torchtitan builds on ``rank`` (``_get_pp_rank_to_stage_indices_mapping``):
    V-style for ZBVZeroBubble and DualPipeV, looped otherwise, as torch maps them."""
    cls = torch_schedules.get_schedule_class(class_name)
    style = "v" if cls in (torch_schedules.ScheduleZBVZeroBubble, torch_schedules.ScheduleDualPipeV) else "loop"
    mapping = generate_stage_to_rank_mapping(pp, num_stages, style)
    return [stage for stage in range(num_stages) if mapping[stage] == rank]


def torchtitan_num_stages(parallelism: dict, pp: int, layers: int | None) -> int:
    """The stage count torchtitan's ``_get_pipeline_metadata`` derives from the config."""
    cls = torch_schedules.get_schedule_class(parallelism["pipeline_parallel_schedule"])
    per_stage = parallelism.get("pipeline_parallel_layers_per_stage")
    if per_stage is None:
        return pp * (1 if issubclass(cls, torch_schedules.PipelineScheduleSingle) else 2)
    first = parallelism.get("pipeline_parallel_first_stage_less_layers", 1)
    last = parallelism.get("pipeline_parallel_last_stage_less_layers", 1)
    return math.ceil((layers + first + last) / per_stage)


@pytest.mark.parametrize(("name", "chunks", "layers"), [
    *[(name, 2 if name in MULTI_CHUNK else 1, None) for name in GENERATORS if name != "dualpipe"],  # no file form
    ("interleaved-1f1b", 4, 32), ("looped-bfs", 3, 24), ("zbv", 2, 16)])
def test_torchtitan_builds_the_stages_where_the_csv_puts_them(tmp_path, name, chunks, layers):
    pp, microbatches = 4, 8
    folder = tmp_path / "titan"
    extra = ["--layers", layers] if layers else []
    assert run("export", "--schedule", name, "--pp", pp, "-m", microbatches, *(["-v", chunks] if chunks > 1 else []),
               "--microbatch-size", 2, "--dp", 2, "--tp", 2, *extra, "--torchtitan", folder) == 0
    values = read_args(folder / "torchtitan.args")
    parallelism = {key.split(".", 1)[1]: value for key, value in values.items() if key.startswith("parallelism.")}
    assert parallelism["pipeline_parallel_degree"] == pp
    assert parallelism["pipeline_parallel_schedule_csv"] == str((folder / "schedule.csv").resolve())
    assert (parallelism["data_parallel_replicate_degree"], parallelism["data_parallel_shard_degree"],
            parallelism["tensor_parallel_degree"]) == (2, 1, 2)
    num_stages = torchtitan_num_stages(parallelism, pp, layers)
    assert num_stages == pp * chunks
    count = values["training.local_batch_size"] // parallelism["pipeline_parallel_microbatch_size"]
    assert count == microbatches and values["training.local_batch_size"] == 2 * microbatches
    for rank in range(pp):  # torch's loader, given the stages torchtitan builds, accepts the file
        stages = torchtitan_stage_indices(parallelism["pipeline_parallel_schedule"], pp, num_stages, rank)
        runtime = bare_runtime(pp, num_stages, count, stages, rank)
        load_schedule_csv(runtime, parallelism["pipeline_parallel_schedule_csv"])
        assert [runtime.stage_index_to_group_rank[stage] for stage in stages] == [rank] * len(stages)
    assert "matches" in check_config(folder / "torchtitan.args")
    # what torchtitan 0.3 needs for pp > 1, the plan's choices as its knobs, and nothing 0.3 rejects
    assert values["training.disable_cuda_graphs"] is True and values["activation_checkpoint"] == "none"
    assert values["parallelism.enable_sequence_parallel"] is False
    assert not {"parallelism.num_pp_microbatches", "training.num_tokens_per_microbatch_per_dp_rank"} & set(values)
    assert (folder / "torchtitan.args").read_text().split()[-1] == "activation_checkpoint:none"  # last: a subcommand


def test_torchtitan_files_hold_both_orders(tmp_path):
    folder = tmp_path / "titan"
    assert run("export", "--schedule", "dualpipev", "--pp", 2, "-m", 4, "--dp", 2, "--fsdp", "--torchtitan",
               folder) == 0
    compute, lowered = schedule_from_csv(folder / "schedule.csv"), schedule_from_csv(folder / "schedule-lowered.csv")
    assert not compute.is_lowered and lowered.is_lowered
    assert compute.programs == lowered.compute_only().programs == generate("dualpipev", 2, 4, 2).programs
    assert "UNSHARD" in (folder / "schedule-lowered.csv").read_text()  # dp 2 sharded with FSDP
    config = read_args(folder / "torchtitan.args")
    assert config["parallelism.pipeline_parallel_schedule"] == "DualPipeV"
    assert not any("overlap" in key for key in config)  # 0.2.x's expert-overlap key: 0.3 has none
    assert (config["parallelism.data_parallel_replicate_degree"], config["parallelism.data_parallel_shard_degree"]) \
        == (1, 2)


@pytest.mark.parametrize("dp", [1, 2], ids=["dp1", "ddp2"])
def test_the_lowered_file_unshards_every_stage_as_torchtitan_wraps_them_in_fsdp(tmp_path, dp):
    """torchtitan wraps every stage in FSDP, with one replica and with DDP too: a lowered
    file without UNSHARD fails there ("Attempted to compute on sharded stage_idx=0")."""
    folder = tmp_path / "titan"
    assert run("export", "--schedule", "1f1b", "--pp", 2, "-m", 4, "--dp", dp, "--torchtitan", folder) == 0
    rows = (folder / "schedule-lowered.csv").read_text().splitlines()
    for rank, row in enumerate(rows):
        cells = row.split(",")
        assert cells.index(f"{rank}UNSHARD") < cells.index(f"{rank}F0") and cells[-1] == f"{rank}RESHARD"


@pytest.mark.parametrize(("argv", "written"), [
    (["--schedule", "1f1b", "--recompute", "full"], "activation_checkpoint:full"),
    pytest.param(["--schedule", "1f1b", "--recompute", "per-op"], "activation_checkpoint:selective",
                 marks=pytest.mark.skipif("per-op" not in RECOMPUTE, reason="simulate's --recompute has no per-op")),
    (["--schedule", "zbv", "--recompute", "full"], "activation_checkpoint:full"),
    (["--schedule", "zb-h1", "--recompute", "none"], "activation_checkpoint:none"),
])
def test_recompute_and_sequence_parallel_are_written_as_torchtitans_knobs(tmp_path, argv, written):
    folder = tmp_path / "titan"
    assert run("export", *argv, "--pp", 2, "-m", 4, "--tp", 2, "--sequence-parallel", "--torchtitan", folder) == 0
    words = (folder / "torchtitan.args").read_text().split()
    assert words[-1] == written and "--parallelism.enable_sequence_parallel" in words


def test_per_op_recompute_is_written_as_torchtitans_selective(tmp_path):
    """torchtitan 0.3's activation_checkpoint:selective is per-op (SelectiveAC): pipesim's per-op."""
    folder = tmp_path / "titan"
    write_torchtitan(folder, generate("1f1b", 2, 4), TorchtitanLayout(tp=2, sequence_parallel=True, recompute="per-op"))
    words = (folder / "torchtitan.args").read_text().split()
    assert words[-1] == "activation_checkpoint:selective" and "--parallelism.enable_sequence_parallel" in words
    assert "matches" in check_config(folder / "torchtitan.args")


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_megatrons_selective_recompute_is_refused_for_torchtitan(tmp_path, capsys, name):
    """torchtitan 0.3 has no attention-core-only recompute: its "selective" is per-op."""
    assert run("export", "--schedule", name, "--pp", 2, "-m", 4, "--recompute", "selective", "--torchtitan",
               tmp_path / "titan") == 2
    assert error_line(capsys) == (
        "pipesim export: error: --recompute selective (Megatron's: only the attention core recomputed) has no "
        "torchtitan 0.3 counterpart: its activation_checkpoint:selective is per-op selective checkpointing "
        "(SelectiveAC); use --recompute per-op, none or full")
    assert not (tmp_path / "titan").exists()


SPLIT_BACKWARD = [("zb-h1", 1), ("zbv", 2), ("interleaved-zb", 2)]


@pytest.mark.parametrize(("name", "chunks"), SPLIT_BACKWARD)
def test_per_op_recompute_with_a_split_backward_is_refused(tmp_path, name, chunks):
    """torchtitan's selective checkpointing fails on I then W ("Trying to backward an extra time")."""
    with pytest.raises(ValueError, match=f"^--recompute per-op with {name}: torchtitan's selective activation "
                                         r"checkpointing \(SelectiveAC, pipesim's --recompute per-op\) fails .*"
                                         "Trying to backward an extra time"):
        write_torchtitan(tmp_path / "titan", generate(name, 2, 4, chunks), TorchtitanLayout(recompute="per-op"))
    assert not (tmp_path / "titan").exists()


@pytest.mark.skipif("per-op" not in RECOMPUTE, reason="simulate's --recompute has no per-op")
@pytest.mark.parametrize(("name", "chunks"), SPLIT_BACKWARD)
def test_the_export_command_refuses_per_op_with_a_split_backward(tmp_path, capsys, name, chunks):
    assert run("export", "--schedule", name, "--pp", 2, "-m", 4, *(["-v", chunks] if chunks > 1 else []),
               "--recompute", "per-op", "--torchtitan", tmp_path / "titan") == 2
    line = error_line(capsys)
    assert f"--recompute per-op with {name}" in line and "Trying to backward an extra time" in line
    assert not (tmp_path / "titan").exists()


@pytest.mark.parametrize(("name", "chunks", "torch_class", "theirs", "ours"), [
    ("zbv", 2, "Interleaved1F1B", "rank 0 holds stages 0 and 4", "rank 0 holds stages 0 and 7"),
    ("interleaved-1f1b", 2, "DualPipeV", "rank 0 holds stages 0 and 7", "rank 0 holds stages 0 and 4"),
    ("1f1b", 1, "zbvzerobubble", "V-shaped, two stages per rank", "looped, 1 stage per rank"),
])
def test_a_class_that_places_stages_otherwise_is_refused(tmp_path, capsys, name, chunks, torch_class, theirs, ours):
    assert run("export", "--schedule", name, "--pp", 4, "-m", 8, *(["-v", chunks] if chunks > 1 else []),
               "--torchtitan", tmp_path / "titan", "--torch-class", torch_class) == 2
    line = error_line(capsys)
    assert theirs in line and ours in line and "torch would run the file over the wrong stages" in line
    assert not (tmp_path / "titan").exists()


def test_more_than_two_chunks_need_the_layers(tmp_path, capsys):
    argv = ["export", "--schedule", "interleaved-1f1b", "--pp", 2, "-v", 4, "-m", 4, "--torchtitan", tmp_path / "t"]
    assert run(*argv) == 2
    assert "give --layers (or --model)" in error_line(capsys)
    assert run(*argv, "--layers", 10) == 2
    assert "--layers 10 over 8 stages" in error_line(capsys)


def plan_file(tmp_path, **fields) -> str:
    row = {"schedule": "zbv", "pp": 2, "tp": 1, "dp": 2, "virtual_stages": 2, "microbatch_size": 1,
           "microbatches": 4, "recompute": "none", "zero": 0, "sequence_parallel": False,
           "layout": "zbv v2 pp2 tp1 dp2 mbs1 m4", **fields}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"ranked": [row], "considered": 1}))
    return str(path)


def test_from_plan_writes_what_the_explicit_flags_write(tmp_path):
    plan = plan_file(tmp_path)
    assert run("export", "--from-plan", plan, "--layers", 8, "--torchtitan", tmp_path / "a") == 0
    assert run("export", "--schedule", "zbv", "--pp", 2, "-v", 2, "-m", 4, "--dp", 2, "--layers", 8,
               "--torchtitan", tmp_path / "b") == 0
    for name in ("schedule.csv", "schedule-lowered.csv"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()
    text = {folder: (tmp_path / folder / "torchtitan.args").read_text().replace(str(tmp_path / folder), "X")
            for folder in "ab"}
    assert text["a"] == text["b"]


@pytest.mark.parametrize(("extra", "fields", "expected"), [
    (["--pp", "4"], {}, "--pp conflicts with --from-plan"),
    (["--plan-rank", "2"], {}, "--plan-rank 2: {plan} ranks 1 layouts"),
    ([], {"zero": 1}, "torchtitan's sharded data parallelism is FSDP (ZeRO-3"),
])
def test_from_plan_errors(tmp_path, capsys, extra, fields, expected):
    plan = plan_file(tmp_path, **fields)
    assert run("export", "--from-plan", plan, *extra, "--torchtitan", tmp_path / "t") == 2
    assert expected.format(plan=plan) in error_line(capsys)


def test_from_plan_refuses_a_file_that_is_not_a_plan(tmp_path, capsys):
    path = tmp_path / "other.json"
    path.write_text('{"ranks": []}')
    assert run("export", "--from-plan", path, "--torchtitan", tmp_path / "t") == 2
    assert "not a `pipesim plan --json` file" in error_line(capsys)


def test_config_check_names_the_field_that_disagrees(tmp_path, capsys):
    folder = tmp_path / "titan"
    assert run("export", "--schedule", "zbv", "--pp", 4, "-m", 8, "--torchtitan", folder) == 0
    path = folder / "torchtitan.args"
    capsys.readouterr()
    assert "matches" in check_config(path)
    good = path.read_text()
    for old, new, expected in [
        ("ZBVZeroBubble", "Interleaved1F1B", "Interleaved1F1B builds stages looped"),
        ("local_batch_size 8", "local_batch_size 4", "local_batch_size 4 / pipeline_parallel_microbatch_size 1 = "
                                                     "4 microbatches"),
        ("pipeline_parallel_degree 4", "pipeline_parallel_degree 2", "pipeline_parallel_degree = 2"),
        (" --training.disable_cuda_graphs", "", "needs --training.disable_cuda_graphs with pipeline parallelism"),
        ("activation_checkpoint:none", "activation_checkpoint:selective", "activation_checkpoint:selective with "),
    ]:
        path.write_text(good.replace(old, new))
        with pytest.raises(TorchMismatchError, match=expected.replace("(", r"\(")):
            check_config(path)
        assert launch_main(["--check", str(path)]) == 2
        assert expected in error_line(capsys)


def test_check_without_torchtitan_never_says_ok(tmp_path, capsys):
    """Where torchtitan's parser cannot run, --check says so (exit 1) and never "ok"."""
    folder = tmp_path / "titan"
    assert run("export", "--schedule", "1f1b", "--pp", 2, "-m", 4, "--torchtitan", folder) == 0
    capsys.readouterr()
    no_torchtitan = tmp_path / "python"
    no_torchtitan.write_text(f"#!/bin/sh\nexec {sys.executable} -S -I \"$@\"\n")
    no_torchtitan.chmod(0o755)
    assert launch_main(["--check", str(folder / "torchtitan.args"), "--python", str(no_torchtitan)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("cannot check: torchtitan is not importable")


@pytest.mark.parametrize("version", ["0.2.1", "0.4.0", "1.0"])
def test_other_torchtitan_releases_are_refused(version):
    with pytest.raises(TorchMismatchError, match=f"torchtitan {version} is not supported: pipesim writes the config "
                       "of torchtitan 0.3.x"):
        supported_version(version)
    supported_version("0.3.0")
    supported_version("0.3.1+git1234")


# --- refused before torch's loader runs ---------------------------------------------------

def written(tmp_path, name: str, pp: int, microbatches: int, chunks: int, lowered: bool = False) -> str:
    path = tmp_path / f"{name}.csv"
    schedule = generate(name, pp, microbatches, chunks)
    from schedules.csv_io import schedule_to_csv

    schedule_to_csv(lower_for_torch_runtime(schedule) if lowered else schedule, path, groups=False)
    return str(path)


@pytest.mark.parametrize(("name", "stages", "expected"), [
    # the 94 TB allocation: a V file over looped stages
    ("zbv", [0, 4], "rank 0 holds stages 0 and 4 in torch, but {path} puts stages 0 and 7 on it"),
    # the gloo "Received data size doesn't match": a looped file over V stages
    ("interleaved-1f1b", [0, 7], "rank 0 holds stages 0 and 7 in torch, but {path} puts stages 0 and 4 on it"),
])
@pytest.mark.parametrize("lowered", [False, True], ids=["compute-only", "lowered"])
def test_a_placement_mismatch_is_refused_before_torch_reads_the_file(tmp_path, monkeypatch, name, stages, expected,
                                                                     lowered):
    path = written(tmp_path, name, 4, 8, 2, lowered)
    runtime = bare_runtime(4, 8, 8, stages)
    with pytest.raises(TorchMismatchError, match=expected.format(path=path)):
        load_schedule_csv(runtime, path)
    assert runtime.pipeline_order == {}  # torch's loader never ran
    # the same under executor.torchtitan_launch, where torchtitan calls _load_csv itself
    monkeypatch.setattr(torch_schedules._PipelineScheduleRuntime, "_load_csv", checked_load_csv)
    with pytest.raises(TorchMismatchError, match="use|e.g."):
        runtime._load_csv(path)


def test_microbatches_stages_and_ranks_must_match(tmp_path):
    path = written(tmp_path, "1f1b", 4, 8, 1)
    with pytest.raises(TorchMismatchError, match="runs 8 microbatches but torch's schedule was built for 4"):
        load_schedule_csv(bare_runtime(4, 4, 4, [0]), path)
    with pytest.raises(TorchMismatchError, match="has 4 stages but torch's stages were built as 8"):
        load_schedule_csv(bare_runtime(4, 8, 8, [0, 4]), path)
    with pytest.raises(TorchMismatchError, match="has 4 rows .* torch's pipeline group has 2 ranks"):
        load_schedule_csv(bare_runtime(2, 4, 8, [0]), path)


def test_a_lowered_file_without_reduce_grad_is_refused(tmp_path):
    path = written(tmp_path, "zb-h1", 2, 4, 1, lowered=True)
    text = open(path).read()
    with open(path, "w") as handle:
        handle.write(text.replace(",1REDUCE_GRAD", ""))
    with pytest.raises(TorchMismatchError, match=r"rank 1 has no 1REDUCE_GRAD after stage 1's last backward 1W3"):
        load_schedule_csv(bare_runtime(2, 2, 4, [1], rank=1), path)


def test_the_loader_tells_torch_the_files_format(tmp_path):
    """torch cannot tell a lowered file from a compute-only one; the loader can."""
    lowered = written(tmp_path, "1f1b", 2, 4, 1, lowered=True)
    runtime = bare_runtime(2, 2, 4, [0])
    with pytest.raises(ValueError, match="Expected compute-only schedule"):
        torch_schedules._PipelineScheduleRuntime._load_csv(runtime, lowered)  # torch's default, as torchtitan calls it
    runtime = bare_runtime(2, 2, 4, [0])
    load_schedule_csv(runtime, lowered)
    assert any(action.computation_type.value in COMM_KINDS for action in runtime.pipeline_order_with_comms[0])


def test_a_clip_norm_other_than_torchtitans_own_is_written(tmp_path):
    """simulate prices --clip-grad (default 1.0, torchtitan's training.max_norm too): a
    job that clips otherwise gets the key, one that does not leaves torchtitan's default."""
    for clip, expected in (([], None), (["--clip-grad", "0.5"], 0.5), (["--clip-grad", "0"], 0.0)):
        folder = tmp_path / f"titan{len(clip)}{clip[-1] if clip else ''}"
        assert run("export", "--model", "llama3-8b", "--layers", 8, "--pp", 2, "-m", 4, *clip,
                   "--torchtitan", folder) == 0
        written = read_args(folder / "torchtitan.args").get("training.max_norm")
        assert (None if written is None else float(written)) == expected
    # torchtitan's knob needs no model: a schedule's export keeps the norm given
    assert run("export", "--schedule", "1f1b", "--pp", 2, "-m", 4, "--clip-grad", "0.5", "--torchtitan",
               tmp_path / "bare") == 0
    assert float(read_args(tmp_path / "bare" / "torchtitan.args")["training.max_norm"]) == 0.5
