"""Flags shared by several subcommands, and turning them into schedules, costs and
topologies, so ``simulate``, ``sweep``, ``show`` and ``export`` read them identically."""

from __future__ import annotations

import argparse
import functools
import math
import sys

from executor.options import add_hidden_alias, positive_int
from pipesim.cluster.files import load_topology
from pipesim.cluster.presets import PRESETS
from pipesim.cluster.topology import Topology
from pipesim.model.costs import Costs, load_costs, uniform_costs
from schedules.generators import (
    COST_AWARE,
    DEFAULT_MAX_ACTIONS,
    MULTI_CHUNK,
    SCHEDULE_NAMES,
    generate,
    require_within_limit,
)
from schedules.p2p import P2P_SEMANTICS
from schedules.schedule import Schedule

DEFAULT_VIRTUAL_STAGES = 2  # for schedules that place several chunks per rank


DEFAULT_SCHEDULE, DEFAULT_PP, DEFAULT_MICROBATCHES = "1f1b", 4, 8


def add_schedule_args(parser: argparse.ArgumentParser, allow_file: bool = True) -> None:
    group = parser.add_argument_group("schedule")
    group.add_argument("--schedule", default=None,
                       help=f"one of {', '.join(SCHEDULE_NAMES)} (default: {DEFAULT_SCHEDULE})")
    if allow_file:
        group.add_argument("--schedule-file", help="a schedule CSV (torch.distributed.pipelining format) instead; "
                           "it fixes pp, microbatches and the stages per rank (default: none, generate --schedule)")
    group.add_argument("--pp", type=int, default=None, help=f"pipeline-parallel ranks (default: {DEFAULT_PP})")
    group.add_argument("--microbatches", "-m", type=int, default=None,
                       help=f"microbatches per step (default: {DEFAULT_MICROBATCHES})")
    group.add_argument(
        "--virtual-stages", "-v", type=positive_int, default=None,
        help=f"model chunks per rank for {', '.join(sorted(MULTI_CHUNK))} (default: {DEFAULT_VIRTUAL_STAGES}; "
        "others use 1)",
    )
    add_memory_limit_arg(group)
    add_max_actions_arg(group)


def max_actions_count(text: str) -> int:
    """``--max-actions``: a whole number >= 1 (argparse names the flag on failure)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of actions, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_max_actions_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The limit that stops a schedule too large to build before it is built."""
    parser.add_argument(
        "--max-actions", type=max_actions_count, default=DEFAULT_MAX_ACTIONS, metavar="N",
        help=f"refuse schedules of more than N lowered actions before building them (default: "
        f"{DEFAULT_MAX_ACTIONS:,}, ~2 GB to simulate)",
    )


def add_memory_limit_arg(group) -> None:
    group.add_argument(
        "--memory-limit", type=int, default=None,
        help=f"for {', '.join(sorted(COST_AWARE))}: most activation stashes a rank may hold, in microbatches "
        "(default: pp, 1F1B's peak)",
    )


def add_p2p_arg(parser: argparse.ArgumentParser, default_help: str) -> None:
    """``--p2p``: the point-to-point semantics to check and model (``schedules.p2p``)."""
    parser.add_argument(
        "--p2p", choices=P2P_SEMANTICS, default=None,
        help="point-to-point semantics: rendezvous (NCCL: a pair's transfers match in posting order and a send "
        "waits for its receive) or buffered (gloo: matched by tag, sends never wait); default: " + default_help,
    )


def reject_with_schedule_file(args: argparse.Namespace, flags: dict[str, object]) -> None:
    """A schedule file fixes the schedule, pp, microbatches and chunks per rank: a flag
    that would say otherwise is an error, not silently ignored."""
    files = args.schedule_file if isinstance(args.schedule_file, str) else ",".join(args.schedule_file)
    for flag, value in flags.items():
        if value is not None:
            raise ValueError(f"{flag} conflicts with --schedule-file {files}: the file fixes the "
                             f"schedule, pp, microbatches and stages per rank; drop {flag}")


