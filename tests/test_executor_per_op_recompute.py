"""``--recompute per-op`` (torchtitan 0.3's SelectiveAC policy): which matmuls the
backward runs again, counted in aten ops on one process against torchtitan's rule worked
by hand (forward order of each block's matmuls, odd ones kept, even ones recomputed,
the attention kernel kept, the MoE router's gate always recomputed); the pipelined
numerics against the one-process reference (float64, gloo, 1e-10); and the refusal of a
split backward, which torch's selective checkpoint cannot run."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from executor.config import ConfigError, RunConfig
from executor.launch import launch
from executor.models import build_model
from executor.recompute import apply_recompute
from executor.reference import reference_run
from pipesim.model.spec import RECOMPUTE
from schedules.generators import generate
from tests.test_executor import split_backward

pytestmark = pytest.mark.timeout(240)

ATTENTION = "aten._scaled_dot_product_flash_attention_for_cpu"  # sdpa's CPU kernel, float64 included
FORWARD_MATMULS = ("aten.mm", "aten.addmm")


class MatmulsOfWeights(TorchDispatchMode):
    """While active, records the module of every forward matmul (``x @ W^T``: the weight's
    transposed view as the right-hand side) by the weight's storage, and counts every op."""

    def __init__(self, weights: dict[int, str]) -> None:
        super().__init__()
        self.weights, self.matmuls, self.counts = weights, [], Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.counts[name] += 1
        if name in FORWARD_MATMULS:
            right = args[2] if name == "aten.addmm" else args[1]
            if right.dim() == 2 and right.stride(0) == 1 and right.data_ptr() in self.weights:  # W^T, not W
                self.matmuls.append(self.weights[right.data_ptr()])
        return func(*args, **(kwargs or {}))


def one_step(model: str, mode: str, **fields) -> tuple[list[str], Counter, float, list[torch.Tensor]]:
    """The forward matmuls the backward of one 2-block stage runs (module names), its op
    counts over forward and backward, the loss and the gradients."""
    config = RunConfig(pp=1, model=model, hidden=16, heads=2, layers=2, seq_len=4, vocab=11, batch_size=2,
                       microbatches=1, dtype="float64", **fields)
    built = build_model(config)
    stage = built.build_stage(0, 1)
    apply_recompute(stage, mode)
    weights = {p.data_ptr(): name.removesuffix(".weight") for name, p in stage.named_parameters() if p.dim() == 2}
    inputs, targets = built.make_batch(0, 2)
    loss = built.loss_sum(stage(inputs), targets)
    with MatmulsOfWeights(weights) as backward:
        loss.backward()
    return backward.matmuls, backward.counts, loss.item(), [p.grad for p in stage.parameters()]


def blocks(*names: str) -> list[str]:
    return [f"blocks.{block}.{name}" for block in (0, 1) for name in names]


@pytest.mark.parametrize(("model", "fields", "recomputed"), [
    # Llama: wq wk wv wo, then w2(silu(w1 x) * w3 x): w1, w3, w2. Even places: wk, wo, w3.
    ("llama3-8b", {"kv_heads": 1}, blocks("attention.wk", "attention.wo", "feed_forward.w3")),
    # the toy gpt: every linear biased, so an addmm: saved and not counted, as torchtitan
    # counts (mm and linear only) and the simulator prices it: no matmul recomputed
    ("gpt", {}, []),
    # Mixtral, 4 experts: wq wk wv wo (1-4), the router's gate (forced, not counted), then
    # each expert's w1 w3 w2 (5-16): even places e0.w3, e1.w1, e1.w2, e2.w3, e3.w1, e3.w2.
    ("mixtral-8x7b", {"kv_heads": 1, "experts": 4},
     blocks("attention.wk", "attention.wo", "feed_forward.router.gate", "feed_forward.experts.0.w3",
            "feed_forward.experts.1.w1", "feed_forward.experts.1.w2", "feed_forward.experts.2.w3",
            "feed_forward.experts.3.w1", "feed_forward.experts.3.w2")),
])
def test_the_backward_recomputes_every_second_matmul_and_keeps_attention(model, fields, recomputed) -> None:
    none, none_counts, loss, grads = one_step(model, "none", **fields)
    assert none == []  # without recompute the backward runs no forward matmul
    matmuls, counts, per_op_loss, per_op_grads = one_step(model, "per-op", **fields)
    assert sorted(matmuls) == sorted(recomputed)
    assert counts[ATTENTION] == none_counts[ATTENTION] == 0  # the attention kernel's output was kept
    # the element-wise ops are recomputed: one more norm per norm of a block, in each block
    norms = "aten.rsqrt" if model != "gpt" else "aten.native_layer_norm"
    assert counts[norms] == none_counts[norms] + 2 * 2
    assert per_op_loss == loss
    assert all(torch.equal(a, b) for a, b in zip(grads, per_op_grads, strict=True))


