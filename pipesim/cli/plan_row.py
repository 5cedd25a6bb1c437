"""``pipesim run --plan plan.json --row N``: run a layout ``pipesim plan`` recommended.

The row's layout is kept as the plan chose it: schedule, pp, tp, dp, virtual stages,
microbatches per replica, microbatch size (so the global batch is dp x microbatches x
microbatch size), ZeRO stage, recompute, sequence, context and expert parallelism (cp by
ring attention, the exchange the plan priced), parallel folding (``etp``) and combined
1F1B (``ep_overlap``). The model is the plan's (a row names it: a preset, or a config
file's absolute path), shrunk to fit this machine: the run's own
``--layers/--hidden/--heads/--seq-len/--vocab``, each raised to the least value the
layout needs (a block per stage, heads a multiple of tp, a sequence the cp and tp ranks
can split). A run's ``--model`` naming another model is refused; a plan written before
rows named their model runs the run's ``--model`` (the ``gpt`` transformer unless another
transformer is named: the planner's models are transformers, so ``mlp`` is not used
here; a row with ep needs routed experts, so there the toy gives way to Mixtral). What
the executor does not run (cost-aware orders in a plan written without them, per-op
recompute with a split backward in a hand-edited row) is refused in one line naming the
row and the value. A row whose order
the plan built from the layout's costs (zb-auto, zbv-auto, the adapted zb-h1 and zb-h2)
carries that order (``order``, ``schedules.order_json``), and the run runs it: the
order the plan simulated.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from executor.config import ConfigError, RunConfig
from executor.options import config_from_args, model_sizes
from executor.refused_values import value_refusal
from schedules.order_json import order_from_dict

# Flags whose value the row fixes, with the value that means "not given".
ROW_FIXES = (("--schedule", "schedule", None), ("--schedule-file", "schedule_file", None), ("--pp", "pp", None),
             ("--microbatches", "microbatches", None), ("--virtual-stages", "virtual_stages", None),
             ("--microbatch-group", "microbatch_group", None),
             ("--dp", "dp", 1), ("--tp", "tp", 1), ("--zero", "zero", 0), ("--recompute", "recompute", "none"),
             ("--sequence-parallel", "sequence_parallel", False), ("--batch-size", "batch_size", None),
             ("--cp", "cp", 1), ("--ep", "ep", 1), ("--cp-comm", "cp_comm", "p2p"),
             ("--ep-overlap", "ep_overlap", False), ("--etp", "etp", None),
             ("--recompute-moe-act", "recompute_moe_act", False))
TOYS = ("mlp", "gpt")
# The architecture an ep row runs when the run names only a toy: routed experts, which ep
# splits (cp splits the toy gpt's sequences as any transformer's).
EXPERT_MODEL = "mixtral-8x7b"


def read_row(path: str, number: int) -> dict:
    """Row ``number`` (1 = the best, as the plan's table numbers them) of a plan JSON."""
    try:
        document = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"--plan {path}: not JSON ({error.msg} at line {error.lineno})") from None
    rows = document.get("ranked") if isinstance(document, dict) else None
    if not isinstance(rows, list):
        raise ConfigError(f"--plan {path}: no \"ranked\" list; write the file with `pipesim plan ... --json {path}`")
    if not rows:
        raise ConfigError(f"--plan {path}: the plan ranked no layout")
    if not 1 <= number <= len(rows):
        raise ConfigError(f"--row {number}: {path} has {len(rows)} ranked rows; use 1 to {len(rows)}")
    row = rows[number - 1]
    check_row_fields(row, f"--plan {path}: row {number}")
    return row


# What a row must give, as ``pipesim plan --json`` writes it (cp and ep: 1 when left out).
ROW_INTEGERS = ("pp", "tp", "dp", "virtual_stages", "microbatch_size", "microbatches", "zero")
ROW_OPTIONAL_INTEGERS = ("cp", "ep")


