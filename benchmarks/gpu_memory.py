"""Measured CUDA peak memory against the prediction, action by action, on one GPU.

``pipesim run`` on a CPU counts the tensors the executor holds at action boundaries and
checks them against the simulator's memory model (``pipesim.cli.run_memory``). On a GPU
the caching allocator's ``max_memory_allocated`` also sees what lives *inside* an action
(a backward's gradients before they are freed, a loss's softmax, a matrix product's
workspace) and what the allocator keeps between steps (cuBLAS workspaces). This script
runs a set of single-rank jobs on CUDA, each in its own process, and prints, per job:

- the allocator's peak over a step (``measured``), and the prediction of the tracked
  model (``predicted``: what ``pipesim run`` prints on a CPU) beside the tracked peak
  itself (``tracked``: the tensors the executor counts, counted on the GPU too);
- the most allocated at any action boundary (``boundary``) and the most allocated there
  beyond what the tracker counts (``untracked``), so the gap splits into what the boundary
  model misses and what is transient inside an action;
- the action (or the optimizer step, ``opt``) whose interval held the peak, and how far
  above its starting allocation it went (``transient``).

    python benchmarks/gpu_memory.py                  # on a machine with a GPU
    python benchmarks/gpu_memory.py --json out.json  # the rows, for a later look
    python benchmarks/gpu_memory.py --set held-out   # only the jobs the model was not built on
    python benchmarks/gpu_memory.py --dry-run        # the flow on a CPU (tracked bytes, tiny sizes)

The peer is the prediction of the same job, computed in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipesim.cli.files import UserFileError, check_outputs  # noqa: E402 - after the path above

MIB = 2**20

# (label, RunConfig fields): single-rank jobs whose peaks fall in different places. The
# allocator's part of the prediction (pipesim.cli.run_memory.allocator_extras) was built
# looking at these twelve on an H200: in-sample
IN_SAMPLE: list[tuple[str, dict]] = [
    ("gpt small fp32", dict(model="gpt", layers=4, hidden=512, heads=8, seq_len=256, batch_size=8, microbatches=4,
                            vocab=512)),
    ("gpt 32k vocab fp32", dict(model="gpt", layers=4, hidden=1024, heads=16, seq_len=512, batch_size=16,
                                microbatches=4, vocab=32000)),
    ("gpt 32k vocab bf16", dict(model="gpt", layers=4, hidden=1024, heads=16, seq_len=512, batch_size=16,
                                microbatches=4, vocab=32000, dtype="bfloat16")),
    ("gpt gpipe m8 fp32", dict(model="gpt", schedule="gpipe", layers=8, hidden=1024, heads=16, seq_len=512,
                               batch_size=32, microbatches=8, vocab=4096)),
    ("gpt gpipe m8 bf16", dict(model="gpt", schedule="gpipe", layers=8, hidden=1024, heads=16, seq_len=512,
                               batch_size=32, microbatches=8, vocab=4096, dtype="bfloat16")),
    ("gpt wide fp32", dict(model="gpt", layers=2, hidden=4096, heads=32, seq_len=1024, batch_size=4,
                           microbatches=2, vocab=8192)),
    ("gpt recompute full", dict(model="gpt", schedule="gpipe", layers=8, hidden=1024, heads=16, seq_len=512,
                                batch_size=32, microbatches=8, vocab=4096, recompute="full")),
    ("llama3 fp32", dict(model="llama3-8b", layers=4, hidden=1024, heads=16, kv_heads=4, seq_len=1024,
                         batch_size=8, microbatches=4, vocab=32000)),
    ("llama3 bf16 gpipe", dict(model="llama3-8b", schedule="gpipe", layers=4, hidden=1024, heads=16, kv_heads=4,
                               seq_len=1024, batch_size=16, microbatches=8, vocab=32000, dtype="bfloat16")),
    ("llama3 selective", dict(model="llama3-8b", schedule="gpipe", layers=4, hidden=1024, heads=16, kv_heads=4,
                              seq_len=1024, batch_size=16, microbatches=8, vocab=32000, recompute="selective")),
    ("mixtral fp32", dict(model="mixtral-8x7b", layers=2, hidden=1024, heads=16, kv_heads=4, seq_len=512,
                          batch_size=8, microbatches=4, vocab=32000, experts=4)),
    ("deepseek-v2-lite fp32", dict(model="deepseek-v2-lite", layers=3, hidden=1024, heads=16, seq_len=512,
                                   batch_size=8, microbatches=4, vocab=32000, experts=4)),
]
# looked at only after the allocator's part was built: held out
HELD_OUT: list[tuple[str, dict]] = [
    ("gpt sgd 50k vocab", dict(model="gpt", optimizer="sgd", layers=6, hidden=768, heads=12, seq_len=1024,
                               batch_size=8, microbatches=4, vocab=50304)),
    ("gpt adamw no decay", dict(model="gpt", layers=6, hidden=1536, heads=12, seq_len=256, batch_size=16,
                                microbatches=2, vocab=16384, weight_decay=0.0)),
    ("gpt dualpipev", dict(model="gpt", schedule="dualpipev", virtual_stages=2, layers=8, hidden=1024, heads=16,
                           seq_len=512, batch_size=16, microbatches=8, vocab=8192)),
    ("gpt interleaved v2", dict(model="gpt", schedule="interleaved-1f1b", virtual_stages=2, layers=8, hidden=1024,
                                heads=16, seq_len=512, batch_size=16, microbatches=4, vocab=8192, dtype="bfloat16")),
    ("llama3 per-op gpipe", dict(model="llama3-8b", schedule="gpipe", layers=6, hidden=2048, heads=16, kv_heads=4,
                                 seq_len=2048, batch_size=8, microbatches=4, vocab=65536, recompute="per-op",
                                 dtype="bfloat16")),
    ("deepseek-v3 bf16", dict(model="deepseek-v3", layers=4, hidden=1024, heads=16, seq_len=512, batch_size=8,
                              microbatches=4, vocab=32000, experts=8, ffn_hidden=512, dtype="bfloat16")),
    ("qwen moe fp32", dict(model="qwen1.5-moe-a2.7b", layers=3, hidden=1024, heads=16,
                           seq_len=512, batch_size=8, microbatches=4, vocab=32000, experts=8, ffn_hidden=512)),
    ("gpt float64 small", dict(model="gpt", layers=4, hidden=256, heads=8, seq_len=256, batch_size=8,
                               microbatches=4, vocab=8192, dtype="float64")),
]
JOBS = {"in-sample": IN_SAMPLE, "held-out": HELD_OUT}
DRY_SIZES = dict(layers=2, hidden=64, heads=4, seq_len=32, batch_size=4, microbatches=2, vocab=256)


class ActionPeaks:
    """Wraps the executor's memory tracker: after each action (and at the step's end,
    after the optimizer) the allocator's peak since the previous mark, what is allocated
    now, and what the tracker counts now (the tensors ``pipesim run`` counts on a CPU,
    kept counting on the GPU too); the peak statistic is reset at each mark."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def install(self) -> None:
        import torch

        from executor import memory

        tracker = memory.MemoryTracker
        originals = (tracker.__init__, tracker.start_step, tracker.after_action, tracker.finish_step)
        rows = self.rows

        def mark(self, label: str) -> None:
            if self.on_cuda:
                # at the step's start the runtime has not made its buffers yet: nothing counted
                tracked = self.held_now().peak if label != "start" else None
                rows.append({"at": label, "peak": torch.cuda.max_memory_allocated(self.device),
                             "now": torch.cuda.memory_allocated(self.device), "tracked": tracked})
                torch.cuda.reset_peak_memory_stats(self.device)

        def init(self, params, device) -> None:
            originals[0](self, params, device)
            self.on_cuda, self.cuda = self.cuda, False  # count tensors as on a CPU; read the allocator here

        def start_step(self) -> None:
            rows.clear()
            originals[1](self)
            if self.on_cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            mark(self, "start")

        def after_action(self, action) -> None:
            originals[2](self, action)
            if action.is_compute:
                mark(self, str(action))

        def finish_step(self):
            mark(self, "opt")
            return originals[3](self)

        tracker.__init__, tracker.start_step = init, start_step
        tracker.after_action, tracker.finish_step = after_action, finish_step


