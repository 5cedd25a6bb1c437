"""What the loss holds for a moment on the last stage beyond what it keeps
(``pipesim.model.loss_traffic.cross_entropy_transient_bytes``, a stage's
``workspace_bytes``, as is a fully recomputed layer's rebuilt activations), torchtitan's
published memory rows
(``benchmarks/torchtitan_memory.py``), and plans and exports for torchtitan priced with
its loss (``--cross-entropy torch``).

Expected bytes are counted by hand from the tensors each implementation holds at once:
Megatron-Core's loss casts inside itself (the BF16 logits beside their FP32 copy), torch's
``F.cross_entropy`` on FP32 logits holds the log-softmax, the gradient of zeros from
``nll_loss``'s backward and the input gradient at once (three FP32 copies, one kept),
Transformer Engine's kernel works in place."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import torchtitan_memory
from pipesim.cli import main
from pipesim.model.costs import load_costs
from pipesim.model.loss_traffic import cross_entropy_transient_bytes
from pipesim.plan.request import PlanRequest, checked

LLAMA3_VOCAB = 128256
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("mode,logit_bytes,expected", [
    ("unfused", 2, 2), ("fused", 2, 2),  # the BF16 logits beside their FP32 copy
    ("unfused", 4, 0), ("fused", 4, 0),  # FP32 logits: .float() returns its input
    ("te", 2, 0), ("te", 4, 0),  # in place
    ("torch", 2, 8), ("torch", 4, 8),  # two FP32 copies beside the kept log-softmax
    ("compiled", 2, 2), ("compiled", 4, 4),  # the gradient beside the kept logits
])
def test_transient_bytes_per_logit(mode, logit_bytes, expected):
    assert cross_entropy_transient_bytes(mode, logit_bytes) == expected


def test_over_vocabulary_shards_torchs_loss_holds_a_third_copy():
    """torch's loss_parallel log-softmax backward: exp(output), its product with the
    gradient's sum and the input gradient beside the gradient and the kept output."""
    assert cross_entropy_transient_bytes("torch", 2, tp=8) == 12
    assert [cross_entropy_transient_bytes(mode, 2, tp=8) for mode in ("unfused", "te", "compiled")] == [2, 0, 2]


def _rank0(tmp_path, *flags):
    out = tmp_path / "step.json"
    assert main(["simulate", "--model", "llama3-8b", "--pp", "1", "-m", "1", "--gpu", "h100", *flags,
                 "--json", str(out)]) == 0
    return json.loads(out.read_text())["ranks"][0]


@pytest.mark.parametrize("tp", [1, 2])
def test_the_last_stage_holds_the_loss_temporaries_beside_everything(tmp_path, tp):
    """Llama 3 8B, one microbatch of 8192 tokens, the logits V / tp a rank: torch's loss holds
    8 bytes a logit more than te's for a moment (the buffers; 12 over vocabulary shards),
    and keeps 4 where te keeps 2 (the stash); the peak grows by both."""
    tp_flags = ["--tp", str(tp), "--topology", "nvlink"] if tp > 1 else []
    torch_rank = _rank0(tmp_path, "--cross-entropy", "torch", *tp_flags)
    te_rank = _rank0(tmp_path, "--cross-entropy", "te", *tp_flags)
    logits = 8192 * LLAMA3_VOCAB / tp
    held = 8 if tp == 1 else 12
    assert torch_rank["memory"]["buffer_bytes"] - te_rank["memory"]["buffer_bytes"] == pytest.approx(held * logits)
    assert (torch_rank["memory"]["workspace_bytes"], te_rank["memory"]["workspace_bytes"]) == \
        pytest.approx((held * logits, 0.0))
    assert torch_rank["memory"]["peak_stash_bytes"] - te_rank["memory"]["peak_stash_bytes"] == \
        pytest.approx(2 * logits)
    assert torch_rank["peak_memory_bytes"] - te_rank["peak_memory_bytes"] == pytest.approx((held + 2) * logits)