CASES = {
    "gpt-dp2-pp2": dict(model="gpt", hidden=8, heads=2, layers=3, seq_len=4, vocab=11, dp=2),
    "llama-interleaved": dict(model="llama3-8b", kv_heads=1, hidden=16, heads=2, layers=4, seq_len=4, vocab=32,
                              schedule="interleaved-1f1b", virtual_stages=2, dp=2),
    "llama-tp2-sp": dict(model="llama3-8b", kv_heads=2, hidden=16, heads=2, layers=2, seq_len=4, vocab=32, tp=2,
                         sequence_parallel=True),
    "mixtral-dp2-ep2": dict(model="mixtral-8x7b", kv_heads=1, experts=4, hidden=16, heads=2, layers=2, seq_len=4,
                            vocab=32, dp=2, ep=2),
}
_results: dict[str, dict] = {}


def case_config(name: str) -> RunConfig:
    base = dict(schedule="1f1b", pp=2, microbatches=2, batch_size=4, steps=2, dtype="float64", optimizer="adamw",
                lr=0.05, return_grads=True, recompute="per-op", backend="gloo")
    return RunConfig(**{**base, **CASES[name]})


@pytest.mark.parametrize("name", CASES)
def test_pipelined_per_op_recompute_equals_the_reference_without_it(name: str) -> None:
    if not _results:
        _results.update(zip(CASES, launch([case_config(case) for case in CASES]), strict=True))
    config = case_config(name)
    result, reference = _results[name], reference_run(config)
    assert result["losses"] == pytest.approx(reference["losses"], abs=1e-10, rel=0)
    for key, grad in reference["grads"].items():
        assert (result["grads"][key] - grad).abs().max().item() < 1e-10, key


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv", "IW"])
def test_a_split_backward_is_refused_with_per_op(schedule: str) -> None:
    custom = split_backward(generate("1f1b", 2, 4)) if schedule == "IW" else None
    config = RunConfig(schedule="1f1b" if custom else schedule, pp=2, microbatches=4,
                       virtual_stages=2 if schedule == "zbv" else 1, model="gpt", layers=4, hidden=8, heads=2,
                       recompute="per-op", custom_schedule=custom)
    with pytest.raises(ConfigError, match=r"^--recompute per-op cannot run a split backward: schedule .* splits B "
                                          r"into I and W, .*\"Trying to backward an extra time\"\); use a schedule "
                                          r"with whole backwards"):
        config.check()
    RunConfig(**{**config.__dict__, "recompute": "selective"}).check()  # Megatron's selective runs it


def plan_row_config(tmp_path, schedule: str, virtual_stages: int = 1):
    """``run --plan FILE --row 1`` of a one-row plan that chose per-op recompute."""
    from pipesim.cli import build_parser  # noqa: PLC0415 - the command line, for its run parser only
    from pipesim.cli.plan_row import config_from_plan_row  # noqa: PLC0415

    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"ranked": [{
        "schedule": schedule, "pp": 2, "tp": 1, "dp": 1, "virtual_stages": virtual_stages, "microbatch_size": 1,
        "microbatches": 4, "recompute": "per-op", "zero": 0, "sequence_parallel": False,
        "layout": f"{schedule} pp2 m4 recompute=per-op", "model": "gpt"}]}))
    return config_from_plan_row(build_parser("run").parse_args(["run", "--plan", str(path), "--row", "1"]))


def test_a_plan_row_with_per_op_runs_it_and_one_with_a_split_backward_is_refused(tmp_path) -> None:
    config, line = plan_row_config(tmp_path, "1f1b")
    assert (config.recompute, config.schedule) == ("per-op", "1f1b") and "kept" in line
    with pytest.raises(ConfigError, match=r"^plan row 1 \(zb-h1 pp2 m4 recompute=per-op\): --recompute per-op "
                                          "cannot run a split backward"):
        plan_row_config(tmp_path, "zb-h1")


