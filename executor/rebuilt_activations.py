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
from torch.distributed.tensor import Replicate

from executor.data_parallel import local_storage

Rebuild = Callable[[], Sequence[torch.Tensor]]


class DroppedUntilBackward:
    """The storages of some tensors, emptied now and refilled once from ``rebuild()``,
    which returns the same tensors (same shapes and layouts), in the same order."""

    def __init__(self, tensors: Sequence[torch.Tensor], rebuild: Rebuild | None, what: str) -> None:
        self.rebuild = rebuild
        self.what = what
        # the rebuild runs under the forward's autocast (the backward runs outside it): a linear
        # rebuilt without it would make float32 where the forward made bf16
        device = tensors[0].device.type
        self.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        self.storages = [local_storage(tensor) for tensor in tensors]
        self.sizes = [storage.nbytes() for storage in self.storages]
        self.refilled = False
        for storage in self.storages:
            storage.resize_(0)  # a second view of one storage finds it empty already

    def refill(self, _grad: torch.Tensor | None = None) -> None:
        """Re-run the producing code and copy its bytes back (a tensor hook: the
        gradient passes through unchanged)."""
        self.refill_with(self.rebuild)

    def refill_with(self, rebuild: Rebuild) -> None:
        """Copy back the bytes of what ``rebuild()`` makes, the first time only (a rebuild
        that needs what the backward hands it: ``read_gathered_shard``)."""
        if self.refilled:  # the split backward's W, or a second output of the reader
            return
        device, dtype, enabled = self.autocast
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            fresh = list(rebuild())
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


def drop_until_backward(reader_outputs: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], rebuild: Rebuild,
                        what: str) -> None:
    """Empty ``tensors``' storages now (their readers have run and saved them); refill
    them from ``rebuild()`` when the gradient of the first of ``reader_outputs`` to get
    one arrives, before that reader's backward. Nothing happens outside a graph (no
    gradient will come)."""
    if not (torch.is_grad_enabled() and all(output.requires_grad for output in reader_outputs)):
        return
    dropped = DroppedUntilBackward(tensors, rebuild, what)
    for output in reader_outputs:
        output.register_hook(dropped.refill)


def norm_read_by(norm: torch.nn.Module, reader: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 recompute: bool, regather: bool = False) -> torch.Tensor:
    """``reader(norm(x))``, kept and rebuilt as ``norm_read_by_each`` says."""
    (out,) = norm_read_by_each(norm, (reader,), x, recompute, regather)
    return out


def norm_read_by_each(norm: torch.nn.Module, readers: Sequence[Callable[[torch.Tensor], torch.Tensor]],
                      x: torch.Tensor, recompute: bool, regather: bool = False) -> list[torch.Tensor]:
    """Each reader of ``norm(x)`` on it (Falcon-7B's one norm a layer has two); with
    ``recompute`` the norm's output is not kept for the readers' backward but computed
    again from ``x`` (which the norm keeps anyway) before the first of them. Where the
    output is a sequence shard (tensor parallelism's sequence parallelism) each reader
    gathers it first and its GEMMs keep the gathered copy: with ``regather`` that copy is
    dropped and gathered again before the reader's backward (``read_gathered_shard``),
    the shard (one cast the readers share) or, recomputing, ``x`` kept instead; without
    it the gathered copy stays, and dropping the shard would only rebuild it in the
    backward for nothing."""
    normed = norm(x)
    if sequence_sharded(normed):
        if not regather:
            return [reader(normed) for reader in readers]
        shard = cast_for_gather(normed)
        rebuilt_from = (norm, x) if recompute else None
        return [read_gathered_shard(reader, shard, rebuilt_from) for reader in readers]
    outs = [reader(normed) for reader in readers]
    if recompute:
        drop_until_backward(outs, (normed,), lambda: (norm(x),), f"{type(norm).__name__} output")
    return outs


