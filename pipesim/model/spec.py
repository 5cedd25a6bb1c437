"""Transformer architectures: parameters, FLOPs and activation bytes of one layer.

A ``ModelSpec`` is a decoder-only transformer with its architecture spelled out, because
Llama-style models differ from GPT-3 in ways that move every number by several percent:
grouped-query attention (``kv_heads`` < ``heads``: K and V projections of
``kv_heads * head_dim`` columns), a gated SwiGLU MLP (three ``h x ffn`` matrices instead of
two), untied input and output embeddings, RMSNorm, no biases, rotary instead of learned
positions, no dropout.

Per layer, sequence s, microbatch b, hidden h, heads a, kv width k = kv_heads * h / a,
MLP width f (a multiply-add counts 2 FLOPs, as the datasheet peaks do):

- forward FLOPs: QKV ``2sbh(h + 2k)``, attention core ``4s^2bh`` (QK^T and PV, counted
  whole as Megatron does), output projection ``2sbh^2``, MLP ``2sbhf`` per matrix. GPT-3
  (k = h, f = 4h, 2 matrices) gives ``sbh(24h + 4s)`` (Narayanan et al. 2021).
- backward: input gradient and weight gradient each cost the forward's GEMMs; the
  attention core has no weights, so its backward (2x its forward) is all input gradient.
- activation stash: ``pipesim.model.activations`` (Korthikanti et al. 2022).

This module holds the architecture; ``pipesim.model.activations`` the activation memory,
``pipesim.model.transformer_costs`` the per-stage costs derived from both.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path


class ModelSpecError(ValueError):
    """A model spec or layer split that cannot describe a pipeline."""


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer and the microbatch it is trained on."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    kv_heads: int | None = None  # None: multi-head attention (kv_heads = heads)
    ffn_hidden: int | None = None  # None: 4 * hidden
    gated_mlp: bool = False  # SwiGLU: gate, up and down matrices
    tied_embeddings: bool = True
    learned_positions: bool = True  # a seq_len x hidden position table (GPT); rotary has none
    bias: bool = True
    rms_norm: bool = False  # RMSNorm: a scale only; LayerNorm: scale and shift
    dropout: bool = True  # dropout masks kept for the backward (1 byte per element)
    microbatch_size: int = 1
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "seq_len", "vocab", "microbatch_size", "dtype_bytes"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelSpecError(f"model {self.name}: {key} must be an integer >= 1, got {value!r}")
        for key in ("kv_heads", "ffn_hidden"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ModelSpecError(f"model {self.name}: {key} must be an integer >= 1, got {value!r}")
        if self.hidden % self.heads:
            raise ModelSpecError(f"model {self.name}: hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.heads % self.num_kv_heads:
            raise ModelSpecError(
                f"model {self.name}: heads {self.heads} is not a multiple of kv_heads {self.num_kv_heads}")

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def kv_width(self) -> int:
        """Columns of the K projection (and of V): ``kv_heads * head_dim``."""
        return self.num_kv_heads * (self.hidden // self.heads)

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def tokens(self) -> int:
        """Tokens in one microbatch: ``b * s``."""
        return self.microbatch_size * self.seq_len

    # parameters -------------------------------------------------------------------
    def layer_params(self) -> float:
        """Parameters of one transformer layer, whole (before tensor parallelism)."""
        h, k, f = self.hidden, self.kv_width, self.ffn
        attention = 2 * h * h + 2 * h * k + (2 * h + 2 * k if self.bias else 0)
        mlp = self.mlp_matrices * h * f + ((self.mlp_matrices - 1) * f + h if self.bias else 0)
        return attention + mlp + 2 * self.norm_params()

    def norm_params(self) -> int:
        return self.hidden if self.rms_norm else 2 * self.hidden

    def embedding_params(self) -> float:
        """Token (and learned position) embedding, on the first stage."""
        return self.vocab * self.hidden + (self.seq_len * self.hidden if self.learned_positions else 0)

    def head_params(self) -> float:
        """Final norm and, when untied, the output projection, on the last stage."""
        return self.norm_params() + (0 if self.tied_embeddings else self.vocab * self.hidden)

    def total_params(self) -> float:
        """Every parameter of the model (a tied output head counted once)."""
        return self.layers * self.layer_params() + self.embedding_params() + self.head_params()

    # FLOPs, per microbatch, forward, whole -------------------------------------
    def attention_core_flops(self) -> float:
        """QK^T and PV: ``4 s^2 b h`` (the whole square, as Megatron counts)."""
        return 4 * self.seq_len * self.tokens * self.hidden

    def layer_gemm_flops(self) -> float:
        """Forward FLOPs of a layer's weight GEMMs (QKV, output projection, MLP)."""
        h, k, f = self.hidden, self.kv_width, self.ffn
        return 2 * self.tokens * (h * (h + 2 * k) + h * h + self.mlp_matrices * h * f)

    def layer_flops(self) -> float:
        """Forward FLOPs of one layer, whole (before tensor parallelism)."""
        return self.layer_gemm_flops() + self.attention_core_flops()

    def logits_flops(self) -> float:
        """Forward FLOPs of the output projection: ``2 s b h V``."""
        return 2 * self.tokens * self.hidden * self.vocab

    def forward_flops(self) -> float:
        """Forward FLOPs of the whole model for one microbatch."""
        return self.layers * self.layer_flops() + self.logits_flops()

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward = 3x forward, no recompute): the
        numerator of MFU (Chowdhery et al. 2022, PaLM, appendix B, with the attention
        term counted as Megatron counts it)."""
        return 3 * self.forward_flops() / self.tokens

    def recompute_flops(self, recompute: str) -> float:
        """Forward FLOPs re-run in the backward of one microbatch: every layer's forward
        (full) or every layer's attention core (selective); the output layer never."""
        check_recompute(recompute)
        if recompute == "full":
            return self.layers * self.layer_flops()
        if recompute == "selective":
            return self.layers * self.attention_core_flops()
        return 0.0

    def boundary_bytes(self, tp: int = 1, sequence_parallel: bool = False) -> float:
        """Bytes of the activation passed between pipeline stages (and of its gradient)."""
        full = self.tokens * self.hidden * self.dtype_bytes
        return full / tp if sequence_parallel else full

    def describe(self) -> dict:
        """The architecture and its derived sizes, for ``--json``."""
        document = {field.name: getattr(self, field.name) for field in fields(self)}
        document.update(
            kv_heads=self.num_kv_heads, ffn_hidden=self.ffn, params=self.total_params(),
            flops_per_token=self.flops_per_token(),
        )
        return document


