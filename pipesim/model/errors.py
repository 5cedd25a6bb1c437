"""The one error type of the model package, in a module of its own so that every part
of the model (specs, experts, latent attention, layouts) can raise it without
importing the others."""


class ModelSpecError(ValueError):
    """A model spec, config file or layout that cannot describe a pipeline."""


def require_count(value: object, what: str, minimum: int = 1) -> None:
    """Raise ``ModelSpecError`` unless ``value`` is an integer >= ``minimum`` (a bool is not
    a count: ``True`` would read as 1)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelSpecError(f"{what} must be an integer >= {minimum}, got {value!r}")
