"""Expert parallelism executed (``run --ep``): each MoE layer's experts split over ep
groups cut from the dp ranks, tokens traded by all-to-all. A shrunk Mixtral and
DeepSeek-V3 (sigmoid router, shared experts) in float64 on gloo: every step's loss and
every gradient of the first step equal the one-process reference to 1e-10. The groups
are the simulator's (``pipesim.cluster.mapping``), and bad values are refused in one line.
"""

from __future__ import annotations

import pytest

from executor.architectures.build import shrunk_spec
from executor.architectures.moe import MixtureOfExperts
from executor.config import ConfigError, RunConfig
from executor.expert_parallel import ExpertGroups, expert_groups_of, expert_range, shard_experts
from executor.mesh import MeshPosition
from executor.models import build_model
from executor.reference import reference_run
from pipesim.cli import main
from tests.launched_cases import LaunchedCases, assert_equals_reference

pytestmark = pytest.mark.timeout(300)

SMALL = {"model": "mixtral-8x7b", "hidden": 16, "heads": 4, "kv_heads": 2, "layers": 2, "experts": 4, "seq_len": 8,
         "vocab": 37, "batch_size": 8, "steps": 2, "dtype": "float64", "optimizer": "adamw", "lr": 0.02,
         "return_grads": True, "schedule": "1f1b", "microbatches": 2}
CASES_OF_WORLD = {
    2: {"mixtral-pp1-dp2-ep2": {"pp": 1, "dp": 2, "ep": 2},
        # combined 1F1B without pipelining: F0, then F(i+1) with B(i) as one step (schedules.generators.combined)
        "mixtral-pp1-dp2-ep2-combined": {"pp": 1, "dp": 2, "ep": 2, "microbatches": 4, "ep_overlap": True}},
    4: {
        "mixtral-pp2-dp2-ep2": {"pp": 2, "dp": 2, "ep": 2},
        # combined 1F1B on the interleaved order: one more warm-up forward, then fused pairs, under
        # NCCL's rule (rendezvous: a send waits for its receive, receives never posted ahead)
        "mixtral-pp2-v2-dp2-ep2-combined": {"pp": 2, "dp": 2, "ep": 2, "layers": 4, "schedule": "interleaved-1f1b",
                                            "virtual_stages": 2, "microbatches": 4, "ep_overlap": True,
                                            "p2p": "rendezvous"},
        # ep 2 of dp 4: the experts' gradients are reduced over pairs of ep groups.
        "mixtral-pp1-dp4-ep2": {"pp": 1, "dp": 4, "ep": 2},
        # one expert per rank, some sequences' copies dropped by the capacity
        "mixtral-pp1-dp4-ep4-capacity": {"pp": 1, "dp": 4, "ep": 4, "capacity_factor": 0.5},
        # tp splits each expert (Megatron's expert tensor parallelism = tp); every tp rank
        # of an ep group trades the same tokens with its own tp shard's peers
        "mixtral-pp1-dp2-ep2-tp2": {"pp": 1, "dp": 2, "ep": 2, "tp": 2},
        # with sequence parallelism each tp rank routes its own shard (Megatron-Core's layer,
        # executor.shard_routing): the rows it received gathered over tp around the experts' shards
        "qwen-moe-pp1-dp2-ep2-tp2-sp": {"model": "qwen1.5-moe-a2.7b", "ffn_hidden": 16,
                                        "pp": 1, "dp": 2, "ep": 2, "tp": 2, "sequence_parallel": True},
        # ... the capacity counting the copies of the sequence's earlier shard, the balance loss's counts
        # summed over tp, two steps of AdamW clipped by the global norm
        "mixtral-pp1-dp2-ep2-tp2-sp-capacity": {"pp": 1, "dp": 2, "ep": 2, "tp": 2, "sequence_parallel": True,
                                                "capacity_factor": 0.75, "clip_grad": 1.0},
        # the all-to-alls' backward inside zero-bubble's input-gradient pass
        "deepseek-v3-pp2-dp2-ep2-zb-h1": {"model": "deepseek-v3", "kv_heads": None, "layers": 3, "pp": 2, "dp": 2,
                                          "ep": 2, "schedule": "zb-h1", "microbatches": 4},
    },
}
LAUNCHED = LaunchedCases(SMALL, CASES_OF_WORLD)
CASES = LAUNCHED.cases
case_config = LAUNCHED.config


