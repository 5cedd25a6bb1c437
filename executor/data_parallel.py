"""Data parallelism: each stage's gradients reduced across its dp replicas bucket by
bucket as the backward produces them (DDP's rule), and ZeRO-1/2's sharded optimizer.

Every replica runs the same pipeline on its own slice of the global batch and
accumulates its stages' gradients over its microbatches. A stage's parameters are packed
into DDP-style buckets (25 MiB by default, ``--bucket-mb``, in reverse parameter order:
the order backward produces their gradients). During a stage's *reducing* backward (its
last ``B``, or ``W`` when backward is split: the one that completes accumulation) a
post-accumulate-grad hook on every parameter marks it ready; once every parameter of a
bucket is ready, the bucket's collective is posted asynchronously on the dp group of the
mesh while the backward goes on with the layers below it, as DDP's reducer does. Buckets
are posted in index order (a ready bucket waits for the ones before it), so every
replica issues the same collectives in the same order. The step waits for them just
before the optimizer. This is the overlap rule the simulator charges
(``pipesim.sim.parallel``: a bucket starts as soon as it is full during the last
backward).

ZeRO (``--zero``, Rajbhandari et al. 2020; Megatron's distributed optimizer):

- ZeRO-1: each bucket is reduce-scattered instead of all-reduced; replica ``d`` keeps
  the ``d``-th shard of every bucket (buckets padded to a multiple of dp). The optimizer
  holds only the pieces of the parameters that fall in this replica's shards, so its
  state (AdamW's two moments) is ``1/dp`` of the model's; after it steps, the updated
  shards are all-gathered back into every replica's parameters, bucket by bucket.
- ZeRO-2: as ZeRO-1, but every backward of a stage (every microbatch's) reduce-scatters
  its buckets, and the full gradients are dropped as soon as their bucket is posted: a
  replica keeps only its shard of the gradient, summed over microbatches.
- With context parallelism the group is the stage's dp x cp ranks and with expert
  parallelism the routed experts' is their expert data-parallel group
  (``executor.expert_parallel``): ZeRO shards over every member of the group it reduces
  over (Megatron's distributed optimizer shards over the data-parallel group with cp),
  while the sum is still divided by dp, the number of replicas.

Why not torch's wrappers: on torch 2.13 ``DistributedDataParallel`` cannot wrap a
stage whose parameters are DTensors (after ``parallelize_module`` for tp, its
constructor fails with "aten.cat.default got mixed torch.Tensor and DTensor"). The
composable ``replicate`` (FSDP2-based) does accept a tp-split block on a dp sub-mesh on
gloo, but like DDP it reduces inside the backward call and waits for its buckets at that
call's end, so a stage's reduction could not overlap the rank's other stages, and its
per-forward hooks would have to be steered through every microbatch and the I/W split.
``ZeroRedundancyOptimizer`` assigns whole parameters to ranks (uneven shards) and
broadcasts them. The collectives here are the ones DDP and Megatron issue, on the
DTensors' local shards: a tp shard is reduced with the same shard of every other
replica, which is exactly the dp sub-mesh of the (dp, pp, tp) mesh.

The reduction's type (``--grad-reduce-dtype``) is the master gradients' type by default,
as DDP reduces in the gradients' own type; ``bfloat16`` halves the bytes on the wire
(Megatron-LM's ``--grad-reduce-in-bf16``); the average is written back in the master type.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from schedules.action import WEIGHT_GRAD_DONE_KINDS, Action

DEFAULT_BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb=25
# A flat tensor reduce-scattered into equal shards, and shards gathered into one:
# ``reduce_scatter_single``/``all_gather_single`` where torch has them (the pinned release
# does, and runs them on gloo), else ``reduce_scatter_tensor``/``all_gather_into_tensor``,
# which newer releases deprecate and older ones (2.11, say) have alone; NCCL runs either.
REDUCE_SCATTER_INTO = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALL_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# Trace kinds of the dp stream, named as the simulator names them (pipesim.sim.parallel).
ALL_REDUCE, REDUCE_SCATTER, PARAM_GATHER = "ALLREDUCE_DP", "REDUCE_SCATTER_DP", "ALLGATHER_PARAMS"

DpTiming = tuple[int, int, str, float, float]  # (stage, bucket, kind, start, end) in perf_counter seconds


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor (the tensor itself when it is a plain one)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def local_storage(tensor: torch.Tensor) -> torch.UntypedStorage:
    """The storage holding this process's part of ``tensor``. A DTensor's local part may be
    a functional collective's pending result (tp's sequence-parallel gathers leave one as
    an output's gradient), a wrapper with no storage of its own around the tensor it fills
    (``AsyncCollectiveTensor.elem``): that one's."""
    local = local_tensor(tensor)
    return getattr(local, "elem", local).untyped_storage()


