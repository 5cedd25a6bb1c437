"""``python -m executor.torchtitan_launch``: torchtitan's training with pipesim's schedule
files checked against the stages torchtitan builds, and loaded in the form they are
written in; ``--check torchtitan.args`` checks the overrides pipesim wrote against their
CSV, and runs torchtitan's own config parser on them.

torchtitan builds its schedule from ``pipeline_parallel_schedule_csv`` with
``_PipelineScheduleRuntime(stages, ...)`` and then ``schedule._load_csv(path)``: torch's
default format, compute-only. A lowered file is refused there ("Expected compute-only
schedule but found communication action"), and a compute-only one is lowered again by
torch, so pipesim's placement of the transfers is lost. Run under this module,
``_load_csv`` is ``executor.torch_pipelining.load_schedule_csv``: the file is checked
against the stages torchtitan built (placement, stage count, microbatches, REDUCE_GRAD;
on NCCL, whether its order can hang torch's runtime) and loaded as compute-only or as
lowered, as it is written. Everything else is torchtitan's own ``torchtitan.train``::

    torchrun --nproc-per-node 8 -m executor.torchtitan_launch --module llama3 --config llama3_8b \\
        $(cat titan/torchtitan.args)
    python -m executor.torchtitan_launch --check titan/torchtitan.args... [--python PATH]

Supported: torchtitan 0.3.x (configured in Python, ``--module``/``--config`` plus
overrides); other releases are refused in one line.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import runpy
import subprocess
import sys
from pathlib import Path

from executor.config import PER_OP_SPLIT_FAILS, has_split_backward
from schedules.csv_io import schedule_from_csv
from schedules.torch_compat import TorchMismatchError, stages_per_rank, torch_class_for

ARGS_FILE = "torchtitan.args"
SUPPORTED_RELEASE = "0.3"  # torchtitan's release series whose config keys pipesim writes
# pipesim's --recompute -> torchtitan 0.3's activation-checkpointing subcommand. torchtitan's
# "selective" is per-op selective checkpointing (SelectiveAC), pipesim's per-op; pipesim's
# selective (Megatron's: the attention core only) has no torchtitan counterpart.
AC_SUBCOMMAND = {"none": "activation_checkpoint:none", "per-op": "activation_checkpoint:selective",
                 "full": "activation_checkpoint:full"}
# torchtitan 0.3's defaults for the fields the checks read
TORCHTITAN_DEFAULTS = {"parallelism.pipeline_parallel_schedule": "1F1B", "parallelism.pipeline_parallel_degree": 1,
                       "parallelism.pipeline_parallel_microbatch_size": 1, "training.local_batch_size": 8}
# the module and config torchtitan's parser loads the overrides onto (any release's llama3 debug model)
CHECK_MODULE, CHECK_CONFIG = "llama3", "llama3_debugmodel"


def supported_version(version: str) -> None:
    """Refuse, in one line, a torchtitan release whose config keys pipesim does not write."""
    parts = version.split("+")[0].split(".")
    if ".".join(parts[:2]) != SUPPORTED_RELEASE:
        raise TorchMismatchError(
            f"torchtitan {version} is not supported: pipesim writes the config of torchtitan {SUPPORTED_RELEASE}.x "
            f"(pip install 'torchtitan=={SUPPORTED_RELEASE}.*')")


def read_args(path: str | Path) -> dict[str, object]:
    """The overrides in ``path`` as ``section.field`` -> value (``True`` for a bare flag,
    ``False`` for its ``no_`` form, ints as ints), plus ``activation_checkpoint`` -> the
    subcommand's mode; an error naming the word it cannot read."""
    words = Path(path).read_text().split()
    values: dict[str, object] = {}
    position = 0
    while position < len(words):
        word = words[position]
        if word.startswith("activation_checkpoint:"):
            values["activation_checkpoint"] = word.split(":", 1)[1]
        elif word.startswith("--") and "." in word:
            key = word[2:]
            following = words[position + 1] if position + 1 < len(words) else "--"
            if following.startswith("--") or following.startswith("activation_checkpoint:"):
                section, field = key.split(".", 1)
                negated = field.startswith("no_")
                values[f"{section}.{field[3:] if negated else field}"] = not negated
            else:
                values[key] = int(following) if following.lstrip("-").isdigit() else following
                position += 1
        else:
            raise TorchMismatchError(f"{path}: cannot read {word!r} (expected --section.field [value])")
        position += 1
    return values


# why torchtitan's selective (per-op) checkpointing is refused with a split backward
SELECTIVE_FAILS = (f"torchtitan's selective activation checkpointing (SelectiveAC, pipesim's --recompute per-op) fails "
                   f"on an order that splits the backward into I and W: {PER_OP_SPLIT_FAILS}")


