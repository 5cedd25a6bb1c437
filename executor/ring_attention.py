"""Ring attention (``run --cp N --cp-comm p2p``): each cp rank keeps its queries and
passes blocks of keys and values around the ring, so no rank ever holds the whole
sequence's keys and values (``simulate --cp-comm p2p`` prices exactly these messages,
``pipesim.sim.context_parallel``).

The structure is Transformer Engine's ``AttnFuncWithCPAndKVP2P`` (Megatron-Core's ring),
written here for plain torch:

- **Forward**, ``cp`` steps: at step ``i`` rank ``r`` attends its queries to the block of
  keys and values cp rank ``r - i`` holds (its own first), while that block moves on to
  ``r + 1`` and the next arrives from ``r - 1`` (one message of ``S`` bytes, a rank's
  keys and values, in each of the first ``cp - 1`` steps). The blocks' partial results
  are merged by their log-sum-exp (online softmax, Milakov and Gimelshein 2018; flash
  attention), so the output equals softmax attention over every key at once. The
  forward keeps its queries, its output, the log-sum-exp and only the *last* block it
  saw (rank ``r + 1``'s): not every block.
- **Backward**, ``cp`` steps the other way round the ring, starting from that last
  block: at step ``i`` rank ``r`` holds the block of rank ``r + 1 + i`` together with
  the key/value gradients the ranks before it have accumulated for that block; it adds
  its own queries' share and passes both to ``r - 1``. The first step sends only the
  block (nothing accumulated yet: ``S`` bytes), the middle ``cp - 2`` steps the block and
  its gradients (``2 S``), the last only the gradients (``S``), which reach the block's
  owner exactly there. That is the ``S + (cp - 2) 2S + S`` the simulator charges.

Under load balancing (``executor.context_parallel``: rank ``r`` holds chunks ``r`` and
``2 cp - 1 - r``) a rank's own block is causal within its chunks, an earlier rank's block
is seen only through its first chunk by every query, and a later rank's block whole by
the rank's second chunk only; a step computes just the rows and columns its mask lets
through, so every step after the first is the same amount of work, which is what
balances the ring. Grouped-query attention sends the rank's key/value heads (fewer than
the query heads) and expands them only to compute; latent attention (MLA) sends every
head's up-projected key and value, whose widths differ. The math runs in float32 or
wider (as flash attention keeps its softmax statistics in float32) whatever the
activations' type, while keys, values and their gradients travel in the activations'
own type (bf16 under bf16 autocast, as Transformer Engine's buffers: the bytes the
simulator prices).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from executor.block_attention import block_backward, block_forward, compute_dtype, merge
from executor.inside_timing import RingTimer


@dataclass
class Ring:
    """A cp group seen from one rank: its neighbours' global ranks and every cp rank's
    sequence positions. ``sent``, when a list, records the elements of each message this
    rank sends (forward and backward), which is how tests hold the exchange to the
    simulator's; None (a run) records nothing, so a long run does not grow a list."""

    group: dist.ProcessGroup | None
    cp: int
    cp_index: int
    positions: list[torch.Tensor]  # positions[j]: the sequence positions cp rank j holds
    sent: list[int] | None = None
    timer: RingTimer | None = None  # times the waits and the attention (executor.inside_timing)

    def waiting(self) -> AbstractContextManager:
        """Around a wait for a block: what of the transfer the step's compute did not hide."""
        return self.timer.timed() if self.timer is not None else nullcontext()

    def computing(self) -> AbstractContextManager:
        """Around a step's attention over one block."""
        return self.timer.computing() if self.timer is not None else nullcontext()

    def peer(self, offset: int) -> int:
        """The global rank of the cp rank ``offset`` places along the ring."""
        return dist.get_global_rank(self.group, (self.cp_index + offset) % self.cp)

    def exchange(self, tensor: torch.Tensor, to: int, source: int) -> tuple[torch.Tensor, list]:
        """Post ``tensor``'s send to ring offset ``to`` and a receive of the same size from
        ring offset ``source``, as one batch (NCCL pairs them, so no rank waits on another's
        send); return the receive buffer and the works to wait on."""
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        if self.sent is not None:
            self.sent.append(tensor.numel())
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, self.peer(to), self.group),
                                        dist.P2POp(dist.irecv, received, self.peer(source), self.group)])
        return received, works

    def mask(self, owner: int, device: torch.device) -> torch.Tensor:
        """``queries x keys``: which of cp rank ``owner``'s keys each of this rank's queries sees."""
        mine, theirs = self.positions[self.cp_index].to(device), self.positions[owner].to(device)
        return mine.unsqueeze(1) >= theirs.unsqueeze(0)


def pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Keys and values as one flat message (their widths may differ: MLA)."""
    return torch.cat((k.reshape(-1), v.reshape(-1)))


def unpack(flat: torch.Tensor, k_shape: torch.Size, v_shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``pack``."""
    k, v = flat.split([math.prod(k_shape), math.prod(v_shape)])
    return k.view(k_shape), v.view(v_shape)


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's ``q`` (``batch x heads x S/cp x dim``) over the
    whole sequence, its keys and values (``batch x kv_heads x S/cp x dim``) passed round
    the ring (see the module); returns ``batch x heads x S/cp x v_dim``."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
        compute = compute_dtype(q.dtype)
        with torch.autocast(q.device.type, enabled=False):
            q_ = q.to(compute)
            groups, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
            out = q_.new_zeros((*q.shape[:3], v.shape[-1]))
            lse = q_.new_full(q.shape[:3], float("-inf"))
            block, owner = pack(k, v), ring.cp_index  # travels in the activations' own type
            for step in range(ring.cp):
                if step < ring.cp - 1:  # the next block travels while this one is computed
                    arriving, works = ring.exchange(block, to=1, source=-1)
                with ring.computing():
                    block_k, block_v = unpack(block.to(compute), k.shape, v.shape)
                    merge(out, lse, *block_forward(q_, block_k, block_v, ring.mask(owner, q.device), scale, groups))
                if step < ring.cp - 1:
                    with ring.waiting():
                        for work in works:
                            work.wait()
                    block, owner = arriving, (owner - 1) % ring.cp
        ctx.save_for_backward(q, block, out, lse)
        ctx.ring, ctx.shapes = ring, (k.shape, v.shape)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, out_grad: torch.Tensor):
        q, block, out, lse = ctx.saved_tensors
        ring, (k_shape, v_shape) = ctx.ring, ctx.shapes
        compute = out.dtype
        with torch.autocast(q.device.type, enabled=False):
            q_, grad = q.to(compute), out_grad.to(compute)
            groups, scale = q.shape[1] // k_shape[1], q.shape[-1] ** -0.5
            delta = (grad * out).sum(-1)  # rowsum(dO * O), flash attention's D
            dq = torch.zeros_like(q_)
            owner = (ring.cp_index + 1) % ring.cp  # the forward's last block
            size, wire = block.numel(), block.dtype  # gradients travel in the keys' type, as TE's
            block_grad = torch.zeros_like(block, dtype=compute)  # accumulated for the block held
            for step in range(ring.cp):
                if step == 0:  # the block only: nothing accumulated yet
                    message = block
                elif step == ring.cp - 1:  # the gradients only: they reach their owner
                    message = block_grad.to(wire)
                else:
                    message = torch.cat((block, block_grad.to(wire)))
                arriving, works = ring.exchange(message, to=-1, source=1)
                with ring.computing():
                    block_k, block_v = unpack(block.to(compute), k_shape, v_shape)
                    dk, dv = block_backward(q_, block_k, block_v, grad, delta, lse, ring.mask(owner, q.device), scale,
                                            groups, dq)
                    mine = pack(dk, dv)
                with ring.waiting():
                    for work in works:
                        work.wait()
                if step == 0:
                    block, block_grad = arriving, mine
                elif step == ring.cp - 1:
                    block_grad = arriving.to(compute) + mine
                else:
                    block, block_grad = arriving[:size], arriving[size:].to(compute) + mine
                owner = (owner + 1) % ring.cp
        dk, dv = unpack(block_grad.to(wire), k_shape, v_shape)
        return dq.to(q.dtype), dk, dv, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
    """``RingAttention`` (see the module): this rank's queries over the whole sequence."""
    return RingAttention.apply(q, k, v, ring)
