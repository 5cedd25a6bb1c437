"""Uneven stages: the default split balances each stage's compute, the output layer on the
last stage included (Meta's Llama 3 405B split falls out of it), and a stage given by hand
may hold no layer only at either end."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim import job
from pipesim.cli import main
from pipesim.model.spec import ModelSpecError, model_costs, model_spec
from pipesim.model.stage_split import check_layers_per_stage, ends_on_one_rank, split_layers

PEAK = 1e15
FREE_HBM = {"fallback_memory_bandwidth": math.inf}  # FLOPs only: memory-bound kernels cost nothing


def llama_ratio(h: int, kv: int, f: int, s: int, vocab: int) -> float:
    """The output layer's forward FLOPs per token over one Llama layer's, by hand: the
    layer's GEMMs 2(h(h + 2kv) + h^2 + 3hf) and attention 4sh, the logits 2hV (the
    backward is twice the forward for both, so the ratio holds for F + B)."""
    layer = 2 * (h * (h + 2 * kv) + h * h + 3 * h * f) + 4 * s * h
    return 2 * h * vocab / layer


def test_llama3_405b_splits_as_meta_did():
    # 126 layers; the output layer costs 0.61 of a layer (by hand: 4.20 / 6.91 GFLOP per token).
    # 16 stages: a slowest stage of 8 layers holds 15 x 8 + 7 (7 + 0.61 <= 8) = 127 >= 126,
    # one of 7.61 only 112: one layer too many, taken off the heaviest and outermost: the
    # first stage. 128 stages (16 ranks x 8 chunks): 1 layer each holds 127 (the last stage
    # only its output layer), one too many again: the first stage holds the embedding alone.
    ratio = llama_ratio(16384, 8 * 128, 53248, 8192, 128256)
    assert ratio == pytest.approx(4_202_692_608 / 6_912_212_992)
    assert split_layers(126, 16, last_extra=ratio) == [7] + [8] * 14 + [7]
    assert split_layers(126, 128, last_extra=ratio) == [0] + [1] * 126 + [0]
    spec = model_spec("llama3-405b")
    for stages, expected in ((16, [7] + [8] * 14 + [7]), (128, [0] + [1] * 126 + [0])):
        costs = model_costs(spec, stages, [PEAK] * stages, mfu=0.5, **FREE_HBM)
        assert costs.meta["layers_per_stage"] == expected


def test_llama3_8b_gives_the_last_stage_fewer_layers_for_its_output_layer():
    # The 128,256-row output layer costs 1.84 layers (1.05 / 0.57 GFLOP per token). On 4
    # stages a slowest stage of 9 layers holds 9 + 9 + 9 + 7 = 34 >= 32 (8.84 holds 31):
    # two too many, off the heaviest and outermost: stage 0, then stage 1 (the last stage,
    # at 7 + 1.84, is not among the heaviest). Slowest stage 9 layers' time against 9.84
    # for the even split.
    ratio = llama_ratio(4096, 8 * 128, 14336, 8192, 128256)
    assert ratio == pytest.approx(1_050_673_152 / 570_425_344)
    assert split_layers(32, 4, last_extra=ratio) == [8, 8, 9, 7]
    spec = model_spec("llama3-8b")
    costs = model_costs(spec, 4, [PEAK] * 4, mfu=0.5, **FREE_HBM)
    assert costs.meta["layers_per_stage"] == [8, 8, 9, 7]
    layer = spec.layer_flops() / (PEAK * 0.5)
    assert costs.stages[2].fwd == pytest.approx(9 * layer)
    assert costs.stages[3].fwd == pytest.approx((7 + ratio) * layer)
    assert max(stage.fwd for stage in costs.stages) == pytest.approx(9 * layer)
    even = model_costs(spec, 4, [PEAK] * 4, mfu=0.5, layers_per_stage=[8] * 4, **FREE_HBM)
    assert max(stage.fwd for stage in even.stages) == pytest.approx((8 + ratio) * layer)


def test_without_an_output_layer_the_split_is_even_with_the_extra_layers_in_the_middle():
    assert split_layers(8, 4) == [2, 2, 2, 2]
    assert split_layers(10, 4) == [2, 3, 3, 2]
    assert split_layers(9, 4) == [2, 2, 3, 2]
    assert split_layers(3, 4) == [0, 1, 1, 1]  # the first stage: the embedding alone
    assert split_layers(2, 4) == [0, 1, 1, 0]
    with pytest.raises(ModelSpecError, match="1 layers, too few for 4 stages .*at most 3"):
        split_layers(1, 4)


def test_layers_per_stage_may_leave_only_the_ends_without_a_layer():
    assert check_layers_per_stage([0, 16, 16, 0], 32, 4) == [0, 16, 16, 0]
    with pytest.raises(ModelSpecError, match="stage 1 holds no layer; only the first stage"):
        check_layers_per_stage([16, 0, 16, 0], 32, 4)
    with pytest.raises(ModelSpecError, match="a stage holds 0 layers or more"):
        check_layers_per_stage([17, -1, 16, 0], 32, 4)
    with pytest.raises(ModelSpecError, match="sums to 31 but the model has 32 layers"):
        check_layers_per_stage([0, 16, 15, 0], 32, 4)


def test_embedding_only_and_head_only_chunks_on_the_command_line(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["simulate", "--model", "llama3-8b", "--schedule", "interleaved-1f1b", "--pp", "2", "-v", "2",
                 "-m", "4", "--layers-per-stage", "0,16,16,0", "--json", str(out)]) == 0
    stages = json.loads(out.read_text())["stage_costs"]
    assert [stage["layers"] for stage in stages] == [0, 16, 16, 0]
    assert stages[0]["params"] == 128256 * 4096  # the embedding alone
    assert stages[3]["params"] == 4096 + 128256 * 4096  # the final norm and the output layer
    code = main(["simulate", "--model", "llama3-8b", "--schedule", "interleaved-1f1b", "--pp", "2", "-v", "2",
                 "-m", "4", "--layers-per-stage", "16,0,16,0"])
    assert code == 2
    assert "--layers-per-stage 16,0,16,0: stage 1 holds no layer" in capsys.readouterr().err


# --- rank by rank where one rank holds both ends (V placements, DualPipe's two copies) ---

V4 = (0, 1, 2, 3, 3, 2, 1, 0)  # zbv's and dualpipev's placement of 8 chunks on 4 ranks


def test_a_v_placement_is_balanced_rank_by_rank_by_hand():
    """32 layers on 8 chunks, the output layer worth 3 layers on the last chunk, which rank 0
    holds with the first. The ranks' least slowest load is 9 (8 leaves rank 0 5 layers and
    the others 8 each, 29 < 32); rank 0 fits 6, the others 9: 33, one too many, taken off
    rank 0 (the heaviest, 9, tied, the lowest stage first). Rank 0's 5 layers fill its first
    chunk to the last one's 3 (the later chunk first among equals), then one each: 4 and 1;
    the other ranks' 9 go 4 and 5. Stage by stage, rank 3 would hold 10."""
    assert split_layers(32, 8, last_extra=3.0, ranks=V4) == [4, 4, 4, 4, 5, 5, 5, 1]
    by_stage = split_layers(32, 8, last_extra=3.0)
    assert by_stage == [4, 4, 4, 5, 5, 5, 4, 1]
    assert max(by_stage[rank] + by_stage[7 - rank] for rank in range(4)) == 10


