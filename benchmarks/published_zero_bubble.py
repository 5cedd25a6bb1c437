"""Predicted against measured throughput of the zero-bubble schedules: what ``pipesim
simulate`` says each of the zero-bubble paper's runs trains a second, beside what the
paper measured on its A100s, with no calibration (the A100's compute model).

Source (figures transcribed from the paper): Qi et al., "Zero Bubble Pipeline
Parallelism", arXiv:2401.10241 (the version with ZB-V), samples per GPU per second:

- Table 4: 1.5B, 6.2B, 14.6B and 28.3B on 8, 8, 16 and 32 GPUs (microbatch 6, 3, 1, 1),
  three microbatch counts each, under ZB-2p, ZB-1p, 1F1B and 1F1B-I;
- Table 6: 6.2B, 14.6B and 28.3B on 16, 24 and 32 GPUs (microbatch 6, 2, 2), under ZB-V,
  ZB-2p* (half the microbatch, twice the microbatches), ZB-1p and 1F1B;
- Table 12 (the ICLR version's Table 9, whose peaks ``published_memory.py`` compares): the
  1.5B, 6.2B and 14.6B setups at m <= p (2, 4, 8; 4, 8, 16), under 1F1B and ZB-2p.

The layouts and what is assumed about them: ``benchmarks/zero_bubble_layouts.py``. Two
errors per row: of the throughput itself (the compute model's and the links' as well as
the schedule's), and of the schedule's speed-up over 1F1B on the same setup (the
prediction's ratio against the paper's), which the compute model's bias cancels out of:
that is what a user choosing a schedule asks.

What the paper ran that pipesim does not model: ZB-1p and ZB-2p replace the optimizer's
synchronisation (the global gradient norm and the NaN check, an all-reduce over the
pipeline before the step) with a check after it, rolled back when it fails (its
"optimizer post-validation": with the synchronisation ZB-2p ran 7% to 10% slower, its
Table 10); pipesim has no such synchronisation in any schedule.

Beside them, the passes themselves: the paper's Table 9 profiled, per setup, one stage's
forward ``T_F``, input gradient ``T_B`` and weight gradient ``T_W`` and a hop ``T_comm``
(``benchmarks/data/zero_bubble``); pipesim's compute model prices a middle stage (the
stages with all ``k`` layers; the paper does not say which stage it profiled) and its
links the hop (a boundary activation over the route between two neighbours).

In-sample and held out: transcribed and first run on 2026-12-06, the compute model, the
links and the schedules as they stood; nothing was changed after. Every row is held out.
The paper's profiled stage times (its Table 9) are not used here (``bench_zero_bubble.py``
computes its bubble rates from them).

Run: ``python benchmarks/published_zero_bubble.py``.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo's root

from benchmarks.paper_rows import rows as profiled_rows  # noqa: E402
from benchmarks.zero_bubble_layouts import (  # noqa: E402
    MAIN_SETUPS,
    V_SETUPS,
    ZeroBubbleLayout,
    few_microbatch_layouts,
    simulate_json,
)

TABLE_4, TABLE_6 = "Qi et al. 2024, Table 4", "Qi et al. 2024 (with ZB-V), Table 6"
TABLE_12 = "Qi et al. 2024 (with ZB-V), Table 12 (m <= p)"
# samples per GPU per second, per setup in the order of MAIN_SETUPS / V_SETUPS, per microbatch count
TABLE_4_MEASURED = {
    "ZB-2p": ((14.5, 14.8, 14.9), (4.32, 4.35, 4.39), (1.81, 1.83, 1.85), (0.99, 1.00, 1.00)),
    "ZB-1p": ((12.9, 13.4, 14.2), (3.88, 4.00, 4.20), (1.61, 1.67, 1.76), (0.87, 0.90, 0.96)),
    "1F1B": ((11.8, 12.5, 13.6), (3.50, 3.70, 4.03), (1.40, 1.49, 1.64), (0.76, 0.80, 0.88)),
    "1F1B-I": ((13.1, 13.4, 13.9), (4.01, 4.08, 4.19), (1.54, 1.59, 1.66), (0.82, 0.85, 0.90)),
}
TABLE_6_MEASURED = {
    "ZB-V": ((4.15, 4.21, 4.35), (1.85, 1.88, 1.93), (1.01, 1.02, 1.06)),
    "ZB-2p*": ((4.36, 4.37, 4.45), (1.84, 1.84, 1.85), (1.00, 1.00, 1.01)),
    "ZB-1p": ((3.87, 4.00, 4.29), (1.72, 1.78, 1.89), (0.94, 0.97, 1.03)),
    "1F1B": ((3.38, 3.57, 3.91), (1.52, 1.61, 1.76), (0.82, 0.87, 0.95)),
}

# Table 12: the first three setups at m <= p (zero_bubble_layouts.FEW_MICROBATCHES), in
# few_microbatch_layouts' order
TABLE_12_MEASURED = {"1F1B": (3.56, 5.74, 8.26, 1.04, 1.69, 2.45, 0.39, 0.65, 0.95),
                     "ZB-2p": (4.25, 6.92, 9.90, 1.33, 2.16, 3.07, 0.52, 0.85, 1.25)}


@dataclass(frozen=True)
class ThroughputRow:
    """What the paper measured one layout to train, samples per GPU per second."""

    layout: ZeroBubbleLayout
    measured: float
    source: str
    baseline: float  # the paper's 1F1B on the same setup and microbatch count


def rows() -> list[ThroughputRow]:
    """Every measured throughput: Table 4's, Table 6's, then Table 12's, in the tables' order."""
    found = []
    for setups, measured, source in ((MAIN_SETUPS, TABLE_4_MEASURED, TABLE_4), (V_SETUPS, TABLE_6_MEASURED, TABLE_6)):
        for schedule, figures in measured.items():
            for (model, layers, heads, hidden, pp, b, counts), per_count, baselines in zip(
                    setups, figures, measured["1F1B"], strict=True):
                for m, value, baseline in zip(counts, per_count, baselines, strict=True):
                    layout = ZeroBubbleLayout(model, layers, heads, hidden, pp, b, m, schedule)
                    if schedule == "ZB-2p*":  # the same global batch at half the microbatch
                        layout = replace(layout, microbatch_size=b // 2, microbatches=2 * m)
                    found.append(ThroughputRow(layout, value, source, baseline))
    for schedule, figures in TABLE_12_MEASURED.items():
        found += [ThroughputRow(layout, value, TABLE_12, baseline) for layout, value, baseline in zip(
            few_microbatch_layouts(schedule), figures, TABLE_12_MEASURED["1F1B"], strict=True)]
    return found


def predicted_throughput(layout: ZeroBubbleLayout) -> float:
    """Samples per GPU per second of ``pipesim simulate``'s step for the layout."""
    step = simulate_json(layout)["makespan"]
    return layout.samples / step / layout.pp