def measure(label: str, fields: dict, dry_run: bool) -> dict:
    """One job in this process: its last step's rows and the prediction."""
    import torch

    from executor.config import RunConfig
    from executor.worker import run_local
    from pipesim.cli.run_memory import predicted_peaks

    base = dict(schedule="1f1b", pp=1, steps=3, optimizer="adamw", dtype="float32", return_grads=False,
                backend="gloo" if dry_run else "nccl")
    config = RunConfig(**{**base, **fields, **(DRY_SIZES if dry_run else {})})
    peaks = ActionPeaks()
    peaks.install()
    result = run_local(config)
    capability = torch.cuda.get_device_capability() if config.backend == "nccl" else None
    predicted = predicted_peaks(config, capability)[0]
    rows = peaks.rows
    row = {"label": label, "config": {k: v for k, v in dataclasses.asdict(config).items()
                                      if k in {**base, **fields} and k not in ("backend", "return_grads")},
           "tracked": result["memory"][0]["peak"], "predicted": predicted["predicted_peak"],
           "predicted_activations": predicted["predicted_activations"], "actions": rows}
    if rows:
        at = max(range(1, len(rows)), key=lambda index: rows[index]["peak"])
        row.update(measured=rows[at]["peak"], boundary=max(r["now"] for r in rows), start=rows[0]["now"],
                   peak_at=rows[at]["at"], transient=rows[at]["peak"] - rows[at - 1]["now"],
                   untracked=max(r["now"] - r["tracked"] for r in rows[1:]))
    else:  # the dry run: no allocator, the tracked peak
        row["measured"] = row["tracked"]
    return row