def test_which_placements_split_rank_by_rank():
    assert ends_on_one_rank(V4) == V4
    assert ends_on_one_rank((0, 1, 2, 3, 0, 1, 2, 3)) is None  # looped: the ends on ranks 0 and 3
    assert ends_on_one_rank((0, 1, 2, 3)) is None
    # DualPipe: one copy's 4 stages of 8, rank r holding copy 0's stage r and copy 1's stage 3 - r
    assert ends_on_one_rank((0, 1, 2, 3, 3, 2, 1, 0), copies=2) == (0, 1, 1, 0)


@settings(max_examples=200, deadline=None)
@given(ranks=st.integers(2, 8), layers_per_rank=st.integers(1, 12), more=st.integers(0, 7),
       extra=st.floats(0, 12, allow_nan=False))
def test_rank_by_rank_never_loads_a_rank_more_than_stage_by_stage(ranks, layers_per_rank, more, extra):
    """The rank-by-rank split holds every layer, a layer on every middle chunk, and its
    fullest rank (layers plus the output layer's extra) is never fuller than the stage-by-
    stage split's: it searches that load itself."""
    layers = 2 * ranks * layers_per_rank + more
    placement = tuple(range(ranks)) + tuple(reversed(range(ranks)))
    counts = split_layers(layers, 2 * ranks, last_extra=extra, ranks=placement)
    assert sum(counts) == layers and all(count >= 1 for count in counts[1:-1])

    def fullest(split):
        return max(split[rank] + split[2 * ranks - 1 - rank] + (extra if rank == 0 else 0.0) for rank in range(ranks))

    assert fullest(counts) <= fullest(split_layers(layers, 2 * ranks, last_extra=extra)) + 1e-9


