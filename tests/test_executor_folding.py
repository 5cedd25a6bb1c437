"""Parallel folding executed (``run --etp 1``, Megatron-Core's
``--expert-tensor-parallel-size 1``): the routed experts whole on every rank, the ep
groups cut from every tp x cp x dp rank of a stage, each tp rank sending the tokens of
its own sequence shard. Float64 on gloo: every step's loss and every gradient of the
first step equal the one-process reference to 1e-10. The groups are the simulator's
expert mesh (``pipesim.cluster.mapping``), and what the executor does not run is refused
in one line."""

from __future__ import annotations

import pytest

from executor.config import ConfigError, RunConfig
from executor.expert_parallel import expert_groups_of
from executor.mesh import MeshPosition
from executor.reference import reference_run
from pipesim.cluster.mapping import RankMapping
from tests.cli_runs import assert_one_line_error
from tests.launched_cases import LaunchedCases, assert_equals_reference

pytestmark = pytest.mark.timeout(300)

SMALL = {"model": "mixtral-8x7b", "hidden": 16, "heads": 4, "kv_heads": 2, "layers": 2, "experts": 4, "seq_len": 8,
         "vocab": 37, "batch_size": 8, "steps": 2, "dtype": "float64", "optimizer": "adamw", "lr": 0.02,
         "return_grads": True, "schedule": "1f1b", "microbatches": 2, "pp": 1, "tp": 2, "sequence_parallel": True,
         "etp": 1}
QWEN_MOE = {"model": "qwen1.5-moe-a2.7b", "ffn_hidden": 16}
CASES_OF_WORLD = {
    # one replica: every expert on both tp ranks, each taking its half of every sequence;
    # the experts' gradients summed over the two (their expert data-parallel group)
    2: {"mixtral-tp2-etp1": {"dp": 1},
        # some copies dropped: the capacity counts whole sequences, as the reference does
        "mixtral-tp2-etp1-capacity": {"dp": 1, "capacity_factor": 0.5},
        # each tp rank routes its own shard: the capacity counts the copies the earlier shard sent
        "mixtral-tp2-etp1-capacity-ep2": {"dp": 1, "ep": 2, "capacity_factor": 0.75},
        # the shared expert under full recompute: its gathered input kept by the checkpoint, not regathered
        "qwen-moe-tp2-etp1-recompute": {**QWEN_MOE, "dp": 1, "recompute": "full"}},
    4: {
        # ep 4 across tp x dp: one expert a rank, tokens of both tp ranks of both replicas traded;
        # clipped by the global norm, each expert's gradient counted once (not once per tp rank)
        "mixtral-dp2-tp2-etp1-ep4-clip": {"dp": 2, "ep": 4, "clip_grad": 1.0},
        # shared experts (split over tp as before) beside folded routed ones, a sigmoid gate on them
        "qwen-moe-dp2-tp2-etp1-ep2": {**QWEN_MOE, "dp": 2, "ep": 2},
        # ZeRO-1 shards the folded experts' state over their expert data-parallel group
        "mixtral-dp2-tp2-etp1-ep2-zero1": {"dp": 2, "ep": 2, "zero": 1},
        # ZeRO-3 (FSDP2): the folded experts sharded over their expert data-parallel group, clipped
        "mixtral-dp2-tp2-etp1-ep2-zero3-clip": {"dp": 2, "ep": 2, "zero": 3, "clip_grad": 1.0},
        # the balance loss's counts summed over cp and tp; a sigmoid router's selection biases moved by
        # loads each rank counted on its own shard; shared experts; latent attention
        "deepseek-v3-tp2-cp2-etp1-ep2": {"model": "deepseek-v3", "kv_heads": None, "ffn_hidden": 32, "dp": 1, "cp": 2,
                                         "ep": 2},
        # the split backward: the router's and the shared gate's weight gradients summed over tp in W
        "qwen-moe-pp2-tp2-etp1-zbv": {**QWEN_MOE, "pp": 2, "dp": 1, "layers": 4, "microbatches": 4,
                                      "schedule": "zbv", "virtual_stages": 2},
        # a pipeline: each stage's ep groups cut from its own tp x dp ranks; combined 1F1B
        "mixtral-pp2-tp2-etp1-ep2-combined": {"pp": 2, "dp": 1, "ep": 2, "layers": 4, "microbatches": 4,
                                              "schedule": "interleaved-1f1b", "virtual_stages": 2,
                                              "ep_overlap": True},
    },
}
LAUNCHED = LaunchedCases(SMALL, CASES_OF_WORLD)


