"""The one-process reference: the same model, the same data, no pipeline.

Every stage is built on one process and the whole batch runs through them in one
forward and one backward of the mean loss. A pipelined step is correct when its loss and
every gradient equal this one's (float64: to 1e-10), and a multi-step run is correct
when its loss curve equals this one's.
"""

from __future__ import annotations

from executor.config import RunConfig
from executor.models import PipelineModel, build_model, build_optimizer


def reference_run(config: RunConfig, model: PipelineModel | None = None) -> dict:
    """Losses of ``config.steps`` steps and the first step's gradients, named
    ``"{stage}.{parameter}"`` like a pipelined run's."""
    model = model or build_model(config)
    num_stages = config.num_stages
    stages = [model.build_stage(stage, num_stages) for stage in range(num_stages)]
    params = [p for stage in stages for p in stage.parameters()]
    optimizer = build_optimizer(config, params)
    losses, grads = [], {}
    for step in range(config.steps):
        inputs, targets = model.make_batch(step, config.batch_size)
        optimizer.zero_grad(set_to_none=True)
        output = inputs
        for stage in stages:
            output = stage(output)
        loss = model.loss_sum(output, targets) / config.batch_size
        loss.backward()
        if step == 0:
            grads = {f"{index}.{name}": p.grad.detach().clone()
                     for index, stage in enumerate(stages) for name, p in stage.named_parameters()}
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}
