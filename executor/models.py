"""Models the executor can pipeline: the built-in MLP and GPT, and the interface a user
implements to pipeline their own ``nn.Module`` stages.

Every layer is initialised from ``(seed, layer index)`` alone, so a stage built on any
rank, for any split, holds exactly the weights the one-process reference holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch spelling
from torch import nn

from executor.config import ADAMW_BETAS, RunConfig, even_layout
from executor.rebuilt_activations import norm_read_by
from executor.token_data import byte_tokens, token_windows


@contextmanager
def seeded(seed: int, component: int) -> Iterator[None]:
    """Build one component from its own seed without disturbing the caller's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003 + component)
        yield


class PipelineModel:
    """What the executor needs to know about a model to pipeline it.

    Subclass it (at module level, so it can be pickled to each rank) to run your own
    stages: ``build_stage`` returns stage ``stage``'s module, ``boundary_shape`` the shape
    of the activation passed between stages (known ahead, so ranks never exchange
    shapes), ``make_batch`` one step's inputs and targets, ``loss_sum`` the loss *summed*
    over the samples of a microbatch (the executor divides by the batch size, so the
    gradients are those of the mean loss over the whole batch).
    """

    def build_stage(self, stage: int, num_stages: int) -> nn.Module:
        raise NotImplementedError

    def boundary_shape(self, microbatch_size: int) -> tuple[int, ...]:
        raise NotImplementedError

    def make_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Stage(nn.Module):
    """A contiguous slice of a layered model: optional input layer, blocks, optional head."""

    def __init__(self, embed: nn.Module | None, blocks: list[nn.Module], head: nn.Module | None) -> None:
        super().__init__()
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x


class LayeredModel(PipelineModel):
    """A model made of ``config.layers`` blocks, cut into stages by ``config.layout``."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        # Weights are built in the master type: float32 under bf16/fp16 autocast.
        self.dtype = getattr(torch, config.master_dtype)
        self.layout = config.layout or even_layout(config.layers, config.num_stages)

    def first_block(self, stage: int) -> int:
        return sum(self.layout[:stage])

    def build_stage(self, stage: int, num_stages: int) -> nn.Module:
        first = self.first_block(stage)
        seed = self.config.seed
        embed = head = None
        if stage == 0:
            with seeded(seed, 0):
                embed = self.make_embed()
        blocks = []
        for index in range(first, first + self.layout[stage]):
            with seeded(seed, 1 + index):
                blocks.append(self.make_block(index))
        if stage == num_stages - 1:
            with seeded(seed, 1 + self.config.layers):
                head = self.make_head()
        return Stage(embed, blocks, head).to(self.dtype)

    def make_embed(self) -> nn.Module | None:
        return None

    def make_block(self, layer: int) -> nn.Module:
        """Block ``layer`` (0-based over the whole model: layers may differ, e.g. the
        dense and mixture-of-experts layers of DeepSeek)."""
        raise NotImplementedError

    def make_head(self) -> nn.Module | None:
        return None

    def generator(self, step: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.config.seed * 7919 + step)


class MlpModel(LayeredModel):
    """``layers`` blocks of Linear + tanh on ``hidden`` features, mean-squared error
    against a random target: the smallest model that still has every pipeline edge."""

    def make_block(self, layer: int) -> nn.Module:
        return nn.Sequential(nn.Linear(self.config.hidden, self.config.hidden), nn.Tanh())

    def boundary_shape(self, microbatch_size: int) -> tuple[int, ...]:
        return (microbatch_size, self.config.hidden)

    def make_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = self.generator(step)
        shape = (batch_size, self.config.hidden)
        inputs = torch.randn(shape, generator=generator).to(self.dtype)
        targets = torch.randn(shape, generator=generator).to(self.dtype)
        return inputs, targets

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output - target).pow(2).mean(dim=1).sum()


class Block(nn.Module):
    """A pre-norm decoder block: causal self-attention then a 4x MLP, both residual."""

    recompute_norms = False  # --recompute norm-mla-up: each norm's output recomputed for its reader's backward
    regather_shards = True  # under sequence parallelism, qkv's and fc1's gathered inputs dropped until their backward
    context = None  # --cp: this rank's share of the sequence (executor.context_parallel)

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The qkv features are laid out head by head ([q k v] of head 0, then head 1, ...)
        # so that a tensor-parallel column split of ``qkv`` gives each rank whole heads;
        # the head count and sequence length are read from the (possibly split) output.
        qkv = norm_read_by(self.norm1, self.qkv, x, self.recompute_norms, self.regather_shards)
        batch, seq = qkv.shape[:2]
        heads = qkv.shape[2] // (3 * self.head_dim)
        q, k, v = qkv.view(batch, seq, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        if self.context is not None:  # this rank's share of each sequence against the whole (--cp)
            joined = self.context.attend_rotated(q, k, v)
        else:
            attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            joined = attention.transpose(1, 2).reshape(batch, seq, heads * self.head_dim)
        x = x + self.proj(joined)
        return x + self.fc2(F.gelu(norm_read_by(self.norm2, self.fc1, x, self.recompute_norms,
                                                  self.regather_shards)))


class Embedding(nn.Module):
    """Token plus learned position embedding: the first stage's input layer."""

    context = None  # --cp: this rank's share of the sequence, whose positions it embeds

    def __init__(self, vocab: int, seq_len: int, hidden: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seq_len, hidden)
        nn.init.normal_(self.tokens.weight, std=1 / math.sqrt(hidden))
        nn.init.normal_(self.positions.weight, std=1 / math.sqrt(hidden))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tokens(tokens) + self.positions(token_positions(tokens, self.context))


