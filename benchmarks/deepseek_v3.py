"""DeepSeek-V3 as trained, predicted without calibration: tokens/s per GPU against the
technical report's pre-training throughput, and each rank's peak memory against what
an 80 GB H800 leaves.

Source: DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv:2412.19437). The layout is
the report's (section 3.2): 2,048 H800s, 16-way pipeline parallelism with DualPipe (two
copies of the model along the pipeline), 64-way expert parallelism over 8 nodes, ZeRO-1
data parallelism (dp 128), no tensor parallelism, 20 of the 132 SMs kept for
communication; 15,360 sequences of 4K per step (section 4.2, after the batch-size ramp),
as 60 microbatches of one sequence in each direction. Its config.json (FP8
``quantization_config``, node-limited routing, the multi-token prediction module). Its
all-to-alls as section 3.3.3 sends them: toward the experts (the dispatch, and in the
backward the combine's gradient) in FP8 with a scale per 128 elements, counted as FP32
(1.03125 bytes an element), back from them in BF16 (the config's block-scaled FP8 turns
the FP8 dispatch on; ``--ep-dispatch bf16`` is printed beside it). The
memory rules of section 3.2.3 and 3.3.3: ``--recompute norm-mla-up``, FP8 caching
(under ``--fp8``, which the config turns on), ``--optimizer-moments bf16`` with FP32
gradients and master weights (``--bytes-per-param 2,4,12``: 2 + 4 + 4 + 2 + 2 bytes); the
EMA of the parameters lives in CPU memory (nothing on the GPU); the embedding and output
head that the MTP module shares sit on one rank under DualPipe, so they are counted once.

Assumed (the report does not say): one sequence per microbatch; the layers split as
pipesim splits them by default (as even as possible, the extras in the middle stages);
the dispatch's scales sent as FP32, as DeepEP's FP8 dispatch takes them (DeepSeek's are
powers of 2, which a byte would hold).

Published figure: 14.8T pre-training tokens in 2,664K H800 GPU-hours (Table 1; the
2.788M total adds 119K of context extension and 5K of post-training), 1,543 tokens/s per
GPU. It is an average over the whole pre-training: the batch-size ramp over the first
469B tokens, evaluation, checkpoints and restarts are in it, so the steady step a
simulation predicts should be at or above it. In-sample: the memory rules and the
collectives' pricing were built with this row printed; the FP8 dispatch was added from the
report's text and the stacks' code (it moved the row from -0.7% to +5.1%); the two
copies of a model stage then summed in one all-reduce that holds its links once, not one
each (``pipesim.sim.parallel.comm_plan``), moved it to +11.9%, and pricing the token
permutations around the routed experts (``pipesim.model.operations.token_permutations``,
added on the held-out mixture-of-experts rows of ``benchmarks/published_overlap.py``) to
+10.6%, and pricing the loss's cross entropy over the 129,280-token vocabulary (twice a
microbatch on the last stage: the output head's and the MTP module's;
``pipesim.model.loss_traffic``, Megatron-Core's unfused default, since the report does not
say how its loss runs; Transformer Engine's fused kernel is printed beside it) from +9.3%
to -0.8%. An earlier version split the
layers by hand (3, 4 x 14, 2) to fit a flat 10% headroom of a decimal 80 GB; with the
driver's capacity and the headroom rule the default split fits, so no split is chosen.

Run: ``PYTHONPATH=. python benchmarks/deepseek_v3.py`` (``benchmarks/published.py``
prints the same lines after its tables).
"""

from __future__ import annotations

import time
from dataclasses import replace

from pipesim.cli import build_parser
from pipesim.job import Job, model_figures, simulate_job