def test_megatrons_loss_holds_the_bf16_logits_beside_the_fp32_copy(tmp_path):
    unfused = _rank0(tmp_path)
    te = _rank0(tmp_path, "--cross-entropy", "te")
    assert unfused["memory"]["buffer_bytes"] - te["memory"]["buffer_bytes"] == pytest.approx(2 * 8192 * LLAMA3_VOCAB)


def test_only_the_last_stage_holds_it_and_a_rank_holds_its_largest_once(tmp_path):
    """A costs file's ``workspace_bytes``: rank 0 of a V (dualpipev) holds stages 0 and 3, so
    of their 1 and 3 GB it holds 3 for a moment, one action at a time; rank 1 its
    stages' 2 GB."""
    costs = tmp_path / "costs.json"
    stage = {"fwd": 1e-3, "bwd": 2e-3, "act_bytes": 1e6, "stash_bytes": 1e8, "param_bytes": 1e9}
    costs.write_text(json.dumps({"stages": [{**stage, "workspace_bytes": gb * 1e9} for gb in (1, 2, 0, 3)]}))
    assert load_costs(costs, num_stages=4).stages[3].workspace_bytes == 3e9
    out = tmp_path / "step.json"
    base = ["simulate", "--schedule", "dualpipev", "--pp", "2", "-m", "4", "--json", str(out)]
    assert main([*base, "--costs", str(costs)]) == 0
    with_workspace = json.loads(out.read_text())["ranks"]
    costs.write_text(json.dumps({"stages": [stage] * 4}))
    assert main([*base, "--costs", str(costs)]) == 0
    without = json.loads(out.read_text())["ranks"]
    extra = [a["memory"]["buffer_bytes"] - b["memory"]["buffer_bytes"] for a, b in zip(with_workspace, without,
                                                                                     strict=True)]
    assert extra == pytest.approx([3e9, 2e9])
    assert [rank["memory"]["workspace_bytes"] for rank in with_workspace] == pytest.approx([3e9, 2e9])


def test_each_torchtitan_row_is_its_published_layout():
    """The GPUs of each row are its dp x cp x tp ranks, on hosts of 8; the loss and
    checkpointing are what torchtitan's code at the row's commit runs."""
    for row in torchtitan_memory.ROWS:
        argv = row.argv()
        value = {flag: argv[index + 1] for index, flag in enumerate(argv[:-1]) if flag.startswith("-")}
        pp = int(value["--pp"])
        ranks = int(value["--dp"]) * int(value.get("--cp", 1)) * int(value.get("--tp", 1)) * pp
        assert ranks == row.gpus and int(value["--nodes"]) * 8 == row.gpus, row.label
        # unpipelined FSDP2 shards everything; pipelined, the parameters stay gathered (float8 for 405B) and the
        # gradients unsharded
        assert (value["--zero"], value["--bytes-per-param"]) == (("3", "2,4,12") if pp == 1 else ("1", "1,4,12"))
        assert value["--cross-entropy"] == ("compiled" if row.source == torchtitan_memory.TRAINY else "torch")
        assert value["--recompute"] == ("per-op" if "8B FSDP" in row.label and "CP" not in row.label else "full")
        if pp > 1:  # torchtitan's default microbatch count (the pipeline degree) and generated split
            layers = [int(count) for count in value["--layers-per-stage"].split(",")]
            assert value["-m"] == "8" and sum(layers) == 126 and len(layers) == 8 * int(value.get("-v", 1))
            assert int(value["--microbatch-size"]) * 8 == (32 if "Table 5" in row.source else 8)
    assert [row.measured_gib for row in torchtitan_memory.ROWS] == [82.4, 67.0, 83.9, 84.2, 84.0, 84.5, 71.9, 82.5,
                                                                    72.7, 75.3, 75.9, 77.1, 84.9, 47.96, 46.97]
    # held out: Table 2's rows, which nothing written after their first run moved
    assert [row.label for row in torchtitan_memory.ROWS if not row.in_sample] == [
        "8B FSDP 8 CP 1, 32K", "8B FSDP 4 CP 2, 64K", "8B FSDP 2 CP 4, 128K", "8B FSDP 1 CP 8, 256K"]


