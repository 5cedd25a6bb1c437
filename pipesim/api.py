"""The Python API: what a notebook needs, in a handful of functions.

    import pipesim
    schedule = pipesim.schedule("interleaved-1f1b", pp=4, microbatches=8, virtual_stages=2)
    result = pipesim.simulate(schedule, pipesim.uniform_costs(schedule, fwd=1e-3, bwd=2e-3), "nvlink")
    result.metrics.makespan, result.metrics.bubble_fraction
    pipesim.plot(result, path="gantt.html")

Build or load a schedule, give it costs and a cluster, simulate it, draw it, and run
it for real. Each function is a thin, documented door onto the modules the command line
uses, so a notebook and ``pipesim simulate`` give the same numbers. Like the command
line, this module sits on top of the layers: plotly is imported by ``plot`` and torch
by ``run`` only, so ``import pipesim`` stays light (the simulator itself never imports
the executor). Examples that CI runs: ``docs/api.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipesim.cluster.topology import Topology
    from pipesim.job import Job
    from pipesim.model.costs import Costs
    from pipesim.plan.request import PlanRequest
    from pipesim.plan.search import PlanResult
    from pipesim.sim.step import SimulationResult
    from pipesim.sim.whatif import WhatIfResult
    from schedules.schedule import Schedule
    from schedules.trace import Trace

DEFAULT_VIRTUAL_STAGES = 2  # chunks per rank for interleaved schedules when not given


def schedule(name: str = "1f1b", pp: int = 4, microbatches: int = 8, virtual_stages: int | None = None,
             microbatch_group: int | None = None) -> Schedule:
    """A generated schedule (compute actions only): ``gpipe``, ``1f1b``,
    ``interleaved-1f1b`` and whatever else ``schedules.generators`` offers.
    ``virtual_stages`` defaults to 2 for multi-chunk schedules and 1 otherwise;
    ``microbatch_group`` is interleaved-1f1b's N (``--microbatch-group``)."""
    from schedules.generators import MULTI_CHUNK, generate  # noqa: PLC0415

    if virtual_stages is None:
        virtual_stages = DEFAULT_VIRTUAL_STAGES if name in MULTI_CHUNK else 1
    return generate(name, pp, microbatches, virtual_stages, microbatch_group=microbatch_group)


def load_schedule(path: str | Path, microbatches: int | None = None) -> Schedule:
    """A schedule from a CSV in ``torch.distributed.pipelining``'s format (one row per
    rank). The microbatch count is ``microbatches`` or the number of distinct
    microbatches on each stage; every stage must hold microbatches ``0 … m-1``."""
    from schedules.csv_io import schedule_from_csv  # noqa: PLC0415

    return schedule_from_csv(path, microbatches=microbatches)


def save_schedule(schedule: Schedule, path: str | Path, lowered: bool = False) -> Path:
    """Write ``schedule`` as CSV (``lowered=True``: with its SEND/RECV actions)."""
    from schedules.csv_io import schedule_to_csv  # noqa: PLC0415
    from schedules.lowering import lower  # noqa: PLC0415

    schedule_to_csv(lower(schedule) if lowered else schedule, path)
    return Path(path)


def load_topology(spec: str | Path = "ideal", nodes: int | None = None, gpu: str | None = None) -> Topology:
    """A cluster: a preset (``ideal``, ``nvlink``, ``pcie``, ``pcie5``, ``ib``,
    ``ethernet``; ``nodes`` sizes the multi-node ones; ``gpu`` picks their devices:
    ``a100-40gb``, ``a100-80gb``, ``h100`` (default), ``h200``, ``b200``) or a YAML/JSON
    topology file."""
    from pipesim.cluster.files import load_topology as read_topology  # noqa: PLC0415

    return read_topology(str(spec), nodes, gpu)


def uniform_costs(
    schedule: Schedule,
    fwd: float = 1e-3,
    bwd: float | None = None,
    wgrad: float = 0.0,
    act_bytes: float = 0.0,
) -> Costs:
    """Uniform costs for ``schedule``: ``fwd``/``bwd`` are the seconds one microbatch
    takes on one pipeline *rank's* share of the model (``bwd`` defaults to ``2 * fwd``),
    and each of an interleaved schedule's ``v`` chunks per rank costs ``1/v`` of that,
    with ``v`` read from the schedule. ``wgrad`` is the weight-gradient part of ``bwd``;
    ``act_bytes`` what one microbatch sends between stages."""
    from pipesim.model.costs import uniform_costs as per_stage_costs  # noqa: PLC0415

    return per_stage_costs(schedule, fwd, 2 * fwd if bwd is None else bwd, wgrad, act_bytes)


def load_costs(path: str | Path, schedule: Schedule) -> Costs:
    """Per-stage costs from a file (``pipesim profile`` writes one; JSON or YAML). A
    single stage entry is repeated for every stage of ``schedule``."""
    from pipesim.model.costs import load_costs as read_costs  # noqa: PLC0415

    return read_costs(path, schedule.num_stages)