def conflict(flag: str, other: str, why: str) -> ValueError:
    """The one form of every conflicting-flags error: both flags named, then why."""
    return ValueError(f"{flag} conflicts with {other}: {why}")


COST_FLAGS = (("--fwd", "fwd"), ("--bwd", "bwd"), ("--wgrad", "wgrad"), ("--act-bytes", "act_bytes"))
DEFAULT_FWD = 1e-3


def check_cost_flags(args: argparse.Namespace) -> None:
    """``--costs`` fixes every per-stage cost, so a cost flag beside it is refused, and
    ``--mfu`` and ``--compute-model`` only time a ``--model``'s operations; the defaults
    are filled in after."""
    if getattr(args, "costs", None):
        for flag, dest in COST_FLAGS:
            if getattr(args, dest, None) is not None:
                raise conflict(flag, f"--costs {args.costs}", f"the costs file gives every stage's costs; drop {flag}")
    if hasattr(args, "mfu") and args.mfu is not None and not getattr(args, "model", None):
        raise ValueError("--mfu needs --model: it scales the FLOPs of a model spec; give --model or drop --mfu")
    if getattr(args, "compute_model", None) and not getattr(args, "model", None):
        raise ValueError(f"--compute-model {args.compute_model} needs --model: it times a model spec's operations; "
                         "give --model or drop --compute-model")


def virtual_stages_for(name: str, requested: int | None) -> int:
    """Chunks per rank: as requested for multi-chunk schedules, 1 for the others."""
    if name in MULTI_CHUNK:
        return requested or DEFAULT_VIRTUAL_STAGES
    return 1


def schedule_from_args(args: argparse.Namespace, topology: Topology | None = None) -> Schedule:
    """Generate the named schedule, or read the CSV given with ``--schedule-file``.
    Cost-aware schedules (zb-auto) are built from the command's costs on ``topology``
    (default: free links)."""
    if getattr(args, "schedule_file", None):
        from schedules.csv_io import schedule_from_csv

        reject_with_schedule_file(args, {"--schedule": args.schedule, "--pp": args.pp,
                                         "--microbatches": args.microbatches, "--virtual-stages": args.virtual_stages})
        return schedule_from_csv(args.schedule_file)
    # No file: the flags left unset take their defaults (None marks "not given", so a
    # file can refuse them).
    args.schedule = args.schedule or DEFAULT_SCHEDULE
    args.pp = DEFAULT_PP if args.pp is None else args.pp
    args.microbatches = DEFAULT_MICROBATCHES if args.microbatches is None else args.microbatches
    if args.schedule in COST_AWARE:
        require_within_limit(args.schedule, args.pp, args.microbatches, 1, args.max_actions)
        return cost_aware_schedule_from_args(args, topology)
    if getattr(args, "memory_limit", None) is not None:
        print(f"note: --memory-limit applies to {', '.join(sorted(COST_AWARE))}; {args.schedule}'s memory is "
              "set by its order", file=sys.stderr)
    if args.virtual_stages not in (None, 1) and args.schedule not in MULTI_CHUNK:
        raise conflict(f"--virtual-stages {args.virtual_stages}", f"--schedule {args.schedule}",
                       f"{args.schedule} places one stage per rank; multi-chunk schedules are "
                       f"{', '.join(sorted(MULTI_CHUNK))}")
    return generate(args.schedule, args.pp, args.microbatches, virtual_stages_for(args.schedule, args.virtual_stages),
                    max_actions=args.max_actions)


