"""Causal attention of a rank's queries against one block of keys and values, by
explicit scores, so that partial results can be merged and differentiated block by
block: what ring attention computes at each step (``executor.ring_attention``) and
all-gather context parallelism computes once over the gathered sequence
(``executor.context_parallel``).

A block's forward returns its output and its log-sum-exp per query row; ``merge`` folds
blocks together by log-sum-exp (online softmax: Milakov and Gimelshein 2018, flash
attention), so the result equals softmax attention over every block's keys at once.
The backward is flash attention's, from the final output and log-sum-exp: with
``P = exp(scores - lse)``, ``dV = P^T dO``, ``dS = P (dO V^T - rowsum(dO * O))``,
``dQ = dS K scale``, ``dK = dS^T Q scale``. Only the rows and columns a block's mask lets
through are computed. Key/value heads fewer than query heads (GQA) are expanded to
compute and their gradients summed back (``fold``); values may be narrower than keys (MLA).
"""

from __future__ import annotations

import torch


def expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated for the query heads that share them (GQA)."""
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def fold(x: torch.Tensor, groups: int) -> torch.Tensor:
    """A gradient for the expanded heads summed back onto the key/value heads."""
    if groups == 1:
        return x
    batch, heads, rows, width = x.shape
    return x.view(batch, heads // groups, groups, rows, width).sum(2)


def visible(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query rows and key columns that see anything under ``mask``, and the mask
    cut to them (the part of a block a step computes)."""
    rows = torch.nonzero(mask.any(1)).squeeze(1)
    cols = torch.nonzero(mask.any(0)).squeeze(1)
    return rows, cols, mask[rows][:, cols]


def block_scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Scaled ``q k^T`` with the masked-out pairs at ``-inf``."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    return scores.masked_fill(~mask, float("-inf"))


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                  groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of the forward: this rank's visible queries against one block; returns
    the rows, their output under the block alone and its log-sum-exp."""
    rows, cols, cut = visible(mask)
    scores = block_scores(q[:, :, rows], expand(k[:, :, cols], groups), cut, scale)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), expand(v[:, :, cols], groups))
    return rows, out, lse


def merge(out: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> None:
    """Fold a block's partial result into the running one (in place), by log-sum-exp:
    ``out = out e^(lse - new) + block e^(block_lse - new)``, ``new = log(e^lse + e^block_lse)``."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, block_lse)
    out[:, :, rows] = (out[:, :, rows] * torch.exp(old - new).unsqueeze(-1)
                       + block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse[:, :, rows] = new


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_grad: torch.Tensor, delta: torch.Tensor,
                   lse: torch.Tensor, mask: torch.Tensor, scale: float, groups: int,
                   dq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the backward against one block (flash attention's): adds the queries'
    gradient into ``dq`` and returns the block's key and value gradients."""
    rows, cols, cut = visible(mask)
    qs, grad = q[:, :, rows], out_grad[:, :, rows]
    ks, vs = expand(k[:, :, cols], groups), expand(v[:, :, cols], groups)
    probs = torch.exp(block_scores(qs, ks, cut, scale) - lse[:, :, rows].unsqueeze(-1))
    dv = torch.matmul(probs.transpose(-1, -2), grad)
    dscores = probs * (torch.matmul(grad, vs.transpose(-1, -2)) - delta[:, :, rows].unsqueeze(-1))
    dq[:, :, rows] += torch.matmul(dscores, ks) * scale
    dk = torch.matmul(dscores.transpose(-1, -2), qs) * scale
    dk_block, dv_block = torch.zeros_like(k), torch.zeros_like(v)
    dk_block[:, :, cols] = fold(dk, groups)
    dv_block[:, :, cols] = fold(dv, groups)
    return dk_block, dv_block


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The type the block math runs in: float32 or wider (flash attention keeps its
    softmax statistics in float32 whatever the activations' type)."""
    return torch.promote_types(dtype, torch.float32)
