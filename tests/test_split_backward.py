"""The split backward: ``I`` computes only the input gradient and leaves ``.grad`` alone,
``W`` computes only the weight gradients (no input-gradient GEMM again), and I + W give
exactly the full backward's gradients: per stage, through the runtime on one process,
and pipelined on gloo from a hand-written CSV.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch spelling
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from executor.clock import CpuClock
from executor.config import RunConfig
from executor.launch import launch
from executor.models import build_model
from executor.reference import reference_run
from executor.runtime import PipelineRuntime
from executor.split_backward import SplitBackward
from executor.worker import run_local
from schedules.action import Action, ActionKind, parse_action
from schedules.csv_io import schedule_from_csv
from schedules.schedule import Schedule

pytestmark = pytest.mark.timeout(200)


def flops(run) -> int:
    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


def full_backward_grads(module: nn.Module, x: torch.Tensor, output_grad: torch.Tensor | None, forward):
    """Input and parameter gradients of one ordinary backward, on a copy of ``module``."""
    module = copy.deepcopy(module)
    x = x.detach().clone().requires_grad_(x.is_floating_point())
    torch.autograd.backward(forward(module, x), output_grad)
    return x.grad, {name: p.grad for name, p in module.named_parameters()}


def mlp_stage(layers: int, hidden: int, stage: int = 1, num_stages: int = 3) -> nn.Module:
    config = RunConfig(model="mlp", layers=layers * num_stages, hidden=hidden, dtype="float64", pp=num_stages)
    return build_model(config).build_stage(stage, num_stages)


def split_once(module: nn.Module, x: torch.Tensor, output_grad: torch.Tensor | None, forward):
    """F, I, W on ``module`` with the split; returns the input gradient, the flops of I
    and W, and the ``.grad`` of every parameter after I (before W)."""
    splitter = SplitBackward(module)
    with splitter.recording() as calls:
        output = forward(module, x)
    result = {}

    def input_grad():
        result["input_grad"], result["work"] = splitter.input_grad(output, output_grad, x if x.requires_grad else None,
                                                                  calls)

    result["I flops"] = flops(input_grad)
    result["grads after I"] = {name: p.grad for name, p in module.named_parameters()}
    result["W flops"] = flops(lambda: splitter.weight_grad(result["work"]))
    splitter.close()
    return result


def run_stage(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def test_mlp_stage_split_costs_exactly_one_backward_in_flops() -> None:
    """Closed form: a stage of L Linear(h, h) layers on b samples spends 2bh^2 flops per
    GEMM; the backward is L input-gradient GEMMs and L weight-gradient GEMMs. I must be
    the first L, W the second L (walking the graph again, W would also redo L - 1
    input-gradient GEMMs on its way down)."""
    layers, hidden, batch = 3, 16, 5
    module = mlp_stage(layers, hidden)
    x = torch.randn(batch, hidden, dtype=torch.float64, requires_grad=True)
    output_grad = torch.randn(batch, hidden, dtype=torch.float64)
    gemm = 2 * batch * hidden * hidden
    output = copy.deepcopy(module)(x.detach().requires_grad_())
    assert flops(lambda: torch.autograd.backward(output, output_grad)) == 2 * layers * gemm
    split = split_once(module, x, output_grad, run_stage)
    assert split["I flops"] == layers * gemm
    assert split["W flops"] == layers * gemm


def test_first_stage_input_gradient_skips_the_first_layers_input_gemm() -> None:
    """On the first stage nothing needs the data's gradient: I runs the input-gradient
    GEMMs of layers 2..L only, W the L weight GEMMs."""
    layers, hidden, batch = 3, 16, 5
    module = mlp_stage(layers, hidden, stage=0)
    x = torch.randn(batch, hidden, dtype=torch.float64)
    split = split_once(module, x, torch.randn(batch, hidden, dtype=torch.float64), run_stage)
    gemm = 2 * batch * hidden * hidden
    assert split["I flops"] == (layers - 1) * gemm
    assert split["W flops"] == layers * gemm


def gpt_config(num_stages: int = 3) -> RunConfig:
    return RunConfig(model="gpt", pp=num_stages, layers=num_stages + 1, hidden=8, heads=2, seq_len=4, vocab=11,
                     batch_size=3, dtype="float64")


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_gpt_stage_i_leaves_grads_alone_and_w_gives_the_full_backwards_grads(stage: int) -> None:
    config = gpt_config()
    model = build_model(config)
    module = model.build_stage(stage, config.num_stages)
    inputs, targets = model.make_batch(0, config.batch_size)
    last = stage == config.num_stages - 1
    if stage == 0:
        x = inputs
    else:
        x = torch.randn(model.boundary_shape(config.batch_size), dtype=torch.float64, requires_grad=True)
    output_grad = None if last else torch.randn(model.boundary_shape(config.batch_size), dtype=torch.float64)

    def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        output = m(x)
        return model.loss_sum(output, targets) if last else output

    expected_input_grad, expected = full_backward_grads(module, x, output_grad, forward)
    split = split_once(module, x, output_grad, forward)
    assert all(grad is None for grad in split["grads after I"].values())
    if stage > 0:
        assert (split["input_grad"] - expected_input_grad).abs().max().item() < 1e-12
    else:
        assert split["input_grad"] is None
    for name, param in module.named_parameters():
        assert param.grad is not None, name
        assert (param.grad - expected[name]).abs().max().item() < 1e-12, name


class Awkward(nn.Module):
    """Layers the module hooks alone cannot split exactly: a weight also used outside
    its module (tied), a module applied twice in a row, an in-place op on a recorded
    output, a module that owns a parameter and a child, and an unused layer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.tied = nn.Linear(width, width)
        self.twice = nn.Linear(width, width)
        self.plain = nn.Linear(width, width)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.unused = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.tied(x))
        h = self.twice(torch.tanh(self.twice(h)))
        h = F.relu(self.plain(h), inplace=True)
        h = torch.sin(h) * self.scale
        return F.linear(h, self.tied.weight)  # the tied use, outside self.tied


