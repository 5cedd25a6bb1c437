"""The parts of the executor's architectures, each against a hand calculation or a
second implementation: RMSNorm's closed form, RoPE against explicit 2x2 rotations,
grouped-query attention against multi-head attention with repeated key/value heads,
the router's top-k and capacity dropping on hand-made scores, a mixture of experts
against a token-by-token loop, causality of every attention; and the shrinking of
presets into runnable sizes, the stage split against ``pipesim simulate``'s, and the
byte tokenizer.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.architectures.build import shrink_note, shrunk_spec, stage_layers
from executor.architectures.latent_attention import LatentAttention
from executor.architectures.layers import Attention, RMSNorm, apply_rotary, rotary_angles
from executor.architectures.moe import MixtureOfExperts, Router, within_capacity
from executor.architectures.mtp import MTP_LOSS_WEIGHT
from executor.config import RunConfig
from executor.models import build_model
from executor.reference import reference_run
from executor.token_data import BOS, EOS, byte_tokens, token_windows
from pipesim.cli import main
from pipesim.model.latent_attention import LatentAttention as LatentSizes
from pipesim.model.spec import BUNDLED_CONFIGS


@pytest.fixture(autouse=True)
def float64():
    """Every part in float64 here (and the default restored for the tests after)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def test_rms_norm_closed_form() -> None:
    norm = RMSNorm(2, eps=0.0)
    norm.weight.data = torch.tensor([1.0, 2.0])
    # rms of (3, 4) is sqrt((9 + 16) / 2) = sqrt(12.5)
    out = norm(torch.tensor([[3.0, 4.0]]))
    assert out[0].tolist() == pytest.approx([3 / math.sqrt(12.5), 2 * 4 / math.sqrt(12.5)], abs=1e-12)


def rotation(position: int, dim: int, theta: float = 10000.0) -> torch.Tensor:
    """The block-diagonal matrix turning feature pair i by position * theta^(-2i/dim)."""
    matrix = torch.zeros(dim, dim)
    for pair in range(dim // 2):
        angle = position * theta ** (-2 * pair / dim)
        c, s = math.cos(angle), math.sin(angle)
        matrix[2 * pair:2 * pair + 2, 2 * pair:2 * pair + 2] = torch.tensor([[c, -s], [s, c]])
    return matrix


def test_rope_equals_hand_built_rotations() -> None:
    seq, dim = 5, 6
    x = torch.randn(2, seq, dim, generator=torch.Generator().manual_seed(0))
    cos, sin = rotary_angles(seq, dim, dtype=x.dtype)
    out = apply_rotary(x, cos, sin)
    for position in range(seq):
        expected = x[:, position] @ rotation(position, dim).T
        assert torch.allclose(out[:, position], expected, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 20), st.integers(0, 20), st.integers(0, 5))
def test_rope_scores_depend_on_relative_position_only(m: int, n: int, shift: int) -> None:
    generator = torch.Generator().manual_seed(1)
    q, k = torch.randn(8, generator=generator), torch.randn(8, generator=generator)
    cos, sin = rotary_angles(32, 8)

    def score(i: int, j: int) -> float:
        return float(apply_rotary(q, cos[i], sin[i]) @ apply_rotary(k, cos[j], sin[j]))

    assert score(m, n) == pytest.approx(score(m + shift, n + shift), abs=1e-9)


def test_grouped_query_attention_equals_multi_head_with_repeated_kv_heads() -> None:
    torch.manual_seed(2)
    hidden, heads, kv_heads, head_dim = 16, 4, 2, 4
    gqa = Attention(hidden, heads, kv_heads, head_dim)
    mha = Attention(hidden, heads, heads, head_dim)
    repeat = heads // kv_heads
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        for name in ("wk", "wv"):  # query heads 2j and 2j+1 read kv head j
            weight = getattr(gqa, name).weight.view(kv_heads, head_dim, hidden)
            getattr(mha, name).weight.copy_(weight.repeat_interleave(repeat, dim=0).reshape(heads * head_dim, hidden))
    x = torch.randn(3, 7, hidden)
    assert torch.allclose(gqa(x), mha(x), atol=1e-12)
    assert gqa.wk.weight.numel() == mha.wk.weight.numel() // repeat


@pytest.mark.parametrize("make", [lambda: Attention(16, 4, 2, 4),
                                  lambda: LatentAttention(16, 4, LatentSizes(8, 6, 4, 2, 4)),
                                  lambda: LatentAttention(16, 4, LatentSizes(None, 6, 4, 2, 4))],
                         ids=["gqa", "mla", "mla-no-q-latent"])
