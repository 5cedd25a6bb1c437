"""Costs measured in the run's own calibration steps: what ``pipesim compare`` predicts
with by default (``--calibration run``) and ``pipesim profile --calibration run`` writes.

Why not the stage profile (``executor.profile``)? It times each stage alone, in loops,
by the rank thread's CPU time; the run is timed by the wall clock, with every rank, the
backend's threads and whatever else the machine runs sharing the cores. On the shared
2-core machine this was built on, compute ran up to 8.5x slower inside the run than in
the profile, and every prediction fell short by that much. Here the costs are timed the
way the run is timed, by the same code under the same contention: the job's processes
run a few **calibration steps** of the same lowered programs (``pipesim compare`` runs
them in the same processes as its timed steps, in the order of
``pipesim.cli.calibration_order``), and each F,
B, I and W is the mean wall time of that action over such a step (minus the tp
collectives, ep all-to-alls and ring attention's waits the trace shows inside it, which
the simulator charges itself from the links). The
timed steps that the comparison reports are never used for a cost, so the prediction
stays a prediction: the simulator still has to get every wait, transfer and bubble right.

The runtime's own time between actions (its loop, the hooks, posting P2P groups) is read
off the same steps (``overhead_fit``), and the step's time outside the pipeline (the
receives posted ahead at its start, the optimizer, the loss all-reduce) as what each
calibration step took beyond its last event (``step_tail``). Each is a step's mean, as every
cost the simulator adds up is (docs/calibration.md), and the estimate the median over the
steps.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence

from executor.config import RunConfig
from executor.estimate import ROUNDS, robust_mean
from executor.step_tail import TAIL_KINDS
from pipesim.model.saved_tensors import executor_saved_tensors, regathered_inputs
from pipesim.model.spec import ModelSpec
from schedules.action import COMM_KINDS, COMPUTE_KINDS, ActionKind, parse_action
from schedules.runtime_gaps import gaps
from schedules.schedule import Schedule
from schedules.trace import Trace

RUN_CALIBRATED = "calibration steps of the run"  # meta.source of these costs files: they time tp/cp/ep shards


def calibration_configs(config: RunConfig, steps: int = ROUNDS) -> list[RunConfig]:
    """The configs the job runs beside its timed steps: ``steps`` of them, of two steps
    each, launched in the same processes (``executor.launch.launch``). Each returns the
    Trace of its second step; its first, a fresh model's first step (allocator, autograd's
    first graph), is left out like the run's own warm-up step."""
    if steps < 1:
        raise ValueError(f"--calibration-steps must be >= 1, got {steps}")
    return [dataclasses.replace(config, steps=2, return_grads=False) for _ in range(steps)]


def compute_seconds(trace: Trace, collectives_apart: bool) -> dict[tuple[int, str], float]:
    """Mean wall seconds of each (stage, compute kind) over one step's compute events.
    With ``collectives_apart`` the collectives each action ran inside it (tp collectives
    named ``TP(action)``, ep all-to-alls ``ALLTOALL_EP(action)``, ring attention's waits
    ``CP_KV(action)``) are taken out, for the simulator to charge them from the links
    instead."""
    from executor.gather import INSIDE_KINDS  # noqa: PLC0415 - torch, which this module leaves out at import

    inside: dict[tuple[str, int], float] = defaultdict(float)
    if collectives_apart:
        for event in trace.events:
            if event.kind in INSIDE_KINDS:
                inside[str(parse_action(event.action[len(event.kind) + 1:-1])), event.rank] += event.duration
    durations: dict[tuple[int, str], list[float]] = defaultdict(list)
    for event in trace.events:
        if event.stream == "compute" and event.kind in COMPUTE_KINDS:
            held = inside.get((event.action, event.rank), 0.0)
            durations[event.stage, event.kind].append(max(event.duration - held, 0.0))
    return {key: statistics.fmean(values) for key, values in durations.items()}


