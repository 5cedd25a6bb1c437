"""DeepSeek-V3's config with its own parts (FP8 GEMMs, the MTP module, node-limited
routing) on H800s with 20 SMs kept for communication, in the report's layout: the
tokens/s docs/cluster-model.md quotes, and within 15% of the report's pre-training
throughput (14.8T tokens in 2,664K H800 GPU-hours, its Table 1: 1,543 tokens/s per GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipesim.job import Job, model_figures, simulate_job

CONFIG = Path(__file__).parent / "data" / "hf_configs" / "deepseek-v3.json"


def test_deepseek_v3_in_the_reports_layout():
    job = Job(model=str(CONFIG), seq_len=4096, schedule="dualpipev", pp=16, dp=128, ep=64, topology="ib", nodes=256,
              gpu="h800", comm_sms=20, zero=1, microbatches=120)
    result = simulate_job(job)
    figures = model_figures(job, result)
    assert figures["model"]["fp8"] and figures["model"]["mtp_params"] > 0
    assert figures["model"]["moe"]["node_limit"] == 4
    assert f"{figures['tokens_per_second']:,.0f}" == "3,376,591"  # as docs/cluster-model.md quotes it
    per_gpu = figures["tokens_per_second"] / 2048
    assert per_gpu == pytest.approx(14.8e12 / (2664e3 * 3600), rel=0.15)
