"""The executor: run a lowered pipeline schedule on real processes with torch.distributed.

Python API (torch is imported on first use, so importing ``executor`` stays cheap)::

    from executor import RunConfig, launch, run_local, PipelineModel

    results = launch(RunConfig(schedule="1f1b", pp=4, microbatches=8, model="gpt"))
    results[0]["losses"], results[0]["trace"]
    launch(RunConfig(pp=2, model="mixtral-8x7b", layers=4, hidden=64, experts=4))  # an architecture, shrunk

Pass ``model=`` (a ``PipelineModel`` subclass defined at module level, so it can be
pickled to the ranks) to pipeline your own ``nn.Module`` stages; ``run_local`` runs a
``pp=1`` config in this process; ``reference_run`` is the unpipelined reference.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from executor.config import ConfigError, RunConfig

_LAZY = {
    "launch": "executor.launch",
    "PipelineRunError": "executor.launch",
    "PipelineModel": "executor.models",
    "build_model": "executor.models",
    "reference_run": "executor.reference",
    "run_local": "executor.worker",
    "RankFailedError": "executor.worker",
}

__all__ = ["ConfigError", "RunConfig", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'executor' has no attribute {name!r}")
    return getattr(import_module(module), name)
