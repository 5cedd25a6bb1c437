"""Time each stage's compute on the device it will run on: ``pipesim profile``.

Every rank profiles the stages the schedule places on it, in its own process with the
thread count ``pipesim run`` gives a rank, so each measurement is taken under the same
conditions as the run it predicts (on a CPU: one core per rank, the other ranks busy
next door). For each stage it times, per microbatch and with the executor's own calls:
``F`` (forward, plus the loss on the last stage), ``B`` (full backward), ``I`` (input
gradient) and ``W`` (weight gradients from what I kept), after warm-up,
and takes means: a step is a sum of many such actions, and the expected value of a sum
is the sum of the means. CPU timings are skewed to the right (interrupts, the backend's
own threads), so a median would predict every step short. F and B are timed in rounds
spread over the profile, and the median of the round means is kept
(``executor.estimate``), so that a slow spell of a shared machine does not set a
stage's cost.
It also records the bytes that cross the stage boundary, the bytes the forward keeps
alive for the backward and the parameter bytes, and what the runtime itself costs
around the compute (``executor.overheads``).

The result is a plain dict in the costs-file format ``pipesim simulate --costs`` reads.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from executor.architectures.mtp import give_targets
from executor.config import ONE_BACKWARD_RECOMPUTE, ConfigError, RunConfig, build_schedule
from executor.estimate import DEFAULT_MIN_TIME, ROUNDS, robust_mean
from executor.models import PipelineModel, build_model, build_optimizer
from executor.overheads import measure_overheads, microbatch_size
from executor.pair_streams import PairLanes
from executor.pair_timing import pair_factor, stage_pairs, time_pairs
from executor.per_op_recompute import collecting_kept, kept_tensors
from executor.precision import Precision
from executor.process import init_rank
from executor.recompute import apply_recompute
from executor.spawn import launch_ranks
from executor.split_backward import SplitBackward

RANK_FIELDS = ("rank", "optimizer", "action_gap", "comm_post", "send_post", "recv_wait", "background_cpu",
               "transfer_cost", "prefetch_post", "loss_reduce")


class EventMark:
    """A CUDA event on the current stream; ``later - earlier`` is the device time
    between two marks in seconds (waiting for the later one first)."""

    def __init__(self) -> None:
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record()

    def __sub__(self, earlier: EventMark) -> float:
        self.event.synchronize()
        return earlier.event.elapsed_time(self.event) / 1000.0


COMPUTE_CLOCKS = ("thread", "wall")


def clock_for_compute(device: torch.device, clock: str = "thread") -> Callable[[], float | EventMark]:
    """Seconds as the cost model means them: on a GPU, the device time between CUDA
    events recorded on the compute stream (a difference of marks waits for the later
    one; nothing synchronises the device in between, so the host's launch time counts
    only where the device waited for it). On a CPU, ``clock`` says which: ``thread``,
    the CPU time of this rank's thread, which is what its compute takes on a core of its
    own (time another process took from the core is left out); ``wall``, the monotonic
    clock the run itself is timed by, so that compute slowed by ranks or other work
    sharing the cores is costed as slow as the run will see it (docs/calibration.md)."""
    if device.type == "cuda":
        return EventMark
    if clock not in COMPUTE_CLOCKS:
        raise ValueError(f"compute clock must be one of {', '.join(COMPUTE_CLOCKS)}, got {clock!r}")
    return time.thread_time if clock == "thread" else time.perf_counter


def mean_seconds(run: Callable[[], None], device: torch.device, warmup: int, repeats: int,
                 clock: str = "thread") -> float:
    """Mean time of ``run`` over ``repeats`` calls after ``warmup`` untimed ones."""
    now = clock_for_compute(device, clock)
    samples = []
    for index in range(warmup + repeats):
        start = now()
        run()
        if index >= warmup:
            samples.append(now() - start)
    return statistics.fmean(samples)


MAX_REPEATS = 100_000  # a bound on time-budgeted loops, should a clock not advance


class StageProbe:
    """One stage with the inputs, target and output gradient of one microbatch, and the
    executor's exact calls for each compute kind (``executor.runtime``)."""

    def __init__(self, model: PipelineModel, module: nn.Module, stage: int, num_stages: int, config: RunConfig,
                 device: torch.device) -> None:
        self.model, self.module, self.config = model, module, config
        self.first, self.last = stage == 0, stage == num_stages - 1
        size = microbatch_size(config)
        inputs, targets = model.make_batch(0, config.batch_size)
        self.tokens, self.target = inputs[:size].to(device), targets[:size].to(device)
        dtype = getattr(torch, config.dtype)
        shape = model.boundary_shape(size)
        generator = torch.Generator().manual_seed(stage)
        self.activation = torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype).to(device)
        self.output_grad = None if self.last else torch.randn(shape, generator=generator).to(dtype).to(device) * 1e-3
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.precision = Precision(config, device)  # bf16/fp16: autocast, as the runtime runs it

    def input(self) -> torch.Tensor:
        if self.first:
            return self.tokens
        return self.activation.detach().clone().requires_grad_(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.last:  # what a multi-token prediction head embeds
            give_targets(self.module, self.target)
        output = self.precision.forward(self.module, x)
        if self.last:
            output = self.model.loss_sum(self.precision.for_loss(output), self.target) / self.config.batch_size
        return output

    def time_forward_backward(self, device: torch.device, warmup: int, repeats: int,
                              min_time: float, clock: str = "thread") -> tuple[float, float]:
        """Mean seconds of F and B over one round: a loop of whole forward + backward
        passes, as a rank runs them (caches and the allocator in the state the pipeline
        leaves them in), for at least ``repeats`` passes and ``min_time`` seconds of
        timed work after ``warmup`` untimed ones."""
        now = clock_for_compute(device, clock)
        forward, backward, total = [], [], 0.0
        for index in range(MAX_REPEATS):
            if index >= warmup + repeats and total >= min_time:
                break
            x = self.input()
            start = now()
            output = self.forward(x)
            middle = now()
            torch.autograd.backward(output, self.output_grad)
            end = now()
            if index >= warmup:
                forward.append(middle - start)
                backward.append(end - middle)
                total += end - start
        return statistics.fmean(forward), statistics.fmean(backward)

    def time_split_backward(self, device: torch.device, warmup: int, repeats: int,
                            clock: str = "thread") -> tuple[float, float]:
        """Mean seconds of I and W, with the runtime's split (``executor.split_backward``),
        in a loop of their own (a loop that mixes the two kinds of backward leaves F and B
        a few percent faster than a pipeline ever sees them). They only set how B splits,
        so ``repeats`` passes are enough."""
        now = clock_for_compute(device, clock)
        splitter = SplitBackward(self.module)
        input_grad, weight_grad = [], []
        try:
            for index in range(warmup + repeats):
                x = self.input()
                with splitter.recording() as calls:
                    output = self.forward(x)
                start = now()
                _, work = splitter.input_grad(output, self.output_grad, None if self.first else x, calls)
                middle = now()
                splitter.weight_grad(work)
                if index >= warmup:
                    input_grad.append(middle - start)
                    weight_grad.append(now() - middle)
        finally:
            splitter.close()
        return statistics.fmean(input_grad), statistics.fmean(weight_grad)

    def bytes(self) -> dict[str, float]:
        """Boundary activation, forward stash and parameter bytes of one microbatch.

        The stash is what autograd saves for the backward (parameters excluded: they
        are counted once, not per microbatch), what per-op recompute keeps for it, plus
        the stage's input and output, which the runtime keeps until the backward."""
        param_ptrs = {p.data_ptr() for p in self.module.parameters()}
        saved: dict[tuple[int, int], int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.data_ptr() not in param_ptrs:
                saved[(tensor.data_ptr(), tensor.numel())] = tensor.numel() * tensor.element_size()
            return tensor

        x = self.input()
        stores: list[dict] = []  # what per-op recompute keeps outside autograd's hooks
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), collecting_kept(stores.append):
            output = self.forward(x)
        for tensor in (kept for store in stores for kept in kept_tensors(store)):
            pack(tensor)
        held = {(t.data_ptr(), t.numel()): t.numel() * t.element_size() for t in (x, output)}
        saved.update(held)
        act = 0.0 if self.last else float(output.numel() * output.element_size())
        params = float(sum(p.numel() * p.element_size() for p in self.module.parameters()))
        return {"act_bytes": act, "stash_bytes": float(sum(saved.values())), "param_bytes": params}


def time_stages(probes: dict[int, StageProbe], device: torch.device, warmup: int, repeats: int,
                min_time: float, clock: str = "thread",
                pairs: list[tuple[int, int]] = (), split: bool = True) -> dict[int, dict[str, float]]:
    """F, B, I, W seconds and bytes of each stage. F and B are timed in ``ROUNDS``
    rounds, taking turns between the rank's stages, so a slow spell of the machine
    lands in one round of several stages rather than in all of one stage's; each
    round has its share of ``repeats`` and ``min_time``; I and W only where ``split``. Each overlapped pair of
    ``pairs`` (forward stage, backward stage) the rank runs is timed as the executor
    runs it (``executor.pair_timing``): under ``pair`` of its forward stage, the pair's
    seconds and its backward stage."""
    rounds: dict[int, list[tuple[float, float]]] = {stage: [] for stage in probes}
    per_round = max(1, -(-repeats // ROUNDS))
    for index in range(ROUNDS):
        for stage, probe in probes.items():
            rounds[stage].append(probe.time_forward_backward(device, warmup if index == 0 else 1, per_round,
                                                             min_time / ROUNDS, clock))
    measured = {}
    for stage, probe in probes.items():
        # a recompute that allows one backward per block never runs I and W (RunConfig
        # refuses the split): 0 and 0 are the costs file's "not split", I = B, W = 0
        input_grad, weight_grad = (0.0, 0.0) if not split else probe.time_split_backward(device, warmup, repeats,
                                                                                          clock)
        measured[stage] = {"F": robust_mean([f for f, _ in rounds[stage]]),
                           "B": robust_mean([b for _, b in rounds[stage]]),
                           "I": input_grad, "W": weight_grad, **probe.bytes()}
    timed = time_pairs(probes, list(pairs), device, clock_for_compute(device, clock), warmup, repeats)
    for forward, backward in pairs:
        measured[forward]["pair"] = {"backward_stage": backward, "seconds": timed[forward]}
    return measured


def profile_rank(config: RunConfig, warmup: int = 3, repeats: int = 10, min_time: float = 0.0,
                 clock: str = "thread") -> dict:
    """This rank's measurements: per stage F/B/I/W seconds and bytes, its optimizer step
    and the runtime's overheads. Runs on every launched rank."""
    rank, world, device, backend = init_rank(config.backend, config.threads, config.timeout)
    try:
        schedule = build_schedule(config)
        model = build_model(config)
        stages = {stage: model.build_stage(stage, schedule.num_stages).to(device)
                  for stage in schedule.stages_of(rank)}
        for module in stages.values():  # a run with --recompute pays its second forward: time it
            apply_recompute(module, config.recompute, config.recompute_moe_act)
        probes = {stage: StageProbe(model, module, stage, schedule.num_stages, config, device)
                  for stage, module in stages.items()}
        measured = time_stages(probes, device, warmup, repeats, min_time, clock, stage_pairs(schedule, rank),
                               split=config.recompute not in ONE_BACKWARD_RECOMPUTE)
        params = [p for module in stages.values() for p in module.parameters()]
        optimizer = build_optimizer(config, params, lr=0.0)
        optimizer_seconds = mean_seconds(optimizer.step, device, warmup, repeats, clock)
        overheads = measure_overheads(config, model, schedule, rank, world, device, warmup, repeats, min_time)
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    return {"rank": rank, "backend": backend, "device": str(device), "stages": measured,
            "optimizer": optimizer_seconds, "pairs_overlap": PairLanes(device).overlaps, **overheads}


def costs_document(config: RunConfig, per_rank: dict[int, dict], warmup: int, repeats: int,
                   min_time: float = 0.0, clock: str = "thread") -> dict:
    """The costs file: one entry per stage in stage order, the overheads, and how they
    were measured (``meta``), from every rank's ``profile_rank`` result.

    The optimizer step and the loss all-reduce end every step; the receives the runtime
    posts ahead (gloo) delay the first rank's first action. Both are in
    ``step_overhead``, which the simulator charges after each rank's last action: the
    step ends when the last rank has stepped its optimizer and the loss is known."""
    stages: dict[int, dict] = {}
    for result in per_rank.values():
        for stage, measured in result["stages"].items():
            stages[int(stage)] = measured
    entries = []
    for stage in sorted(stages):
        m = stages[stage]
        # I and W as measured: a split backward runs two autograd passes, which on a small
        # stage cost well over one full backward (executor.split_backward), and a
        # zero-bubble schedule runs exactly those passes.
        entries.append({"stage": stage, "fwd": m["F"], "bwd": m["B"], "igrad": m["I"], "wgrad": m["W"],
                        "act_bytes": m["act_bytes"],
                        "stash_bytes": m["stash_bytes"], "param_bytes": m["param_bytes"],
                        # an overlapped pair with its forward here, as the executor ran it
                        **({"overlap_fb": m["pair"]["seconds"]} if "pair" in m else {})})
    ranks = [per_rank[rank] for rank in sorted(per_rank)]
    first = ranks[0]
    pairs = {str(stage): {**pair, "factor": pair_factor(pair["seconds"], stages[stage]["F"],
                                                         stages[pair["backward_stage"]]["B"])}
             for stage, pair in sorted((stage, stages[stage].get("pair")) for stage in stages) if pair}
    step_overhead = first["prefetch_post"] + max(r["optimizer"] for r in ranks) + max(r["loss_reduce"] for r in ranks)
    return {
        "action_overhead": statistics.median(r["action_gap"] for r in ranks),
        # what a SEND or RECV costs a computing rank, the backend's threads included
        "comm_overhead": statistics.median(max(r["transfer_cost"], r["comm_post"]) for r in ranks),
        "step_overhead": step_overhead,
        # whether the profiled executor ran a pair's halves together (two CUDA streams)
        **({"pairs_overlap": first["pairs_overlap"]} if pairs else {}),
        "meta": {
            "source": "pipesim profile",
            "backend": first["backend"], "device": first["device"], "threads": config.threads,
            "model": config.model, "layers": config.layers, "hidden": config.hidden, "batch_size": config.batch_size,
            "seq_len": config.seq_len, "microbatches": config.microbatches, "pp": config.pp,
            "virtual_stages": config.virtual_stages, "schedule": config.schedule, "dtype": config.dtype,
            "optimizer": config.optimizer, "microbatch_size": microbatch_size(config),
            "warmup": warmup, "repeats": repeats, "min_time": min_time, "compute_clock": clock,
            "measured": {
                "stages": {str(stage): {kind: stages[stage][kind] for kind in "FBIW"} for stage in sorted(stages)},
                "ranks": [{key: r[key] for key in RANK_FIELDS} for r in ranks],
                # each overlapped pair by its forward stage: seconds, backward stage, seconds / (F + B)
                **({"pairs": pairs} if pairs else {}),
            },
        },
        "stages": entries,
    }


def profile(config: RunConfig, warmup: int = 3, repeats: int = 10, min_time: float = DEFAULT_MIN_TIME,
            verbose: bool = False, clock: str = "thread") -> dict:
    """Launch ``config.pp`` ranks, profile each one's stages, return the costs document.
    Each stage's forward + backward loop and the transfer-cost loop run for at least
    ``repeats`` passes and ``min_time`` seconds; ``clock`` times the compute on a CPU
    (``clock_for_compute``)."""
    config.check()
    clock_for_compute(torch.device("cpu"), clock)  # an unknown clock is refused before any rank starts
    if config.tp > 1 or config.cp > 1 or config.ep > 1:
        raise ConfigError(f"profile measures whole pipeline stages (--tp 1 --cp 1 --ep 1); got --tp {config.tp} "
                          f"--cp {config.cp} --ep {config.ep}; --calibration run times the run's own steps with them")
    # every data-parallel replica runs the same stages on its slice of the batch: one
    # replica's pipeline is what there is to time, and the simulator adds the dp reduction
    config = dataclasses.replace(config, dp=1, batch_size=config.replica_batch_size)
    per_rank = launch_ranks(profile_rank, (config, warmup, repeats, min_time, clock), config.pp, config.threads,
                            config.backend, verbose)
    return costs_document(config, per_rank, warmup, repeats, min_time, clock)