def cost_aware_schedule_from_args(args: argparse.Namespace, topology: Topology | None) -> Schedule:
    """zb-auto from the command's costs (flags, costs file or model spec; unit costs
    F = I = W where the command has none) and its cluster's hop time."""
    from pipesim.cluster.topology import ideal_topology
    from pipesim.sim.cost_aware import build_cost_aware

    topology = topology or ideal_topology()
    if getattr(args, "model", None):
        costs = model_costs_from_args(args, generate("1f1b", args.pp, args.microbatches), topology)
    elif hasattr(args, "fwd"):
        costs = costs_from_args(args, args.pp, 1)
        if not any(stage.wgrad for stage in costs.stages):
            print(f"note: {args.schedule} with no weight-gradient time (--wgrad 0 or none in the costs file) "
                  "has no W passes to fill bubbles with", file=sys.stderr)
    else:
        costs = uniform_costs(args.pp, 1.0, 2.0, 1.0)
    devices = None
    if not topology.ideal:
        from pipesim.cluster.mapping import map_ranks

        devices = map_ranks(topology, getattr(args, "dp", 1), args.pp, getattr(args, "tp", 1),
                            getattr(args, "rank_order", "tp-dp-pp")).pipeline()
    return build_cost_aware(args.schedule, args.pp, args.microbatches, costs, topology,
                            getattr(args, "memory_limit", None), devices)


def add_cost_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("costs (per microbatch, on one pipeline rank's share of the model)")
    group.add_argument("--fwd", type=float, default=None,
                       help=f"forward seconds per microbatch (default: {DEFAULT_FWD:g})")
    group.add_argument("--bwd", type=float, default=None, help="full backward seconds (default: 2 x --fwd)")
    group.add_argument("--wgrad", type=float, default=None,
                       help="weight-gradient part of --bwd, for split backward (I = bwd - wgrad, W = wgrad) "
                       "(default: 0)")
    group.add_argument("--act-bytes", type=float, default=None,
                       help="bytes one microbatch sends between consecutive stages (default: 0)")
    group.add_argument("--stash-bytes", type=float, default=None,
                       help="activation bytes one microbatch's forward keeps until its backward, on one rank's share "
                       "(default: unknown; memory reads n/a without this or --param-bytes)")
    group.add_argument("--param-bytes", type=float, default=None,
                       help="bytes of one rank's share of the weights, in the weights' dtype (see --bytes-per-param)")
    group.add_argument("--costs", help="per-stage costs file (JSON or YAML) instead of the flags above")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    from pipesim.model.spec import PRESETS as MODELS
    from pipesim.model.spec import RECOMPUTE

    group = parser.add_argument_group("model spec (costs from FLOPs and bytes instead of --fwd/--bwd)")
    group.add_argument("--model", help=f"one of {', '.join(MODELS)}; gpt (the transformer pipesim run trains, "
                       "with run's sizes: layers 4, hidden 64, heads 4, seq-len 16, vocab 128, float32); or a "
                       "Hugging Face style config.json; the flags below override its fields (default: none, "
                       "costs from --fwd/--bwd)")
    for flag, what in (("--layers", "transformer layers"), ("--hidden", "hidden size"), ("--heads", "attention heads"),
                       ("--kv-heads", "key/value heads (grouped-query attention)"),
                       ("--ffn-hidden", "MLP intermediate size"),
                       ("--seq-len", "sequence length"), ("--vocab", "vocabulary size"),
                       ("--microbatch-size", "sequences per microbatch")):
        group.add_argument(flag, type=int, default=None, help=f"{what} (default: the model's)")
    group.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default=None,
                       help="element type of activations and weights, as pipesim run's --dtype "
                       "(default: the model's; bfloat16 for the presets, float32 for gpt)")
    add_hidden_alias(group, "--dtype-bytes", "dtype_bytes", type=int)
    group.add_argument("--mfu", type=float, default=None,
                       help="with --model: one fraction of the device's peak FLOP/s that every GEMM and attention "
                       "kernel reaches, to calibrate on a measured step (default: none, the GPU's compute model "
                       "times each kernel by its shape)")
    group.add_argument("--compute-model", default=None, metavar="FILE",
                       help="with --model: a compute model fitted on your GPU by pipesim profile --compute-model, "
                       "for every device (default: the built-in model of each device's GPU)")
    group.add_argument("--layers-per-stage", help="layers on each stage, e.g. 3,3,2,2 (default: as even as possible)")
    add_hidden_alias(group, "--layout", "layers_per_stage")
    group.add_argument("--sequence-parallel", action="store_true",
                       help="Megatron sequence parallelism: tp all-gather + reduce-scatter, activations / tp")
    group.add_argument("--recompute", choices=RECOMPUTE, default="none",
                       help="activation recomputation: full re-runs each layer's forward in its backward, selective "
                       "the attention core only (default: none)")
    group.add_argument("--no-flash-attention", action="store_true",
                       help="keep the s x s attention scores for the backward (Korthikanti et al.'s 5as/h term)")
    group.add_argument("--capacity-factor", type=float, default=None,
                       help="mixture of experts: token slots each routed expert computes, as a multiple of its "
                       "balanced share; empty slots cost time, not model FLOPs (default: dropless)")


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    from pipesim.cluster.mapping import DEFAULT_ORDER

    group = parser.add_argument_group("data and tensor parallelism, memory")
    group.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default: 1)")
    group.add_argument("--tp", type=int, default=1, help="tensor-parallel shards per pipeline rank (default: 1)")
    group.add_argument("--rank-order", default=DEFAULT_ORDER,
                       help=f"axes innermost first, e.g. tp-pp-dp (default: {DEFAULT_ORDER}, Megatron's)")
    group.add_argument("--bucket-mb", type=float, default=25.0,
                       help="gradient all-reduce bucket in MiB (default: 25, torch DDP's)")
    add_hidden_alias(group, "--dp-bucket-mb", "bucket_mb", type=float)
    group.add_argument("--no-dp-overlap", action="store_true",
                       help="reduce gradients after the rank's last action instead of bucket by bucket during "
                       "each stage's last backward (DDP's overlap)")
    group.add_argument("--zero", type=int, choices=(0, 1), default=0,
                       help="1: distributed optimizer (ZeRO-1): reduce-scatter gradients, all-gather parameters "
                       "after the optimizer step, optimizer state sharded over dp (default: 0, all-reduce)")
    group.add_argument("--collective", choices=("ring", "tree"), default="ring",
                       help="all-reduce algorithm (default: ring)")
    group.add_argument("--bytes-per-param", default="2,2,12",
                       help="memory per parameter: WEIGHTS,GRADS,OPTIMIZER bytes (default: 2,2,12, bf16 + Adam)")


