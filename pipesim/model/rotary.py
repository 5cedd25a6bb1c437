"""Rotary positions as a model's config describes them: the base (``rope_theta``) and a
context-extension rescaling of the frequencies (``rope_scaling``).

Position ``p`` turns feature pair ``i`` of a ``d``-wide head by ``p * f_i`` with
``f_i = theta^(-2i/d)`` (RoFormer, Su et al. 2021). Llama 1/2, Mistral-7B v0.1 and
DeepSeek use a base of 10000, Llama 3 500000, Qwen2/3 and Mixtral 1000000. Two
rescalings are built by ``pipesim run``'s executor:

- ``linear`` (position interpolation, Chen et al. 2023): every ``f_i / factor``;
- ``llama3`` (Llama 3.1's ``rope_scaling``, as Meta's reference code and Hugging Face's
  ``_compute_llama3_parameters`` apply it): with ``L`` the original context, pairs of
  wavelength ``2π / f`` above ``L / low_freq_factor`` divided by ``factor``, below
  ``L / high_freq_factor`` kept, and between them a blend, ``(1 - t) f / factor + t f``
  with ``t = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)``.

Other rope types (``yarn``, ``dynamic``, ``longrope``) are read and named, not built:
the executor's frequencies are then the unscaled ones, and its shrink line says so.
Rotary positions change no count: the simulator reads none of this.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from pipesim.model.errors import ModelSpecError, require_positive

BUILT_SCALINGS = ("linear", "llama3")


@dataclass(frozen=True)
class Rope:
    """A model's rotary positions: base and rescaling."""

    theta: float = 10000.0
    scaling: str | None = None  # Hugging Face's rope_type; None: unscaled
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_positions: int = 8192  # llama3: the context the frequencies were trained for

    def __post_init__(self) -> None:
        for name in ("theta", "factor", "low_freq_factor", "high_freq_factor"):
            require_positive(getattr(self, name), f"rotary positions: {name}")
        if self.scaling == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ModelSpecError(f"rotary positions: llama3 scaling needs high_freq_factor "
                                 f"({self.high_freq_factor}) above low_freq_factor ({self.low_freq_factor})")

    @property
    def built(self) -> bool:
        """Whether the executor builds these frequencies exactly (else unscaled)."""
        return self.scaling is None or self.scaling in BUILT_SCALINGS

    @functools.lru_cache(maxsize=64)  # noqa: B019 - a frozen dataclass, hashable: one list per (rope, width)
    def inverse_frequencies(self, dim: int) -> tuple[float, ...]:
        """``f_i`` for the ``dim / 2`` feature pairs of a ``dim``-wide rotary part (every
        layer's forward asks: computed once)."""
        plain = [self.theta ** (-index / dim) for index in range(0, dim, 2)]
        if self.scaling == "linear":
            return tuple(frequency / self.factor for frequency in plain)
        if self.scaling != "llama3":
            return tuple(plain)
        longest = self.original_positions / self.low_freq_factor  # wavelengths above: all interpolated
        shortest = self.original_positions / self.high_freq_factor  # below: kept
        scaled = []
        for frequency in plain:
            wavelength = 2 * math.pi / frequency
            if wavelength < shortest:
                scaled.append(frequency)
            elif wavelength > longest:
                scaled.append(frequency / self.factor)
            else:
                blend = (self.original_positions / wavelength - self.low_freq_factor) / (
                    self.high_freq_factor - self.low_freq_factor)
                scaled.append((1 - blend) * frequency / self.factor + blend * frequency)
        return tuple(scaled)


def rope_from_config(theta: object, scaling: object, name: str) -> Rope:
    """A ``Rope`` from a config's ``rope_theta`` and ``rope_scaling`` (None: unscaled)."""
    if scaling is None:
        return Rope(theta=theta)
    if not isinstance(scaling, dict):
        raise ModelSpecError(f"{name}: rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return Rope(theta=theta)
    fields = {"factor": scaling.get("factor", 1.0)}
    if kind == "llama3":
        fields.update(low_freq_factor=scaling.get("low_freq_factor", 1.0),
                      high_freq_factor=scaling.get("high_freq_factor", 4.0),
                      original_positions=scaling.get("original_max_position_embeddings", 8192))
    return Rope(theta=theta, scaling=str(kind), **fields)
