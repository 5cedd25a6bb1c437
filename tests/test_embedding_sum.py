"""A tied model's embedding all-reduce between its first and last stages' ranks
(``Costs.embedding_sums``), priced by ``simulate`` as Megatron-LM runs it: after the
step's gradient reductions, before the optimizer, against hand calculations."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from pipesim.cluster.files import topology_from_dict
from pipesim.model.costs import Costs, CostsError, StageCost, costs_from_dict
from pipesim.model.spec import PRESETS
from pipesim.model.transformer_costs import with_embedding_copies
from pipesim.sim.step import run_simulation
from schedules import generate

# two devices joined by a 10 GB/s link, no latency: a ring all-reduce over two moves
# 2(n-1)/n * S = S bytes, so S / 10 GB/s
PAIR = {
    "devices": [{"name": "g0"}, {"name": "g1"}],
    "links": [{"src": "g0", "dst": "g1", "bandwidth": 10e9, "latency": 0.0}],
}
MB = 1e6


def two_stages(embedding_bytes: float, optimizer: float) -> Costs:
    """pp 2, F 4 ms, B 10 ms, nothing sent (no act bytes: the transfers take no time)."""
    stage = StageCost(fwd=4e-3, bwd=10e-3)
    return Costs(stages=(stage, stage), step_overhead=optimizer, embedding_sums=((0, 1, embedding_bytes),))


def tail(result, rank: int) -> list[tuple[str, float, float]]:
    return sorted(((event.kind, event.start, event.end) for event in result.trace.events
                   if event.rank == rank and event.stream == "step"), key=lambda part: part[1])


def test_the_pair_sums_once_both_are_done_then_steps():
    # 1F1B, pp 2, m 2. Rank 1: F0 4-8, B0 8-18, F1 18-22, B1 22-32 (done at 32). Rank 0:
    # F0 0-4, F1 4-8, B0 18-28, B1 32-42 (done at 42). 50 MB at 10 GB/s: 5 ms from 42,
    # rank 1 waiting in it from 32; the optimizer (1 ms) after it on both: 48 ms.
    result = run_simulation(generate("1f1b", 2, 2), two_stages(50 * MB, 1e-3), topology_from_dict(PAIR))
    expected = {0: [("EMBEDDING_ALLREDUCE", 42e-3, 47e-3), ("OPTIMIZER", 47e-3, 48e-3)],
                1: [("EMBEDDING_ALLREDUCE", 32e-3, 47e-3), ("OPTIMIZER", 47e-3, 48e-3)]}
    for rank, parts in expected.items():
        got = tail(result, rank)
        assert [kind for kind, _, _ in got] == [kind for kind, _, _ in parts]
        assert [moment for _, *span in got for moment in span] == pytest.approx(
            [moment for _, *span in parts for moment in span])
    assert result.metrics.makespan == pytest.approx(48e-3)


def test_without_an_optimizer_the_sum_alone_ends_the_step():
    result = run_simulation(generate("1f1b", 2, 2), two_stages(20 * MB, 0.0), topology_from_dict(PAIR))
    assert result.metrics.makespan == pytest.approx(44e-3)  # 42 ms + 20 MB / 10 GB/s


def test_a_copy_is_kept_and_summed_only_where_the_last_stage_has_no_first():
    spec = replace(PRESETS["gpt3-175b"], layers=8, hidden=256, heads=4, vocab=1000)  # tied, learned positions
    stage = StageCost(fwd=1.0, bwd=2.0, params=10, param_bytes=20)
    table = 500 * 256  # vocab 1000 over tp 2, rows of 256; the position table is not copied
    costs = with_embedding_copies(Costs(stages=(stage,) * 4), spec, [0, 1, 2, 3], tp=2)
    assert costs.embedding_sums == ((0, 3, table * spec.dtype_bytes),)
    assert costs.stages[3].params == 10 + table
    # a V-shaped placement: the last stage is on rank 0 with the first, which reads the one it has
    assert with_embedding_copies(Costs(stages=(stage,) * 4), spec, [0, 1, 1, 0], tp=2).embedding_sums == ()
    # the executor's stages keep a copy even there, summed on the rank, with no collective
    kept = with_embedding_copies(Costs(stages=(stage,) * 4), spec, [0, 1, 1, 0], tp=2, shared_on_rank=False)
    assert kept.stages[3].params == 10 + table and kept.embedding_sums == ()
    untied = replace(spec, tied_embeddings=False)
    assert with_embedding_copies(Costs(stages=(stage,) * 4), untied, [0, 1, 2, 3], tp=2).embedding_sums == ()


def test_a_tied_preset_draws_the_sum_between_its_first_and_last_ranks(tmp_path):
    from pipesim.cli import main

    out = tmp_path / "trace.json"
    assert main(["simulate", "--model", "gpt3-175b", "--layers", "4", "--hidden", "512", "--heads", "8",
                 "--pp", "4", "-m", "4", "--topology", "nvlink", "--gpu", "h100", "--trace", str(out)]) == 0
    events = json.loads(out.read_text())["events"]
    sums = sorted(event["rank"] for event in events if event["kind"] == "EMBEDDING_ALLREDUCE")
    assert sums == [0, 3]
    ends = {event["end"] for event in events if event["kind"] == "EMBEDDING_ALLREDUCE"}
    assert len(ends) == 1  # one collective: both ranks leave it together


def test_costs_files_keep_the_sums_and_refuse_bad_ones():
    costs = two_stages(8.0, 0.0)
    assert costs_from_dict(costs.to_dict()).embedding_sums == ((0, 1, 8.0),)
    document = costs.to_dict()
    for sums, words in (([{"first": 1, "last": 1, "bytes": 8}], "the first before the last"),
                        ([{"first": 0, "last": 2, "bytes": 8}], "two of the 2 stages"),
                        ([{"first": 0, "last": 1, "bytes": -1}], "embedding_sums[0].bytes must be a finite"),
                        ([{"first": 0, "last": 1}], "exactly first, last and bytes"),
                        ([{"first": "0", "last": 1, "bytes": 8}], "must be stage numbers"),
                        ({"first": 0}, "must be a list")):
        with pytest.raises(CostsError, match=r"^c\.json: .*" + re.escape(words)):
            costs_from_dict({**document, "embedding_sums": sums}, name="c.json")
