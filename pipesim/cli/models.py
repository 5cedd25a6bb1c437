"""``pipesim models``: every name ``--model`` takes, with the architecture behind it.

A user choosing a model for ``simulate``, ``plan`` or ``run`` should not have to open
``--help`` and then a config.json to learn that ``qwen3-30b-a3b`` is 48 layers of 128
experts, 8 active. One row a name: where it comes from (a preset written from the
papers, or a shipped Hugging Face config.json), its size counted as ``simulate`` counts
it, and the parts that decide its costs.
"""

from __future__ import annotations

import argparse
import json

from pipesim.model.spec import PRESETS, ModelSpec, bundled_models, load_model, model_names

HEADER = ("name", "from", "params", "active", "layers", "hidden", "heads", "kv", "head dim", "experts",
          "attention", "seq")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models", help="list every model --model takes by name, with its size and parts",
        description="The models --model takes by name: the presets, then the Hugging Face config.json files "
                    "pipesim ships. Sizes are counted as simulate counts them (a tied output head once; the "
                    "active count with the embedding table, as the published figures count it); seq is the "
                    "sequence it runs at unless --seq-len says. Any other config.json is taken by its path.")
    parser.add_argument("--json", help="also write the rows as JSON to this path")
    parser.set_defaults(handler=handle)


def attention_of(spec: ModelSpec) -> str:
    """The attention's kind in a word or two: latent, multi-query, grouped-query or
    multi-head, and what limits the keys a query sees in some layers."""
    if spec.mla is not None:
        kind = "latent"
    elif spec.num_kv_heads == 1 < spec.heads:
        kind = "multi-query"
    else:
        kind = "grouped" if spec.num_kv_heads < spec.heads else "multi-head"
    if spec.sliding_window is not None and spec.sliding_layers:
        kind += f", window {spec.sliding_window} in {len(spec.sliding_layers)}/{spec.layers}"
    if spec.attention_chunk is not None and spec.chunked_layers:
        kind += f", chunks of {spec.attention_chunk} in {len(spec.chunked_layers)}/{spec.layers}"
    if spec.attention_sinks:
        kind += ", sinks"
    return kind


def experts_of(spec: ModelSpec) -> str:
    """``E top-k`` (and shared experts), or ``-`` for a dense model."""
    if spec.moe is None:
        return "-"
    shared = f" +{spec.moe.shared_experts} shared" if spec.moe.shared_experts else ""
    return f"{spec.moe.experts} top-{spec.moe.experts_per_token}{shared}"


def row(name: str) -> dict:
    """One model's row (``HEADER``'s fields)."""
    spec = load_model(name)
    head_dim = spec.q_width / spec.heads
    return {"name": name, "from": "preset" if name in PRESETS else "config.json",
            "params": spec.total_params(), "active": spec.active_params(), "layers": spec.layers,
            "hidden": spec.hidden, "heads": spec.heads, "kv": spec.num_kv_heads,
            "head dim": int(head_dim) if head_dim == int(head_dim) else head_dim,
            "experts": experts_of(spec), "attention": attention_of(spec), "seq": spec.seq_len}


def billions(count: int) -> str:
    return f"{count / 1e9:.2f} B" if count >= 1e9 else f"{count / 1e6:.1f} M"


def table(rows: list[dict]) -> str:
    """The rows as aligned text, counts in billions (millions below one)."""
    cells = [[billions(value) if key in ("params", "active") else str(value) for key, value in item.items()]
             for item in rows]
    widths = [max(len(header), *(len(line[index]) for line in cells)) for index, header in enumerate(HEADER)]
    numeric = {"params", "active", "layers", "hidden", "heads", "kv", "head dim", "seq"}

    def line(values: list[str]) -> str:
        return "  ".join(value.rjust(width) if header in numeric else value.ljust(width)
                         for header, value, width in zip(HEADER, values, widths, strict=True)).rstrip()

    return "\n".join([line(list(HEADER)), *(line(values) for values in cells)])


def handle(args: argparse.Namespace) -> int:
    rows = [row(name) for name in model_names()]
    print(table(rows))
    print(f"({len(PRESETS)} presets and {len(bundled_models())} shipped config.json files; any other "
          f"config.json is taken by its path)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
        print(f"wrote {args.json}")
    return 0
