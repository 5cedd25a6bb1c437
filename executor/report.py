"""What a finished run tells its user: the JSON summary and the printed lines."""

from __future__ import annotations

import json
from pathlib import Path

from executor.gather import is_fsdp
from schedules.metrics import comm_by_kind, step_metrics
from schedules.units import duration, percent, time_unit


def summary(result: dict) -> dict:
    """The ``--json`` document: the run's shape (``microbatches`` per dp replica, the
    global batch and each replica's slice of it), one loss and one step time per step,
    the measured makespan, bubble fraction and communication by kind (seconds summed
    over one pipeline's ranks) of the last step, and each rank's measured memory of the
    last step (``memory``: bytes by kind, ``executor.memory``) and, for DualPipeV, how its
    overlapped pairs ran (``pairs``). ``comm["dp"]["inside_actions"]``: the part of dp
    that ZeRO-3's (FSDP2's) collectives took inside the compute actions they serve
    (``executor.fsdp_timing``), which the accounting counts as compute, so that a dp
    "exposed 0" is not read as hidden communication."""
    trace = result["trace"]
    metrics = step_metrics(trace)
    comm = {kind: {"total": 0.0, "exposed": 0.0} for kind in ("p2p", "dp", "tp")}
    for rank in comm_by_kind(trace):
        for kind, seconds in rank.items():  # ep where the trace has its all-to-alls
            comm.setdefault(kind, {"total": 0.0, "exposed": 0.0})
            comm[kind]["total"] += seconds["total"]
            comm[kind]["exposed"] += seconds["exposed"]
    comm["dp"]["inside_actions"] = sum(event.duration for event in trace.events if event.stream == "dp"
                                       and is_fsdp(event))
    return {
        "schedule": result["schedule"],
        "pp": result["pp"],
        "dp": result.get("dp", 1),
        "tp": result.get("tp", 1),
        "ep": result.get("ep", 1),
        "etp": result.get("etp", result.get("tp", 1)),  # the routed experts' tp: 1 folded (whole on every rank)
        "cp": result.get("cp", 1),
        "cp_comm": result.get("cp_comm"),  # how the cp ranks exchanged keys and values (None without cp)
        "ep_overlap": result.get("ep_overlap", False),  # run as combined 1F1B (schedules.generators.combined)
        "microbatches": result["microbatches"],
        "copies": result.get("copies", 1),  # DualPipe's two copies of the model, each fed half the microbatches
        "global_batch_size": result.get("global_batch_size"),
        "replica_batch_size": result.get("replica_batch_size"),
        "virtual_stages": result["virtual_stages"],
        "world_size": result["world_size"],
        "backend": result["backend"],
        "losses": result["losses"],
        "step_times": result["step_times"],
        "measured_makespan": metrics.makespan,
        "bubble_fraction": metrics.bubble_fraction,
        "comm": comm,
        "memory": result.get("memory"),
        **pairs_of(result["trace"].meta),
    }


def pairs_of(meta: dict) -> dict:
    """DualPipeV's overlapped pairs as they ran (``executor.pair_streams``): rank 0's
    pairs per step, whether their halves ran on two CUDA streams, and how many of the
    last step's overlapped; nothing for a schedule without pairs."""
    if "pairs" not in meta:
        return {}
    return {"pairs": {"per_step": meta["pairs"], "streams": meta["pairs_overlap"],
                      "overlapped": meta["pairs_overlapped"]}}


def write_outputs(result: dict, json_path: str | None, trace_path: str | None, document: dict | None = None) -> None:
    """Write the ``--json`` summary (``document``, when the caller already has it) and the Trace."""
    if json_path:
        Path(json_path).write_text(json.dumps(document or summary(result), indent=2) + "\n")
    if trace_path:
        result["trace"].save(trace_path)


