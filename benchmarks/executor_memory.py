"""Predicted against measured peak memory per rank, on CPU: ``pipesim run`` over the
schedules, recompute modes and tp/sp/dp/ZeRO layouts of issue 31's memory target, on the
toy ``gpt`` and architectures shrunk (llama3-8b: GQA, SwiGLU, RMSNorm, rotary;
mixtral-8x7b: the same with a mixture of experts; deepseek-v3 and v2-lite: latent
attention, shared experts; config.json files: Qwen3's and OLMoE's query and key norms,
Qwen3-0.6B's tied embeddings, gpt-oss's sinks, Llama 4's layers), float32 (a few rows
float64 or bf16 autocast) and AdamW.

    python benchmarks/executor_memory.py               # every row, a few minutes on 2 cores
    python benchmarks/executor_memory.py --only llama  # the rows whose name contains llama
    python benchmarks/executor_memory.py --only "tp 2,cp 2"  # ... either text

Each row is one ``pipesim run --json`` in a fresh process (printed with ``--commands``);
the table lists each pipeline rank's measured peak (``peak``: the tensors the executor
tracks, at action boundaries) against the simulator's prediction (``predicted_peak``,
``pipesim.cli.run_memory``), and the activations alone (``activations_peak`` against
``predicted_activations``). The target: every |error| of the peak within 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ("--steps", "2", "--optimizer", "adamw", "--backend", "gloo", "--seq-len", "32", "--vocab", "128")
GPT = ("--model", "gpt", "--layers", "4", "--hidden", "64", "--heads", "4", "--batch-size", "8", "-m", "4")
LLAMA = ("--model", "llama3-8b", "--layers", "4", "--hidden", "64", "--heads", "8", "--batch-size", "8", "-m", "4")
MIXTRAL = ("--model", "mixtral-8x7b", "--layers", "4", "--hidden", "64", "--heads", "8", "--batch-size", "8",
           "-m", "4")
DEEPSEEK = ("--layers", "4", "--hidden", "64", "--heads", "8", "--batch-size", "8", "-m", "4")
TWO_CHUNKS = ("--virtual-stages", "2")
QWEN3_MOE = ("--model", "qwen3-30b-a3b", *DEEPSEEK, "--kv-heads", "2")


def config(name: str) -> str:
    """A stored Hugging Face config.json, by its file's stem."""
    return f"pipesim/model/data/hf_configs/{name}.json"