@pytest.mark.parametrize("name", LAUNCHED.cases)
def test_folded_experts_step_equals_one_process_reference(name: str) -> None:
    assert_equals_reference(LAUNCHED.result(name), reference_run(LAUNCHED.config(name)))


def test_folded_routed_experts_run_no_tp_collective() -> None:
    """By hand, one stage of 2 layers at tp 2 with sequence parallelism: each layer's
    attention all-gathers and reduce-scatters in the forward (2) and mirrors them in the
    backward, gathering its input again from the shard it kept (3); the head's gather adds
    1 to the forward, the embedding cut's backward 1 to the backward. Mixtral's routed
    experts, folded, add nothing: 5 and 7 (Megatron-Core's folded layer; a block routing
    the gathered sequence gathers and scatters for its MLP too). Qwen-MoE's shared expert, split
    over tp as a dense MLP, adds the MLP's 2 and 3 a layer: 9 and 13."""
    assert LAUNCHED.tp_collectives_per_action("mixtral-tp2-etp1") == {"0F": {5}, "0B": {7}}
    assert LAUNCHED.tp_collectives_per_action("qwen-moe-dp2-tp2-etp1-ep2") == {"0F": {9}, "0B": {13}}


def test_folded_groups_are_the_simulators_expert_mesh() -> None:
    """Global rank order tp innermost, then dp (the executor's and `--rank-order
    tp-cp-dp-pp`): at etp 1 the ep groups are runs of ep of a stage's ranks in that order,
    its expert data-parallel groups every ep-th, as the simulator's expert mesh has them."""
    position = MeshPosition.of_rank(0, dp=2, pp=2, tp=2)
    ep_groups, expert_dp_groups = expert_groups_of(position, ep=2, folded=True)
    assert ep_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]  # each stage: (dp0 tp0, dp0 tp1), (dp1 tp0, dp1 tp1)
    assert expert_dp_groups == [[0, 2], [1, 3], [4, 6], [5, 7]]
    four, _ = expert_groups_of(position, ep=4, folded=True)
    assert four == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for ep, executor_groups in ((2, ep_groups), (4, four)):
        mapping = RankMapping(dp=2, pp=2, tp=2, order=("tp", "cp", "dp", "pp"),
                              devices=tuple(str(rank) for rank in range(8)), ep=ep, etp=1)
        simulated = [[int(device) for device in group] for stage in range(2) for group in mapping.ep_groups(stage, 0)]
        assert simulated == executor_groups
    assert [int(device) for device in mapping.expert_dp_group(1, 0)] == [4]  # ep 4: each expert once a stage


@pytest.mark.parametrize(("changes", "expected"), [
    ({"etp": 0}, "--etp must be a whole number >= 1, got 0"),
    ({"etp": 4, "tp": 2}, "--etp 4 above --tp 2"),
    ({"etp": 2, "tp": 4, "heads": 4, "kv_heads": 4, "dp": 1},
     "--etp 2: the executor runs the routed experts whole on every rank"),
    ({"sequence_parallel": False}, "--etp 1 with --tp 2 needs --sequence-parallel"),
    ({"model": "llama3-8b", "heads": 4, "kv_heads": 2}, "--etp 1 splits the routed experts of a mixture-of-experts"),
    ({"dp": 1, "ep": 4}, "--ep 4 must divide the tp x cp x dp = 2 ranks of a stage"),
])
def test_what_folding_cannot_run_is_refused(changes: dict, expected: str) -> None:
    fields = {key: value for key, value in SMALL.items() if key != "experts" or "model" not in changes}
    with pytest.raises(ConfigError, match=expected.replace("+", r"\+")):
        RunConfig(**{**fields, "dp": 2, **changes}).check()


def test_run_etp_bad_values_are_one_line_errors(capsys) -> None:
    base = ["run", "--model", "mixtral-8x7b", "--layers", "2", "--hidden", "16", "--heads", "4", "--kv-heads", "2",
            "--experts", "4",
            "--seq-len", "8", "--pp", "1", "--tp", "2", "--sequence-parallel"]
    assert_one_line_error(capsys, base + ["--etp", "3"], "--etp 3 above --tp 2")
    assert_one_line_error(capsys, base + ["--etp", "-1"], "--etp must be a whole number >= 1, got -1")
    assert_one_line_error(capsys, base[:-1] + ["--etp", "1"], "--etp 1 with --tp 2 needs --sequence-parallel")
