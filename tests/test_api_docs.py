"""Every ```python block of docs/api.md runs, in order, as one script in a fresh folder:
the examples a user copies into a script (or a notebook) stay true (their own asserts
check the closed forms they quote), spawned ranks included."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks(text: str) -> list[str]:
    return BLOCK.findall(text)


def test_doc_has_examples():
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) >= 5
    assert any("pipesim.run(" in block for block in blocks)


def test_api_doc_examples_run_as_a_script(tmp_path):
    """As a user runs them: ``python examples.py``, so ``pipesim.run``'s spawned ranks
    import the script again (what the ``__main__`` guard is for)."""
    import os
    import subprocess

    script = tmp_path / "examples.py"
    script.write_text("\n".join(python_blocks(DOC.read_text())))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(DOC.parents[1])})
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "gantt.html").stat().st_size < 200_000  # plotly="cdn": no embedded plotly.js
    assert (tmp_path / "measured.html").stat().st_size > 1_000_000  # inline: plotly.js embedded


def test_import_pipesim_loads_neither_torch_nor_plotly():
    import subprocess

    code = "import sys, pipesim; pipesim.simulate; print(sorted({'torch', 'plotly'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_uniform_costs_take_v_from_the_schedule():
    """The trap the API closes: per-rank costs given as a stage count on an interleaved
    schedule charge every chunk a whole rank's share, doubling the step at v=2."""
    import pipesim
    from pipesim.model.costs import uniform_costs

    schedule = pipesim.schedule("interleaved-1f1b", pp=2, microbatches=4, virtual_stages=2)
    from_schedule = uniform_costs(schedule, 2e-3, 4e-3)
    assert [stage.fwd for stage in from_schedule.stages] == [1e-3] * 4
    assert pipesim.uniform_costs(schedule, 2e-3, 4e-3) == from_schedule
    with pytest.raises(ValueError, match="contradicts"):
        uniform_costs(schedule, 2e-3, 4e-3, virtual_stages=1)
    # closed form m(F+B) + (p-1)(F+B)/v with F+B = 6 ms per rank
    assert pipesim.simulate(schedule, from_schedule).metrics.makespan == pytest.approx(4 * 6e-3 + 6e-3 / 2)


def test_readme_python_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    readme = DOC.parents[1] / "README.md"
    blocks = python_blocks(readme.read_text())
    assert blocks, "the README shows the Python API"
    for index, block in enumerate(blocks):
        exec(compile(block, f"README.md block {index + 1}", "exec"), {"__name__": "__readme__"})  # noqa: S102
    assert (tmp_path / "gantt.html").exists()


def test_run_without_the_main_guard_is_named_at_once(tmp_path):
    """A script calling ``pipesim.run`` at its top level would have every spawned rank run
    it again; it is refused before any rank starts, naming the line and the guard."""
    import os
    import subprocess

    script = tmp_path / "train.py"
    script.write_text("import pipesim\n\nresult = pipesim.run('1f1b', pp=2, microbatches=2, model='mlp', layers=2, "
                      "hidden=8, batch_size=4, steps=1)\n")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": str(DOC.parents[1])})
    assert done.returncode != 0
    assert f"{script}, line 3: pipesim.run starts its ranks" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr


def test_guarded_and_aliased_calls_are_told_apart():
    import ast

    from pipesim.script_guard import _unguarded_run_calls

    guarded = "import pipesim\nif __name__ == '__main__':\n    pipesim.run('1f1b')\n"
    in_function = "import pipesim\ndef main():\n    pipesim.run('1f1b')\nmain.__name__\n"
    aliased = "from pipesim import run as launch\nfor _ in range(2):\n    launch('1f1b')\n"
    other_run = "import asyncio, subprocess\nfrom subprocess import run\nrun(['true'])\nasyncio.run(None)\n"
    assert _unguarded_run_calls(ast.parse(guarded)) == []
    assert _unguarded_run_calls(ast.parse(in_function)) == []
    assert _unguarded_run_calls(ast.parse(aliased)) == [3]
    assert _unguarded_run_calls(ast.parse(other_run)) == []
