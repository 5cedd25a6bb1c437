"""Flags shared by several subcommands, and turning them into schedules, costs and
topologies, so ``simulate``, ``sweep``, ``show`` and ``export`` read them identically."""

from __future__ import annotations

import argparse
import sys

from pipesim.costs import Costs, load_costs, uniform_costs
from pipesim.presets import PRESETS
from pipesim.topology import Topology
from pipesim.topology_file import load_topology
from schedules.generators import GENERATORS, MULTI_CHUNK, generate
from schedules.schedule import Schedule

DEFAULT_VIRTUAL_STAGES = 2  # for schedules that place several chunks per rank


def add_schedule_args(parser: argparse.ArgumentParser, allow_file: bool = True) -> None:
    group = parser.add_argument_group("schedule")
    group.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(GENERATORS)} (default: 1f1b)")
    if allow_file:
        group.add_argument("--schedule-file", help="a schedule CSV (torch.distributed.pipelining format) instead")
    group.add_argument("--pp", type=int, default=4, help="pipeline-parallel ranks (default: 4)")
    group.add_argument("--microbatches", "-m", type=int, default=8, help="microbatches per step (default: 8)")
    group.add_argument(
        "--virtual-stages", "-v", type=int, default=None,
        help=f"model chunks per rank for {', '.join(sorted(MULTI_CHUNK))} (default: {DEFAULT_VIRTUAL_STAGES}; "
        "others use 1)",
    )


def virtual_stages_for(name: str, requested: int | None) -> int:
    """Chunks per rank: as requested for multi-chunk schedules, 1 for the others."""
    if name in MULTI_CHUNK:
        return requested or DEFAULT_VIRTUAL_STAGES
    return 1


def schedule_from_args(args: argparse.Namespace) -> Schedule:
    """Generate the named schedule, or read the CSV given with ``--schedule-file``."""
    if getattr(args, "schedule_file", None):
        from schedules.csv_io import schedule_from_csv

        return schedule_from_csv(args.schedule_file)
    if args.virtual_stages not in (None, 1) and args.schedule not in MULTI_CHUNK:
        print(
            f"note: --virtual-stages {args.virtual_stages} applies to {', '.join(sorted(MULTI_CHUNK))}; "
            f"{args.schedule} uses one stage per rank",
            file=sys.stderr,
        )
    return generate(args.schedule, args.pp, args.microbatches, virtual_stages_for(args.schedule, args.virtual_stages))


def add_cost_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("costs (per microbatch, on one pipeline rank's share of the model)")
    group.add_argument("--fwd", type=float, default=1e-3, help="forward seconds per microbatch (default: 1e-3)")
    group.add_argument("--bwd", type=float, default=None, help="full backward seconds (default: 2 x --fwd)")
    group.add_argument("--wgrad", type=float, default=0.0,
                       help="weight-gradient part of --bwd, for split backward (I = bwd - wgrad, W = wgrad)")
    group.add_argument("--act-bytes", type=float, default=0.0,
                       help="bytes one microbatch sends between consecutive stages (default: 0)")
    group.add_argument("--costs", help="per-stage costs file (JSON or YAML) instead of the flags above")


def costs_from_args(args: argparse.Namespace, num_stages: int, virtual_stages: int) -> Costs:
    """Uniform costs from the flags, or the costs file; chunk costs are per-rank / v."""
    if args.costs:
        return load_costs(args.costs, num_stages)
    bwd = 2 * args.fwd if args.bwd is None else args.bwd
    return uniform_costs(num_stages, args.fwd, bwd, args.wgrad, args.act_bytes, virtual_stages)


def add_topology_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster")
    group.add_argument("--topology", default="ideal",
                       help=f"preset ({', '.join(PRESETS)}) or a YAML/JSON topology file (default: ideal)")
    group.add_argument("--nodes", type=int, default=None, help="nodes for the multi-node presets (ib, ethernet)")


def topology_from_args(args: argparse.Namespace) -> Topology:
    return load_topology(args.topology, args.nodes)


def split_list(text: str, cast=str) -> list:
    """``"8,16,32"`` -> ``[8, 16, 32]``; errors name the bad item."""
    items = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            items.append(cast(item))
        except ValueError as error:
            raise ValueError(f"{item!r} in {text!r} is not a valid {cast.__name__}") from error
    if not items:
        raise ValueError(f"empty list: {text!r}")
    return items