def in_subprocess(label: str, dry_run: bool) -> dict:
    """``measure`` in a fresh process: a job's allocations never sit under the next one's."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "row.json"
        command = [sys.executable, __file__, "--job", label, "--row-out", str(out)] + (["--dry-run"] if dry_run else [])
        finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if finished.returncode != 0 or not out.exists():
            tail = (finished.stderr or finished.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"exit {finished.returncode}: {tail[0][:200]}")
        return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU and gloo, tiny sizes: the flow only")
    parser.add_argument("--json", help="write every row (with each action's peak) here")
    parser.add_argument("--only", help="comma-separated labels to run")
    parser.add_argument("--set", choices=("all", *JOBS), default="all",
                        help="the jobs the allocator's part was built on (in-sample), the others (held-out), or both")
    parser.add_argument("--job", help=argparse.SUPPRESS)  # one job in this process (what main runs per row)
    parser.add_argument("--row-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = sorted(set(args.only.split(",")) - {label for label, _ in IN_SAMPLE + HELD_OUT}) if args.only else []
    if unknown:
        parser.error(f"--only: no job named {', '.join(map(repr, unknown))}; the jobs: "
                     f"{', '.join(label for label, _ in IN_SAMPLE + HELD_OUT)}")
    try:
        check_outputs(args)
    except UserFileError as error:
        parser.error(str(error))
    if args.job:
        fields = dict(IN_SAMPLE + HELD_OUT)[args.job]
        Path(args.row_out).write_text(json.dumps(measure(args.job, fields, args.dry_run)))
        return 0
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_memory: no CUDA device is visible (use --dry-run on a CPU)", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    chosen = [job for name in (JOBS if args.set == "all" else [args.set]) for job in JOBS[name]]
    jobs = [job for job in chosen if not args.only or job[0] in args.only.split(",")]
    print(f"{'job':<24} {'measured':>9} {'predicted':>9} {'error':>7} {'tracked':>9} {'boundary':>9} "
          f"{'untracked':>9} {'at start':>9} {'peak in':>8} {'transient':>9}   (MiB; error = measured / predicted - 1)")
    rows = []
    for label, _fields in jobs:
        try:
            row = in_subprocess(label, args.dry_run)
        except Exception as error:  # one job's failure is a row, not the end of the table
            print(f"{label:<24} FAILED: {type(error).__name__}: {str(error)[:200]}")
            continue
        rows.append(row)
        extra = (f"{row['boundary'] / MIB:>9.1f} {row['untracked'] / MIB:>9.1f} {row['start'] / MIB:>9.1f} "
                 f"{row['peak_at']:>8} {row['transient'] / MIB:>9.1f}" if "boundary" in row else "")
        print(f"{label:<24} {row['measured'] / MIB:>9.1f} {row['predicted'] / MIB:>9.1f} "
              f"{row['measured'] / row['predicted'] - 1:>+7.1%} {row['tracked'] / MIB:>9.1f} {extra}", flush=True)
    for name, members in JOBS.items():
        errors = [abs(row["measured"] / row["predicted"] - 1) for row in rows if row["label"] in dict(members)]
        if errors:
            print(f"{name}: median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%} "
                  f"over {len(errors)} jobs")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if len(rows) == len(jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
