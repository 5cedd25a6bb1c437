"""Flags shared by several subcommands, so ``simulate``, ``sweep``, ``show``, ``export``
and ``plan`` spell and default them identically. What the flags mean is ``pipesim.job``:
a parsed command line becomes a ``Job`` (``Job.from_namespace``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from executor.options import add_hidden_alias, add_microbatch_group_arg, positive_int
from pipesim.cluster.presets import PRESETS
from pipesim.job import (
    DEFAULT_FWD,
    DEFAULT_MICROBATCHES,
    DEFAULT_PP,
    DEFAULT_SCHEDULE,
    DEFAULT_VIRTUAL_STAGES,
    DTYPE_BYTES,
)
from pipesim.model.ring_merge import CP_COMMS
from schedules.generators import (
    COST_AWARE,
    DEFAULT_MAX_ACTIONS,
    MULTI_CHUNK,
    SCHEDULE_NAMES,
)
from schedules.p2p import P2P_SEMANTICS

if TYPE_CHECKING:
    from pipesim.sim.stash_budget import MemoryBudget


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
    add_microbatch_group_arg(group)
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


def memory_limit_value(text: str) -> int | float | MemoryBudget:
    """``--memory-limit``: a number of stashes (whole, or halves where a schedule counts
    them), a size per GPU (``60GB``) or ``device`` (``pipesim.sim.stash_budget``)."""
    from pipesim.sim.stash_budget import parse_memory_limit

    try:
        return parse_memory_limit(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_memory_limit_arg(group) -> None:
    group.add_argument(
        "--memory-limit", type=memory_limit_value, default=None,
        help=f"for {', '.join(sorted(COST_AWARE))}: most activation stashes a rank may hold, in microbatches "
        "of the rank's share of the model (default: pp, 1F1B's peak; zbv-auto takes halves: one chunk's stash); "
        "or a peak per GPU, such as 60GB (decimal; GiB for binary), or 'device' (each rank's usable memory: "
        "its capacity less --memory-headroom), turned into the most stashes every rank holds within it "
        "(needs the stages' memory: --model, --stash-bytes/--param-bytes or a costs file)",
    )


def add_p2p_arg(parser: argparse.ArgumentParser, default_help: str) -> None:
    """``--p2p``: the point-to-point semantics to check and model (``schedules.p2p``)."""
    parser.add_argument(
        "--p2p", choices=P2P_SEMANTICS, default=None,
        help="point-to-point semantics: rendezvous (NCCL: a pair's transfers match in posting order and a send "
        "waits for its receive) or buffered (gloo: matched by tag, sends never wait); default: " + default_help,
    )


def add_cost_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("costs (per microbatch, on one pipeline rank's share of the model)")
    group.add_argument("--fwd", type=float, default=None,
                       help=f"forward seconds per microbatch (default: {DEFAULT_FWD:g})")
    group.add_argument("--bwd", type=float, default=None, help="full backward seconds (default: 2 x --fwd)")
    group.add_argument("--wgrad", type=float, default=None,
                       help="weight-gradient part of --bwd, for split backward (I = bwd - wgrad, W = wgrad) "
                       "(default: half of --bwd for schedules that split the backward, said on stderr; 0 otherwise)")
    group.add_argument("--act-bytes", type=float, default=None,
                       help="bytes one microbatch sends between consecutive stages (default: 0)")
    group.add_argument("--wgrad-stash-share", type=float, default=None, metavar="SHARE",
                       help="share of a microbatch's stash still held between its I and its W when the backward "
                       "is split (the matrix products' inputs and output gradients, which W needs: Qi et al.'s "
                       "32h of 34h + 5as, about 0.4 for their models); memory and zb-auto's search count it "
                       "(default: 1, the whole stash; a --model derives it from its layers)")
    group.add_argument("--stash-bytes", type=float, default=None,
                       help="activation bytes one microbatch's forward keeps until its backward, on one rank's share "
                       "(default: unknown; memory reads n/a without this or --param-bytes)")
    group.add_argument("--param-bytes", type=float, default=None,
                       help="bytes of one rank's share of the weights, in the weights' dtype (see --bytes-per-param)")
    group.add_argument("--costs", help="per-stage costs file (JSON or YAML) instead of the flags above")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    from pipesim.model.spec import PRESETS as MODELS
    from pipesim.model.spec import RECOMPUTE, bundled_models

    group = parser.add_argument_group("model spec (costs from FLOPs and bytes instead of --fwd/--bwd)")
    group.add_argument("--model", help=f"one of {', '.join(MODELS)}; a shipped Hugging Face config by name: "
                       f"{', '.join(bundled_models())}; gpt (the transformer pipesim run trains, with run's sizes: "
                       "layers 4, hidden 64, heads 4, seq-len 16, vocab 128, float32); or a Hugging Face style "
                       "config.json; the flags below override its fields (default: none, costs from --fwd/--bwd)")
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
                       help="Megatron sequence parallelism: tp all-gather + reduce-scatter, activations / tp "
                            "(the column-parallel inputs kept as shards and gathered again in the backward, "
                            "beside the input-gradient product)")
    group.add_argument("--recompute", choices=RECOMPUTE, default="none",
                       help="activation recomputation: full re-runs each layer's forward in its backward, selective "
                       "the attention core only (Megatron's), per-op is torchtitan's SelectiveAC (per-op selective "
                       "checkpointing: a block keeps its input, the attention kernel's output and every second "
                       "matrix product's output, and re-runs the other products (Llama: K, output and up "
                       "projections; with --qkv fused output and up), every norm and element-wise op and the tp "
                       "all-gathers (all-reduces without sequence parallelism); refused for mixture-of-experts and "
                       "latent-attention models and without flash attention), norm-mla-up every norm's "
                       "output and latent attention's up-projections (DeepSeek-V3's: a layer keeps the norms' inputs "
                       "and the latents, not Q, K, V) (default: none)")
    add_moe_act_arg(group)
    group.add_argument("--no-flash-attention", action="store_true",
                       help="keep the s x s attention scores for the backward (Korthikanti et al.'s 5as/h term)")
    group.add_argument("--attention-flops", choices=("causal", "whole"), default="causal",
                       help="how MFU and TFLOP/s count the attention core's FLOPs: causal, the half of the s x s "
                       "scores a causal mask computes (Meta's Llama 3 figures, today's Megatron-LM and MaxText), or "
                       "whole, the full square (PaLM's appendix B formula, torchtitan, Narayanan et al. 2021) "
                       "(default: causal)")
    add_precision_args(group)
    add_qkv_arg(group)
    group.add_argument("--capacity-factor", type=float, default=None,
                       help="mixture of experts: token slots each routed expert computes, as a multiple of its "
                       "balanced share; empty slots cost time, not model FLOPs (default: dropless)")


def add_moe_act_arg(group) -> None:
    """``--recompute-moe-act`` for the commands of ``add_model_args`` (simulate, sweep,
    export); run's, compare's and profile's is the executor's own (``executor.options``),
    plan's searches it (``pipesim.cli.plan``)."""
    group.add_argument("--recompute-moe-act", action="store_true",
                       help="mixture of experts: Megatron-Core's moe_act recompute module (--recompute-modules "
                       "moe_act): the routed experts keep their activation's inputs, not its output, which every "
                       "backward re-runs (a memory-bound kernel); beside --recompute none, selective or "
                       "norm-mla-up. Under --fp8 it changes nothing: FP8 caching already keeps the inputs alone "
                       "(default: off)")


