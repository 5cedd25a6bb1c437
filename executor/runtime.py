"""The runtime: one rank walks its lowered program, one handler per action kind.

``F`` runs a stage forward and stashes what its backward needs; ``B`` runs the full
backward; ``I`` computes only the input gradient and ``W`` the weight gradients from
what ``I`` kept, without running the stage's backward again
(``executor.split_backward``), so zero-bubble schedules run unchanged. Communication actions are
posted in program order (a run of consecutive ones as one batch); a receive is waited
on at once, because the next compute action needs its data, while sends complete in the
background and are timed when they are seen to finish. Stashes are dropped as soon as
the backward that needed them is done.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from executor.comm import PeerLinks, Pending
from executor.models import PipelineModel
from executor.precision import Precision
from executor.split_backward import ModuleCall, SplitBackward, WeightWork
from schedules.action import COMM_KINDS, RECV_KINDS, SEND_KINDS, Action, ActionKind
from schedules.schedule import Schedule
from schedules.trace import TraceEvent

Key = tuple[int, int]  # (stage, microbatch)


def program_items(program: tuple[Action, ...]) -> list[Action | list[Action]]:
    """The program with each run of consecutive communication actions grouped, since
    a group is posted as one batch."""
    items: list[Action | list[Action]] = []
    for action in program:
        if action.kind in COMM_KINDS:
            if items and isinstance(items[-1], list):
                items[-1].append(action)
            else:
                items.append([action])
        else:
            items.append(action)
    return items


class PipelineRuntime:
    """Runs one rank's share of a training step, action by action, and times each one."""

    def __init__(self, rank: int, schedule: Schedule, stages: dict[int, nn.Module], model: PipelineModel,
                 links: PeerLinks | None, clock: Any, batch_size: int,
                 before_action: Callable[[Action], None] | None = None, prefetch_recvs: bool = False,
                 after_action: Callable[[Action], None] | None = None, precision: Precision | None = None) -> None:
        self.rank = rank
        self.schedule = schedule
        self.stages = stages
        self.model = model
        self.links = links
        self.clock = clock
        self.batch_size = batch_size
        self.before_action = before_action
        self.after_action = after_action  # e.g. start a stage's dp all-reduce after its last backward
        self.prefetch_recvs = prefetch_recvs and links is not None
        self.precision = precision or Precision()
        self.loss_scale = 1.0  # set each step by fp16's dynamic loss scaling
        self.last_stage = schedule.num_stages - 1
        self.items = program_items(schedule.programs[rank])
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
        self.current: Action | None = None
        # The dtype/device of the loss, fixed once the stages are built.
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
        self.module_calls: dict[Key, list[ModuleCall]] = {}  # what F recorded for a split backward
        self.weight_work: dict[Key, WeightWork] = {}
        self.pending: list[Pending] = []
        self.marks: list[tuple[Action, Any, Any, str]] = []
        self.loss = torch.zeros((), dtype=self.loss_dtype, device=self.loss_device)
        self.clock.start_step()
        self.prefetched = self.prefetch_receives() if self.prefetch_recvs else None
        for item in self.items:
            if isinstance(item, list):
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
        self.current = None
        leftover = len(self.stash) + len(self.weight_work) + len(self.module_calls)
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
        self.splitters[action.stage].weight_grad(self.weight_work.pop((action.stage, action.microbatch)))

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

    def communicate(self, group: list[Action]) -> None:
        """Post a run of SEND/RECV actions as one batch, then wait for its receives.
        Receives already posted at the start of the step (``prefetch_recvs``) are only
        waited for here."""
        ops, prefetched = [], []
        for action in group:
            self.current = action
            if self.before_action is not None:
                self.before_action(action)
            if action.kind in SEND_KINDS:
                ops.append((action, self.outbox.pop((action.kind, action.stage, action.microbatch))))
            elif self.prefetched is not None:
                prefetched.append((action, *self.prefetched.pop(action)))
            else:
                ops.append((action, self.links.buffer(action)))
        start = self.clock.mark()
        works = self.links.post(ops) if ops else []
        paired = len(works) == len(ops)
        receives = []
        for index, (action, tensor) in enumerate(ops):
            handles = [works[index]] if paired else works
            if action.kind in SEND_KINDS:
                self.pending.append(Pending(action, handles, tensor, start))
            else:
                receives.append((action, handles, tensor))
        receives.extend((action, [work], tensor) for action, work, tensor in prefetched)
        for action, handles, tensor in receives:
            self.current = action
            for work in handles:
                work.wait()
            self.marks.append((action, start, self.clock.mark(), "recv"))
            if action.kind == ActionKind.RECV_F:
                self.forward_inputs[(action.stage, action.microbatch)] = tensor
            else:
                self.output_grads[(action.stage, action.microbatch)] = tensor

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
                (work,) = self.links.post([(action, buffer)])
                prefetched[action] = (work, buffer)
        return prefetched

    def poll_sends(self) -> None:
        """Time sends that have completed since the last look."""
        still = []
        for pending in self.pending:
            if all(work.is_completed() for work in pending.work):
                self.marks.append((pending.action, pending.start, self.clock.mark(), "send"))
            else:
                still.append(pending)
        self.pending = still

    def finish_sends(self) -> None:
        for pending in self.pending:
            self.current = pending.action
            for work in pending.work:
                work.wait()
            self.marks.append((pending.action, pending.start, self.clock.mark(), "send"))
        self.pending = []
