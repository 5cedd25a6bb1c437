"""The one-process reference: the same model, the same data, no pipeline.

Every stage is built on one process and the whole batch runs through them in one
forward and one backward of the mean loss, kept as a run keeps it: a tied model's two
embedding copies given their gradients' sum (``executor.tied_embeddings``), DeepSeek-V3's
selection biases moved after each step from its loads (``executor.expert_balance``). A
pipelined step is correct when its loss and every gradient equal this one's (float64:
to 1e-10), and a multi-step run is correct when its loss curve equals this one's.

bf16/fp16 runs go through the same ``Precision`` casts (autocast per stage, activations
rounded to the wire type between stages, the loss in float32), and fp16's loss scaling
is ``torch.amp.GradScaler`` itself: the pipelined runtime's own scaler is checked
against it.
"""

from __future__ import annotations

import torch

from executor.architectures.moe import balanced_layers, set_balance_scale
from executor.architectures.mtp import give_targets
from executor.config import RunConfig
from executor.expert_balance import ExpertBalance, selection_biases
from executor.grad_clip import clip_gradients
from executor.lr_schedule import attach_schedule
from executor.models import PipelineModel, build_model, build_optimizer
from executor.precision import Precision
from executor.tied_embeddings import TiedEmbeddings, is_tied


def reference_run(config: RunConfig, model: PipelineModel | None = None) -> dict:
    """Losses of ``config.steps`` steps, the first step's gradients and the weights
    after the last step, named ``"{stage}.{parameter}"`` like a pipelined run's; with fp16, also the steps the
    ``GradScaler`` skipped and its final scale."""
    model = model or build_model(config)
    num_stages = config.num_stages
    stages = [model.build_stage(stage, num_stages) for stage in range(num_stages)]
    params = [p for stage in stages for p in stage.parameters()]
    optimizer = build_optimizer(config, params)
    schedule = attach_schedule(optimizer, config)
    precision = Precision(config)
    scaler = torch.amp.GradScaler("cpu", enabled=config.dtype == "float16")
    losses, grads, skipped, norms = [], {}, [], []
    balance = ExpertBalance(config, stages, torch.device("cpu"))
    balanced = balanced_layers(stages)  # MoE layers adding a balance loss
    tied = TiedEmbeddings(dict(enumerate(stages)), None, model.spec) if is_tied(model) else None
    for step in range(config.steps):
        balance.start_step()
        set_balance_scale(balanced, scaler.get_scale() / config.batch_size)
        inputs, targets = model.make_batch(step, config.batch_size)
        optimizer.zero_grad(set_to_none=True)
        output = inputs
        give_targets(stages[-1], targets)  # what a multi-token prediction head embeds
        for index, stage in enumerate(stages):
            output = precision.forward(stage, output)
            if index < num_stages - 1:
                output = precision.to_wire(output)
        loss = model.loss_sum(precision.for_loss(output), targets) / config.batch_size
        scaler.scale(loss).backward()
        if tied is not None:  # the table's two uses: one gradient, the sum, on both copies
            tied.sum_gradients(None)
        scaler.unscale_(optimizer)
        if step == 0:
            grads = {f"{index}.{name}": p.grad.detach().clone()
                     for index, stage in enumerate(stages) for name, p in stage.named_parameters()}
        scale = scaler.get_scale()
        if config.clip_grad is not None and all(torch.isfinite(p.grad).all() for p in params if p.grad is not None):
            copies = tied.holders if tied is not None else lambda _param: 1
            norms.append(clip_gradients([(p.grad, copies(p)) for p in params if p.grad is not None],
                                        config.clip_grad))
        scaler.step(optimizer)
        scaler.update()
        if schedule is not None:
            schedule.step()
        balance.end_step()  # every token routed here: the loads need no reduction
        if scaler.is_enabled() and scaler.get_scale() < scale:  # GradScaler backs off only when it skipped
            skipped.append(step)
        losses.append(loss.item())
    params = {f"{index}.{name}": p.detach().clone() for index, stage in enumerate(stages)
              for name, p in stage.named_parameters()}
    params.update(selection_biases(dict(enumerate(stages))))
    return {"losses": losses, "grads": grads, "params": params, "skipped_steps": skipped, "grad_norms": norms,
            "loss_scale": scaler.get_scale() if scaler.is_enabled() else 1.0}
