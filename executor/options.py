"""The flags of a run, shared by ``pipesim run`` and ``python -m executor``.

Imports no torch, so ``pipesim --help`` stays fast; the config is checked here so a bad
flag is reported before any process starts.
"""

from __future__ import annotations

import argparse

from executor.architectures.build import CPU_SIZES as CPU
from executor.architectures.build import GPU_SIZES as GPU
from executor.architectures.build import MAX_EXPERTS, is_architecture
from executor.config import (
    ADAMW_BETAS,
    BACKENDS,
    CP_COMMS,
    DTYPES,
    MODELS,
    OPTIMIZER_DEFAULTS,
    OPTIMIZERS,
    P2P_SEMANTICS,
    RECOMPUTE_MODES,
    ConfigError,
    RunConfig,
)
from executor.lr_schedule import LR_DECAYS
from executor.token_data import BYTE_VOCAB
from pipesim.model.spec import model_names
from schedules.generators import MULTI_CHUNK

# The same schedule defaults as the simulator (pipesim.cli.options): pp 4 with
# m = 2 pp, the project's standard example, so `simulate` and `run` with no flags describe
# the same pipeline and `compare` needs none. Four CPU processes run the default tiny
# mlp (one layer per stage) in seconds.
DEFAULT_SCHEDULE, DEFAULT_PP, DEFAULT_MICROBATCHES = "1f1b", 4, 8
DEFAULT_BATCH = 8  # global samples a step when --batch-size is not given (more with dp: batch_size)
# Three steps by default: the first is cold (allocator, autograd graph, gloo buffers:
# a 190 ms first forward against ~20 ms warm), and the chart and --trace show the last.
DEFAULT_STEPS = 3


