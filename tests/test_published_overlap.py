"""Published H100 runs of stacks that overlap communication (benchmarks/published_overlap.py):
the rows' layouts are the published ones, their model flags reproduce each source's own
FLOP count, and the predictions are held to issue 30's target (not met yet: an expected
failure that says by how much)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from benchmarks.published_overlap import (
    B200_SOURCE,
    GB200_SOURCE,
    MOE_SOURCE,
    SOURCES,
    ZOO_SOURCE,
    by_layout,
    dense_megatron,
    drift_lines,
    ep_overlap_lines,
    error,
    fp8_over_bf16_lines,
    grace_blackwell_lines,
    later_containers,
    layout_key,
    main,
    memory_lines,
    newest_of_each_layout,
    predict,
    runs,
    summary,
    table,
)
from pipesim.cli import build_parser
from pipesim.job import Job, model_spec_of
from pipesim.model.transformer_costs import attention_flops_counted

ROWS = runs()
MEGATRON = [run for run in ROWS if dense_megatron(run)]
# how each source's model TFLOP/s counts the attention core (NeMo 24.07: the whole square;
# Megatron-Bridge: the causal half, as Megatron-LM's num_floating_point_operations does now)
ATTENTION_COUNT = {"nemo-24.07": "whole", ZOO_SOURCE: "causal", B200_SOURCE: "causal", GB200_SOURCE: "causal",
                   **{source: "causal" for source in SOURCES if source.startswith("bridge-")}}


def job_of(run) -> Job:
    return Job.from_namespace(build_parser("simulate").parse_args(["simulate", *run.argv()]))


@pytest.mark.parametrize("run", ROWS, ids=lambda run: run.label)
def test_each_rows_command_is_the_published_layout(run):
    job = job_of(run)
    assert run.source in SOURCES
    assert job.tp * job.pp * job.cp * job.dp == run.gpus  # every GPU of the published job, once
    assert job.dp * job.microbatches * job.microbatch_size == run.global_batch  # its global batch, as accumulated
    assert (job.tp, job.pp, job.cp, job.microbatch_size, job.seq_len, job.fp8) == \
           (run.tp, run.pp, run.cp, run.microbatch_size, run.seq_len, run.fp8 and run.fp8_scaling)
    assert job.zero == (3 if run.fsdp else 1) and not job.no_dp_overlap and not job.no_param_gather_overlap
    assert job.no_tp_overlap == (not run.tp_overlap)
    assert (job.virtual_stages or 1) == run.vp
    assert job.ep == run.ep and (job.etp or 0) == run.etp
    # DGX-B200's part, DGX-GB200's in its NVL72 racks, else DGX-H100's in 8-GPU nodes
    assert (job.gpu, job.topology) == {B200_SOURCE: ("b200", "ib"), GB200_SOURCE: ("gb200", "nvl72")}.get(
        run.source, ("h100", "ib"))


@pytest.mark.parametrize("run", [run for run in ROWS if run.tflops_per_gpu], ids=lambda run: run.label)
def test_model_flags_reproduce_the_sources_flop_count(run):
    """The source's TFLOP/s over its tokens/s is its FLOPs per token: the model flags give
    the same count (3 passes, the attention as the source counts it) within 1%, so the
    architecture simulated is the one measured."""
    spec = model_spec_of(job_of(run))
    whole = spec.sum_over_layers(lambda layer: spec.attention_core_flops())
    counted = attention_flops_counted(spec, ATTENTION_COUNT[run.source])
    per_token = 3 * (spec.forward_flops() - whole + counted) / (spec.seq_len * spec.microbatch_size)
    assert run.tflops_per_gpu * 1e12 / run.tokens_per_gpu == pytest.approx(per_token, rel=0.01)


@pytest.mark.xfail(strict=True, reason="issue 30's target is not met: every Megatron-Core layout but GPT3-20B is "
                   "predicted faster than published (each layout once at its newest container: median 8.8%, worst "
                   "14.3%), the predicted steps mostly compute (docs/cluster-model.md, 'Stacks that overlap "
                   "communication')")
def test_megatron_core_rows_within_the_target():
    """Each layout counted once, at its newest container: repeating a layout across
    containers would weight it by how often it was republished."""
    errors = [abs(error(run, predict(run))) for run in newest_of_each_layout(MEGATRON)]
    assert statistics.median(errors) <= 0.05
    assert max(errors) <= 0.10


def test_async_tp_is_predicted_faster_than_vanilla_tp_as_published():
    for overlapped in (run for run in ROWS if run.source == "torchtitan-asynctp" and run.tp_overlap):
        vanilla = next(run for run in ROWS if run.label == overlapped.label.replace("async", "vanilla"))
        assert overlapped.tokens_per_gpu > vanilla.tokens_per_gpu  # published
        assert predict(overlapped).tokens_per_gpu > predict(vanilla).tokens_per_gpu


def test_the_docs_quote_the_table_and_medians_as_printed():
    """docs/cluster-model.md's table and medians are what the benchmark prints now."""
    docs = (Path(__file__).resolve().parents[1] / "docs" / "cluster-model.md").read_text()
    lines, predictions = table(ROWS)
    for line in lines:
        assert line in docs, line
    errors = {run.label: abs(error(run, predictions[run.label])) for run in ROWS}
    assert summary("all rows", list(errors.values())) in docs
    assert summary("Megatron-Core dense rows (NeMo, Megatron-Bridge)", [errors[run.label] for run in MEGATRON]) in docs
    assert summary("held out", [errors[run.label] for run in ROWS if not run.in_sample]) in docs
    for line in fp8_over_bf16_lines(ROWS, predictions) + drift_lines(ROWS, predictions):
        assert f"- {line}" in docs, line
    for line in ep_overlap_lines(ROWS, predictions) + memory_lines(ROWS, predictions):
        assert line in docs, line
    zoo_text = docs[docs.index("**The Megatron-Core MoE team's own layouts**"):]
    zoo_text = zoo_text[:zoo_text.index("\n\n**")]
    for run in (run for run in ROWS if run.source == ZOO_SOURCE):  # the prose's figures, each row's own
        assert f"{run.tokens_per_gpu:,.0f}" in zoo_text and f"{error(run, predictions[run.label]):+.1%}" in zoo_text
    combined = [error(run, predictions[run.label]) for run in ROWS if run.source == MOE_SOURCE and run.ep_overlap]
    assert f"they come out {min(combined):+.1%} to {max(combined):+.1%}" in " ".join(docs.split())
    assert summary("mixture-of-experts layouts (Megatron-MoE-ModelZoo)",
                   [errors[run.label] for run in ROWS if run.source == ZOO_SOURCE]) in docs
    newest = newest_of_each_layout(MEGATRON)
    assert summary("Megatron-Core dense layouts, each once at its newest container",
                   [errors[run.label] for run in newest]) in docs
    assert summary("Megatron-Bridge layouts (2025-2026 containers), each once at its newest",
                   [errors[run.label] for run in newest if run.source.startswith("bridge-")]) in docs
    blackwell = newest_of_each_layout([run for run in ROWS if run.source == B200_SOURCE])
    assert summary("Megatron-Bridge on DGX-B200, each layout once at its newest",
                   [errors[run.label] for run in blackwell]) in docs
    grace = newest_of_each_layout([run for run in ROWS if run.source == GB200_SOURCE])
    assert summary("Megatron-Bridge on DGX-GB200 (NVL72), each layout once at its newest",
                   [errors[run.label] for run in grace]) in docs
    for line in grace_blackwell_lines(ROWS, predictions):
        assert f"- {line}" in docs, line
    moe = newest_of_each_layout([run for run in ROWS if run.source == MOE_SOURCE])
    assert summary("mixture-of-experts layouts (Megatron-Bridge), each once at its newest",
                   [errors[run.label] for run in moe]) in docs


