"""Predicted against published per-GPU peak memory: what ``pipesim simulate`` says a rank
peaks at, beside what a paper measured on the GPUs that ran the layout.

Source (figures transcribed from the paper's table):

- Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024 (arXiv:2401.10241), the
  "Memory (GB)" of every 1F1B row: Table 4 (GPT-3-like models of 1.5B, 6.2B, 14.6B and
  28.3B parameters, Table 3: layers, heads, hidden; sequence 1024; microbatch size 6, 3, 1,
  1 on 8, 8, 16 and 32 A100 SXM 80 GB; one figure for its three microbatch counts, as
  1F1B's peak does not grow with m), Table 8 (the microbatch size doubled) and Table 9
  (m <= p). Pipeline parallelism only (one GPU per stage), Megatron-LM's 1F1B, the first
  and last stages one transformer layer fewer than the others (section 5.1).
  Not in the paper, assumed here: Megatron's GPT vocabulary 51,200 with tied embeddings,
  mixed-precision Adam (2 + 2 + 12 bytes per parameter), dropout, no flash attention (the
  paper's Table 1 counts the ``5as`` attention scores), no recompute.

And the same tables' rows of the paper's other schedules (``schedule_rows``): ZB-1p and
ZB-2p (pipesim's zb-auto at ``--memory-limit`` p and 2p, whose orders count the share of
a stash a layer keeps between I and W, the matrix products' inputs and output gradients)
and 1F1B-I (one transformer layer a chunk, as the paper's section 5.1 says, the first
chunk the embedding alone and the last the output layer alone), and the ZB-V comparison
of the paper's version with ZB-V (its Table 6: ZB-V, ZB-1p, 1F1B and ZB-2p* at half the
microbatch, 6.2B to 28.3B on 16 to 32 GPUs). Each is run as ``pipesim simulate`` runs it,
the command printed; the fullest rank's peak is compared.

The usable column is what the fullest rank's A100 (81920 MiB) leaves it by the headroom
rule (``pipesim.sim.headroom``): every layout ran, and every predicted peak is under it.

In-sample and held out: the memory model (``pipesim.sim.memory``, the activation inventory
of ``pipesim.model.activations``) was written before these rows were first run, and
nothing was changed after: every row is held out. The other schedules' rows were
transcribed and first run on 2026-12-06, with zb-auto's and zbv-auto's orders and the
kept share as they stood; nothing was changed after either. The paper says GB; if it meant GiB, each
figure is 7.4% larger than read here.

Run: ``python benchmarks/published_memory.py``.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo's root

from benchmarks.published import Prediction, Run, command_line, gpt, predict  # noqa: E402
from benchmarks.zero_bubble_layouts import MAIN_SETUPS, V_SETUPS, ZeroBubbleLayout, simulate_json  # noqa: E402


@dataclass(frozen=True)
class MemoryRow:
    """A peak the paper measured per GPU for one of its layouts
    (``benchmarks.zero_bubble_layouts``)."""

    layout: ZeroBubbleLayout
    measured_gb: float
    source: str = "Qi et al. 2024, Table 4 (1F1B)"

    def run(self) -> Run:
        """A 1F1B layout as ``benchmarks.published`` simulates it: first and last stage a
        layer short, sequence 1024, one GPU per stage."""
        layout = self.layout
        if layout.schedule != "1F1B":
            raise ValueError(f"{layout.label}: benchmarks.published runs 1F1B rows; run the others with "
                             "predict_schedule_memory")
        spec = replace(gpt(f"gpt-{layout.model}", layout.layers, layout.hidden, layout.heads), seq_len=1024,
                       microbatch_size=layout.microbatch_size)
        return Run(f"{layout.model} p{layout.pp} m{layout.microbatches} b{layout.microbatch_size}", spec, 1,
                   layout.pp, 1, layout.samples, 1.0, recompute="none", microbatch_size=layout.microbatch_size,
                   gpu="a100-80gb", layers_per_stage=layout.layers_per_stage(), in_sample=False)


def one_f_one_b(model: str, layers: int, heads: int, hidden: int, pp: int, microbatch_size: int, microbatches: int,
                measured_gb: float, source: str = MemoryRow.source) -> MemoryRow:
    """A 1F1B row of the paper's tables."""
    return MemoryRow(ZeroBubbleLayout(model, layers, heads, hidden, pp, microbatch_size, microbatches, "1F1B"),
                     measured_gb, source)


