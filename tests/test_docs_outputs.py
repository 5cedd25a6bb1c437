"""The README's quoted outputs are what the code prints now (``scripts/docs_outputs.py``
regenerates them; CI checks the ones whose commands take seconds)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "docs_outputs.py"


@pytest.fixture(scope="module")
def docs_outputs():
    spec = importlib.util.spec_from_file_location("docs_outputs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_outputs"] = module  # a dataclass looks its module up by name
    spec.loader.exec_module(module)
    return module


def test_quoted_outputs_equal_what_the_code_prints(docs_outputs):
    differing = docs_outputs.regenerate([entry for entry in docs_outputs.QUOTED if not entry.slow], check=True)
    assert not differing, "run: python scripts/docs_outputs.py --fast\n" + "\n".join(differing)


def test_every_quoted_command_is_in_its_file(docs_outputs):
    for entry in docs_outputs.QUOTED:
        text = (SCRIPT.parents[1] / entry.path).read_text(encoding="utf-8")
        docs_outputs.quoted_block(text, entry.command)  # raises if the file no longer quotes it


def test_excerpt_keeps_the_selected_lines_in_order(docs_outputs):
    output = "head\n  a 1\n  b 2\n  a 3\n  c 4\ntail\n"
    assert docs_outputs.excerpt(output, ("head", "  a", "...", "  a", "...", "tail")) == \
        "head\n  a 1\n  ...\n  a 3\n  ...\ntail\n"
    with pytest.raises(RuntimeError, match="no output line starting 'x'"):
        docs_outputs.excerpt(output, ("head", "x"))
