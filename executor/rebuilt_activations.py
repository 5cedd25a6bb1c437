"""Activations dropped after the forward and rebuilt just before the backward reads them:
DeepSeek-V3's recomputation of every RMSNorm and of latent attention's up-projections
(report, section 3.2.3; ``--recompute norm-mla-up``).

Why not ``torch.utils.checkpoint``: what a norm's output costs is not kept by the norm but
by the GEMM that reads it (a linear saves its input for its weight gradient).
Checkpointing the norm alone leaves that copy in place; checkpointing the norm together
with its reader re-runs the reader's GEMM in the backward, which DeepSeek does not pay
for and the simulator does not charge. Megatron-Core's ``CheckpointWithoutOutput`` shows
the way, and this module does the same: the tensors stay where they are, in autograd's
graph, but once the reader's forward has saved them their storages are emptied
(``untyped_storage().resize_(0)``: the bytes go back to the allocator, the tensor objects
and autograd's references stay). A hook on the reader's output, which autograd calls
when that output's gradient is ready, i.e. just before the reader's backward, re-runs
the producing code without autograd and copies the bytes back into the same storages.

Because the graph is autograd's own, the split backward (``I`` then ``W``,
``executor.split_backward``), FSDP and tensor parallelism run it as any other graph: the
storages are refilled in ``I`` and read again by ``W``. The bytes are copied storage to
storage, not through the tensors, so no version counter moves and autograd's in-place
check stays quiet. A storage read before its refill fails loudly (torch refuses a tensor
whose storage is smaller than it), never silently.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from executor.data_parallel import local_storage

Rebuild = Callable[[], Sequence[torch.Tensor]]


class DroppedUntilBackward:
    """The storages of some tensors, emptied now and refilled once from ``rebuild()``,
    which returns the same tensors (same shapes and layouts), in the same order."""

    def __init__(self, tensors: Sequence[torch.Tensor], rebuild: Rebuild, what: str) -> None:
        self.rebuild = rebuild
        self.what = what
        self.storages = [local_storage(tensor) for tensor in tensors]
        self.sizes = [storage.nbytes() for storage in self.storages]
        self.refilled = False
        for storage in self.storages:
            storage.resize_(0)  # a second view of one storage finds it empty already

    def refill(self, _grad: torch.Tensor | None = None) -> None:
        """Re-run the producing code and copy its bytes back (a tensor hook: the
        gradient passes through unchanged)."""
        if self.refilled:  # the split backward's W, or a second output of the reader
            return
        with torch.no_grad():
            fresh = list(self.rebuild())
        if len(fresh) != len(self.storages):
            raise RuntimeError(f"{self.what}: the rebuild returned {len(fresh)} tensors, the forward dropped "
                               f"{len(self.storages)}")
        for index, (storage, size, tensor) in enumerate(zip(self.storages, self.sizes, fresh, strict=True)):
            source = local_storage(tensor)
            if source.nbytes() != size:
                raise RuntimeError(f"{self.what}: tensor {index} rebuilt to {source.nbytes()} bytes, the forward "
                                   f"made {size}")
            if storage.nbytes() == 0:  # a view of a storage already refilled is skipped
                storage.resize_(size)
                storage.copy_(source)
        self.refilled = True


def drop_until_backward(reader_output: torch.Tensor, tensors: Sequence[torch.Tensor], rebuild: Rebuild,
                        what: str) -> None:
    """Empty ``tensors``' storages now (their reader has run and saved them); refill
    them from ``rebuild()`` when the gradient of ``reader_output`` arrives, before the
    reader's backward. Nothing happens outside a graph (no gradient will come)."""
    if not (torch.is_grad_enabled() and reader_output.requires_grad):
        return
    dropped = DroppedUntilBackward(tensors, rebuild, what)
    reader_output.register_hook(dropped.refill)


def norm_read_by(norm: torch.nn.Module, reader: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 recompute: bool) -> torch.Tensor:
    """``reader(norm(x))``; with ``recompute`` the norm's output is not kept for the
    reader's backward but computed again from ``x`` (which the norm keeps anyway). Not
    where the output is a sequence shard (tensor parallelism's sequence parallelism): the
    reader gathers it first and keeps the gathered copy, the shard is kept by no one, and
    dropping it would only rebuild it in the backward for nothing."""
    normed = norm(x)
    out = reader(normed)
    if recompute and not sequence_sharded(normed):
        drop_until_backward(out, (normed,), lambda: (norm(x),), f"{type(norm).__name__} output")
    return out


def sequence_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor sharded over its mesh (sequence parallelism's norm
    outputs are, on the sequence dimension)."""
    return any(placement.is_shard() for placement in getattr(tensor, "placements", ()))
