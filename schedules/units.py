"""How every number pipesim prints is written: one rule, in one place.

Times in milliseconds below ten seconds and in seconds above (a step of 3,533 ms reads
as one number, a 40 s step does not need five digits of ms); fractions as percentages;
large counts and rates with thousands separators; bytes in GB, or MB below a tenth of a
GB (never "0.001049 GB"). Four significant digits: what a model of a step can claim.
The text tables, the summaries and the charts' labels all call these functions, so a
number reads the same in a terminal and on a chart.
"""

from __future__ import annotations

import math

SECONDS_LIMIT = 10.0  # from here on, seconds; below, milliseconds
DIGITS = 4  # significant digits


def number(value: float, digits: int = DIGITS) -> str:
    """``value`` to ``digits`` significant digits, thousands separated, never in
    scientific notation above one (``3,533``, ``27.5``, ``0.01733``)."""
    if not math.isfinite(value):
        return "n/a" if math.isnan(value) else ("∞" if value > 0 else "-∞")
    if value == 0:
        return "0"
    if abs(value) >= 1e15:  # past a million billion, separators no longer help
        return f"{value:.{digits - 1}e}"
    if abs(value) >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    return f"{value:,.{digits}g}" if abs(value) >= 1e-4 else f"{value:.{digits - 1}e}"


def time_unit(longest: float) -> tuple[str, float]:
    """The unit a column or axis of times whose largest is ``longest`` seconds is written
    in, and the factor from seconds: ms below ``SECONDS_LIMIT``, s from there."""
    return ("s", 1.0) if abs(longest) >= SECONDS_LIMIT else ("ms", 1e3)


def duration(seconds: float, unit: str | None = None) -> str:
    """``3,533 ms``, ``27.5 s``: ``seconds`` in its own unit (or the ``unit`` of the
    column it stands in, ``"ms"`` or ``"s"``; ``"units"`` for unit costs)."""
    if unit == "units":
        return f"{number(seconds)} units"
    unit = unit or time_unit(seconds)[0]
    return f"{number(seconds * (1e3 if unit == 'ms' else 1.0))} {unit}"


def percent(fraction: float, decimals: int = 1) -> str:
    """A fraction as a percentage: ``0.2727`` -> ``27.3%``."""
    if not math.isfinite(fraction):
        return "n/a"
    return f"{fraction:.{decimals}%}"


def count(value: float) -> str:
    """A count or rate with thousands separators, no decimals: ``37,126``."""
    if not math.isfinite(value):
        return "n/a"
    return f"{value:,.0f}"


def size(byte_count: float) -> str:
    """``230.1 GB``, ``12.29 GB``, ``1.049 MB``: bytes in GB, or MB below a tenth of a GB."""
    if not math.isfinite(byte_count):
        return "unbounded"
    if abs(byte_count) >= 1e8 or byte_count == 0:
        return f"{number(byte_count / 1e9)} GB"
    return f"{number(byte_count / 1e6)} MB"