@pytest.mark.parametrize("name", CASES)
def test_expert_parallel_step_equals_one_process_reference(name: str) -> None:
    assert_equals_reference(LAUNCHED.result(name), reference_run(case_config(name)))


def test_shard_routing_gathers_the_received_rows_over_tp() -> None:
    """By hand, one stage of 2 layers at tp 2 with sequence parallelism and ep 2: each
    layer's attention runs 2 tp collectives in the forward and 3 in the backward (its
    input gathered again), as a dense layer's; its mixture of experts routes the rank's
    own shard and gathers the rows the rank received over tp before the experts and
    reduce-scatters their outputs after (2), and the backward mirrors the two (2), with no
    sequence gathered for the MLP. The head's gather and the embedding cut's backward add
    1 each: 9 and 11 (every tp rank routing the gathered sequence ran 9 and 15)."""
    assert LAUNCHED.tp_collectives_per_action("mixtral-pp1-dp2-ep2-tp2-sp-capacity") == {"0F": {9}, "0B": {11}}


def test_groups_are_the_simulators() -> None:
    """dp 4, pp 2, ep 2 (ranks pp-major, then dp): ep groups of consecutive dp ranks,
    expert dp groups of the members at the same place (as mapping.py cuts them)."""
    ep_groups, expert_dp_groups = expert_groups_of(MeshPosition.of_rank(0, dp=4, pp=2, tp=1), ep=2)
    assert ep_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert expert_dp_groups == [[0, 2], [1, 3], [4, 6], [5, 7]]
    ep_groups, expert_dp_groups = expert_groups_of(MeshPosition.of_rank(0, dp=4, pp=1, tp=2), ep=4)
    assert ep_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]  # tp innermost: same tp shard only
    assert expert_dp_groups == [[0], [2], [4], [6], [1], [3], [5], [7]]
    # with cp 2 the ep groups are cut from the dp x cp ranks, in global-rank order
    ep_groups, expert_dp_groups = expert_groups_of(MeshPosition.of_rank(0, dp=2, pp=1, tp=1, cp=2), ep=2)
    assert ep_groups == [[0, 1], [2, 3]]
    assert expert_dp_groups == [[0, 2], [1, 3]]
    assert list(expert_range(8, 4, 1)) == [2, 3]


def test_a_rank_keeps_only_its_experts_under_their_global_names() -> None:
    config = RunConfig(**{**SMALL, "pp": 1, "dp": 2, "ep": 2})
    stage = build_model(config).build_stage(0, 1)
    shard_experts(stage, ExpertGroups(ep=2, ep_index=1, ep_group=None, expert_dp_group=None))
    layers = [module for module in stage.modules() if isinstance(module, MixtureOfExperts)]
    assert len(layers) == shrunk_spec(config).layers
    for layer in layers:
        assert list(layer.experts) == ["2", "3"]
        assert layer.num_experts == 4
    names = {name for name, _ in stage.named_parameters() if ".experts." in name}
    assert names and all(".experts.2." in name or ".experts.3." in name for name in names)


@pytest.mark.parametrize(("changes", "expected"), [
    ({"dp": 2, "ep": 4}, "--ep 4 must divide --dp 2"),
    ({"dp": 1, "cp": 2, "ep": 4, "model": "mixtral-8x7b"}, "--ep 4 must divide the dp x cp = 2 ranks"),
    ({"dp": 3, "ep": 3, "batch_size": 6}, "--ep 3 must divide the 4 experts"),
    ({"model": "llama3-8b", "dp": 2, "ep": 2}, "--ep 2 splits the experts of a mixture-of-experts model"),
    ({"model": "gpt", "dp": 2, "ep": 2, "kv_heads": None, "experts": None},
     "--ep 2 splits the experts of a mixture-of-experts model"),
    ({"ep": 0}, "--ep must be at least 1, got 0"),
])
def test_bad_expert_parallel_is_refused(changes: dict, expected: str) -> None:
    fields = {**SMALL, "pp": 1, **changes}
    if fields["model"] == "llama3-8b":
        fields["experts"] = None
    with pytest.raises(ConfigError, match=expected):
        RunConfig(**fields).check()


def test_run_refuses_ep_in_one_line(capsys) -> None:
    status = main(["run", "--model", "mixtral-8x7b", "--dp", "2", "--ep", "4", "--experts", "4",
                   "--microbatches", "2"])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert len(err.splitlines()) == 1 and "--ep 4 must divide --dp 2" in err
