"""pipesim's schedule files run in torch's own ``_PipelineScheduleRuntime``: every
generator at pp 2 and 4, the compute-only file (torch lowers it) and the lowered file
(``pipesim export --lowered``: run as written), under ``scale_grads=True`` (torch divides
the gradients by the microbatch count) and ``False`` (the loss already divides, as
torchtitan sets it). gloo on CPU, float64, an MLP of one block per stage, two SGD steps:
the loss of both steps and every gradient of the first equal the one-process reference
(``executor.reference``) to 1e-10. And pp 2 x dp 2 with every stage sharded by FSDP2
over the replicas, torch's UNSHARD/RESHARD/REDUCE_GRAD in the lowered file.

Both files are also loaded as torchtitan loads a schedule CSV (``_load_csv(path)``,
``scale_grads=False``) under ``executor.torchtitan_launch``, which loads each in its own
format. One launch of 4 processes runs every case (pp 2 on a group of the first two ranks);
the gloo timeout (30 s) and the test timeout make a hang fail rather than wait. A lowered
file without its REDUCE_GRAD cells, loaded past pipesim's check, shows what the check
prevents: gradients exactly m times too large.
"""

from __future__ import annotations

import pytest

from executor.config import RunConfig
from schedules.csv_io import schedule_to_csv
from schedules.generators import (
    GENERATORS,
    MULTI_CHUNK,
    ScheduleUnavailableError,
    generate,
    interleaved_auto,
    zb_auto,
    zbv_auto,
)
from schedules.schedule import Schedule
from schedules.torch_runtime import lower_for_torch_runtime

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(900)

# dualpipe: no file form
NAMES = (*(name for name in GENERATORS if name != "dualpipe"), "zb-auto", "zbv-auto", "interleaved-auto")
PIPELINES = (2, 4)
# (file, loader, scale_grads): each file in torch's runtime under both settings, and as
# torchtitan loads it (``runtime._load_csv(path)``, scale_grads=False) under
# ``executor.torchtitan_launch``
VARIANTS = [(form, "checked", scale) for form in ("compute-only", "lowered") for scale in (True, False)] + [
    (form, "torchtitan", False) for form in ("compute-only", "lowered")]
WORLD = max(PIPELINES)
FSDP_PIPELINE, FSDP_REPLICAS = 2, 2  # pp x dp = WORLD
TOLERANCE = 1e-10


def microbatches(pp: int) -> int:
    """2p: interleaved's rounds (m // p = 2) divide it, and DualPipeV needs m >= 2p."""
    return 2 * pp


def chunks(name: str) -> int:
    return 2 if name in MULTI_CHUNK else 1


def build(name: str, pp: int) -> Schedule:
    if name == "zb-auto":
        return zb_auto(pp, microbatches(pp), 1.0, 1.0, 0.7, 0.1, pp)
    if name == "zbv-auto":
        return zbv_auto(pp, microbatches(pp), 1.0, 1.0, 0.7, 0.1)
    if name == "interleaved-auto":  # below Megatron's memory: a searched order
        return interleaved_auto(pp, microbatches(pp), chunks(name), 0.5, 1.0, 0.1, memory_limit=pp + 1)
    return generate(name, pp, microbatches(pp), chunks(name))


def config_for(name: str, pp: int, dp: int = 1) -> RunConfig:
    return RunConfig(pp=pp, dp=dp, microbatches=microbatches(pp), virtual_stages=chunks(name), model="mlp",
                     layers=pp * chunks(name), hidden=4, batch_size=2 * dp * microbatches(pp), steps=2, seed=3,
                     dtype="float64", optimizer="sgd", lr=0.1, backend="gloo", timeout=30.0)


def label(name: str, pp: int, form: str, loader: str, scale_grads: bool, dp: int = 1) -> str:
    return f"p{pp}-dp{dp}-{name}-{form}-{loader}-scale_grads={scale_grads}"


_results: dict[str, dict] = {}
_unavailable: dict[tuple[str, int], str] = {}


