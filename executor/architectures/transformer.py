"""A decoder built from a ``pipesim.model`` spec: the architecture ``simulate --model``
prices, trained for real (``run --model llama3-8b``, ``mixtral-8x7b``, ``deepseek-v3``,
a config.json), at the sizes ``executor.architectures.build`` shrinks it to.

Each block is pre-norm (RMSNorm or LayerNorm as the spec says): attention (grouped-query
with rotary positions, ``executor.architectures.layers``; latent attention, ``executor.architectures.latent_attention``)
then the MLP (SwiGLU or GeLU; a mixture of experts on the spec's sparse layers,
``executor.architectures.moe``), both residual. The layers are split over stages as the simulator
splits them (``executor.architectures.build.stage_layers``); the first stage holds the token
embedding (and a learned position table where the spec has one), the last the final
norm, the output projection and the next-token loss. Embeddings are untied: the first
and last stage are different ranks.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from executor.architectures.build import shrunk_spec, stage_layers
from executor.architectures.latent_attention import LatentAttention
from executor.architectures.layers import Attention, FeedForward, RMSNorm, SoftCappedLinear
from executor.architectures.moe import MixtureOfExperts
from executor.architectures.mtp import (
    MTP_LOSS_WEIGHT,
    HeadWithPrediction,
    PredictionModule,
    prediction_targets,
    split_logits,
)
from executor.config import RunConfig
from executor.models import GptModel, seeded, token_positions
from executor.rebuilt_activations import norm_read_by, norm_read_by_each
from pipesim.model.spec import ModelSpec


def norm_of(spec: ModelSpec) -> nn.Module:
    return RMSNorm(spec.hidden, offset=spec.norm_offset) if spec.rms_norm else nn.LayerNorm(spec.hidden)


class TransformerBlock(nn.Module):
    """Layer ``layer`` of ``spec``: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``;
    with a parallel residual (GPT-NeoX, Falcon) ``x + attention(norm(x)) + mlp(norm'(x))``,
    one norm shared where the spec has one a layer (Falcon-7B); with four norms a layer
    (Gemma 2/3) each half's output normalised too before it joins the residual,
    ``x + post(attention(norm(x)))``."""

    recompute_norms = False  # --recompute norm-mla-up: each norm's output recomputed for its reader's backward
    # under sequence parallelism, each sublayer's gathered input dropped after its forward and gathered again
    # before its backward (executor.rebuilt_activations.read_gathered_shard); off under a checkpoint
    regather_shards = True

    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.parallel = spec.parallel_residual
        self.attention_norm = norm_of(spec)
        sliding = layer in spec.sliding_layers
        query_scale = 1.0
        if spec.query_pre_attn_scalar is not None:
            query_scale = (spec.head_size / spec.query_pre_attn_scalar) ** 0.5
        if spec.mla is not None:
            self.attention = LatentAttention(spec.hidden, spec.heads, spec.mla, spec.attention_has_bias, spec.rope)
        else:
            self.attention = Attention(
                spec.hidden, spec.heads, spec.num_kv_heads, spec.head_size, spec.attention_has_bias, spec.qkv_bias,
                rotary=not spec.learned_positions and layer not in spec.nope_layers, fused_qkv=spec.fused_qkv,
                qk_norm=spec.qk_norm if spec.has_qk_norm(layer) else None,
                window=spec.sliding_window if sliding else None,
                chunk=spec.attention_chunk if layer in spec.chunked_layers else None, sinks=spec.attention_sinks,
                rope=spec.local_rope if sliding and spec.local_rope else spec.rope, rotary_dim=spec.rotary_width,
                norm_offset=spec.norm_offset, query_scale=query_scale, softcap=spec.attention_softcap,
                temperature=spec.nope_temperature if layer in spec.nope_layers else None)
        # Falcon-7B's parallel block: one norm whose output both the attention and the MLP read
        self.ffn_norm = norm_of(spec) if spec.norms_per_layer != 1 else None
        # Gemma 2/3: the attention's and the MLP's outputs normalised before the residual adds them
        self.post_attention_norm = self.post_ffn_norm = None
        if spec.norms_per_layer == 4:
            self.post_attention_norm, self.post_ffn_norm = norm_of(spec), norm_of(spec)
        moe = spec.moe
        if spec.is_moe_layer(layer):
            self.feed_forward = MixtureOfExperts(
                spec.hidden, moe.experts, moe.experts_per_token, moe.expert_ffn, moe.shared_ffn,
                moe.shared_expert_gate, moe.gating, moe.normalize_top_k, moe.capacity_factor,
                moe.expert_groups, moe.node_limit, moe.group_scoring, moe.routed_scaling, moe.router_bias,
                moe.balanced_by_bias, moe.weighted_input, spec.mlp_has_bias, spec.activation, spec.activation_limit,
                moe.balance_loss)
            self.feed_forward.router.layer = layer
        else:
            self.feed_forward = FeedForward(spec.hidden, spec.ffn, spec.gated_mlp, spec.mlp_has_bias, spec.activation,
                                            spec.activation_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recompute, regather = self.recompute_norms, self.regather_shards
        if self.ffn_norm is None:  # parallel, one norm both halves read
            attended, fed = norm_read_by_each(self.attention_norm, (self.attention, self.feed_forward), x, recompute,
                                              regather)
            return x + attended + fed
        attended = norm_read_by(self.attention_norm, self.attention, x, recompute, regather)
        if self.post_attention_norm is not None:
            x = x + self.post_attention_norm(attended)
            return x + self.post_ffn_norm(norm_read_by(self.ffn_norm, self.feed_forward, x, recompute, regather))
        if self.parallel:  # GPT-NeoX, Falcon's new decoder: both read the block's input
            return x + attended + norm_read_by(self.ffn_norm, self.feed_forward, x, recompute, regather)
        x = x + attended
        return x + norm_read_by(self.ffn_norm, self.feed_forward, x, recompute, regather)


class TokenEmbedding(nn.Module):
    """Token embedding, plus a learned position table where the spec has one (GPT-2)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.tokens = nn.Embedding(spec.vocab, spec.hidden)
        nn.init.normal_(self.tokens.weight, std=1 / math.sqrt(spec.hidden))
        self.positions = None
        self.context = None  # --cp: this rank's share of the sequence, whose positions it embeds
        self.scale = math.sqrt(spec.hidden) if spec.embedding_scale else None
        if spec.learned_positions:
            self.positions = nn.Embedding(spec.positions or spec.seq_len, spec.hidden)
            nn.init.normal_(self.positions.weight, std=1 / math.sqrt(spec.hidden))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens)
        if self.scale is not None:  # Gemma: times sqrt(hidden)
            x = x * self.scale
        if self.positions is not None:
            x = x + self.positions(token_positions(tokens, self.context))
        return x


