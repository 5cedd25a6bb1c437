"""The loss's cross entropy over the vocabulary: its bytes, its time and what it keeps
(``pipesim.model.loss_traffic``, ``--cross-entropy``).

Expected bytes are counted by hand from the kernels each implementation runs (see the
module): Megatron-Core's unfused ``VocabParallelCrossEntropy`` (cast, max, subtraction,
exp, sum, division; backward product and cast), its native fusion, Transformer
Engine's online-softmax Triton kernels, and PyTorch's ``F.cross_entropy`` on FP32 logits
(torchtitan's eager loss: cast, ``log_softmax``, ``nll_loss``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipesim.cli import main
from pipesim.model.activations import last_stage_extra_bytes
from pipesim.model.compute_model import gpu_compute_model
from pipesim.model.errors import ModelSpecError
from pipesim.model.loss_traffic import cross_entropy_bytes
from pipesim.model.memory_traffic import HBM_EFFICIENCY
from pipesim.model.operations import MemoryBound, head_operations
from pipesim.model.spec import model_spec
from pipesim.model.transformer_costs import head_time

H100_BANDWIDTH = 3.35e12


def _with(spec, mode):
    return replace(spec, cross_entropy=mode)


@pytest.mark.parametrize("mode,logit_bytes,expected", [
    # unfused: .float() 2 + 4, max 4, subtract 4 + 4, exp 4 + 4, sum 4, divide 4 + 4; backward multiply 4 + 4,
    # cast back 4 + 2; keeps the fp32 softmax
    ("unfused", 2, (38, 14, 4)),
    # fused: cast with max 2 + 4, subtract-exp 4 + 4, sum 4, divide 4 + 4; the same backward and softmax
    ("fused", 2, (26, 14, 4)),
    # te: the online softmax reads the bf16 logits; the backward reads them and writes the gradient in place
    ("te", 2, (2, 4, 2)),
    # fp32 logits: .float() and the cast back are no-ops, the max reads 4 bytes alone
    ("unfused", 4, (32, 8, 4)),
    ("fused", 4, (24, 8, 4)),
    ("te", 4, (4, 8, 4)),
    # torch (F.cross_entropy on .float() logits): the cast 2 + 4, log_softmax reads the row three times and writes
    # it, 12 + 4; backward zeros 4, log_softmax's backward 4 + 4 + 4 + 4, the cast back 4 + 2; keeps the log-softmax
    ("torch", 2, (22, 26, 4)),
    ("torch", 4, (16, 20, 4)),
    # compiled: one online pass reads the logits; the backward reads them and writes the gradient
    ("compiled", 2, (2, 4, 2)),
    ("compiled", 4, (4, 8, 4)),
])
def test_bytes_per_logit_counted_from_each_implementation(mode, logit_bytes, expected):
    assert cross_entropy_bytes(mode, logit_bytes) == expected


def test_the_head_runs_the_loss_after_its_logits():
    spec = model_spec("llama3-8b")  # 8192 tokens, vocab 128256, bf16
    logits, loss = head_operations(spec, tp=2)
    assert logits.name == "logits" and isinstance(loss, MemoryBound)
    elements = 8192 * 128256 / 2
    assert loss.bytes == pytest.approx(38 * elements)
    assert loss.backward_bytes == pytest.approx(14 * elements)


def test_the_loss_is_priced_at_the_hbm_rate():
    """Unfused against Transformer Engine's on an H100, Llama 3 8B (8192 tokens, tp 1): the
    head's forward differs by 36 bytes a logit and its backward by 10, at 3.35 TB/s x 0.85."""
    compute = gpu_compute_model("h100")
    unfused = head_time(model_spec("llama3-8b"), 1, compute)
    te = head_time(_with(model_spec("llama3-8b"), "te"), 1, compute)
    elements = 8192 * 128256
    rate = H100_BANDWIDTH * HBM_EFFICIENCY
    assert unfused.forward - te.forward == pytest.approx(36 * elements / rate, rel=1e-9)
    assert unfused.input_grad - te.input_grad == pytest.approx(10 * elements / rate, rel=1e-9)
    assert 36 * elements / rate == pytest.approx(0.0133, abs=5e-5)  # 13.3 ms a microbatch


def test_te_keeps_the_logits_in_their_own_type():
    """The last stage's stash: the FP32 softmax (4 bytes a logit) unless TE's kernel keeps the
    BF16 logits (2): 2 x 8192 x 128256 / 4 bytes less at tp 4."""
    spec = model_spec("llama3-8b")
    saved = last_stage_extra_bytes(spec, 4) - last_stage_extra_bytes(_with(spec, "te"), 4)
    assert saved == pytest.approx(2 * 8192 * 128256 / 4)
    assert last_stage_extra_bytes(_with(spec, "fused"), 4) == last_stage_extra_bytes(spec, 4)


def test_an_unknown_mode_is_refused_by_the_spec():
    with pytest.raises(ModelSpecError, match="cross entropy 'chunked' is not one of unfused, fused, te"):
        _with(model_spec("llama3-8b"), "chunked")


def test_simulate_takes_the_flag_and_the_unfused_loss_is_slower(tmp_path):
    steps = {}
    for mode in ("unfused", "fused", "te"):
        out = tmp_path / f"{mode}.json"
        assert main(["simulate", "--model", "llama3-8b", "--schedule", "1f1b", "--pp", "2", "-m", "4",
                     "--gpu", "h100", "--cross-entropy", mode, "--json", str(out)]) == 0
        steps[mode] = json.loads(out.read_text())["makespan"]
    assert steps["unfused"] > steps["fused"] > steps["te"]


@pytest.mark.parametrize("argv,message", [
    (["--model", "llama3-8b", "--cross-entropy", "bogus"], "--cross-entropy 'bogus': use one of unfused, fused, te"),
    (["--cross-entropy", "te"], "--cross-entropy te needs --model"),
])
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    assert main(["simulate", "--schedule", "1f1b", "--pp", "2", "-m", "4", *argv]) != 0
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_plan_takes_the_flag(capsys):
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "16", "--topology", "ib",
                 "--gpu", "h100", "--schedules", "1f1b", "--top", "1", "--cross-entropy", "te"]) == 0
    assert "1f1b" in capsys.readouterr().out