def add_precision_args(group) -> None:
    """``--fp8``, ``--ep-dispatch``, ``--cross-entropy`` and ``--comm-sms``: what the GEMMs
    and the MoE dispatch run in, the loss's kernels and the SMs kept for communication
    (``pipesim.model.compute_model.stage_compute_model``, ``pipesim.job.with_ep_dispatch``),
    for simulate's model and every layout plan tries."""
    from pipesim.model.spec import FP8_SCALINGS

    group.add_argument("--fp8", nargs="?", const="delayed", default=False, choices=FP8_SCALINGS, metavar="SCALING",
                       help="with --model: the weight GEMMs in FP8 (Transformer Engine, DeepSeek-V3's recipe; the "
                       "router, attention core and output head stay BF16) on h100, h200, h800 or b200, their k loop "
                       "at the FP8 matmul throughput measured on Hopper (1.70x BF16's) plus each GEMM's casts; "
                       "SCALING: delayed (the default: scales from the amax history, one read per cast; "
                       "DeepSeek-V3's tile-wise scales alike) or current (an amax pass first, two reads: "
                       "Transformer Engine's current scaling, Megatron-Bridge's FP8-CS, torchao's tensorwise); "
                       "MFU stays against the BF16 peak, as papers report it, the FP8 peak's beside it; the GEMMs' "
                       "inputs are stashed in FP8 (a mixture of experts keeps only SwiGLU's inputs, DeepSeek-V3's "
                       "caching). A config.json's FP8 quantization_config turns it on (default: BF16)")
    group.add_argument("--ep-dispatch", default=None, metavar="fp8|bf16",
                       help="with --model, a mixture of experts: what the all-to-all toward the experts carries (the "
                       "forward's dispatch, the backward's combine gradient): fp8, 1 byte an element plus an FP32 "
                       "scale per 128 (DeepSeek-V3's recipe, DeepEP's FP8 dispatch; needs --fp8), or bf16; the "
                       "combine and the dispatch's gradient stay BF16 (default: fp8 for a config.json whose FP8 "
                       "quantization_config is block-scaled, DeepSeek-V3's; bf16 otherwise, under --fp8 too, as "
                       "Megatron-Core dispatches)")
    group.add_argument("--ep-dispatcher", default=None, metavar="alltoall|deepep",
                       help="with --model, a mixture of experts: how its all-to-alls move the routed copies: "
                       "alltoall, Megatron-Core's all-to-all dispatcher (one copy per routed expert on every link, "
                       "permuted into expert order before and sorted by local expert after), or deepep, DeepEP's "
                       "and Megatron-Core's flex dispatcher (DeepEP, HybridEP: a token crosses to each node holding "
                       "its experts once and is fanned out there over NVLink; no permutation before the dispatch) "
                       "(default: alltoall)")
    group.add_argument("--cross-entropy", default=None, metavar="unfused|fused|te|torch|compiled",
                       help="with --model: the loss's kernels over the logits, priced by the bytes they move, keep "
                       "and hold for a moment on the last stage: unfused, Megatron-Core's default (FP32 softmax in "
                       "six passes, 52 bytes a BF16 logit forward and backward, the softmax kept in FP32, the BF16 "
                       "logits beside it for a moment); fused, --cross-entropy-loss-fusion (40 bytes, the same "
                       "softmax kept); te, with --cross-entropy-fusion-impl te (Transformer Engine's online "
                       "softmax: 6 bytes, the BF16 logits kept, nothing more held), as Megatron-Bridge's recipes "
                       "run; torch, F.cross_entropy on FP32 logits as torchtitan's eager loss runs it (48 bytes, "
                       "the FP32 log-softmax kept, two more FP32 copies held in its backward); compiled, that loss "
                       "under torch.compile (te's bytes, the BF16 gradient held beside the kept logits) (default: "
                       "unfused; torch for plan --torchtitan and export --torchtitan)")
    group.add_argument("--comm-sms", type=int, default=0, metavar="SMS",
                       help="with --model: SMs of each GPU kept for communication kernels (DeepSeek-V3 kept 20 of "
                       "an H800's 132): GEMMs and attention run on the rest, at their share of the peak (default: 0)")


