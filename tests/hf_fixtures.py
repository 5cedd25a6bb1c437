"""The Hugging Face ``config.json`` files the tests read (``pipesim/model/data/hf_configs``), and
one of them with keys changed."""

from __future__ import annotations

import json

from pipesim.model.spec import BUNDLED_CONFIGS

CONFIGS = BUNDLED_CONFIGS


def hf(name: str, **changes) -> dict:
    """The stored config ``name`` (without ``.json``) with ``changes`` over its keys."""
    return {**json.loads((CONFIGS / f"{name}.json").read_text()), **changes}
