"""``python -m pipesim`` is the ``pipesim`` command."""

from pipesim.cli import entry

entry()
