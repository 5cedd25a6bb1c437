"""Sequence parallelism keeps the sequence shard, not the gathered copy, between the
forward and the backward (``executor.rebuilt_activations.read_gathered_shard``), as
Megatron-Core's column-parallel linears do (Korthikanti et al. 2022, section 4.2.2), and
the simulator charges and counts what that costs: one more all-gather a sublayer in each
backward, the two gathered copies held from a split backward's ``I`` until its ``W``;
and Megatron's own regather, beside the input-gradient product, in ``simulate``.

Expected values by hand: a toy GPT block (hidden 16, float64) on 2 tp ranks, a
microbatch of 2 sequences of 8 tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from executor.reference import reference_run
from executor.spawn import launch_ranks
from pipesim.cluster.files import topology_from_dict
from pipesim.cluster.mapping import map_ranks
from pipesim.model.activations import (
    layer_stash_bytes,
    rebuilt_until_weight_grad_bytes,
    regathered_until_weight_grad_bytes,
)
from pipesim.model.costs import Costs, CostsError, StageCost, costs_from_dict
from pipesim.model.saved_tensors import (
    AUTOCAST_TORCH,
    EAGER_TORCH,
    KERNELS,
    async_regathered_inputs,
    regathered_inputs,
)
from pipesim.model.spec import ModelSpec
from pipesim.sim.parallel import tp_collective_seconds
from schedules import generate
from schedules.action import ActionKind
from tests.launched_cases import LaunchedCases, assert_equals_reference

HIDDEN, HEADS, BATCH, SEQ, F64 = 16, 4, 2, 8, 8


def forward_and_backward(block: torch.nn.Module, x: torch.Tensor, autocast: bool = False) -> dict:
    """Run ``block`` (split over this rank's tp group) on ``x``, this rank's sequence
    shard: the bytes its forward saved (parameters aside, each storage once, at its size
    after the forward), the all-gathers its backward ran, its output and gradients; under
    ``autocast`` in bf16."""
    import torch.distributed._functional_collectives as funcol  # noqa: PLC0415

    from executor.data_parallel import local_storage, local_tensor  # noqa: PLC0415
    from executor.shard_routing import TIMED_COLLECTIVES  # noqa: PLC0415

    params = {local_storage(p).data_ptr() for p in block.parameters()}
    saved: dict[int, torch.UntypedStorage] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = local_storage(tensor)
        if storage.data_ptr() not in params:
            # keyed by the storage itself (kept alive here), not its address: a gathered copy the
            # executor drops (resized to nothing) frees its memory, which a later shard may reuse
            saved.setdefault(storage._cdata, storage)
        return tensor

    with (torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
          torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)):
        out = block(x)
    kept = sum(storage.nbytes() for storage in saved.values())
    gathers = []
    name = TIMED_COLLECTIVES[1]
    original = getattr(funcol, name)
    setattr(funcol, name, lambda *args, **kwargs: gathers.append(1) or original(*args, **kwargs))
    try:
        local_tensor(out).pow(2).sum().backward()
    finally:
        setattr(funcol, name, original)
    grads = {key: local_tensor(p.grad).clone() for key, p in block.named_parameters() if p.grad is not None}
    return {"kept": kept, "gathers": len(gathers), "grads": grads, "x_grad": x.grad.clone(),
            "out": local_tensor(out).detach().clone(), "dtype": local_tensor(out).dtype}


def sequence_shard(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's half of a fixed ``BATCH x SEQ x HIDDEN`` input, a leaf."""
    whole = torch.randn(BATCH, SEQ, HIDDEN, dtype=dtype, generator=torch.Generator().manual_seed(1))
    return whole[:, rank * SEQ // 2:(rank + 1) * SEQ // 2].clone().requires_grad_()


def block_on_two_ranks(regather: bool, recompute: bool, autocast: bool = False) -> dict:
    """One toy GPT block split over a 2-rank tp group with sequence parallelism
    (``forward_and_backward``); float64, or with ``autocast`` float32 under bf16 autocast."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.tensor.parallel import parallelize_module  # noqa: PLC0415

    from executor.models import Block  # noqa: PLC0415
    from executor.tensor_parallel import block_plan  # noqa: PLC0415

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        dtype = torch.float32 if autocast else torch.float64
        block = Block(HIDDEN, HEADS).to(dtype)
        block.regather_shards, block.recompute_norms = regather, recompute
        parallelize_module(block, init_device_mesh("cpu", (2,)), block_plan(sequence_parallel=True))
        return forward_and_backward(block, sequence_shard(dist.get_rank(), dtype), autocast)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs() -> dict[tuple[bool, bool], dict]:
    return {(regather, recompute): launch_ranks(block_on_two_ranks, (regather, recompute), 2)[0]
            for regather, recompute in ((False, False), (True, False), (True, True))}


@pytest.mark.timeout(300)
def test_under_autocast_the_shard_is_cast_before_the_gather() -> None:
    """qkv's and fc1's bf16 casts of the gathered input (autocast's, whole) give way to
    the bf16 shards gathered: one cast a sublayer, kept as a shard; the forward's values
    do not change (casting then gathering moves the same bits)."""
    plain, regathered = (launch_ranks(block_on_two_ranks, (regather, False, True), 2)[0]
                         for regather in (False, True))
    whole_cast, shard_cast = BATCH * SEQ * HIDDEN * 2, BATCH * SEQ // 2 * HIDDEN * 2
    assert plain["kept"] - regathered["kept"] == 2 * (whole_cast - shard_cast)
    assert regathered["gathers"] - plain["gathers"] == 2
    assert torch.equal(regathered["out"], plain["out"])
    # the input gradients are summed in bf16 before their reduce-scatter, as Megatron sums them
    assert torch.allclose(regathered["x_grad"], plain["x_grad"], rtol=2e-2, atol=1e-2)


def mixture_block_on_two_ranks(regather: bool) -> dict:
    """One Mixtral block (4 experts, top 2, dropless; separate Q, K and V projections)
    split over a 2-rank tp group with sequence parallelism, float32 under bf16 autocast
    (``forward_and_backward``)."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    from executor.architectures.build import shrunk_spec  # noqa: PLC0415
    from executor.architectures.transformer import TransformerBlock  # noqa: PLC0415
    from executor.config import RunConfig  # noqa: PLC0415
    from executor.tensor_parallel import parallelize_stage  # noqa: PLC0415

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        spec = shrunk_spec(RunConfig(model="mixtral-8x7b", layers=1, hidden=HIDDEN, heads=HEADS, kv_heads=2,
                                     seq_len=SEQ, experts=4, ffn_hidden=32))
        block = TransformerBlock(spec, 0)
        block.regather_shards = regather
        parallelize_stage(torch.nn.ModuleList([block]), init_device_mesh("cpu", (2,)), sequence_parallel=True)
        return forward_and_backward(block, sequence_shard(dist.get_rank(), torch.float32), autocast=True)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_under_autocast_a_mixture_of_experts_keeps_its_shard_too() -> None:
    """Cast after the gather, Q, K and V each keep a whole bf16 cast of the attention's
    input, the router one of the MoE's, and each expert's gate and up projections their
    own cast of its tokens (top 2: two slices of 2 rows a token); cast before, a bf16
    shard a sublayer is kept and the gate and up projections share one slice. The output
    is the same bits, in float32 (the combine's type either way)."""
    plain, regathered = (launch_ranks(mixture_block_on_two_ranks, (regather,), 2)[0] for regather in (False, True))
    tokens, shard, row, top_k = BATCH * SEQ, BATCH * SEQ // 2, HIDDEN * 2, 2
    attention = 3 * tokens * row - shard * row
    experts = tokens * row + 2 * top_k * tokens * row - (shard * row + top_k * tokens * row)
    assert plain["kept"] - regathered["kept"] == attention + experts
    assert regathered["gathers"] - plain["gathers"] == 2
    assert regathered["dtype"] == plain["dtype"] == torch.float32
    assert torch.equal(regathered["out"], plain["out"])
    assert torch.allclose(regathered["x_grad"], plain["x_grad"], rtol=2e-2, atol=1e-2)
    assert regathered["grads"].keys() == plain["grads"].keys()
    for key, grad in plain["grads"].items():
        assert torch.allclose(regathered["grads"][key], grad, rtol=2e-2, atol=1e-2), key


@pytest.mark.timeout(300)
def test_the_gathered_copies_are_dropped_and_the_shards_kept(runs) -> None:
    whole_copy, shard = BATCH * SEQ * HIDDEN * F64, BATCH * SEQ // 2 * HIDDEN * F64
    # qkv's and fc1's gathered inputs (whole) give way to the two shards they were gathered from
    assert runs[False, False]["kept"] - runs[True, False]["kept"] == 2 * (whole_copy - shard)
    # recomputing the norms keeps not even the shard: the norm's input, kept anyway, rebuilds it
    assert runs[True, False]["kept"] - runs[True, True]["kept"] == 2 * shard


@pytest.mark.timeout(300)
def test_each_sublayer_gathers_its_input_again_in_the_backward(runs) -> None:
    assert runs[True, False]["gathers"] - runs[False, False]["gathers"] == 2
    assert runs[True, True]["gathers"] == runs[True, False]["gathers"]


@pytest.mark.timeout(300)
def test_the_results_do_not_change(runs) -> None:
    reference = runs[False, False]
    for run in (runs[True, False], runs[True, True]):
        assert torch.equal(run["out"], reference["out"])
        assert torch.equal(run["x_grad"], reference["x_grad"])
        for name, grad in reference["grads"].items():
            assert torch.equal(run["grads"][name], grad), name


def test_the_executor_regathers_two_inputs_a_layer_where_it_can() -> None:
    assert regathered_inputs(EAGER_TORCH, 2, True, "none") == 2
    assert regathered_inputs(AUTOCAST_TORCH, 2, True, "none") == 2
    assert regathered_inputs(EAGER_TORCH, 2, True, "selective") == 2
    assert regathered_inputs(EAGER_TORCH, 2, True, "norm-mla-up") == 2
    # a checkpoint re-runs the forward in the backward
    assert regathered_inputs(EAGER_TORCH, 2, True, "full") == 0
    assert regathered_inputs(EAGER_TORCH, 2, True, "per-op") == 0
    assert regathered_inputs(EAGER_TORCH, 2, False, "none") == 0
    assert regathered_inputs(EAGER_TORCH, 1, True, "none") == 0
    assert regathered_inputs(KERNELS, 2, True, "none") == 0  # Megatron's runs beside its dgrad GEMM


def test_a_split_backward_holds_the_two_whole_copies_until_w() -> None:
    spec = ModelSpec("small-llama", layers=2, hidden=64, heads=8, seq_len=32, vocab=100, kv_heads=2,
                     ffn_hidden=128, gated_mlp=True, tied_embeddings=False, learned_positions=False, bias=False,
                     rms_norm=True, dropout=False, microbatch_size=2, dtype_bytes=4)
    tokens, h, d = 2 * 32, 64, 4
    assert regathered_until_weight_grad_bytes(spec, 2, True, "none", EAGER_TORCH) == 2 * tokens * h * d
    assert regathered_until_weight_grad_bytes(spec, 2, True, "full", EAGER_TORCH) == 0.0
    # norm-mla-up: the rebuild makes the copies, not the norms' shards the recompute counts as rebuilt
    rebuilt = rebuilt_until_weight_grad_bytes(spec, 2, True, "norm-mla-up", saved=EAGER_TORCH)
    regathered = regathered_until_weight_grad_bytes(spec, 2, True, "norm-mla-up", EAGER_TORCH)
    assert regathered == 2 * tokens * h * d - 2 * tokens * h / 2 * d
    assert rebuilt >= 2 * tokens * h / 2 * d
    # between F and B the executor now keeps the inventory's shard: sequence parallelism saves
    # the same share of the gathered inputs as of the paper's count
    with_sp = layer_stash_bytes(spec, 2, True, saved=EAGER_TORCH)
    without = layer_stash_bytes(spec, 2, True, saved=replace(EAGER_TORCH, regathered_gemm_inputs=False,
                                                             gathered_gemm_inputs=True))
    assert without - with_sp == 2 * tokens * h * d * (1 - 1 / 2)


def test_the_regathers_are_charged_to_each_backward_not_the_forward() -> None:
    # two GPUs, 10 GB/s, no latency: an all-gather of S bytes over 2 ranks takes S / 2 / 10 GB/s
    topology = topology_from_dict({"devices": [{"name": "g0"}, {"name": "g1"}],
                                   "links": [{"src": "g0", "dst": "g1", "bandwidth": 10e9, "latency": 0.0}]})
    message = 10e6
    one = message / 2 / 10e9
    base = StageCost(fwd=1e-3, bwd=2e-3, wgrad=1e-3, layers=3, tp_message_bytes=message)
    for overlap in (False, True):  # held whole either way: the backward waits for each before reading it
        before, after = (tp_collective_seconds(generate("1f1b", 1, 1), Costs(stages=(stage,), sequence_parallel=True),
                                               topology, map_ranks(topology, tp=2), overlap=overlap)
                         for stage in (base, replace(base, tp_regathers=2)))
        assert after[0, ActionKind.F] == before[0, ActionKind.F]
        for kind in (ActionKind.B, ActionKind.I):
            assert after[0, kind] - before[0, kind] == pytest.approx(3 * 2 * one, rel=1e-12)


def test_under_autocast_a_dense_layer_keeps_its_shards_not_its_projections_casts() -> None:
    spec = ModelSpec("small-llama", layers=2, hidden=64, heads=8, seq_len=32, vocab=100, kv_heads=2,
                     ffn_hidden=128, gated_mlp=True, tied_embeddings=False, learned_positions=False, bias=False,
                     rms_norm=True, dropout=False, microbatch_size=2, dtype_bytes=2)
    tokens, h, d = 2 * 32, 64, 2
    cast_after = replace(AUTOCAST_TORCH, regathered_gemm_inputs=False)
    # cast after the gather: K's, V's and the up projection's own casts, whole (3h), and the first
    # projection's of each sublayer whole beyond the shard the inventory counts (2 x h/2)
    saved = layer_stash_bytes(spec, 2, True, saved=cast_after) - layer_stash_bytes(spec, 2, True,
                                                                                   saved=AUTOCAST_TORCH)
    assert saved == tokens * (3 * h + 2 * h / 2) * d
    # without sequence parallelism nothing is gathered and nothing changes
    assert layer_stash_bytes(spec, 2, False, saved=cast_after) == layer_stash_bytes(spec, 2, False,
                                                                                    saved=AUTOCAST_TORCH)


def test_megatrons_kernels_regather_beside_the_input_gradient_product() -> None:
    assert async_regathered_inputs(KERNELS, 2, True, "none") == 2
    assert async_regathered_inputs(KERNELS, 2, True, "full") == 2  # the re-run forward keeps the shard again
    assert async_regathered_inputs(KERNELS, 2, True, "none", moe_layer=True) == 1  # grouped GEMMs keep their tokens
    assert async_regathered_inputs(KERNELS, 2, True, "per-op") == 0  # torchtitan's: the gathered input kept
    assert async_regathered_inputs(KERNELS, 2, False, "none") == 0
    assert async_regathered_inputs(EAGER_TORCH, 2, True, "none") == 0  # the executor's are tp_regathers
    assert async_regathered_inputs(AUTOCAST_TORCH, 2, True, "none") == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_the_async_regathers_by_hand(overlap: bool) -> None:
    """Two GPUs at 10 GB/s: each all-gather and reduce-scatter of 10 MB takes 0.5 ms. Per
    layer the attention's input projections take 1 ms (a backward's input- and
    weight-gradient products 1 ms each), the MLP's 0.2 ms; no slowdown, so a collective
    costs what its window does not hide."""
    topology = topology_from_dict({"devices": [{"name": "g0"}, {"name": "g1"}],
                                   "links": [{"src": "g0", "dst": "g1", "bandwidth": 10e9, "latency": 0.0}]})
    base = StageCost(fwd=10e-3, bwd=20e-3, wgrad=8e-3, layers=3, tp_message_bytes=10e6,
                     tp_window_attention_in=1e-3, tp_window_attention_out=1e-3, tp_window_mlp_in=0.2e-3,
                     tp_window_mlp_out=1e-3)
    before, after = (tp_collective_seconds(generate("1f1b", 1, 1), Costs(stages=(stage,), sequence_parallel=True),
                                           topology, map_ranks(topology, tp=2), overlap=overlap, slowdown=0.0)
                     for stage in (base, replace(base, tp_async_regathers=2)))
    assert after[0, ActionKind.F] == before[0, ActionKind.F]
    ms = 1e-3
    if not overlap:  # each beside its input-gradient product: the attention's hides, the MLP's 0.3 ms shows
        added = {ActionKind.B: 0.3 * ms, ActionKind.I: 0.3 * ms}
    else:  # B: the MLP's reduce-scatter had 0.4 ms (0.1 shown), now 0.2 beside the wgrad (0.3) and the
        # all-gather 0.2 beside the dgrad (0.3); I: both beside the dgrad, 1 ms in 0.2 (0.8) against 0.3
        added = {ActionKind.B: 0.5 * ms, ActionKind.I: 0.5 * ms}
    for kind, seconds in added.items():
        assert after[0, kind] - before[0, kind] == pytest.approx(3 * seconds, rel=1e-9), kind


@pytest.mark.parametrize("key", ["tp_regathers", "tp_async_regathers"])
@pytest.mark.parametrize("value", [-1, 3, float("nan"), "two"])
def test_a_costs_file_gives_at_most_two_regathers_a_layer(key: str, value) -> None:
    with pytest.raises(CostsError, match=rf"costs: stages\[0\]\.{key} "):
        costs_from_dict({"stages": [{"fwd": 1.0, "bwd": 2.0, "layers": 2, key: value}]}, 1, name="costs")


# The regather beside what else touches a layer's saved tensors: a split backward (zbv's I then W)
# with selective recompute, DeepSeek-V3's norm-mla-up with latent attention and experts, DualPipeV's
# pairs with experts, interleaving under full recompute (which turns the regather off); float64,
# pp 2 x tp 2 with sequence parallelism, against the one-process reference.
EQUAL = LaunchedCases({"layers": 4, "hidden": 32, "heads": 8, "seq_len": 16, "vocab": 37, "batch_size": 4,
                       "microbatches": 2, "steps": 2, "dtype": "float64", "optimizer": "adamw", "lr": 0.02,
                       "return_grads": True, "pp": 2, "tp": 2, "sequence_parallel": True}, {4: {
    "llama-zbv-selective": {"model": "llama3-8b", "schedule": "zbv", "virtual_stages": 2, "recompute": "selective"},
    "deepseek-zbv-norm-mla-up": {"model": "deepseek-v3", "schedule": "zbv", "virtual_stages": 2,
                                 "recompute": "norm-mla-up", "experts": 4, "ffn_hidden": 32},
    "mixtral-dualpipev": {"model": "mixtral-8x7b", "schedule": "dualpipev", "virtual_stages": 2, "experts": 4,
                          "ffn_hidden": 32, "microbatches": 4},
    "gpt-interleaved-full": {"model": "gpt", "schedule": "interleaved-1f1b", "virtual_stages": 2,
                             "recompute": "full"},
}})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(EQUAL.cases))
def test_regathering_runs_equal_the_one_process_reference(name: str) -> None:
    assert_equals_reference(EQUAL.result(name), reference_run(EQUAL.config(name)))