CONFIG = "pipesim/model/data/hf_configs/deepseek-v3.json"
GPUS = 2048
PRETRAINING_TOKENS = 14.8e12
PRETRAINING_GPU_HOURS = 2664e3
PUBLISHED_TOKENS_PER_GPU = PRETRAINING_TOKENS / (PRETRAINING_GPU_HOURS * 3600)
COMMAND = (f"pipesim simulate --model {CONFIG} --seq-len 4096 --schedule dualpipe --pp 16 --dp 128 --ep 64 "
           f"--topology ib --nodes 256 --gpu h800 --comm-sms 20 --zero 1 -m 120 "
           "--recompute norm-mla-up --bytes-per-param 2,4,12 --optimizer-moments bf16")
# each memory rule taken away in turn: (what, the Job's fields as without it)
WITHOUT = (("--recompute none", {"recompute": "none"}),
           ("--optimizer-moments fp32", {"optimizer_moments": "fp32"}),
           ("--bytes-per-param 2,2,12 (BF16 gradients), moments FP32", {"bytes_per_param": "2,2,12",
                                                                       "optimizer_moments": "fp32"}))


def job_of(command: str = COMMAND) -> Job:
    """The Job ``pipesim simulate`` makes of ``command``."""
    return Job.from_namespace(build_parser().parse_args(command.split()[1:]))


def predict(job: Job) -> dict:
    """Tokens/s per GPU, the fullest rank's peak, the least usable memory, the wall time."""
    started = time.perf_counter()
    result = simulate_job(job)
    figures = model_figures(job, result)
    fullest = max(result.memory, key=lambda rank: rank.peak_bytes)
    return {"tokens_per_gpu": figures["tokens_per_second"] / GPUS, "mfu": figures["mfu"],
            "peak_gb": fullest.peak_bytes / 1e9, "rank": fullest.rank, "usable_gb": fullest.usable_bytes / 1e9,
            "capacity_gb": fullest.capacity_bytes / 1e9, "fits": not result.oom,
            "seconds": time.perf_counter() - started}


def report_lines() -> list[str]:
    """The comparison with the report, and what each memory rule is worth."""
    job = job_of()
    row = predict(job)
    error = row["tokens_per_gpu"] / PUBLISHED_TOKENS_PER_GPU - 1
    lines = ["DeepSeek-V3 as trained (technical report, 2,048 H800s): no calibration",
             f"  {COMMAND}",
             f"  tokens/s per GPU {row['tokens_per_gpu']:,.0f} against the report's {PUBLISHED_TOKENS_PER_GPU:,.0f} "
             f"(14.8T tokens in 2,664K GPU-hours): {error:+.1%}, in-sample; MFU {row['mfu']:.1%}",
             f"  fullest rank {row['rank']}: peak {row['peak_gb']:.2f} GB of {row['usable_gb']:.2f} GB usable "
             f"({row['capacity_gb']:.2f} GB device): {'fits' if row['fits'] else 'OUT OF MEMORY'}; "
             f"simulated in {row['seconds']:.1f} s"]
    for what, fields in WITHOUT:
        other = predict(replace(job, **fields))
        lines.append(f"  with {what}: peak {other['peak_gb']:.2f} GB (rank {other['rank']})")
    bf16 = predict(replace(job, ep_dispatch="bf16"))
    lines.append(f"  with --ep-dispatch bf16 (the all-to-alls both ways in BF16): tokens/s per GPU "
                 f"{bf16['tokens_per_gpu']:,.0f} ({bf16['tokens_per_gpu'] / PUBLISHED_TOKENS_PER_GPU - 1:+.1%}), peak "
                 f"{bf16['peak_gb']:.2f} GB (rank {bf16['rank']})")
    fused = predict(replace(job, cross_entropy="te"))
    lines.append(f"  with --cross-entropy te (the loss in one fused pass, not Megatron-Core's default): tokens/s per "
                 f"GPU {fused['tokens_per_gpu']:,.0f} ({fused['tokens_per_gpu'] / PUBLISHED_TOKENS_PER_GPU - 1:+.1%}), "
                 f"peak {fused['peak_gb']:.2f} GB (rank {fused['rank']})")
    return lines


if __name__ == "__main__":
    print("\n".join(report_lines()))
