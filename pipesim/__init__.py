"""pipesim: predict, run and compare pipeline-parallel training schedules.

The Python API (``docs/api.md`` has runnable examples)::

    import pipesim
    schedule = pipesim.schedule("1f1b", pp=4, microbatches=8)
    result = pipesim.simulate(schedule, pipesim.uniform_costs(schedule, fwd=1e-3, bwd=2e-3), "nvlink")
    print(result.summary())
    pipesim.plot(result, path="gantt.html")

Functions are loaded on first use, so ``import pipesim`` (and the ``pipesim`` command)
stays fast and never imports torch or plotly until asked to run or draw.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# Not ``costs``/``topology``/``plan``: those are submodules (``pipesim.model.costs``,
# ``pipesim.plan``), which an import of them would bind over a function of the same name
# (the planner is ``pipesim.api.plan``).
API = ("schedule", "load_schedule", "save_schedule", "load_topology", "uniform_costs", "load_costs", "model_costs",
       "simulate", "whatif", "plot", "load_trace", "run", "Job", "simulate_job", "PlanRequest")

__all__ = [*API, "__version__"]


def __getattr__(name: str) -> Any:
    if name in API:
        return getattr(import_module("pipesim.api"), name)
    if name == "api":  # the module itself (``pipesim.api.plan``), loaded on first use
        return import_module("pipesim.api")
    if name == "__version__":
        from pipesim.cli import version  # noqa: PLC0415

        return version()
    raise AttributeError(f"module 'pipesim' has no attribute {name!r}")