def stage_entry(stage: int, seconds: dict[tuple[int, str], float]) -> dict[str, float]:
    """A costs-file entry's times for ``stage``: F, and B, I and W as far as the
    schedule ran them (a missing B is I + W; without a split, I is B and W nothing)."""
    def mean(kind: str) -> float | None:
        return seconds.get((stage, kind))

    forward = mean(ActionKind.F)
    if forward is None:
        raise ValueError(f"the calibration steps ran no forward of stage {stage}")
    backward, input_grad, weight_grad = mean(ActionKind.B), mean(ActionKind.I), mean(ActionKind.W)
    if backward is None and input_grad is None:
        raise ValueError(f"the calibration steps ran no backward of stage {stage}")
    if input_grad is None:
        return {"fwd": forward, "bwd": backward, "igrad": 0.0, "wgrad": 0.0}
    weight_grad = weight_grad or 0.0
    return {"fwd": forward, "bwd": input_grad + weight_grad if backward is None else backward,
            "igrad": input_grad, "wgrad": weight_grad}


def overhead_fit(samples: Sequence[tuple[float, int, bool]], waits_timed: bool = False) -> tuple[float, float]:
    """(seconds per compute action, seconds per P2P action) from the gaps between compute
    actions: the first is the mean gap with no post and no wait in it, the second what
    the gaps with posts take beyond that, per post (a ratio of sums: a mean per post).
    The simulator charges the first before every compute action and the second on every
    SEND and RECV, so a step's sum of both is what these gaps summed to. None of a kind:
    zero.

    Which gaps give the per-post price: without ``waits_timed`` only those that wait for
    nothing (a waiting gap's time is mostly the wait, whose length the trace does not
    give). With it (``gaps(..., waits_timed=True)``: the blocked seconds already taken
    out) every gap, so the posts are priced with what the waits cost the runtime beyond
    being blocked. Why: in traces of 2-rank gloo runs (1f1b, gpipe, interleaved-1f1b,
    pp 2, 8 microbatches), a least-squares split of the gaps put a send's post at
    0.23-0.29 ms, a receive's at 0.04-0.14 ms and a wait's bookkeeping at 0.04-0.09 ms;
    the gaps that wait for nothing are few in a 1F1B-like order and mostly post
    receives, so priced from them alone a post cost 0.05-0.10 ms, and an interleaved
    step's gaps summed to about 3 ms per rank (of 100) more than the costs said.
    """
    free = [(seconds, posts) for seconds, posts, waits in samples if not waits]
    plain = [seconds for seconds, posts in free if posts == 0]
    per_action = max(statistics.fmean(plain), 0.0) if plain else 0.0
    if waits_timed:  # every gap, a waiting one with no post in it too (it still holds the wait's bookkeeping)
        beyond, posts_total = sum(seconds - per_action for seconds, _, _ in samples), sum(p for _, p, _ in samples)
    else:
        posted = [(seconds - per_action, posts) for seconds, posts in free if posts > 0]
        beyond, posts_total = sum(s for s, _ in posted), sum(p for _, p in posted)
    per_post = max(beyond / posts_total, 0.0) if posts_total else 0.0
    return per_action, per_post


def step_tail(schedule: Schedule, trace: Trace, step_time: float, per_action: float, per_post: float) -> float:
    """Seconds of the step outside the pipeline's actions, which the simulator charges
    after each rank's last one (``Costs.step_overhead``): the step's time beyond the end
    of its last event (the optimizer, the loss all-reduce), plus what the first stage's
    rank spent before its first compute action beyond its loop and posts (the receives
    posted ahead at the start of a step)."""
    # the tail's own events (executor.step_tail) are what this measures, not where it starts
    last = max((event.end for event in trace.events if event.kind not in TAIL_KINDS), default=0.0)
    first_rank = schedule.placement[0]
    starts = [event.start for event in trace.events if event.rank == first_rank and event.stream == "compute"]
    program = schedule.programs[first_rank]
    first_compute = next((index for index, action in enumerate(program) if action.kind in COMPUTE_KINDS), 0)
    posts = sum(1 for action in program[:first_compute] if action.kind in COMM_KINDS)
    lead = max(min(starts, default=0.0) - per_action - posts * per_post, 0.0)
    return max(step_time - last, 0.0) + lead