def check_row_fields(row: object, where: str) -> None:
    """A row an edited or foreign file gives must still be one: an object with the
    schedule and recompute named, and whole numbers where the plan writes them (a
    missing field, NaN or a fraction named in one line, not a traceback)."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected an object, got {type(row).__name__}")
    missing = [name for name in ("schedule", "recompute", "sequence_parallel", *ROW_INTEGERS) if name not in row]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}; write the file with `pipesim plan ... --json`")
    for name in ROW_INTEGERS + tuple(name for name in ROW_OPTIONAL_INTEGERS if name in row):
        value = row[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: {name} must be a whole number, got {value!r}")


def _switch(row: dict, name: str, number: int) -> bool:
    """A row's on-or-off field (off where a row written before it existed leaves it out)."""
    value = row.get(name, False)
    if not isinstance(value, bool):
        raise ConfigError(f"plan row {number}: {name} must be true or false, got {value!r}")
    return value


def _expert_tp(row: dict, number: int) -> int | None:
    """A row's ``etp``: 1 (the experts folded) or None (split over tp: 0, or a row written
    before rows carried it)."""
    value = row.get("etp", 0)
    if isinstance(value, bool) or value not in (0, 1):
        raise ConfigError(f"plan row {number}: etp must be 0 (the experts split over tp) or 1 (folded), got {value!r}")
    return value or None


def planned_model(args: argparse.Namespace, row: dict, number: int) -> str:
    """The model to run: the row's, which a ``--model`` of the run may repeat but not
    change (a config file by any path to it); for a row that names none, the run's (``gpt``
    for the toy ``mlp`` default), and where the row has ep but that is a toy, an
    architecture with routed experts."""
    from pipesim.plan.request import model_reference  # noqa: PLC0415 - how the plan named it

    planned = row.get("model")
    if planned:
        if args.model != "mlp" and model_reference(args.model) != planned:
            raise ConfigError(f"--model {args.model} conflicts with --plan {args.plan}: row {number} was planned for "
                              f"{planned}; drop --model")
        return planned
    model = "gpt" if args.model == "mlp" else args.model
    if model in TOYS and row.get("ep", 1) > 1:
        model = EXPERT_MODEL
    return model


def planned_qkv(args: argparse.Namespace, row: dict, model: str, number: int) -> str:
    """How the run builds Q, K and V: for an architecture the row's (the plan's ``--qkv``),
    which the run's ``--qkv`` may repeat but not change; else (a toy, or a row written
    before rows carried it) the run's own."""
    from executor.architectures.build import is_architecture  # noqa: PLC0415

    given, planned = getattr(args, "qkv", "separate"), row.get("qkv")
    if planned is None or not is_architecture(model):
        return given
    if given not in ("separate", planned):
        raise ConfigError(f"--qkv {given} conflicts with --plan {args.plan}: row {number} was planned with --qkv "
                          f"{planned}; drop --qkv")
    return planned


def planned_clip(args: argparse.Namespace, row: dict, number: int) -> float | None:
    """The norm the run clips to: the run's ``--clip-grad`` where given, else the one
    the plan priced (``clip_grad``, a norm of 0 meaning none; a row written before rows
    carried it: none, the run's default)."""
    given = getattr(args, "clip_grad", None)
    if given is not None:
        return given
    planned = row.get("clip_grad")
    if planned is None:
        return None
    if isinstance(planned, bool) or not isinstance(planned, (int, float)) or not math.isfinite(planned) \
            or planned < 0:
        raise ConfigError(f"--plan {args.plan}: row {number}'s clip_grad {planned!r} is not a norm >= 0")
    return float(planned) or None