def launched(tmp_path_factory) -> dict[str, dict]:
    """Every case's result, from one launch of WORLD processes (made on first use)."""
    if _results:
        return _results
    from executor.spawn import launch_ranks
    from executor.torch_pipelining import TorchCase, run_cases

    folder = tmp_path_factory.mktemp("torch-runtime")
    jobs = []
    for pp in PIPELINES:
        for name in NAMES:
            try:
                schedule = build(name, pp)
            except (ScheduleUnavailableError, ValueError) as error:
                _unavailable[(name, pp)] = str(error)
                continue
            files = {"compute-only": schedule, "lowered": lower_for_torch_runtime(schedule)}
            for form, written in files.items():
                schedule_to_csv(written, folder / f"{name}-p{pp}-{form}.csv", groups=False)
            cases = [TorchCase(label(name, pp, form, loader, scale), str(folder / f"{name}-p{pp}-{form}.csv"),
                               scale, loader) for form, loader, scale in VARIANTS]
            jobs.append((config_for(name, pp), cases))
    # FSDP over 2 replicas of a 2-rank pipeline: torch's own UNSHARD/RESHARD in the
    # compute-only file, pipesim's (`export --lowered --fsdp`) in the lowered one
    for name in NAMES:
        schedule = build(name, FSDP_PIPELINE)
        files = {"compute-only": (schedule, False), "lowered": (lower_for_torch_runtime(schedule), True)}
        for form, (written, fsdp) in files.items():
            schedule_to_csv(written, folder / f"{name}-fsdp-{form}.csv", groups=False, fsdp=fsdp)
        jobs.append((config_for(name, FSDP_PIPELINE, FSDP_REPLICAS), [
            TorchCase(label(name, FSDP_PIPELINE, form, "checked", scale, FSDP_REPLICAS),
                      str(folder / f"{name}-fsdp-{form}.csv"), scale)
            for form in files for scale in (True, False)]))
    # the same lowered 1F1B file without its REDUCE_GRAD cells, past pipesim's check
    lowered = (folder / "1f1b-p4-lowered.csv").read_text()
    stripped = folder / "1f1b-p4-no-reduce-grad.csv"
    stripped.write_text(lowered.replace(",0REDUCE_GRAD", "").replace(",1REDUCE_GRAD", "")
                        .replace(",2REDUCE_GRAD", "").replace(",3REDUCE_GRAD", ""))
    jobs.append((config_for("1f1b", 4), [TorchCase("no-reduce-grad", str(stripped), True, loader="torch")]))
    per_rank = launch_ranks(run_cases, (jobs,), WORLD)
    for results in per_rank.values():
        for case_label, result in results.items():
            merged = _results.setdefault(case_label, {"losses": [], "grads": {}})
            merged["grads"].update(result["grads"])
            merged["losses"] = merged["losses"] or result["losses"]
    return _results


_references: dict[tuple[str, int, int], dict] = {}


def reference(name: str, pp: int, dp: int = 1) -> dict:
    """The one-process run of the whole batch (all replicas' slices)."""
    from executor.reference import reference_run

    if (name, pp, dp) not in _references:
        _references[(name, pp, dp)] = reference_run(config_for(name, pp, dp))
    return _references[(name, pp, dp)]


def assert_matches(result: dict, expected: dict) -> None:
    assert result["losses"] == pytest.approx(expected["losses"], abs=TOLERANCE, rel=0)
    assert sorted(result["grads"]) == sorted(expected["grads"])
    for parameter, grad in expected["grads"].items():
        assert (result["grads"][parameter] - grad).abs().max().item() < TOLERANCE, parameter


@pytest.mark.parametrize(("form", "loader", "scale_grads"), VARIANTS,
                         ids=[f"{form}-{loader}-{'scale_grads' if scale else 'loss_divided'}"
                              for form, loader, scale in VARIANTS])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("pp", PIPELINES, ids=lambda pp: f"p{pp}")
def test_torch_runtime_matches_one_process_reference(tmp_path_factory, pp, name, form, loader, scale_grads):
    results = launched(tmp_path_factory)
    if (name, pp) in _unavailable:
        pytest.skip(f"{name} does not exist for pp={pp}, m={microbatches(pp)}: {_unavailable[(name, pp)]}")
    assert_matches(results[label(name, pp, form, loader, scale_grads)], reference(name, pp))


@pytest.mark.parametrize("scale_grads", [True, False], ids=["scale_grads", "loss_divided"])
@pytest.mark.parametrize("form", ["compute-only", "lowered"])
@pytest.mark.parametrize("name", NAMES)
def test_fsdp_replicas_match_one_process_reference(tmp_path_factory, name, form, scale_grads):
    """pp 2 x dp 2, each stage sharded with FSDP2 over the replicas: the lowered file's
    UNSHARD/RESHARD gather the parameters where torch's own lowering would, and its
    REDUCE_GRAD reduces the gradients across the replicas."""
    results = launched(tmp_path_factory)
    assert_matches(results[label(name, FSDP_PIPELINE, form, "checked", scale_grads, FSDP_REPLICAS)],
                   reference(name, FSDP_PIPELINE, FSDP_REPLICAS))


def test_every_schedule_is_exercised_as_intended(tmp_path_factory):
    """The cases above cover what they claim: no generator was skipped at these sizes,
    zbv and dualpipev place stages in a V (the last stage on rank 0), dualpipev has
    overlapped pairs, and the split-backward schedules run I and W."""
    launched(tmp_path_factory)
    assert not _unavailable
    for pp in PIPELINES:
        assert all(build(name, pp).placement[-1] == 0 for name in ("zbv", "zbv-auto", "dualpipev"))
        assert any(build("dualpipev", pp).fused)
        for name in ("zb-h1", "zb-h2", "zb-auto", "zbv", "zbv-auto", "interleaved-zb"):
            assert {"I", "W"} <= {action.kind for program in build(name, pp).programs for action in program}


def test_a_lowered_file_without_reduce_grad_gives_m_times_the_gradients(tmp_path_factory):
    """What pipesim's check refuses (``schedules.torch_compat.check_reduce_grad``): torch
    runs such a file, scales nothing, and every gradient is m = 8 times the true one."""
    result, expected = launched(tmp_path_factory)["no-reduce-grad"], reference("1f1b", 4)
    for parameter, grad in expected["grads"].items():
        assert (result["grads"][parameter] - microbatches(4) * grad).abs().max().item() < TOLERANCE, parameter
