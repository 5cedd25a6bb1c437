"""How the profile turns timings into one number per cost, on a machine that is not
always the same speed.

Each cost is measured in ``ROUNDS`` rounds spread over the profile, and the estimate is
the median of the per-round means. Each round's mean is the quantity wanted (a step is a
sum of many actions, and its expected value is the sum of the means); the median across
rounds sets aside a round that a slow spell of the machine covered. On a shared 2-core
VM such spells are real and last about a second: one profile saw a stage's thread CPU
time run 50% high through a whole second-long loop while the other rank's did not move,
and the cost of a transfer drifts between 180 and 360 us from one second to the next.
"""

from __future__ import annotations

import statistics

ROUNDS = 5
DEFAULT_MIN_TIME = 1.0  # seconds of timed work per stage, and for the transfer cost


def robust_mean(round_means: list[float]) -> float:
    """The median of per-round means (see the module docstring)."""
    if not round_means:
        raise ValueError("no timing rounds to estimate from")
    return statistics.median(round_means)
