"""The what-if flags (``--jitter``, ``--straggler``, ``--stragglers``, ``--slow-link``,
``--samples``, ``--seed``) shared by ``simulate`` and ``sweep``, and what they become: a
``pipesim.sim.variability.Variability``, or None when none was given (one deterministic
step, as before)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from pipesim.sim.variability import (
    Variability,
    parse_jitter,
    parse_slow_link,
    parse_straggler,
    parse_straggler_share,
)

DEFAULT_SAMPLES = 1000
FLAGS = ("jitter", "straggler", "stragglers", "slow_link", "samples")


def add_variability_args(parser: argparse.ArgumentParser, seed: bool = True) -> None:
    """The what-if flags; ``seed=False`` where the command has a ``--seed`` of its own
    (``compare``: the run's), which then seeds the draws too."""
    group = parser.add_argument_group(
        "what-if: step time as a distribution (docs/whatif.md)")
    group.add_argument("--jitter", metavar="CV",
                       help="each action's time drawn around its cost, lognormal of mean 1 with this coefficient of "
                       "variation; one number for every kind, or per kind: F=0.05,B=0.08,comm=0.2 (kinds F, B, I, W, "
                       "comm: P2P transfers) (default: none)")
    group.add_argument("--straggler", action="append", metavar="RANK:FACTOR",
                       help="pipeline rank RANK computes FACTOR times slower, e.g. 3:1.5; repeatable (default: none)")
    group.add_argument("--stragglers", metavar="FRACTION:FACTOR",
                       help="each sample, a random FRACTION of the GPUs computes FACTOR times slower; a pipeline "
                       "rank straggles when any GPU of its tp group does (default: none)")
    group.add_argument("--slow-link", action="append", metavar="A-B:FACTOR",
                       help="transfers between pipeline ranks A and B take FACTOR times their wire time, e.g. "
                       "3-4:2; repeatable (default: none)")
    group.add_argument("--samples", type=int, default=None,
                       help=f"steps drawn (default: {DEFAULT_SAMPLES} when any flag above is given)")
    if seed:
        group.add_argument("--seed", type=int, default=0, help="seed of the draws (default: 0)")


def variability_from_args(args: argparse.Namespace) -> Variability | None:
    """The ``Variability`` the flags ask for; None when no what-if flag was given."""
    if not any(getattr(args, flag, None) is not None for flag in FLAGS):
        return None
    stragglers: dict[int, float] = {}
    for text in args.straggler or ():
        rank, factor = parse_straggler(text)
        if rank in stragglers:
            raise ValueError(f"--straggler {text}: rank {rank} is already named; give each rank once")
        stragglers[rank] = factor
    slow_links: dict[tuple[int, int], float] = {}
    for text in args.slow_link or ():
        link, factor = parse_slow_link(text)
        if link in slow_links:
            raise ValueError(f"--slow-link {text}: link {link[0]}-{link[1]} is already named; give each link once")
        slow_links[link] = factor
    return Variability(
        jitter=parse_jitter(args.jitter) if args.jitter is not None else {},
        stragglers=stragglers,
        straggler_share=parse_straggler_share(args.stragglers) if args.stragglers is not None else None,
        slow_links=slow_links,
        samples=DEFAULT_SAMPLES if args.samples is None else args.samples,
        seed=getattr(args, "seed", 0),
    )


def write_whatif_page(path: str, whatif, plotly: str) -> None:
    """``--html`` of a what-if run: the distribution, then the Gantts of the median and
    the p99 sample (``viz.whatif``)."""
    from schedules.units import time_unit as seconds_unit
    from viz.whatif import write_whatif_html

    samples = {name: whatif.sample_at(name) for name in ("p50", "p99")}
    traces = [whatif.trace(sample) for sample in samples.values()]
    unit, scale = seconds_unit(float(whatif.step_times.max()))
    titles = [f"{name} sample #{sample}: {whatif.step_times[sample] * scale:.4g} {unit}"
              for name, sample in samples.items()]
    schedule = whatif.deterministic.schedule
    write_whatif_html(whatif.step_times, whatif.deterministic.metrics.makespan, whatif.quantiles, traces, titles, path,
                      title=f"{schedule.name} pp={schedule.pp} m={schedule.microbatches}: step time over "
                      f"{len(whatif.step_times)} samples", plotly=plotly)


def objective_variability(args: argparse.Namespace) -> Variability | None:
    """``plan --objective p99``: the draws to rank layouts by (a what-if flag is needed);
    None for the deterministic objective, which refuses what-if flags rather than
    ignoring them."""
    variability = variability_from_args(args)
    if args.objective == "p99" and variability is None:
        raise ValueError("--objective p99 needs what varies: give --jitter, --straggler, --stragglers or --slow-link")
    if args.objective != "p99" and variability is not None:
        raise ValueError("--jitter, --straggler, --stragglers, --slow-link and --samples rank layouts only with "
                         "--objective p99; add it or drop them")
    return variability


def rank_by_p99(rows: list[dict], top: int, variability: Variability, simulate_row: Callable) -> None:
    """Sample the first ``top`` of ``rows`` (the layouts the deterministic search ranked
    best; ``simulate_row(row)`` simulates one as ``pipesim simulate`` does) and put them
    in order of their sampled p99, each with ``step_time_mean``, ``step_time_p99`` and
    ``tokens_per_second_p99`` (the step's tokens over its p99)."""
    from pipesim.sim.whatif import sample_steps

    for row in rows[:top]:
        try:
            whatif = sample_steps(simulate_row(row), variability)
        except ValueError as error:  # a rank or link this layout's pipeline lacks
            raise ValueError(f"{error} (layout {row['layout']}; fix pp with --constraint pp=N to name ranks, or "
                             "use --stragglers FRACTION:FACTOR)") from None
        row["step_time_mean"] = whatif.mean
        row["step_time_p99"] = whatif.quantiles["p99"]
        row["tokens_per_second_p99"] = row["tokens_per_second"] * row["step_time"] / row["step_time_p99"]
    rows[:top] = sorted(rows[:top], key=lambda row: (row["step_time_p99"], row["layout"]))