RECOMPUTE = ("none", "selective", "full")


def check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE:
        raise ModelSpecError(f"--recompute {recompute!r}: use one of {', '.join(RECOMPUTE)}")


def _gpt3(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(name, layers=layers, hidden=hidden, heads=heads, seq_len=2048, vocab=50257)


def _llama3(name: str, layers: int, hidden: int, heads: int, ffn: int) -> ModelSpec:
    return ModelSpec(name, layers=layers, hidden=hidden, heads=heads, seq_len=8192, vocab=128256, kv_heads=8,
                     ffn_hidden=ffn, gated_mlp=True, tied_embeddings=False, learned_positions=False, bias=False,
                     rms_norm=True, dropout=False)


# GPT-3: Brown et al. 2020, Table 2.1 (1.3B with 16 heads of 128, as Megatron-LM's configs;
# GPT-2 lineage: tied embeddings, learned positions, biases, LayerNorm, dropout).
# Llama 3: Meta's model cards / config.json (GQA with 8 KV heads, SwiGLU, untied, RMSNorm).
PRESETS: dict[str, ModelSpec] = {
    "gpt3-1.3b": _gpt3("gpt3-1.3b", 24, 2048, 16),
    "gpt3-13b": _gpt3("gpt3-13b", 40, 5120, 40),
    "gpt3-175b": _gpt3("gpt3-175b", 96, 12288, 96),
    "llama3-8b": _llama3("llama3-8b", 32, 4096, 32, 14336),
    "llama3-70b": _llama3("llama3-70b", 80, 8192, 64, 28672),
    "llama3-405b": _llama3("llama3-405b", 126, 16384, 128, 53248),
}

def load_model(name_or_path: str, seq_len: int | None = None) -> ModelSpec:
    """A preset by name, or a Hugging Face style ``config.json``."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.suffix.lower() == ".json" or path.exists():
        if not path.exists():
            raise FileNotFoundError(f"model config {path} does not exist")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ModelSpecError(f"{path}: not valid JSON ({error})") from error
        from pipesim.model.hf_config import spec_from_hf_config

        return spec_from_hf_config(data, str(path), seq_len)
    raise ModelSpecError(f"unknown model {name_or_path!r}: use one of {', '.join(PRESETS)} or a config.json")


def model_spec(name: str, **overrides: int | None) -> ModelSpec:
    """A preset (or config.json) with any of its fields replaced (``None`` leaves a field
    as it is)."""
    spec = load_model(name, overrides.get("seq_len"))
    changes = {key: value for key, value in overrides.items() if value is not None}
    for key, value in changes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelSpecError(f"model field {key} must be an integer >= 1, got {value!r}")
    return replace(spec, **changes)


def split_layers(layers: int, num_stages: int, layers_per_stage: list[int] | None = None) -> list[int]:
    """Layers on each stage: as given, or as even as possible with the extra layers on
    the middle stages (the first and last already carry the embedding and the head)."""
    if layers_per_stage is not None:
        if len(layers_per_stage) != num_stages:
            raise ModelSpecError(
                f"--layers-per-stage lists {len(layers_per_stage)} stages but the schedule has {num_stages} "
                f"(pp x virtual stages)"
            )
        if any(count < 1 for count in layers_per_stage):
            raise ModelSpecError(f"--layers-per-stage {layers_per_stage}: every stage needs at least one layer")
        if sum(layers_per_stage) != layers:
            raise ModelSpecError(
                f"--layers-per-stage {','.join(map(str, layers_per_stage))} sums to {sum(layers_per_stage)} "
                f"but the model has {layers} layers"
            )
        return list(layers_per_stage)
    if layers < num_stages:
        raise ModelSpecError(
            f"the model has {layers} layers, fewer than the {num_stages} stages (pp x virtual stages); "
            f"every stage needs at least one layer"
        )
    base, extra = divmod(layers, num_stages)
    counts = [base] * num_stages
    first = (num_stages - extra) // 2
    for stage in range(first, first + extra):
        counts[stage] += 1
    return counts


def finite_peak(peak: float, fallback: float) -> float:
    """A device's peak FLOP/s, or ``fallback`` where the topology does not say (ideal)."""
    return peak if math.isfinite(peak) and peak > 0 else fallback


def model_costs(spec: ModelSpec, num_stages: int, stage_peak_flops: list[float], **options):
    """Per-stage costs of ``spec``: ``pipesim.model.transformer_costs.model_costs`` (kept importable
    from here, where it used to live)."""
    from pipesim.model.transformer_costs import model_costs as derive

    return derive(spec, num_stages, stage_peak_flops, **options)
