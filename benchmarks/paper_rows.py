"""The zero-bubble paper's rows (``benchmarks/data/zero_bubble``): each configuration's
profiled times, the paper's bubble rates where they are published here, and pipesim's
rates for the same schedule classes, computed the paper's way on the engine.

Shared by ``bench_zero_bubble.py`` (the side-by-side table) and the tests that hold
pipesim to the published rows.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from schedules import engine
from schedules.generators import generate, zb_auto
from schedules.generators.adaptive import adapt
from schedules.lowering import lower
from schedules.p2p import RENDEZVOUS
from schedules.schedule import Schedule

DATA = Path(__file__).resolve().parent / "data" / "zero_bubble"
# the paper's Table 5 columns, and the schedule pipesim runs for each
COLUMNS = ("1F1B", "1F1B-I", "ZB-H1", "ZB-H2", "ZB-1p", "ZB-2p")
# Between I and W the paper's transformers keep the inputs of their matrix products,
# 32h of 34h + 5as per token and layer (its Table 1): about 0.4 for its models. Every
# share from 0.25 to 0.5 gives the same orders on the published rows.
PAPER_WEIGHT_MEMORY = 0.4
# The paper's models (its Table 3): 22, 30, 46 and 62 layers, hidden 2304 / 4096 / 5120 /
# 6144 (12 L h^2 gives 1.4B, 6.0B, 14.5B and 28.1B before the embeddings). Each is k p - 2
# layers for its p, as the paper's repository recommends with --allow-padding-num-layers
# (one layer fewer on the first and last stage), and its 1F1B-I runs one layer per virtual
# stage (--num-layers-per-virtual-pipeline-stage 1 in examples/pretrain_zero_bubble.sh): k
# = (L + 2) / p chunks per rank, an input here, not fitted.
MODEL_LAYERS = {"1.5B": 22, "6.2B": 30, "14.6B": 46, "28.3B": 62}


@dataclass(frozen=True)
class Row:
    """One configuration: per-stage ms, pipeline size, microbatches, and the paper's
    rates by column (empty when held out)."""

    model: str
    pp: int
    microbatches: int
    forward: float
    backward_input: float
    backward_weight: float
    comm: float
    paper: dict[str, float]

    @property
    def label(self) -> str:
        return f"{self.model} p{self.pp} m{self.microbatches}"

    @property
    def interleaved_chunks(self) -> int:
        """1F1B-I's chunks per rank: the model's layers per stage, with the first and
        last stage's missing layer counted (``MODEL_LAYERS``)."""
        return (MODEL_LAYERS[self.model] + 2) // self.pp


def rows() -> list[Row]:
    """Every profiled row, with the paper's rates where Table 5 is here."""
    with open(DATA / "table5_bubble_rates.csv") as handle:
        published = {(r["model"], int(r["p"]), int(r["m"])): {c: float(r[c]) for c in COLUMNS}
                     for r in csv.DictReader(handle)}
    with open(DATA / "table9_profiled.csv") as handle:
        return [Row(r["model"], int(r["p"]), int(r["m"]), float(r["TF_ms"]), float(r["TB_ms"]), float(r["TW_ms"]),
                    float(r["Tcomm_ms"]), published.get((r["model"], int(r["p"]), int(r["m"])), {}))
                for r in csv.DictReader(handle)]


def timing(row: Row, schedule: Schedule) -> engine.StepTiming:
    """The row's costs for ``schedule``: each of a rank's ``v`` chunks costs 1/v of the
    stage, every hop between ranks ``Tcomm``."""
    chunks = schedule.num_stages // schedule.pp
    forward, backward_input, backward_weight = (value / chunks for value in
                                                (row.forward, row.backward_input, row.backward_weight))
    table = np.tile(np.array([forward, backward_input + backward_weight, backward_input, backward_weight]),
                    (schedule.num_stages, 1))
    hops = [row.comm if schedule.placement[stage] != schedule.placement[stage + 1] else 0.0
            for stage in range(schedule.num_stages - 1)]
    return engine.StepTiming(table, wires=engine.hop_wires(schedule.num_stages, hops))


def schedule_for(row: Row, column: str, search_seconds: float | None = None) -> Schedule:
    """pipesim's schedule for one of the paper's columns on this row."""
    pp, microbatches = row.pp, row.microbatches
    if column == "1F1B":
        return generate("1f1b", pp, microbatches)
    if column == "1F1B-I":
        return generate("interleaved-1f1b", pp, microbatches, row.interleaved_chunks)
    if column in ("ZB-H1", "ZB-H2"):
        textbook = generate(column.lower(), pp, microbatches)
        return adapt(textbook, timing(row, textbook))
    limit = pp if column == "ZB-1p" else 2 * pp
    extra = {} if search_seconds is None else {"search_seconds": search_seconds}
    return zb_auto(pp, microbatches, row.forward, row.backward_input, row.backward_weight, row.comm, limit,
                   weight_memory=PAPER_WEIGHT_MEMORY, **extra)


def bubble_rate(step: engine.StepRun, row: Row) -> float:
    """The paper's rate: (longest rank span - m (F + I + W)) / that span."""
    span = float(step.rank_spans().max())
    return (span - row.microbatches * (row.forward + row.backward_input + row.backward_weight)) / span


def rates(row: Row, schedule: Schedule) -> tuple[float, float, float]:
    """(rate under rendezvous with the cost-aware lowering, rate with free-flowing
    transfers, rendezvous step / free-flowing step) of ``schedule`` on ``row``."""
    step_timing = timing(row, schedule)
    free = engine.run(schedule, step_timing, engine.FREE)
    nccl = engine.run(lower(schedule, step_timing), step_timing, RENDEZVOUS)
    return bubble_rate(nccl, row), bubble_rate(free, row), nccl.makespan / free.makespan
