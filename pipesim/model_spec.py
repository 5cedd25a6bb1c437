"""Transformer model specs turned into per-stage costs.

Per layer, for sequence length s, microbatch b, hidden h, heads a, tensor parallel t
(Narayanan et al. 2021; Korthikanti et al. 2022; Qi et al. 2024, Table 1):

- forward FLOPs ``s*b*h*(24h + 4s)``, counting a multiply-add as 2 FLOPs (a GEMM of
  (m x k)(k x n) is 2mkn), the same convention as the GPUs' datasheet peaks;
  input-gradient backward = forward, weight-gradient backward = forward, so
  ``B = 2F`` and ``W = F``; all divided by t;
- parameters ``12h^2 + 13h`` (attention 4h^2 + 4h, MLP 8h^2 + 5h, two layer norms 4h),
  divided by t;
- activation stash, 16-bit: ``s*b*h*(34 + 5*a*s/h)`` bytes; with tp and no sequence
  parallelism ``s*b*h*(10 + 24/t + 5*a*s/(h*t))``, with it ``s*b*h*(34 + 5*a*s/h)/t``;
- the activation sent between stages ``s*b*h*dtype`` bytes (``/t`` with sequence
  parallelism, where it is sharded along the sequence).

The first stage also holds the token embedding (``V*h`` parameters); the last holds
the untied output head (``V*h``) and the loss, and computes the logits:
``2*s*b*h*V`` FLOPs forward, twice that backward, keeping ``s*b*V*dtype`` bytes of
logits for the loss. Llama models use this GPT layer formula too: their grouped-query
attention and SwiGLU MLP change the count by a few percent (70B: 66.5B by the formula).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pipesim.costs import Costs, StageCost

H100_BF16_FLOPS = 989e12  # used when a device has no peak (the ideal topology)


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
    microbatch_size: int = 1
    dtype_bytes: int = 2

    def layer_flops(self) -> float:
        """Forward FLOPs of one layer, whole (before tensor parallelism)."""
        s, b, h = self.seq_len, self.microbatch_size, self.hidden
        return s * b * h * (24 * h + 4 * s)

    def layer_params(self) -> float:
        return 12 * self.hidden**2 + 13 * self.hidden

    def layer_stash_bytes(self, tp: int = 1, sequence_parallel: bool = False) -> float:
        """Bytes one microbatch keeps per layer until its backward, on one tp shard."""
        s, b, h, a = self.seq_len, self.microbatch_size, self.hidden, self.heads
        if sequence_parallel:
            per_token = (34 + 5 * a * s / h) / tp
        else:
            per_token = 10 + 24 / tp + 5 * a * s / (h * tp)
        return s * b * h * per_token * self.dtype_bytes / 2

    def boundary_bytes(self, tp: int = 1, sequence_parallel: bool = False) -> float:
        """Bytes of the activation passed between pipeline stages (and of its gradient)."""
        full = self.seq_len * self.microbatch_size * self.hidden * self.dtype_bytes
        return full / tp if sequence_parallel else full

    def total_params(self) -> float:
        return self.layers * self.layer_params() + 2 * self.vocab * self.hidden


# Figures: GPT-3 paper (Brown et al. 2020, Table 2.1; 1.3B with 16 heads of 128 as in
# Megatron-LM's configs), Llama 3 model card (Meta, 2024).
PRESETS: dict[str, ModelSpec] = {
    "gpt3-1.3b": ModelSpec("gpt3-1.3b", layers=24, hidden=2048, heads=16, seq_len=2048, vocab=50257),
    "gpt3-13b": ModelSpec("gpt3-13b", layers=40, hidden=5120, heads=40, seq_len=2048, vocab=50257),
    "gpt3-175b": ModelSpec("gpt3-175b", layers=96, hidden=12288, heads=96, seq_len=2048, vocab=50257),
    "llama3-8b": ModelSpec("llama3-8b", layers=32, hidden=4096, heads=32, seq_len=8192, vocab=128256),
    "llama3-70b": ModelSpec("llama3-70b", layers=80, hidden=8192, heads=64, seq_len=8192, vocab=128256),
}


def model_spec(name: str, **overrides: int | None) -> ModelSpec:
    """A preset with any of its fields replaced (``None`` leaves a field as it is)."""
    spec = PRESETS.get(name)
    if spec is None:
        raise ModelSpecError(f"unknown model {name!r}: use one of {', '.join(PRESETS)}")
    changes = {key: value for key, value in overrides.items() if value is not None}
    for key, value in changes.items():
        if value < 1:
            raise ModelSpecError(f"model field {key} must be >= 1, got {value}")
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


def model_costs(
    spec: ModelSpec,
    num_stages: int,
    stage_peak_flops: list[float],
    tp: int = 1,
    mfu: float = 0.5,
    sequence_parallel: bool = False,
    layers_per_stage: list[int] | None = None,
) -> Costs:
    """Per-stage ``Costs`` of ``spec`` split over ``num_stages`` stages, on devices whose
    peak FLOP/s are ``stage_peak_flops[stage]``, reaching ``mfu`` of peak."""
    if not 0 < mfu <= 1:
        raise ModelSpecError(f"--mfu is a fraction of peak in (0, 1], got {mfu}")
    if tp < 1:
        raise ModelSpecError(f"--tp must be >= 1, got {tp}")
    counts = split_layers(spec.layers, num_stages, layers_per_stage)
    s, b, h, vocab = spec.seq_len, spec.microbatch_size, spec.hidden, spec.vocab
    full_message = s * b * h * spec.dtype_bytes
    stages = []
    for stage, count in enumerate(counts):
        peak = stage_peak_flops[stage]
        rate = (peak if math.isfinite(peak) else H100_BF16_FLOPS) * mfu
        flops = count * spec.layer_flops() / tp
        params = count * spec.layer_params() / tp
        stash = count * spec.layer_stash_bytes(tp, sequence_parallel)
        if stage == 0:
            params += vocab * h / tp
        if stage == num_stages - 1:
            params += vocab * h / tp
            flops += 2 * s * b * h * vocab / tp
            stash += s * b * vocab * spec.dtype_bytes / tp
        # input-gradient and weight-gradient passes each cost one forward (head included)
        fwd = flops / rate
        bwd, wgrad = 2 * fwd, fwd
        stages.append(StageCost(
            fwd=fwd,
            bwd=bwd,
            wgrad=wgrad,
            act_bytes=spec.boundary_bytes(tp, sequence_parallel) if stage < num_stages - 1 else 0.0,
            stash_bytes=stash,
            param_bytes=params * spec.dtype_bytes,
            layers=count if tp > 1 else 0,
            tp_message_bytes=full_message if tp > 1 else 0.0,
        ))
    meta = {"model": spec.name, "layers_per_stage": counts, "tp": tp, "mfu": mfu, "total_params": spec.total_params()}
    return Costs(stages=tuple(stages), sequence_parallel=sequence_parallel, meta=meta)