def test_later_containers_rerun_layouts_already_in_the_table():
    """Every row from the other containers is a layout the table already has from another
    source (so its prediction is that row's, and the spread of the published figures is the
    software's own), and each layout is counted once at its newest source."""
    later = later_containers(ROWS)
    earlier = {layout_key(run): run for run in ROWS if run not in later}
    for run in later:
        twin = earlier[layout_key(run)]
        assert twin.source != run.source
        assert predict(run).tokens_per_gpu == predict(twin).tokens_per_gpu
    newest = newest_of_each_layout(MEGATRON)
    assert len(newest) == len({layout_key(run) for run in MEGATRON}) == 14
    order = list(SOURCES)
    for run in newest:
        assert all(order.index(other.source) <= order.index(run.source)
                   for other in MEGATRON if layout_key(other) == layout_key(run))


def test_fp8s_predicted_gain_is_not_above_the_published_one():
    """On torchtitan's pairs (one layout in float8 and in BF16) pipesim's FP8 speedup is at
    most the measured one: the FP8 model does not make the FP8 rows too fast."""
    _, predictions = table(ROWS)
    for float8 in (run for run in ROWS if run.source == "torchtitan-asynctp" and run.fp8):
        bf16 = next(run for run in ROWS if run.label == float8.label.replace("float8", "bf16"))
        predicted = predictions[float8.label].tokens_per_gpu / predictions[bf16.label].tokens_per_gpu
        assert 1 < predicted <= float8.tokens_per_gpu / bf16.tokens_per_gpu