def model_costs(schedule: Schedule, model: str, topology: Topology | str = "ideal", mfu: float = 0.5,
                tp: int = 1, **fields: int) -> Costs:
    """Costs derived from a model preset or shipped config by name (``gpt3-1.3b``,
    ``llama3-8b``, ``qwen3-30b-a3b``, …: ``pipesim models`` lists them) or a config.json path (``fields``
    override ``layers``, ``hidden``, ``heads``, ``seq_len``, ``vocab``,
    ``microbatch_size``, ``dtype_bytes``) at ``mfu`` of each device's peak FLOP/s, split
    over ``schedule``'s stages as ``pipesim simulate`` splits them (rank by rank where a
    rank holds both ends of the model, the V placements)."""
    from pipesim.cluster.mapping import DEFAULT_ORDER, map_ranks  # noqa: PLC0415
    from pipesim.model.spec import model_costs as derive_costs  # noqa: PLC0415
    from pipesim.model.spec import model_spec  # noqa: PLC0415

    cluster = _as_topology(topology)
    devices = map_ranks(cluster, 1, schedule.pp, tp, DEFAULT_ORDER).pipeline()
    peaks = [cluster.device_peak_flops(devices[schedule.placement[stage]]) for stage in range(schedule.num_stages)]
    return derive_costs(model_spec(model, **fields), schedule.num_stages, peaks, tp=tp, mfu=mfu,
                        stage_ranks=list(schedule.placement))


def simulate(
    schedule: Schedule,
    costs: Costs | None = None,
    topology: Topology | str = "ideal",
    dp: int = 1,
    tp: int = 1,
) -> SimulationResult:
    """Predict one step of ``schedule`` on ``topology`` (a ``Topology`` or a preset
    name / file path). ``costs`` defaults to ``uniform_costs(schedule)`` (F = 1 ms, B = 2 ms per
    rank). The result has ``.trace``, ``.metrics`` (``makespan``, ``bubble_fraction`` — the
    pipeline bubble —, ``idle_fraction`` — every moment not computing —, ``ranks``),
    ``.memory``, ``.summary()`` and ``.to_dict()``."""
    from pipesim.sim.parallel import ParallelConfig  # noqa: PLC0415
    from pipesim.sim.step import run_simulation  # noqa: PLC0415

    if costs is None:
        costs = uniform_costs(schedule)
    if costs.num_stages != schedule.num_stages:
        raise ValueError(f"the costs describe {costs.num_stages} stages but {schedule.name!r} has "
                         f"{schedule.num_stages}; build them with pipesim.uniform_costs(schedule, ...)")
    return run_simulation(schedule, costs, _as_topology(topology), parallel=ParallelConfig(dp=dp, tp=tp))


def whatif(
    step: SimulationResult | Schedule,
    costs: Costs | None = None,
    topology: Topology | str = "ideal",
    *,
    jitter: float | dict[str, float] = 0.0,
    stragglers: dict[int, float] | None = None,
    straggler_share: tuple[float, float] | None = None,
    slow_links: dict[tuple[int, int], float] | None = None,
    samples: int = 1000,
    seed: int = 0,
) -> WhatIfResult:
    """``samples`` steps of a simulated layout (a ``simulate`` result, or a schedule
    simulated here with ``costs`` on ``topology``), each with its own draws:
    ``jitter`` is the coefficient of variation of every action's time (one number) or
    per kind (``{"F": 0.05, "B": 0.08, "comm": 0.2}``); ``stragglers`` slows pipeline
    ranks (``{3: 1.5}``); ``straggler_share`` a random ``(fraction, factor)`` of GPUs
    each sample; ``slow_links`` the transfers between two ranks (``{(3, 4): 2.0}``).
    The result has ``.step_times``, ``.mean``, ``.quantiles`` (p50, p90, p99),
    ``.owner_shares`` (which rank's delays set the step), ``.trace(sample)`` and
    ``.summary()``; ``pipesim simulate --jitter ...`` prints the same numbers."""
    from pipesim.sim.variability import JITTER_KINDS, Variability  # noqa: PLC0415
    from pipesim.sim.whatif import sample_steps  # noqa: PLC0415

    result = step if hasattr(step, "metrics") else simulate(step, costs, topology)
    variability = Variability(
        jitter=dict(jitter) if isinstance(jitter, dict) else dict.fromkeys(JITTER_KINDS, jitter),
        stragglers=dict(stragglers or {}), straggler_share=straggler_share,
        slow_links={tuple(sorted(link)): factor for link, factor in (slow_links or {}).items()},
        samples=samples, seed=seed,
    )
    return sample_steps(result, variability)


