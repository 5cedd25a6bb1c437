"""Predictions with no calibration against published training runs (benchmarks/published.py):
every expected figure is the paper's (Narayanan et al. 2021 Table 1, Korthikanti et al.
2022 Table 5: step times; Dubey et al. 2024 Table 4: Llama 3 405B's MFU)."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.published import korthikanti_2022, llama3_2024, narayanan_2021, predict


def test_megatron_studies_without_calibration():
    """The GPU's compute model, no --mfu: median |error| <= 10%, worst <= 15% over both
    studies' 18 rows, each run with its paper's setup (A100, no flash attention, full or
    selective recompute, no dp overlap in 2021)."""
    errors = [abs(predict(run, None).error(run)) for run in narayanan_2021() + korthikanti_2022()]
    assert len(errors) == 18
    assert statistics.median(errors) <= 0.10
    assert max(errors) <= 0.15


LLAMA = {run.label: run for run in llama3_2024()}


def test_llama3_405b_on_16384_gpus_without_calibration():
    """Meta reports 41% MFU (tp 8, pp 16, dp 128, 16 sequences of 8192 per replica)."""
    run = LLAMA["405B 16384 GPUs t8 p16 d128"]
    assert run.published_mfu == 0.41
    assert abs(predict(run, None).error(run)) <= 0.10


@pytest.mark.xfail(strict=True, reason="predicts 51.0% MFU where Meta reports 43% (+18.5%): the step the model "
                   "simulates has less overhead than Meta's at 8,192 GPUs (docs/cluster-model.md)")
def test_llama3_405b_on_8192_gpus_without_calibration():
    """Meta reports 43% MFU (tp 8, pp 16, dp 64, 32 sequences of 8192 per replica)."""
    run = LLAMA["405B 8192 GPUs t8 p16 d64"]
    assert abs(predict(run, None).error(run)) <= 0.10
