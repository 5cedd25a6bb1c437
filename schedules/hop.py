"""The unloaded hop: what a transfer costs when nothing else is on its links.

The zero-bubble list schedulers (``zb-auto``, ``zbv-auto``, the adapted ``zb-h1`` and
``zb-h2``) plan with one number per step, the paper's ``T_comm``: the time from a
producer's end until its consumer on another rank can start. Here it is the slowest
wire's flight: the seconds its slowest route takes with the links free (``occupancy +
latency``, ``Route.wire``'s two parts; the data has arrived when every route's copy
has). Whoever plans an order asks ``planning_hop`` of the same ``StepTiming`` the
engine ranks the candidate orders with, so the hop and the ranking never disagree.

The posting overhead of a transfer's two ends (``comm_overhead``) is not part of the
hop: the engine charges it to the host of each rank as it posts (rendezvous, buffered),
not to the data's flight, and the free-flowing timing every candidate order is ranked
on charges none. Until this rule had one home, zb-auto and zbv-auto planned with
``hop + 2 x comm_overhead`` and the adapted zb-h1/zb-h2 with the hop alone; timed as
the step runs (lowered, rendezvous), adding the overhead made the adapted orders' steps
longer more often than shorter on random costs, and rarely changed zb-auto's or
zbv-auto's. Costs without a measured overhead (every preset and model) plan as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from schedules.engine import Route, StepTiming


def flights(routes: Iterable[Route] | None) -> list[float]:
    """Each route's seconds from departure to arrival with its links free."""
    return [occupancy + latency for _links, occupancy, latency in routes or ()]


def wire_flight(routes: Sequence[Route] | None) -> float:
    """A wire's unloaded flight: its slowest route (the data has arrived when every route's
    has); 0 for a wire of no route (it arrives at once)."""
    return max(flights(routes), default=0.0)


def planning_hop(timing: StepTiming) -> float:
    """The one ``T_comm`` a list scheduler plans with under ``timing``: the slowest wire's
    unloaded flight (see the module)."""
    return max(map(wire_flight, timing.wires or ()), default=0.0)
