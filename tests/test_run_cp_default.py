"""``run --cp N`` exchanges keys and values the way ``simulate --cp N`` prices them when
neither names ``--cp-comm``: ring attention (p2p), so the same flags predict and run the
same exchange."""

from __future__ import annotations

import json

import pytest

from pipesim.cli import build_parser, main

pytestmark = pytest.mark.timeout(120)


def default_of(command: str, *argv: str) -> str:
    return build_parser(command).parse_args([command, *argv]).cp_comm


def test_run_and_simulate_default_to_the_same_exchange() -> None:
    assert default_of("simulate", "--cp", "2") == "p2p"
    assert default_of("run", "--cp", "2") == default_of("simulate", "--cp", "2")


def test_run_cp_2_without_cp_comm_runs_the_ring(tmp_path, capsys) -> None:
    out = tmp_path / "run.json"
    assert main(["run", "--model", "llama3-8b", "--pp", "1", "--cp", "2", "--layers", "2", "--hidden", "16",
                 "--heads", "4", "--kv-heads", "2", "--seq-len", "8", "--vocab", "37", "--batch-size", "2",
                 "--microbatches", "2", "--steps", "1", "--timeout", "60", "--json", str(out), "--quiet"]) == 0
    document = json.loads(out.read_text())
    assert (document["cp"], document["cp_comm"]) == (2, "p2p")
    assert " cp=2 cp-comm=p2p (world 2)" in capsys.readouterr().out
