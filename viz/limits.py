"""The memory lines every chart draws: the usable limit out of memory is judged against
(the device's capacity less the headroom it keeps back) and the capacity itself.

One place, so that a point above the usable line is exactly a point the simulator called
out of memory, whichever chart it is on, and a point between the two lines is not read as
fitting because it sits below "device memory".
"""

from __future__ import annotations

from dataclasses import dataclass

OOM_COLOR = "#C0392B"
CAPACITY_COLOR = "#7F7F7F"


@dataclass(frozen=True)
class MemoryLine:
    """One line to draw: where (GB), its label, its colour and dash."""

    gigabytes: float
    label: str
    color: str
    dash: str


def memory_lines(rows: list[dict]) -> list[MemoryLine]:
    """The usable limit (``usable_bytes``) and the capacity (``capacity_bytes``) of the
    smallest device among ``rows``, each labelled; the capacity alone, said so, when the
    rows do not carry the limit they were judged against; none for unbounded devices."""
    capacities = [row["capacity_bytes"] for row in rows if row.get("capacity_bytes")]
    if not capacities:
        return []
    capacity = min(capacities) / 1e9
    usable = [row["usable_bytes"] for row in rows if row.get("usable_bytes")]
    capacity_line = MemoryLine(capacity, f"device capacity {capacity:,.1f} GB", CAPACITY_COLOR, "dot")
    if not usable:
        return [MemoryLine(capacity, f"device capacity {capacity:,.1f} GB (usable limit not given)", OOM_COLOR,
                           "dash")]
    limit = min(usable) / 1e9
    headroom = next((row["memory_headroom"] for row in rows if row.get("memory_headroom")), None)
    kept = f"capacity less {headroom} headroom" if headroom else "capacity less headroom"
    limit_line = MemoryLine(limit, f"usable limit {limit:,.1f} GB ({kept}): above it, out of memory", OOM_COLOR,
                            "dash")
    return [limit_line] if abs(limit - capacity) < 1e-9 else [limit_line, capacity_line]