def test_uncovered_parameters_fall_back_and_every_gradient_is_exact() -> None:
    torch.manual_seed(0)
    module = Awkward(6).double()
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    output_grad = torch.randn(4, 6, dtype=torch.float64)
    expected_input_grad, expected = full_backward_grads(module, x, output_grad, lambda m, x: m(x))
    splitter = SplitBackward(module)
    with splitter.recording() as calls:
        output = module(x)
    input_grad, work = splitter.input_grad(output, output_grad, x, calls)
    assert all(p.grad is None for p in module.parameters())
    # found on the graph: the tied weight (and its module's bias) and the twice-applied layer
    assert {id(p) for p in splitter.uncovered} == {id(p) for p in (*module.tied.parameters(),
                                                                     *module.twice.parameters())}
    assert sorted(splitter.uncovered_names) == ["tied.bias", "tied.weight", "twice.bias", "twice.weight"]
    splitter.weight_grad(work)
    assert (input_grad - expected_input_grad).abs().max().item() < 1e-12
    for name, param in module.named_parameters():
        if name.startswith("unused"):
            assert param.grad is None and expected[name] is None
            continue
        assert (param.grad - expected[name]).abs().max().item() < 1e-12, name


def runtime_for(config: RunConfig, programs: list[list[str]]) -> tuple[PipelineRuntime, dict, list]:
    """A one-process runtime over every stage of ``config`` running ``programs`` (all on
    rank 0), with a hook that snapshots the parameter gradients after each action."""
    model = build_model(config)
    stages = {stage: model.build_stage(stage, config.num_stages) for stage in range(config.num_stages)}
    program = [parse_action(text) for text in programs[0]]
    schedule = Schedule(pp=1, microbatches=config.microbatches, placement=(0,) * config.num_stages,
                        programs=[program], name="hand-written")
    snapshots: list[tuple[Action, dict]] = []

    def after(action: Action) -> None:
        snapshots.append((action, {(stage, name): None if p.grad is None else p.grad.clone()
                                   for stage, module in stages.items() for name, p in module.named_parameters()}))

    runtime = PipelineRuntime(0, schedule, stages, model, None, CpuClock(), config.batch_size, after_action=after)
    return runtime, stages, snapshots


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_runtime_i_touches_no_grad_and_each_w_completes_its_stage(model: str) -> None:
    """Three stages on one process, two microbatches, every W after every I: after each
    I no parameter has a gradient; a stage's gradients appear with its first W and equal
    the one-process reference after its last."""
    config = RunConfig(model=model, pp=1, virtual_stages=3, layers=4, hidden=8, heads=2, seq_len=4, vocab=11,
                       microbatches=2, batch_size=5, dtype="float64")
    order = ["0F0", "1F0", "2F0", "0F1", "1F1", "2F1", "2I0", "1I0", "0I0", "2I1", "1I1", "0I1",
             "1W0", "2W0", "0W0", "2W1", "0W1", "1W1"]
    runtime, stages, snapshots = runtime_for(config, [order])
    data = build_model(config).make_batch(0, config.batch_size)
    inputs, targets = (list(torch.tensor_split(t, config.microbatches)) for t in data)
    runtime.run_step(inputs, targets)
    reference = reference_run(config)["grads"]
    seen_w: set[int] = set()
    for action, grads in snapshots:
        if action.kind == ActionKind.W:
            seen_w.add(action.stage)
        for (stage, name), grad in grads.items():
            if stage not in seen_w:
                assert grad is None, f"{stage}.{name} has a gradient after {action}"
            else:
                assert grad is not None, f"{stage}.{name} has no gradient after {action}"
    final = snapshots[-1][1]
    for (stage, name), grad in final.items():
        assert (grad - reference[f"{stage}.{name}"]).abs().max().item() < 1e-10, (stage, name)
    # after 1W0 only microbatch 0's share is there: not yet the whole batch's gradient
    after_first_w = next(grads for action, grads in snapshots if str(action) == "1W0")
    assert any((after_first_w[key] - final[key]).abs().max().item() > 1e-6 for key in after_first_w if key[0] == 1)


