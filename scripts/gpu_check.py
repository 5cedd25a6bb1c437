"""The Python half of ``scripts/gpu-check.sh``: each check is one subcommand that prints
what it measured and exits non-zero when the check fails.

    numerics        one GPU: a float64 run on CUDA against the CPU one-process reference
    predict         one GPU: profile -> simulate -> run, the step-time error (pp=1)
    precision       one GPU: bf16 against fp32 loss curves of a small gpt (AdamW, defaults)
    nccl-schedules  >= 2 GPUs: every generated schedule on NCCL, transfers >= 64 MB,
                    the step-0 losses of all schedules equal (the same model and data)
    expert-parallel >= 2 GPUs: a shrunk Mixtral, dp 2 ep 2, float64 on NCCL (all-to-all with
                    splits) against the CPU one-process reference
    context-parallel >= 2 GPUs: a shrunk Llama 3, cp 2 (K/V all-gather, reduce-scatter in
                    the backward), float64 on NCCL against the CPU one-process reference
    ring-attention  >= 2 GPUs: the same with --cp-comm p2p (K/V and their gradients passed
                    round the ring by batch_isend_irecv)
    zero-ep         >= 2 GPUs: a shrunk Mixtral, dp 2 ep 2 with ZeRO-3 (FSDP2, the experts
                    their own units), float64 on NCCL against the CPU reference

``--dry-run`` runs the same logic on CPU with gloo and tiny sizes, so the script's own
flow can be checked on a machine without a GPU; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import math
import sys

MIB = 2**20


def backend(args: argparse.Namespace) -> str:
    return "gloo" if args.dry_run else "nccl"


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
    from executor.config import RunConfig
    from executor.launch import launch
    from executor.models import build_model
    from schedules.generators import GENERATORS, MULTI_CHUNK

    pp = args.pp
    microbatches = 2 * pp  # interleaved with m >= 2 pp is where the old lowering hung
    per_microbatch = 2 if args.dry_run else 16
    sizes = dict(hidden=16, heads=2, seq_len=8) if args.dry_run else dict(hidden=2048, heads=16, seq_len=512)
    configs = [RunConfig(schedule=name, pp=pp, microbatches=microbatches, virtual_stages=2 if name in MULTI_CHUNK
                         else 1, model="gpt", layers=2 * pp, vocab=128, batch_size=per_microbatch * microbatches,
                         steps=2, dtype="float32", backend=backend(args), timeout=120, **sizes)
               for name in GENERATORS]
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
    return parallel_numerics(args, "cp 2", cp=2, model="llama3-8b")


def ring_attention(args: argparse.Namespace) -> int:
    return parallel_numerics(args, "cp 2 ring", cp=2, cp_comm="p2p", model="llama3-8b")


def zero_ep(args: argparse.Namespace) -> int:
    return parallel_numerics(args, "dp 2 ep 2 zero 3", dp=2, ep=2, zero=3, model="mixtral-8x7b", experts=4)


def parallel_numerics(args: argparse.Namespace, label: str, **layout) -> int:
    """A float64 run of ``layout`` on the devices against the CPU one-process reference."""
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
    return 0 if loss_error < 1e-9 and grad_error < 1e-9 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=("numerics", "predict", "precision", "nccl-schedules",
                                               "expert-parallel", "context-parallel", "ring-attention",
                                               "zero-ep"))
    parser.add_argument("--dry-run", action="store_true", help="CPU and gloo, tiny sizes: checks the flow only")
    parser.add_argument("--pp", type=int, default=2, help="nccl-schedules: pipeline ranks (one GPU each)")
    args = parser.parse_args()
    check = {"numerics": numerics, "predict": predict, "precision": precision, "nccl-schedules": nccl_schedules,
             "expert-parallel": expert_parallel, "context-parallel": context_parallel,
             "ring-attention": ring_attention, "zero-ep": zero_ep}
    return check[args.check](args)


if __name__ == "__main__":
    sys.exit(main())
