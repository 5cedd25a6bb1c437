"""One rank of a pipelined run: set up the process group, build this rank's stages,
run the steps, and hand rank 0 the losses, step times and the gathered Trace.

``run_worker`` is the function every launched process runs (by ``pipesim run`` through
torch's elastic launcher, or by ``python -m executor`` under torchrun). Several configs
can share one process group, which lets tests run many schedules per launch.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from executor.clock import CpuClock, clock_for, earliest_start, shared_clock, shifted
from executor.comm import PeerLinks
from executor.config import RunConfig, build_schedule, parse_failure
from executor.context_parallel import local_shape
from executor.copies import by_model_stage, check_mirrored, copies_group, copies_mesh, data_index, model_stage
from executor.data_parallel import GradientAverager, is_partial, local_tensor
from executor.expert_balance import ExpertBalance, selection_biases
from executor.gather import CP_KIND, EP_KIND, TP_KIND, dp_event, fsdp_event, gather_events, inside_event
from executor.grad_clip import clip_gradients, tp_copies
from executor.lr_schedule import attach_schedule
from executor.memory import FIELDS, MemoryPeak, MemoryTracker
from executor.mesh import build_mesh
from executor.models import PipelineModel, build_model, build_optimizer
from executor.precision import LossScaler, Precision
from executor.process import init_rank
from executor.progress import ProgressWriter, progress_dir_from_env
from executor.recompute import apply_recompute
from executor.routed_rows import ROUTED_ROWS
from executor.runtime import PipelineRuntime
from executor.step_tail import (
    EMBEDDING_ALLREDUCE,
    EXPERT_LOAD_ALLREDUCE,
    GRAD_NORM_ALLREDUCE,
    LOSS_ALLREDUCE,
    OPTIMIZER,
    StepTail,
    split_joining_waits,
)
from executor.tied_embeddings import TiedEmbeddings, embedding_group, is_tied
from schedules.action import COMPUTE_KINDS, Action, ActionKind
from schedules.trace import Trace


class RankFailedError(RuntimeError):
    """A rank failed while running its program; the message names the rank, the step and
    the action it was on, and the launcher passes it on to the user."""


def run_worker(configs: list[RunConfig], model: PipelineModel | None = None) -> list[dict]:
    """Run each config in turn on this rank and return one result per config: the full
    result (losses, step times, gathered Trace) on rank 0, the gradients (when asked
    for) on every rank."""
    first = configs[0]
    rank, world, device, backend = init_rank(first.backend, first.threads, first.timeout)
    directory = progress_dir_from_env()
    progress = ProgressWriter(directory, rank) if directory else None
    try:
        results = [run_config(config, model, rank, world, backend, device, progress) for config in configs]
    finally:
        if progress is not None:
            progress.close()
        if world > 1:
            dist.destroy_process_group()
    return results


def run_local(config: RunConfig, model: PipelineModel | None = None) -> dict:
    """Run a config on this process alone (``pp=1``: every stage here, no communication)."""
    if config.world_size != 1:
        raise ValueError(f"run_local runs one process only; dp={config.dp} x pp={config.pp} x tp={config.tp} "
                         f"needs launch() or torchrun")
    config.check()
    (result,) = run_worker([config], model)
    return result


def run_config(config: RunConfig, model: PipelineModel | None, rank: int, world: int, backend: str,
               device: torch.device, progress: ProgressWriter | None) -> dict:
    """Train ``config.steps`` steps of this rank's stages under the config's schedule."""
    run = RankRun(config, model, rank, world, backend, device, progress)
    for step in range(config.steps):
        run.step(step)
    return run.result()


class RankRun:
    """This rank's stages, optimizer and runtime for one config, stepped one step at a
    time (so a benchmark can interleave it with another runtime step by step)."""

    def __init__(self, config: RunConfig, model: PipelineModel | None, rank: int, world: int, backend: str,
                 device: torch.device, progress: ProgressWriter | None) -> None:
        schedule = build_schedule(config)
        try:
            self.mesh = build_mesh(rank, world, config.dp, schedule.pp, config.tp, device.type, config.timeout,
                                   config.cp)
        except ValueError as error:
            raise RankFailedError(str(error)) from None
        position = self.mesh.position
        self.config, self.schedule, self.rank, self.world = config, schedule, rank, world
        self.pp_rank = pp_rank = position.pp_index  # this process's rank in its pipeline
        self.backend, self.device, self.progress = backend, device, progress
        self.model = model = model or build_model(config)
        # with DualPipe's two copies a pipeline stage runs model stage (stage mod pp) (executor.copies)
        self.stages = {stage: model.build_stage(model_stage(schedule, stage), schedule.copy_stages).to(device)
                       for stage in schedule.stages_of(pp_rank)}
        self.tp_timer = None
        self.clock = clock_for(device)
        # ZeRO-3 beside DualPipe's two copies: FSDP shards over both copies' holders, an axis
        # of a mesh of its own, whose tp axis tensor parallelism must then split over
        held_by_copies = None
        if config.zero == 3 and schedule.copies > 1 and world > 1:
            check_mirrored(schedule, every_compute=True)
            held_by_copies = copies_mesh(schedule, position, device.type, config.timeout)
        if config.tp > 1:
            from executor.tensor_parallel import TpTimer, parallelize_stage  # noqa: PLC0415 - DTensor only for tp

            tp_mesh = held_by_copies["tp"] if held_by_copies is not None else self.mesh.submesh("tp")
            for stage in self.stages.values():
                parallelize_stage(stage, tp_mesh, config.sequence_parallel, fold_experts=config.folded,
                                  shard_routing=config.routes_shards)
            self.tp_timer = TpTimer(lambda: self.runtime.current, self.clock.mark, progress)
        for stage in self.stages.values():
            apply_recompute(stage, config.recompute, config.recompute_moe_act)
        self.context = None
        self.cp_timer = None
        self.attention: dict[tuple[int, str], float] = {}  # ring attention's core, seconds by (stage, kind), last step
        if config.cp > 1:
            from executor.context_parallel import ContextShard, shard_context  # noqa: PLC0415 - cp only
            from executor.inside_timing import RingTimer  # noqa: PLC0415

            if config.cp_comm == "p2p":
                self.cp_timer = RingTimer(lambda: self.runtime.current, self.clock.mark)
            self.context = ContextShard(self.mesh.group("cp"), config.cp, position.cp_index, config.seq_len,
                                        config.cp_comm, self.cp_timer)
            for stage in self.stages.values():
                shard_context(stage, self.context)
        expert_groups = None
        self.ep_timer = None
        if config.ep > 1 or config.folded:
            from executor.expert_parallel import ExpertGroups, shard_experts  # noqa: PLC0415 - MoE only
            from executor.inside_timing import CollectiveTimer  # noqa: PLC0415

            expert_groups = ExpertGroups.build(rank, position, config.ep, config.timeout, schedule.copies,
                                               config.folded)
            self.ep_timer = CollectiveTimer(lambda: self.runtime.current, self.clock.mark)
            for stage in self.stages.values():
                shard_experts(stage, expert_groups, self.ep_timer)
        unsharded = sum(local_tensor(p.detach()).numel() * p.element_size()
                        for stage in self.stages.values() for p in stage.parameters())
        self.fsdp_timer = None
        fsdp_weight_grad = None  # ZeRO-3: W gathers and reduces unit by unit
        if config.zero == 3:
            from executor.fsdp import ShardedWeightGrad, shard_stages  # noqa: PLC0415
            from executor.fsdp_timing import FsdpTimer  # noqa: PLC0415

            fsdp_weight_grad = ShardedWeightGrad()
            self.fsdp_timer = FsdpTimer(lambda: self.runtime.current, self.clock.mark)
            shard_stages(self.stages, self.mesh.mesh, config.cp, config.dp,
                         expert_groups.expert_dp_group if expert_groups else None, config.timeout, self.fsdp_timer,
                         copies=held_by_copies)
        self.params = params = [p for stage in self.stages.values() for p in stage.parameters()]
        # folded experts (--etp 1) are whole on each tp rank: their expert data-parallel group,
        # which the averager counts, already holds the tp peers (executor.grad_clip)
        self.folded_experts: set[int] = set()
        if config.folded:
            from executor.expert_parallel import expert_parameters  # noqa: PLC0415 - MoE only

            self.folded_experts = expert_parameters(self.stages)
        self.tied = None  # the table's copies: tied output, MTP embeddings (after FSDP, which replaces the parameters)
        if is_tied(model):
            group = embedding_group(schedule, position, config.timeout) if world > 1 else None
            self.tied = TiedEmbeddings(self.stages, group, model.spec)
        alone = {id(param) for param in self.tied.held} if self.tied is not None else set()
        self.scaler = LossScaler(enabled=config.dtype == "float16")
        self.skipped_steps: list[int] = []
        self.averager = None
        # ZeRO-3: FSDP reduces the gradients itself. ZeRO-1/2 on one replica (a one-rank
        # group, scripts/gpu_check.py) still shards through the averager.
        # under parallel folding the experts' gradients are summed over tp peers too (their
        # expert data-parallel group), even with one replica
        if (config.dp > 1 or config.cp > 1 or config.zero in (1, 2) or schedule.copies > 1 or config.folded) \
                and config.zero < 3:
            dense_group = self.mesh.group("dp")
            # the averager's step-level collectives (ZeRO's gathers, a stage left unreduced) go
            # stage by stage in this order; DualPipe's mirror ranks list the same model stages
            reduced_stages = by_model_stage(schedule, self.stages)
            if schedule.copies > 1:  # DualPipe: summed with the other copy's holders (and cp), averaged over dp
                check_mirrored(schedule)
                dense_group = copies_group(schedule, position, config.timeout)
            elif config.cp > 1:  # the cp ranks' gradients summed, the replicas' averaged (executor.context_parallel)
                from executor.context_parallel import dp_cp_group  # noqa: PLC0415 - cp only

                dense_group = dp_cp_group(rank, position, config.timeout)
            if expert_groups is not None:
                from executor.expert_parallel import ExpertAwareAverager  # noqa: PLC0415 - MoE only

                self.averager = ExpertAwareAverager(reduced_stages, schedule.programs[pp_rank], dense_group,
                                                    expert_groups, config.dp, config.dp_bucket_mb * 2**20,
                                                    getattr(torch, config.reduce_dtype), config.zero, alone)
            else:
                self.averager = GradientAverager(reduced_stages, schedule.programs[pp_rank], dense_group, config.dp,
                                                 config.dp_bucket_mb * 2**20,
                                                 reduce_dtype=getattr(torch, config.reduce_dtype), zero=config.zero,
                                                 alone=alone)
        if config.zero in (1, 2):  # the optimizer steps this replica's shard only
            shard, matrices = self.averager.optimizer_tensors()
            self.optimizer = build_optimizer(config, shard, decays=lambda tensor: id(tensor) in matrices)
        else:  # foreach kernels refuse a list mixing DTensors (tp-split) and plain tensors.
            self.optimizer = build_optimizer(config, params, foreach=False if config.tp > 1 else None)
        self.lr_schedule = attach_schedule(self.optimizer, config)
        batch = config.replica_batch_size
        sizes = [len(part) for part in torch.tensor_split(torch.arange(batch), config.microbatches)]
        # Pipeline peers are the processes at the same (dp, tp) position of the mesh.
        placement = tuple(position.global_rank(pipeline_rank) for pipeline_rank in schedule.placement)
        rendezvous = config.p2p_semantics(backend) == "rendezvous"
        split = config.boundary_sequence_split  # a cp (and, with SP, tp) rank sends its share of the sequence
        self.links = PeerLinks(placement, config.microbatches, device, getattr(torch, config.dtype),
                               lambda action: local_shape(model.boundary_shape(
                                   sizes[data_index(schedule, action.stage, action.microbatch)]), split),
                               handshake=rendezvous and backend != "nccl", rank=rank)
        self.memory = MemoryTracker(params, device)
        self.memory.unsharded_params = unsharded
        self.memory.optimizer = self.optimizer
        if config.zero in (1, 2):
            self.memory.extra_grads = self.averager.held_shards
        before = chain_hooks(action_hook(config, rank, progress),
                             self.averager.before_action if self.averager else None, self.memory.before_action)
        self.runtime = PipelineRuntime(pp_rank, schedule, self.stages, model, self.links, self.clock,
                                       batch, before, progress=progress,
                                       prefetch_recvs=config.prefetch_receives(backend), rendezvous=rendezvous,
                                       after_action=chain_hooks(self.averager.after_action if self.averager
                                                                else None, self.memory.after_action),
                                       precision=Precision(config, device),
                                       weight_grad_runner=fsdp_weight_grad)
        # DeepSeek-V3's selection biases, moved after each step from every rank's expert loads
        self.balance = ExpertBalance(config, self.stages.values(), device)
        self.waiting_on: str | None = None  # a step-level collective the rank is blocked in
        self.losses: list[float] = []
        self.step_times: list[float] = []
        self.events: list = []
        self.grads: dict[str, torch.Tensor] = {}
        self.grad_norms: list[float] = []  # --clip-grad: the global norm before each step's clipping
        self.sum_over_ranks = dist.all_reduce if world > 1 else None  # a step-level sum over every rank
        runtime = self.runtime
        self.memory.buffers = lambda: [*runtime.outbox.values(), *runtime.forward_inputs.values(),
                                       *runtime.output_grads.values()]
        self.memory.weight_grad_inputs = lambda: [
            grad for work in runtime.weight_work.values()
            for grad in (*(grad for _, grads in work.calls for grad in grads), work.output_grad) if grad is not None]
        self.memory_peak = MemoryPeak()
        self.one_timeline = shared_clock(device, self.world)  # every rank on one perf_counter (executor.clock)

    def step(self, step: int) -> None:
        """One training step: the program, the optimizer, the loss made known to all."""
        config, device = self.config, self.device
        inputs, targets = self.model.make_batch(step, config.batch_size)
        replica = self.mesh.position.dp_index  # this replica's slice of the global batch
        inputs = torch.tensor_split(inputs, config.dp)[replica]
        targets = torch.tensor_split(targets, config.dp)[replica]
        if self.context is not None:  # this cp rank's chunks of every sequence
            inputs, targets = self.context.local(inputs), self.context.local(targets)
        # each microbatch its own storage, as a loader hands it over: a view would keep the whole
        # step's batch alive in every microbatch's stash (the embedding saves its ids), which the
        # memory tracker then counts once a microbatch (on a CPU ``to`` copies nothing)
        inputs = [part.clone() for part in torch.tensor_split(inputs.to(device), config.microbatches)]
        targets = [part.clone() for part in torch.tensor_split(targets.to(device), config.microbatches)]
        self.optimizer.zero_grad(set_to_none=True)
        if self.averager is not None and self.config.zero in (1, 2):  # the optimizer holds shards
            self.averager.zero_grad()
            for param in self.params:
                param.grad = None
        if self.progress is not None:
            self.progress.step = step
        if self.world > 1:
            self.wait_for("in the step's barrier", dist.barrier)
        started = time.perf_counter()
        self.runtime.loss_scale = self.scaler.scale
        self.balance.start_step()
        self.memory.start_step()
        try:
            if self.tp_timer is not None:
                with self.tp_timer.timing():
                    loss, self.events = self.runtime.run_step(inputs, targets)
            else:
                loss, self.events = self.runtime.run_step(inputs, targets)
            self.events.extend(self.collective_events())  # also waits for the dp all-reduce
        except Exception as error:
            where = self.waiting_on or self.runtime.where()
            raise RankFailedError(f"rank {self.rank} failed in step {step} {where}: "
                                  f"{type(error).__name__}: {error}") from error
        tail = StepTail(self.runtime.clock)
        if self.tied is not None:  # the table's two copies' gradients summed, as one tied weight's
            with tail.timing(EMBEDDING_ALLREDUCE):
                self.wait_for("in the tied embeddings' all-reduce", lambda: self.tied.sum_gradients(self.averager))
        # fp16: every rank of the job skips the step if any gradient anywhere overflowed.
        sharded = config.zero in (1, 2)
        overflow = self.scaler.unscale(self.averager.shard_grads() if sharded else [p.grad for p in self.params])
        if config.return_grads and step == 0:
            if sharded:
                self.averager.full_gradients()
            self.grads = {f"{model_stage(self.schedule, stage)}.{name}": full_tensor(p.grad).detach().cpu().clone()
                          for stage, module in by_model_stage(self.schedule, self.stages).items()
                          for name, p in module.named_parameters()}
        if overflow:
            self.skipped_steps.append(step)
        else:
            if config.clip_grad is not None:
                with tail.timing(GRAD_NORM_ALLREDUCE):
                    self.grad_norms.append(self.wait_for("in the gradient norm's all-reduce", lambda: clip_gradients(
                        self.stepped_gradients(), config.clip_grad, self.sum_over_ranks)))
            with tail.timing(OPTIMIZER):
                self.optimizer.step()
        if self.lr_schedule is not None:  # once a step, a skipped one too (executor.lr_schedule)
            self.lr_schedule.step()
        if sharded:  # every replica's parameters from the shards each one stepped (also on a skipped step)
            gathers = self.wait_for("in the dp parameter all-gather", self.averager.gather_parameters)
            self.events.extend(self.dp_events(gathers))
        self.scaler.update(overflow)
        if self.balance.active:
            with tail.timing(EXPERT_LOAD_ALLREDUCE):
                self.wait_for("in the expert-load all-reduce", lambda: self.balance.end_step(self.sum_over_ranks))
        self.memory_peak = self.memory.finish_step()
        with tail.timing(LOSS_ALLREDUCE):
            if self.world > 1:
                # Only last-stage ranks hold a share: each replica's mean loss, once per tp rank
                # (a cp rank holds its tokens' part of its replica's loss: summed, not averaged).
                self.wait_for("in the loss all-reduce", lambda: dist.all_reduce(loss))
                loss /= config.dp * config.tp
            self.losses.append(self.wait_for("in the loss all-reduce", loss.item))
        self.step_times.append(time.perf_counter() - started)
        self.events.extend(tail.events(self.pp_rank))
        if self.one_timeline:  # every rank's events, and the step, from the earliest rank's start
            first = self.wait_for("in the step's clock exchange", lambda: earliest_start(started))
            self.step_times[-1] += started - first
            self.events = shifted(self.events, self.runtime.clock.origin - first)

    def stepped_gradients(self) -> list[tuple[torch.Tensor, float]]:
        """What the optimizer steps, each with the number of ranks holding the same
        tensor (``executor.grad_clip``). A norm weight's gradient that sequence
        parallelism left a partial sum over tp is summed first (as DTensor's optimizer
        would when stepping it, and ZeRO's averager does before reducing it)."""
        for param in self.params:
            if param.grad is not None and is_partial(param.grad):
                param.grad = param.grad.redistribute(param.grad.device_mesh, param.placements)
        if self.averager is not None:
            held = self.averager.stepped_gradients()
        else:  # one replica, or ZeRO-3, whose local shards are this rank's alone
            held = [(param.grad, param, 1) for param in self.params if param.grad is not None]
        tied = self.tied.holders if self.tied is not None else lambda _param: 1
        tp = self.config.tp
        return [(grad, holders * (1 if id(param) in self.folded_experts else tp_copies(param, tp)) * tied(param))
                for grad, param, holders in held]

    def wait_for(self, what: str, call):
        """``call()`` marked in the progress file as a wait for peers, so that a rank
        that times out here is not taken for the one that stopped first. On a GPU the
        host reaches these points ahead of the device: it first follows the device
        through the step's P2P groups (``PipelineRuntime.follow_device``)."""
        self.waiting_on = what
        if self.progress is None:
            result = call()
            self.waiting_on = None
            return result
        self.runtime.follow_device()
        self.progress.waiting(what)
        result = call()  # on an error the line keeps saying that the rank was waiting here
        self.progress.running()
        self.waiting_on = None
        return result

    def collective_events(self) -> list:
        """This step's dp all-reduce buckets, FSDP's gathers and reduce-scatters, tp
        collectives, ep all-to-alls and ring attention's waits as Trace events (and the
        ring's attention core, kept for ``gather_attention``). The collectives inside
        actions are timed in the runtime clock's marks (CUDA events on a GPU, FSDP's on
        its own streams); the dp buckets in host time, so on a GPU they are left out
        (they would need events on the dp stream)."""
        reductions = self.wait_for("in the dp all-reduce", self.averager.finish) if self.averager is not None else []
        clock = self.runtime.clock
        events = []
        if self.cp_timer is not None:
            self.attention = defaultdict(float)
            for action, start, end in self.cp_timer.take_attention():
                if action is not None:
                    self.attention[action.stage, action.kind] += clock.seconds(end) - clock.seconds(start)
        for timer, kind in ((self.tp_timer, TP_KIND), (self.ep_timer, EP_KIND), (self.cp_timer, CP_KIND)):
            collectives = timer.take() if timer is not None else []
            events += [inside_event(self.pp_rank, action, clock.seconds(start), clock.seconds(end), kind)
                       for action, start, end in collectives if action is not None]
        if self.fsdp_timer is not None:
            events += [fsdp_event(self.pp_rank, kind, unit, action, clock.seconds(start), clock.seconds(end))
                       for kind, _, unit, action, start, end in self.fsdp_timer.take() if action is not None]
        return events + self.dp_events(reductions)

    def dp_events(self, timings: list) -> list:
        """dp buckets as Trace events; host-timed, so left out on a GPU (they would need
        events on the dp stream)."""
        clock = self.runtime.clock
        if not isinstance(clock, CpuClock):
            return []
        return [dp_event(self.pp_rank, stage, clock.seconds(start), clock.seconds(end), kind, bucket)
                for stage, bucket, kind, start, end in timings]

    def result(self) -> dict:
        """Rank 0: the run's summary and the last step's Trace from every rank; every
        rank: its gradients of the first step, when the config asked for them."""
        schedule, events = self.schedule, self.events
        config = self.config
        shape = {"dp": config.dp, "tp": config.tp, "ep": config.ep, "cp": config.cp,
                 "cp_comm": config.cp_comm if config.cp > 1 else None, "ep_overlap": config.ep_overlap,
                 "etp": config.expert_tp,
                 "global_batch_size": config.batch_size,
                 "replica_batch_size": config.replica_batch_size}
        meta = {"pp": schedule.pp, "virtual_stages": schedule.virtual_stages, "schedule": schedule.name,
                "microbatches": schedule.microbatches, "source": "measured", "backend": self.backend,
                "world_size": self.world, "step": len(self.losses) - 1, **shape,
                "one_timeline": self.one_timeline}  # every rank's events from one start (executor.clock)
        if self.fsdp_timer is not None and self.device.type == "cpu":
            # FSDP2's collectives held the rank inside its actions (synchronous on gloo,
            # executor.fsdp_timing); on a GPU they run on FSDP's own streams beside the compute
            meta["dp_held_inside_actions"] = True
        if schedule.copies > 1:  # DualPipe: `microbatches` counts one direction's, as the simulator's Trace does
            meta["copies"] = schedule.copies
        if any(schedule.fused):  # what the simulator must charge a pair (pipesim.sim.overlap)
            meta.update(pairs_overlap=self.runtime.lanes.overlaps, pairs_overlapped=self.runtime.pairs_overlapped,
                        pairs=len(schedule.fused_pairs(self.pp_rank)))
        if self.world > 1:
            events = gather_events(schedule, self.pp_rank, events, self.device, self.mesh.group("pp"))
            if self.one_timeline:  # the norm's all-reduce: the wait for the last rank drawn as such
                events = split_joining_waits(events)
        params = {}
        if config.return_grads:  # the weights after the last step (a collective on tp groups)
            params = {f"{model_stage(schedule, stage)}.{name}": full_tensor(p.detach()).cpu().clone()
                      for stage, module in by_model_stage(schedule, self.stages).items()
                      for name, p in module.named_parameters()}
        if config.return_grads:
            params.update(selection_biases(by_model_stage(schedule, self.stages)))
        held = sum(local_tensor(p).numel() for group in self.optimizer.param_groups for p in group["params"])
        result = {"rank": self.rank, "grads": self.grads, "params": params, "optimizer_elements": held,
                  "skipped_steps": self.skipped_steps, "grad_norms": self.grad_norms,
                  "loss_scale": self.scaler.scale}
        memory = self.gather_memory()
        attention = self.gather_attention() if self.cp_timer is not None else None
        if attention is not None and self.rank == 0:
            result["attention_seconds"] = attention
        if self.rank == 0:
            result.update(memory=memory, schedule=schedule.name, pp=schedule.pp, microbatches=schedule.microbatches,
                          virtual_stages=schedule.virtual_stages, world_size=self.world, backend=self.backend,
                          losses=self.losses, step_times=self.step_times, copies=schedule.copies, **shape,
                          trace=Trace.merge([Trace(events)], meta))
        return result


    def gather_attention(self) -> dict[str, float]:
        """Ring attention's core of the last step, the mean seconds of one action of
        each (stage, compute kind) of this pipeline, by ``{stage}{kind}`` (what the
        simulator sets the ring's transfers against; ``executor.run_costs``); every pp
        rank adds its own stages', summed over the pp group."""
        kinds = list(COMPUTE_KINDS)
        table = torch.zeros(self.schedule.num_stages, len(kinds), dtype=torch.float64)
        program = self.schedule.programs[self.pp_rank]
        for (stage, kind), seconds in self.attention.items():
            actions = sum(1 for action in program if action.stage == stage and action.kind == kind)
            table[stage, kinds.index(kind)] = seconds / max(actions, 1)
        table = table.to(self.device)
        if self.world > 1:
            dist.all_reduce(table, group=self.mesh.group("pp"))
        return {f"{stage}{kind}": float(table[stage, index]) for stage in range(self.schedule.num_stages)
                for index, kind in enumerate(kinds) if table[stage, index] > 0}

    def gather_memory(self) -> list[dict]:
        """Every rank's measured memory of the last step (bytes by kind), on every rank;
        gathered as numbers, like the Trace."""
        mine = torch.tensor(self.memory_peak.as_list(), dtype=torch.float64, device=self.device)
        rows = [mine]
        if self.world > 1:
            rows = [torch.empty_like(mine) for _ in range(self.world)]
            dist.all_gather(rows, mine)
        source = "cuda" if self.device.type == "cuda" else "tracked"
        # the GPU's generation sizes what torch's cuBLAS workspaces hold (pipesim.cli.run_memory)
        device = {"cuda_capability": list(torch.cuda.get_device_capability(self.device))} if source == "cuda" else {}
        routed = self.gather_routed_rows()
        return [{"rank": rank, "source": source, **device, **dict(zip(FIELDS, row.tolist(), strict=True)),
                 **({"routed_rows": routed[rank]} if routed is not None else {})}
                for rank, row in enumerate(rows)]

    def gather_routed_rows(self) -> list[list[list[float]]] | None:
        """Every rank's routed copies its experts ran in each forward of the last step, as
        ``[stage][microbatch]`` (``executor.routed_rows``); ``None`` where no rank ran any
        (no expert parallelism, or a GPU run, whose forwards the tracker does not open)."""
        if self.config.ep == 1:  # every rank's experts run in-process: nothing routed elsewhere, nothing counted
            return None
        actions = [action for program in self.schedule.programs for action in program if action.kind == ActionKind.F]
        shape = (1 + max(action.stage for action in actions), 1 + max(action.microbatch for action in actions))
        mine = torch.zeros(shape, dtype=torch.float64)
        for (stage, microbatch), rows in ROUTED_ROWS.counts.items():
            mine[stage, microbatch] = rows
        mine = mine.to(self.device)
        tables = [mine]
        if self.world > 1:
            tables = [torch.empty_like(mine) for _ in range(self.world)]
            dist.all_gather(tables, mine)
        if not any(bool(table.any()) for table in tables):
            return None
        return [table.cpu().tolist() for table in tables]


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a tp-split DTensor (a collective on its tp group)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def chain_hooks(*hooks):
    """One per-action hook that runs each given hook (``None`` ones skipped) in order."""
    present = [hook for hook in hooks if hook is not None]
    if len(present) <= 1:
        return present[0] if present else None

    def chained(action: Action) -> None:
        for hook in present:
            hook(action)

    return chained


def action_hook(config: RunConfig, rank: int, progress: ProgressWriter | None):
    """What runs before each action: the progress line, and any injected failure."""
    failure = parse_failure(config.inject_failure) if config.inject_failure else None
    target = failure if failure and failure[0] == rank else None
    if progress is None and target is None:
        return None

    def before(action: Action) -> None:
        if progress is not None:
            progress.on_action(action)
        if target is not None and str(action) == target[1] and (progress is None or progress.step == 0):
            if target[2] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if target[2] == "hang":
                # When the hang began, for whoever checks how soon the job ended after it.
                print(f"rank {rank}: --inject-failure hangs before {action} at {time.time():.3f}", file=sys.stderr,
                      flush=True)
                time.sleep(24 * 3600)  # its peers must give up after --timeout
            raise RuntimeError(f"failure injected by --inject-failure {config.inject_failure}")

    return before