def test_attention_is_causal(make) -> None:
    """A token's output never depends on the tokens after it."""
    torch.manual_seed(3)
    attention = make()
    x = torch.randn(2, 6, 16)
    changed = x.clone()
    changed[:, 4:] += torch.randn(2, 2, 16)
    assert torch.allclose(attention(x)[:, :4], attention(changed)[:, :4], atol=1e-12)
    assert not torch.allclose(attention(x)[:, 4:], attention(changed)[:, 4:])


def router_with_logits(logits: list[list[float]], top_k: int, gating: str = "softmax",
                       normalize: bool = True) -> tuple[Router, torch.Tensor]:
    """A router whose gate is the identity, so each token's logits are its features."""
    experts = len(logits[0])
    router = Router(experts, experts, top_k, gating, normalize)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(experts))
    return router, torch.tensor(logits)


def test_router_softmax_top2_renormalised() -> None:
    router, tokens = router_with_logits([[1.0, 3.0, 2.0, 0.0], [0.5, 0.0, 0.0, 2.5]], top_k=2)
    weights, chosen = router(tokens)
    assert chosen.tolist() == [[1, 2], [3, 0]]
    # normalised top-2 of a softmax = softmax over the two logits: e^3 / (e^3 + e^2)
    assert weights[0].tolist() == pytest.approx([1 / (1 + math.exp(-1)), 1 / (1 + math.exp(1))], abs=1e-12)
    assert weights[1].tolist() == pytest.approx([1 / (1 + math.exp(-2)), 1 / (1 + math.exp(2))], abs=1e-12)


def test_router_unnormalised_softmax_keeps_the_full_softmax_scores() -> None:
    router, tokens = router_with_logits([[1.0, 3.0, 2.0, 0.0]], top_k=2, normalize=False)
    weights, _ = router(tokens)
    total = sum(math.exp(v) for v in (1.0, 3.0, 2.0, 0.0))
    assert weights[0].tolist() == pytest.approx([math.exp(3) / total, math.exp(2) / total], abs=1e-12)


def test_sigmoid_router_bias_moves_the_choice_not_the_weight() -> None:
    router, tokens = router_with_logits([[2.0, 1.0, 0.0]], top_k=1, gating="sigmoid")
    assert router(tokens)[1].tolist() == [[0]]
    router.selection_bias.copy_(torch.tensor([0.0, 0.5, 0.0]))  # sigmoid(1) + 0.5 > sigmoid(2)
    weights, chosen = router(tokens)
    assert chosen.tolist() == [[1]]
    assert weights.item() == pytest.approx(1.0)  # normalised: the one weight is 1
    router.normalize = False
    assert router(tokens)[0].item() == pytest.approx(1 / (1 + math.exp(-1)), abs=1e-12)


def test_capacity_drops_copies_beyond_each_experts_share_in_token_order() -> None:
    # one sequence of 4 tokens, top-1 of 2 experts, factor 1: capacity ceil(1 * 1 * 4 / 2) = 2
    chosen = torch.tensor([[[0], [0], [0], [1]]])
    assert within_capacity(chosen, 2, 1.0).flatten().tolist() == [True, True, False, True]
    # top-2 of 2, factor 0.5: capacity ceil(0.5 * 2 * 4 / 2) = 2 copies per expert
    chosen = torch.tensor([[[0, 1], [0, 1], [1, 0], [0, 1]]])
    assert within_capacity(chosen, 2, 0.5).tolist() == [[[True, True], [True, True], [False, False], [False, False]]]
    # the capacity counts per sequence: a second sequence starts afresh
    chosen = torch.tensor([[[0], [0], [0], [0]], [[0], [1], [1], [0]]])
    assert within_capacity(chosen, 2, 1.0).flatten().tolist() == [True, True, False, False] + [True] * 4


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 8), st.integers(1, 4), st.data(),
       st.sampled_from([0.25, 0.5, 1.0, 1.5, 4.0]))
