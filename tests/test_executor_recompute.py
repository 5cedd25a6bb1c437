"""Activation recompute (``--recompute full|selective``): what is recomputed, counted in
aten ops on one process, and the pipelined numerics against the one-process reference
(which recomputes nothing) on gloo, float64, dp 2 x pp 2, with and without a split
backward."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from executor.config import ConfigError, RunConfig
from executor.launch import launch
from executor.models import build_model
from executor.recompute import apply_recompute
from executor.reference import reference_run
from pipesim.cli import main
from schedules.generators import generate
from tests.test_executor import split_backward

pytestmark = pytest.mark.timeout(240)

ATTENTION = "aten._scaled_dot_product_flash_attention_for_cpu"  # sdpa's CPU kernel, float64 included


class OpCounter(TorchDispatchMode):
    """Counts every aten op run while active, forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def one_step_ops(mode: str) -> tuple[Counter, float, list[torch.Tensor]]:
    """Op counts, loss and gradients of one forward + backward of a 2-block gpt stage."""
    config = RunConfig(pp=1, model="gpt", hidden=8, heads=2, layers=2, seq_len=4, vocab=11, batch_size=2,
                       microbatches=1, dtype="float64")
    model = build_model(config)
    stage = model.build_stage(0, 1)
    apply_recompute(stage, mode)
    inputs, targets = model.make_batch(0, 2)
    with OpCounter() as counter:
        loss = model.loss_sum(stage(inputs), targets)
        loss.backward()
    return counter.counts, loss.item(), [p.grad for p in stage.parameters()]


def test_full_recomputes_each_block_forward_and_selective_only_its_attention() -> None:
    none, loss, grads = one_step_ops("none")
    layers = 2
    # Without recompute: one attention and one gelu per block, 2 + 2 linears per block and
    # the head's (addmm), layer norms: 2 per block and the head's.
    assert (none[ATTENTION], none["aten.gelu"], none["aten.addmm"]) == (layers, layers, 4 * layers + 1)
    full, full_loss, full_grads = one_step_ops("full")
    # Full: each block's forward runs a second time in the backward, the head's does not.
    # The non-reentrant checkpoint stops recomputing once it has every tensor the backward
    # saved: the block's last linear (fc2) saved only its input, so 3 of its 4 linears rerun.
    assert full[ATTENTION] == 2 * layers and full["aten.gelu"] == 2 * layers
    assert full["aten.addmm"] == none["aten.addmm"] + 3 * layers
    assert full["aten.native_layer_norm"] == none["aten.native_layer_norm"] + 2 * layers
    selective, selective_loss, selective_grads = one_step_ops("selective")
    # Selective: the attention core only; every other op's output was kept (the checkpoint's
    # own bookkeeping adds detaches, no computation).
    assert selective[ATTENTION] == 2 * layers
    assert {op: n for op, n in selective.items() if op not in (ATTENTION, "aten.detach")} == \
           {op: n for op, n in none.items() if op not in (ATTENTION, "aten.detach")}
    for other_loss, other_grads in ((full_loss, full_grads), (selective_loss, selective_grads)):
        assert other_loss == loss
        assert all(torch.equal(a, b) for a, b in zip(grads, other_grads, strict=True))


CASES = [("full", ""), ("selective", ""), ("full", "IW"), ("selective", "IW")]
_results: dict[tuple, dict] = {}


def case_config(mode: str, variant: str) -> RunConfig:
    custom = split_backward(generate("1f1b", 2, 2)) if variant == "IW" else None
    return RunConfig(schedule="1f1b", pp=2, dp=2, microbatches=2, model="gpt", hidden=8, heads=2, layers=3,
                     seq_len=4, vocab=11, batch_size=10, steps=2, dtype="float64", optimizer="adamw", lr=0.05,
                     return_grads=True, recompute=mode, custom_schedule=custom)


@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(filter(None, case)))
def test_pipelined_recompute_equals_the_reference_without_it(case: tuple) -> None:
    if not _results:
        _results.update(zip(CASES, launch([case_config(*c) for c in CASES]), strict=True))
    config = case_config(*case)
    result, reference = _results[case], reference_run(config)
    assert result["losses"] == pytest.approx(reference["losses"], abs=1e-10, rel=0)
    for name, grad in reference["grads"].items():
        assert (result["grads"][name] - grad).abs().max().item() < 1e-10, name
    for name, weight in reference["params"].items():
        assert (result["params"][name] - weight).abs().max().item() < 1e-10, name


def test_bad_recompute_is_refused_naming_the_flag(capsys) -> None:
    with pytest.raises(ConfigError, match="--recompute 'some' is not one of: none, selective, full, per-op"):
        RunConfig(recompute="some").check()
    with pytest.raises(SystemExit) as exit_status:
        main(["run", "--pp", "1", "--recompute", "some"])
    assert exit_status.value.code == 2
    assert "--recompute: invalid choice: 'some'" in capsys.readouterr().err


def test_profile_measures_the_stage_with_its_recompute() -> None:
    from executor.profile import profile_rank  # noqa: PLC0415

    def stash(mode: str) -> float:
        config = RunConfig(pp=1, microbatches=1, model="gpt", hidden=16, heads=2, layers=2, seq_len=8, vocab=11,
                           batch_size=2, recompute=mode)
        (measured,) = profile_rank(config, warmup=0, repeats=1)["stages"].values()
        return measured["stash_bytes"]

    # Full recompute keeps each block's input only: far less than every block's activations.
    assert stash("full") < stash("none") / 2