def test_simulate_splits_a_v_schedule_rank_by_rank_and_runs_faster(tmp_path, monkeypatch):
    """Gemma 3 1B (262,144-token vocabulary: its output layer and loss outweigh several of
    its 26 layers) on 4 H100s under zbv: the default split balances ranks, leaving rank 0,
    which runs the output layer and its loss, fewer layers than stage by stage (which
    fills its first chunk like any other), and the step is shorter."""
    args = ["simulate", "--model", "gemma-3-1b", "--seq-len", "4096", "--schedule", "zbv",
            "--pp", "4", "-m", "16", "--gpu", "h100"]
    assert main([*args, "--json", str(tmp_path / "ranks.json")]) == 0
    monkeypatch.setattr("pipesim.model.stage_split.ends_on_one_rank", lambda placement, copies=1: None)
    for cached in (job._model_costs, job._model_costs_per_optimizer_byte):  # the costs are kept per input
        cached.cache_clear()
    assert main([*args, "--json", str(tmp_path / "stages.json")]) == 0
    ranks, stages = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("ranks", "stages"))
    layers = [[stage["layers"] for stage in result["stage_costs"]] for result in (ranks, stages)]
    assert layers[0] != layers[1] and sum(layers[0]) == sum(layers[1]) == 26
    assert layers[0][0] + layers[0][-1] < layers[1][0] + layers[1][-1]  # rank 0 also runs the output layer
    assert ranks["makespan"] < stages["makespan"]


def test_a_run_splits_a_v_schedule_as_simulate_does(tmp_path):
    """The executor builds each stage's layers by the simulator's split
    (``executor.architectures.build.stage_layers``): for a V schedule and DualPipe it
    groups the stages by rank as ``simulate`` does, so Gemma 3 1B under zbv at pp 4 holds
    the layers ``simulate --json`` reports (not the stage-by-stage split, which differs)."""
    from executor.architectures.build import stage_layers
    from executor.config import RunConfig
    from pipesim.model.spec import model_spec as spec_of

    zbv, dualpipe = (RunConfig(schedule=name, pp=4, virtual_stages=2, microbatches=8) for name in ("zbv", "dualpipe"))
    assert zbv.split_ranks == V4 and dualpipe.split_ranks == (0, 1, 1, 0)
    assert RunConfig(schedule="interleaved-1f1b", pp=4, virtual_stages=2, microbatches=8).split_ranks is None
    out = tmp_path / "zbv.json"
    assert main(["simulate", "--model", "gemma-3-1b", "--schedule", "zbv", "--pp", "4",
                 "-m", "8", "--gpu", "h100", "--json", str(out)]) == 0
    simulated = [stage["layers"] for stage in json.loads(out.read_text())["stage_costs"]]
    spec = spec_of("gemma-3-1b")
    assert stage_layers(spec, 8, None, split_ranks=zbv.split_ranks) == simulated
    assert stage_layers(spec, 8, None) != simulated
