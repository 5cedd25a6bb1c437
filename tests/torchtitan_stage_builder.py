"""Run in a Python with torchtitan (``tests/test_torchtitan_release.py`` starts it): each
``torchtitan.args`` file pipesim wrote, parsed by torchtitan's own config parser, its CSV
run through torchtitan's placement of the stages, its activation checkpointing (the
policy the file asks for, round each stage), FSDP and schedule builder on gloo
(``executor.torch_pipelining.run_cases``, an MLP of one block per stage, float64, two SGD
steps), and compared with the one-process reference (``executor.reference``).

    python tests/torchtitan_stage_builder.py ARGS_FILE... > errors.json

Prints, per file, the largest loss and gradient differences and the number of gradients
compared; the test asserts on them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def parsed_config(path: str):
    """torchtitan's parse of the overrides, on its llama3 debug config (the fields pipesim
    writes are the same for every model)."""
    from torchtitan.config.manager import ConfigManager

    from executor.torchtitan_launch import CHECK_CONFIG, CHECK_MODULE

    return ConfigManager().parse_args(["--module", CHECK_MODULE, "--config", CHECK_CONFIG,
                                       *Path(path).read_text().split()])


def main(paths: list[str]) -> dict[str, dict]:
    from executor.config import RunConfig
    from executor.reference import reference_run
    from executor.spawn import launch_ranks
    from executor.torch_pipelining import TorchCase, run_cases
    from schedules.csv_io import schedule_from_csv

    jobs, configs = [], {}
    for path in paths:
        config = parsed_config(path)
        parallelism, batch = config.parallelism, config.training.local_batch_size
        schedule = schedule_from_csv(parallelism.pipeline_parallel_schedule_csv)
        run = RunConfig(pp=schedule.pp, dp=1, microbatches=schedule.microbatches,
                        virtual_stages=schedule.num_stages // schedule.pp, model="mlp", layers=schedule.num_stages,
                        hidden=4, batch_size=batch, steps=2, seed=3, dtype="float64", optimizer="sgd", lr=0.1,
                        backend="gloo", timeout=30.0)
        configs[path] = run
        jobs.append((run, [TorchCase(path, parallelism.pipeline_parallel_schedule_csv, False, "torchtitan",
                                     parallelism, batch, config.activation_checkpoint)]))
    world = max(run.pp for run, _ in jobs)
    if any(run.pp != world for run, _ in jobs):
        raise ValueError("every file must have the same pipeline degree (one launch)")
    merged: dict[str, dict] = {}
    for results in launch_ranks(run_cases, (jobs,), world).values():
        for label, result in results.items():
            entry = merged.setdefault(label, {"losses": [], "grads": {}})
            entry["grads"].update(result["grads"])
            entry["losses"] = entry["losses"] or result["losses"]
    report = {}
    for path, run in configs.items():
        expected, result = reference_run(run), merged[path]
        report[path] = {
            "loss_error": max(abs(a - b) for a, b in zip(result["losses"], expected["losses"], strict=True)),
            "grad_error": max((result["grads"][name] - grad).abs().max().item()
                              for name, grad in expected["grads"].items()),
            "grads": len(expected["grads"]), "grads_run": len(result["grads"]), "steps": len(result["losses"])}
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