def summary_lines(result: dict, document: dict | None = None) -> list[str]:
    """Human-readable lines: one per step, then the measured step and bubble
    (``document`` is ``summary(result)``, when the caller already has it)."""
    document = document or summary(result)
    expert = "".join(f" {axis}={document[axis]}" for axis in ("cp", "ep") if document.get(axis, 1) > 1)
    if document.get("etp", document["tp"]) != document["tp"]:  # parallel folding
        expert += f" etp={document['etp']}"
    if document.get("cp_comm"):
        expert = expert.replace(f" cp={document['cp']}", f" cp={document['cp']} cp-comm={document['cp_comm']}")
    lines = [
        f"{document['schedule']}{' (combined 1F1B)' if document.get('ep_overlap') else ''}: "
        f"dp={document['dp']} pp={document['pp']} tp={document['tp']}{expert} "
        f"(world {document['world_size']}) virtual_stages={document['virtual_stages']} backend={document['backend']}",
        f"global batch {document['global_batch_size']}: {document['replica_batch_size']} per dp replica, "
        f"in {document['microbatches'] * document.get('copies', 1)} microbatches per replica"
        + (f" ({document['microbatches']} from each end, one copy of the model each)"
           if document.get("copies", 1) > 1 else ""),
    ]
    span = document["measured_makespan"]
    unit, _ = time_unit(max([span, *document["step_times"]]))  # one unit for every time of the run
    for step, (loss, seconds) in enumerate(zip(document["losses"], document["step_times"], strict=True)):
        lines.append(f"step {step}: loss {loss:.6f}  time {duration(seconds, unit)}")
    lines.append(f"measured step (last): makespan {duration(span, unit)}, "
                 f"bubble {percent(document['bubble_fraction'])}")
    comm = document["comm"]

    def took(seconds: float) -> str:  # a difference of equal sums is not a measured time
        return duration(0.0 if abs(seconds) < 1e-12 * span else seconds, unit)

    # The time sends spend in flight is summed over every send, and sends overlap each
    # other and the compute: a sum many times the step, so it stays in --json (p2p.total).
    held = comm["dp"].get("inside_actions", 0.0)
    inside = f"; ZeRO-3's gathers and reduce-scatters {took(held)} of it, inside compute actions" if held else ""
    lines.append("measured communication (last step, summed over one pipeline's ranks): "
                 f"blocked on p2p data in flight {took(comm['p2p']['exposed'])}; "
                 f"dp {took(comm['dp']['total'])} (exposed {took(comm['dp']['exposed'])}{inside}); "
                 f"tp {took(comm['tp']['total'])}"
                 + "".join(f"; {kind} {took(comm[kind]['total'])} ({what})"
                           for kind, what in (("ep", "all-to-alls"), ("cp", "ring waits")) if kind in comm))
    pairs = document.get("pairs")
    if pairs:
        how = (f"halves on two CUDA streams, {pairs['overlapped']} overlapped" if pairs["streams"]
               else "halves one after the other (no streams on a CPU)")
        lines.append(f"overlapped pairs (rank 0, last step): {pairs['per_step']}, {how}")
    lines.extend(memory_lines(document.get("memory")))
    return lines


def memory_lines(memory: list[dict] | None) -> list[str]:
    """One line per rank: the measured peak and what it was made of (``executor.memory``)."""
    if not memory:
        return []

    def mib(value: float) -> str:
        return f"{value / 2**20:.3f} MiB"

    if memory[0]["source"] == "cuda":
        return ["measured memory (last step, torch.cuda.max_memory_allocated): "
                + ", ".join(f"rank {row['rank']} {mib(row['peak'])}" for row in memory)]
    lines = ["measured memory (last step, tensors the executor holds, peak at action boundaries):"]
    for row in memory:
        lines.append(f"  rank {row['rank']}: peak {mib(row['peak'])} = params {mib(row['params'])} + grads "
                     f"{mib(row['grads'])} + optimizer {mib(row['optimizer'])} + activations "
                     f"{mib(row['activations'])} + buffers {mib(row['buffers'])}; most activations at once "
                     f"{mib(row['activations_peak'])}")
    return lines