def test_capacity_keeps_the_first_copies_up_to_the_capacity(sequences, seq, experts, data, factor) -> None:
    """Whatever the routes: per sequence and expert, the copies kept are the first
    ``min(copies, capacity)`` in token-then-choice order, ``capacity = ceil(f k s / E)``."""
    top_k = data.draw(st.integers(1, experts))
    routes = data.draw(st.lists(st.permutations(range(experts)), min_size=sequences * seq,
                                max_size=sequences * seq))
    chosen = torch.tensor([route[:top_k] for route in routes]).view(sequences, seq, top_k)
    keep = within_capacity(chosen, experts, factor)
    capacity = math.ceil(factor * top_k * seq / experts)
    for sequence in range(sequences):
        order = chosen[sequence].flatten().tolist()
        kept = keep[sequence].flatten().tolist()
        for expert in range(experts):
            places = [place for place, e in enumerate(order) if e == expert]
            assert [kept[place] for place in places] == [n < capacity for n in range(len(places))]


def moe_by_tokens(moe: MixtureOfExperts, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The mixture of experts one token and one chosen expert at a time."""
    tokens = x.reshape(-1, x.shape[-1])
    weights, chosen = moe.router(tokens)
    rows = []
    for token in range(tokens.shape[0]):
        row = torch.zeros(tokens.shape[1])
        for slot in range(chosen.shape[1]):
            if keep is None or keep[token, slot]:
                row += weights[token, slot] * moe.experts[int(chosen[token, slot])](tokens[token])
        if moe.shared is not None:
            row += moe.shared(tokens[token]) * (moe.shared_gate(tokens[token]).sigmoid() if moe.shared_gate else 1)
        rows.append(row)
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_mixture_of_experts_equals_token_by_token_loop(capacity_factor) -> None:
    torch.manual_seed(4)
    moe = MixtureOfExperts(8, experts=4, top_k=2, expert_ffn=6, shared_ffn=5, shared_gate=True,
                           capacity_factor=capacity_factor)
    x = torch.randn(2, 6, 8)
    keep = None
    if capacity_factor is not None:
        chosen = moe.router(x.reshape(-1, 8))[1]
        keep = within_capacity(chosen.view(2, 6, 2), 4, capacity_factor).view(-1, 2)
        assert not keep.all()  # capacity 0.5 * 2 * 6 / 4 -> 2 of 12 copies per expert: some are dropped
    assert torch.allclose(moe(x), moe_by_tokens(moe, x, keep), atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixture_of_experts_under_autocast_keeps_the_residual_type(dtype) -> None:
    """Under bf16/fp16 autocast the experts compute in the low type and the router in
    float32; the layer returns the residual stream's type (float32 on the first stage)."""
    torch.manual_seed(5)
    moe = MixtureOfExperts(8, experts=4, top_k=2, expert_ffn=6, shared_ffn=4, shared_gate=True).float()
    x = torch.randn(2, 3, 8, dtype=torch.float32)
    with torch.autocast("cpu", dtype=dtype):
        out = moe(x)
        weights, _ = moe.router(x.reshape(-1, 8))
    assert out.dtype == torch.float32 and weights.dtype == torch.float32
    assert torch.allclose(out, moe(x), atol=0.05)  # the float32 layer, to low precision


def test_an_expert_no_token_chose_gets_a_zero_gradient() -> None:
    torch.manual_seed(6)
    moe = MixtureOfExperts(4, experts=3, top_k=1, expert_ffn=4)
    with torch.no_grad():  # every token prefers expert 0
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[0, 0] = 1.0
    x = torch.randn(1, 5, 4).abs()
    moe(x).sum().backward()
    assert moe.experts[0].w1.weight.grad.abs().sum() > 0
    for expert in moe.experts[1:]:
        assert all(p.grad is not None and not p.grad.any() for p in expert.parameters())


def config(model: str, **fields) -> RunConfig:
    return RunConfig(model=model, **{"pp": 2, **fields})


def test_shrunk_presets_keep_their_proportions() -> None:
    llama = shrunk_spec(config("llama3-8b", hidden=64, heads=8))
    assert (llama.num_kv_heads, llama.ffn) == (2, 224)  # 32:8 heads, ffn 14336/4096 = 3.5 h
    mixtral = shrunk_spec(config("mixtral-8x7b"))
    assert (mixtral.moe.experts, mixtral.moe.experts_per_token, mixtral.moe.expert_ffn) == (8, 2, 224)
    deepseek = shrunk_spec(config("deepseek-v3", layers=4))
    # 256 experts top 8 -> 8 top 4; the first 3 of 61 layers dense -> at most half of 4
    assert (deepseek.moe.experts, deepseek.moe.experts_per_token, deepseek.moe.dense_layers) == (8, 4, (0, 1))
    assert deepseek.moe.gating == "sigmoid" and deepseek.mla.qk_rope_head_dim == 8
    assert shrink_note(config("mixtral-8x7b", experts=4)) == (
        "model mixtral-8x7b: layers 32->4, hidden 4096->64, heads 32->4, kv-heads 8->1, ffn-hidden 14336->224, "
        "seq-len 8192->16, vocab 32000->128, experts 8->4, expert ffn 14336->224; "
        "load-balancing loss 0.02 per MoE layer, per sequence (the config's)")


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["llama3-8b", "llama3-70b", "mixtral-8x7b", "deepseek-v3", "deepseek-v2-lite", "gpt3-13b"]),
       st.integers(1, 6), st.sampled_from([1, 2, 4, 8]), st.integers(1, 16), st.integers(1, 16))