TABLE_8 = "Qi et al. 2024, Table 8 (1F1B, microbatch doubled)"
TABLE_9 = "Qi et al. 2024, Table 9 (1F1B, m <= p)"
ROWS = (
    one_f_one_b("1.5B", 22, 24, 2304, 8, 6, 24, 30),
    one_f_one_b("6.2B", 30, 32, 4096, 8, 3, 24, 39),
    one_f_one_b("14.6B", 46, 40, 5120, 16, 1, 48, 32),
    one_f_one_b("28.3B", 62, 48, 6144, 32, 1, 96, 43),
    one_f_one_b("1.5B", 22, 24, 2304, 8, 12, 24, 57, TABLE_8),
    one_f_one_b("6.2B", 30, 32, 4096, 8, 6, 24, 66, TABLE_8),
    one_f_one_b("14.6B", 46, 40, 5120, 16, 2, 48, 50, TABLE_8),
    one_f_one_b("28.3B", 62, 48, 6144, 32, 2, 96, 72, TABLE_8),
    one_f_one_b("1.5B", 22, 24, 2304, 8, 6, 2, 11, TABLE_9),
    one_f_one_b("1.5B", 22, 24, 2304, 8, 6, 4, 18, TABLE_9),
    one_f_one_b("1.5B", 22, 24, 2304, 8, 6, 8, 29, TABLE_9),
    one_f_one_b("6.2B", 30, 32, 4096, 8, 3, 2, 21, TABLE_9),
    one_f_one_b("6.2B", 30, 32, 4096, 8, 3, 4, 28, TABLE_9),
    one_f_one_b("6.2B", 30, 32, 4096, 8, 3, 8, 39, TABLE_9),
    one_f_one_b("14.6B", 46, 40, 5120, 16, 1, 4, 19, TABLE_9),
    one_f_one_b("14.6B", 46, 40, 5120, 16, 1, 8, 24, TABLE_9),
    one_f_one_b("14.6B", 46, 40, 5120, 16, 1, 16, 32, TABLE_9),
)


ZB_V_TABLE = "Qi et al. 2024 (with ZB-V), Table 6"