def is_partial(tensor: torch.Tensor) -> bool:
    """Whether a DTensor holds partial sums (each tp rank one addend) on some mesh axis."""
    return any(placement.is_partial() for placement in getattr(tensor, "placements", ()))


def bucket_parameters(module: nn.Module, bucket_bytes: float,
                      keep: Callable[[nn.Parameter], bool] | None = None,
                      alone: Collection[int] = ()) -> list[list[nn.Parameter]]:
    """Parameters in reverse order (the order backward produces their gradients),
    packed into buckets of at most ``bucket_bytes`` (a larger parameter gets its own);
    only those ``keep`` accepts, when given; those whose ids are in ``alone`` each in a
    bucket of its own (a tied embedding's copies: their ZeRO shards then cover the same
    rows at both ends, ``executor.tied_embeddings``)."""
    buckets: list[list[nn.Parameter]] = []
    size = 0.0
    for param in reversed([p for p in module.parameters() if p.requires_grad and (keep is None or keep(p))]):
        nbytes = local_tensor(param.detach()).numel() * param.element_size()
        if not buckets or size + nbytes > bucket_bytes or id(param) in alone:
            buckets.append([])
            size = 0.0
        buckets[-1].append(param)
        size = math.inf if id(param) in alone else size + nbytes
    return buckets


@dataclass(eq=False)
class Reduction:
    """One bucket's collective in flight: what travels (``sent``), where the result
    lands (``received``: the same tensor for an all-reduce), the work handle, and
    ``times = [start, end]``."""

    kind: str
    sent: torch.Tensor
    received: torch.Tensor
    grads: list[torch.Tensor]
    work: dist.Work
    times: list[float]


