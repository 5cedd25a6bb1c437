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
from benchmarks.zero_bubble_layouts import (  # noqa: E402
    MAIN_SETUPS,
    V_SETUPS,
    ZeroBubbleLayout,
    few_microbatch_layouts,
    first_count_layouts,
    simulate_json,
)


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


TABLE_8 = "Qi et al. 2024, Table 8 (1F1B, microbatch doubled)"
TABLE_9 = "Qi et al. 2024, Table 9 (1F1B, m <= p)"
ROWS = tuple(
    MemoryRow(layout, gb, source) for layouts, figures, source in (
        (first_count_layouts(MAIN_SETUPS, "1F1B"), (30, 39, 32, 43), MemoryRow.source),
        (first_count_layouts(MAIN_SETUPS, "1F1B", microbatch_size_scale=2), (57, 66, 50, 72), TABLE_8),
        (few_microbatch_layouts("1F1B"), (11, 18, 29, 21, 28, 39, 19, 24, 32), TABLE_9),
    ) for layout, gb in zip(layouts, figures, strict=True))


ZB_V_TABLE = "Qi et al. 2024 (with ZB-V), Table 6"


def schedule_rows() -> tuple[MemoryRow, ...]:
    """Every measured peak of the paper's other schedules (GB as the paper prints them): one
    figure for a setup's microbatch counts (its Tables 4 and 6), taken at the first; the
    microbatch doubled, ZB-1p (its ZB-2p rows are Table 4's); m <= p, ZB-2p (there ZB-1p as
    well, the paper says); ZB-2p* at half the microbatch and twice the count (63, 64, 65 GB
    for the 6.2B setup's three counts: the first taken)."""
    table_4, doubled, few = "Qi et al. 2024, Table 4", "Qi et al. 2024, Table 8 (microbatch doubled)", \
        "Qi et al. 2024, Table 9 (m <= p)"
    groups = [
        (first_count_layouts(MAIN_SETUPS, "ZB-1p"), (32, 42, 33, 44), table_4),
        (first_count_layouts(MAIN_SETUPS, "ZB-2p"), (59, 70, 51, 74), table_4),
        (first_count_layouts(MAIN_SETUPS, "1F1B-I"), (40, 48, 39, 58), table_4),
        (first_count_layouts(MAIN_SETUPS, "ZB-1p", microbatch_size_scale=2), (61, 71, 51, 74), doubled),
        (few_microbatch_layouts("ZB-2p"), (12, 19, 34, 21, 29, 44, 20, 24, 33), few),
        (first_count_layouts(V_SETUPS, "ZB-V"), (64, 45, 71), ZB_V_TABLE),
        (first_count_layouts(V_SETUPS, "ZB-1p"), (62, 46, 73), ZB_V_TABLE),
        (first_count_layouts(V_SETUPS, "1F1B"), (61, 44, 69), ZB_V_TABLE),
        (first_count_layouts(V_SETUPS, "ZB-2p*", microbatch_size_scale=0.5, count_scale=2), (63, 45, 72), ZB_V_TABLE),
    ]
    return tuple(MemoryRow(layout, gb, source) for layouts, figures, source in groups
                 for layout, gb in zip(layouts, figures, strict=True))


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
