"""DeepSeek-V3's multi-token prediction (MTP, report section 2.2), trained beside the
model on the last stage.

Module ``k`` (of ``num_nextn_predict_layers``) takes the previous depth's hidden states
(the main model's last block's output for ``k = 1``, before the final norm) and the
embeddings of the tokens ``k`` ahead, ``M_k [RMSNorm(h); RMSNorm(Emb(t_{i+k}))]`` (a
projection from ``2d`` to ``d``), runs one transformer block (the layer after the main
model's last: a mixture-of-experts layer in DeepSeek-V3), and predicts token ``i + k + 1``
through its own final norm and the main model's output layer. Its loss over the
``T - k`` positions that have such a token, summed and divided by ``T`` as the report's
``L_k``, is weighted by ``MTP_LOSS_WEIGHT / D`` and added to the main loss.

The embedding is the model's: the last stage keeps a copy of the first stage's table,
whose gradients are summed as a tied model's are (``executor.tied_embeddings``).

Every depth runs over the whole sequence, as Megatron-Core's MTP does: the tokens ahead
are the targets rolled by ``k`` on the whole sequence before it is cut
(``prediction_targets``: the model's ``make_batch`` hands the last stage a ``batch x
(D + 1) x seq`` target, row ``k`` the token ``k + 1`` ahead), and the positions with no
token that far ahead are ignored by the loss. A causal block's position sees only
positions up to its own, and those positions are ignored at every later depth too, so
this gives the losses and gradients of truncating each depth's sequence; what it changes
is that the tail's tokens are routed (a mixture of experts' balance loss counts them, as
Megatron-Core's does). Because every depth is the whole sequence, a context-parallel rank
cuts each row of the targets as it cuts the tokens (its chunks' tokens ahead are rolled
in from the others' before the cut) and runs the module's block under ring attention as
the model's; under sequence parallelism every depth splits evenly over the tp ranks.

Under tensor parallelism the module's block is split as the model's are (the tp plan
covers every block of the stage); its norms, projection and embedding copy are whole on
every tp rank, as the model's norms and embedding are. With sequence parallelism the
block takes this rank's shard of the whole sequence the head gathered and hands the
whole sequence on (``executor.tensor_parallel.shard_prediction_blocks``). torch's
runtime calls a stage without its targets, so a run there refuses a model with MTP in
one line (``executor.torch_pipelining``).
"""

from __future__ import annotations

import torch
from torch import nn

# The MTP losses' weight: Megatron-Core's default --mtp-loss-scaling-factor, and DeepSeek-V3's
# after its first 10T tokens (0.3 before)
MTP_LOSS_WEIGHT = 0.1
IGNORED = -100  # torch's cross_entropy ignore_index: a position with no token that far ahead


def prediction_targets(targets: torch.Tensor, depth: int) -> torch.Tensor:
    """``batch x seq`` next tokens as ``batch x (depth + 1) x seq``: row 0 the next
    tokens, row ``k`` those ``k`` further ahead (the targets rolled by ``k``), ``IGNORED``
    where the sequence has no token that far ahead."""
    rows = [targets]
    for k in range(1, depth + 1):
        rolled = torch.full_like(targets, IGNORED)
        rolled[:, :-k] = targets[:, k:]
        rows.append(rolled)
    return torch.stack(rows, dim=1)


class PredictionModule(nn.Module):
    """One depth: the table's copy, two norms, the projection, a block, a final norm."""

    def __init__(self, embed: nn.Module, hidden_norm: nn.Module, embedding_norm: nn.Module, block: nn.Module,
                 norm: nn.Module, hidden: int) -> None:
        super().__init__()
        self.embed, self.hidden_norm, self.embedding_norm = embed, hidden_norm, embedding_norm
        self.projection = nn.Linear(2 * hidden, hidden, bias=False)
        self.block, self.norm = block, norm

    def forward(self, hidden: torch.Tensor, ahead: torch.Tensor) -> torch.Tensor:
        """The next depth's hidden states from ``hidden`` and the tokens ``ahead``."""
        joined = torch.cat((self.hidden_norm(hidden), self.embedding_norm(self.embed(ahead))), dim=-1)
        return self.block(self.projection(joined))


class HeadWithPrediction(nn.Module):
    """The last stage's head (final norm, output layer) and the MTP modules after it.
    Indexable as the plain head is (``head[0]`` the norm, ``head[-1]`` the output
    layer). ``targets`` is set by the runtime before each forward: the microbatch's
    ``prediction_targets``, whose rows the modules embed. The output is the main logits
    and each depth's, joined along the sequence (``split_logits`` takes them apart)."""

    def __init__(self, norm: nn.Module, output: nn.Module, modules: list[PredictionModule]) -> None:
        super().__init__()
        self.norm, self.output = norm, output
        self.predictions = nn.ModuleList(modules)
        self.targets: torch.Tensor | None = None

    def __getitem__(self, index: int) -> nn.Module:
        return (self.norm, self.output)[index]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            raise RuntimeError("multi-token prediction needs the microbatch's targets before the last stage's "
                               "forward (pipesim's runtime sets them; torch's does not)")
        logits = [self.output(self.norm(hidden))]
        for depth, module in enumerate(self.predictions, start=1):
            # position i embeds token i + depth (row depth - 1) and predicts row depth; past the
            # sequence's end any token will do, those positions' losses being ignored
            hidden = module(hidden, self.targets[:, depth - 1].clamp(min=0))
            logits.append(self.output(module.norm(hidden)))
        self.targets = None
        return torch.cat(logits, dim=1)


def split_logits(output: torch.Tensor, seq: int, depth: int) -> list[torch.Tensor]:
    """The main logits and each depth's, ``seq`` positions each."""
    return list(output.split(seq, dim=1))


def prediction_head(stage: nn.Module) -> HeadWithPrediction | None:
    """A last stage's head where it has MTP modules, else None."""
    head = getattr(stage, "head", None)
    return head if isinstance(head, HeadWithPrediction) else None


def give_targets(stage: nn.Module, targets: torch.Tensor) -> None:
    """Hand a last stage's MTP head the microbatch's targets (no-op for other stages)."""
    if (head := prediction_head(stage)) is not None:
        head.targets = targets


def prediction_tables(stage: nn.Module) -> list[nn.Parameter]:
    """The embedding copies a last stage's MTP modules hold."""
    head = prediction_head(stage)
    return [module.embed.tokens.weight for module in head.predictions] if head is not None else []


def prediction_blocks(stage: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a last stage's MTP modules (recompute wraps them too)."""
    head = prediction_head(stage)
    return [module.block for module in head.predictions] if head is not None else []
