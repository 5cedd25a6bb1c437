"""``pipesim export``: write a schedule as CSV for torch.distributed.pipelining, or a layout
for torchtitan.

The file is built exactly as ``simulate`` builds the order (same flags, so a zb-auto order
from ``--model`` costs is the one ``simulate`` and ``plan`` predicted). Forms:

- compute-only (default): torch lowers it itself when it loads it;
- ``--lowered``: the form torch's runtime runs as written (``_load_csv(...,
  format="compute_comms")``): one action per cell, each transfer posted alone, pipesim's
  transfers checked not to hang torch's runtime on NCCL, and torch's ``REDUCE_GRAD`` (with
  ``--fsdp`` also ``UNSHARD``/``RESHARD``) where torch's own lowering puts them;
- ``--lowered --groups``: pipesim's own form, P2P groups joined by ``+`` in one cell, for
  pipesim's executor (torch cannot read it);
- ``--torchtitan DIR``: both CSVs and the config torchtitan reads (``pipesim.cli.torchtitan``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from pipesim.cli.options import (
    add_cost_args,
    add_model_args,
    add_p2p_arg,
    add_parallel_args,
    add_schedule_args,
    add_topology_args,
)
from pipesim.job import Job, conflict, schedule_of, topology_of
from pipesim.model.loss_traffic import TORCHTITAN_CROSS_ENTROPY
from schedules.p2p import RENDEZVOUS


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export", help="write a schedule as CSV (torch.distributed.pipelining format), or a layout for torchtitan",
        description="Write a schedule as CSV: one row per rank, one action per cell; or, with --torchtitan, the "
        "CSVs and the config torchtitan reads. The order is built as `pipesim simulate` builds it from the same flags.",
    )
    add_schedule_args(parser, allow_file=False)
    add_cost_args(parser)  # zb-auto builds its order from the costs and the cluster's hop time
    add_model_args(parser)
    add_parallel_args(parser, context_and_experts=False)
    add_topology_args(parser)
    output = parser.add_argument_group("output")
    output.add_argument("--out", help="CSV file to write (default: none; give --out or --torchtitan)")
    output.add_argument("--lowered", action="store_true",
                        help="include the SEND/RECV actions, in the form torch's runtime runs as written: one action "
                        "per cell, each transfer posted alone (checked not to hang it on NCCL), torch's REDUCE_GRAD "
                        "after each stage's last backward")
    output.add_argument("--flat", action="store_true",
                        help="the torch form of --lowered, said explicitly (it is the default)")
    output.add_argument("--groups", action="store_true",
                        help="with --lowered: pipesim's own form instead, each P2P group in one cell joined by '+', "
                        "for `pipesim run --schedule-file` (torch cannot read it)")
    output.add_argument("--fsdp", action="store_true",
                        help="the dp replicas shard parameters with FSDP (torchtitan's data_parallel_shard_degree): "
                        "the lowered file gets torch's UNSHARD/RESHARD around each stage's compute; without it dp "
                        "replicates them (DDP, data_parallel_replicate_degree)")
    output.add_argument("--torchtitan", metavar="DIR",
                        help="write DIR/schedule.csv (compute-only, what torchtitan loads), "
                        "DIR/schedule-lowered.csv and DIR/torchtitan.args (torchtitan 0.3's command-line overrides, "
                        "to append last); a model's order is built with the loss torchtitan runs (--cross-entropy "
                        "torch) (default: none)")
    output.add_argument("--from-plan", metavar="PLAN.json",
                        help="take the layout (schedule, pp, tp, dp, cp, ep, virtual stages, microbatch size and "
                        "count, recompute, zero, sequence parallelism) and the model (which a --model may repeat, not "
                        "change) from a `pipesim plan --json` file; give the plan's --topology, --nodes and "
                        "--seq-len too, so the order is the one it simulated (default: none)")
    output.add_argument("--plan-rank", "--row", type=int, default=1,
                        help="which of the plan's ranked layouts --from-plan takes, 1 = the best, as the plan's table "
                        "and run --plan --row number them (default: 1)")
    output.add_argument("--torch-class", metavar="NAME",
                        help="the torch schedule class torchtitan builds the stages with (default: the one matching "
                        "the schedule's placement); one that places them otherwise is refused")
    add_p2p_arg(parser, "rendezvous (NCCL's rule, which also holds on gloo); only for --groups, the torch form is "
                "checked under torch's runtime rules on NCCL")
    parser.set_defaults(handler=handle, output_dirs=("torchtitan",))


def check_flags(args: argparse.Namespace) -> None:
    """Refuse flags that contradict each other or do nothing here, naming them."""
    if not args.out and not args.torchtitan:
        raise ValueError("export: give --out FILE (a schedule CSV) or --torchtitan DIR (CSVs and torchtitan's config)")
    if args.out and args.torchtitan:
        raise conflict("--out", f"--torchtitan {args.torchtitan}", "--torchtitan writes its own CSVs into the "
                       "folder; give one of them")
    if args.groups and args.flat:
        raise conflict("--groups", "--flat", "a file is either pipesim's grouped form or torch's flat one")
    if (args.groups or args.flat) and not args.lowered:
        flag = "--groups" if args.groups else "--flat"
        raise ValueError(f"{flag} describes how a lowered file holds its transfers; add --lowered")
    if args.fsdp and args.groups:
        raise conflict("--fsdp", "--groups", "UNSHARD/RESHARD are torch's actions, written in its form only")
    if args.fsdp and args.out and not args.lowered:
        raise ValueError("--fsdp adds torch's UNSHARD/RESHARD to a lowered file (torch adds its own when it lowers a "
                         "compute-only one): add --lowered")
    if args.p2p and not args.groups:
        raise ValueError(f"--p2p {args.p2p} checks pipesim's grouped form (--lowered --groups); the files torch runs "
                         "are checked under torch's runtime rules on NCCL")
    if args.torch_class and not args.torchtitan:
        raise ValueError("--torch-class names the class torchtitan builds the stages with; add --torchtitan DIR")
    if args.torchtitan and (args.lowered or args.groups):
        raise conflict("--lowered" if args.lowered else "--groups", f"--torchtitan {args.torchtitan}",
                       "--torchtitan writes both the compute-only and the lowered CSV")
    if args.torchtitan and args.zero and not args.fsdp:
        raise conflict(f"--zero {args.zero}", f"--torchtitan {args.torchtitan}",
                       "torchtitan's sharded data parallelism is FSDP (ZeRO-3: parameters, gradients and "
                       "optimizer state sharded): pass --fsdp, or drop --zero")
    if args.torchtitan and args.layers_per_stage:
        raise conflict(f"--layers-per-stage {args.layers_per_stage}", f"--torchtitan {args.torchtitan}",
                       "torchtitan gives every stage the same layers (pipeline_parallel_layers_per_stage); "
                       "give --layers instead")


def handle(args: argparse.Namespace) -> int:
    from pipesim.cli.torchtitan import priced_as_torchtitan_shards
    from schedules.csv_io import schedule_to_csv
    from schedules.lowering import lower
    from schedules.torch_runtime import lower_for_torch_runtime
    from schedules.validate import validate

    if args.from_plan:
        apply_plan_layout(args)
    check_flags(args)
    job = Job.from_namespace(args)
    if args.torchtitan and job.model and job.cross_entropy is None:  # priced with the loss torchtitan runs
        job = replace(job, cross_entropy=TORCHTITAN_CROSS_ENTROPY)
    if args.torchtitan and args.fsdp:
        line = priced_as_torchtitan_shards(job)  # refuses a layout torchtitan's FSDP would not fit
        if line:
            print(f"note: {line}", file=sys.stderr)
    schedule = schedule_of(job, topology_of(job))
    if args.torchtitan:
        return write_layout(args, schedule)
    if args.lowered and args.groups:
        schedule = lower(schedule)
        validate(schedule, args.p2p or RENDEZVOUS)
    elif args.lowered:
        schedule = lower_for_torch_runtime(schedule)
    else:
        validate(schedule)
    schedule_to_csv(schedule, args.out, groups=args.groups, fsdp=args.fsdp)
    form = "pipesim's grouped form" if args.groups else "torch's form" if args.lowered else "compute-only"
    print(f"wrote {args.out}: {schedule.name}, pp={schedule.pp}, stages={schedule.num_stages}, "
          f"microbatches={schedule.microbatches}, {schedule.num_actions} actions ({form})")
    return 0


# plan's layout fields -> (export's flag, its argparse destination, the value meaning "not given")
PLAN_FIELDS = {"schedule": ("--schedule", "schedule", None), "pp": ("--pp", "pp", None),
               "microbatches": ("--microbatches", "microbatches", None),
               "virtual_stages": ("--virtual-stages", "virtual_stages", None),
               "microbatch_group": ("--microbatch-group", "microbatch_group", None), "tp": ("--tp", "tp", 1),
               "dp": ("--dp", "dp", 1), "microbatch_size": ("--microbatch-size", "microbatch_size", None),
               "recompute": ("--recompute", "recompute", "none"), "zero": ("--zero", "zero", 0),
               "sequence_parallel": ("--sequence-parallel", "sequence_parallel", False),
               "recompute_moe_act": ("--recompute-moe-act", "recompute_moe_act", False)}


def apply_plan_layout(args: argparse.Namespace) -> None:
    """Set the layout flags from ``--from-plan``'s ranked layout ``--plan-rank``; a layout
    flag given as well is refused (the plan already decides it)."""
    import json

    from pipesim.cli.files import read_text

    try:
        ranked = json.loads(read_text(args.from_plan, "plan JSON")).get("ranked")
    except (json.JSONDecodeError, AttributeError):
        ranked = None
    if not isinstance(ranked, list) or not ranked:
        raise ValueError(f"--from-plan {args.from_plan}: not a `pipesim plan --json` file with ranked layouts")
    if not 1 <= args.plan_rank <= len(ranked):
        raise ValueError(f"--plan-rank {args.plan_rank}: {args.from_plan} ranks {len(ranked)} layouts (1 to "
                         f"{len(ranked)})")
    row = ranked[args.plan_rank - 1]
    apply_plan_model(args, row)
    for field, (flag, dest, unset) in PLAN_FIELDS.items():
        if getattr(args, dest) != unset:
            raise conflict(flag, f"--from-plan {args.from_plan}", f"the plan's layout sets {field}; drop {flag}")
        if field not in row:
            # a plan written before groups were searched: the schedule's own; before the experts'
            # activation could be recomputed: not recomputed
            if field in ("microbatch_group", "recompute_moe_act"):
                continue
            raise ValueError(f"--from-plan {args.from_plan}: layout {args.plan_rank} has no {field!r}")
        setattr(args, dest, row[field])
    for field in ("cp", "ep"):  # no flags of export's: the plan's layout alone sets them
        setattr(args, field, row.get(field, 1))
    args.etp = row.get("etp") or None  # the experts folded (1), else split over tp
    args.ep_overlap = bool(row.get("ep_overlap", False))  # combined 1F1B: the order the plan simulated


def apply_plan_model(args: argparse.Namespace, row: dict) -> None:
    """Build the model the layout was planned for (a row names it: a preset, or a config's
    absolute path, and its ``--qkv``), as ``run --plan`` does (``pipesim.cli.plan_row.planned_model``); a
    ``--model`` (``--qkv``) may repeat it (a config by any path to the same file) but not change it.
    A plan written before rows named their model leaves ``--model`` to the user."""
    from pipesim.plan.request import model_reference

    planned = row.get("model")
    if not planned:
        return
    if args.model is not None and model_reference(args.model) != planned:
        raise conflict(f"--model {args.model}", f"--from-plan {args.from_plan}",
                       f"layout {args.plan_rank} was planned for {planned}; drop --model")
    args.model = planned
    qkv = row.get("qkv")  # how the planned model built Q, K and V (rows before --qkv: the flag's)
    if qkv is not None and args.qkv not in ("separate", qkv):
        raise conflict(f"--qkv {args.qkv}", f"--from-plan {args.from_plan}",
                       f"layout {args.plan_rank} was planned with --qkv {qkv}; drop --qkv")
    args.qkv = qkv or args.qkv
    seq_len = row.get("seq_len")  # the sequence the plan priced (rows before it carried one: the model's)
    if seq_len is not None and getattr(args, "seq_len", None) not in (None, seq_len):
        raise conflict(f"--seq-len {args.seq_len}", f"--from-plan {args.from_plan}",
                       f"layout {args.plan_rank} was planned for {seq_len}-token sequences; drop --seq-len")
    if seq_len is not None:
        args.seq_len = seq_len


def write_layout(args: argparse.Namespace, schedule) -> int:
    """``--torchtitan DIR``: the files and their summary."""
    from pipesim.cli.torchtitan import write_torchtitan

    written = write_torchtitan(args.torchtitan, schedule, layout_from_args(args))
    print(f"wrote {', '.join(str(path) for path in written)}: {schedule.name}, pp={schedule.pp}, "
          f"stages={schedule.num_stages}, microbatches={schedule.microbatches}")
    return 0


def layout_from_args(args: argparse.Namespace):
    """The ``TorchtitanLayout`` that the flags (``export``'s, or a plan layout's ``Job``)
    describe; the model's layers and sequence length where a
    ``--model`` or ``--layers``/``--seq-len`` gives them, and its ``--qkv`` with a ``--model``."""
    from pipesim.cli.torchtitan import TorchtitanLayout, qkv_of
    from pipesim.job import clip_grad_of

    layers, seq_len = getattr(args, "layers", None), getattr(args, "seq_len", None)
    microbatch_size = getattr(args, "microbatch_size", None) or 1
    qkv = None
    if getattr(args, "model", None):
        from pipesim.job import Job, model_spec_of

        spec = model_spec_of(Job.from_namespace(args))
        layers, seq_len, microbatch_size, qkv = spec.layers, spec.seq_len, spec.microbatch_size, qkv_of(spec)
    return TorchtitanLayout(dp=getattr(args, "dp", 1), tp=getattr(args, "tp", 1), fsdp=getattr(args, "fsdp", False),
                            microbatch_size=microbatch_size, layers=layers, seq_len=seq_len,
                            torch_class=getattr(args, "torch_class", None), ep=getattr(args, "ep", 1),
                            etp=getattr(args, "etp", None) or 0,
                            cp=getattr(args, "cp", 1), sequence_parallel=getattr(args, "sequence_parallel", False),
                            recompute=getattr(args, "recompute", "none"),
                            recompute_moe_act=getattr(args, "recompute_moe_act", False), qkv=qkv,
                            max_norm=clip_grad_of(args))
