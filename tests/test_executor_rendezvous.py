"""NCCL's rules on CPU: every generated schedule runs under ``--p2p rendezvous`` on gloo
(each P2P group waits for the peer's matching group through the handshake, receives
posted at their place, never ahead) and its loss and gradients equal the one-process
reference; so do the quick-start configs of the README and docs. A hand-made order
that hangs under rendezvous is refused before launch and, forced through, hangs and is
caught by the timeout instead of succeeding silently as it does on plain gloo.

One launch per world size runs all of its configs (spawning ranks dominates the cost on
a 2-core CI machine).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from executor.config import RunConfig
from executor.launch import PipelineRunError, launch
from executor.reference import reference_run
from executor.worker import build_schedule
from schedules.action import parse_action
from schedules.csv_io import schedule_to_csv
from schedules.generators import ScheduleUnavailableError, generate
from schedules.schedule import Schedule
from schedules.validate import ScheduleValidationError
from tests.program_checks import assert_each_rank_ran_its_program
from tests.test_executor import case_config

pytestmark = pytest.mark.timeout(400)
ROOT = Path(__file__).resolve().parent.parent


def generated_cases(pp: int) -> list[tuple]:
    """(pp, schedule, m, model, variant) for every generator at m in {pp, 2pp, 2pp+1}
    where it exists (interleaved with m >= 2pp is the set that hung before groups), with
    a split backward for each generator at m = 2pp."""
    found = []
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        for microbatches in (pp, 2 * pp, 2 * pp + 1):
            try:
                generate(schedule, pp, microbatches, 2 if schedule == "interleaved-1f1b" else 1)
            except ScheduleUnavailableError:
                continue
            found.append((pp, schedule, microbatches, "mlp", ""))
        found.append((pp, schedule, 2 * pp, "mlp", "IW"))
    return found


# The quick-start configs, in float64 (docs/executor.md, README's compare), as a case key.
QUICK_START = {
    "docs-quick-start": dict(schedule="interleaved-1f1b", pp=4, microbatches=8, virtual_stages=2, model="gpt",
                             layers=8, hidden=256, batch_size=32),
    "readme-compare": dict(schedule="interleaved-1f1b", pp=2, microbatches=8, virtual_stages=2, model="gpt",
                           layers=8, hidden=256, batch_size=32),
}


def config_of(case: tuple | str) -> RunConfig:
    if isinstance(case, str):
        return RunConfig(**QUICK_START[case], steps=2, dtype="float64", optimizer="adamw", lr=0.01,
                         return_grads=True, p2p="rendezvous")
    return dataclasses.replace(case_config(*case), p2p="rendezvous", prefetch_recvs=None)


CASES = [*generated_cases(2), "readme-compare", *generated_cases(4), "docs-quick-start"]
_launched: dict[int, dict] = {}


def result_of(case) -> dict:
    pp = config_of(case).pp
    if pp not in _launched:
        own = [c for c in CASES if config_of(c).pp == pp]
        _launched[pp] = dict(zip(own, launch([config_of(c) for c in own]), strict=True))
    return _launched[pp][case]


def case_id(case) -> str:
    if isinstance(case, str):
        return case
    pp, schedule, microbatches, model, variant = case
    return f"p{pp}-{schedule}-m{microbatches}-{model}" + (f"-{variant}" if variant else "")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_rendezvous_run_matches_one_process_reference(case) -> None:
    config = config_of(case)
    result, reference = result_of(case), reference_run(config)
    assert result["losses"] == pytest.approx(reference["losses"], abs=1e-10, rel=0)
    assert sorted(result["grads"]) == sorted(reference["grads"])
    for name, grad in reference["grads"].items():
        assert (result["grads"][name] - grad).abs().max().item() < 1e-10, name
    # every action of every rank's program ran and was timed, in program order for compute
    schedule, trace = build_schedule(config), result["trace"]
    assert_each_rank_ran_its_program(schedule, trace)


def hanging_order() -> Schedule:
    """gpipe, pp=2, m=2, with each transfer a group of its own and rank 1 sending B0
    before it receives F1: fine on gloo (sends are buffered), a cycle under rendezvous
    (rank 0's stream holds 0SEND_F1 before 0RECV_B0; rank 1's holds 1SEND_B0 before
    1RECV_F1)."""
    rows = ["0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
            "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"]
    return Schedule(pp=2, microbatches=2, placement=(0, 1), name="hand",
                    programs=[[parse_action(cell) for cell in row.split()] for row in rows])


def hanging_config(**overrides) -> RunConfig:
    return RunConfig(schedule="hand", pp=2, microbatches=2, hidden=8, layers=2, batch_size=2,
                     custom_schedule=hanging_order(), **overrides)


def test_hanging_order_runs_on_buffered_gloo_and_is_refused_under_rendezvous_before_launch() -> None:
    (result,) = launch(hanging_config(p2p="buffered", steps=1, timeout=20))
    assert len(result["losses"]) == 1
    with pytest.raises(ScheduleValidationError, match=r"rendezvous P2P semantics.*0SEND_F1.*1SEND_B0"):
        launch(hanging_config(p2p="rendezvous"))


def test_hanging_order_from_a_csv_is_refused_by_the_cli(tmp_path: Path) -> None:
    path = tmp_path / "hand.csv"
    schedule_to_csv(hanging_order(), path)
    finished = subprocess.run([sys.executable, "-m", "pipesim", "run", "--schedule-file", str(path), "--hidden", "8",
                               "--layers", "2", "--batch-size", "2", "--p2p", "rendezvous"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert finished.returncode == 2
    assert "cannot run under rendezvous P2P semantics" in finished.stderr
    assert "0SEND_F1" in finished.stderr and "1SEND_B0" in finished.stderr
    assert "Traceback" not in finished.stderr


def test_hanging_order_forced_through_hangs_and_is_caught_by_the_timeout() -> None:
    with pytest.raises(PipelineRunError) as failure:
        launch(hanging_config(p2p="rendezvous", timeout=5), unchecked=True)
    message = str(failure.value)
    # caught by the timeout (the first rank to give up reports it, or is stopped once its peer has)
    assert "Timed out" in message or "was stopped" in message, message
    # the rank and the transfer it was stuck on are named: an action of the cycle
    assert any(f"action {action} (waiting for rank {peer})" in message for action, peer in
               (("0SEND_F1", 1), ("0RECV_B0", 1), ("1SEND_B0", 0), ("1RECV_F1", 0))), message


def mismatched_order() -> Schedule:
    """gpipe, pp=2, m=2, rank 1 receiving F1 before F0: gloo matches by tag and runs it;
    NCCL would fill 1RECV_F1's buffer with 0SEND_F0's activation."""
    rows = ["0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
            "1RECV_F1 1RECV_F0 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1"]
    return Schedule(pp=2, microbatches=2, placement=(0, 1), name="mismatched",
                    programs=[[parse_action(cell) for cell in row.split()] for row in rows])


def test_pair_order_mismatch_is_refused_and_forced_through_fails_naming_both_actions() -> None:
    config = RunConfig(schedule="mismatched", pp=2, microbatches=2, hidden=8, layers=2, batch_size=2,
                       custom_schedule=mismatched_order(), p2p="rendezvous", timeout=20)
    with pytest.raises(ScheduleValidationError, match=r"0SEND_F0.*1RECV_F1"):
        launch(config)
    with pytest.raises(PipelineRunError) as failure:
        launch(config, unchecked=True)
    assert "rendezvous order mismatch: rank 0's 0SEND_F0 is its send #1 to rank 1, but rank 1's receive #1 " \
           "from rank 0 is 1RECV_F1" in str(failure.value)
