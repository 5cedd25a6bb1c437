"""Measured memory per rank, beside the time: what the simulator predicts, checked.

On a GPU the caching allocator knows: ``torch.cuda.max_memory_allocated`` over the step
(its peak statistic is reset when the step starts). On a CPU nothing counts allocations,
so the executor counts the tensors it is responsible for, by kind, as the simulator's
memory model splits them (``pipesim.sim.memory``):

- ``params``: the stages' parameters (this process's shards of tp-split ones);
- ``grads``: their ``.grad`` tensors, plus under ZeRO the reduced gradient shards;
- ``optimizer``: every tensor in the optimizer's state (AdamW's two moments: under ZeRO
  only this replica's shard);
- ``activations``: what each microbatch's forward saved for its backward, counted by
  a ``saved_tensors_hooks`` pack hook during ``F`` (each storage once, at the size it
  holds when the parts are added up: FSDP frees a gathered weight after the forward;
  parameters excluded: a linear saves its weight, which is already counted), and the
  outputs per-op recompute keeps in its own store (``executor.per_op_recompute``), held
  from the microbatch's ``F`` until its last backward (``B``, or ``W`` when split) ends;
- ``buffers``: the activations and gradients waiting to be sent or used (the runtime's
  outbox and inbox);
- between a split backward's ``I`` and its ``W``, the gradients ``I`` found for the
  outputs of the stage's parameter-owning modules, which ``W`` multiplies by their
  inputs (``executor.split_backward``): counted with the activations, as the
  simulator's memory model grows the microbatch's stash at ``I`` by them.

They are added up after every action and the peak is kept (with, apart, the most
activations held at once: the number the schedule decides, GPipe's m microbatches on
the first rank against 1F1B's p, and ``static``: parameters, gradients and optimizer
state once the optimizer has stepped, what ZeRO's table predicts): a peak at action boundaries,
not inside an action (a backward's transient gradients are not seen), so it is a lower
bound of what the process allocates, and the part the schedule decides.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from executor.data_parallel import local_storage, local_tensor
from executor.per_op_recompute import collecting_kept, kept_tensors
from executor.routed_rows import ROUTED_ROWS
from schedules.action import WEIGHT_GRAD_DONE_KINDS, Action, ActionKind

FIELDS = ("peak", "params", "grads", "optimizer", "activations", "buffers", "activations_peak", "static",
          "unsharded_params")


def tensor_bytes(tensor: torch.Tensor | None) -> int:
    """Bytes of this process's part of ``tensor`` (a DTensor's local shard)."""
    if tensor is None:
        return 0
    local = local_tensor(tensor)
    return local.numel() * local.element_size()


def held_bytes(kept: torch.UntypedStorage | int) -> int:
    """Bytes a saved storage holds now (0 once FSDP has freed a gathered weight)."""
    return kept if isinstance(kept, int) else kept.nbytes()


def storage_key(tensor: torch.Tensor) -> int:
    """What tells two tensors on one storage apart from two on their own: the address of
    the storage of this process's part (``local_storage``)."""
    return local_storage(tensor).data_ptr()


@dataclass
class MemoryPeak:
    """The step's peak (bytes) and what it was made of when it was reached."""

    peak: float = 0.0
    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0
    activations_peak: float = 0.0  # the most activations held at once, whenever that was
    static: float = 0.0  # params + grads + optimizer state at the step's end, after the optimizer
    unsharded_params: float = 0.0  # this rank's parameter bytes before ZeRO-3 shards them over dp

    def as_list(self) -> list[float]:
        return [getattr(self, name) for name in FIELDS]