def token_positions(tokens: torch.Tensor, context) -> torch.Tensor:
    """The sequence positions of ``tokens``' columns: ``0 .. n-1``, or under context
    parallelism the rank's share of the whole sequence's (``ContextShard.positions``)."""
    if context is None:
        return torch.arange(tokens.shape[1], device=tokens.device)
    return context.positions.to(tokens.device)


class GptModel(LayeredModel):
    """A small decoder-only transformer: embedding on the first stage, blocks split
    across stages, final norm + vocabulary head and next-token loss on the last."""

    document: list[int] | None = None  # --data's tokens, read on first use

    def make_embed(self) -> nn.Module:
        return Embedding(self.config.vocab, self.config.seq_len, self.config.hidden)

    def make_block(self, layer: int) -> nn.Module:
        return Block(self.config.hidden, self.config.heads)

    def make_head(self) -> nn.Module:
        return nn.Sequential(nn.LayerNorm(self.config.hidden), nn.Linear(self.config.hidden, self.config.vocab))

    def boundary_shape(self, microbatch_size: int) -> tuple[int, ...]:
        return (microbatch_size, self.config.seq_len, self.config.hidden)

    def make_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Synthetic tokens, or windows of ``--data`` read byte by byte
        (``executor.token_data``); either way deterministic from the seed and the step."""
        length, generator = self.config.seq_len + 1, self.generator(step)
        if self.config.data is None:
            tokens = torch.randint(self.config.vocab, (batch_size, length), generator=generator)
        else:
            if self.document is None:
                self.document = byte_tokens(self.config.data)
            tokens = token_windows(self.document, batch_size, length, generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Mean over tokens of each sequence, summed over sequences: divided by the batch
        # size this is the mean next-token loss of the whole batch.
        losses = F.cross_entropy(output.flatten(0, 1), target.flatten(), reduction="sum")
        return losses / self.config.seq_len


BUILT_IN = {"mlp": MlpModel, "gpt": GptModel}


def build_model(config: RunConfig) -> PipelineModel:
    """The model named by ``config.model``: a toy, or an architecture (a preset or a
    config.json, ``executor.architectures.transformer``)."""
    if config.model in BUILT_IN:
        return BUILT_IN[config.model](config)
    from executor.architectures.transformer import SpecModel  # noqa: PLC0415 - it builds on this module

    return SpecModel(config)


def build_optimizer(config: RunConfig, params: Iterable[torch.Tensor], lr: float | None = None,
                    decays: Callable[[torch.Tensor], bool] | None = None, **options) -> torch.optim.Optimizer:
    """The optimizer named by ``config.optimizer`` over ``params``, at ``lr`` (default
    ``config.learning_rate``: the optimizer's own default unless ``--lr`` is given);
    ``options`` go to its constructor as given.

    Weight decay (``config.decay``) applies to matrices (linear and embedding weights)
    only: biases and norm weights are one-dimensional and are not decayed, the split
    Megatron-LM and nanoGPT make (decaying a norm's gain pulls it towards zero, which
    only shrinks the signal). AdamW uses the betas of LLM pretraining, ``ADAMW_BETAS``.
    ``decays`` overrides which tensors are matrices (ZeRO steps flat pieces cut from them).
    """
    params = list(params)
    decay = config.decay
    decays = decays or (lambda p: p.ndim >= 2)
    groups = [{"params": [p for p in params if decays(p)], "weight_decay": decay},
              {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}]
    groups = [group for group in groups if group["params"]] or [{"params": params}]
    lr = config.learning_rate if lr is None else lr
    if config.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=ADAMW_BETAS, **options)
    return torch.optim.SGD(groups, lr=lr, **options)