def add_qkv_arg(group) -> None:
    """``--qkv``: how the model builds its attention's input projections
    (``pipesim.model.spec.QKV_PROJECTIONS``, ``pipesim.model.per_op_checkpoint``)."""
    group.add_argument("--qkv", default="separate", metavar="separate|fused",
                       help="with --model: the attention's Q, K and V projections as three linears (separate: "
                       "Meta's and Hugging Face's Llama, torchtitan's published per-op runs, pipesim run's "
                       "default) or one fused wqkv (fused: torchtitan 0.3's Llama 3 configs). Taken with "
                       "every recompute mode but it only matters under --recompute per-op, which counts the "
                       "products a block runs: fused keeps K's output too and does not re-run K's GEMM; the FLOPs, "
                       "the GEMMs timed and every other mode are the same either way (default: separate)")


def add_parallel_args(parser: argparse.ArgumentParser, context_and_experts: bool = True) -> None:
    """dp, tp (and, unless ``context_and_experts`` is false, cp and ep: the commands that
    simulate a step), rank order, gradient buckets, ZeRO, collectives, bytes per parameter."""
    from pipesim.cluster.mapping import DEFAULT_ORDER
    from pipesim.sim.comm_overlap import OVERLAP_SLOWDOWN
    from pipesim.sim.zero import ZERO3_COLLECTIVES, ZERO3_OVERLAPPED

    group = parser.add_argument_group("data, tensor, context and expert parallelism, memory")
    group.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default: 1)")
    group.add_argument("--tp", type=int, default=1, help="tensor-parallel shards per pipeline rank (default: 1)")
    if context_and_experts:
        add_context_and_expert_args(group)
    group.add_argument("--rank-order", default=DEFAULT_ORDER,
                       help=f"axes innermost first, e.g. tp-pp-dp; cp, unnamed, sits right outside tp (default: "
                       f"{DEFAULT_ORDER}, Megatron's)")
    group.add_argument("--bucket-mb", type=float, default=25.0,
                       help="gradient all-reduce bucket in MiB (default: 25, torch DDP's)")
    add_hidden_alias(group, "--dp-bucket-mb", "bucket_mb", type=float)
    group.add_argument("--no-dp-overlap", action="store_true",
                       help="reduce gradients after the rank's last action instead of bucket by bucket during "
                       "each stage's last backward (default: during it, as DDP and Megatron-Core's "
                       "--overlap-grad-reduce do)")
    group.add_argument("--no-tp-overlap", action="store_true",
                       help="run the tensor-parallel all-gathers and reduce-scatters of --sequence-parallel between "
                       "the GEMMs instead of beside them (default: each beside the GEMM it feeds or follows, as "
                       "Megatron-Core's --tp-comm-overlap and torch's async TP run them; without --sequence-parallel "
                       "the all-reduces are exposed)")
    group.add_argument("--no-param-gather-overlap", action="store_true",
                       help="--zero 1/2: all-gather the updated parameters after the optimizer step, exposed, instead "
                       "of under the next step's first forwards (default: under them, Megatron-Core's "
                       "--overlap-param-gather)")
    group.add_argument("--overlap-slowdown", type=float, default=OVERLAP_SLOWDOWN, metavar="SHARE",
                       help="how much slower compute runs while a collective runs beside it (default: "
                       f"{OVERLAP_SLOWDOWN}, the mean "
                       "Lee et al. 2025 measured on A100/H100/MI250/MI210; 0: overlap is free)")
    group.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                       help="ZeRO stage: 1 optimizer state sharded over dp (reduce-scatter gradients, all-gather "
                       "parameters after the optimizer step); 2 gradients too (reduce-scattered after every "
                       "backward); 3 parameters too (FSDP: each layer gathered before its forward and backward, "
                       "prefetched one ahead) (default: 0, all-reduce)")
    group.add_argument("--zero3-collectives", choices=ZERO3_COLLECTIVES, default=ZERO3_OVERLAPPED,
                       help="--zero 3: where the gathers and reduce-scatters run: overlapped (on their own streams, "
                       "prefetched one layer ahead and beside the backward, as FSDP2 on GPUs, torchtitan and "
                       "Megatron-Core run them) or in-costs (synchronous inside the actions, their time already in "
                       "the --costs stage times, as FSDP2 runs on gloo and compare measures it: nothing charged "
                       "beside the actions; needs --costs) (default: overlapped)")
    group.add_argument("--collective", choices=("ring", "tree"), default="ring",
                       help="all-reduce algorithm (default: ring)")
    group.add_argument("--bytes-per-param", default="2,2,12",
                       help="memory per parameter: WEIGHTS,GRADS,OPTIMIZER bytes (default: 2,2,12, bf16 + Adam)")
    group.add_argument("--optimizer-moments", choices=("fp32", "bf16"), default="fp32",
                       help="AdamW's first and second moments: fp32 (4 bytes each, as --bytes-per-param's 12 counts "
                       "them) or bf16 (2 each: 4 bytes fewer per parameter, DeepSeek-V3's; its FP32 gradients are "
                       "--bytes-per-param 2,4,12) (default: fp32)")
    add_clip_grad_arg(group)
    add_memory_headroom_arg(group)


