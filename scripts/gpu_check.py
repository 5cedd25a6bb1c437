"""The Python half of ``scripts/gpu-check.sh``: each check is one subcommand that prints
what it measured and exits non-zero when the check fails.

One GPU (float64 on CUDA against the CPU one-process reference, bound 1e-9, unless said):

    numerics        a gpt under 1f1b
    architectures   every architecture preset shrunk (GPT-3, Llama 3, Mixtral, DeepSeek-V3,
                    DeepSeek-V2-Lite) and a Qwen-MoE config.json
    recompute       a shrunk Llama 3 with --recompute full, selective, per-op and norm-mla-up,
                    and a shrunk DeepSeek-V3 with norm-mla-up (CUDA's attention kernel
                    keeping Q, K and V themselves, dropped and rebuilt), and a shrunk
                    Mixtral with --recompute-moe-act (the experts' activation output
                    dropped and rebuilt)
    zero            ZeRO-1, 2 and 3 (FSDP2) on a one-rank NCCL group
    degree-one      tensor, context and expert parallelism applied over one-rank NCCL
                    groups (DTensor, the K/V all-gather, the all-to-all dispatch)
    pairs           DualPipeV's overlapped pairs on two CUDA streams: float64 against the
                    reference, then a float32 run: how many pairs' halves overlapped (at
                    least one must) and the step time beside the halves one after the other;
                    the profile's timing of one pair (overlap_fb) over its halves alone
    memory          torch.cuda.max_memory_allocated over a step beside the simulator's
                    static prediction and the CPU run's tracked peak of the same config
    predict         profile -> simulate -> run, the step-time error (pp=1)
    precision       bf16 against fp32 loss curves of a small gpt (AdamW, defaults)

Two GPUs and more:

    nccl-schedules  every generated schedule on NCCL, transfers >= 64 MB,
                    the step-0 losses of all schedules equal (the same model and data)
    expert-parallel a shrunk Mixtral, dp 2 ep 2, float64 on NCCL (all-to-all with
                    splits) against the CPU one-process reference
    context-parallel a shrunk Llama 3, cp 2 (K/V all-gather, reduce-scatter in
                    the backward), float64 on NCCL against the CPU one-process reference
    tensor-parallel a shrunk Llama 3, tp 2 with sequence parallelism, float64 on NCCL
                    against the CPU one-process reference
    ring-attention  >= 2 GPUs: the same with --cp-comm p2p (K/V and their gradients passed
                    round the ring by batch_isend_irecv)
    zero-ep         >= 2 GPUs: a shrunk Mixtral, dp 2 ep 2 with ZeRO-3 (FSDP2, the experts
                    their own units), float64 on NCCL against the CPU reference; its
                    Trace holds FSDP2's gathers and reduce-scatters (CUDA events on
                    FSDP's own streams), each of non-negative length within the step

``--dry-run`` runs the same logic on CPU with gloo and tiny sizes, so the script's own
flow can be checked on a machine without a GPU (``tests/test_gpu_check.py``); its
numbers mean nothing, and the checks that only a GPU can pass (pairs that overlap) are
reported, not required.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import tempfile
import time
from contextlib import contextmanager

MIB = 2**20
BOUND = 1e-9  # float64 on CUDA against float64 on the CPU: kernels differ in summation order
ARCHITECTURES = {  # name: shrinking fields (every case 2 layers of hidden 64, 4 heads)
    "gpt3-1.3b": {},
    "llama3-8b": {"kv_heads": 2},
    "mixtral-8x7b": {"kv_heads": 2, "experts": 4},
    "deepseek-v3": {"experts": 4, "ffn_hidden": 32},
    "deepseek-v2-lite": {"experts": 4, "ffn_hidden": 32},
    "qwen1.5-moe-a2.7b": {"experts": 4, "ffn_hidden": 32},
    # config.json parts: query/key norms, tied embeddings, sinks and clamped experts with YaRN,
    # Llama 4's layers, Gemma's four norms, soft caps and local rotary base, parallel blocks
    "qwen3-8b": {"kv_heads": 2},
    "qwen3-0.6b": {"kv_heads": 2},
    "olmoe-1b-7b": {"experts": 4, "ffn_hidden": 32},
    "gpt-oss-20b": {"experts": 4, "ffn_hidden": 32},
    "llama-4-scout": {"experts": 4, "kv_heads": 2, "layers": 4},
    "gemma-2-9b": {"kv_heads": 2},
    "gemma-3-1b": {"kv_heads": 1},
    "pythia-160m": {"heads": 2},
    "falcon-7b": {},
    "pipesim/model/data/hf_configs/deepseek-v3.json": {"experts": 8, "ffn_hidden": 32},
}


def backend(args: argparse.Namespace) -> str:
    return "gloo" if args.dry_run else "nccl"


def device(args: argparse.Namespace):
    import torch

    return torch.device("cpu" if args.dry_run else "cuda", 0)


def small(**fields):
    """A float64 config of a few tokens (AdamW, 2 steps, the first step's gradients kept)."""
    from executor.config import RunConfig

    base = dict(schedule="1f1b", pp=1, microbatches=2, layers=2, hidden=64, heads=4, seq_len=16, vocab=128,
                batch_size=4, steps=2, dtype="float64", optimizer="adamw", lr=1e-3, return_grads=True)
    return RunConfig(**{**base, **fields})


def differences(result: dict, reference: dict) -> tuple[float, float]:
    """The largest |loss difference| over the steps and |gradient difference| of step 0;
    a gradient missing on either side is infinitely far."""
    loss = max(abs(a - b) for a, b in zip(result["losses"], reference["losses"], strict=True))
    if sorted(result["grads"]) != sorted(reference["grads"]):
        return loss, math.inf
    grad = max((result["grads"][name].cpu() - g).abs().max().item() for name, g in reference["grads"].items())
    return loss, grad


def against_reference(rows: list[tuple[str, dict, dict]]) -> int:
    """Print one line per (label, result, reference); 0 when every one is within BOUND."""
    failed = 0
    for label, result, reference in rows:
        loss, grad = differences(result, reference)
        ok = loss < BOUND and grad < BOUND
        failed += not ok
        print(f"{label:<44} max |loss difference| {loss:.2e}  max |gradient difference| {grad:.2e}  "
              f"{'ok' if ok else 'FAILED'}")
    print(f"{len(rows) - failed} of {len(rows)} within {BOUND:g} of the CPU float64 reference")
    return 1 if failed else 0


def architectures(args: argparse.Namespace) -> int:
    from executor.reference import reference_run
    from executor.worker import run_local

    rows = []
    for model, shrink in ARCHITECTURES.items():
        config = small(model=model, backend=backend(args), **shrink)
        rows.append((f"{model} ({config.schedule}, float64)", run_local(config), reference_run(config)))
    return against_reference(rows)


def recompute(args: argparse.Namespace) -> int:
    from executor.reference import reference_run
    from executor.worker import run_local

    rows = []
    for mode in ("full", "selective", "per-op", "norm-mla-up"):
        config = small(model="llama3-8b", kv_heads=2, recompute=mode, backend=backend(args))
        rows.append((f"llama3-8b --recompute {mode}", run_local(config), reference_run(config)))
    config = small(model="deepseek-v3", experts=4, recompute="norm-mla-up", backend=backend(args))
    rows.append(("deepseek-v3 --recompute norm-mla-up", run_local(config), reference_run(config)))
    config = small(model="mixtral-8x7b", experts=4, recompute_moe_act=True, backend=backend(args))
    rows.append(("mixtral-8x7b --recompute-moe-act", run_local(config), reference_run(config)))
    return against_reference(rows)


@contextmanager
def one_rank_group(args: argparse.Namespace):
    """A process group of this one rank (NCCL on the GPU, gloo in a dry run): what ZeRO
    and the parallel pieces talk through when a single GPU is all there is."""
    import torch
    import torch.distributed as dist

    if not args.dry_run:
        torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as folder:
        store = dist.FileStore(os.path.join(folder, "store"), 1)
        dist.init_process_group(backend(args), store=store, rank=0, world_size=1,
                                device_id=None if args.dry_run else device(args))
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def zero(args: argparse.Namespace) -> int:
    """ZeRO-1/2 (the averager's reduce-scatter and parameter all-gather) and ZeRO-3
    (FSDP2's fully_shard; with 1f1b's whole backwards and zb-h1's I and W) over one
    replica: RunConfig refuses --zero with --dp 1 for
    users, so the configs go to the worker directly, inside a one-rank group."""
    from executor.reference import reference_run
    from executor.worker import run_worker

    rows = []
    with one_rank_group(args):
        for stage, schedule in ((1, "1f1b"), (2, "1f1b"), (3, "1f1b"), (3, "zb-h1")):
            config = small(model="gpt", zero=stage, schedule=schedule, backend=backend(args))
            (result,) = run_worker([config])
            rows.append((f"gpt {schedule} --zero {stage} on a one-rank {backend(args)} group", result,
                         reference_run(config)))
    return against_reference(rows)


def stage_step(config, apply=None, where=None) -> dict:
    """One forward and backward of the whole model as one stage on ``where`` (the CPU by
    default), after ``apply(stage)`` parallelises it; the loss and the gradients."""
    import torch

    from executor.context_parallel import ContextShard
    from executor.models import build_model
    from executor.worker import full_tensor

    where = where or torch.device("cpu")
    model = build_model(config)
    stage = model.build_stage(0, 1).to(where)
    inputs, targets = model.make_batch(0, config.batch_size)
    shard = apply(stage) if apply is not None else None
    if isinstance(shard, ContextShard):  # this rank's chunks of every sequence (all of them: cp 1)
        inputs, targets = shard.local(inputs), shard.local(targets)
    loss = model.loss_sum(stage(inputs.to(where)), targets.to(where)) / config.batch_size
    loss.backward()
    grads = {name: full_tensor(p.grad).detach().cpu() for name, p in stage.named_parameters()}
    return {"losses": [loss.item()], "grads": grads}


def degree_one(args: argparse.Namespace) -> int:
    """tp, cp and ep applied as a run at degree > 1 applies them, over one-rank groups."""
    from torch.distributed.device_mesh import init_device_mesh

    from executor.context_parallel import ContextShard, shard_context
    from executor.expert_parallel import ExpertGroups, shard_experts
    from executor.tensor_parallel import parallelize_stage

    llama = small(model="llama3-8b", kv_heads=2)
    mixtral = small(model="mixtral-8x7b", kv_heads=2, experts=4)
    rows = []
    with one_rank_group(args) as group:
        mesh = init_device_mesh(device(args).type, (1,), mesh_dim_names=("tp",))
        def tensor(stage) -> None:
            parallelize_stage(stage, mesh, sequence_parallel=True)

        def context(stage) -> ContextShard:
            shard = ContextShard(group, 1, 0, llama.seq_len)
            shard_context(stage, shard)
            return shard

        def experts(stage) -> None:
            shard_experts(stage, ExpertGroups(1, 0, group, group))

        cases = [("llama3-8b tp 1 (DTensor), sequence parallel", llama, tensor),
                 ("llama3-8b cp 1 (K/V all-gather)", llama, context),
                 ("mixtral-8x7b ep 1 (all-to-all dispatch)", mixtral, experts)]
        for label, config, apply in cases:
            rows.append((label, stage_step(config, apply, device(args)), stage_step(config)))
    return against_reference(rows)


def pairs(args: argparse.Namespace) -> int:
    """DualPipeV on one GPU (both chunks of the V on it, pairs on two streams)."""
    import torch

    import executor.runtime
    from executor.pair_streams import PairLanes
    from executor.reference import reference_run
    from executor.worker import run_local

    config = small(schedule="dualpipev", virtual_stages=2, microbatches=4, batch_size=8, layers=3, model="gpt",
                   backend=backend(args))
    status = against_reference([("gpt dualpipev pp 1 (5 pairs a step), float64", run_local(config),
                                 reference_run(config))])
    sizes = dict(layers=4, hidden=32, heads=4, seq_len=16, batch_size=8) if args.dry_run else \
        dict(layers=8, hidden=2048, heads=16, seq_len=512, batch_size=32)
    timed = small(schedule="dualpipev", virtual_stages=2, microbatches=8, model="gpt", vocab=512, steps=5,
                  dtype="float32", return_grads=False, backend=backend(args), **sizes)
    together = run_local(timed)
    meta = together["trace"].meta
    original = executor.runtime.PairLanes
    executor.runtime.PairLanes = lambda _device: PairLanes(torch.device("cpu"))  # no streams: one after the other
    try:
        apart = run_local(timed)
    finally:
        executor.runtime.PairLanes = original
    step = {name: sorted(result["step_times"][1:])[len(result["step_times"][1:]) // 2]
            for name, result in (("together", together), ("apart", apart))}
    lanes = "two CUDA streams" if meta["pairs_overlap"] else "one lane (no streams)"
    print(f"float32 gpt dualpipev pp 1, {sizes}, pairs on {lanes}: median step {step['together'] * 1e3:.2f} ms; "
          f"forced one after the other: {step['apart'] * 1e3:.2f} ms ({step['apart'] / step['together'] - 1:+.1%})")
    print(f"{meta['pairs_overlapped']} of {meta['pairs']} pairs' halves overlapped in the last step")
    profiled_pair(args, timed)
    if not args.dry_run and (not meta["pairs_overlap"] or meta["pairs_overlapped"] == 0):
        print("FAILED: no pair's halves overlapped on the GPU")
        return 1
    return status


def profiled_pair(args: argparse.Namespace, config) -> None:
    """What ``pipesim profile`` writes as ``overlap_fb`` on this device: one pair, the
    forward of stage 0 beside the backward of stage 1 on the executor's lanes, over the
    two halves timed alone (reported, not required: the factor is the GPU's to find)."""
    from executor.models import build_model
    from executor.pair_timing import pair_factor, time_pair
    from executor.profile import StageProbe, clock_for_compute

    where = device(args)
    model = build_model(config)
    probes = {stage: StageProbe(model, model.build_stage(stage, 2).to(where), stage, 2, config, where)
              for stage in (0, 1)}
    forward, _ = probes[0].time_forward_backward(where, 3, 10, 0.0)
    _, backward = probes[1].time_forward_backward(where, 3, 10, 0.0)
    pair = time_pair(probes[0], probes[1], where, clock_for_compute(where), 3, 10)
    print(f"profile's pair F0 + B1: {pair * 1e3:.3f} ms against F0 {forward * 1e3:.3f} + B1 {backward * 1e3:.3f} ms: "
          f"{pair_factor(pair, forward, backward):.2f} x (overlap_fb)")


def memory(args: argparse.Namespace) -> int:
    """The device's peak beside the simulator's prediction of it (the executor's layers,
    the allocator's cuBLAS workspaces and the loss's and optimizer's temporaries), and
    the CPU run's tracked peak beside its own prediction; each within 10%."""
    import torch

    from executor.worker import run_local
    from pipesim.cli.run_memory import predicted_peaks

    sizes = dict(layers=2, hidden=32, heads=4, seq_len=16, batch_size=8) if args.dry_run else \
        dict(layers=4, hidden=512, heads=8, seq_len=256, batch_size=8)  # the CPU runs it too: a few seconds
    config = small(model="gpt", microbatches=4, vocab=512, steps=2, dtype="float32", return_grads=False,
                   backend=backend(args), **sizes)
    measured = run_local(config)["memory"][0]
    on_cpu = dataclasses.replace(config, backend="gloo", threads=min(8, os.cpu_count() or 1))
    tracked = measured if args.dry_run else run_local(on_cpu)["memory"][0]
    predicted_tracked = predicted_peaks(config)[0]["predicted_peak"]
    predicted = predicted_tracked if args.dry_run else \
        predicted_peaks(config, torch.cuda.get_device_capability())[0]["predicted_peak"]
    error, tracked_error = measured["peak"] / predicted - 1, tracked["peak"] / predicted_tracked - 1
    print(f"{measured['source']} peak over the step {measured['peak'] / MIB:.1f} MiB, predicted {predicted / MIB:.1f} "
          f"MiB ({error:+.1%}); the CPU run's tracked peak {tracked['peak'] / MIB:.1f} MiB, predicted "
          f"{predicted_tracked / MIB:.1f} MiB ({tracked_error:+.1%}); both within 10%: "
          f"{abs(error) <= 0.10 and abs(tracked_error) <= 0.10}")
    return 0 if abs(error) <= 0.10 and abs(tracked_error) <= 0.10 else 1


def numerics(args: argparse.Namespace) -> int:
    from executor.config import RunConfig
    from executor.reference import reference_run
    from executor.worker import run_local

    config = RunConfig(schedule="1f1b", pp=1, microbatches=4, model="gpt", layers=4, hidden=64, heads=4, seq_len=16,
                       vocab=128, batch_size=8, steps=3, dtype="float64", optimizer="adamw", lr=1e-3,
                       backend=backend(args), return_grads=True)
    device = run_local(config)
    reference = reference_run(config)  # on the CPU
    loss_error = max(abs(a - b) for a, b in zip(device["losses"], reference["losses"], strict=True))
    grad_error = max((device["grads"][name] - grad).abs().max().item() for name, grad in reference["grads"].items())
    print(f"backend {device['backend']}: losses {device['losses']}")
    print(f"reference (CPU float64): losses {reference['losses']}")
    print(f"max |loss difference| {loss_error:.3e}, max |gradient difference| {grad_error:.3e} (bound 1e-9)")
    return 0 if loss_error < 1e-9 and grad_error < 1e-9 else 1


def predict(args: argparse.Namespace) -> int:
    from executor.config import RunConfig, build_schedule
    from executor.profile import profile
    from executor.worker import run_local
    from pipesim.cluster.presets import ideal
    from pipesim.model.costs import costs_from_dict
    from pipesim.sim.comparison import compare, report_lines
    from pipesim.sim.step import run_simulation

    sizes = dict(layers=2, hidden=32, heads=4, seq_len=16, batch_size=8) if args.dry_run else \
        dict(layers=8, hidden=1024, heads=16, seq_len=256, batch_size=32)
    config = RunConfig(schedule="1f1b", pp=1, microbatches=8, model="gpt", vocab=512, steps=8,
                       backend=backend(args), **sizes)
    document = profile(config, warmup=2, repeats=10, min_time=0.5 if args.dry_run else 2.0)
    schedule = build_schedule(config)
    predicted = run_simulation(schedule, costs_from_dict(document, schedule.num_stages), ideal())
    result = run_local(config)
    comparison = compare(result["trace"], result["step_times"], predicted.trace, predicted.metrics.makespan,
                         warmup_steps=2)
    print("\n".join(report_lines(comparison)))
    print(f"step times (ms): {[round(t * 1e3, 2) for t in result['step_times']]}")
    return 0


def precision(args: argparse.Namespace) -> int:
    from executor.config import RunConfig
    from executor.worker import run_local

    curves = {}
    for dtype in ("float32", "bfloat16"):
        config = RunConfig(schedule="1f1b", pp=1, microbatches=4, model="gpt", layers=4, hidden=256, heads=4,
                           seq_len=64 if not args.dry_run else 16, vocab=256, batch_size=16, steps=10,
                           dtype=dtype, optimizer="adamw", backend=backend(args))
        curves[dtype] = run_local(config)["losses"]
        losses = " ".join(f"{loss:.4f}" for loss in curves[dtype])
        print(f"{dtype:>9} (AdamW, default lr {config.learning_rate:g}): {losses}")
    fp32, bf16 = curves["float32"], curves["bfloat16"]
    gap = max(abs(b - f) / abs(f) for b, f in zip(bf16, fp32, strict=True))
    learns = fp32[-1] < fp32[0] and bf16[-1] < bf16[0]
    print(f"both lower the loss over 10 steps: {learns}; largest bf16/fp32 gap {gap:.2%} (bound 2%)")
    return 0 if learns and gap <= 0.02 else 1


def nccl_schedules(args: argparse.Namespace) -> int:
    from executor.config import ConfigError, RunConfig
    from executor.launch import launch
    from executor.models import build_model
    from schedules.generators import GENERATORS, MULTI_CHUNK

    pp = args.pp
    microbatches = 2 * pp  # interleaved with m >= 2 pp is where the old lowering hung
    per_microbatch = 2 if args.dry_run else 16
    sizes = dict(hidden=16, heads=2, seq_len=8) if args.dry_run else dict(hidden=2048, heads=16, seq_len=512)
    configs = []
    for name in GENERATORS:
        config = RunConfig(schedule=name, pp=pp, microbatches=microbatches, virtual_stages=2 if name in MULTI_CHUNK
                           else 1, model="gpt", layers=2 * pp, vocab=128, batch_size=per_microbatch * microbatches,
                           steps=2, dtype="float32", backend=backend(args), timeout=120, **sizes)
        try:
            config.check()
        except ConfigError as error:  # a schedule the executor does not run (the cost-aware orders)
            print(f"{name:<18} not run by the executor: {str(error).split(';')[0]}")
            continue
        configs.append(config)
    transfer = build_model(configs[0]).boundary_shape(per_microbatch)
    transfer_bytes = 4 * math.prod(transfer)
    print(f"pp={pp} m={microbatches}: each transfer {transfer} float32 = {transfer_bytes / MIB:.0f} MiB")
    if not args.dry_run and transfer_bytes < 64 * MIB:
        print("transfers are under 64 MiB: the check would not exercise NCCL's rendezvous")
        return 1
    results = launch(configs)
    first = [result["losses"][0] for result in results]
    for config, result in zip(configs, results, strict=True):
        print(f"{config.schedule:<18} losses {[round(loss, 6) for loss in result['losses']]}  "
              f"step times (ms) {[round(t * 1e3, 1) for t in result['step_times']]}")
    spread = (max(first) - min(first)) / abs(first[0])
    print(f"step-0 loss spread across schedules {spread:.2e} (bound 1e-4: same model, same data)")
    return 0 if spread < 1e-4 else 1


def expert_parallel(args: argparse.Namespace) -> int:
    return parallel_numerics(args, "dp 2 ep 2", dp=2, ep=2, model="mixtral-8x7b", experts=4)


def context_parallel(args: argparse.Namespace) -> int:
    return parallel_numerics(args, "cp 2", cp=2, cp_comm="all-gather", model="llama3-8b")


def tensor_parallel(args: argparse.Namespace) -> int:
    return parallel_numerics(args, "tp 2 sequence parallel", tp=2, model="llama3-8b", sequence_parallel=True)


def ring_attention(args: argparse.Namespace) -> int:
    return parallel_numerics(args, "cp 2 ring", cp=2, cp_comm="p2p", model="llama3-8b")


def zero_ep(args: argparse.Namespace) -> int:
    return parallel_numerics(args, "dp 2 ep 2 zero 3", dp=2, ep=2, zero=3, model="mixtral-8x7b", experts=4,
                             also=fsdp_collectives_drawn)


def folding(args: argparse.Namespace) -> int:
    """Parallel folding (``--etp 1``): the experts whole on both tp ranks, ep 2 cut from
    them, each rank sending its own sequence shard; clipped by the global norm."""
    return parallel_numerics(args, "tp 2 sequence parallel etp 1 ep 2", tp=2, ep=2, etp=1, sequence_parallel=True,
                             model="mixtral-8x7b", experts=4, clip_grad=1.0)


def fsdp_collectives_drawn(result: dict) -> int:
    """0 when the run's Trace holds FSDP2's all-gathers and reduce-scatters
    (``executor.fsdp_timing``), each of non-negative length and within the step."""
    from collections import Counter

    from executor.gather import is_fsdp

    events = result["trace"].events
    fsdp = [event for event in events if event.stream == "dp" and is_fsdp(event)]
    step_end = max(event.end for event in events)
    kinds = Counter(event.kind for event in fsdp)
    bad = [event.action for event in fsdp if not 0.0 <= event.start <= event.end <= step_end + 1e-9]
    print(f"FSDP collectives in the Trace: {dict(kinds)}, {sum(e.duration for e in fsdp) * 1e3:.3f} ms; "
          f"{len(bad)} outside the step or of negative length {bad[:3]}")
    return 0 if len(kinds) == 2 and not bad else 1


def parallel_numerics(args: argparse.Namespace, label: str, also=None, **layout) -> int:
    """A float64 run of ``layout`` on the devices against the CPU one-process reference
    (and ``also(result)``'s status, when given: a check of the run's own result)."""
    from executor.config import RunConfig
    from executor.launch import launch
    from executor.reference import reference_run

    config = RunConfig(schedule="1f1b", pp=1, microbatches=2, layers=2, hidden=64, heads=4, kv_heads=2, seq_len=16,
                       vocab=128, batch_size=8, steps=3, dtype="float64", optimizer="adamw", lr=1e-3,
                       backend=backend(args), return_grads=True, **layout)
    (device,) = launch([config])
    reference = reference_run(config)  # on the CPU
    loss_error = max(abs(a - b) for a, b in zip(device["losses"], reference["losses"], strict=True))
    grad_error = max((device["grads"][name] - grad).abs().max().item() for name, grad in reference["grads"].items())
    print(f"{label} on {device['backend']}: losses {device['losses']}")
    print(f"reference (CPU float64): losses {reference['losses']}")
    print(f"max |loss difference| {loss_error:.3e}, max |gradient difference| {grad_error:.3e} (bound 1e-9)")
    status = 0 if loss_error < 1e-9 and grad_error < 1e-9 else 1
    return max(status, also(device)) if also is not None else status


CHECKS = {"numerics": numerics, "architectures": architectures, "recompute": recompute, "zero": zero,
          "degree-one": degree_one, "pairs": pairs, "memory": memory, "predict": predict, "precision": precision,
          "nccl-schedules": nccl_schedules, "expert-parallel": expert_parallel, "context-parallel": context_parallel,
          "tensor-parallel": tensor_parallel, "ring-attention": ring_attention, "zero-ep": zero_ep,
          "folding": folding}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=tuple(CHECKS))
    parser.add_argument("--dry-run", action="store_true", help="CPU and gloo, tiny sizes: checks the flow only")
    parser.add_argument("--pp", type=int, default=2, help="nccl-schedules: pipeline ranks (one GPU each)")
    args = parser.parse_args()
    started = time.perf_counter()
    status = CHECKS[args.check](args)
    print(f"{args.check}: {'passed' if status == 0 else 'FAILED'} in {time.perf_counter() - started:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