def test_the_reserved_prediction_adds_the_fragmentation_share():
    prediction = torchtitan_memory.Reserved(peak=50e9, static=10e9, buffers=10e9, stash=30e9)
    assert prediction.reserved == pytest.approx(51.5e9)
    row = torchtitan_memory.ROWS[0]
    assert torchtitan_memory.error(row, prediction) == pytest.approx(51.5e9 / (82.4 * 2**30) - 1)


def test_the_docs_quote_what_the_script_prints():
    _, errors = torchtitan_memory.table()
    docs = " ".join((ROOT / "docs" / "cluster-model.md").read_text().split())
    for name, values in errors.items():
        line = torchtitan_memory.summary(name, values)
        assert line in docs, line
    numbers = re.findall(r"[+-]\d+\.\d%", "\n".join(torchtitan_memory.table()[0]))
    assert len(numbers) == len(torchtitan_memory.ROWS)


@pytest.mark.parametrize("torchtitan,given,priced", [
    (False, None, None),  # Megatron-Core's default, unfused
    (True, None, "torch"),  # torchtitan's eager loss
    (True, "te", "te"),  # what the user says wins
])
def test_a_plan_for_torchtitan_prices_torchtitans_loss(torchtitan, given, priced):
    base, _ = checked(PlanRequest(model="llama3-8b", gpus=8, global_batch=16, torchtitan=torchtitan,
                                  cross_entropy=given))
    assert base.cross_entropy == priced


def test_export_for_torchtitan_prints_the_loss_it_priced(tmp_path, capsys):
    assert main(["export", "--model", "gpt3-1.3b", "--topology", "nvlink", "--nodes", "1", "--schedule", "1f1b",
                 "--pp", "2", "-m", "4", "--dp", "2", "--fsdp", "--torchtitan", str(tmp_path / "titan")]) == 0
    note = capsys.readouterr().err
    assert "priced so (simulate --zero 1 --bytes-per-param 2,4,12 --no-dp-overlap --cross-entropy torch)" in note


@pytest.mark.parametrize("tp", [1, 2])
def test_a_fully_recomputed_layer_rebuilds_its_activations_in_its_backward(tmp_path, tp):
    """GPT-3 1.3B (s 2048, b 1, h 2048, dropout, flash attention): a layer keeps 34 sbh
    without recompute and its 2 sbh input under full recompute (Korthikanti et al. 2022,
    Table 2), both over t with sequence parallelism, so its backward rebuilds 32 sbh / t
    for a moment; the last stage holds the larger of that and its loss's BF16 logits beside
    their FP32 copy (2 x s x V / t)."""
    out = tmp_path / "step.json"
    tp_flags = ["--tp", str(tp), "--sequence-parallel"] if tp > 1 else []
    assert main(["simulate", "--model", "gpt3-1.3b", "--pp", "2", "-m", "4", "--recompute", "full", *tp_flags,
                 "--json", str(out)]) == 0
    stages = json.loads(out.read_text())["stage_costs"]
    sbh = 2048 * 1 * 2048
    assert stages[0]["workspace_bytes"] == pytest.approx(32 * sbh / tp)
    assert stages[1]["workspace_bytes"] == pytest.approx(max(32 * sbh / tp, 2 * 2048 * 50257 / tp))
    assert main(["simulate", "--model", "gpt3-1.3b", "--pp", "2", "-m", "4", "--recompute", "selective", *tp_flags,
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["stage_costs"][0]["workspace_bytes"] == 0
