"""The runtime: one rank walks its lowered program, one handler per action kind.

``F`` runs a stage forward and stashes what its backward needs; ``B`` runs the full
backward; ``I`` computes only the input gradient and ``W`` the weight gradients from
what ``I`` kept, without running the stage's backward again
(``executor.split_backward``), so zero-bubble schedules run unchanged. Each P2P group of
the program is posted as one batch (``executor.comm``). Under ``rendezvous`` semantics
(NCCL, or gloo emulating it) posting never blocks: a group is waited for (whole, as
Megatron waits on every op of a batch) right before the compute action that needs one
of its receives, and every group by the end of the step; on gloo the groups are
started one after another, as NCCL runs them on its stream. Under ``buffered`` (gloo)
a group is posted at its place and never waited for there: each receive is waited for
right before the compute action that needs it (``irecv`` now, ``wait`` then), and sends
complete in the background, timed when they are seen to finish. Stashes are dropped as soon as the backward that needed
them is done. An overlapped forward-backward pair (DualPipeV's) is one step with a
handler of its own: both of its inputs are waited for first, then its halves run on
two CUDA streams on a GPU, one after the other on a CPU (``executor.pair_streams``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from executor.architectures.moe import balanced_layers, set_balance_scale
from executor.architectures.mtp import give_targets
from executor.comm import PeerLinks, Pending, Posted
from executor.copies import data_index
from executor.models import PipelineModel
from executor.pair_streams import COMPUTE_LANE, OverlappedPair, PairLanes, pair_events, with_pairs
from executor.precision import Precision
from executor.split_backward import ModuleCall, SplitBackward, WeightWork
from schedules import dataflow
from schedules.action import RECV_KINDS, RECV_OF, SEND_KINDS, Action, ActionKind
from schedules.schedule import Schedule
from schedules.trace import TraceEvent

Key = tuple[int, int]  # (stage, microbatch)


@dataclass(eq=False)
class InFlight:
    """One P2P group on a rank's stream (rendezvous): its ops, and once started its
    posted actions, start mark and (on a GPU) the event that completes with it."""

    group: tuple[Action, ...]
    ops: list
    posted: list[Posted] | None = None
    start: Any = None
    end_mark: Any = None
    done: bool = False


class PipelineRuntime:
    """Runs one rank's share of a training step, action by action, and times each one."""

    def __init__(self, rank: int, schedule: Schedule, stages: dict[int, nn.Module], model: PipelineModel,
                 links: PeerLinks | None, clock: Any, batch_size: int,
                 before_action: Callable[[Action], None] | None = None, prefetch_recvs: bool = False,
                 after_action: Callable[[Action], None] | None = None, precision: Precision | None = None,
                 rendezvous: bool = False, progress: Any = None,
                 weight_grad_runner: Callable[[SplitBackward, nn.Module, WeightWork], None] | None = None) -> None:
        self.rank = rank
        self.schedule = schedule
        self.stages = stages
        self.model = model
        self.links = links
        self.clock = clock
        self.batch_size = batch_size
        self.before_action = before_action
        self.after_action = after_action  # e.g. start a stage's dp all-reduce after its last backward
        self.rendezvous = rendezvous  # wait for whole groups; never post a receive ahead
        self.prefetch_recvs = prefetch_recvs and links is not None and not rendezvous
        self.progress = progress  # executor.progress.ProgressWriter: where the rank waits
        self.precision = precision or Precision()
        self.loss_scale = 1.0  # set each step by fp16's dynamic loss scaling
        self.balanced = balanced_layers(stages.values())  # MoE layers adding a balance loss (their gradient's scale)
        # each copy of the model (DualPipe: two, fed from both ends) has its own first and
        # last stage, and its own half of the step's microbatches (executor.copies)
        self.first_stages, self.last_stages = schedule.first_stages, schedule.last_stages
        self.items = schedule.program_items(rank)  # P2P groups as lowering made them
        # an overlapped pair is one step: its forward waits for the backward's input too
        self.pair_of = {forward: backward for forward, backward in schedule.fused_pairs(rank)}
        self.steps = with_pairs(self.items, self.pair_of)  # what the walk runs, pairs as one step each
        self.handlers: dict[str, Callable[[Action], None]] = {
            ActionKind.F: self.forward,
            ActionKind.B: self.backward,
            ActionKind.I: self.input_grad,
            ActionKind.W: self.weight_grad,
        }
        # Stages whose backward this rank splits into I and W record, during the F of
        # those microbatches, where the weight gradients start (executor.split_backward).
        self.split_keys = {(a.stage, a.microbatch) for a in self.items
                           if isinstance(a, Action) and a.kind == ActionKind.I}
        self.splitters = {stage: SplitBackward(stages[stage]) for stage in {stage for stage, _ in self.split_keys}}
        if self.splitters:
            self.handlers[ActionKind.F] = self.forward_recording
        # how W runs (under ZeRO-3, executor.fsdp.ShardedWeightGrad: unit by unit, gathered and reduced)
        self.weight_grad_runner = weight_grad_runner or (lambda splitter, _stage, work: splitter.weight_grad(work))
        self.current: Action | None = None
        self.current_group: tuple[Action, ...] | None = None  # the P2P group being waited for
        self.device_marks: list[tuple[tuple[Action, ...], Any]] = []  # (group, CUDA event at its end)
        self.side_stream = None  # CUDA: where the completion of communication is marked
        # The dtype/device of the loss, fixed once the stages are built.
        param = next((p for stage in stages.values() for p in stage.parameters()), None)
        # The loss adds up in float32 at least, whatever type the stages compute in.
        self.loss_dtype = torch.float64 if param is not None and param.dtype == torch.float64 else torch.float32
        self.loss_device = param.device if param is not None else None
        # where an overlapped pair's halves run (executor.pair_streams): the rank's device
        self.lanes = PairLanes(links.device if links is not None else self.loss_device or torch.device("cpu"))
        self.pairs_overlapped = 0  # of the last step: pairs whose halves ran at the same time

    # -- the walk -------------------------------------------------------------------

    def run_step(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> tuple[torch.Tensor, list]:
        """Run the program once over these microbatches; return this rank's share of the
        loss (non-zero on the last stage only) and the timed events."""
        self.inputs, self.targets = inputs, targets
        self.forward_inputs: dict[Key, torch.Tensor] = {}  # input of F(stage, mb)
        self.output_grads: dict[Key, torch.Tensor] = {}  # gradient of F(stage, mb)'s output
        self.outbox: dict[tuple[str, int, int], torch.Tensor] = {}  # what SEND_F / SEND_B will send
        self.stash: dict[Key, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.module_calls: dict[Key, list[ModuleCall]] = {}  # what F recorded for a split backward
        self.weight_work: dict[Key, WeightWork] = {}
        self.pending: list[Pending] = []
        self.stream: list[InFlight] = []  # rendezvous: groups not yet completed, in posting order
        self.awaited: dict[tuple[str, int, int], InFlight] = {}  # receive -> its group, until waited for
        self.arriving: dict[tuple[str, int, int], Posted] = {}  # buffered: receives posted, not yet waited for
        self.marks: list[tuple[Action, Any, Any, str]] = []
        self.loss = torch.zeros((), dtype=self.loss_dtype, device=self.loss_device)
        # the balance losses' gradient, as the model loss's: over the batch, at fp16's scale
        set_balance_scale(self.balanced, self.loss_scale / self.batch_size)
        self.clock.start_step()
        self.device_marks = []
        if self.links is not None:
            self.links.start_step()
        self.prefetched = self.prefetch_receives() if self.prefetch_recvs else None
        self.lanes.start_step()
        self.pair_marks: list[int] = []  # where each pair's forward is in ``marks`` (its backward next)
        for item in self.steps:
            if isinstance(item, OverlappedPair):
                self.overlapped_pair(item)
            elif isinstance(item, Action):
                self.compute(item)
            else:  # a P2P group (an Action is a tuple too, hence the order of the tests)
                self.communicate(item)
            if self.pending:
                self.poll_sends()
            if self.stream:
                self.advance_stream()
        self.finish_groups()
        self.finish_arrivals()
        self.finish_sends()
        self.current = self.current_group = None
        leftover = len(self.stash) + len(self.weight_work) + len(self.module_calls)
        if leftover:
            raise RuntimeError(f"rank {self.rank}: {leftover} forward stashes were never consumed by a backward")
        events = [TraceEvent.of(self.rank, action, self.clock.seconds(start), self.clock.seconds(end), stream)
                  for action, start, end, stream in self.marks]
        self.pairs_overlapped = 0
        for at in self.pair_marks:
            forward, backward = events[at], events[at + 1]
            self.pairs_overlapped += forward.start < backward.end and backward.start < forward.end
            events[at], events[at + 1] = pair_events(forward, backward)
        return self.loss, events

    # -- compute --------------------------------------------------------------------

    def compute(self, action: Action) -> None:
        """One compute action on the compute stream, once its input is here."""
        self.current = action
        if self.before_action is not None:
            self.before_action(action)
        if self.awaited or self.arriving:
            self.await_input(action)
        start = self.clock.mark()
        self.handlers[action.kind](action)
        self.marks.append((action, start, self.clock.mark(), "compute"))
        if self.after_action is not None:
            self.after_action(action)

    def overlapped_pair(self, pair: OverlappedPair) -> None:
        """An overlapped pair: both inputs waited for on the compute stream, then the
        forward half on one lane and the backward half on the other (two CUDA streams;
        on a CPU one after the other, in the same order), the compute stream waiting
        for both before anything after the pair (``executor.pair_streams``). Each half
        keeps its own per-action hooks, the forward's closed before the backward starts."""
        forward, backward = pair.forward, pair.backward
        self.current = forward
        if self.before_action is not None:
            self.before_action(forward)
        if self.awaited or self.arriving:
            self.await_input(forward)
            self.await_input(backward)
            self.current = forward
        forward_lane, backward_lane = self.lanes.assign(pair)
        self.lanes.fork()
        self.pair_marks.append(len(self.marks))
        self.run_half(forward, forward_lane)
        if self.after_action is not None:
            self.after_action(forward)
        self.current = backward
        if self.before_action is not None:
            self.before_action(backward)
        self.run_half(backward, backward_lane)
        self.lanes.join()
        self.lanes.hand_over(self.made_by(forward) + self.made_by(backward), COMPUTE_LANE)
        if self.after_action is not None:
            self.after_action(backward)

    def run_half(self, action: Action, lane: int) -> None:
        """One half of a pair on its lane, timed there; its inputs handed to the lane."""
        self.lanes.hand_over(self.used_by(action), lane)
        with self.lanes.on(lane):
            start = self.clock.mark()
            self.handlers[action.kind](action)
            self.marks.append((action, start, self.clock.mark(), "compute"))

    def used_by(self, action: Action) -> list[torch.Tensor | None]:
        """The tensors a compute action reads that an earlier action made: its input,
        targets, stash and output gradient (a lane reading them must hold their memory)."""
        key = (action.stage, action.microbatch)
        if action.kind == ActionKind.F:
            data = data_index(self.schedule, action.stage, action.microbatch)
            made = [self.inputs[data] if action.stage in self.first_stages else self.forward_inputs.get(key)]
            return made + ([self.targets[data]] if action.stage in self.last_stages else [])
        return [*self.stash.get(key, ()), self.output_grads.get(key)]

    def made_by(self, action: Action) -> list[torch.Tensor | None]:
        """What a compute action left for later actions: its output (stashed, sent or
        kept for the next stage here) or its input gradient (sent or kept)."""
        stage, microbatch = action.stage, action.microbatch
        target = dataflow.output_stage(stage, action.kind)
        if action.kind == ActionKind.F:
            made = [*self.stash.get((stage, microbatch), ()), self.outbox.get((ActionKind.SEND_F, stage, microbatch))]
            return made + [self.forward_inputs.get((target, microbatch))]
        return [self.outbox.get((ActionKind.SEND_B, stage, microbatch)), self.output_grads.get((target, microbatch))]

    def forward(self, action: Action) -> None:
        stage, microbatch = action.stage, action.microbatch
        first = stage in self.first_stages
        if first:
            x = self.inputs[data_index(self.schedule, stage, microbatch)]
        else:
            x = self.forward_inputs.pop((stage, microbatch)).requires_grad_(True)
        last = stage in self.last_stages
        if last:  # also what a multi-token prediction head embeds
            targets = self.targets[data_index(self.schedule, stage, microbatch)]
            give_targets(self.stages[stage], targets)
        output = self.precision.forward(self.stages[stage], x)
        if last:
            loss = self.model.loss_sum(self.precision.for_loss(output), targets) / self.batch_size
            self.loss += loss.detach().to(self.loss_dtype)
            output = loss * self.loss_scale if self.loss_scale != 1.0 else loss
        elif self.schedule.placement[target := dataflow.output_stage(stage, ActionKind.F)] == self.rank:
            self.forward_inputs[(target, microbatch)] = self.precision.to_wire(output.detach())
        else:
            self.outbox[(ActionKind.SEND_F, stage, microbatch)] = self.precision.to_wire(output.detach())
        self.stash[(stage, microbatch)] = (None if first else x, output)

    def backward(self, action: Action) -> None:
        x, output = self.stash.pop((action.stage, action.microbatch))
        torch.autograd.backward(output, self.output_grad(action, output))
        if x is not None:
            self.deliver_input_grad(action, x.grad)

    def forward_recording(self, action: Action) -> None:
        """F, recording the stage's parameter-owning module calls when this microbatch's
        backward is split into I and W."""
        key = (action.stage, action.microbatch)
        if key not in self.split_keys:
            self.forward(action)
            return
        with self.splitters[action.stage].recording() as calls:
            self.forward(action)
        self.module_calls[key] = calls

    def input_grad(self, action: Action) -> None:
        key = (action.stage, action.microbatch)
        x, output = self.stash.pop(key)
        input_grad, work = self.splitters[action.stage].input_grad(
            output, self.output_grad(action, output), x, self.module_calls.pop(key))
        if x is not None:
            self.deliver_input_grad(action, input_grad)
        self.weight_work[key] = work

    def weight_grad(self, action: Action) -> None:
        self.weight_grad_runner(self.splitters[action.stage], self.stages[action.stage],
                                self.weight_work.pop((action.stage, action.microbatch)))

    def output_grad(self, action: Action, output: torch.Tensor) -> torch.Tensor | None:
        """The gradient flowing into this stage's output (none for the loss itself), in
        the output's type (it crossed the wire in the low-precision one)."""
        if action.stage in self.last_stages:
            return None
        return self.output_grads.pop((action.stage, action.microbatch)).to(output.dtype)

    def deliver_input_grad(self, action: Action, grad: torch.Tensor) -> None:
        stage, microbatch = action.stage, action.microbatch
        target = dataflow.output_stage(stage, action.kind)
        if self.schedule.placement[target] == self.rank:
            self.output_grads[(target, microbatch)] = grad
        else:
            self.outbox[(ActionKind.SEND_B, stage, microbatch)] = grad

    # -- communication --------------------------------------------------------------

    def communicate(self, group: tuple[Action, ...]) -> None:
        """Post a P2P group as one batch, in the group's order, and wait as the
        semantics says (``schedules.p2p``)."""
        if self.rendezvous:
            self.post_rendezvous(group)
        else:
            self.communicate_buffered(group)

    def post_rendezvous(self, group: tuple[Action, ...]) -> None:
        """Rendezvous: posting never blocks. The group joins the rank's stream; each of
        its receives is waited for (with the whole group) right before the compute
        action that needs it (``await_input``). NCCL runs the stream itself; on gloo
        (the handshake) the next group is started only once the previous one has
        completed, as NCCL's stream would."""
        ops, _ = self.group_ops(group, prefetched=None)
        flight = InFlight(group, ops)
        self.stream.append(flight)
        for action in group:
            if action.kind in RECV_KINDS:
                self.awaited[(action.kind, action.stage, action.microbatch)] = flight
        if not self.links.handshake:
            self.start_group(flight)
        self.advance_stream()

    def group_ops(self, group: tuple[Action, ...], prefetched: dict | None) -> tuple[list, list]:
        """The (action, tensor) pairs to post for ``group`` — each send's output, a fresh
        buffer for each receive — running the per-action hook; receives found in
        ``prefetched`` (posted at the start of the step) come back apart, already posted."""
        ops, already = [], []
        for action in group:
            self.current = action
            if self.before_action is not None:
                self.before_action(action)
            if action.kind in SEND_KINDS:
                ops.append((action, self.outbox.pop((action.kind, action.stage, action.microbatch))))
            elif prefetched is not None:
                work, buffer = prefetched.pop(action)
                already.append(Posted(action, buffer, [work]))
            else:
                ops.append((action, self.links.buffer(action)))
        return ops, already

    def start_group(self, flight: InFlight) -> None:
        flight.start = self.clock.mark()
        flight.posted = self.links.post(flight.ops)
        flight.end_mark = self.completion_mark([work for item in flight.posted for work in item.works])

    def advance_stream(self) -> None:
        """Without blocking: finish the groups that have completed and (gloo) start the
        next one once the one before it is done."""
        while self.stream:
            head = self.stream[0]
            if head.posted is None:
                self.start_group(head)
            if not all(work.is_completed() for item in head.posted for work in self.links.all_works(item)):
                return
            self.finish_group(head)

    def await_input(self, action: Action) -> None:
        """Before a compute action: wait for what brings its input, if anything: its
        group (rendezvous) or its receive (buffered)."""
        kind = RECV_OF.get(action.kind, ActionKind.RECV_B)  # the transfer that carries its input
        key = (kind, action.stage, action.microbatch)
        flight = self.awaited.get(key)
        if flight is not None:
            self.wait_group(flight)
            self.current = action
        elif key in self.arriving:
            self.await_arrival(key)
            self.current = action

    def wait_group(self, flight: InFlight) -> None:
        """Block until ``flight`` has completed, finishing the groups before it on the
        stream first (on gloo they must complete before it can start)."""
        peers = tuple(self.links.peer(action) for action in flight.group)
        self.current_group = flight.group
        if self.progress is not None:
            self.progress.waiting(f"action {'+'.join(map(str, flight.group))}", peers)
        while not flight.done:
            head = self.stream[0] if self.links.handshake else flight
            if head.posted is None:
                self.start_group(head)
            self.current_group = head.group
            done: set[int] = set()
            for item in sorted(head.posted, key=lambda item: item.action.kind not in SEND_KINDS):  # tokens first
                self.current = item.action
                self.complete(item, done)
            self.finish_group(head)
        if self.progress is not None:
            self.progress.running()
        self.current_group = None

    def finish_group(self, flight: InFlight) -> None:
        """A completed group: check its tokens, hand its receives on, time it."""
        for item in flight.posted:
            self.links.check_token(item)
        flight.done = True
        self.stream.remove(flight)
        end = flight.end_mark if flight.end_mark is not None else self.clock.mark()
        for item in flight.posted:
            action = item.action
            self.marks.append((action, flight.start, end, "send" if action.kind in SEND_KINDS else "recv"))
            if action.kind in RECV_KINDS:
                self.awaited.pop((action.kind, action.stage, action.microbatch), None)
                if self.links.device.type == "cuda":  # the compute stream waits for the data before using it
                    for work in item.works:
                        work.wait()
                inbox = self.forward_inputs if action.kind == ActionKind.RECV_F else self.output_grads
                inbox[(action.stage, action.microbatch)] = item.tensor
        if isinstance(end, torch.cuda.Event):
            self.device_marks.append((flight.group, end))

    def finish_groups(self) -> None:
        """The end of the step: every group on the stream completes."""
        while self.stream:
            self.wait_group(self.stream[-1])

    def communicate_buffered(self, group: tuple[Action, ...]) -> None:
        """Buffered (gloo): the group is posted here and nothing waits here. Sends complete
        in the background; each receive is waited for right before the compute action
        that needs its data (``await_input``), as ``irecv`` and a later ``wait``, so a rank
        keeps computing while its data is on the way. Receives already posted at the start
        of the step (``prefetch_recvs``) are only registered here."""
        ops, prefetched = self.group_ops(group, self.prefetched)
        start = self.clock.mark()
        posted = self.links.post(ops) if ops else []
        self.pending.extend(Pending(item, start, self.completion_mark(item.works))
                            for item in posted if item.action.kind in SEND_KINDS)
        for item in [item for item in posted if item.action.kind not in SEND_KINDS] + prefetched:
            self.arriving[(item.action.kind, item.action.stage, item.action.microbatch)] = item

    def await_arrival(self, key: tuple[str, int, int]) -> None:
        """Buffered: block until the receive ``key`` (posted earlier) has its data, and
        hand it to the compute action about to run. The wait is the receive's event."""
        item = self.arriving.pop(key)
        self.current_group = (item.action,)
        if self.progress is not None:
            self.progress.waiting(f"action {item.action}", (self.links.peer(item.action),))
        start = self.clock.mark()
        self.current = item.action
        self.complete(item, set())
        end = self.clock.mark()
        self.marks.append((item.action, start, end, "recv"))
        inbox = self.forward_inputs if item.action.kind == ActionKind.RECV_F else self.output_grads
        inbox[(item.action.stage, item.action.microbatch)] = item.tensor
        if isinstance(end, torch.cuda.Event):
            self.device_marks.append(((item.action,), end))
        if self.progress is not None:
            self.progress.running()
        self.current_group = None

    def finish_arrivals(self) -> None:
        """The end of the step: receives whose data no compute action used are waited for
        all the same (a program that receives what it never uses)."""
        for key in list(self.arriving):
            self.await_arrival(key)

    def complete(self, item: Posted, done: set[int]) -> None:
        """Wait for one posted action, its handshake token first (checked as soon as it
        arrives); a coalesced batch's one handle is waited for once."""
        for work in item.token_works or []:
            work.wait()
        self.links.check_token(item)
        for work in item.works:
            if id(work) not in done:
                work.wait()
                done.add(id(work))

    def completion_mark(self, works: list) -> Any:
        """On a GPU, a CUDA event that completes when ``works`` do: recorded on a side
        stream made to wait for them, so the compute stream does not wait and the
        event's time is the transfer's end (not when the host happened to notice it).
        On a CPU, None: the end is taken when the host sees the work complete."""
        if self.links is None or self.links.device.type != "cuda":
            return None
        if self.side_stream is None:
            self.side_stream = torch.cuda.Stream(self.links.device)
        with torch.cuda.stream(self.side_stream):
            for work in works:
                work.wait()
            event = torch.cuda.Event(enable_timing=True)
            event.record(self.side_stream)
        return event

    def follow_device(self) -> None:
        """On a GPU the host posts every group and runs ahead; before it blocks at the
        end of the step it follows the device through the step's groups (their end
        events), keeping the progress line on the group the device is waiting in, so a
        hang is reported where the GPU is stuck rather than at the program's end."""
        if self.progress is None:
            return
        for group, end in self.device_marks:
            if end.query():
                continue
            self.progress.waiting(f"action {'+'.join(map(str, group))} (on the device)",
                                  tuple(self.links.peer(a) for a in group))
            while not end.query():
                time.sleep(0.002)
        self.device_marks = []

    def where(self) -> str:
        """The action or P2P group the rank is on, with the peers it waits for."""
        if self.current_group is not None:
            peers = ", ".join(map(str, sorted({self.links.peer(a) for a in self.current_group})))
            if len(self.current_group) == 1:
                return f"on action {self.current_group[0]} (waiting for rank {peers})"
            return f"on group {'+'.join(map(str, self.current_group))} (waiting for rank {peers})"
        action = self.current
        if action is not None and not action.is_compute:
            return f"on action {action} (waiting for rank {self.links.peer(action)})"
        return f"on action {action}"

    def prefetch_receives(self) -> dict[Action, tuple]:
        """Post every receive of the program now, each into its own buffer.

        gloo moves data only once the receiver has posted its receive (a sender waits
        for it), so a receive posted early lets the transfer overlap the receiver's
        compute. gloo matches transfers by tag, so posting receives ahead of their
        place cannot mismatch them; NCCL matches by order, so it does not prefetch."""
        prefetched = {}
        for action in self.schedule.programs[self.rank]:
            if action.kind in RECV_KINDS:
                buffer = self.links.buffer(action)
                prefetched[action] = (dist.irecv(buffer, self.links.peer(action), tag=self.links.tag(action)), buffer)
        return prefetched

    def poll_sends(self) -> None:
        """Time sends that have completed since the last look (on a GPU their end is
        already an event: they are only waited for at the end of the step)."""
        if self.pending and self.pending[0].end is not None:
            return
        still = []
        for pending in self.pending:
            if all(work.is_completed() for work in self.links.all_works(pending.item)):
                self.links.check_token(pending.item)
                self.marks.append((pending.item.action, pending.start, self.clock.mark(), "send"))
            else:
                still.append(pending)
        self.pending = still

    def finish_sends(self) -> None:
        """Wait for every send still in flight (the end of the step, or, under the gloo
        handshake, before the next group starts)."""
        done = set()
        for pending in self.pending:
            self.current = pending.item.action
            self.complete(pending.item, done)
            end = pending.end if pending.end is not None else self.clock.mark()
            self.marks.append((pending.item.action, pending.start, end, "send"))
        self.pending = []
