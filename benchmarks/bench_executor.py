"""Step time of this executor against ``torch.distributed.pipelining`` on the same model,
split and microbatches: GPipe, 1F1B and interleaved 1F1B, gloo, 4 ranks, one launch.

The headline is the executor as it runs on NCCL: ``--p2p rendezvous`` (receives posted
at their place in the program, never ahead; each P2P group waits for the peer's
matching group through the gloo handshake). Beside it, gloo's buffered semantics in
program order (no prefetch and no handshake tokens: what the handshake itself costs),
and the gloo-only variant that posts every receive at the start of the step, which
NCCL cannot do. All runtimes share one process group and take turns step by step, so
machine noise hits them alike; each step is timed the same way (barrier, step,
optimizer step, loss all-reduce) and the median of the measured steps is reported.

    PYTHONPATH=. python benchmarks/bench_executor.py [--steps 10] [--warmup 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

SCHEDULES = (("gpipe", "ScheduleGPipe", 1), ("1f1b", "Schedule1F1B", 1),
             ("interleaved-1f1b", "ScheduleInterleaved1F1B", 2))


def bench_config(name: str, virtual: int, args: argparse.Namespace, p2p: str = "rendezvous",
                 prefetch: bool = False):
    """The benchmark's config: ``rendezvous`` as on NCCL (emulated on gloo), or gloo's
    ``buffered`` semantics with or without every receive posted at the start of the step."""
    from executor.config import RunConfig  # noqa: PLC0415

    return RunConfig(schedule=name, pp=4, microbatches=args.microbatches, virtual_stages=virtual, model="gpt",
                     layers=args.layers, hidden=args.hidden, seq_len=args.seq_len, vocab=args.vocab,
                     heads=args.heads, batch_size=args.batch_size, steps=args.warmup + args.steps, threads=1,
                     p2p=p2p, prefetch_recvs=prefetch)


def torch_pipelining_runner(config, class_name: str):
    """A function running one step of ``torch.distributed.pipelining`` on the executor's
    model and split, returning its step time."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed import pipelining  # noqa: PLC0415

    from executor.models import build_model  # noqa: PLC0415
    from executor.worker import build_schedule  # noqa: PLC0415

    rank = dist.get_rank()
    model = build_model(config)
    schedule = build_schedule(config)
    stage_ids = schedule.stages_of(rank)
    modules = {stage: model.build_stage(stage, schedule.num_stages) for stage in stage_ids}
    # Static shapes, as the executor has: no shape inference (no object exchange) at the first step.
    size = config.batch_size // config.microbatches
    tokens = torch.zeros(size, config.seq_len, dtype=torch.int64)
    activation = torch.zeros(model.boundary_shape(size))
    logits = torch.zeros(size, config.seq_len, config.vocab)
    last_stage = schedule.num_stages - 1
    stages = [pipelining.PipelineStage(modules[stage], stage, schedule.num_stages, torch.device("cpu"),
                                       input_args=tokens if stage == 0 else activation.clone().requires_grad_(True),
                                       output_args=logits if stage == last_stage else activation,
                                       input_grads=None if stage == 0 else activation,
                                       output_grads=None if stage == last_stage else activation)
              for stage in stage_ids]
    params = [p for module in modules.values() for p in module.parameters()]
    optimizer = torch.optim.SGD(params, lr=config.learning_rate)

    def loss_fn(output, target):
        return model.loss_sum(output, target) / config.batch_size

    schedule_class = getattr(pipelining, class_name)
    runner = schedule_class(stages if class_name == "ScheduleInterleaved1F1B" else stages[0],
                            n_microbatches=config.microbatches, loss_fn=loss_fn, scale_grads=False)
    first, last = 0 in stage_ids, schedule.num_stages - 1 in stage_ids

    def step(index: int) -> float:
        inputs, targets = model.make_batch(index, config.batch_size)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.zeros(())
        dist.barrier()
        started = time.perf_counter()
        if first:
            runner.step(inputs, target=targets if last else None)
        elif last:
            losses: list = []
            runner.step(target=targets, losses=losses)
            loss = torch.stack([item.detach() for item in losses]).sum()
        else:
            runner.step()
        optimizer.step()
        dist.all_reduce(loss)
        return time.perf_counter() - started

    return step


def bench_worker(args: argparse.Namespace) -> list[tuple] | None:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from executor.worker import RankRun  # noqa: PLC0415

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = []
    for name, class_name, virtual in SCHEDULES:
        config = bench_config(name, virtual, args)
        ours = RankRun(config, None, rank, dist.get_world_size(), "gloo", torch.device("cpu"), None)
        in_order = RankRun(bench_config(name, virtual, args, "buffered"), None, rank, dist.get_world_size(),
                           "gloo", torch.device("cpu"), None)
        prefetching = RankRun(bench_config(name, virtual, args, "buffered", prefetch=True), None, rank,
                              dist.get_world_size(), "gloo", torch.device("cpu"), None)
        theirs = torch_pipelining_runner(config, class_name)
        their_times = []
        for step in range(config.steps):  # alternate step by step: noise hits all alike
            ours.step(step)
            in_order.step(step)
            prefetching.step(step)
            their_times.append(theirs(step))
        if rank == 0:
            rows.append((name, class_name, statistics.median(ours.step_times[args.warmup:]),
                         statistics.median(their_times[args.warmup:]),
                         statistics.median(in_order.step_times[args.warmup:]),
                         statistics.median(prefetching.step_times[args.warmup:])))
    dist.destroy_process_group()
    return rows if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="measured steps per runtime and schedule")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch  # noqa: PLC0415

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    launch_config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=4, run_id=str(uuid.uuid4()),
                                 rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0)
    rows = elastic_launch(launch_config, bench_worker)(args)[0]
    print(f"gpt layers={args.layers} hidden={args.hidden} seq={args.seq_len} batch={args.batch_size} "
          f"microbatches={args.microbatches}, gloo, 4 ranks, median of {args.steps} steps")
    print("executor, headline: --p2p rendezvous (NCCL's rule, emulated on gloo: receives at their place, each group "
          "waiting for the peer's through a handshake token);")
    print("beside it: buffered in program order (no prefetch, no handshake tokens) and buffered with every receive "
          "prefetched (gloo only)")
    print(f"{'schedule':<18} {'torch.pipelining ms':>20} {'rendezvous ms':>14} {'ratio':>6} "
          f"{'in order ms':>12} {'ratio':>6} {'prefetch ms':>12} {'ratio':>6}")
    for name, class_name, ours, theirs, in_order, prefetching in rows:
        print(f"{name:<18} {theirs * 1000:>20.2f} {ours * 1000:>14.2f} {ours / theirs:>6.2f} "
              f"{in_order * 1000:>12.2f} {in_order / theirs:>6.2f} {prefetching * 1000:>12.2f} "
              f"{prefetching / theirs:>6.2f}   ({class_name})")

if __name__ == "__main__":
    main()