def add_clip_grad_arg(parser) -> None:
    """``--clip-grad``: gradient clipping's norm, priced by ``simulate`` and ``plan`` alike
    (``pipesim.job.model_costs_of``: ``Costs.grad_norm_overhead``)."""
    from pipesim.job import CLIP_GRAD

    parser.add_argument("--clip-grad", type=float, default=None, metavar="NORM",
                        help="with --model: clip the gradients' global norm to NORM before the optimizer step, "
                        "priced as each rank reading the gradients its optimizer steps (its shard under ZeRO) and "
                        "one all-reduce of a number over every rank holding a share of them, which no rank leaves "
                        "before the last one enters; 0: no clipping, nothing charged (default: "
                        f"{CLIP_GRAD:g}, what Megatron-LM and torchtitan clip to unless told not to)")


def add_memory_headroom_arg(parser) -> None:
    """``--memory-headroom``: what each device keeps back from the model (``simulate``'s
    out-of-memory verdict and ``plan``'s, the same)."""
    from pipesim.sim.headroom import CUDA_CONTEXT_BYTES, DEFAULT_HEADROOM, FRAGMENTATION_SHARE, MiB

    parser.add_argument("--memory-headroom", default=DEFAULT_HEADROOM, metavar="auto|SHARE|GB",
                        help="memory each device keeps back from the model; a rank is out of memory above the rest. "
                        f"auto: the CUDA context ({CUDA_CONTEXT_BYTES // MiB} MiB), NCCL's buffers for each "
                        "communicator the rank joins (tp, pp, dp, cp, ep: 10 MiB per channel and peer, as NCCL opens "
                        "them) "
                        f"and the caching allocator's fragmentation ({FRAGMENTATION_SHARE * 100:g}%% of the peak), "
                        "from published measurements; or a share of the device (10%%) or gigabytes (6) instead "
                        f"(default: {DEFAULT_HEADROOM}; docs/cluster-model.md, Headroom, says why)")