def check_config(path: str | Path) -> str:
    """Check torchtitan overrides against the CSV they name, as torchtitan will build the
    stages from them (class, pipeline degree, stages per rank, microbatches); return a
    one-line summary, raise ``TorchMismatchError`` naming the field that disagrees."""
    values = read_args(path)

    def value(key: str) -> object:
        return values.get(key, TORCHTITAN_DEFAULTS.get(key))

    csv_path = values.get("parallelism.pipeline_parallel_schedule_csv")
    if not csv_path:
        raise TorchMismatchError(f"{path}: no --parallelism.pipeline_parallel_schedule_csv")
    schedule = schedule_from_csv(csv_path)
    cls = torch_class_for(schedule, value("parallelism.pipeline_parallel_schedule"))
    degree = value("parallelism.pipeline_parallel_degree")
    if degree != schedule.pp:
        raise TorchMismatchError(f"{path}: pipeline_parallel_degree = {degree}, but {csv_path} has {schedule.pp} "
                                 f"rows (pipeline ranks)")
    chunks = stages_per_rank(schedule)
    if "parallelism.pipeline_parallel_layers_per_stage" not in values and chunks != (1 if cls.single_stage else 2):
        raise TorchMismatchError(
            f"{path}: without pipeline_parallel_layers_per_stage torchtitan builds "
            f"{1 if cls.single_stage else 2} stages per rank for {cls.name}, but {csv_path} has {chunks}")
    size, batch = value("parallelism.pipeline_parallel_microbatch_size"), value("training.local_batch_size")
    if batch % size:
        raise TorchMismatchError(f"{path}: local_batch_size {batch} is not a multiple of "
                                 f"pipeline_parallel_microbatch_size {size}")
    if batch // size != schedule.microbatches:
        raise TorchMismatchError(f"{path}: local_batch_size {batch} / pipeline_parallel_microbatch_size {size} = "
                                 f"{batch // size} microbatches, but {csv_path} runs {schedule.microbatches}")
    if schedule.pp > 1 and values.get("training.disable_cuda_graphs") is not True:
        raise TorchMismatchError(f"{path}: torchtitan {SUPPORTED_RELEASE} needs --training.disable_cuda_graphs "
                                 f"with pipeline parallelism (pp = {schedule.pp})")
    if values.get("activation_checkpoint") == "selective" and has_split_backward(schedule):
        raise TorchMismatchError(f"{path}: activation_checkpoint:selective with {csv_path}: {SELECTIVE_FAILS}")
    form = "lowered (run it with this module)" if schedule.is_lowered else "compute-only"
    return (f"{csv_path} ({form}, pp={schedule.pp}, {schedule.num_stages} stages, {schedule.microbatches} "
            f"microbatches) matches {path}: {cls.name} places the stages {cls.style}, as the file does")


# Run in the Python that has torchtitan: its version, then, for each file (stdin: a JSON
# list of [overrides, fields]), its parser on the overrides, printing the fields pipesim
# wrote as torchtitan parsed them, or what the parser printed when it refused them.
PARSER_SCRIPT = """
import contextlib, importlib.metadata, io, json, sys
print(json.dumps({"version": importlib.metadata.version("torchtitan")}), flush=True)
from torchtitan.config.manager import ConfigManager
for overrides, keys in json.loads(sys.stdin.read()):
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            config = ConfigManager().parse_args([*sys.argv[1:], *overrides])
    except (Exception, SystemExit) as error:
        print(json.dumps({"refused": said.getvalue() + repr(error)}), flush=True)
        continue
    parsed = {}
    for key in keys:
        if key == "activation_checkpoint":
            ac = config.activation_checkpoint
            parsed[key] = "none" if ac is None else type(ac).__qualname__.split(".")[0]
        else:
            section, field = key.split(".", 1)
            parsed[key] = getattr(getattr(config, section), field)
    print(json.dumps({"parsed": parsed}), flush=True)
"""
# torchtitan 0.3's activation-checkpointing subcommand -> the config class its parser builds
AC_CLASS = {"none": "none", "selective": "SelectiveAC", "full": "FullAC"}