def finite_flag(value: float, flag: str, positive: bool = False) -> float:
    """``value`` if it is a finite number >= 0 (> 0 with ``positive``); else a one-line
    error naming the flag and the value."""
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{flag} must be a finite number {bound}, got {value!r}")
    return value


def parallel_from_args(args: argparse.Namespace):
    """The ``ParallelConfig`` the flags describe."""
    from pipesim.sim.memory import parse_bytes_per_param
    from pipesim.sim.parallel import ParallelConfig

    bucket_mb = finite_flag(getattr(args, "bucket_mb", 25.0), "--bucket-mb", positive=True)
    return ParallelConfig(
        dp=getattr(args, "dp", 1), tp=getattr(args, "tp", 1), rank_order=getattr(args, "rank_order", "tp-dp-pp"),
        bucket_bytes=bucket_mb * 2**20, overlap_dp=not getattr(args, "no_dp_overlap", False),
        algorithm=getattr(args, "collective", "ring"), zero=getattr(args, "zero", 0),
        bytes_per_param=parse_bytes_per_param(getattr(args, "bytes_per_param", "2,2,12")),
    )


# The executor's built-in transformer (``pipesim run --model gpt``) as a model spec, so
# one name means one model in both: its defaults are run's (LayerNorm, biases, learned
# positions, an untied head, no dropout, MLP 4 x hidden, float32), so ``simulate
# --model gpt --layers 4 --hidden 64`` predicts the model that ``run --model gpt
# --layers 4 --hidden 64`` trains.
EXECUTOR_GPT = {"layers": 4, "hidden": 64, "heads": 4, "seq_len": 16, "vocab": 128, "dtype_bytes": 4}


