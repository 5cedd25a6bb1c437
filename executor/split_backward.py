"""Split backward for zero-bubble schedules: ``I`` computes only the input gradient, ``W``
the weight gradients from what ``I`` kept, each op's backward run once between them.

Why not simply ``autograd.grad(output, [x])`` then ``autograd.backward(output, inputs=params)``:
the second call walks the stage's whole graph again, recomputing every input-gradient
GEMM on its way to the parameters, so I + W cost about 1.6 B. The split here cuts the
graph where the weight gradients start instead:

- during ``F``, a forward hook on every submodule that directly owns trainable
  parameters (``parameters(recurse=False)``: a Linear, a LayerNorm, an Embedding, a
  user's own layer) records the *gradient edge* of each tensor it returns (the autograd
  node that made it, taken at once, so a later in-place op on the output cannot move it).
  The hook runs ahead of any other forward hook (``prepend``), so it sees the module's
  own output before ``parallelize_module``'s output hooks redistribute it: under
  sequence parallelism a row-parallel linear's recorded output is the GEMM's partial
  sum, not the shard its reduce-scatter leaves, so ``I`` finds the all-gathered output
  gradient and ``W`` multiplies it with no collective (as Megatron's zero-bubble
  weight-gradient store keeps it); recorded after the hook, ``W`` would all-gather it again;
- ``I`` asks autograd, in one ``autograd.grad`` call, for the gradient of the stage
  input *and* of every recorded edge. Autograd then runs each op's backward only for the
  outputs it needs (``should_compute_output``): a Linear's backward computes its input
  gradient and skips its weight GEMM; ``.grad`` is not touched;
- ``W``, for each recorded module call, runs ``autograd.backward`` from that call's
  edges with that call's gradients and ``inputs=`` the module's own parameters: a local
  backward of one op (the weight GEMM, the norm's affine gradients), nothing upstream.

This is generic (no knowledge of the stage's layers) and costs nothing per microbatch
but the hooks. It is exact when every path from the stage output to a parameter passes
through exactly one recorded output of a module that owns it. That holds for layers
that use their own weights (every torch layer), but not for a parameter also used
outside its module (a head tied to the embedding weight through ``F.linear``) or a
module applied twice in a row (its second call's edge reaches its first call's weights
again). Those parameters are found once per stage, on the first microbatch's graph,
and their gradients are computed in ``W`` the old way (a backward from the stage
output restricted to them): slower, never wrong. ``torch.distributed.pipelining``
finds the cut by walking the whole graph on every microbatch instead
(``stage_backward_input``); the hooks avoid that walk.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.utils._pytree import tree_leaves


class ModuleCall(NamedTuple):
    """One forward call of a parameter-owning module: the edges of its outputs and the
    trainable parameters it held during the call. Those are the leaves of this call's
    graph: under ZeRO-3 (``executor.fsdp``) a module holds FSDP's unsharded parameters
    while it runs and its sharded ones between runs, so W must name the ones it ran with."""

    module: nn.Module
    edges: tuple[GradientEdge, ...]
    params: tuple[nn.Parameter, ...]


class WeightWork(NamedTuple):
    """What ``W`` needs for one microbatch: each module call's edges with the gradients
    ``I`` found for them, and (only where some parameters are not covered by the
    recorded calls) the stage output and its gradient for the fallback backward."""

    calls: list[tuple[ModuleCall, list[torch.Tensor]]]
    output: torch.Tensor | None
    output_grad: torch.Tensor | None


class SplitBackward:
    """The split backward of one stage module: records its parameter-owning submodules'
    outputs during ``recording()`` and runs ``input_grad`` (I) and ``weight_grad`` (W)."""

    def __init__(self, stage: nn.Module) -> None:
        self.stage = stage
        self.trainable = [p for p in stage.parameters() if p.requires_grad]
        self.names = {id(param): name for name, param in stage.named_parameters()}
        self.own: dict[nn.Module, list[nn.Parameter]] = {}
        for module in stage.modules():
            params = own_trainable(module)
            if params:
                self.own[module] = params
        self.active: list[ModuleCall] | None = None
        self.handles = [module.register_forward_hook(self.record, prepend=True) for module in self.own]
        # Parameters the recorded calls do not cover exactly; decided on the first graph.
        self.uncovered: list[nn.Parameter] | None = None
        self.uncovered_names: list[str] = []  # theirs in the stage, for messages
        self.local: set[nn.Module] = set()

    def record(self, module: nn.Module, _inputs: object, output: object) -> None:
        if self.active is None:
            return
        edges = tuple(get_gradient_edge(t) for t in tree_leaves(output)
                      if isinstance(t, torch.Tensor) and t.requires_grad)
        if edges:
            self.active.append(ModuleCall(module, edges, tuple(own_trainable(module))))

    @contextmanager
    def recording(self) -> Iterator[list[ModuleCall]]:
        """Record the module calls of the forward run inside the block."""
        calls: list[ModuleCall] = []
        self.active = calls
        try:
            yield calls
        finally:
            self.active = None

    def close(self) -> None:
        """Remove the hooks (the module runs as before)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def input_grad(self, output: torch.Tensor, output_grad: torch.Tensor | None, x: torch.Tensor | None,
                   calls: list[ModuleCall]) -> tuple[torch.Tensor | None, WeightWork]:
        """I: the gradient of ``x`` (``None`` when ``x`` is ``None``, the first stage's
        data) and the gradients of the recorded edges, in one pass that computes no
        weight gradient; returns it with the ``WeightWork`` for W."""
        if self.uncovered is None:
            self.plan(output, calls)
        calls = [call for call in calls if call.module in self.local]
        edges = [edge for call in calls for edge in call.edges]
        targets: list[torch.Tensor | GradientEdge] = ([x] if x is not None else []) + edges
        grads: tuple[torch.Tensor | None, ...] = ()
        if targets and output.requires_grad:
            grads = torch.autograd.grad(output, targets, output_grad, retain_graph=True, allow_unused=True)
        input_grad = None
        if x is not None:
            input_grad = grads[0] if grads and grads[0] is not None else torch.zeros_like(x)
            grads = grads[1:]
        kept, offset = [], 0
        for call in calls:
            call_grads = list(grads[offset:offset + len(call.edges)])
            offset += len(call.edges)
            kept.append((call, call_grads))
        fallback = bool(self.uncovered)
        return input_grad, WeightWork(kept, output if fallback else None, output_grad if fallback else None)

    def weight_grad(self, work: WeightWork) -> None:
        """W: accumulate every parameter's gradient for this microbatch into ``.grad``."""
        self.call_weight_grads(work.calls)
        if work.output is not None and work.output.requires_grad:
            torch.autograd.backward(work.output, work.output_grad, inputs=self.uncovered, retain_graph=True)

    @staticmethod
    def call_weight_grads(calls: list[tuple[ModuleCall, list[torch.Tensor]]]) -> None:
        """The local backward of these recorded calls into their parameters' ``.grad``:
        one backward per module and the parameters it ran with, over all of its calls (an
        output layer read by the main head and every multi-token prediction depth), so
        each parameter's gradient is accumulated once, as one backward of the whole graph
        accumulates it (data parallelism's buckets count on that)."""
        grouped: dict[tuple[int, ...], tuple[list[GradientEdge], list[torch.Tensor], tuple[nn.Parameter, ...]]] = {}
        for call, grads in calls:
            key = (id(call.module), *map(id, call.params))
            edges, given, _ = grouped.setdefault(key, ([], [], call.params))
            for edge, grad in zip(call.edges, grads, strict=True):
                if grad is not None:
                    edges.append(edge)
                    given.append(grad)
        for edges, given, params in grouped.values():
            if edges:
                torch.autograd.backward(edges, given, inputs=list(params), retain_graph=True)

    # -- which parameters the recorded calls cover ------------------------------------

    def plan(self, output: torch.Tensor, calls: list[ModuleCall]) -> None:
        """Find, on this microbatch's graph, the modules whose parameters the recorded
        calls cover exactly (every path from the output to each of their parameters
        through exactly one recorded edge of an owner); the rest go to the fallback."""
        nodes_of: dict[nn.Module, set[Node]] = collections.defaultdict(set)
        # each parameter as this graph holds it (under ZeRO-3, FSDP's unsharded one)
        ran_with: dict[nn.Parameter, nn.Parameter] = {}
        for call in calls:
            nodes_of[call.module].update(edge.node for edge in call.edges)
            ran_with.update(zip(self.own[call.module], call.params, strict=True))
        owners: dict[nn.Parameter, list[nn.Module]] = collections.defaultdict(list)
        for module, params in self.own.items():
            for param in params:
                owners[param].append(module)
        root = output.grad_fn
        uncovered: set[nn.Parameter] = set()
        by_owners: dict[tuple[nn.Module, ...], list[nn.Parameter]] = collections.defaultdict(list)
        for param in self.trainable:
            by_owners[tuple(owners[param])].append(param)
        for owner_modules, params in by_owners.items():
            blocked = set().union(*(nodes_of[module] for module in owner_modules))
            outside = reachable([root], blocked) if root is not None else set()
            # One recorded call reaching another would count the second one's share twice.
            chained = len(blocked) > 1 and any(blocked & reachable([node], set()) for node in blocked)
            for param in params:
                if chained or get_gradient_edge(ran_with.get(param, param)).node in outside:
                    uncovered.add(param)
        self.local = {module for module, params in self.own.items() if not uncovered.intersection(params)}
        # A module with some uncovered parameters has all of them computed by the fallback.
        partly = [param for module, params in self.own.items() if module not in self.local
                  for param in params if param not in uncovered]
        fallback = [p for p in self.trainable if p in uncovered] + list(dict.fromkeys(partly))
        self.uncovered = [ran_with.get(param, param) for param in fallback]
        self.uncovered_names = [self.names.get(id(param), "?") for param in fallback]


def own_trainable(module: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters ``module`` itself holds (not its children's), as it holds them now."""
    return [p for p in module.parameters(recurse=False) if p.requires_grad]


def reachable(starts: list[Node], blocked: set[Node]) -> set[Node]:
    """Nodes reached from ``starts`` along ``next_functions`` without passing through a
    node of ``blocked`` (a start in ``blocked`` leads nowhere)."""
    seen: set[Node] = set()
    queue = collections.deque(node for node in starts if node not in blocked)
    while queue:
        node = queue.popleft()
        for next_node, _ in node.next_functions:
            if next_node is None or next_node in seen or next_node in blocked:
                continue
            seen.add(next_node)
            queue.append(next_node)
    return seen