class SpecModel(GptModel):
    """``config.model``'s architecture, shrunk to the config's sizes, pipelined: the gpt's
    data and next-token loss, the spec's blocks, the simulator's stage split."""

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.spec = shrunk_spec(config)
        self.layout = tuple(stage_layers(self.spec, config.num_stages, config.layout, config.tp,
                                         config.sequence_parallel, config.split_ranks))

    def make_embed(self) -> nn.Module:
        return TokenEmbedding(self.spec)

    def make_block(self, layer: int) -> nn.Module:
        return TransformerBlock(self.spec, layer)

    def make_head(self) -> nn.Module:
        cap = self.spec.logit_softcap
        output = (nn.Linear(self.spec.hidden, self.spec.vocab, bias=False) if cap is None
                  else SoftCappedLinear(self.spec.hidden, self.spec.vocab, cap))
        norm = norm_of(self.spec)
        modules = [self.make_prediction(depth) for depth in range(1, self.spec.mtp_depth + 1)]
        head = HeadWithPrediction(norm, output, modules) if modules else nn.Sequential(norm, output)
        if self.spec.tied_embeddings:  # the last stage's copy of the table (executor.tied_embeddings)
            with seeded(self.config.seed, 0), torch.no_grad():
                head[-1].weight.copy_(self.make_embed().tokens.weight)
        return head

    def make_prediction(self, depth: int) -> PredictionModule:
        """DeepSeek-V3's MTP module ``depth`` (``executor.architectures.mtp``): its block is
        the layer after the model's last, its embedding a copy of the first stage's table."""
        spec = self.spec
        embed = TokenEmbedding(spec)
        with seeded(self.config.seed, 0), torch.no_grad():
            embed.tokens.weight.copy_(self.make_embed().tokens.weight)
        block = TransformerBlock(spec, spec.layers + depth - 1)
        return PredictionModule(embed, norm_of(spec), norm_of(spec), block, norm_of(spec), spec.hidden)

    def make_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's tokens; with MTP the targets as ``prediction_targets`` (each depth's
        tokens ahead, rolled on the whole sequence before a cp rank cuts its chunks)."""
        inputs, targets = super().make_batch(step, batch_size)
        if self.spec.mtp_depth:
            targets = prediction_targets(targets, self.spec.mtp_depth)
        return inputs, targets

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The next-token loss, plus with MTP each depth ``k``'s loss on the token ``k + 1``
        ahead (summed over the ``s - k`` positions that have one, the rest ignored, divided
        by ``s`` as the main loss is), weighted by ``MTP_LOSS_WEIGHT / depth``; ``target``
        is then ``prediction_targets``' ``batch x (depth + 1) x seq``."""
        depth = self.spec.mtp_depth
        if not depth:
            return super().loss_sum(output, target)
        main, *ahead = split_logits(output, target.shape[-1], depth)
        loss = super().loss_sum(main, target[:, 0])
        for k, logits in enumerate(ahead, start=1):
            loss = loss + MTP_LOSS_WEIGHT / depth * super().loss_sum(logits, target[:, k])
        return loss
