"""What a finished run tells its user: the JSON summary and the printed lines."""

from __future__ import annotations

import json
from pathlib import Path

from schedules.metrics import step_metrics


def summary(result: dict) -> dict:
    """The ``--json`` document: the run's shape, one loss and one step time per step,
    and the measured makespan and bubble fraction of the last step."""
    metrics = step_metrics(result["trace"])
    return {
        "schedule": result["schedule"],
        "pp": result["pp"],
        "microbatches": result["microbatches"],
        "virtual_stages": result["virtual_stages"],
        "world_size": result["world_size"],
        "backend": result["backend"],
        "losses": result["losses"],
        "step_times": result["step_times"],
        "measured_makespan": metrics.makespan,
        "bubble_fraction": metrics.bubble_fraction,
    }


def write_outputs(result: dict, json_path: str | None, trace_path: str | None) -> None:
    if json_path:
        Path(json_path).write_text(json.dumps(summary(result), indent=2) + "\n")
    if trace_path:
        result["trace"].save(trace_path)


def summary_lines(result: dict) -> list[str]:
    """Human-readable lines: one per step, then the measured step and bubble."""
    document = summary(result)
    lines = [
        f"{document['schedule']}: pp={document['pp']} microbatches={document['microbatches']} "
        f"virtual_stages={document['virtual_stages']} backend={document['backend']}"
    ]
    for step, (loss, seconds) in enumerate(zip(document["losses"], document["step_times"], strict=True)):
        lines.append(f"step {step}: loss {loss:.6f}  time {seconds * 1000:.2f} ms")
    lines.append(f"measured step (last): makespan {document['measured_makespan'] * 1000:.2f} ms, "
                 f"bubble fraction {document['bubble_fraction']:.3f}")
    return lines