def predicted_passes(layout: ZeroBubbleLayout) -> tuple[float, float, float]:
    """A middle stage's forward, input-gradient and weight-gradient seconds in
    ``pipesim simulate``'s costs for the layout (``bwd`` is I + W)."""
    stage = simulate_json(layout)["stage_costs"][1]
    return stage["fwd"], stage["bwd"] - stage["wgrad"], stage["wgrad"]


def pass_lines() -> list[str]:
    """The paper's profiled passes (its Table 9) beside pipesim's, per setup."""
    setups = {model: (layers, heads, hidden, b) for model, layers, heads, hidden, _, b, _ in MAIN_SETUPS}
    lines = ["| setup | T_F paper / pipesim (ms) | error | T_B (I) | error | T_W | error | T_B + T_W | error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    errors: dict[str, list[float]] = {"F": [], "I": [], "W": [], "I + W": []}
    for row in profiled_rows():
        layers, heads, hidden, b = setups[row.model]
        ours = [1e3 * value for value in predicted_passes(
            ZeroBubbleLayout(row.model, layers, heads, hidden, row.pp, b, row.microbatches, "ZB-2p"))]
        pairs = [(row.forward, ours[0]), (row.backward_input, ours[1]), (row.backward_weight, ours[2]),
                 (row.backward_input + row.backward_weight, ours[1] + ours[2])]
        cells = []
        for name, (theirs, mine) in zip(errors, pairs, strict=True):
            errors[name].append(mine / theirs - 1)
            cells.append(f"{theirs:.2f} / {mine:.2f} | {errors[name][-1]:+.1%}")
        lines.append(f"| {row.label} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"pass {name}: median error {statistics.median(values):+.1%}, from {min(values):+.1%} to "
              f"{max(values):+.1%} over {len(values)} setups" for name, values in errors.items()]
    return lines


def main() -> None:
    table = rows()
    predicted = {row.layout: predicted_throughput(row.layout) for row in table}
    baseline_of = {(row.source, row.layout.model, row.layout.pp, row.layout.samples): predicted[row.layout]
                   for row in table if row.layout.schedule == "1F1B"}
    print("| source | run | GPUs | measured | predicted | error | speed-up over 1F1B: measured | predicted | error "
          "| sample |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    errors, speedup_errors = [], []
    for row in table:
        value = predicted[row.layout]
        error = value / row.measured - 1
        errors.append(error)
        cells = ["", "", ""]
        if row.layout.schedule != "1F1B":
            ours = value / baseline_of[row.source, row.layout.model, row.layout.pp, row.layout.samples]
            theirs = row.measured / row.baseline
            speedup_errors.append(ours / theirs - 1)
            cells = [f"{theirs:.3f}", f"{ours:.3f}", f"{speedup_errors[-1]:+.1%}"]
        print(f"| {row.source} | {row.layout.label} | {row.layout.pp} | {row.measured:g} | {value:.3g} | "
              f"{error:+.1%} | " + " | ".join(cells) + " | held out |")
    print()
    for name, values in (("throughput", errors), ("speed-up over 1F1B", speedup_errors)):
        magnitudes = [abs(value) for value in values]
        print(f"{name}: median |error| {statistics.median(magnitudes):.1%}, worst {max(magnitudes):.1%} "
              f"over {len(values)} rows")
    for schedule in ("ZB-2p", "ZB-1p", "1F1B-I", "ZB-V", "ZB-2p*"):
        pairs = [(row.measured / row.baseline, predicted[row.layout] / baseline_of[
            row.source, row.layout.model, row.layout.pp, row.layout.samples]) for row in table
            if row.layout.schedule == schedule]
        print(f"{schedule} over 1F1B: measured {statistics.median(p[0] for p in pairs):.3f}, predicted "
              f"{statistics.median(p[1] for p in pairs):.3f} (medians over {len(pairs)} runs)")
    print(f"equivalent command ({table[0].layout.label}): `{table[0].layout.command()}`")
    print()
    print("\n".join(pass_lines()))


if __name__ == "__main__":
    main()
