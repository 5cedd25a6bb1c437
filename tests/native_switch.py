"""The tests' switch between a C loop and its Python twin: a module's ``ACCELERATED``
set for the length of a block."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType


@contextmanager
def accelerated(module: ModuleType, native: bool) -> Iterator[None]:
    """``module`` runs its C loop (True) or its Python twin (False) inside the block."""
    saved = module.ACCELERATED
    module.ACCELERATED = native
    try:
        yield
    finally:
        module.ACCELERATED = saved
