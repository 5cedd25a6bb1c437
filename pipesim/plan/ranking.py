"""Two rankings of the same layouts, and how far they agree: by the deterministic step
and by the p99 of sampled steps (``pipesim.sim.whatif``).

A schedule that wins on paper can lose its lead once ranks straggle: one with less slack
(fewer bubbles to absorb a late rank) degrades more. Kendall's tau says how much of the
paper ranking survives: 1, the same order; -1, reversed; ties (schedules equally fast)
are handled as tau-b does, so a tie in one ranking that the other breaks costs
agreement without counting as a reversal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence


def kendall_tau(first: Sequence[float], second: Sequence[float]) -> float:
    """Kendall's tau-b between two scorings of the same items: (concordant - discordant)
    pairs over the geometric mean of the pairs each leaves untied. NaN when either
    scoring ties every pair (nothing to rank)."""
    if len(first) != len(second):
        raise ValueError(f"kendall_tau needs two scorings of the same items, got {len(first)} and {len(second)}")
    concordant = discordant = untied_first = untied_second = 0
    for i in range(len(first)):
        for j in range(i + 1, len(first)):
            a = (first[i] > first[j]) - (first[i] < first[j])
            b = (second[i] > second[j]) - (second[i] < second[j])
            untied_first += a != 0
            untied_second += b != 0
            concordant += a * b > 0
            discordant += a * b < 0
    if not untied_first or not untied_second:
        return float("nan")
    return (concordant - discordant) / math.sqrt(untied_first * untied_second)


def label(row: dict) -> str:
    """A sweep row's name in a ranking: schedule, then the shape where rows differ in it."""
    text = f"{row['schedule']} pp={row['pp']} m={row['microbatches']}"
    return text + (f" v={row['virtual_stages']}" if int(row.get("virtual_stages") or 1) > 1 else "")


def ranking_lines(rows: Sequence[dict], step: str = "makespan", name: Callable[[dict], str] = label) -> list[str]:
    """The rows ranked by deterministic step (field ``step``) and by sampled p99, side by
    side, and the Kendall tau between the two orders (rows without a p99 are left out)."""
    ranked = [row for row in rows if row.get("step_time_p99") is not None]
    if not ranked:
        return []
    by_step = sorted(ranked, key=lambda row: row[step])
    by_p99 = sorted(ranked, key=lambda row: row["step_time_p99"])
    width = max(len(name(row)) for row in ranked)
    lines = [f"{'rank':>4}  {'by deterministic step':<{width + 13}}  by p99 of sampled steps"]
    for place, (paper, sampled) in enumerate(zip(by_step, by_p99, strict=True), 1):
        lines.append(f"{place:>4}  {name(paper):<{width}} {paper[step]:>12.6g}  "
                     f"{name(sampled):<{width}} {sampled['step_time_p99']:>12.6g}")
    tau = kendall_tau([row[step] for row in ranked], [row["step_time_p99"] for row in ranked])
    agreement = "n/a: every row ties" if math.isnan(tau) else f"{tau:+.3f}"
    lines.append(f"Kendall tau between the two rankings: {agreement} (1: same order, -1: reversed)")
    return lines