def add_context_and_expert_args(group) -> None:
    """``--cp``, ``--cp-comm``, ``--ep`` and ``--etp`` (``pipesim.job.Job``'s ``cp``,
    ``cp_comm``, ``ep``, ``etp``)."""
    group.add_argument("--cp", type=int, default=1,
                       help="context-parallel ranks per replica: each holds 1/cp of every sequence (2 x cp must "
                       "divide it: causal load balancing) and exchanges attention's keys and values (default: 1)")
    group.add_argument("--cp-comm", choices=CP_COMMS, default="p2p",
                       help="how context-parallel ranks exchange keys and values: p2p, a ring overlapped with the "
                       "attention (ring attention; with --model its steps' merges priced too, as Transformer "
                       "Engine runs them), or all-gather before it (Llama 3) (default: p2p)")
    group.add_argument("--ep", type=int, default=1,
                       help="expert-parallel ranks: each holds 1/ep of every MoE layer's routed experts and trades "
                       "tokens by all-to-all; cut from the dp x cp ranks, so ep must divide dp x cp (default: 1)")
    group.add_argument("--etp", type=int, default=None,
                       help="with --model, a mixture of experts: expert tensor-parallel ranks, Megatron-Core's "
                       "parallel folding (--expert-tensor-parallel-size): the routed experts split over etp ranks "
                       "instead of tp, and ep groups cut from every tp x cp x dp rank of a stage (etp innermost, then "
                       "ep), so etp x ep must divide tp x cp x dp, etp must divide tp, and an etp other than tp "
                       "needs --sequence-parallel; 1 for fine-grained experts, as Megatron-Core recommends "
                       "(default: tp, no folding)")
    group.add_argument("--ep-overlap", action="store_true",
                       help="with --model, a mixture of experts and --ep above 1: Megatron-Core's combined 1F1B "
                       "(--overlap-moe-expert-parallel-comm): one more warm-up forward per rank, then each "
                       "steady-state forward run together with the backward after it, one's all-to-alls under the "
                       "other's compute; interleaved-1f1b, or 1f1b at pp 1, without full recompute, as Megatron-Core "
                       "requires (default: off, as in Megatron-Core)")
    group.add_argument("--delay-wgrad", action="store_true",
                       help="with --model and overlapped pairs (--ep-overlap, dualpipe, dualpipev): Megatron-Core's "
                       "--delay-wgrad-compute: in each pair a MoE layer's experts' weight gradient runs after the "
                       "backward's dispatch has started, widening what hides it (default: off, as in Megatron-Core; "
                       "its Qwen3-235B-A22B recipe turns it on)")


def add_topology_args(parser: argparse.ArgumentParser) -> None:
    from pipesim.hardware.gpus import GPUS

    group = parser.add_argument_group("cluster")
    group.add_argument("--topology", default="ideal",
                       help=f"preset ({', '.join(PRESETS)}) or a YAML/JSON topology file (default: ideal)")
    group.add_argument("--nodes", type=int, default=None, help="nodes for the multi-node presets (ib, ethernet)")
    group.add_argument("--gpu", choices=tuple(GPUS), default=None,
                       help="GPU model of the presets' devices: peak, memory, NVLink (default: h100)")
