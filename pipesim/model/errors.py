"""The one error type of the model package, in a module of its own so that every part
of the model (specs, experts, latent attention, layouts) can raise it without
importing the others."""

import math


class ModelSpecError(ValueError):
    """A model spec, config file or layout that cannot describe a pipeline."""


# The most layers a model may have: a thousand times the deepest trained today. Work
# grows with the layer count (stages are split layer by layer), so a config that says
# 10^9 is refused at once rather than run for minutes.
MAX_LAYERS = 100_000


def require_positive(value: object, what: str) -> None:
    """Raise ``ModelSpecError`` unless ``value`` is a finite number > 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ModelSpecError(f"{what} must be a number > 0, got {value!r}")


def require_non_negative(value: object, what: str) -> None:
    """Raise ``ModelSpecError`` unless ``value`` is a finite number >= 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ModelSpecError(f"{what} must be a number >= 0, got {value!r}")


def require_count(value: object, what: str, minimum: int = 1, maximum: int | None = None) -> None:
    """Raise ``ModelSpecError`` unless ``value`` is an integer >= ``minimum`` (and <=
    ``maximum`` when given; a bool is not a count: ``True`` would read as 1)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelSpecError(f"{what} must be an integer >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ModelSpecError(f"{what} must be at most {maximum:,}, got {value:,}")
