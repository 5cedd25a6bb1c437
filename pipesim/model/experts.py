"""Mixture-of-experts MLPs: which layers route their tokens to experts, and how.

A mixture-of-experts layer replaces the dense MLP by a router (an ``h x E`` matrix
scoring each token against the ``E`` routed experts), ``E`` routed experts of which each
token uses the ``k`` best scoring (top-k), and optionally shared experts that every
token goes through (DeepSeekMoE, Qwen-MoE). Every expert is a gated MLP of width
``expert_ffn`` (Mixtral: 8 experts of 14336, top 2; DeepSeek-V3: 256 of 2048, top 8,
plus one shared).

Layers are not all alike: DeepSeek keeps the first ``first_k_dense_replace`` layers
dense, Qwen-MoE lists dense layers in ``mlp_only_layers`` or makes only every
``decoder_sparse_step``-th layer sparse. ``dense_layers`` names them by index, so every
per-layer quantity asks ``is_moe_layer(layer)``.

What a layer *holds* is every expert (memory: total parameters); what a token
*computes* is its ``k`` routed experts and the shared ones (FLOPs: active parameters).
With a ``capacity_factor`` C each expert computes ``C * k * T / E`` token slots of a
microbatch's ``T`` tokens whatever the routing (GShard, Switch Transformer: slots left
empty are padding, tokens beyond the capacity are dropped), so the routed experts' time
is C times the routed tokens' FLOPs; without one (dropless, as Megatron-LM and
DeepSeek-V3 train) it is the routed tokens' FLOPs, balanced over the experts.

Node-limited routing (``node_limit``, DeepSeek-V3's ``topk_group`` of its ``n_group``
expert groups, one group per node as it deploys them) sends a token to at most ``M``
nodes: its all-to-all crosses nodes with at most ``M`` copies of the token instead of
``k`` (``remote_share``).

How the router turns scores into the top-k weights changes no count but is part of the
architecture the executor builds: ``softmax`` over every expert's logit (Mixtral,
DeepSeek-V2, Qwen-MoE) or ``sigmoid`` per expert with a selection bias kept outside the
gradient (DeepSeek-V3's auxiliary-loss-free balancing); ``normalize_top_k`` rescales
the k chosen weights to sum to one (Mixtral, DeepSeek-V3) or leaves them as scored
(DeepSeek-V2, Qwen-MoE's ``norm_topk_prob`` false); ``routed_scaling`` multiplies them
(DeepSeek's ``routed_scaling_factor``, 2.5 in V3). DeepSeek's group-limited routing
splits the experts into ``expert_groups`` equal groups, scores each group (``max``: its
best expert, V2's ``group_limited_greedy``; ``top2-sum``: its best two by biased score,
V3's ``noaux_tc``), keeps the ``node_limit`` best groups and picks the token's k experts
among theirs.

``balance_loss`` is the coefficient of the load-balancing loss each MoE layer adds to
the training loss (Switch Transformer's ``E * sum_e f_e P_e``, taken per sequence as
DeepSeek's sequence-wise loss and Megatron-Core's ``seq_aux_loss`` take it; the config's
``router_aux_loss_coef``, DeepSeek's ``aux_loss_alpha``; 0: none). The simulator counts
no time for it (a few element-wise passes over the router's ``T x E`` scores); the
executor trains with it (``executor.architectures.moe``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipesim.model.errors import ModelSpecError, require_count, require_non_negative, require_positive

GATINGS = ("softmax", "sigmoid")
# how expert parallelism's all-to-alls move the routed copies (ModelSpec.ep_dispatcher, --ep-dispatcher):
# "alltoall", Megatron-Core's all-to-all dispatcher (one copy per routed slot over every link, permuted
# around it by the rank); "deepep", DeepEP's and Megatron-Core's flex dispatcher (DeepEP, HybridEP): a
# token crosses to each node holding any of its experts once and is fanned out there over NVLink, and the
# dispatch kernels read the rows by index (pipesim.model.operations.token_permutations)
EP_DISPATCHERS = ("alltoall", "deepep")
GROUP_SCORINGS = ("max", "top2-sum")


@dataclass(frozen=True)
class MixtureOfExperts:
    """The routed MLP of a transformer's sparse layers."""

    experts: int  # routed experts per MoE layer
    experts_per_token: int  # top-k
    expert_ffn: int  # intermediate width of one routed expert
    shared_experts: int = 0  # experts every token goes through
    shared_expert_ffn: int | None = None  # width of one shared expert; None: expert_ffn
    shared_expert_gate: bool = False  # Qwen-MoE: a sigmoid gate (h x 1) on the shared expert's output
    dense_layers: tuple[int, ...] = ()  # indices of the layers that keep a dense MLP
    capacity_factor: float | None = None  # token slots per expert / its balanced share; None: dropless
    router_bias: bool = False  # gpt-oss: the router's scores have a bias per expert
    node_limit: int | None = None  # a token's experts on at most this many nodes (DeepSeek-V3's topk_group)
    gating: str = "softmax"  # "softmax" or "sigmoid" (with DeepSeek-V3's auxiliary-loss-free selection bias)
    normalize_top_k: bool = True  # the k chosen weights rescaled to sum to one
    expert_groups: int = 1  # DeepSeek's n_group: a token picks node_limit of these groups, then its experts there
    group_scoring: str = "max"  # a group's score: its best expert's ("max", V2) or its best two's sum ("top2-sum", V3)
    routed_scaling: float = 1.0  # the routed experts' weights times this (DeepSeek's routed_scaling_factor)
    selection_bias: bool | None = None  # a bias picking experts, moved to balance them; None: sigmoid routers' (V3)
    weighted_input: bool = False  # the routing weight scales the expert's input, not its output (Llama 4)
    balance_loss: float = 0.0  # the load-balancing loss's coefficient per MoE layer (router_aux_loss_coef)

    @property
    def balanced_by_bias(self) -> bool:
        """Whether the router picks by score plus a balancing bias (DeepSeek-V3's
        auxiliary-loss-free balancing): said, or by default every sigmoid router."""
        return self.gating == "sigmoid" if self.selection_bias is None else self.selection_bias

    def __post_init__(self) -> None:
        for key in ("experts", "experts_per_token", "expert_ffn"):
            require_count(getattr(self, key), f"mixture of experts: {key}")
        require_count(self.shared_experts, "mixture of experts: shared_experts", minimum=0)
        if self.shared_expert_ffn is not None:
            require_count(self.shared_expert_ffn, "mixture of experts: shared_expert_ffn")
        for layer in self.dense_layers:
            require_count(layer, "mixture of experts: each of dense_layers", minimum=0)
        if self.experts_per_token > self.experts:
            raise ModelSpecError(f"mixture of experts: experts_per_token {self.experts_per_token} exceeds the "
                                 f"{self.experts} routed experts")
        if self.node_limit is not None:
            require_count(self.node_limit, "mixture of experts: node_limit (or none)")
        if self.gating not in GATINGS:
            raise ModelSpecError(f"mixture of experts: gating {self.gating!r} is not one of: {', '.join(GATINGS)}")
        self._check_groups()
        require_positive(self.routed_scaling, "mixture of experts: routed_scaling")
        require_non_negative(self.balance_loss, "mixture of experts: balance_loss")
        factor = self.capacity_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                                   or not math.isfinite(factor) or factor <= 0):
            raise ModelSpecError(f"mixture of experts: capacity_factor must be a number > 0 (or none for dropless), "
                                 f"got {factor!r}")

    def _check_groups(self) -> None:
        """Group-limited routing needs equal groups, a limit among them, and room in the
        kept groups for a token's k experts (the best two of a group need two there)."""
        require_count(self.expert_groups, "mixture of experts: expert_groups")
        if self.group_scoring not in GROUP_SCORINGS:
            raise ModelSpecError(f"mixture of experts: group_scoring {self.group_scoring!r} is not one of: "
                                 f"{', '.join(GROUP_SCORINGS)}")
        groups = self.expert_groups
        if groups == 1:
            return
        if self.experts % groups:
            raise ModelSpecError(f"mixture of experts: expert_groups {groups} must divide the {self.experts} "
                                 "routed experts")
        per_group = self.experts // groups
        if self.node_limit is None or self.node_limit > groups:
            raise ModelSpecError(f"mixture of experts: node_limit {self.node_limit} must be a count of the "
                                 f"{groups} expert groups a token may use")
        if self.node_limit * per_group < self.experts_per_token:
            raise ModelSpecError(f"mixture of experts: node_limit {self.node_limit} groups of {per_group} experts "
                                 f"hold fewer than the {self.experts_per_token} a token picks")
        if self.group_scoring == "top2-sum" and per_group < 2:
            raise ModelSpecError(f"mixture of experts: group_scoring top2-sum needs 2 experts a group, "
                                 f"{groups} groups of {self.experts} leave {per_group}")

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    @property
    def shared_ffn(self) -> int:
        """Width of the shared experts taken together (DeepSeek runs them as one MLP)."""
        return self.shared_experts * (self.shared_expert_ffn or self.expert_ffn)

    def routed_slots(self, padded: bool = True) -> float:
        """Routed-expert computations per token: ``k``, times the capacity factor when
        ``padded`` (the time an expert spends on its whole capacity, empty slots included).
        Unpadded, the computations the tokens get: ``k``, or with a capacity factor below 1
        only that share of them (the rest are dropped, ``dropped_share``), so model FLOPs
        never count work no expert did (an MFU over 100%)."""
        if self.node_limit is not None:
            require_count(self.node_limit, "mixture of experts: node_limit (or none)")
        if self.capacity_factor is None:
            return float(self.experts_per_token)
        factor = self.capacity_factor if padded else min(1.0, self.capacity_factor)
        return self.experts_per_token * factor

    def routed_width(self, padded: bool = True) -> float:
        """Per token, its routed experts' MLP columns: ``routed_slots`` of the expert width
        (what an activation over them reads per input matrix and writes)."""
        return self.routed_slots(padded) * self.expert_ffn

    @property
    def dropped_share(self) -> float:
        """The share of routed token copies a capacity below the balanced share drops:
        ``1 - C`` for ``C < 1`` with a balanced router (more with an unbalanced one)."""
        return max(0.0, 1.0 - self.capacity_factor) if self.capacity_factor is not None else 0.0

    def tokens_per_expert(self, tokens: float, padded: bool = True) -> float:
        """Token slots each routed expert computes for ``tokens`` tokens: ``C k T / E``, the
        ``k T`` routed tokens spread evenly (a balanced router, which the auxiliary losses
        aim for) times the capacity factor when ``padded``."""
        return self.routed_slots(padded) * tokens / self.experts

    def remote_share(self, nodes: int) -> float:
        """The share of a token's routed copies that still cross between nodes when its
        expert-parallel group spans ``nodes`` nodes: 1 without a node limit (the
        all-to-all sends one copy per routed expert, ``k``); with node-limited routing
        (DeepSeek-V3, section 2.1.2 and 3.2.2: a token's experts on at most ``M`` nodes,
        sent once to each over InfiniBand and fanned out within it over NVLink) at most
        ``min(M, nodes)`` copies of the ``k``."""
        return node_limited_share(self.node_limit or 0, self.routed_slots(padded=False), nodes)

    def dispatch_bytes(self, tokens: float, hidden: int, element_bytes: float) -> float:
        """Bytes of one rank's routed token copies: what each of expert parallelism's
        all-to-alls moves for ``tokens`` tokens (dispatch sends them to the experts' ranks,
        combine brings the experts' outputs back, the backward does both in reverse): a
        copy of the ``hidden``-wide token per routed slot, padded to the capacity, at
        ``element_bytes`` an element (``ModelSpec.dispatch_element_bytes``: FP8 and its
        scales for DeepSeek-V3's dispatch, the activations' dtype for the combine)."""
        return self.routed_slots() * tokens * hidden * element_bytes


def node_limited_share(node_limit: float, copies: float, nodes: int) -> float:
    """``min(1, min(M, nodes) / k)``: the share of ``k`` routed copies of a token that
    cross between ``nodes`` nodes when its experts sit on at most ``M`` of them (``M`` 0:
    no limit, every copy)."""
    if not node_limit or not copies or nodes <= 1:
        return 1.0
    return min(1.0, min(node_limit, nodes) / copies)


def dense_layer_indices(layers: int, first_dense: int = 0, moe_every: int = 1, moe_offset: int = 0,
                        listed: tuple[int, ...] | list[int] = ()) -> tuple[int, ...]:
    """Indices of the dense layers of a ``layers``-layer model: the first ``first_dense``,
    every layer ``i`` with ``(i + moe_offset) % moe_every != 0`` and the ``listed`` ones.

    DeepSeek (``first_k_dense_replace``, ``moe_layer_freq``): ``first_dense=k,
    moe_every=freq``; Qwen-MoE (``decoder_sparse_step``, ``mlp_only_layers``):
    ``moe_every=step, moe_offset=1, listed=mlp_only_layers``."""
    return tuple(layer for layer in range(layers)
                 if layer < first_dense or (layer + moe_offset) % moe_every or layer in listed)
