"""The figures README.md and docs/cluster-model.md quote for the published Megatron
studies are the ones ``benchmarks/published.py`` computes: each no-calibration row of
the two tables, each study's median and worst, and the two studies' together. A change
to the model that moves them fails here until the docs are regenerated (run the script
and paste its tables)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from benchmarks.published import korthikanti_2022, narayanan_2021, predict, summary

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = (ROOT / "docs" / "cluster-model.md").read_text()
STUDIES = {"narayanan": narayanan_2021, "korthikanti": korthikanti_2022}


def errors(study: str) -> list[float]:
    return [abs(predict(run, None).error(run)) for run in STUDIES[study]()]


@pytest.mark.parametrize("study", sorted(STUDIES))
def test_every_no_calibration_row_is_quoted_as_printed(study):
    for run in STUDIES[study]():
        plain = predict(run, None)
        row = (f"| {run.label} | {run.gpus} | {run.microbatches} | {run.step_seconds:.3f} | "
               f"{plain.step_seconds:.3f} | {plain.error(run):+.1%} |")
        assert row in DOCS, f"docs/cluster-model.md does not quote {row}"


@pytest.mark.parametrize("study", sorted(STUDIES))
def test_each_studys_median_and_worst_are_quoted_as_printed(study):
    line = summary("no calibration", errors(study))
    assert f"\n{line}\n" in DOCS, f"docs/cluster-model.md does not quote {line!r}"


def test_the_two_studies_together_are_quoted_as_printed():
    both = errors("narayanan") + errors("korthikanti")
    median, worst = statistics.median(both), max(both)
    assert summary("Narayanan + Korthikanti, no calibration", both) in DOCS.replace("**", "")
    assert f"runs come within a {median:.1%} median, {worst:.1%} worst" in README
    assert (f"no calibration: median \\|error\\| {median:.1%}, worst {worst:.1%} over the two studies' "
            f"{len(both)} runs") in README
