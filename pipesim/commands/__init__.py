"""Subcommands of ``pipesim``; each module exposes ``register(subparsers)``."""