def schedule_rows() -> tuple[MemoryRow, ...]:
    """Every measured peak of the paper's other schedules (GB as the paper prints them): one
    figure for a setup's microbatch counts (its Tables 4 and 6), taken at the first."""
    rows = []
    table_4 = "Qi et al. 2024, Table 4"
    main = [(model, layers, heads, hidden, pp, b, counts[0]) for model, layers, heads, hidden, pp, b, counts
            in MAIN_SETUPS]
    for schedule, measured in (("ZB-1p", (32, 42, 33, 44)), ("ZB-2p", (59, 70, 51, 74)),
                               ("1F1B-I", (40, 48, 39, 58))):
        rows += [MemoryRow(ZeroBubbleLayout(*setup, schedule), gb, table_4)
                 for setup, gb in zip(main, measured, strict=True)]
    # the microbatch doubled (ZB-1p; its ZB-2p rows are Table 4's)
    rows += [MemoryRow(ZeroBubbleLayout(model, layers, heads, hidden, pp, 2 * b, m, "ZB-1p"), gb,
                       "Qi et al. 2024, Table 8 (microbatch doubled)")
             for (model, layers, heads, hidden, pp, b, m), gb in zip(main, (61, 71, 51, 74), strict=True)]
    # m <= p (ZB-2p; with m <= p it is ZB-1p as well, the paper says)
    for (model, layers, heads, hidden, pp, b, _), counts, measured in zip(
            main[:3], ((2, 4, 8), (2, 4, 8), (4, 8, 16)), ((12, 19, 34), (21, 29, 44), (20, 24, 33)), strict=True):
        rows += [MemoryRow(ZeroBubbleLayout(model, layers, heads, hidden, pp, b, m, "ZB-2p"), gb,
                           "Qi et al. 2024, Table 9 (m <= p)")
                 for m, gb in zip(counts, measured, strict=True)]
    # the ZB-V comparison (ZB-2p*: 63, 64, 65 GB for the 6.2B row's three m; the first taken)
    v_setups = [(model, layers, heads, hidden, pp, b, counts[0]) for model, layers, heads, hidden, pp, b, counts
                in V_SETUPS]
    for schedule, measured in (("ZB-V", (64, 45, 71)), ("ZB-1p", (62, 46, 73)), ("1F1B", (61, 44, 69))):
        rows += [MemoryRow(ZeroBubbleLayout(*setup, schedule), gb, ZB_V_TABLE)
                 for setup, gb in zip(v_setups, measured, strict=True)]
    rows += [MemoryRow(ZeroBubbleLayout(model, layers, heads, hidden, pp, b // 2, 2 * m, "ZB-2p*"), gb,
                               ZB_V_TABLE)
             for (model, layers, heads, hidden, pp, b, m), gb in zip(v_setups, (63, 45, 72), strict=True)]
    return tuple(rows)


def predict_schedule_memory(row: MemoryRow) -> dict:
    """The fullest rank of ``pipesim simulate``'s ``--json`` for the row: its ``memory``
    parts and ``peak_memory_bytes``."""
    return max(simulate_json(row.layout)["ranks"], key=lambda rank: rank["peak_memory_bytes"])


def schedule_table() -> tuple[list[str], list[float]]:
    """The comparison of the other schedules' rows and their errors."""
    lines = ["| source | run | GPUs | measured (GB) | predicted peak (GB) | static + buffers + stash | error "
             "| usable (GB) | sample |", "|---|---|---:|---:|---:|---|---:|---:|---|"]
    errors = []
    for row in schedule_rows():
        rank = predict_schedule_memory(row)
        memory = rank["memory"]
        errors.append(rank["peak_memory_bytes"] / (row.measured_gb * 1e9) - 1)
        lines.append(f"| {row.source} | {row.layout.label} | {row.layout.pp} | {row.measured_gb:.0f} | "
                     f"{rank['peak_memory_bytes'] / 1e9:.1f} | {memory['static_bytes'] / 1e9:.1f} + "
                     f"{memory['buffer_bytes'] / 1e9:.2f} + {memory['peak_stash_bytes'] / 1e9:.1f} | "
                     f"{errors[-1]:+.1%} | {memory['usable_bytes'] / 1e9:.1f} | held out |")
    return lines, errors


def predict_memory(row: MemoryRow) -> Prediction:
    """The simulated step of ``row`` with its fullest rank's memory."""
    return predict(row.run(), None, with_memory=True)


def error(row: MemoryRow, prediction: Prediction) -> float:
    """Relative error of the predicted peak against the measured one (GB = 1e9 bytes)."""
    return prediction.peak_bytes / (row.measured_gb * 1e9) - 1


def table() -> tuple[list[str], list[float]]:
    """The comparison table and the errors of its rows."""
    lines = ["| source | run | GPUs | measured (GB) | predicted peak (GB) | static + buffers + stash | error "
             "| usable (GB) | sample |", "|---|---|---:|---:|---:|---|---:|---:|---|"]
    errors = []
    for row in ROWS:
        prediction = predict_memory(row)
        errors.append(error(row, prediction))
        lines.append(f"| {row.source} | {row.run().label} | {row.layout.pp} | {row.measured_gb:.0f} | "
                     f"{prediction.peak_bytes / 1e9:.1f} | {prediction.static_bytes / 1e9:.1f} + "
                     f"{prediction.buffer_bytes / 1e9:.2f} + {prediction.stash_bytes / 1e9:.1f} | "
                     f"{errors[-1]:+.1%} | {prediction.usable_bytes / 1e9:.1f} | held out |")
    return lines, errors


def main() -> None:
    lines, errors = table()
    print("\n".join(lines))
    magnitudes = [abs(value) for value in errors]
    print(f"\nper-GPU peak memory: median |error| {statistics.median(magnitudes):.1%}, worst {max(magnitudes):.1%} "
          f"over {len(errors)} rows")
    print(f"equivalent command ({ROWS[0].run().label}): `{command_line(ROWS[0].run(), None)}`")
    lines, errors = schedule_table()
    print("\n" + "\n".join(lines))
    magnitudes = [abs(value) for value in errors]
    print(f"\nthe other schedules: median |error| {statistics.median(magnitudes):.1%}, worst {max(magnitudes):.1%} "
          f"over {len(errors)} rows")
    first = schedule_rows()[0].layout
    print(f"equivalent command ({first.label}): `{first.command()}`")


if __name__ == "__main__":
    main()
