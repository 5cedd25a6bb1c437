"""The what-if flags (``--jitter``, ``--straggler``, ``--stragglers``, ``--slow-link``,
``--samples``, ``--seed``) shared by ``simulate`` and ``sweep``, and what they become: a
``pipesim.sim.variability.Variability``, or None when none was given (one deterministic
step, as before)."""

from __future__ import annotations

import argparse

from pipesim.sim.variability import (
    Variability,
    parse_jitter,
    parse_slow_link,
    parse_straggler,
    parse_straggler_share,
)

DEFAULT_SAMPLES = 1000
FLAGS = ("jitter", "straggler", "stragglers", "slow_link", "samples")


def add_variability_args(parser: argparse.ArgumentParser) -> None:
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
        seed=args.seed,
    )


def write_whatif_page(path: str, whatif, plotly: str) -> None:
    """``--html`` of a what-if run: the distribution, then the Gantts of the median and
    the p99 sample (``viz.whatif``)."""
    from viz.whatif import write_whatif_html

    samples = {name: whatif.sample_at(name) for name in ("p50", "p99")}
    traces = [whatif.trace(sample) for sample in samples.values()]
    titles = [f"{name} sample #{sample}: {whatif.step_times[sample] * 1e3:.4g} ms" for name, sample in samples.items()]
    schedule = whatif.deterministic.schedule
    write_whatif_html(whatif.step_times, whatif.deterministic.metrics.makespan, whatif.quantiles, traces, titles, path,
                      title=f"{schedule.name} pp={schedule.pp} m={schedule.microbatches}: step time over "
                      f"{len(whatif.step_times)} samples", plotly=plotly)