# A zero-bubble-style order for 2 ranks and 3 microbatches, written by hand: each W is
# put off to fill the rank's idle time, and the first stage's weights are done last.
HAND_WRITTEN = """\
0F0,0F1,0I0,0F2,0I1,0W0,0I2,0W1,0W2
1F0,1I0,1F1,1I1,1W0,1F2,1I2,1W1,1W2
"""


def test_hand_written_split_schedule_matches_reference_on_gloo() -> None:
    schedule = schedule_from_csv(io.StringIO(HAND_WRITTEN), name="hand-written")
    configs = [RunConfig(pp=2, microbatches=3, model=model, layers=3, hidden=8, heads=2, seq_len=4, vocab=11,
                         batch_size=7, steps=2, dtype="float64", optimizer="adamw", lr=0.05, return_grads=True,
                         custom_schedule=schedule) for model in ("mlp", "gpt")]
    for config, result in zip(configs, launch(configs), strict=True):
        reference = reference_run(config)
        assert result["losses"] == pytest.approx(reference["losses"], abs=1e-10, rel=0)
        assert sorted(result["grads"]) == sorted(reference["grads"])
        for name, grad in reference["grads"].items():
            assert (result["grads"][name] - grad).abs().max().item() < 1e-10, (config.model, name)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_split_under_autocast_and_loss_scaling_equals_the_full_backward(dtype: str) -> None:
    """Mixed precision (autocast over float32 weights; fp16 with its scaled loss): the
    split computes the same ops as B, so the same losses and gradients come out."""
    from schedules.generators import generate
    from tests.test_executor import split_backward

    config = RunConfig(schedule="interleaved-1f1b", pp=1, microbatches=2, virtual_stages=3, model="gpt", layers=4,
                       hidden=8, heads=2, seq_len=4, vocab=11, batch_size=5, steps=2, dtype=dtype,
                       return_grads=True, optimizer="adamw")
    split = RunConfig(**{**config.__dict__, "custom_schedule": split_backward(generate("interleaved-1f1b", 1, 2, 3))})
    full, parts = run_local(config), run_local(split)
    assert parts["losses"] == pytest.approx(full["losses"], rel=1e-6, abs=0)
    for name, grad in full["grads"].items():
        assert torch.allclose(parts["grads"][name], grad, rtol=1e-5, atol=1e-7), name


def test_a_stage_with_no_layers_passes_the_gradient_through() -> None:
    """A gpt with ``--layout 1,0,1``: the middle stage holds no block and returns its
    input, so its I must hand on the gradient it received, unchanged."""
    from schedules.generators import generate
    from tests.test_executor import split_backward

    config = RunConfig(pp=1, microbatches=2, virtual_stages=3, model="gpt", layers=2, layout=(1, 0, 1), hidden=8,
                       heads=2, seq_len=4, vocab=11, batch_size=5,
                       steps=2, dtype="float64", return_grads=True, optimizer="adamw", lr=0.05,
                       custom_schedule=split_backward(generate("interleaved-1f1b", 1, 2, 3)))
    result, reference = run_local(config), reference_run(config)
    assert result["losses"] == pytest.approx(reference["losses"], abs=1e-10, rel=0)
    for name, grad in reference["grads"].items():
        assert (result["grads"][name] - grad).abs().max().item() < 1e-10, name