def executor_gpt_spec(**fields: int | None):
    from dataclasses import replace

    from pipesim.model.spec import ModelSpec

    spec = ModelSpec(name="gpt", **EXECUTOR_GPT, tied_embeddings=False, dropout=False)
    return replace(spec, **{key: value for key, value in fields.items() if value is not None})


# --dtype NAME -> bytes per element; --dtype-bytes N is the old spelling, kept working
DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


def dtype_bytes_from_args(args: argparse.Namespace) -> int | None:
    dtype, size = getattr(args, "dtype", None), getattr(args, "dtype_bytes", None)
    if dtype is not None and size is not None:
        raise conflict("--dtype-bytes", f"--dtype {dtype}", "give one of them")
    return DTYPE_BYTES[dtype] if dtype is not None else size


def model_spec_from_args(args: argparse.Namespace):
    """The ``ModelSpec`` of ``--model`` with the field flags applied: a preset, a
    config.json, or the executor's ``gpt`` (``mlp`` has no transformer FLOP model)."""
    from pipesim.model.spec import model_spec

    if args.model == "mlp":
        raise ValueError("--model mlp is the executor's toy MLP; the simulator models transformers: use "
                         "--model gpt (the executor's transformer), a preset, or --fwd/--bwd")
    build = executor_gpt_spec if args.model == "gpt" else lambda **fields: model_spec(args.model, **fields)
    spec = build(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                 ffn_hidden=args.ffn_hidden, seq_len=args.seq_len, vocab=args.vocab,
                 microbatch_size=args.microbatch_size, dtype_bytes=dtype_bytes_from_args(args))
    factor = getattr(args, "capacity_factor", None)
    if factor is not None:
        spec = spec.with_capacity_factor(finite_flag(factor, "--capacity-factor", positive=True))
    return spec


def fallback_peak_flops(args: argparse.Namespace) -> float:
    """Peak FLOP/s for devices the topology gives none (ideal): ``--gpu``'s, else H100's."""
    from pipesim.cluster.gpus import gpu_spec

    return gpu_spec(getattr(args, "gpu", None)).bf16_flops


def fallback_memory_bandwidth(args: argparse.Namespace) -> float:
    """HBM bytes/s for devices the topology gives none: ``--gpu``'s, else H100's."""
    from pipesim.cluster.gpus import gpu_spec

    return gpu_spec(getattr(args, "gpu", None)).memory_bandwidth


def model_costs_from_args(args: argparse.Namespace, schedule: Schedule, topology: Topology) -> Costs:
    """Costs of ``--model`` on the devices its pipeline ranks are mapped to."""
    from pipesim.cluster.mapping import map_ranks
    from pipesim.model.transformer_costs import device_memory_bandwidth
    from pipesim.sim.memory import static_bytes_per_param

    given = [flag for flag, dest in (*COST_FLAGS, ("--costs", "costs"), ("--stash-bytes", "stash_bytes"),
                                      ("--param-bytes", "param_bytes")) if getattr(args, dest, None) is not None]
    if given:
        raise conflict(given[0], f"--model {args.model}", f"the model spec derives the costs; drop {given[0]}")
    spec = model_spec_from_args(args)
    devices = map_ranks(topology, args.dp, schedule.pp, args.tp, args.rank_order).pipeline()
    stage_devices = [devices[schedule.placement[stage]] for stage in range(schedule.num_stages)]
    peaks = [topology.device_peak_flops(device) for device in stage_devices]
    bandwidths = [device_memory_bandwidth(topology, device) for device in stage_devices]
    gpus = [topology.device_gpu(device) for device in stage_devices]
    layout = split_list(args.layers_per_stage, int) if args.layers_per_stage else None
    parallel = parallel_from_args(args)
    profiled = compute_model_from_args(args)
    return _model_costs(spec, schedule.num_stages, tuple(peaks), args.tp, args.mfu,
                        args.sequence_parallel, tuple(layout) if layout else None, args.recompute,
                        not args.no_flash_attention, fallback_peak_flops(args), tuple(bandwidths),
                        fallback_memory_bandwidth(args),
                        static_bytes_per_param(parallel.bytes_per_param, args.dp, parallel.zero),
                        tuple(schedule.placement), tuple(gpus), getattr(args, "gpu", None), profiled)


