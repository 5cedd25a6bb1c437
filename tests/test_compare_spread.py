"""compare's spread of the measured steps and its warnings, on synthetic step times."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipesim.cli import main
from pipesim.sim.comparison import (
    compare,
    compute_stretch,
    reliability_warnings,
    report_lines,
    step_spread,
    stretch_warnings,
    transfer_warnings,
)
from schedules.trace import Trace, TraceEvent


def trace(source: str) -> Trace:
    events = [TraceEvent(rank, f"{rank}F0", "F", rank, 0, 0.0, 0.5, "compute") for rank in range(2)]
    return Trace(events, {"pp": 2, "schedule": "1f1b", "microbatches": 1, "virtual_stages": 1, "source": source})


def test_spread_of_five_steps_by_hand():
    # sorted 1.0 1.1 1.2 1.3 2.0: quartiles at positions 1 and 3 -> 1.1 and 1.3
    spread = step_spread([1.2, 2.0, 1.0, 1.3, 1.1])
    assert (spread["min"], spread["q1"], spread["median"], spread["q3"], spread["max"]) == pytest.approx(
        (1.0, 1.1, 1.2, 1.3, 2.0))
    assert spread["relative_spread"] == pytest.approx(0.2 / 1.2)


@given(st.lists(st.floats(min_value=1e-3, max_value=10.0), min_size=1, max_size=30))
def test_spread_is_ordered_and_one_slow_step_does_not_set_it(steps):
    spread = step_spread(steps)
    assert spread["min"] <= spread["q1"] <= spread["median"] <= spread["q3"] <= spread["max"]
    assert spread["median"] == statistics.median(steps)
    if len(steps) >= 5:
        slowed = step_spread([*steps[:-1], max(steps) * 100])
        assert slowed["q3"] <= max(steps) and slowed["max"] == max(steps) * 100


def test_a_quiet_run_on_an_idle_machine_has_no_warnings():
    spread = step_spread([1.00, 1.01, 0.99, 1.00, 1.02])
    assert reliability_warnings(spread, 5, load=1.5, cores=2, world_size=2) == []


def test_noisy_steps_too_few_steps_and_a_loaded_machine_each_warn():
    noisy = step_spread([1.0, 1.1, 1.2, 1.3, 1.4])  # IQR 0.2 of median 1.2
    assert reliability_warnings(noisy, 5, None, None, 2) == [
        "the steps' interquartile range is 16.7% of their median (over 5%): the run is too noisy for an error "
        "of a few percent to mean much"]
    quiet = step_spread([1.0] * 3)
    (few,) = reliability_warnings(quiet, 3, None, None, 2)
    assert few.startswith("only 3 steps measured after the warm-up")
    (loaded,) = reliability_warnings(quiet, 6, load=10.4, cores=2, world_size=2)
    assert loaded.startswith("machine load 10.4 on 2 cores (this run: 2 ranks)")
    assert reliability_warnings(quiet, 6, load=2.0, cores=2, world_size=2) == []  # load at the core count


def test_the_compare_document_carries_the_spread_and_the_warnings_into_the_report():
    document = compare(trace("measured"), [9.0, 1.0, 1.1, 1.2, 1.3, 1.4], trace("simulated"), 1.2, warmup_steps=1,
                       load=7.5, cores=2, world_size=2)
    assert document["measured_step_time"] == pytest.approx(1.2) and document["error"] == pytest.approx(0.0)
    assert document["measured_step_time_spread"]["max"] == 1.4  # the warm-up step is not in it
    assert (document["load_average"], document["cores"]) == (7.5, 2)
    assert len(document["warnings"]) == 2
    lines = report_lines(document)
    assert any("5 steps: min 1000.00" in line and "IQR 16.7% of the median   load 7.5 on 2 cores" in line
               for line in lines)
    assert sum(line.startswith("  warning: ") for line in lines) == 2


def test_compare_refuses_a_negative_warmup(capsys):
    assert main(["compare", "--schedule", "1f1b", "--pp", "2", "--warmup-steps", "-1"]) == 2
    assert "--warmup-steps must be >= 0, got -1" in capsys.readouterr().err


def test_compute_slower_in_the_run_than_profiled_is_named_per_rank():
    assert compute_stretch([0.6, 0.5, 0.3], [0.5, 0.5, 0.0]) == pytest.approx([1.2, 1.0, None])
    (line,) = stretch_warnings([1.2, 1.04, None, 0.9])
    assert line.startswith("compute ran at another speed in the run than in the profile (rank 0 x1.20, rank 3 x0.90:")
    assert stretch_warnings([1.04, 0.96, None]) == []
    slow = Trace([TraceEvent(rank, f"{rank}F0", "F", rank, 0, 0.0, 0.6, "compute") for rank in range(2)],
                 {"pp": 2, "schedule": "1f1b", "microbatches": 1, "virtual_stages": 1, "source": "measured"})
    document = compare(slow, [1.0] * 6, trace("simulated"), 1.0, load=1.0, cores=2)
    assert document["compute_stretch"] == pytest.approx([1.2, 1.2])
    assert [warning[:30] for warning in document["warnings"]] == ["compute ran at another speed i"]


def test_transfers_priced_far_from_what_they_took_are_said():
    """1f1b pp 4 on 2 cores: the run's transfers took 0.478 ms each from post to arrival,
    the links priced them at 2.225 ms: 4.65 times, beyond the factor of 2 (either way)."""
    (line,) = transfer_warnings({"transfers": 25, "measured": 0.478e-3, "predicted": 2.225e-3})
    assert "4.65x" in line and "2.225 against 0.478 ms" in line and "25 a rank waited through" in line
    (short,) = transfer_warnings({"transfers": 3, "measured": 3e-3, "predicted": 1e-3})
    assert "0.33x" in short
    assert transfer_warnings({"transfers": 4, "measured": 1e-3, "predicted": 1.9e-3}) == []
    assert transfer_warnings({"transfers": 4, "measured": 1e-3, "predicted": 0.6e-3}) == []
    assert transfer_warnings(None) == []
    assert transfer_warnings({"transfers": 0, "measured": 0.0, "predicted": 0.0}) == []