def positive_int(text: str) -> int:
    """argparse type for counts that must be >= 1 (``-v 0`` is an error, not a default)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_hidden_alias(group, alias: str, dest: str, **kwargs) -> None:
    """An old spelling kept working but left out of ``--help`` (one name per thing)."""
    group.add_argument(alias, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)


def add_run_arguments(parser: argparse.ArgumentParser, outputs: bool = True) -> None:
    """Add the schedule, model, training and runtime flags to ``parser``; ``outputs``:
    also what only a training run uses: ``--steps``, ``--lr``, ``--weight-decay``,
    ``--inject-failure``, ``--json`` and ``--trace`` (profile times passes and an
    optimizer step at learning rate 0, so it takes none of them)."""
    schedule = parser.add_argument_group("schedule")
    schedule.add_argument("--schedule", default=None, help=f"a generated schedule (default {DEFAULT_SCHEDULE})")
    schedule.add_argument("--schedule-file", default=None, metavar="CSV",
                          help="run the order in this schedule CSV (torch.distributed.pipelining format) instead; "
                               "it fixes pp, microbatches and the stages per rank (default: none, generate --schedule)")
    schedule.add_argument("--pp", type=int, default=None,
                          help=f"pipeline ranks, one process each (default {DEFAULT_PP}; 1: no pipeline)")
    schedule.add_argument("--microbatches", "-m", type=int, default=None,
                          help=f"microbatches per dp replica and step (default {DEFAULT_MICROBATCHES})")
    schedule.add_argument("--dp", type=int, default=1,
                          help="data-parallel replicas (world size = dp * pp * tp * cp) (default 1)")
    schedule.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage (gpt only) (default 1)")
    schedule.add_argument("--ep", type=int, default=1,
                          help="expert-parallel ranks: each MoE layer's experts split over groups of this many of the "
                               "dp x cp ranks, tokens sent to them by all-to-all (must divide dp x cp; with --etp 1, "
                               "tp x cp x dp) (default 1)")
    schedule.add_argument("--etp", type=int, default=None,
                          help="with a mixture of experts: the routed experts' own tensor parallelism, Megatron-Core's "
                               "parallel folding (--expert-tensor-parallel-size): 1 keeps every expert whole on each "
                               "rank and cuts the ep groups from every tp x cp x dp rank of a stage, each rank "
                               "dispatching its own shard of the sequence (needs --sequence-parallel with --tp > 1); "
                               "the executor runs 1 or --tp (default: --tp, no folding)")
    schedule.add_argument("--cp", type=int, default=1,
                          help="context-parallel ranks per replica: each holds 2 of 2 x cp chunks of every sequence "
                               "(world size x cp) (default 1)")
    schedule.add_argument("--cp-comm", choices=CP_COMMS, default="p2p",
                          help="how cp ranks exchange keys and values: p2p, ring attention, blocks passed rank to "
                               "rank with isend/irecv and merged by log-sum-exp (Transformer Engine's ring), or "
                               "all-gather before attention (Llama 3) (default p2p, as simulate and plan price cp)")
    schedule.add_argument("--sequence-parallel", action="store_true",
                          help="with --tp: Megatron sequence parallelism: norms on sequence shards, an "
                               "all-gather before each sublayer and a reduce-scatter after it; each sublayer "
                               "keeps its input's shard and gathers it again before its backward")
    schedule.add_argument("--bucket-mb", dest="dp_bucket_mb", type=float, metavar="MB", default=25.0,
                          help="gradient all-reduce bucket size in MiB (default 25, as DDP)")
    add_hidden_alias(schedule, "--dp-bucket-mb", "dp_bucket_mb", type=float)
    schedule.add_argument("--zero", type=int, default=0, metavar="{0,1,2,3}",
                          help="with --dp: 1 shards the optimizer state over the replicas (gradients "
                               "reduce-scattered, parameters all-gathered), 2 the gradients too, 3 the parameters "
                               "too (FSDP2 fully_shard per block); with --cp over the dp x cp ranks, with --ep the "
                               "routed experts over their expert data-parallel group (default 0)")
    schedule.add_argument("--virtual-stages", "-v", type=positive_int, default=None,
                          help=f"stages per rank (default 2 for {', '.join(sorted(MULTI_CHUNK))}; else 1)")
    add_microbatch_group_arg(schedule)
    schedule.add_argument("--ep-overlap", action="store_true",
                          help="with --ep: Megatron-Core's combined 1F1B (--overlap-moe-expert-parallel-comm): one "
                               "more warm-up forward per rank, then each steady-state forward run with the backward "
                               "after it as one step (two CUDA streams on a GPU, one after the other on a CPU); "
                               "interleaved-1f1b, or 1f1b at pp 1, without full recompute (default: off)")
    model = parser.add_argument_group("model and data (synthetic, deterministic from --seed)")
    model.add_argument("--model", default="mlp",
                       help=f"{' or '.join(MODELS)} (toys), or an architecture shrunk to this machine: "
                            f"{', '.join(model_names())} or a Hugging Face config.json, as simulate --model takes "
                            "(default mlp)")
    model.add_argument("--layers", type=int, default=None, help=f"layers in the whole model (default {CPU['layers']}; "
                       f"an architecture on a GPU {GPU['layers']})")
    model.add_argument("--hidden", type=int, default=None,
                       help=f"hidden size (default {CPU['hidden']}; an architecture on a GPU {GPU['hidden']})")
    model.add_argument("--batch-size", type=int, default=None,
                       help="global samples per step: split across dp replicas, then cut into microbatches "
                       f"(default {DEFAULT_BATCH}, or one sample a microbatch of every dp replica where that is "
                       "more)")
    model.add_argument("--seq-len", type=int, default=None,
                       help=f"tokens per sample (default {CPU['seq_len']}; an architecture on a GPU {GPU['seq_len']})")
    model.add_argument("--vocab", type=int, default=None,
                       help=f"vocabulary size (default {CPU['vocab']}; with --data {BYTE_VOCAB}; an architecture on "
                       f"a GPU {GPU['vocab']})")
    model.add_argument("--heads", type=int, default=None,
                       help=f"attention heads (default {CPU['heads']}; an architecture on a GPU {GPU['heads']})")
    model.add_argument("--kv-heads", type=int, default=None,
                       help="architectures: key/value heads (default: the original's heads / kv-heads ratio)")
    model.add_argument("--ffn-hidden", type=int, default=None,
                       help="architectures: MLP width; experts keep their width relative to it (default: the "
                       "original's ratio to the hidden size)")
    model.add_argument("--qkv", default="separate", metavar="separate|fused",
                       help="architectures: the attention's Q, K and V as three linears (separate) or one wqkv "
                       "(fused: torchtitan 0.3's Llama 3, its weights laid out key/value group by group as torchtitan "
                       "lays them out); the same model and numerics, it only changes what --recompute per-op keeps "
                       "and re-runs (fused keeps K's output, re-runs the output and up projections only) "
                       "(default: separate)")
    model.add_argument("--experts", type=int, default=None,
                       help=f"mixture of experts: routed experts (default: the original's, at most {MAX_EXPERTS}; "
                       "top-k cut to half of them when fewer)")
    model.add_argument("--capacity-factor", type=float, default=None,
                       help="mixture of experts: each expert takes at most factor * k * seq-len / experts tokens "
                       "of a sequence and drops the rest (default: dropless)")
    model.add_argument("--expert-bias-rate", type=float, default=None, metavar="RATE",
                       help="mixture of experts with a sigmoid router (DeepSeek-V3): after each step every expert's "
                       "selection bias moves by RATE towards balance, up where the expert took fewer than the mean "
                       "of the step's routed tokens, down where more (auxiliary-loss-free balancing; default: "
                       "0.001, DeepSeek-V3's and Megatron-Core's; 0 keeps the biases at zero)")
    model.add_argument("--balance-loss", type=float, default=None, metavar="COEF",
                       help="mixture of experts: the coefficient of the load-balancing loss each MoE layer adds "
                       "(Switch Transformer's E * sum f_e P_e, per sequence as Megatron-Core's seq_aux_loss and "
                       "DeepSeek's sequence-wise loss; default: the config's router_aux_loss_coef or aux_loss_alpha, "
                       "Mixtral's 0.02, none where it names none; 0 leaves it out)")
    model.add_argument("--data", default=None, metavar="FILE",
                       help=f"train on this local text file, byte-level tokens (vocabulary {BYTE_VOCAB}) "
                       "(default: synthetic tokens)")
    model.add_argument("--layers-per-stage", dest="layout", default=None, metavar="LIST",
                       help="layers per stage, comma-separated, e.g. 1,3,3,1 (default: as even as possible; an "
                       "architecture: split as simulate --model splits it)")
    add_hidden_alias(model, "--layout", "layout")
    model.add_argument("--recompute", choices=RECOMPUTE_MODES, default="none",
                       help="activation recompute per block: full (the whole block), selective (its attention "
                            "core only, Megatron's) or per-op (torchtitan's SelectiveAC: matmul and attention outputs "
                            "kept but every second matmul's, all else recomputed; no I/W split), with "
                            "torch.utils.checkpoint; or norm-mla-up (DeepSeek-V3's: every norm's output and latent "
                            "attention's Q, K and V dropped after the forward and rebuilt before the backward, no "
                            "GEMM re-run) (default none)")
    model.add_argument("--recompute-moe-act", action="store_true",
                       help="mixture of experts: Megatron-Core's moe_act recompute module: each routed expert's "
                            "activation checkpointed and its output dropped after the down projection read it, "
                            "rebuilt before that projection's backward (the experts keep the gate and up "
                            "outputs alone) (default: off)")
    train = parser.add_argument_group("training")
    if outputs:
        train.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                           help="training steps (default %(default)s; the chart and --trace show the last, warm one)")
    train.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
    (sgd_lr, sgd_decay), (adamw_lr, adamw_decay) = OPTIMIZER_DEFAULTS["sgd"], OPTIMIZER_DEFAULTS["adamw"]
    train.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                       help=f"sgd (plain) or adamw (betas {ADAMW_BETAS}, as in LLM pretraining) (default sgd)")
    if outputs:
        train.add_argument("--lr", type=float, default=None,
                           help=f"learning rate (default: the optimizer's own: sgd {sgd_lr:g}, adamw {adamw_lr:g})")
        train.add_argument("--lr-warmup", type=int, default=0, metavar="STEPS",
                           help="warm the learning rate up linearly over the first STEPS steps, from "
                           "lr / (STEPS + 1) (default 0: none)")
        train.add_argument("--lr-decay", choices=LR_DECAYS, default="none",
                           help="after the warm-up, decay the learning rate over the rest of the run, linearly or "
                           "along a half cosine, to --min-lr-ratio of it, as Megatron-LM and torchtitan schedule it "
                           "(default none: constant)")
        train.add_argument("--min-lr-ratio", type=float, default=0.0, metavar="R",
                           help="the decay's floor as a share of the learning rate (Megatron-LM's --min-lr over "
                           "--lr) (default 0)")
        train.add_argument("--weight-decay", type=float, default=None,
                           help=f"decoupled weight decay on matrices, never on biases or norm weights "
                           f"(default: sgd {sgd_decay:g}, adamw {adamw_decay:g})")
    train.add_argument("--clip-grad", type=float, default=None, metavar="NORM",
                       help="clip the gradients' global norm to NORM before each optimizer step, as "
                       "torch.nn.utils.clip_grad_norm_ (Megatron-LM, torchtitan and DeepSeek-V3 train with 1.0); "
                       "one all-reduce of a number over every rank (default: no clipping)")
    train.add_argument("--dtype", choices=DTYPES, default="float32",
                       help="float32/float64: the whole model in that type; bfloat16/float16: float32 master "
                       "weights, compute under autocast, loss in float32 (float16 with dynamic loss scaling) "
                       "(default float32)")
    train.add_argument("--grad-reduce-dtype", choices=DTYPES, default=None,
                       help="type of the dp gradient all-reduce on the wire (default: the master weights', "
                       "float32, or float64 with --dtype float64)")
    runtime = parser.add_argument_group("runtime")
    runtime.add_argument("--backend", choices=BACKENDS, default="auto",
                         help="auto: nccl with CUDA, else gloo (default auto)")
    runtime.add_argument("--timeout", type=float, default=60.0,
                         help="seconds a rank waits on a peer before the job fails (default 60)")
    runtime.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    runtime.add_argument("--p2p", choices=P2P_SEMANTICS, default=None,
                         help="point-to-point semantics the schedule is checked and run under: rendezvous "
                              "(NCCL's rule, emulated on gloo) or buffered (gloo's); default: the backend's")
    runtime.add_argument("--verbose", action="store_true",
                         help="show every rank's output and a failed rank's traceback on the console")
    if not outputs:
        return
    runtime.add_argument("--inject-failure", default=None, metavar="RANK:ACTION:MODE",
                         help="testing aid: make RANK raise|kill|hang before ACTION of step 0, e.g. 1:1B0:kill "
                         "(default: none)")
    output = parser.add_argument_group("output")
    output.add_argument("--json", default=None, metavar="PATH", help="write the run summary as JSON")
    output.add_argument("--trace", default=None, metavar="PATH", help="write the measured Trace of the last step")


MICROBATCH_GROUP_HELP = (
    "interleaved-1f1b: microbatches a rank runs on one model chunk before the next, N; rank r runs "
    "2(pp-r-1) + (v-1)N forwards before its first backward, so a smaller N holds fewer stashes. Megatron-Core's "
    "--microbatch-group-size-per-virtual-pipeline-stage, the flexible N of Meta's Llama 3 schedule; its range: "
    "pp <= N <= microbatches, microbatches mod N zero or >= pp (outside it the order deadlocks)"
)


def add_microbatch_group_arg(group) -> None:
    """``--microbatch-group N``: interleaved-1f1b's group size (Megatron-Core, Meta); the
    one spelling for ``run`` and the simulator's commands."""
    group.add_argument(
        "--microbatch-group", type=positive_int, default=None, metavar="N",
        help=MICROBATCH_GROUP_HELP + " (default: pp where pp divides microbatches; otherwise "
        "microbatches / max(1, microbatches // pp), as torch.distributed.pipelining)",
    )


