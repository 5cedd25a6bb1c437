"""How MFU counts the attention core (--attention-flops): the whole s x s square (PaLM's
formula) or the causal half (Meta's Llama 3 figures), by hand on GPT-3 1.3B."""

from __future__ import annotations

import json

import pytest

from pipesim.cli import main
from pipesim.model.spec import model_spec
from pipesim.model.transformer_costs import attention_flops_counted, training_figures


def test_the_attention_core_counted_whole_and_causal_by_hand():
    # GPT-3 1.3B: 24 layers, h 2048, s 2048, one sequence. QK^T and PV: 2 x 2 s^2 h a layer
    # forward, the whole square; the causal half is 2 s^2 h.
    spec = model_spec("gpt3-1.3b")
    whole = 24 * 4 * 2048**2 * 2048
    assert attention_flops_counted(spec, "whole") == pytest.approx(whole)
    assert attention_flops_counted(spec, "causal") == pytest.approx(whole / 2)
    # MFU: 3 passes of the model's forward, the attention as counted
    forward = spec.forward_flops()
    figures = {convention: training_figures(spec, "none", 1.0, 8, 1, 8, 1e15, convention)
               for convention in ("whole", "causal")}
    assert figures["whole"]["mfu"] == pytest.approx(8 * 3 * forward / 8 / 1e15)
    assert figures["causal"]["mfu"] == pytest.approx(8 * 3 * (forward - whole / 2) / 8 / 1e15)
    # Megatron's TFLOP/s adds the recomputed forward (full: the layers again, the attention as counted)
    full = training_figures(spec, "full", 1.0, 8, 1, 8, 1e15, "causal")
    recomputed = spec.recompute_flops("full") - whole / 2
    assert full["model_tflops_per_gpu"] == pytest.approx(8 * (3 * (forward - whole / 2) + recomputed) / 8 / 1e12)


def test_simulate_reports_mfu_by_the_convention_asked(tmp_path, capsys):
    documents = {}
    for convention in ("causal", "whole"):
        out = tmp_path / f"{convention}.json"
        assert main(["simulate", "--model", "gpt3-1.3b", "--pp", "2", "-m", "4", "--mfu", "0.4",
                     "--attention-flops", convention, "--json", str(out)]) == 0
        assert f"(attention counted {convention})" in capsys.readouterr().out
        documents[convention] = json.loads(out.read_text())
    spec = model_spec("gpt3-1.3b")
    whole = attention_flops_counted(spec, "whole")
    assert documents["causal"]["makespan"] == documents["whole"]["makespan"]  # a count, not a time
    assert documents["causal"]["mfu"] / documents["whole"]["mfu"] == pytest.approx(
        (spec.forward_flops() - whole / 2) / spec.forward_flops())
    with pytest.raises(SystemExit) as refused:
        main(["simulate", "--model", "gpt3-1.3b", "--attention-flops", "half"])
    assert refused.value.code == 2
    assert "--attention-flops" in capsys.readouterr().err
    with pytest.raises(ValueError, match="^--attention-flops 'half': use causal .* or whole"):
        training_figures(spec, "none", 1.0, 1, 1, 1, 1e15, "half")