def test_the_profiled_stash_counts_what_per_op_keeps() -> None:
    """torch keeps per-op's outputs outside autograd's saved-tensor hooks; the profile's
    stash (and the run's measured activations, by the same collector) counts them. Full
    recompute keeps each block's input and everything outside the blocks; per-op keeps
    that too, plus per token of each block (hand count, Llama: hidden 16, 2 query heads
    of 8, 1 key/value head, MLP 40): wq's output 16, wv's 8, the attention output 16 and
    its log-sum-exp (one per head) 2, w1's output 40, w2's 16."""
    from executor.profile import profile_rank  # noqa: PLC0415

    def stash(mode: str) -> float:
        config = RunConfig(pp=1, microbatches=1, model="llama3-8b", hidden=16, heads=2, kv_heads=1, ffn_hidden=40,
                           layers=2, seq_len=8, vocab=32, batch_size=2, dtype="float64", recompute=mode)
        (measured,) = profile_rank(config, warmup=0, repeats=1)["stages"].values()
        if mode == "per-op":  # never split (refused): the costs file's "not measured apart", I = B, W = 0
            assert measured["I"] == measured["W"] == 0.0 and measured["B"] > 0
        return measured["stash_bytes"]

    blocks, tokens, float64 = 2, 2 * 8, 8
    assert stash("per-op") - stash("full") == blocks * tokens * (16 + 8 + 16 + 2 + 40 + 16) * float64


def test_run_refuses_per_op_with_a_split_backward_in_one_line(capsys) -> None:
    from pipesim.cli import main  # noqa: PLC0415

    assert main(["run", "--schedule", "zbv", "--pp", "2", "--model", "gpt", "--recompute", "per-op"]) == 2
    assert capsys.readouterr().err.strip() == (
        "pipesim run: error: --recompute per-op cannot run a split backward: schedule 'zbv' splits B into I and W, "
        "and torch's selective activation checkpointing lets one backward through each block, and I then W go "
        "through it twice (\"Trying to backward an extra time\"); use a schedule with whole backwards (gpipe, 1f1b, "
        "interleaved-1f1b) or --recompute selective or full")


@pytest.mark.skipif("per-op" not in RECOMPUTE, reason="the simulator's model (run's memory prediction) has no per-op")
def test_run_executes_per_op_beside_the_simulators_prediction(tmp_path) -> None:
    from pipesim.cli import main  # noqa: PLC0415

    runs = {}
    for mode in ("none", "per-op"):
        out = tmp_path / f"{mode}.json"
        assert main(["run", "--schedule", "1f1b", "--pp", "2", "--model", "llama3-8b", "--recompute", mode,
                     "--steps", "1", "--json", str(out), "--quiet"]) == 0
        runs[mode] = json.loads(out.read_text())
    assert runs["per-op"]["losses"] == runs["none"]["losses"]  # the forward computes the same loss
    for kept, whole in zip(runs["per-op"]["memory"], runs["none"]["memory"], strict=True):
        assert 0 < kept["activations_peak"] < whole["activations_peak"] and kept["predicted_activations"] > 0


def test_the_runs_measured_activations_count_what_per_op_keeps() -> None:
    """The rank's memory tracker (``executor.memory``) counts per-op's kept outputs with
    what autograd saves: the same hand count as the profile's stash above."""
    from executor.memory import MemoryTracker  # noqa: PLC0415
    from schedules.action import Action, ActionKind  # noqa: PLC0415

    def activations(mode: str) -> float:
        config = RunConfig(pp=1, microbatches=1, model="llama3-8b", hidden=16, heads=2, kv_heads=1, ffn_hidden=40,
                           layers=2, seq_len=8, vocab=32, batch_size=2, dtype="float64")
        built = build_model(config)
        stage = built.build_stage(0, 1)
        apply_recompute(stage, mode)
        tracker = MemoryTracker(list(stage.parameters()), torch.device("cpu"))
        tracker.start_step()
        forward = Action(0, ActionKind.F, 0)
        tracker.before_action(forward)
        output = stage(built.make_batch(0, 2)[0])
        tracker.after_action(forward)
        assert output.requires_grad
        return tracker.last.activations

    assert activations("per-op") - activations("full") == 2 * 2 * 8 * (16 + 8 + 16 + 2 + 40 + 16) * 8