def sequence_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor sharded over its mesh (sequence parallelism's norm
    outputs are, on the sequence dimension)."""
    return any(placement.is_shard() for placement in getattr(tensor, "placements", ()))


def read_gathered_shard(reader: torch.nn.Module, shard: torch.Tensor,
                        recomputed_from: tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor] | None = None
                        ) -> torch.Tensor:
    """``reader(shard)`` (``shard`` in the type it is gathered in, ``cast_for_gather``),
    where ``reader``'s own input hook (tensor parallelism's
    ``ColwiseParallel`` or ``PrepareModuleInput``) all-gathers the sequence shard before
    its column-parallel GEMMs, which save the gathered copy for their weight gradients.
    As Megatron-Core's ``ColumnParallelLinear`` runs sequence parallelism (and Korthikanti
    et al. 2022 count it, section 4.2.2): the gathered copy's storage is emptied once the
    reader has run, the shard is saved instead, and when the reader's output gradient
    arrives, just before the reader's backward, the shard is all-gathered again into the
    same storage: one more all-gather a sublayer in each backward, the sequence shard
    kept between the forward and the backward instead of the whole sequence. With
    ``recomputed_from`` (``(norm, x)``: the shard is ``norm(x)``, ``--recompute
    norm-mla-up``) not even the shard is kept: ``x`` is (the norm keeps it anyway) and the
    backward runs the norm again. A split backward's ``I`` refills the copy and ``W``
    reads it, as Megatron's deferred weight gradients read the gathered input.

    Under autocast the shard is cast to the autocast type before the gather (by the
    caller, ``norm_read_by_each``), as Megatron
    gathers its 16-bit activations: the GEMMs' own casts are then no-ops, so they save the
    one gathered copy, which is dropped (cast after the gather, each linear would keep its
    own cast, whole). A mixture of experts takes the 16-bit tokens too (its router, its
    experts' slices and its shared expert read them; its combine still sums in float32,
    ``executor.architectures.moe.combine_dtype``). Outside a graph, or where the reader
    did not gather, nothing is dropped."""
    dtype = shard.dtype
    gathered: list[torch.Tensor] = []
    handle = reader.register_forward_pre_hook(lambda _module, args: gathered.append(args[0]))
    try:
        out = reader(shard)
    finally:
        handle.remove()
    if not (torch.is_grad_enabled() and out.requires_grad) or sequence_sharded(gathered[0]):
        return out
    kept = shard if recomputed_from is None else recomputed_from[1]
    dropped = DroppedUntilBackward((gathered[0],), None, f"{type(reader).__name__}'s gathered input")

    def refill(saved: torch.Tensor) -> None:  # ``kept`` as the backward unpacked it
        def gathered_again() -> tuple[torch.Tensor]:
            again = saved if recomputed_from is None else recomputed_from[0](saved).to(dtype)
            return (gather_sequence(again),)

        dropped.refill_with(gathered_again)

    return RegatherBeforeBackward.apply(out, kept, refill)


def cast_for_gather(shard: torch.Tensor) -> torch.Tensor:
    """``shard`` as its readers gather it: under autocast in the autocast type, outside it
    as it is. One cast for readers that share a shard (Falcon-7B's one norm a layer), so
    the shard is kept once."""
    device = shard.device.type
    if not torch.is_autocast_enabled(device):
        return shard
    return shard.to(torch.get_autocast_dtype(device))


def gather_sequence(shard: torch.Tensor) -> torch.Tensor:
    """The whole of a sequence-sharded DTensor on every rank of its mesh (the all-gather
    the reader's input hook ran in the forward)."""
    return shard.redistribute(shard.device_mesh, [Replicate()] * shard.device_mesh.ndim)


class RegatherBeforeBackward(torch.autograd.Function):
    """Identity on a reader's output that saves ``kept`` for the backward (so it lives
    with the graph, and the executor's memory count sees it) and, when the output's
    gradient arrives, hands it to ``refill`` before the gradient flows on into the
    reader."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, kept: torch.Tensor,
                refill: Callable[[torch.Tensor], None]) -> torch.Tensor:
        ctx.refill = refill
        ctx.save_for_backward(kept)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (kept,) = ctx.saved_tensors
        ctx.refill(kept)
        return grad, None, None
