"""DeepSeek-V3's multi-token prediction trained by the executor: each module's hidden
states, logits and loss by hand, its embedding a copy of the model's table whose
gradient is the sum of the table's uses (against one process with a truly shared
table), and pipelined float64 runs (dp, ep, tp with and without sequence parallelism, a
split backward, DualPipe, full recompute, ZeRO-1 and 3) equal to the one-process
reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch spelling

from executor.architectures.build import shrink_note, shrunk_spec
from executor.architectures.mtp import MTP_LOSS_WEIGHT, HeadWithPrediction, give_targets
from executor.config import RunConfig
from executor.models import build_model
from executor.tied_embeddings import TiedEmbeddings
from tests.launched_cases import LaunchedCases, assert_run_and_weights_equal_reference, last_stage

pytestmark = pytest.mark.timeout(300)
V3 = str(Path(__file__).parent / "data" / "hf_configs" / "deepseek-v3.json")
SMALL = {"model": V3, "layers": 4, "hidden": 32, "heads": 4, "seq_len": 8, "vocab": 37, "experts": 8}


def test_built_on_one_cp_rank_and_named_elsewhere(tmp_path: Path) -> None:
    for flags in ({}, {"tp": 2}, {"tp": 2, "sequence_parallel": True}):
        config = RunConfig(**SMALL, **flags)
        assert shrunk_spec(config).mtp_depth == 1
        assert "multi-token" not in shrink_note(config)
    config = RunConfig(**SMALL, cp=2)
    assert shrunk_spec(config).mtp_depth == 0
    assert "no multi-token prediction (the config's 1 module(s) not built under --cp above 1)" in shrink_note(config)
    # two modules: the second's sequence, one token shorter, does not split over tp's sequence shards
    deeper = tmp_path / "deepseek-v3-mtp2.json"
    deeper.write_text(json.dumps({**json.loads(Path(V3).read_text()), "num_nextn_predict_layers": 2}))
    config = RunConfig(**{**SMALL, "model": str(deeper)}, tp=2, sequence_parallel=True)
    assert shrunk_spec(config).mtp_depth == 0
    assert ("no multi-token prediction (the config's 2 module(s) not built under --tp with --sequence-parallel, "
            "beyond one module)") in shrink_note(config)
    assert shrunk_spec(RunConfig(**{**SMALL, "model": str(deeper)}, tp=2)).mtp_depth == 2


def test_the_module_and_its_loss_by_hand() -> None:
    config = RunConfig(**SMALL, pp=1, dtype="float64")
    model = build_model(config)
    stage = model.build_stage(0, 1).double()
    head = stage.head
    assert isinstance(head, HeadWithPrediction)
    (module,) = head.predictions
    # the module's block is the layer after the model's last (a mixture-of-experts layer here)
    assert module.block.feed_forward.router.layer == 4
    # its embedding starts as the model's table
    assert torch.equal(module.embed.tokens.weight, stage.embed.tokens.weight)
    tokens, targets = model.make_batch(0, 2)
    hidden = tokens
    hidden = stage.embed(hidden)
    for block in stage.blocks:
        hidden = block(hidden)
    main = head.output(head.norm(hidden))
    # position i: [norm(h_i); norm(Emb(t_{i+1}))], projected, through the block: predicts t_{i+2}
    joined = torch.cat((module.hidden_norm(hidden), module.embedding_norm(module.embed(targets))), dim=-1)
    ahead = head.output(module.norm(module.block(joined @ module.projection.weight.T)))[:, :-1]
    give_targets(stage, targets)
    output = stage(tokens)
    torch.testing.assert_close(output, torch.cat((main, ahead), dim=1), rtol=1e-12, atol=1e-12)
    s = config.seq_len
    expected = (F.cross_entropy(main.flatten(0, 1), targets.flatten(), reduction="sum")
                + MTP_LOSS_WEIGHT * F.cross_entropy(ahead.flatten(0, 1), targets[:, 1:].flatten(), reduction="sum")) / s
    torch.testing.assert_close(model.loss_sum(output, targets), expected, rtol=1e-12, atol=0)
    with pytest.raises(RuntimeError, match="needs the microbatch's targets"):
        stage(tokens)  # the targets are taken by one forward


def test_the_tables_gradient_is_the_sum_of_its_uses() -> None:
    """Copies summed after the backward give the gradient of one shared table."""
    config = RunConfig(**SMALL, pp=1, dtype="float64")
    model = build_model(config)
    tokens, targets = model.make_batch(0, 2)
    copied, shared = model.build_stage(0, 1).double(), model.build_stage(0, 1).double()
    shared.head.predictions[0].embed.tokens.weight = shared.embed.tokens.weight  # one parameter, two uses
    for stage in (copied, shared):
        give_targets(stage, targets)
        model.loss_sum(stage(tokens), targets).backward()
    TiedEmbeddings({0: copied}, None, model.spec).sum_gradients(None)
    torch.testing.assert_close(copied.embed.tokens.weight.grad, shared.embed.tokens.weight.grad, rtol=1e-12,
                               atol=1e-14)
    torch.testing.assert_close(copied.head.predictions[0].embed.tokens.weight.grad, shared.embed.tokens.weight.grad,
                               rtol=1e-12, atol=1e-14)


BASE = {**SMALL, "batch_size": 8, "microbatches": 2, "steps": 2, "dtype": "float64", "optimizer": "adamw",
        "lr": 0.02, "return_grads": True, "schedule": "1f1b", "pp": 2, "expert_bias_rate": 0.05}
CASES = LaunchedCases(BASE, {
    2: {"pp2": {}, "zbv-pp2": {"schedule": "zbv", "virtual_stages": 2}},
    4: {"pp2-dp2": {"dp": 2},
        "pp2-dp2-ep2": {"dp": 2, "ep": 2},
        "pp2-dp2-zero1-recompute": {"dp": 2, "zero": 1, "recompute": "full"},
        "pp2-dp2-zero3": {"dp": 2, "zero": 3},
        "dualpipe-pp2-dp2": {"schedule": "dualpipe", "virtual_stages": 2, "dp": 2, "microbatches": 4},
        # experts 16 columns wide (ffn 144 over hidden 32, DeepSeek-V3's 2048 of 18432), split over tp 2
        "pp2-tp2": {"tp": 2, "ffn_hidden": 144},
        "pp2-tp2-sp-zbv": {"tp": 2, "ffn_hidden": 144, "sequence_parallel": True, "schedule": "zbv",
                           "virtual_stages": 2}},
})


@pytest.mark.parametrize("name", list(CASES.cases))
def test_pipelined_mtp_runs_equal_the_reference(name: str) -> None:
    reference = assert_run_and_weights_equal_reference(CASES, name)
    # the copies stayed equal through the optimizer's steps
    assert torch.equal(reference["params"]["0.embed.tokens.weight"],
                       reference["params"][f"{last_stage(reference)}.head.predictions.0.embed.tokens.weight"])