def test_the_readme_quotes_the_figures_as_printed():
    """README.md's benchmark table row for this script: the dense summary, the
    Megatron-Bridge layouts', the drift between containers, the torchtitan range, the
    mixture-of-experts layouts' and the held-out count, as the benchmark computes them."""
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    _, predictions = table(ROWS)
    errors = {run.label: error(run, predictions[run.label]) for run in ROWS}
    dense = [abs(errors[run.label]) for run in newest_of_each_layout(MEGATRON)]
    assert (f"Megatron-Core dense layouts, each once at its newest container: median \\|error\\| "
            f"{statistics.median(dense):.1%}, worst {max(dense):.1%} over {len(dense)} runs") in readme
    bridge = [abs(errors[run.label]) for run in newest_of_each_layout(MEGATRON) if run.source.startswith("bridge-")]
    assert (f"the 2025-2026 Megatron-Bridge layouts median {statistics.median(bridge):.1%}, worst {max(bridge):.1%} "
            f"over {len(bridge)}") in readme
    drift = max(max(run.tokens_per_gpu for run in group) / min(run.tokens_per_gpu for run in group) - 1
                for group in by_layout(MEGATRON).values())
    assert f"moving by up to {drift:.1%} between containers" in readme
    titan = [errors[run.label] for run in ROWS if run.source == "torchtitan-asynctp"]
    assert f"torchtitan's Grand Teton rows {min(titan):+.1%} to {max(titan):+.1%}" in readme
    moe = sorted(errors[run.label] for run in newest_of_each_layout([run for run in ROWS if run.source == MOE_SOURCE]))
    fast = [value for value in moe if value > 0]
    slow = [value for value in moe if value <= 0]
    assert len(fast) == 6 and len(slow) == 1
    assert f"predicted {min(fast):+.0%} to {max(fast):+.0%} fast on six of seven, the seventh {slow[0]:+.1%}" in readme
    zoo = [errors[run.label] for run in ROWS if run.source == ZOO_SOURCE]
    assert f"three Qwen3-235B-A22B layouts {min(zoo):+.1%} to {max(zoo):+.1%}" in readme
    blackwell = sorted(errors[run.label] for run in newest_of_each_layout([run for run in ROWS
                                                                          if run.source == B200_SOURCE]))
    assert f"the DGX-B200 layouts (Llama 3 8B, 405B; `--gpu b200`, never checked on Blackwell before) " \
           f"{blackwell[0]:+.1%} and {blackwell[1]:+.1%} at their newest containers" in readme
    grace = [f"{errors[run.label]:+.1%}" for run in newest_of_each_layout([run for run in ROWS
                                                                            if run.source == GB200_SOURCE])]
    assert f"(Llama 3 8B, 70B under FSDP, 405B; `--gpu gb200 --topology nvl72`, new, the part's matmul " \
           f"throughput estimated from the datasheet peaks) {grace[0]}, {grace[1]} and {grace[2]} at their newest " \
           f"containers" in readme
    assert f"{sum(not run.in_sample for run in ROWS)} of the {len(ROWS)} rows held out" in readme


def test_the_script_prints_its_summaries(monkeypatch, capsys):
    """The command itself, end to end on a few rows: the table, then the summaries."""
    monkeypatch.setattr("sys.argv", ["published_overlap.py", "--only", "Qwen3-235B"])
    main()
    out = capsys.readouterr().out
    assert "| Qwen3-235B-A22B ep32 etp1 (26.04.01) | bridge-moe | 256 | 2 8 1 4 16 |" in out
    assert "mixture-of-experts layouts (Megatron-Bridge), each once at its newest: median |error|" in out