def torchtitan_parse(paths: list[str | Path], python: str = sys.executable, timeout: float = 300) -> list[str]:
    """Run torchtitan's own config parser (in ``python``, one process for all ``paths``)
    on the overrides in each file, loaded onto its llama3 debug config, and compare every
    field it parsed with what the file says; return a one-line summary per file, raise
    ``TorchMismatchError`` on a version pipesim does not support, a key torchtitan
    rejects, or a value it reads otherwise."""
    files = [(Path(path).read_text().split(), read_args(path)) for path in paths]
    done = subprocess.run([python, "-c", PARSER_SCRIPT, "--module", CHECK_MODULE, "--config", CHECK_CONFIG],
                          input=json.dumps([[words, list(values)] for words, values in files]),
                          capture_output=True, text=True, timeout=timeout, check=False)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines or done.returncode or len(lines) != len(paths) + 1:
        tail = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise TorchMismatchError(f"torchtitan's config parser did not run in {python}: {tail[0]}")
    supported_version(lines[0]["version"])
    summaries = []
    for path, (_, values), answer in zip(paths, files, lines[1:], strict=True):
        if "refused" in answer:
            said = [line.strip(" │╭╮╰╯─") for line in answer["refused"].splitlines() if line.strip(" │╭╮╰╯─")]
            detail = next((line for line in said if ":" in line and ("nrecognized" in line or "rror" in line)),
                          said[-1])
            raise TorchMismatchError(f"{path}: torchtitan's config parser refuses it: {detail}")
        for key, wrote in values.items():
            expected = AC_CLASS.get(wrote, wrote) if key == "activation_checkpoint" else wrote
            if answer["parsed"][key] != expected:
                raise TorchMismatchError(f"{path}: torchtitan reads {key} as {answer['parsed'][key]!r}, pipesim "
                                         f"wrote {wrote!r}")
        summaries.append(f"torchtitan {lines[0]['version']}'s parser reads all {len(values)} fields as written")
    return summaries


def torchtitan_python_available(python: str) -> bool:
    """Whether ``python`` can import torchtitan."""
    if python == sys.executable:
        return importlib.util.find_spec("torchtitan") is not None
    probe = subprocess.run([python, "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('torchtitan') is None)"], capture_output=True,
                           timeout=60, check=False)
    return probe.returncode == 0


def checked_load_csv(self, filename: str, format: str | None = None) -> None:  # noqa: A002 - torch's name
    """Stands in for ``_PipelineScheduleRuntime._load_csv``: pipesim's checks, then torch's
    loader in the file's own format. A ``format`` the caller insists on must be the file's."""
    from executor.torch_pipelining import load_schedule_csv, torch_format

    if format is not None and format != torch_format(schedule_from_csv(filename)):
        raise TorchMismatchError(f"{filename} is {torch_format(schedule_from_csv(filename))}, not {format}")
    load_schedule_csv(self, filename)


def install() -> None:
    """Make every ``_PipelineScheduleRuntime`` load its CSV through pipesim's checks."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime  # noqa: PLC0415

    import executor.torch_pipelining  # noqa: F401,PLC0415 - keeps torch's own loader before replacing it

    _PipelineScheduleRuntime._load_csv = checked_load_csv


def check(argv: list[str]) -> int:
    """``--check ARGS... [--python PATH]``: pipesim's checks, then torchtitan's parser; an
    "ok" line per file only when both ran and agree (exit 0), a line saying torchtitan's
    parser could not run when torchtitan is not importable (exit 1), one line naming the
    disagreement (exit 2)."""
    paths, python = argv[1:], sys.executable
    if "--python" in paths:
        at = paths.index("--python")
        paths, python = paths[:at] + paths[at + 2:], (paths[at + 1:at + 2] or [""])[0]
    if not paths or not python or any(path.startswith("--") for path in paths):
        print("usage: python -m executor.torchtitan_launch --check torchtitan.args... [--python PATH]",
              file=sys.stderr)
        return 2
    try:
        summaries = [check_config(path) for path in paths]
        if not torchtitan_python_available(python):
            print(f"cannot check: torchtitan is not importable by {python}, so its parser did not run (pipesim's "
                  f"own checks pass: {'; '.join(summaries)}); give --python with torchtitan {SUPPORTED_RELEASE}.x "
                  "installed", file=sys.stderr)
            return 1
        parsed = torchtitan_parse(paths, python)
    except (ValueError, OSError, subprocess.TimeoutExpired) as error:
        print(f"torchtitan_launch --check: error: {error}", file=sys.stderr)
        return 2
    for summary, verdict in zip(summaries, parsed, strict=True):
        print(f"ok: {summary}; {verdict}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--check"]:
        return check(argv)
    if importlib.util.find_spec("torchtitan") is None:
        print(f"torchtitan_launch: error: torchtitan is not installed in this environment "
              f"(pip install 'torchtitan=={SUPPORTED_RELEASE}.*')", file=sys.stderr)
        return 2
    try:
        supported_version(importlib.metadata.version("torchtitan"))
    except TorchMismatchError as error:
        print(f"torchtitan_launch: error: {error}", file=sys.stderr)
        return 2
    install()
    sys.argv = [sys.argv[0], *argv]
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
