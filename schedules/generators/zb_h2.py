"""ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Section 2.2): the
bubble closed by spending memory.

Rank ``r`` runs ``2(p - r) - 1`` warm-up forwards, enough to keep it busy until the
first input gradient comes back, then the input-gradient passes ``I`` as soon as they
arrive, forwards while it holds fewer than ``2p - 1`` stashes, and weight passes ``W``
in every gap, so the layout becomes a parallelogram: with F = I = W and free links each
rank computes without a gap from its first action to its last once ``m >= 2p``
(the paper's zero bubble; the step still starts ``p - 1`` forwards later on the last
rank). Peak memory: ``2p - 1`` stashes on rank 0, about twice 1F1B's.

The order is fixed, built once on the unit-time grid the paper draws it on (the greedy
rules of ``greedy_zero_bubble`` with F = I = W = 1); it does not depend on real costs.
Under communication time T it keeps a bubble of ``(p-1)(F + I - 2W + 2T)`` where that
is positive (the paper's Section 2.2 remark); ``zb-auto`` re-plans for real costs.
"""

from __future__ import annotations

from schedules.generators.common import require_single_chunk
from schedules.generators.greedy_zero_bubble import greedy_orders
from schedules.schedule import Schedule, looped_placement


def zb_h2(pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The unit-cost zero-bubble order with ``2p - 1`` stashes per rank."""
    require_single_chunk("zb-h2", virtual_stages)
    unit = [1.0] * pp
    programs = greedy_orders(pp, microbatches, unit, unit, unit, comm=0.0, memory_limit=2 * pp - 1)
    return Schedule(pp, microbatches, looped_placement(pp, 1), programs, name="zb-h2",
                    meta={"memory_microbatches": 2 * pp - 1})
