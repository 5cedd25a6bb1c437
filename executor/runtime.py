"""The runtime: one rank walks its lowered program, one handler per action kind.

``F`` runs a stage forward and stashes what its backward needs; ``B`` runs the full
backward; ``I`` computes only the input gradient (keeping the graph for ``W``) and ``W``
the weight gradients, so zero-bubble schedules run unchanged. Each P2P group of the
program is posted as one batch (``executor.comm``). Under ``rendezvous`` semantics (NCCL,
or gloo emulating it) a group holding a receive is waited for whole, as Megatron waits
on every op of a batch, and a group of sends alone completes in the background; under
``buffered`` (gloo) only receives are waited for, since the next compute action needs
their data. Sends in the background are timed when they are seen to finish (on a GPU,
by an event that completes with them). Stashes are dropped as soon as the backward that
needed them is done.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from executor.comm import PeerLinks, Pending, Posted
from executor.models import PipelineModel
from executor.precision import Precision
from schedules.action import RECV_KINDS, SEND_KINDS, Action, ActionKind
from schedules.schedule import Schedule
from schedules.trace import TraceEvent

Key = tuple[int, int]  # (stage, microbatch)


class PipelineRuntime:
    """Runs one rank's share of a training step, action by action, and times each one."""

    def __init__(self, rank: int, schedule: Schedule, stages: dict[int, nn.Module], model: PipelineModel,
                 links: PeerLinks | None, clock: Any, batch_size: int,
                 before_action: Callable[[Action], None] | None = None, prefetch_recvs: bool = False,
                 after_action: Callable[[Action], None] | None = None, precision: Precision | None = None,
                 rendezvous: bool = False, progress: Any = None) -> None:
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
        self.last_stage = schedule.num_stages - 1
        self.items = schedule.program_items(rank)  # P2P groups as lowering made them
        self.handlers: dict[str, Callable[[Action], None]] = {
            ActionKind.F: self.forward,
            ActionKind.B: self.backward,
            ActionKind.I: self.input_grad,
            ActionKind.W: self.weight_grad,
        }
        self.current: Action | None = None
        self.current_group: tuple[Action, ...] | None = None  # the P2P group being waited for
        self.device_marks: list[tuple[tuple[Action, ...], Any]] = []  # (group, CUDA event at its end)
        self.side_stream = None  # CUDA: where the completion of background sends is marked
        # What W differentiates, and the dtype/device of the loss, fixed once the stages are built.
        self.trainable = {stage: [p for p in module.parameters() if p.requires_grad]
                          for stage, module in stages.items()}
        param = next((p for stage in stages.values() for p in stage.parameters()), None)
        # The loss adds up in float32 at least, whatever type the stages compute in.
        self.loss_dtype = torch.float64 if param is not None and param.dtype == torch.float64 else torch.float32
        self.loss_device = param.device if param is not None else None

    # -- the walk -------------------------------------------------------------------

    def run_step(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> tuple[torch.Tensor, list]:
        """Run the program once over these microbatches; return this rank's share of the
        loss (non-zero on the last stage only) and the timed events."""
        self.inputs, self.targets = inputs, targets
        self.forward_inputs: dict[Key, torch.Tensor] = {}  # input of F(stage, mb)
        self.output_grads: dict[Key, torch.Tensor] = {}  # gradient of F(stage, mb)'s output
        self.outbox: dict[tuple[str, int, int], torch.Tensor] = {}  # what SEND_F / SEND_B will send
        self.stash: dict[Key, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.weight_work: dict[Key, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.pending: list[Pending] = []
        self.marks: list[tuple[Action, Any, Any, str]] = []
        self.loss = torch.zeros((), dtype=self.loss_dtype, device=self.loss_device)
        self.clock.start_step()
        self.device_marks = []
        if self.links is not None:
            self.links.start_step()
        self.prefetched = self.prefetch_receives() if self.prefetch_recvs else None
        for item in self.items:
            if not isinstance(item, Action):  # a P2P group (an Action is a tuple too)
                self.communicate(item)
            else:
                self.current = item
                if self.before_action is not None:
                    self.before_action(item)
                start = self.clock.mark()
                self.handlers[item.kind](item)
                self.marks.append((item, start, self.clock.mark(), "compute"))
                if self.after_action is not None:
                    self.after_action(item)
            if self.pending:
                self.poll_sends()
        self.finish_sends()
        self.current = self.current_group = None
        leftover = len(self.stash) + len(self.weight_work)
        if leftover:
            raise RuntimeError(f"rank {self.rank}: {leftover} forward stashes were never consumed by a backward")
        events = [TraceEvent.of(self.rank, action, self.clock.seconds(start), self.clock.seconds(end), stream)
                  for action, start, end, stream in self.marks]
        return self.loss, events

    # -- compute --------------------------------------------------------------------

    def forward(self, action: Action) -> None:
        stage, microbatch = action.stage, action.microbatch
        if stage == 0:
            x = self.inputs[microbatch]
        else:
            x = self.forward_inputs.pop((stage, microbatch)).requires_grad_(True)
        output = self.precision.forward(self.stages[stage], x)
        if stage == self.last_stage:
            loss = self.model.loss_sum(self.precision.for_loss(output), self.targets[microbatch]) / self.batch_size
            self.loss += loss.detach().to(self.loss_dtype)
            output = loss * self.loss_scale if self.loss_scale != 1.0 else loss
        elif self.schedule.placement[stage + 1] == self.rank:
            self.forward_inputs[(stage + 1, microbatch)] = self.precision.to_wire(output.detach())
        else:
            self.outbox[(ActionKind.SEND_F, stage, microbatch)] = self.precision.to_wire(output.detach())
        self.stash[(stage, microbatch)] = (x if stage > 0 else None, output)

    def backward(self, action: Action) -> None:
        x, output = self.stash.pop((action.stage, action.microbatch))
        torch.autograd.backward(output, self.output_grad(action, output))
        if x is not None:
            self.deliver_input_grad(action, x.grad)

    def input_grad(self, action: Action) -> None:
        x, output = self.stash.pop((action.stage, action.microbatch))
        grad = self.output_grad(action, output)
        if x is not None:
            (input_grad,) = torch.autograd.grad(output, [x], grad, retain_graph=True)
            self.deliver_input_grad(action, input_grad)
        self.weight_work[(action.stage, action.microbatch)] = (output, grad)

    def weight_grad(self, action: Action) -> None:
        output, grad = self.weight_work.pop((action.stage, action.microbatch))
        torch.autograd.backward(output, grad, inputs=self.trainable[action.stage])

    def output_grad(self, action: Action, output: torch.Tensor) -> torch.Tensor | None:
        """The gradient flowing into this stage's output (none for the loss itself), in
        the output's type (it crossed the wire in the low-precision one)."""
        if action.stage == self.last_stage:
            return None
        return self.output_grads.pop((action.stage, action.microbatch)).to(output.dtype)

    def deliver_input_grad(self, action: Action, grad: torch.Tensor) -> None:
        stage, microbatch = action.stage, action.microbatch
        if self.schedule.placement[stage - 1] == self.rank:
            self.output_grads[(stage - 1, microbatch)] = grad
        else:
            self.outbox[(ActionKind.SEND_B, stage, microbatch)] = grad

    # -- communication --------------------------------------------------------------

    def communicate(self, group: tuple[Action, ...]) -> None:
        """Post a P2P group as one batch, in the group's order, then wait as the
        semantics says (``schedules.p2p``). Rendezvous: a group holding a receive is
        waited for whole (the next compute needs its data, and its sends complete with
        it, as Megatron waits on every op of a batch); a group of sends alone completes
        in the background, and on gloo the next group is posted only once it has (NCCL
        runs a rank's groups one after another on its communication stream). Buffered:
        only the receives are waited for. Receives already posted at the start of the
        step (``prefetch_recvs``, buffered only) are only waited for here."""
        ops, prefetched = [], []
        for action in group:
            self.current = action
            if self.before_action is not None:
                self.before_action(action)
            if action.kind in SEND_KINDS:
                ops.append((action, self.outbox.pop((action.kind, action.stage, action.microbatch))))
            elif self.prefetched is not None:
                work, buffer = self.prefetched.pop(action)
                prefetched.append(Posted(action, buffer, [work]))
            else:
                ops.append((action, self.links.buffer(action)))
        if self.rendezvous and self.links.handshake and self.pending:
            # The stream's previous groups complete before this one starts.
            if self.progress is not None:
                self.progress.waiting(f"action {'+'.join(str(p.item.action) for p in self.pending)}",
                                      tuple(self.links.peer(p.item.action) for p in self.pending))
            self.finish_sends()
        self.current_group = group
        if self.progress is not None:
            self.progress.waiting(f"action {'+'.join(map(str, group))}", tuple(self.links.peer(a) for a in group))
        start = self.clock.mark()
        posted = self.links.post(ops) if ops else []
        receives = any(action.kind in RECV_KINDS for action in group)
        if self.rendezvous:
            waited = posted if receives else []
            background = [] if receives else posted
        else:
            waited = [item for item in posted if item.action.kind not in SEND_KINDS] + prefetched
            background = [item for item in posted if item.action.kind in SEND_KINDS]
        self.pending.extend(Pending(item, start, self.completion_mark(item.works)) for item in background)
        done, end_of = set(), {}
        order = sorted(range(len(waited)), key=lambda i: waited[i].action.kind not in SEND_KINDS)  # sends' tokens first
        for index in order:
            self.current = waited[index].action
            self.complete(waited[index], done)
            end_of[index] = self.clock.mark()
        end = end_of[order[-1]] if order else None
        for index, item in enumerate(waited):
            self.marks.append((item.action, start, end if self.rendezvous else end_of[index],
                               "send" if item.action.kind in SEND_KINDS else "recv"))
            if item.action.kind == ActionKind.RECV_F:
                self.forward_inputs[(item.action.stage, item.action.microbatch)] = item.tensor
            elif item.action.kind == ActionKind.RECV_B:
                self.output_grads[(item.action.stage, item.action.microbatch)] = item.tensor
        if isinstance(end, torch.cuda.Event):
            self.device_marks.append((group, end))
        if self.progress is not None:
            self.progress.running()
        self.current_group = None

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
            peers = sorted({self.links.peer(a) for a in self.current_group})
            return f"on group {'+'.join(map(str, self.current_group))} (waiting for rank {', '.join(map(str, peers))})"
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