def pair_seconds(schedule: Schedule, trace: Trace) -> dict[int, float]:
    """Mean seconds of the step's overlapped pairs by forward stage: from the forward
    half's start to the backward half's end, as the runtime drew them
    (``executor.pair_streams.pair_events``: one after the other, or sharing the span
    they overlapped), so the pair's own time whether its halves overlapped or not."""
    timed = {(event.rank, event.action): event for event in trace.events if event.stream == "compute"}
    spans: dict[int, list[float]] = defaultdict(list)
    for rank in range(schedule.pp):
        for forward, backward in schedule.fused_pairs(rank):
            first, second = timed.get((rank, str(forward))), timed.get((rank, str(backward)))
            if first is not None and second is not None:
                spans[forward.stage].append(second.end - first.start)
    return {stage: statistics.fmean(values) for stage, values in spans.items()}


def run_costs(schedule: Schedule, traces: Sequence[Trace], step_times: Sequence[float],
              collectives_apart: bool = False, waits_timed: bool = False) -> dict:
    """The costs document (times and overheads; no bytes) from calibration steps: one
    Trace per step with the step's time. Each step is a round, as in the stage profile
    (``executor.estimate``): every cost is its mean over the step, and the estimate the
    median of the steps' means, so that a step a slow spell of the machine covered (on
    the shared 2-core machine, one of three calibration steps once put 8 ms on every
    P2P post) does not set it. Bytes are added by ``stage_bytes``. ``waits_timed``: the
    steps ran buffered P2P, whose traces mark each receive's wait (``gaps``)."""
    if not traces or len(traces) != len(step_times):
        raise ValueError(f"need one step time per calibration Trace, got {len(traces)} traces and "
                         f"{len(step_times)} step times")
    per_step = [compute_seconds(trace, collectives_apart) for trace in traces]
    seconds = {key: robust_mean([step[key] for step in per_step if key in step]) for key in per_step[0]}
    fits = [overhead_fit(gaps(schedule, trace, waits_timed), waits_timed) for trace in traces]
    per_action, per_post = robust_mean([fit[0] for fit in fits]), robust_mean([fit[1] for fit in fits])
    tails = [step_tail(schedule, trace, time, per_action, per_post)
             for trace, time in zip(traces, step_times, strict=True)]
    stages = [{"stage": stage, **stage_entry(stage, seconds)} for stage in range(schedule.num_stages)]
    per_step_pairs = [pair_seconds(schedule, trace) for trace in traces]
    for stage, entry in enumerate(stages):  # an overlapped pair with its forward on the stage, as it ran
        timed = [step[stage] for step in per_step_pairs if stage in step]
        if timed:
            entry["overlap_fb"] = robust_mean(timed)
    document = {"action_overhead": per_action, "comm_overhead": per_post, "step_overhead": robust_mean(tails),
                "stages": stages}
    if any(per_step_pairs):  # whether the run's halves ran together (two CUDA streams) or one after the other
        document["pairs_overlap"] = bool(traces[0].meta.get("pairs_overlap", False))
    return document