class MemoryTracker:
    """Counts the tensors a rank holds after each action (CPU), or reads the CUDA
    allocator's peak (GPU). The runtime calls ``before_action`` and ``after_action``."""

    def __init__(self, params: list[nn.Parameter], device: torch.device) -> None:
        self.params = params
        self.cuda = device.type == "cuda"
        self.device = device
        self.param_storages = {storage_key(p) for p in params}
        self.param_bytes = sum(tensor_bytes(p) for p in params)
        self.unsharded_params = self.param_bytes  # set before ZeRO-3 shards the stages
        self.optimizer: torch.optim.Optimizer | None = None
        self.extra_grads = lambda: []  # ZeRO's gradient shards
        self.buffers = lambda: []  # the runtime's outbox and inbox tensors
        self.weight_grad_inputs = lambda: []  # the output gradients split backwards hold from I to W
        # (stage, microbatch) -> storage key -> the storage (or, unreachable, its bytes)
        self.saved: dict[tuple[int, int], dict[int, torch.UntypedStorage | int]] = {}
        self.recording: tuple[int, int] | None = None
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)
        self.last = MemoryPeak()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count what autograd saves; hand it back detached (the same storage). Why not
        the tensor itself: a node that saves its own output would then hold that output's
        Python object, whose ``grad_fn`` is the node, a cycle neither Python's collector
        nor autograd breaks once the graph is retained (a split backward's ``I`` and ``W``
        run with ``retain_graph``): every zbv or dualpipev microbatch's activations
        stayed allocated for the rest of the run, 29 MiB more each step on a small gpt.
        Autograd gives an unpacked output its ``grad_fn`` back itself."""
        if self.recording is not None and isinstance(tensor, torch.Tensor):
            try:
                key = storage_key(tensor)
            except RuntimeError:
                # a tensor whose storage Python cannot reach (an empty selection saved by
                # autograd, e.g. the rows of an expert no token chose): counted by its size
                self.saved[self.recording][id(tensor)] = tensor_bytes(tensor)
                return tensor.detach()
            if key not in self.param_storages:
                # the storage, not its size now: FSDP (ZeRO-3) frees a gathered weight's
                # storage after the forward, and a freed storage holds nothing. Kept by the
                # storage's own identity, not its address: a storage emptied after the
                # forward (--recompute norm-mla-up) gives its address back, a later tensor
                # there is another storage, and the emptied one refilled in I counts until W
                storage = local_storage(tensor)
                self.saved[self.recording][storage._cdata] = storage
            return tensor.detach()
        return tensor

    def start_step(self) -> None:
        self.saved = {}
        ROUTED_ROWS.reset()
        self.last = MemoryPeak()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def before_action(self, action: Action) -> None:
        """Before an ``F``: count what its autograd graph saves."""
        if action.kind == ActionKind.F and not self.cuda:
            self.recording = (action.stage, action.microbatch)
            self.saved[self.recording] = {}
            ROUTED_ROWS.open(action.stage, action.microbatch)
            self.hooks.__enter__()
            self.kept_stores = []
            self.collecting = collecting_kept(self.kept_stores.append)
            self.collecting.__enter__()

    def after_action(self, action: Action) -> None:
        """After an action: stop counting (``F``), release a microbatch whose last
        backward ran, and add up what the rank holds now."""
        if self.cuda or not action.is_compute:
            return
        if self.recording is not None:
            self.hooks.__exit__(None, None, None)
            self.collecting.__exit__(None, None, None)
            ROUTED_ROWS.close()
            for tensor in (kept for store in self.kept_stores for kept in kept_tensors(store)):
                self.pack(tensor)  # what per-op recompute keeps outside autograd's hooks
            self.recording = None
        if action.kind in WEIGHT_GRAD_DONE_KINDS:
            self.saved.pop((action.stage, action.microbatch), None)
        self.observe()

    def held_now(self) -> MemoryPeak:
        """The tracked tensors now, by kind (``peak``: their total)."""
        grads = sum(tensor_bytes(p.grad) for p in self.params) + sum(map(tensor_bytes, self.extra_grads()))
        optimizer = self.optimizer_bytes()
        activations = sum(map(held_bytes, (kept for stored in self.saved.values() for kept in stored.values())))
        activations += sum(map(tensor_bytes, {storage_key(grad): grad for grad in self.weight_grad_inputs()}.values()))
        buffers = sum(map(tensor_bytes, self.buffers()))
        total = self.param_bytes + grads + optimizer + activations + buffers
        return MemoryPeak(total, self.param_bytes, grads, optimizer, activations, buffers)

    def observe(self) -> None:
        """Add up the tracked tensors now; keep the largest total of the step."""
        now = self.held_now()
        most = max(self.last.activations_peak, now.activations)
        if now.peak > self.last.peak:
            self.last = now
        self.last.activations_peak = most

    def optimizer_bytes(self) -> int:
        """Every tensor of the optimizer's state (not its scalar step counters)."""
        states: Iterable[dict] = self.optimizer.state.values() if self.optimizer is not None else ()
        return sum(tensor_bytes(value) for state in states for value in state.values()
                   if isinstance(value, torch.Tensor) and value.dim() > 0)

    def finish_step(self) -> MemoryPeak:
        """The step's peak: the allocator's on a GPU; on a CPU the tracked tensors' after
        each action and once more now (after the optimizer: its state exists from the
        first step on)."""
        if self.cuda:
            return MemoryPeak(float(torch.cuda.max_memory_allocated(self.device)), self.param_bytes,
                              unsharded_params=self.unsharded_params)
        self.observe()
        grads = sum(tensor_bytes(p.grad) for p in self.params) + sum(map(tensor_bytes, self.extra_grads()))
        self.last.static = self.param_bytes + grads + self.optimizer_bytes()
        self.last.unsharded_params = self.unsharded_params
        return self.last
