"""ZeRO-3 (FSDP2) under the zero-bubble schedules' split backward: I all-gathers each
unit and leaves the gradients alone, W gathers each unit again, runs its local weight
backwards and reduce-scatters what they left (``executor.fsdp.ShardedWeightGrad``).

Float64 AdamW on gloo: the losses, the first step's gradients and the weights after two
steps equal the one-process reference to 1e-10, over a pipeline (zb-h1, zb-h2, and zbv
and dualpipev with two stages a rank; DualPipe's two copies of the model, each model
stage sharded over both copies' holders, with dp, cp, tp with sequence parallelism, ep,
tp and ep together, or none of them at pp 4), beside cp
(the dense shard over dp x cp), ep (each routed expert its own unit over its expert dp
group, whose output W starts from) and tp with sequence parallelism (DTensor parameters
sharded over a 2-D mesh); and the trace shows every W's gathers and reduce-scatters,
counted by hand.
"""

from __future__ import annotations

from collections import Counter

import pytest

from executor.config import RunConfig
from executor.data_parallel import PARAM_GATHER, REDUCE_SCATTER
from executor.reference import reference_run
from tests.launched_cases import LaunchedCases, assert_equals_reference, assert_weights_equal_reference
from tests.test_executor_fsdp_trace import unit_and_action

pytestmark = pytest.mark.timeout(300)

BASE = {"hidden": 16, "heads": 4, "layers": 3, "seq_len": 8, "vocab": 37, "batch_size": 8, "steps": 2,
        "dtype": "float64", "optimizer": "adamw", "lr": 0.02, "return_grads": True, "schedule": "zb-h1",
        "microbatches": 4, "pp": 2, "dp": 2, "zero": 3}
LLAMA = {"model": "llama3-8b", "kv_heads": 2, "cp_comm": "all-gather"}
MIXTRAL = {"model": "mixtral-8x7b", "experts": 4, "cp_comm": "all-gather"}
LAUNCHED = LaunchedCases(BASE, {
    4: {
        "gpt-pp2-dp2-zb-h1": {"model": "gpt"},
        "gpt-pp2-dp2-zb-h2": {"model": "gpt", "schedule": "zb-h2"},
        "gpt-pp2-dp2-zbv": {"model": "gpt", "schedule": "zbv", "virtual_stages": 2, "layers": 4},
        # DualPipeV: a forward and a backward overlapped as one pair, W deferred
        "gpt-pp2-dp2-dualpipev": {"model": "gpt", "schedule": "dualpipev", "virtual_stages": 2, "layers": 4},
        # DualPipe's two copies: each model stage sharded over both copies' holders
        "gpt-pp2-dp2-dualpipe": {"model": "gpt", "schedule": "dualpipe", "virtual_stages": 2, "layers": 4},
        "gpt-pp4-dp1-dualpipe": {"model": "gpt", "schedule": "dualpipe", "virtual_stages": 2, "layers": 8, "pp": 4,
                                 "dp": 1, "microbatches": 8, "batch_size": 16},
        "llama-pp2-dp1-cp2-dualpipe": {**LLAMA, "schedule": "dualpipe", "virtual_stages": 2, "layers": 4, "dp": 1,
                                       "cp": 2},
        # ...with tp: FSDP's copies axis and tp's from one mesh (executor.copies.copies_mesh)
        "llama-pp2-dp1-tp2-sp-dualpipe": {**LLAMA, "schedule": "dualpipe", "virtual_stages": 2, "layers": 4,
                                          "dp": 1, "tp": 2, "sequence_parallel": True},
        # ...with ep: the experts sharded over both copies' expert data-parallel ranks
        "mixtral-pp2-dp2-ep2-dualpipe": {**MIXTRAL, "schedule": "dualpipe", "virtual_stages": 2, "layers": 4,
                                         "ep": 2},
        "llama-pp1-dp2-cp2-zb-h1": {**LLAMA, "pp": 1, "cp": 2, "layers": 2, "microbatches": 2},
        "mixtral-pp1-dp2-ep2-tp2-sp-zb-h1": {**MIXTRAL, "pp": 1, "kv_heads": 2, "ep": 2, "tp": 2,
                                             "sequence_parallel": True, "layers": 2, "microbatches": 2},
    },
    2: {
        "mixtral-pp1-dp2-ep2-zb-h1": {**MIXTRAL, "pp": 1, "ep": 2, "layers": 2, "microbatches": 2},
    },
    8: {
        "mixtral-pp2-dp2-ep2-tp2-sp-dualpipe": {**MIXTRAL, "schedule": "dualpipe", "virtual_stages": 2, "layers": 4,
                                                "kv_heads": 2, "ep": 2, "tp": 2, "sequence_parallel": True},
    },
})


@pytest.mark.parametrize("name", LAUNCHED.cases)
def test_zero3_with_a_split_backward_equals_the_one_process_reference(name: str) -> None:
    result, reference = LAUNCHED.result(name), reference_run(LAUNCHED.config(name))
    assert_equals_reference(result, reference)
    assert_weights_equal_reference(result, reference)  # after both AdamW steps


def test_each_w_gathers_and_reduce_scatters_the_units_it_runs_and_i_reduces_nothing() -> None:
    """zb-h1 on pp 2 x dp 2, 3 blocks over 2 stages (stage 0: the embedding and blocks
    L0, L1; stage 1: block L0 and the final norm and head, its root): every W issues one
    all-gather and one reduce-scatter per unit, the root's included (the embedding, the
    head), on the dp stream (the trace is replica 0's pipeline); no I reduces anything."""
    name = "gpt-pp2-dp2-zb-h1"
    config = LAUNCHED.config(name)
    events = LAUNCHED.result(name)["trace"].events
    fsdp = [e for e in events if e.stream == "dp"]
    gathers = Counter(unit_and_action(e) for e in fsdp if e.kind == PARAM_GATHER)
    reductions = Counter(unit_and_action(e) for e in fsdp if e.kind == REDUCE_SCATTER)
    units = {0: ("L0", "L1", "root"), 1: ("L0", "root")}
    weight_grads = [f"{stage}W{microbatch}" for stage in range(2) for microbatch in range(config.microbatches)]
    for action in weight_grads:
        stage = int(action[0])
        for unit in units[stage]:
            assert gathers[(unit, action)] == 1 and reductions[(unit, action)] == 1, (unit, action)
    assert {action for _, action in reductions} == set(weight_grads)
    inputs = {action for _, action in gathers if "I" in action}
    assert inputs == {f"{stage}I{microbatch}" for stage in range(2) for microbatch in range(config.microbatches)}


def test_a_zero3_plan_row_with_a_split_backward_is_no_longer_refused() -> None:
    config = RunConfig(**{**BASE, "model": "gpt", "schedule": "zbv", "virtual_stages": 2, "layers": 4})
    config.check()  # raised "--zero 3 (FSDP) cannot run a split backward" before