def stage_bytes(config: RunConfig, num_stages: int) -> list[dict[str, float]]:
    """Per stage, what the simulator needs beside the times: the boundary activation one
    rank sends (``act_bytes``: its cp share of the sequence, and with sequence
    parallelism its tp shard of that, ``RunConfig.boundary_sequence_split``), the
    parameter bytes one rank holds and reduces over dp (the stage's parameters over
    ``tp``: norms and biases that tp replicates are counted as split, a small share of a
    stage; its routed experts over ``ep`` and their own tp, whole under parallel
    folding), and for tp the layers and the activation each layer's collectives carry
    (``layers``, ``tp_message_bytes``: the whole ``s*b*h`` activation, Megatron's rule,
    ``pipesim.sim.parallel``; ``tp_regathers``: the sublayer inputs a layer's backward
    gathers again under sequence parallelism, ``executor.rebuilt_activations``; with ep,
    ``moe_tp_dense``: its MoE blocks gather and scatter the sequence as the dense MLP's
    do; where each tp rank routes its own sequence shard, ``RunConfig.routes_shards``,
    Megatron-Core's rule instead, ``moe_shared`` saying whether the shared experts run
    that pair, ``executor.shard_routing``). With
    DualPipe's two copies of the model, ``num_stages`` counts the pipeline's stages, each
    the model stage ``stage mod`` the model's (``executor.copies``), each copy's last
    sending nothing. Builds the stages on the CPU to count them (torch is loaded here)."""
    import torch  # noqa: PLC0415

    from executor.architectures.build import shrunk_spec  # noqa: PLC0415
    from executor.context_parallel import local_shape  # noqa: PLC0415
    from executor.expert_parallel import expert_parameters  # noqa: PLC0415
    from executor.models import build_model  # noqa: PLC0415

    model = build_model(config)
    saved = executor_saved_tensors(config.dtype)
    microbatch = -(-config.replica_batch_size // config.microbatches)
    shape = local_shape(model.boundary_shape(microbatch), config.boundary_sequence_split)
    element = torch.tensor([], dtype=getattr(torch, config.dtype)).element_size()
    activation = float(math.prod(shape) * element)
    model_stages = num_stages // config.copies
    spec = shrunk_spec(config) if config.ep > 1 or config.folded else None  # the mixture of experts run
    shared = config.routes_shards and bool(spec.moe.shared_ffn)
    entries = []
    for stage in (index % model_stages for index in range(num_stages)):
        module = model.build_stage(stage, model_stages)
        routed = expert_parameters({stage: module})
        params = sum(p.numel() * p.element_size() / (config.tp if id(p) not in routed else config.ep * config.expert_tp)
                     for p in module.parameters())
        entry = {"act_bytes": activation if stage < model_stages - 1 else 0.0, "param_bytes": params}
        if config.ep > 1 or config.folded:
            entry.update(expert_exchange(config, spec, model.layout, stage, microbatch, element))
        if config.tp > 1:
            layers = model.layout[stage]
            entry["layers"] = float(layers)
            entry["tp_message_bytes"] = float(math.prod(model.boundary_shape(microbatch)) * element)
            regathers = regathered_inputs(saved, config.tp, config.sequence_parallel, config.recompute)
            moe_layers = entry.get("moe_layers", 0.0)
            if moe_layers and config.routes_shards:
                # Megatron-Core's rule: the routed experts' rows gathered over their own tp (none
                # folded), the shared ones (split over tp) the dense MLP's pair; a MoE layer without
                # them gathers no sequence for its MLP, so its backward regathers only the attention's
                entry["moe_shared"] = float(shared)
                if not shared:  # one of a layer's two regathers gone on each MoE layer
                    regathers *= 1 - moe_layers / (2 * layers)
            elif moe_layers:  # the MoE block gathers the sequence as a dense MLP does
                entry["moe_tp_dense"] = 1.0
            entry["tp_regathers"] = float(regathers if layers else 0)
        if config.cp > 1 and config.cp_comm == "p2p":
            entry.update(ring_exchange(config, model.layout[stage], microbatch, element))
        entries.append(entry)
    return entries


def ring_exchange(config: RunConfig, layers: int, microbatch: int, element: int) -> dict[str, float]:
    """What the simulator prices a stage's ring attention from (``pipesim.sim.
    context_parallel``): its attention layers and the keys and values one cp rank
    passes on per layer (``kv_bytes``: the microbatch's ``seq_len / cp`` tokens, each
    with the key and value widths ``pipesim.model.activations.key_value_bytes`` counts
    for the model at ``tp``, ``executor.architectures.build.run_spec``, in the
    activations' type, which the ring sends them in)."""
    from executor.architectures.build import run_spec  # noqa: PLC0415
    from pipesim.model.activations import key_value_bytes  # noqa: PLC0415

    spec = run_spec(config)
    per_token = key_value_bytes(spec, config.tp) / spec.dtype_bytes * element
    return {"attention_layers": float(layers), "kv_bytes": float(microbatch * config.seq_len / config.cp * per_token)}


def add_ring(entries: list[dict], attention: Sequence[dict[str, float]]) -> None:
    """Each stage's attention core seconds per layer (``attention_fwd``, and
    ``attention_bwd`` of its input-gradient backward, B or I), the median over the
    calibration steps of what ring attention computed in one action (rank 0's gather of
    the pipeline's, ``executor.worker``): the simulator sets each step's transfer
    against a step's share of it."""
    for entry in entries:
        layers = entry.get("attention_layers") or 0.0
        stage = entry["stage"]
        for field, kinds in (("attention_fwd", (ActionKind.F,)), ("attention_bwd", (ActionKind.B, ActionKind.I))):
            seconds = [step[f"{stage}{kind}"] for step in attention for kind in kinds if f"{stage}{kind}" in step]
            if layers and seconds:
                entry[field] = robust_mean(seconds) / layers


def expert_exchange(config: RunConfig, spec: ModelSpec, layout: Sequence[int], stage: int, microbatch: int,
                    element: int) -> dict[str, float]:
    """What the simulator prices a stage's ep all-to-alls from, as it prices a model's
    (``pipesim.model.transformer_costs``): its MoE layers (``moe_layers``) and one rank's
    routed token copies (``dispatch_bytes``: ``k`` copies of each of the microbatch's
    ``seq_len / cp`` tokens, ``hidden`` wide, in the activations' type: every tp rank
    routes the whole sequence its MoE block gathered, or where it routes its own sequence
    shard, ``RunConfig.routes_shards``, only that ``1 / tp``, ``executor.shard_routing``), for
    ``spec``, the shrunk architecture the run builds (``executor.architectures.build.shrunk_spec``)."""
    first = sum(layout[:stage])
    moe_layers = sum(1 for layer in range(first, first + layout[stage]) if spec.is_moe_layer(layer))
    tokens = microbatch * config.seq_len / config.cp / (config.tp if config.routes_shards else 1)
    dispatch = spec.moe.dispatch_bytes(tokens, spec.hidden, element) if spec.moe and moe_layers else 0.0
    return {"moe_layers": float(moe_layers), "dispatch_bytes": float(dispatch)}


def held_seconds(traces: Sequence[Trace], stream: str) -> float | None:
    """The seconds one collective the run timed inside its actions on ``stream`` held a
    rank for (``ep``: an all-to-all, peers' late arrival included), the median over the
    calibration steps of each step's mean, as the compute's (``robust_mean``); None
    when no step timed one."""
    means = []
    for trace in traces:
        held = [event.duration for event in trace.events if event.stream == stream]
        if held:
            means.append(sum(held) / len(held))
    return robust_mean(means) if means else None


def calibration_document(config: RunConfig, schedule: Schedule, calibrated: Sequence[dict]) -> dict:
    """The costs file from the launched calibration configs' results (rank 0's, one per
    config: its last step's Trace and step times), with the bytes of each stage and, in
    ``meta``, what the times were measured on (the fields ``pipesim compare --costs``
    checks against its run)."""
    backend = calibrated[0].get("backend")
    document = run_costs(schedule, [result["trace"] for result in calibrated],
                         [result["step_times"][-1] for result in calibrated],
                         collectives_apart=config.tp > 1 or config.ep > 1 or config.cp > 1,
                         waits_timed=backend is not None and config.p2p_semantics(backend) == "buffered")
    for entry, sizes in zip(document["stages"], stage_bytes(config, schedule.num_stages), strict=True):
        entry.update(sizes)
    if config.cp > 1 and config.cp_comm == "p2p":
        add_ring(document["stages"], [result["attention_seconds"] for result in calibrated])
    document["sequence_parallel"] = config.sequence_parallel
    document["meta"] = {
        "source": RUN_CALIBRATED, "calibration_steps": len(calibrated),
        "backend": backend, "threads": config.threads, "model": config.model,
        "layers": config.layers, "hidden": config.hidden, "seq_len": config.seq_len, "pp": config.pp,
        "virtual_stages": config.virtual_stages, "schedule": schedule.name, "dtype": config.dtype,
        "microbatch_size": -(-config.replica_batch_size // config.microbatches), "dp": config.dp, "tp": config.tp,
        "cp": config.cp, "ep": config.ep, "etp": config.expert_tp,
    }
    return document