ROWS: dict[str, tuple[str, ...]] = {
    "gpt gpipe": (*GPT, "--pp", "2", "--schedule", "gpipe"),
    "gpt 1f1b": (*GPT, "--pp", "2", "--schedule", "1f1b"),
    "gpt interleaved-1f1b": (*GPT, "--pp", "2", "--schedule", "interleaved-1f1b", *TWO_CHUNKS),
    "gpt zbv": (*GPT, "--pp", "2", "--schedule", "zbv", *TWO_CHUNKS),
    "gpt 1f1b recompute full": (*GPT, "--pp", "2", "--schedule", "1f1b", "--recompute", "full"),
    "gpt 1f1b recompute selective": (*GPT, "--pp", "2", "--schedule", "1f1b", "--recompute", "selective"),
    "gpt zbv recompute full": (*GPT, "--pp", "2", "--schedule", "zbv", *TWO_CHUNKS, "--recompute", "full"),
    "gpt 1f1b tp 2": (*GPT, "--pp", "2", "--tp", "2"),
    "gpt 1f1b tp 2 sp": (*GPT, "--pp", "2", "--tp", "2", "--sequence-parallel"),
    "gpt 1f1b tp 2 sp recompute full": (*GPT, "--pp", "2", "--tp", "2", "--sequence-parallel", "--recompute", "full"),
    # a split backward's kept output gradients: each row-parallel GEMM's whole, all-gathered in I
    "gpt zb-h1 tp 2 sp": (*GPT, "--pp", "2", "--tp", "2", "--sequence-parallel", "--schedule", "zb-h1"),
    "gpt 1f1b float64": (*GPT, "--pp", "2", "--dtype", "float64"),
    "gpt 1f1b bfloat16": (*GPT, "--pp", "2", "--dtype", "bfloat16"),
    "gpt 1f1b dp 2 zero 0": (*GPT, "--pp", "2", "--dp", "2", "--zero", "0"),
    "gpt 1f1b dp 2 zero 1": (*GPT, "--pp", "2", "--dp", "2", "--zero", "1"),
    "gpt 1f1b dp 2 zero 2": (*GPT, "--pp", "2", "--dp", "2", "--zero", "2"),
    "gpt 1f1b dp 2 zero 3": (*GPT, "--pp", "2", "--dp", "2", "--zero", "3"),
    "gpt zbv dp 2 zero 3": (*GPT, "--pp", "2", "--dp", "2", "--zero", "3", "--schedule", "zbv", *TWO_CHUNKS),
    "gpt dualpipe dp 2 zero 3": (*GPT, "--pp", "2", "--dp", "2", "--zero", "3", "--schedule", "dualpipe",
                                 *TWO_CHUNKS),
    "llama gpipe": (*LLAMA, "--pp", "2", "--schedule", "gpipe"),
    "llama 1f1b": (*LLAMA, "--pp", "2", "--schedule", "1f1b"),
    "llama interleaved-1f1b": (*LLAMA, "--pp", "2", "--schedule", "interleaved-1f1b", *TWO_CHUNKS),
    "llama zbv": (*LLAMA, "--pp", "2", "--schedule", "zbv", *TWO_CHUNKS),
    "llama 1f1b recompute full": (*LLAMA, "--pp", "2", "--recompute", "full"),
    "llama 1f1b recompute selective": (*LLAMA, "--pp", "2", "--recompute", "selective"),
    "llama 1f1b tp 2": (*LLAMA, "--pp", "2", "--tp", "2"),
    "llama 1f1b tp 2 sp": (*LLAMA, "--pp", "2", "--tp", "2", "--sequence-parallel"),
    "llama zb-h1 tp 2 sp": (*LLAMA, "--pp", "2", "--tp", "2", "--sequence-parallel", "--schedule", "zb-h1"),
    "llama 1f1b bfloat16": (*LLAMA, "--pp", "2", "--dtype", "bfloat16"),
    "llama zbv bfloat16 recompute full": (*LLAMA, "--pp", "2", "--schedule", "zbv", *TWO_CHUNKS, "--dtype",
                                          "bfloat16", "--recompute", "full"),
    # sequence parallelism under autocast: what each sublayer keeps of its gathered input
    "gpt 1f1b tp 2 sp bfloat16": (*GPT, "--pp", "2", "--tp", "2", "--sequence-parallel", "--dtype", "bfloat16"),
    "llama zb-h1 tp 2 sp bfloat16": (*LLAMA, "--pp", "2", "--tp", "2", "--sequence-parallel", "--schedule", "zb-h1",
                                     "--dtype", "bfloat16"),
    "mixtral 1f1b tp 2 sp bfloat16": (*MIXTRAL, "--pp", "2", "--tp", "2", "--sequence-parallel", "--dtype",
                                      "bfloat16"),
    "mixtral 1f1b": (*MIXTRAL, "--pp", "2", "--schedule", "1f1b"),
    "mixtral zbv": (*MIXTRAL, "--pp", "2", "--schedule", "zbv", *TWO_CHUNKS),
    "mixtral 1f1b recompute selective": (*MIXTRAL, "--pp", "2", "--recompute", "selective"),
    "mixtral 1f1b dp 2 zero 1": (*MIXTRAL, "--pp", "2", "--dp", "2", "--zero", "1"),
    "mixtral 1f1b tp 2": (*MIXTRAL, "--pp", "2", "--tp", "2"),
    "mixtral 1f1b dp 2 ep 2": (*MIXTRAL, "--pp", "2", "--dp", "2", "--ep", "2"),
    # parallel folding: the experts whole on both tp ranks, ep 2 cut from them (one replica)
    "mixtral 1f1b tp 2 sp etp 1 ep 2": (*MIXTRAL, "--pp", "2", "--tp", "2", "--sequence-parallel", "--etp", "1",
                                        "--ep", "2"),
    # under autocast each rank casts its own experts' weights only; the dispatch keeps float32 rows
    "mixtral 1f1b dp 2 ep 2 bfloat16": (*MIXTRAL, "--pp", "2", "--dp", "2", "--ep", "2", "--dtype", "bfloat16"),
    "mixtral 1f1b cp 2": (*MIXTRAL, "--pp", "2", "--cp", "2"),
    # folded experts: each tp rank routes its own sequence shard, alone and at ep 2 (8 experts, top 4)
    "qwen3-moe 1f1b tp 2 sp etp 1 bfloat16": (*QWEN3_MOE, "--pp", "2", "--tp", "2", "--sequence-parallel", "--etp",
                                              "1", "--dtype", "bfloat16"),
    "qwen3-moe 1f1b tp 2 sp etp 1 ep 2 bfloat16": (*QWEN3_MOE, "--pp", "2", "--tp", "2", "--sequence-parallel",
                                                   "--etp", "1", "--ep", "2", "--dtype", "bfloat16"),
    # Megatron-Core's moe_act: the experts' activation output dropped and rebuilt; under a split
    # backward held from I until the down projection's W
    "mixtral 1f1b recompute-moe-act": (*MIXTRAL, "--pp", "2", "--recompute-moe-act"),
    "mixtral zbv recompute-moe-act": (*MIXTRAL, "--pp", "2", "--schedule", "zbv", *TWO_CHUNKS,
                                      "--recompute-moe-act"),
    "deepseek-v3 1f1b": ("--model", "deepseek-v3", *DEEPSEEK, "--pp", "2"),
    "deepseek-v2-lite zbv": ("--model", "deepseek-v2-lite", *DEEPSEEK, "--pp", "2", "--schedule", "zbv", *TWO_CHUNKS),
    # latent attention under bf16 autocast: the math path's float32 Q, K, V and softmax
    "deepseek-v3 1f1b bfloat16": ("--model", "deepseek-v3", *DEEPSEEK, "--pp", "2", "--dtype", "bfloat16"),
    "deepseek-v2-lite zbv bfloat16 recompute norm-mla-up": ("--model", "deepseek-v2-lite", *DEEPSEEK, "--pp", "2",
                                                            "--schedule", "zbv", *TWO_CHUNKS, "--dtype", "bfloat16",
                                                            "--recompute", "norm-mla-up"),
    "deepseek-v3 1f1b tp 2 sp bfloat16": ("--model", "deepseek-v3", *DEEPSEEK, "--pp", "2", "--tp", "2",
                                          "--sequence-parallel", "--ffn-hidden", "184", "--dtype", "bfloat16"),
    "gpt 1f1b recompute norm-mla-up": (*GPT, "--pp", "2", "--recompute", "norm-mla-up"),
    "llama 1f1b recompute norm-mla-up": (*LLAMA, "--pp", "2", "--recompute", "norm-mla-up"),
    "llama 1f1b tp 2 sp recompute norm-mla-up": (*LLAMA, "--pp", "2", "--tp", "2", "--sequence-parallel",
                                                 "--recompute", "norm-mla-up"),
    "deepseek-v3 1f1b recompute norm-mla-up": ("--model", "deepseek-v3", *DEEPSEEK, "--pp", "2", "--recompute",
                                               "norm-mla-up"),
    "deepseek-v2-lite zbv recompute norm-mla-up": ("--model", "deepseek-v2-lite", *DEEPSEEK, "--pp", "2", "--schedule",
                                                   "zbv", *TWO_CHUNKS, "--recompute", "norm-mla-up"),
    # config.json parts: query and key norms, tied embeddings, sinks, Llama 4's layers
    "qwen3 1f1b": ("--model", config("qwen3-8b"), *DEEPSEEK, "--pp", "2"),
    "qwen3-0.6b tied 1f1b": ("--model", config("qwen3-0.6b"), *DEEPSEEK, "--pp", "2"),
    "qwen3-0.6b tied zbv": ("--model", config("qwen3-0.6b"), *DEEPSEEK, "--pp", "2", "--schedule", "zbv", *TWO_CHUNKS),
    "olmoe 1f1b": ("--model", config("olmoe-1b-7b"), *DEEPSEEK, "--pp", "2", "--experts", "4"),
    "gpt-oss 1f1b": ("--model", config("gpt-oss-20b"), *DEEPSEEK, "--pp", "2", "--experts", "4"),
    "llama4 1f1b": ("--model", config("llama-4-scout"), *DEEPSEEK, "--pp", "2", "--experts", "4"),
    # mixtures of experts under bf16 autocast: each linear's own cast of the tokens, the combine in float32;
    # Qwen1.5-MoE's gated shared expert; Llama 4's copies scaled before their expert
    "mixtral 1f1b bfloat16": (*MIXTRAL, "--pp", "2", "--dtype", "bfloat16"),
    "qwen1.5-moe 1f1b": ("--model", config("qwen1.5-moe-a2.7b"), *DEEPSEEK, "--pp", "2", "--experts", "4"),
    "qwen1.5-moe 1f1b bfloat16": ("--model", config("qwen1.5-moe-a2.7b"), *DEEPSEEK, "--pp", "2", "--experts", "4",
                                  "--dtype", "bfloat16"),
    "qwen1.5-moe 1f1b tp 2 sp bfloat16": ("--model", config("qwen1.5-moe-a2.7b"), *DEEPSEEK, "--pp", "2",
                                          "--experts", "4", "--tp", "2", "--sequence-parallel", "--dtype", "bfloat16"),
    "llama4 1f1b bfloat16": ("--model", config("llama-4-scout"), *DEEPSEEK, "--pp", "2", "--experts", "4",
                             "--dtype", "bfloat16"),
    "llama4 1f1b tp 2 sp bfloat16": ("--model", config("llama-4-scout"), *DEEPSEEK, "--pp", "2", "--experts", "4",
                                     "--kv-heads", "2", "--ffn-hidden", "192",
                                     "--tp", "2", "--sequence-parallel", "--dtype", "bfloat16"),
    # parallel blocks: GPT-NeoX's two norms and partial rotary, Falcon-7B's one norm read twice
    "pythia 1f1b": ("--model", config("pythia-160m"), *DEEPSEEK, "--pp", "2"),
    "falcon-7b 1f1b": ("--model", config("falcon-7b"), *DEEPSEEK, "--pp", "2"),
    "falcon-7b 1f1b recompute norm-mla-up": ("--model", config("falcon-7b"), *DEEPSEEK, "--pp", "2", "--recompute",
                                             "norm-mla-up"),
    "llama 1f1b bfloat16 recompute norm-mla-up": (*LLAMA, "--pp", "2", "--dtype", "bfloat16", "--recompute",
                                                  "norm-mla-up"),
    # Gemma: four norms a layer, soft-capped scores and logits (Gemma 2), local rotary base (Gemma 3)
    "gemma-2 1f1b": ("--model", config("gemma-2-9b"), *DEEPSEEK, "--pp", "2"),
    "gemma-3 1f1b": ("--model", config("gemma-3-1b"), *DEEPSEEK, "--pp", "2"),
    # under bf16 autocast: query and key norms' float32 weights make the rotated Q and the rotary tables float32;
    # Gemma's post norms read the sublayers' 16-bit outputs, its offset norms keep 1 + weight; the written-out
    # attention keeps its boolean mask (and gpt-oss's softmax the sinks' column); Falcon-7B's one norm cast twice
    "qwen3 1f1b bfloat16": ("--model", config("qwen3-8b"), *DEEPSEEK, "--pp", "2", "--dtype", "bfloat16"),
    "olmoe 1f1b bfloat16": ("--model", config("olmoe-1b-7b"), *DEEPSEEK, "--pp", "2", "--experts", "4",
                            "--dtype", "bfloat16"),
    "gpt-oss 1f1b bfloat16": ("--model", config("gpt-oss-20b"), *DEEPSEEK, "--pp", "2", "--experts", "4",
                              "--dtype", "bfloat16"),
    "gemma-2 1f1b bfloat16": ("--model", config("gemma-2-9b"), *DEEPSEEK, "--pp", "2", "--dtype", "bfloat16"),
    "gemma-3 1f1b bfloat16": ("--model", config("gemma-3-1b"), *DEEPSEEK, "--pp", "2", "--dtype", "bfloat16"),
    "gemma-3 1f1b tp 2 sp bfloat16": ("--model", config("gemma-3-1b"), *DEEPSEEK, "--pp", "2", "--kv-heads", "2",
                                      "--tp", "2", "--sequence-parallel", "--dtype", "bfloat16"),
    "falcon-7b 1f1b bfloat16": ("--model", config("falcon-7b"), *DEEPSEEK, "--pp", "2", "--dtype", "bfloat16"),
    # selective recompute checkpoints the written-out attention core too (Gemma 2's soft caps); latent
    # attention's checkpointed kernel keeps its float32 Q and K and its V as the up-projection's view
    "gemma-2 1f1b bfloat16 recompute selective": ("--model", config("gemma-2-9b"), *DEEPSEEK, "--pp", "2",
                                                  "--dtype", "bfloat16", "--recompute", "selective"),
    "deepseek-v2-lite 1f1b bfloat16 recompute selective": ("--model", "deepseek-v2-lite", *DEEPSEEK, "--pp", "2",
                                                           "--dtype", "bfloat16", "--recompute", "selective"),
    # ... and under sequence parallelism, where the block reads the 16-bit gathered shard, 16-bit Q and K
    "deepseek-v3 1f1b tp 2 sp bfloat16 recompute selective": ("--model", "deepseek-v3", *DEEPSEEK, "--pp", "2",
                                                              "--tp", "2", "--sequence-parallel", "--ffn-hidden",
                                                              "184", "--dtype", "bfloat16", "--recompute",
                                                              "selective"),
    # context parallelism's ring keeps K and V at their own heads, its output in float32, and under autocast
    # a query norm's float32 Q and the K/V message it makes float32
    "qwen3 1f1b cp 2 bfloat16": ("--model", config("qwen3-8b"), *DEEPSEEK, "--pp", "2", "--cp", "2",
                                 "--dtype", "bfloat16"),
    # learned positions (GPT-2): the attention kernel's output joins its heads as a view, no copy
    "gpt2 1f1b": ("--model", config("gpt2"), *DEEPSEEK, "--pp", "2"),
    # DeepSeek-V3's config.json: its multi-token prediction module on the last stage, YaRN
    "deepseek-v3 mtp 1f1b": ("--model", config("deepseek-v3"), *DEEPSEEK, "--pp", "2", "--experts", "8"),
    "deepseek-v3 mtp 1f1b cp 2": ("--model", config("deepseek-v3"), *DEEPSEEK, "--pp", "2", "--experts", "8",
                                  "--cp", "2"),
}