@dataclass(eq=False)
class Bucket:
    """A stage's bucket: its parameters (reverse order), their offsets in the flat
    bucket, and under ZeRO this replica's shard of it."""

    stage: int
    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    padded: int  # elements, a multiple of dp
    ready: set[int] = field(default_factory=set)  # ids of parameters accumulated in this backward
    posted: bool = False
    in_flight: Reduction | None = None
    shard_grad: torch.Tensor | None = None  # ZeRO: the sum of this replica's reduced shards

    @property
    def numel(self) -> int:
        return self.offsets[-1]


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that falls in this replica's shard of a bucket: the
    optimizer steps ``tensor`` (a view into the parameter), whose gradient is
    ``shard_grad[start:end]`` (ZeRO-2) or the same view into the parameter's ``.grad``
    (ZeRO-1, whose full gradients stay)."""

    bucket: Bucket
    param: nn.Parameter
    tensor: torch.Tensor
    start: int  # in the shard
    end: int
    offset: int  # where the piece starts in the parameter (flattened)


class GradientAverager:
    """Reduces each stage's gradients across the dp group bucket by bucket during the
    stage's reducing backward(s), and under ZeRO shards the optimizer over the replicas.

    The runtime calls ``before_action`` and ``after_action`` around every action; the
    worker calls ``finish`` before the optimizer and, under ZeRO, ``gather_parameters``
    after it."""

    def __init__(self, stages: dict[int, nn.Module], program: tuple[Action, ...], group: dist.ProcessGroup,
                 replicas: int, bucket_bytes: float = DEFAULT_BUCKET_BYTES,
                 reduce_dtype: torch.dtype | None = None, zero: int = 0,
                 keep: Callable[[nn.Parameter], bool] | None = None, alone: Collection[int] = ()) -> None:
        # ``keep``: the parameters this averager reduces (expert parallelism reduces the
        # experts' over another group, executor.expert_parallel); None: all of them.
        # ``replicas`` (dp) divides the summed gradients; ZeRO shards over every member of
        # ``group`` (dp, or with cp the dp x cp ranks, or an expert data-parallel group),
        # as Megatron's distributed optimizer shards over its data-parallel group with cp.
        self.group = group
        self.replicas = replicas
        self.shards = dist.get_world_size(group) if group is not None else 1
        self.shard_index = dist.get_rank(group) if group is not None else 0
        self.reduce_dtype = reduce_dtype  # None: the gradients' own type
        self.zero = zero
        backwards = [action for action in program if action.kind in WEIGHT_GRAD_DONE_KINDS]
        if zero >= 2:  # every backward reduces its microbatch's gradient
            self.reducing = set(backwards)
        else:  # the last backward of each stage completes its accumulation
            self.reducing = set({action.stage: action for action in backwards}.values())
        self.buckets = {stage: [self.make_bucket(stage, index, params) for index, params in
                                enumerate(bucket_parameters(module, bucket_bytes, keep, alone))]
                        for stage, module in stages.items()}
        self.active: dict[int, list[Bucket]] = {}  # stage -> its buckets, during a reducing backward
        self.late: list[str] = []  # gradients that arrived after their bucket was posted
        self.timings: list[DpTiming] = []
        self.unwatched: list[tuple[dist.Work, list[float]]] = []  # collectives whose end is polled
        self.pieces = [piece for buckets in self.buckets.values() for bucket in buckets
                       for piece in self.shard_pieces(bucket)] if zero else []
        self.handles = [param.register_post_accumulate_grad_hook(self.hook(stage, bucket))
                        for stage, buckets in self.buckets.items() for bucket in buckets for param in bucket.params]

    def make_bucket(self, stage: int, index: int, params: list[nn.Parameter]) -> Bucket:
        offsets = [0]
        for param in params:
            offsets.append(offsets[-1] + local_tensor(param.detach()).numel())
        padded = -(-offsets[-1] // self.shards) * self.shards
        return Bucket(stage, index, params, offsets, padded)

    # -- when a bucket is posted ------------------------------------------------------

    def before_action(self, action: Action) -> None:
        """Runtime hook: arm a stage's buckets before its reducing backward."""
        if action in self.reducing:
            for bucket in self.buckets[action.stage]:
                bucket.ready.clear()
                bucket.posted = False
            self.active[action.stage] = self.buckets[action.stage]

    def hook(self, stage: int, bucket: Bucket) -> Callable[[nn.Parameter], None]:
        def ready(param: nn.Parameter) -> None:
            if stage not in self.active:
                return
            if bucket.posted:  # a second accumulation in one backward: the bucket left without it
                self.late.append(f"stage {stage} bucket {bucket.index}")
                return
            bucket.ready.add(id(param))
            self.post_ready(stage)

        return ready

    def post_ready(self, stage: int) -> None:
        """Post the stage's buckets that are complete, in index order."""
        for bucket in self.active[stage]:
            if bucket.posted:
                continue
            if len(bucket.ready) < len(bucket.params):
                return
            self.post(bucket)

    def after_action(self, action: Action) -> None:
        """Runtime hook: after a reducing backward, post what is left (parameters this
        backward gave no gradient: DDP reduces zeros for them)."""
        if self.active.pop(action.stage, None) is not None and action in self.reducing:
            for bucket in self.buckets[action.stage]:
                if not bucket.posted:
                    self.post(bucket)
        if self.unwatched:
            self.poll()

    # -- the collectives ----------------------------------------------------------------

    def post(self, bucket: Bucket) -> None:
        """Post one asynchronous collective for ``bucket``'s gradients: an all-reduce, or
        under ZeRO a reduce-scatter into this replica's shard."""
        bucket.posted = True
        if bucket.in_flight is not None:  # ZeRO-2: the previous microbatch's shard first
            self.complete(bucket)
        grads = []
        for param in bucket.params:
            if param.grad is None:  # unused in this step: contribute zeros like DDP
                param.grad = torch.zeros_like(param)
            elif self.zero and is_partial(param.grad):
                # Sequence parallelism leaves a norm weight's gradient a partial sum over
                # tp; DTensor's optimizer would sum it when stepping, but ZeRO steps plain
                # shards, so it is summed over tp here, as the parameter is laid out.
                param.grad = param.grad.redistribute(param.grad.device_mesh, param.placements)
            grads.append(local_tensor(param.grad))
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        if self.reduce_dtype is not None:
            flat = flat.to(self.reduce_dtype)
        times = [time.perf_counter()]
        if self.zero:
            flat = torch.nn.functional.pad(flat, (0, bucket.padded - bucket.numel))
            shard = flat.new_empty(bucket.padded // self.shards)
            work = REDUCE_SCATTER_INTO(shard, flat, group=self.group, async_op=True)
            reduction = Reduction(REDUCE_SCATTER, flat, shard, grads, work, times)
        else:
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            reduction = Reduction(ALL_REDUCE, flat, flat, grads, work, times)
        self.time_completion(work, times)
        bucket.in_flight = reduction
        if self.zero >= 2:  # the replica keeps only its shard of the gradient
            for param in bucket.params:
                param.grad = None

    def time_completion(self, work: dist.Work, times: list[float]) -> None:
        """Append the collective's end to ``times`` when it completes: a callback on its
        future where the backend has one (gloo's all-reduce), else the first time the
        rank sees it completed (``poll``, after each action; gloo's reduce-scatter)."""
        try:
            work.get_future().add_done_callback(lambda _future: times.append(time.perf_counter()))
        except RuntimeError:  # "Work::getFuture not implemented"
            self.unwatched.append((work, times))

    def poll(self) -> None:
        """Stamp the end of collectives without a completion callback that have finished."""
        still = []
        for work, times in self.unwatched:
            if work.is_completed():
                if len(times) < 2:
                    times.append(time.perf_counter())
            else:
                still.append((work, times))
        self.unwatched = still

    def complete(self, bucket: Bucket) -> None:
        """Wait for ``bucket``'s collective and fold its result in: the average written
        back into the gradients, or (ZeRO) the shard added to this replica's sum."""
        reduction, bucket.in_flight = bucket.in_flight, None
        reduction.work.wait()
        self.poll()
        if len(reduction.times) < 2:
            reduction.times.append(time.perf_counter())
        self.timings.append((bucket.stage, bucket.index, reduction.kind, *reduction.times[:2]))
        dtype = reduction.grads[0].dtype  # the master type, whatever type the sum travelled in
        with torch.no_grad():
            if self.zero:
                shard = reduction.received.to(dtype)
                bucket.shard_grad = shard if bucket.shard_grad is None else bucket.shard_grad.add_(shard)
                return
            flat = reduction.received.to(dtype).div_(self.replicas)
            for grad, start, end in zip(reduction.grads, bucket.offsets[:-1], bucket.offsets[1:], strict=True):
                grad.copy_(flat[start:end].view_as(grad))

    def finish(self) -> list[DpTiming]:
        """Wait for every reduction of the step and leave the averaged gradients where the
        optimizer reads them (the parameters' ``.grad``, or under ZeRO the pieces'); return
        ``(stage, bucket, kind, start, end)`` per collective."""
        if self.late:
            raise RuntimeError(f"a gradient was accumulated after its dp bucket was reduced ({self.late[0]}): "
                               "a parameter received two gradients in one backward")
        for buckets in self.buckets.values():
            for bucket in buckets:
                if bucket.in_flight is None and (bucket.shard_grad is None if self.zero else not bucket.posted):
                    self.post(bucket)  # a stage with no backward in this program: still reduce it
                if bucket.in_flight is not None:
                    self.complete(bucket)
                bucket.posted = False
        if self.zero:
            for buckets in self.buckets.values():
                for bucket in buckets:
                    bucket.shard_grad.div_(self.replicas)
            for piece in self.pieces:
                shard = piece.bucket.shard_grad[piece.start:piece.end]
                if self.zero == 1:  # the full gradient is kept anyway: the reduced shard goes into it,
                    # as in Megatron's one gradient buffer, rather than beside it
                    grad = local_tensor(piece.param.grad).view(-1)[piece.offset:piece.offset + len(shard)]
                    shard = grad.copy_(shard)
                piece.tensor.grad = shard
            if self.zero == 1:
                for buckets in self.buckets.values():
                    for bucket in buckets:
                        bucket.shard_grad = None
        timings, self.timings = self.timings, []
        return timings

    # -- ZeRO: the sharded optimizer -------------------------------------------------------

    def shard_pieces(self, bucket: Bucket) -> list[ShardPiece]:
        """The pieces of ``bucket``'s parameters that fall in this replica's shard."""
        size = bucket.padded // self.shards
        low, high = self.shard_index * size, (self.shard_index + 1) * size
        pieces = []
        for param, start, end in zip(bucket.params, bucket.offsets[:-1], bucket.offsets[1:], strict=True):
            first, last = max(start, low), min(end, high)
            if first < last:
                view = local_tensor(param.detach()).view(-1)[first - start:last - start]
                pieces.append(ShardPiece(bucket, param, view, first - low, last - low, first - start))
        return pieces

    def optimizer_tensors(self) -> tuple[list[torch.Tensor], set[int]]:
        """Under ZeRO, what the optimizer steps (this replica's pieces) and the ids of
        those cut from matrices (weight decay applies to matrices only)."""
        tensors = [piece.tensor for piece in self.pieces]
        return tensors, {id(piece.tensor) for piece in self.pieces if piece.param.ndim >= 2}

    def stepped_gradients(self) -> list[tuple[torch.Tensor, nn.Parameter, int]]:
        """After ``finish``: each gradient the optimizer steps, its parameter, and how many
        members of the group hold that same tensor (every one without ZeRO, which
        averages into each; one with ZeRO, each member stepping its own shard)."""
        if self.zero:
            return [(piece.tensor.grad, piece.param, 1) for piece in self.pieces if piece.tensor.grad is not None]
        return [(local_tensor(param.grad), param, self.shards) for buckets in self.buckets.values()
                for bucket in buckets for param in bucket.params if param.grad is not None]

    def shard_grads(self) -> list[torch.Tensor]:
        """Under ZeRO, this replica's averaged gradient shards (what the loss scaler checks)."""
        return [piece.tensor.grad for piece in self.pieces if piece.tensor.grad is not None]

    def held_shards(self) -> list[torch.Tensor]:
        """The gradient shards held beside the parameters' ``.grad`` (ZeRO-2's, and
        ZeRO-1's until they are written into the full gradients)."""
        return [bucket.shard_grad for buckets in self.buckets.values() for bucket in buckets
                if bucket.shard_grad is not None]

    def gather_parameters(self) -> list[DpTiming]:
        """Under ZeRO, after the optimizer stepped this replica's pieces: all-gather every
        bucket's shards back into every replica's parameters; return the gathers' times."""
        size_of = {id(bucket): bucket.padded // self.shards for buckets in self.buckets.values()
                   for bucket in buckets}
        posted = []
        for buckets in self.buckets.values():
            for bucket in buckets:
                first = local_tensor(bucket.params[0].detach())
                shard = first.new_zeros(size_of[id(bucket)])
                for piece in self.pieces:
                    if piece.bucket is bucket:
                        shard[piece.start:piece.end] = piece.tensor
                whole = first.new_empty(bucket.padded)
                times = [time.perf_counter()]
                work = ALL_GATHER_INTO(whole, shard, group=self.group, async_op=True)
                self.time_completion(work, times)
                posted.append((bucket, whole, times, work))
        timings = []
        with torch.no_grad():
            for bucket, whole, times, work in posted:
                work.wait()
                self.poll()
                if len(times) < 2:
                    times.append(time.perf_counter())
                timings.append((bucket.stage, bucket.index, PARAM_GATHER, *times[:2]))
                for param, low, high in zip(bucket.params, bucket.offsets[:-1], bucket.offsets[1:], strict=True):
                    view = local_tensor(param.detach())
                    view.copy_(whole[low:high].view_as(view))
        return timings

    def full_gradients(self) -> None:
        """Under ZeRO, all-gather the averaged gradient shards into every parameter's
        ``.grad`` (a tp-split parameter's as a DTensor of its local shards): what a test
        compares with the reference."""
        for buckets in self.buckets.values():
            for bucket in buckets:
                first = local_tensor(bucket.params[0].detach())
                shard = first.new_zeros(bucket.padded // self.shards)
                for piece in self.pieces:
                    if piece.bucket is bucket:
                        shard[piece.start:piece.end] = piece.tensor.grad
                whole = first.new_empty(bucket.padded)
                ALL_GATHER_INTO(whole, shard, group=self.group)
                for param, low, high in zip(bucket.params, bucket.offsets[:-1], bucket.offsets[1:], strict=True):
                    local = local_tensor(param.detach())
                    grad = whole[low:high].view_as(local).clone()
                    if hasattr(param, "device_mesh"):  # a DTensor: the same layout as the parameter
                        from torch.distributed.tensor import DTensor  # noqa: PLC0415

                        grad = DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False)
                    param.grad = grad

    def zero_grad(self) -> None:
        """Drop the step's gradient shards (the parameters' own are dropped by the caller)."""
        for buckets in self.buckets.values():
            for bucket in buckets:
                bucket.shard_grad = None
        for piece in self.pieces:
            piece.tensor.grad = None
