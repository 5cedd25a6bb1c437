"""Rotary positions as a model's config describes them: the base (``rope_theta``) and a
context-extension rescaling of the frequencies (``rope_scaling``).

Position ``p`` turns feature pair ``i`` of a ``d``-wide head by ``p * f_i`` with
``f_i = theta^(-2i/d)`` (RoFormer, Su et al. 2021). Llama 1/2, Mistral-7B v0.1 and
DeepSeek use a base of 10000, Llama 3 500000, Qwen2/3 and Mixtral 1000000. The
rescalings ``pipesim run``'s executor builds, each as Hugging Face's
``modeling_rope_utils`` computes it:

- ``linear`` (position interpolation, Chen et al. 2023): every ``f_i / factor``;
- ``llama3`` (Llama 3.1's, as Meta's reference code applies it): with ``L`` the original
  context, pairs of wavelength ``2π / f`` above ``L / low_freq_factor`` divided by
  ``factor``, below ``L / high_freq_factor`` kept, and between them a blend,
  ``(1 - t) f / factor + t f`` with ``t = (L / wavelength - low_freq_factor) /
  (high_freq_factor - low_freq_factor)``;
- ``yarn`` (Peng et al. 2023; gpt-oss, DeepSeek-V3's full config, Qwen3's long-context
  one): pair ``i`` is ``f_i / factor`` past the pair that turns ``beta_slow`` times over
  the original context, ``f_i`` before the one that turns ``beta_fast`` times, and a
  linear ramp between (the two pair indices rounded outwards unless ``truncate`` is
  false); the cosines and sines are multiplied by an attention factor, ``0.1 ln(factor)
  + 1`` unless the config gives ``attention_factor``, or ``mscale`` and ``mscale_all_dim``
  (then the ratio of the two such terms, 1 in DeepSeek's configs). DeepSeek-V2/V3's own
  attention also multiplies its softmax scale by the square of the ``mscale_all_dim``
  term (``latent_softmax_scale``);
- ``dynamic`` (dynamic NTK): unscaled up to ``max_position_embeddings`` tokens, beyond
  them a base grown with the sequence, ``theta (factor s / max - factor + 1)^(d/(d-2))``;
- ``longrope`` (Phi-3 and Phi-4-mini; ``su`` in Phi-3's first configs): pair ``i`` is
  ``f_i / short_factor[i]``, or ``f_i / long_factor[i]`` for sequences longer than the
  original context, and the cosines and sines are multiplied by ``attention_factor``,
  else by ``sqrt(1 + ln(factor) / ln(L))`` with ``factor`` the config's
  ``max_position_embeddings`` over its ``original_max_position_embeddings`` (Hugging
  Face's rule). The lists hold one factor per pair of the model's rotary part; a head
  shrunk to fewer pairs takes, for its pair ``i`` of ``n``, the factor of the listed pair
  ``i * len / n``, the pair of the same base frequency ``theta^(-2i/d)`` where ``n``
  divides the list's length (``longrope_pairs``; the shrink line says so).

Rotary positions change no count: the simulator reads none of this.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from pipesim.model.errors import ModelSpecError, require_non_negative, require_positive

BUILT_SCALINGS = ("linear", "llama3", "yarn", "dynamic", "longrope")
LEGACY_NAMES = {"su": "longrope"}  # Phi-3's first configs named longrope "su"


@dataclass(frozen=True)
class Rope:
    """A model's rotary positions: base and rescaling."""

    theta: float = 10000.0
    scaling: str | None = None  # Hugging Face's rope_type; None: unscaled
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_positions: int = 8192  # llama3, yarn: the context the frequencies were trained for
    beta_fast: float = 32.0  # yarn: pairs turning more often than this over the original context are kept
    beta_slow: float = 1.0  # yarn: pairs turning less often are divided by factor
    truncate: bool = True  # yarn: the ramp's ends rounded outwards to whole pairs
    attention_factor: float | None = None  # yarn: the cosines' and sines' multiplier, None: from factor
    mscale: float | None = None  # yarn (DeepSeek): the attention factor's numerator's weight
    mscale_all_dim: float | None = None  # yarn (DeepSeek): its denominator's, and the softmax scale's
    max_positions: int | None = None  # dynamic: the longest sequence left unscaled
    short_factor: tuple[float, ...] | None = None  # longrope: each pair's divisor up to the original context
    long_factor: tuple[float, ...] | None = None  # longrope: beyond it

    def __post_init__(self) -> None:
        for name in ("theta", "factor", "low_freq_factor", "high_freq_factor", "original_positions",
                     "beta_fast", "beta_slow"):
            require_positive(getattr(self, name), f"rotary positions: {name}")
        for name in ("attention_factor", "max_positions"):
            if getattr(self, name) is not None:
                require_positive(getattr(self, name), f"rotary positions: {name}")
        for name in ("mscale", "mscale_all_dim"):
            if getattr(self, name) is not None:
                require_non_negative(getattr(self, name), f"rotary positions: {name}")
        if self.scaling == "dynamic" and self.max_positions is None:
            raise ModelSpecError("rotary positions: dynamic scaling needs max_position_embeddings (the longest "
                                 "sequence it leaves unscaled)")
        if self.scaling == "longrope":
            for name in ("short_factor", "long_factor"):
                factors = getattr(self, name)
                if not factors:
                    raise ModelSpecError(f"rotary positions: longrope scaling needs {name}, one number per "
                                         "feature pair of the rotary part")
                for index, value in enumerate(factors):
                    require_positive(value, f"rotary positions: {name}[{index}]")
            if len(self.short_factor) != len(self.long_factor):
                raise ModelSpecError(f"rotary positions: longrope's short_factor has {len(self.short_factor)} "
                                     f"numbers and its long_factor {len(self.long_factor)}: one per pair each")
        if self.scaling == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ModelSpecError(f"rotary positions: llama3 scaling needs high_freq_factor "
                                 f"({self.high_freq_factor}) above low_freq_factor ({self.low_freq_factor})")

    @property
    def built(self) -> bool:
        """Whether the executor builds these frequencies exactly (else unscaled)."""
        return self.scaling is None or self.scaling in BUILT_SCALINGS

    @functools.lru_cache(maxsize=64)  # noqa: B019 - a frozen dataclass, hashable: one list per (rope, width)
    def inverse_frequencies(self, dim: int, seq_len: int = 0) -> tuple[float, ...]:
        """``f_i`` for the ``dim / 2`` feature pairs of a ``dim``-wide rotary part, for
        sequences of ``seq_len`` tokens (only ``dynamic`` reads it; every layer's forward
        asks: computed once)."""
        theta = self.theta
        if self.scaling == "dynamic" and seq_len > self.max_positions:
            theta *= (self.factor * seq_len / self.max_positions - (self.factor - 1)) ** (dim / (dim - 2))
        plain = [theta ** (-index / dim) for index in range(0, dim, 2)]
        if self.scaling == "linear":
            return tuple(frequency / self.factor for frequency in plain)
        if self.scaling == "yarn":
            return self.yarn_frequencies(plain, dim)
        if self.scaling == "longrope":
            factors = self.long_factor if seq_len > self.original_positions else self.short_factor
            return tuple(frequency / factors[pair] for frequency, pair in
                         zip(plain, longrope_pairs(len(plain), len(factors)), strict=True))
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

    def yarn_frequencies(self, plain: list[float], dim: int) -> tuple[float, ...]:
        """YaRN's blend of ``plain`` and ``plain / factor``: the pair index where a pair
        turns ``turns`` times over the original context is ``dim ln(L / (2π turns)) / (2
        ln theta)``; pairs below the ``beta_fast`` index kept, above the ``beta_slow``
        index interpolated, a linear ramp between. The upper end is capped at ``dim - 1``
        (not ``dim / 2 - 1``), as Hugging Face and vLLM cap it."""
        def pair_turning(turns: float) -> float:
            return dim * math.log(self.original_positions / (turns * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = pair_turning(self.beta_fast), pair_turning(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as the reference implementations: no division by zero
        scaled = []
        for index, frequency in enumerate(plain):
            interpolated = min(max((index - low) / (high - low), 0.0), 1.0)
            scaled.append(frequency / self.factor * interpolated + frequency * (1 - interpolated))
        return tuple(scaled)

    @property
    def cos_sin_scale(self) -> float:
        """What the cosines and sines are multiplied by (YaRN's attention factor; 1 for
        every other rescaling)."""
        if self.scaling == "longrope":
            if self.attention_factor is not None:
                return self.attention_factor
            if self.factor <= 1:
                return 1.0
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_positions))
        if self.scaling != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def latent_softmax_scale(self) -> float:
        """What DeepSeek-V2/V3's attention multiplies its softmax scale by under YaRN:
        the ``mscale_all_dim`` term squared (1 without one)."""
        if self.scaling != "yarn" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def longrope_pairs(pairs: int, listed: int) -> list[int]:
    """Which of ``listed`` longrope factors each of a rotary part's ``pairs`` takes: its
    own where the counts agree, else pair ``i`` the listed pair ``i * listed // pairs``,
    whose base frequency is the same where ``pairs`` divides ``listed`` (a shrunk head:
    ``theta^(-2i/d)`` of ``d = 2 pairs`` at ``i`` is ``theta^(-2j/D)`` at ``j = i D / d``)."""
    return [pair * listed // pairs for pair in range(pairs)]


def yarn_mscale(factor: float, weight: float = 1.0) -> float:
    """YaRN's attention temperature term: ``0.1 weight ln(factor) + 1`` (1 when the
    context is not extended)."""
    return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0


def rope_from_config(theta: object, scaling: object, name: str, max_positions: int | None = None,
                     original_positions: object = None) -> Rope:
    """A ``Rope`` from a config's ``rope_theta`` and ``rope_scaling`` (None: unscaled);
    ``max_positions``: its ``max_position_embeddings``, which yarn takes for the original
    context when ``rope_scaling`` leaves that out, and dynamic scaling for the longest
    sequence it leaves unscaled; ``original_positions``: the config's own
    ``original_max_position_embeddings`` (Phi-3 keeps it beside ``rope_scaling``), from
    which longrope takes its factor. A value no rope takes is refused naming the file."""
    try:
        return _rope_from_config(theta, scaling, name, max_positions, original_positions)
    except ModelSpecError as error:
        message = str(error)
        raise ModelSpecError(message if message.startswith(f"{name}:") else f"{name}: {message}") from None


def _rope_from_config(theta: object, scaling: object, name: str, max_positions: int | None = None,
                      original_positions: object = None) -> Rope:
    if scaling is None:
        return Rope(theta=theta)
    if not isinstance(scaling, dict):
        raise ModelSpecError(f"{name}: rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    kind = LEGACY_NAMES.get(kind, kind)
    if kind == "longrope":
        return _longrope(theta, scaling, name, max_positions, original_positions)
    if kind in (None, "default"):
        return Rope(theta=theta)
    fields = {"factor": scaling.get("factor", 1.0)}
    original = scaling.get("original_max_position_embeddings")
    if kind == "llama3":
        fields.update(low_freq_factor=scaling.get("low_freq_factor", 1.0),
                      high_freq_factor=scaling.get("high_freq_factor", 4.0),
                      original_positions=original or 8192)
    elif kind == "yarn":
        original = original or max_positions
        if original is None:
            raise ModelSpecError(f"{name}: yarn rope scaling needs original_max_position_embeddings (or the "
                                 "config's max_position_embeddings)")
        fields.update(original_positions=original, beta_fast=scaling.get("beta_fast") or 32.0,
                      beta_slow=scaling.get("beta_slow") or 1.0, truncate=bool(scaling.get("truncate", True)),
                      attention_factor=scaling.get("attention_factor"), mscale=scaling.get("mscale"),
                      mscale_all_dim=scaling.get("mscale_all_dim"))
    elif kind == "dynamic":
        fields.update(max_positions=max_positions)
    return Rope(theta=theta, scaling=str(kind), **fields)


def _longrope(theta: object, scaling: dict, name: str, max_positions: int | None, top_level: object) -> Rope:
    """Hugging Face's longrope parameters: with an ``original_max_position_embeddings`` at
    the config's top level (Phi-3's) the factor is ``max_position_embeddings`` over it,
    else ``rope_scaling``'s own factor over ``max_position_embeddings``."""
    factor: object = scaling.get("factor", 1.0)
    original = scaling.get("original_max_position_embeddings")
    if top_level is not None:
        original = top_level
        if max_positions is not None:
            require_positive(top_level, "original_max_position_embeddings")
            factor = max_positions / top_level
    original = original or max_positions
    if original is None:
        raise ModelSpecError(f"{name}: longrope rope scaling needs original_max_position_embeddings (or the "
                             "config's max_position_embeddings)")
    lists = {}
    for key in ("short_factor", "long_factor"):
        value = scaling.get(key)
        if not isinstance(value, list):
            raise ModelSpecError(f"{name}: longrope rope scaling needs {key}, a list of one number per feature "
                                 f"pair of the rotary part, got {value!r}")
        lists[key] = tuple(value)
    return Rope(theta=theta, scaling="longrope", factor=factor, original_positions=original,
                attention_factor=scaling.get("attention_factor"), **lists)