def run_row(name: str, folder: str) -> list[dict]:
    """One ``pipesim run`` in a fresh process; its memory rows."""
    path = os.path.join(folder, name.replace(" ", "_") + ".json")
    done = subprocess.run([sys.executable, "-m", "pipesim", "run", *ROWS[name], *COMMON, "--quiet", "--json", path],
                          cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise SystemExit(f"executor_memory.py: {name} failed: {last}")
    return json.loads(Path(path).read_text())["memory"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the rows whose name contains this text (or any of several, "
                                                    "comma-separated)")
    parser.add_argument("--commands", action="store_true", help="print each row's command and exit")
    args = parser.parse_args(argv)
    names = [name for name in ROWS if any(text in name for text in args.only.split(","))]
    if not names:
        raise SystemExit(f"executor_memory.py: --only {args.only!r} matches no row of: {', '.join(ROWS)}")
    if args.commands:
        for name in names:
            print(f"{name}: pipesim run {' '.join(ROWS[name] + COMMON)}")
        return 0
    print("| case | rank | measured peak MiB | predicted MiB | error | activations measured | predicted |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    with tempfile.TemporaryDirectory() as folder:
        for name in names:
            for row in run_row(name, folder):
                error = row["peak"] / row["predicted_peak"] - 1
                worst = max(worst, abs(error))
                print(f"| {name} | {row['rank']} | {row['peak'] / 2**20:.3f} | {row['predicted_peak'] / 2**20:.3f} | "
                      f"{error:+.1%} | {row['activations_peak'] / 2**20:.3f} | "
                      f"{row['predicted_activations'] / 2**20:.3f} |", flush=True)
    print(f"worst |error| of the peak: {worst:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