def compute_model_from_args(args: argparse.Namespace):
    """The profiled compute model of ``--compute-model FILE``, or None (read once per file)."""
    path = getattr(args, "compute_model", None)
    if not path:
        return None
    if getattr(args, "mfu", None) is not None:
        raise conflict(f"--mfu {args.mfu:g}", f"--compute-model {path}",
                       "one efficiency for every kernel or a profiled model of them; give one")
    return _load_compute_model(path)


@functools.lru_cache(maxsize=8)
def _load_compute_model(path: str):
    from pipesim.model.compute_model import load_compute_model

    return load_compute_model(path)


@functools.lru_cache(maxsize=1024)
def _model_costs(spec, num_stages: int, peaks: tuple, tp: int, mfu: float | None, sequence_parallel: bool,
                 layout: tuple | None, recompute: str, flash_attention: bool, fallback_peak: float,
                 bandwidths: tuple, fallback_bandwidth: float, optimizer_state_bytes: float,
                 stage_ranks: tuple, gpus: tuple, fallback_gpu: str | None, profiled) -> Costs:
    """``transformer_costs.model_costs``, kept per distinct input: it is a pure function of
    them and ``Costs`` never changes, and a plan asks for the same stages' costs for many
    layouts (every dp width on one kind of GPU, with and without ZeRO where it does not
    change the optimizer's bytes)."""
    from pipesim.model.transformer_costs import model_costs

    return model_costs(spec, num_stages, list(peaks), tp=tp, mfu=mfu, sequence_parallel=sequence_parallel,
                       layers_per_stage=list(layout) if layout else None, recompute=recompute,
                       flash_attention=flash_attention, fallback_peak=fallback_peak,
                       stage_memory_bandwidth=list(bandwidths), fallback_memory_bandwidth=fallback_bandwidth,
                       optimizer_state_bytes=optimizer_state_bytes, stage_ranks=list(stage_ranks),
                       stage_gpus=list(gpus), fallback_gpu=fallback_gpu, compute_model=profiled)


def costs_from_args(args: argparse.Namespace, num_stages: int, virtual_stages: int) -> Costs:
    """Uniform costs from the flags, or the costs file; chunk costs are per-rank / v."""
    check_cost_flags(args)
    if args.costs:
        return load_costs(args.costs, num_stages, virtual_stages)
    fwd = DEFAULT_FWD if args.fwd is None else args.fwd
    bwd = 2 * fwd if args.bwd is None else args.bwd
    return uniform_costs(num_stages, fwd, bwd, args.wgrad or 0.0, args.act_bytes or 0.0, virtual_stages,
                         stash_bytes=getattr(args, "stash_bytes", None), param_bytes=getattr(args, "param_bytes", None))


def add_topology_args(parser: argparse.ArgumentParser) -> None:
    from pipesim.cluster.gpus import GPUS

    group = parser.add_argument_group("cluster")
    group.add_argument("--topology", default="ideal",
                       help=f"preset ({', '.join(PRESETS)}) or a YAML/JSON topology file (default: ideal)")
    group.add_argument("--nodes", type=int, default=None, help="nodes for the multi-node presets (ib, ethernet)")
    group.add_argument("--gpu", choices=tuple(GPUS), default=None,
                       help="GPU model of the presets' devices: peak, memory, NVLink (default: h100)")


def topology_from_args(args: argparse.Namespace) -> Topology:
    return load_topology(args.topology, args.nodes, getattr(args, "gpu", None))


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