def refuse_copies(config: RunConfig, command: str) -> None:
    """``profile`` times the stages of one copy of the model; DualPipe's two copies
    (``pipesim run`` executes them, ``pipesim compare`` times them in its run) are refused
    in one line."""
    if config.copies > 1:
        raise ValueError(f"{command} --schedule dualpipe: {command} measures the stages of one copy of the model, "
                         f"and dualpipe runs two; compare it with `pipesim compare --schedule dualpipe` (which "
                         f"times the stages in its own run), or {command} --schedule dualpipev (the same steps "
                         f"folded in a V)")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The checked ``RunConfig`` the flags describe."""
    if args.schedule_file:
        shape = schedule_file_shape(args)
    else:
        name = args.schedule or DEFAULT_SCHEDULE
        virtual = args.virtual_stages
        if virtual is None:
            virtual = 2 if name in MULTI_CHUNK else 1
        elif virtual != 1 and name not in MULTI_CHUNK:
            raise ConfigError(f"--virtual-stages {virtual} conflicts with --schedule {name}: {name} places one "
                              f"stage per rank; multi-chunk schedules are {', '.join(sorted(MULTI_CHUNK))}")
        shape = {"schedule": name, "pp": DEFAULT_PP if args.pp is None else args.pp,
                 "microbatches": DEFAULT_MICROBATCHES if args.microbatches is None else args.microbatches,
                 "virtual_stages": virtual, "microbatch_group": getattr(args, "microbatch_group", None),
                 "ep_overlap": getattr(args, "ep_overlap", False)}
        planned = getattr(args, "custom_schedule", None)  # a plan row's own order (pipesim.cli.plan_row)
        if planned is not None:
            shape["custom_schedule"] = planned
    layout = None
    if args.layout:
        try:
            layout = tuple(int(part) for part in args.layout.split(","))
        except ValueError:
            raise ConfigError(f"--layers-per-stage {args.layout!r} must be comma-separated layer counts, "
                              "e.g. 1,3,3,1") from None
    config = RunConfig(
        **shape, dp=args.dp, tp=args.tp, ep=args.ep, etp=getattr(args, "etp", None), cp=args.cp, cp_comm=args.cp_comm,
        sequence_parallel=args.sequence_parallel, dp_bucket_mb=args.dp_bucket_mb,
        zero=args.zero, recompute=args.recompute, recompute_moe_act=args.recompute_moe_act,
        model=args.model, batch_size=batch_size(args, shape["microbatches"]), **model_sizes(args), seed=args.seed,
        kv_heads=args.kv_heads, ffn_hidden=args.ffn_hidden, qkv=args.qkv, experts=args.experts,
        capacity_factor=args.capacity_factor, expert_bias_rate=args.expert_bias_rate,
        balance_loss=args.balance_loss, data=args.data,
        steps=getattr(args, "steps", DEFAULT_STEPS),
        optimizer=args.optimizer, lr=getattr(args, "lr", None),
        weight_decay=getattr(args, "weight_decay", None), clip_grad=args.clip_grad, dtype=args.dtype,
        lr_warmup=getattr(args, "lr_warmup", 0), lr_decay=getattr(args, "lr_decay", "none"),
        min_lr_ratio=getattr(args, "min_lr_ratio", 0.0),
        grad_reduce_dtype=args.grad_reduce_dtype, backend=args.backend, timeout=args.timeout,
        threads=args.threads, layout=layout, inject_failure=getattr(args, "inject_failure", None), p2p=args.p2p,
    )
    config.check()
    return config


def batch_size(args: argparse.Namespace, microbatches: int) -> int:
    """``--batch-size``, else ``DEFAULT_BATCH`` or, where more, one sample for each of
    every dp replica's microbatches (so ``--dp 2`` needs no ``--batch-size`` of its own)."""
    if args.batch_size is not None:
        return args.batch_size
    return max(DEFAULT_BATCH, getattr(args, "dp", 1) * microbatches)