def plot(*steps: SimulationResult | Trace | dict, path: str | Path | None = None,
         titles: list[str] | None = None, title: str | None = None, plotly: str = "inline") -> Any:
    """A Gantt chart of one or more steps (simulation results, Traces, or the dict
    ``run`` returns), stacked on one time axis. Returns the plotly ``Figure`` (a
    notebook shows it); with ``path`` also writes the HTML page (``plotly="cdn"`` for a
    small file that loads plotly.js from the network)."""
    from viz.gantt import gantt_figure, write_gantt_html  # noqa: PLC0415

    traces = [_as_trace(step) for step in steps]
    if not traces:
        raise ValueError("plot needs at least one simulation result or trace")
    if path is not None:
        write_gantt_html(traces, path, titles=titles, title=title, plotly=plotly)
    figure = gantt_figure(traces, titles)
    if title:
        figure.update_layout(title={"text": title, "x": 0.0, "xanchor": "left"})
    return figure


def load_trace(path: str | Path) -> Trace:
    """A Trace saved by ``simulate --trace``, ``run --trace`` or ``Trace.save``."""
    from schedules.trace import Trace  # noqa: PLC0415

    return Trace.load(path)


def run(schedule: Schedule | str = "1f1b", **config: Any) -> dict:
    """Run training steps for real on local processes (torch.distributed: gloo on CPU,
    NCCL with CUDA) and return rank 0's result: ``losses``, ``step_times`` and the
    measured ``trace`` of the last step. ``schedule`` is a name or a ``Schedule`` (its
    pp, microbatches and chunks are used); ``config`` takes any ``executor.RunConfig``
    field (``model="gpt"``, ``layers``, ``hidden``, ``batch_size``, ``steps``, …).
    torch is imported here, not on ``import pipesim``. Called from a script, the call must
    sit under ``if __name__ == "__main__":`` (its ranks are spawned, importing the script
    again); one that does not is refused at once, naming the line (``script_guard``)."""
    from executor import RunConfig  # noqa: PLC0415
    from pipesim.script_guard import require_main_guard  # noqa: PLC0415

    if not isinstance(schedule, str):
        config = {"pp": schedule.pp, "microbatches": schedule.microbatches,
                  "virtual_stages": schedule.virtual_stages, "custom_schedule": schedule, **config}
        schedule = schedule.name
    elif "virtual_stages" not in config:
        from schedules.generators import MULTI_CHUNK  # noqa: PLC0415

        config["virtual_stages"] = DEFAULT_VIRTUAL_STAGES if schedule in MULTI_CHUNK else 1
    run_config = RunConfig(schedule=schedule, **config)
    run_config.check()
    if run_config.world_size == 1:
        from executor.worker import run_local  # noqa: PLC0415

        return run_local(run_config)
    require_main_guard()  # before torch loads: the ranks would import the script again
    from executor.launch import launch  # noqa: PLC0415 - loads torch

    (result,) = launch(run_config)
    return result


def simulate_job(job: Job) -> SimulationResult:
    """Simulate what a ``Job`` describes: everything ``pipesim simulate`` takes as flags
    (a model with its sizes, a cluster preset, dp x tp x pp, ZeRO, ...) as one object, the
    form the planner fills in for each layout it tries. ``pipesim.Job(model="llama3-8b",
    pp=4, tp=2, topology="nvlink")``; fields are the flags' names."""
    from pipesim.job import simulate_job as run_job  # noqa: PLC0415

    return run_job(job)


def plan(request: PlanRequest, progress: Callable[[int, int], None] | None = None) -> PlanResult:
    """The fastest layouts of a model on a cluster, searched as ``pipesim plan`` searches
    them: ``request`` is a ``PlanRequest`` (``pipesim.PlanRequest(model="gpt3-1.3b",
    gpus=8, global_batch=16, topology="nvlink")``; fields are the command's flags' names,
    lists as sequences). Returns the ``PlanResult``: ``.rows`` ranked best first (each what
    ``pipesim simulate`` prints for that layout), the buckets every considered layout went
    to with their causes, and ``.to_dict(top)``, what ``pipesim plan --json`` writes.
    ``progress(done, total)`` is called as layouts are simulated or pruned. Bad fields
    raise ``ValueError`` naming the flag, before anything is simulated. (``pipesim.plan``
    is the package holding the search: call ``pipesim.api.plan``.)"""
    from pipesim.plan.request import plan as run_plan  # noqa: PLC0415

    return run_plan(request, progress)


def __getattr__(name: str) -> Any:
    if name == "Job":  # the class itself, loaded on first use like everything here
        from pipesim.job import Job  # noqa: PLC0415

        return Job
    if name == "PlanRequest":
        from pipesim.plan.request import PlanRequest  # noqa: PLC0415

        return PlanRequest
    raise AttributeError(f"module 'pipesim.api' has no attribute {name!r}")


def _as_topology(topology: Topology | str | Path) -> Topology:
    return topology if hasattr(topology, "devices") else load_topology(topology)


def _as_trace(step: object) -> Trace:
    if hasattr(step, "events"):
        return step  # a Trace
    if hasattr(step, "trace"):
        return step.trace  # a SimulationResult
    if isinstance(step, dict) and "trace" in step:
        return step["trace"]  # what run() returns
    raise TypeError(f"cannot draw a {type(step).__name__}: pass a simulation result, a Trace or run()'s result")