def test_any_shrink_is_a_valid_architecture(model, layers, heads, head_width, experts) -> None:
    """Whatever sizes are asked, the shrunk spec is one pipesim.model accepts: the
    key/value heads divide the heads, top-k fits the experts, some layer stays sparse
    where the original has experts, widths are positive."""
    hidden = heads * 2 * head_width
    spec = shrunk_spec(config(model, layers=layers, hidden=hidden, heads=heads, pp=1,
                              experts=experts if "mixtral" in model or "deepseek" in model else None))
    assert (spec.layers, spec.hidden, spec.heads) == (layers, hidden, heads)
    assert spec.heads % spec.num_kv_heads == 0 and spec.ffn >= 1
    if spec.moe is not None:
        assert spec.moe.experts == experts and 1 <= spec.moe.experts_per_token <= experts
        assert len(spec.moe.dense_layers) <= layers // 2 and any(spec.is_moe_layer(i) for i in range(layers))


@pytest.mark.parametrize("flags", [("--layers", 10, "--vocab", 4096, "--pp", 4),
                                   ("--layers", 16, "--pp", 2, "--schedule", "interleaved-1f1b", "-v", 2)])
def test_stage_split_is_the_one_simulate_prints(flags, tmp_path, capsys) -> None:
    sizes = ("--hidden", 64, "--heads", 4, "--kv-heads", 1, "--ffn-hidden", 224, "--seq-len", 16)
    out = tmp_path / "simulated.json"
    assert main(["simulate", "--model", "llama3-8b", *map(str, sizes + flags), "--json", str(out)]) == 0
    capsys.readouterr()
    simulated = [stage["layers"] for stage in json.loads(out.read_text())["stage_costs"]]
    named = dict(zip(flags[::2], flags[1::2], strict=True))
    run = config("llama3-8b", layers=named["--layers"], hidden=64, heads=4, kv_heads=1, ffn_hidden=224,
                 vocab=named.get("--vocab", 128), pp=named["--pp"], virtual_stages=named.get("-v", 1),
                 schedule=named.get("--schedule", "1f1b"))
    assert stage_layers(shrunk_spec(run), run.num_stages, None) == simulated


CONFIGS = sorted((BUNDLED_CONFIGS).glob("*.json"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.stem)
def test_every_stored_config_trains(path) -> None:
    """Each Hugging Face config the simulator reads builds, shrunk, and takes a step whose
    loss is a fresh model's (about ln V: nearly uniform next-token guesses)."""
    run = RunConfig(model=str(path), pp=2, microbatches=2, batch_size=2, steps=1, dtype="float64")
    run.check()
    (loss,) = reference_run(run)["losses"]
    # a tied model's output layer is the embedding table (initialised with std 1/sqrt(h)):
    # logits of unit variance, whose log-sum-exp is about ln V + 1/2
    spec = build_model(run).spec
    fresh = math.log(run.vocab) + (0.5 if spec.tied_embeddings else 0.0)
    # DeepSeek-V3's multi-token prediction adds its loss over s - 1 of s positions, weighted
    fresh *= 1 + spec.mtp_depth * MTP_LOSS_WEIGHT * (run.seq_len - 1) / run.seq_len
    assert abs(loss - fresh) < 0.5


def test_byte_tokens_and_windows(tmp_path) -> None:
    path = tmp_path / "text.txt"
    path.write_bytes(b"ab\xff")
    tokens = byte_tokens(str(path))
    assert tokens == [BOS, 97, 98, 255, EOS]
    windows = token_windows(tokens, 6, 7, torch.Generator().manual_seed(0))
    assert windows.shape == (6, 7)
    for window in windows.tolist():  # every window is a stretch of the document repeated end to end
        start = tokens.index(window[0])
        assert window == [tokens[(start + i) % len(tokens)] for i in range(7)]