def model_sizes(args: argparse.Namespace) -> dict:
    """``--layers/--hidden/--heads/--seq-len/--vocab`` as given, else the sizes a run
    takes on this machine (``executor.architectures.build``: an architecture on a GPU runs
    larger; on a CPU, and the toys everywhere, the small ones); ``--data`` asks for the
    byte vocabulary."""
    sizes = CPU
    if is_architecture(args.model) and args.backend != "gloo":
        import torch  # noqa: PLC0415 - only to ask whether this machine has a GPU

        sizes = GPU if args.backend == "nccl" or torch.cuda.is_available() else CPU
    given = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "seq_len": args.seq_len,
             "vocab": args.vocab if args.vocab is not None or not args.data else BYTE_VOCAB}
    return {key: sizes[key] if value is None else value for key, value in given.items()}


def schedule_file_shape(args: argparse.Namespace) -> dict:
    """The config fields a ``--schedule-file`` fixes: the schedule itself, its pp, its
    microbatch count and its stages per rank. Flags that would say otherwise are refused
    rather than silently overridden."""
    from schedules.csv_io import schedule_from_csv  # noqa: PLC0415

    for flag, value in (("--schedule", args.schedule), ("--pp", args.pp), ("--microbatches", args.microbatches),
                        ("--virtual-stages", args.virtual_stages),
                        ("--microbatch-group", getattr(args, "microbatch_group", None)),
                        ("--ep-overlap", True if getattr(args, "ep_overlap", False) else None)):
        if value is not None:
            raise ConfigError(f"{flag} conflicts with --schedule-file {args.schedule_file}: the file fixes the "
                              f"schedule, pp, microbatches and stages per rank; drop {flag}")
    schedule = schedule_from_csv(args.schedule_file)
    counts = {rank: len(schedule.stages_of(rank)) for rank in range(schedule.pp)}
    if len(set(counts.values())) != 1:
        raise ConfigError(f"--schedule-file {args.schedule_file}: the executor needs the same number of stages on "
                          f"every rank; stages per rank are {counts}")
    return {"schedule": schedule.name, "pp": schedule.pp, "microbatches": schedule.microbatches,
            "virtual_stages": schedule.virtual_stages, "custom_schedule": schedule,
            "schedule_file": str(args.schedule_file)}
