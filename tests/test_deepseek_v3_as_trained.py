"""DeepSeek-V3's config with its own parts (FP8 GEMMs and caching, the MTP module,
node-limited routing) on H800s with 20 SMs kept for communication, in the report's layout
with DualPipe and its memory rules: the figures docs/cluster-model.md quotes, every rank
within the 80 GB device, and within 15% of the report's pre-training throughput (14.8T
tokens in 2,664K H800 GPU-hours, its Table 1: 1,543 tokens/s per GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.deepseek_v3 import COMMAND, PUBLISHED_TOKENS_PER_GPU, job_of
from pipesim.job import model_figures, simulate_job

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "docs" / "cluster-model.md").read_text()
README = " ".join((ROOT / "README.md").read_text().split())


def test_deepseek_v3_in_the_reports_layout():
    job = job_of()
    result = simulate_job(job)
    figures = model_figures(job, result)
    assert figures["model"]["fp8"] and figures["model"]["fp8_dispatch"] and figures["model"]["mtp_params"] > 0
    assert figures["model"]["moe"]["node_limit"] == 4
    assert result.schedule.name == "dualpipe" and result.schedule.step_microbatches * job.dp == 15360
    tokens = f"{figures['tokens_per_second']:,.0f}"
    assert f"; {tokens} tokens/s," in DOCS  # as docs/cluster-model.md quotes it
    assert " ".join(COMMAND.split()) in " ".join(DOCS.replace("\\\n", " ").split())
    fullest = max(result.memory, key=lambda rank: rank.peak_bytes)
    quoted_rows = [line.split() for line in DOCS.splitlines() if line.startswith(f"{fullest.rank:>6} ")]
    assert any(row[-2] == f"{fullest.peak_bytes / 1e9:.2f}" for row in quoted_rows), "the docs' fullest rank"
    assert not result.oom and fullest.peak_bytes <= fullest.usable_bytes
    per_gpu = figures["tokens_per_second"] / 2048
    assert per_gpu == pytest.approx(14.8e12 / (2664e3 * 3600), rel=0.15)
    quoted = (f"peaks at {fullest.peak_bytes / 1e9:.2f} GB a GPU, within what an 80 GB H800 leaves, "
              f"at {per_gpu:,.0f} tokens/s per GPU against the {PUBLISHED_TOKENS_PER_GPU:,.0f} of the report's "
              f"pre-training GPU-hours ({per_gpu / PUBLISHED_TOKENS_PER_GPU - 1:+.1%};")
    assert quoted in README, f"README.md does not quote {quoted!r}"