def shrunk_model(args: argparse.Namespace, row: dict, model: str) -> dict:
    """``model`` at the run's sizes, raised to what the row's layout needs."""
    cp = row.get("cp", 1)
    sizes = model_sizes(argparse.Namespace(**{**vars(args), "model": model}))  # the flags given, else run's defaults
    tp, stages = row["tp"], row["pp"] * row["virtual_stages"]
    heads = math.lcm(max(sizes["heads"], 1), tp)
    kv_heads = _kv_heads(args, model, heads, tp)
    if kv_heads:  # grouped-query attention: every tp rank holds whole key/value heads, each serving whole groups
        heads = math.lcm(heads, kv_heads)
    head_dim = max(1, sizes["hidden"] // max(sizes["heads"], 1))
    hidden = max(sizes["hidden"], heads * head_dim)
    hidden += -hidden % heads
    # cp cuts a sequence into 2 cp chunks; sequence parallelism splits a rank's S / cp tokens over tp.
    split = tp if row.get("sequence_parallel") else 1
    step = math.lcm(2 * cp, cp * split)
    seq_len = sizes["seq_len"] + -sizes["seq_len"] % step
    return {"model": model, "layers": max(sizes["layers"], stages), "hidden": hidden, "heads": heads,
            **({"kv_heads": kv_heads} if kv_heads else {}), "seq_len": seq_len, "vocab": sizes["vocab"]}


def _kv_heads(args: argparse.Namespace, model: str, heads: int, tp: int) -> int | None:
    """An architecture's key/value heads at ``heads`` query heads (the run's ``--kv-heads``,
    else the original's grouping), raised to a multiple of ``tp``; None for the toys and
    latent attention (every head its own keys and values)."""
    from executor.architectures.build import full_spec, is_architecture, kv_heads_like

    if not is_architecture(model):
        return None
    full = full_spec(model)
    if full.mla:
        return None
    return math.lcm(getattr(args, "kv_heads", None) or kv_heads_like(full, heads), tp)


def config_from_plan_row(args: argparse.Namespace) -> tuple[RunConfig, str]:
    """The checked ``RunConfig`` of ``--plan``'s row ``--row``, and the line that says
    what was kept and what was shrunk."""
    for flag, name, unset in ROW_FIXES:
        if getattr(args, name, unset) != unset:
            raise ConfigError(f"{flag} conflicts with --plan {args.plan}: the plan's row fixes the schedule, pp, "
                              "microbatches, virtual stages, dp, tp, cp, ep, etp, ZeRO, recompute (the experts' "
                              f"activation's too), sequence parallelism, combined 1F1B and the batch; drop {flag}")
    number = args.row
    row = read_row(args.plan, number)
    model = shrunk_model(args, row, planned_model(args, row, number))
    model["qkv"] = planned_qkv(args, row, model["model"], number)
    fixed = {"schedule": row["schedule"], "pp": row["pp"], "microbatches": row["microbatches"],
             "virtual_stages": row["virtual_stages"], "microbatch_group": row.get("microbatch_group"),
             "dp": row["dp"], "tp": row["tp"], "zero": row["zero"],
             "recompute": row["recompute"], "sequence_parallel": bool(row["sequence_parallel"]),
             "batch_size": row["dp"] * row["microbatches"] * row["microbatch_size"],
             "cp": row.get("cp", 1), "ep": row.get("ep", 1),
             "cp_comm": "p2p",  # the ring, as plan priced cp
             "ep_overlap": _switch(row, "ep_overlap", number),  # combined 1F1B, as the plan simulated it
             "etp": _expert_tp(row, number),  # the experts folded (1) or split over tp
             "clip_grad": planned_clip(args, row, number),
             # the experts' activation recomputed, as every layout of the plan was priced
             "recompute_moe_act": _switch(row, "recompute_moe_act", number)}
    if row.get("order") is not None:  # the order the plan built from its costs, run as simulated
        fixed["custom_schedule"] = order_from_dict(row["order"], f"plan row {number}'s order")
    planned = argparse.Namespace(**{**vars(args), **fixed, **model})
    refused = value_refusal(planned, "pipesim run", "run")  # a value the plan simulated but run does not execute
    if refused:
        raise ConfigError(f"plan row {number} ({row.get('layout', '')}): {refused}")
    try:
        config = config_from_args(planned)
    except ConfigError as error:
        raise ConfigError(f"plan row {number} ({row.get('layout', '')}): {error}") from None
    line = (f"plan row {number}: {row.get('layout', '')} kept (world {config.world_size}, global batch "
            f"{config.batch_size}); model shrunk to {model['model']} with {model['layers']} layers, hidden "
            f"{model['hidden']}, {model['heads']} heads, seq-len {model['seq_len']}, vocab {model['vocab']}"
            + ("" if row.get("model") else " (the plan's rows do not name its model: the run's --model"
               + ("; the toy gpt has no routed experts to split" if args.model in TOYS and config.ep > 1 else "")
               + ")")
            + (f"; cp {config.cp} by ring attention" if config.cp > 1 else "")
            + (f"; gradients clipped to {config.clip_grad:g}"
               + (" as the plan priced" if getattr(args, "clip_grad", None) is None else "")
               if config.clip_grad is not None else "")
            + ("; its order as the plan built it from the layout's costs" if row.get("order") is not None else ""))
    return config, line
