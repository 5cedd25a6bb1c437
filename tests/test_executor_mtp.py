"""DeepSeek-V3's multi-token prediction trained by the executor: each module's hidden
states, logits and loss by hand, its embedding a copy of the model's table whose
gradient is the sum of the table's uses (against one process with a truly shared
table), and pipelined float64 runs (dp, ep, tp with and without sequence parallelism, a
split backward, DualPipe, full recompute, ZeRO-1 and 3, cp, two modules under cp and
under sequence parallelism) equal to the one-process reference."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch spelling

from executor.architectures.build import shrink_note, shrunk_spec
from executor.architectures.mtp import IGNORED, MTP_LOSS_WEIGHT, HeadWithPrediction, give_targets, prediction_targets
from executor.config import RunConfig
from executor.models import build_model
from executor.tied_embeddings import TiedEmbeddings
from pipesim.model.spec import BUNDLED_CONFIGS
from tests.launched_cases import LaunchedCases, assert_run_and_weights_equal_reference, last_stage

pytestmark = pytest.mark.timeout(300)
V3 = str(BUNDLED_CONFIGS / "deepseek-v3.json")
SMALL = {"model": V3, "layers": 4, "hidden": 32, "heads": 4, "seq_len": 8, "vocab": 37, "experts": 8}


def test_built_under_every_layout(tmp_path: Path) -> None:
    """Every depth runs over the whole sequence, so cp ranks cut it and sequence
    parallelism splits it as the model's blocks: the modules are built everywhere."""
    deeper = tmp_path / "deepseek-v3-mtp2.json"
    deeper.write_text(json.dumps({**json.loads(Path(V3).read_text()), "num_nextn_predict_layers": 2}))
    for flags in ({}, {"tp": 2}, {"tp": 2, "sequence_parallel": True}, {"cp": 2}, {"cp": 2, "tp": 2}):
        for model, depth in ((V3, 1), (str(deeper), 2)):
            config = RunConfig(**{**SMALL, "model": model}, **flags)
            assert shrunk_spec(config).mtp_depth == depth
            assert "multi-token" not in shrink_note(config)


def test_prediction_targets_roll_the_whole_sequence_by_hand() -> None:
    targets = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    rolled = prediction_targets(targets, 2)
    assert rolled.tolist() == [[[1, 2, 3, 4], [2, 3, 4, IGNORED], [3, 4, IGNORED, IGNORED]],
                               [[5, 6, 7, 8], [6, 7, 8, IGNORED], [7, 8, IGNORED, IGNORED]]]


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
    tokens, rows = model.make_batch(0, 2)
    targets = rows[:, 0]  # the next tokens; row 1 the same rolled by one (prediction_targets)
    assert torch.equal(rows[:, 1, :-1], targets[:, 1:]) and (rows[:, 1, -1] == IGNORED).all()
    hidden = tokens
    hidden = stage.embed(hidden)
    for block in stage.blocks:
        hidden = block(hidden)
    main = head.output(head.norm(hidden))
    # position i: [norm(h_i); norm(Emb(t_{i+1}))], projected, through the block: predicts t_{i+2};
    # truncated where no t_{i+2} exists, as the report writes it (causal: the last position
    # changes no other)
    joined = torch.cat((module.hidden_norm(hidden[:, :-1]), module.embedding_norm(module.embed(targets[:, :-1]))),
                       dim=-1)
    ahead = head.output(module.norm(module.block(joined @ module.projection.weight.T)))
    give_targets(stage, rows)
    output = stage(tokens)
    s = config.seq_len
    torch.testing.assert_close(output[:, :s], main, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(output[:, s:-1], ahead, rtol=1e-12, atol=1e-12)
    expected = (F.cross_entropy(main.flatten(0, 1), targets.flatten(), reduction="sum")
                + MTP_LOSS_WEIGHT * F.cross_entropy(ahead.flatten(0, 1), targets[:, 1:].flatten(), reduction="sum")) / s
    torch.testing.assert_close(model.loss_sum(output, rows), expected, rtol=1e-12, atol=0)
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


# two modules (DeepSeek-V3's file trains one)
DEEPER = Path(tempfile.mkdtemp(prefix="pipesim-mtp-")) / "deepseek-v3-mtp2.json"
DEEPER.write_text(json.dumps({**json.loads(Path(V3).read_text()), "num_nextn_predict_layers": 2}))
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
                           "virtual_stages": 2},
        # each rank's chunks' tokens ahead rolled in from the other's, the module's block under ring attention
        "pp2-cp2": {"cp": 2},
        "pp2-cp2-zbv-2-modules": {"cp": 2, "model": str(DEEPER), "schedule": "zbv", "virtual_stages": 2},
        "pp2-tp2-sp-2-modules": {"tp": 2, "ffn_hidden": 144, "sequence_parallel": True, "model": str(DEEPER)}},
})


@pytest.mark.parametrize("name", list(CASES.cases))
def test_pipelined_mtp_runs_equal_the_reference(name: str) -> None:
    reference = assert_run_and_weights_equal_reference(CASES, name)
    # the copies stayed equal through the optimizer's steps
    assert torch.equal(reference["params"]["0.embed.tokens.weight"],
                       reference["params"][f"{last_stage(reference)}.head.predictions.0.embed.tokens.weight"])
