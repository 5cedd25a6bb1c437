"""Zero-bubble and V-shaped schedules side by side: simulated bubbles, ours against the
orders torch.distributed.pipelining builds for the same schedule class.

For each case (F, I, W, T_comm per rank, p, m) every schedule is simulated with the
same costs on a cluster whose hops take exactly T_comm (unlimited bandwidth, so transfers
never queue). Columns:
  step bubble  1 - compute / (p x makespan): the number pipesim reports for one step
  rank bubble  the zero-bubble paper's rate: (longest per-rank span - m(F+I+W)) / span,
               i.e. with the step's lead-in hidden by the next step (optimizer
               post-validation, Qi et al. 2024)
  peak         most microbatch stashes held by a rank (its whole share of the model)
  makespan     step time in the papers' transfer model (sent when produced, awaited when
               needed, sends never wait)
  nccl         step time as ``pipesim simulate`` predicts it for NCCL: ``lower``'s P2P
               groups, placed with the step's own costs (``lower(schedule, timing)``),
               under rendezvous semantics (what posting transfers in groups costs shows
               as the gap to ``makespan``)
  vs torch     our makespan / the makespan of torch's own order for the class
               (ScheduleInterleavedZeroBubble for zb-h1, zb-auto and interleaved-zb,
               ScheduleZBVZeroBubble, ScheduleLoopedBFS, ScheduleInterleaved1F1B,
               ScheduleDualPipeV), built from torch's schedule classes in this run.

Measured step times: ``bench_zero_bubble_measured.py`` profiles, runs (gloo, 4 ranks)
and predicts zb-h1, zbv and 1f1b on a gpt and prints measured beside predicted; its
``--json`` (a list of ``{"schedule", "pp", "microbatches", "step_time", ...}``), or any
such list, passed with ``--measured FILE`` shows each matching measured time here too.

Before those cases, the zero-bubble paper's own rows (``benchmarks/data/zero_bubble``,
``paper_rows.py``): per row and column of its Table 5, the paper's bubble rate, ours
under rendezvous (NCCL's rule, transfers placed by the cost-aware lowering), ours with
free-flowing transfers (the same order), torch's order for the class with free-flowing
transfers, and the rendezvous / free-flowing step ratio; the 14.6B and 28.3B rows are
held out (no published rate here). Then the ratio for every generator on the rows and on
harder costs (hop time close to a chunk's compute), and on small cases (p <= 4, m <= 8)
that ratio beside a CP-SAT lower bound on the best rendezvous-safe program of the same
order over the free-flowing step (``schedules.rendezvous_bound``): a bound above 1.01 is a
gap NCCL's rule forces whatever the placement.

Run: ``python benchmarks/bench_zero_bubble.py`` (``--quick`` for the first cases only,
``--paper`` for the paper's rows only).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.paper_model import longest_rank_span, run  # noqa: E402
from benchmarks.paper_rows import COLUMNS, rates, rows, schedule_for, timing  # noqa: E402
from benchmarks.torch_orders import TORCH_CLASSES, torch_schedule  # noqa: E402
from schedules import engine, generate, step_metrics  # noqa: E402
from schedules.generators import GENERATORS, MULTI_CHUNK, ScheduleUnavailableError, zb_auto, zbv_auto  # noqa: E402
from schedules.lowering import lower  # noqa: E402
from schedules.p2p import RENDEZVOUS  # noqa: E402

# (F, I, W, T_comm) in ms per rank, p, m
CASES = (
    ((1.0, 1.0, 1.0, 0.0), 4, 8),
    ((1.0, 1.0, 1.0, 0.0), 4, 16),
    ((1.0, 1.0, 1.0, 0.0), 8, 32),
    ((1.0, 1.0, 0.5, 0.05), 4, 16),
    ((1.0, 1.1, 0.7, 0.1), 8, 32),
    ((1.0, 1.0, 1.0, 0.5), 4, 16),
    ((1.0, 1.0, 0.4, 0.3), 8, 24),
)
SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-auto p", "zb-auto 2p-1", "zbv", "zbv-auto",
             "interleaved-zb", "looped-bfs", "dualpipev")
TORCH_CLASS_OF = {"zb-auto p": "zb-h1", "zb-auto 2p-1": "zb-h1", "zbv-auto": "zbv"}


def build(label: str, pp: int, microbatches: int, costs: tuple[float, float, float, float]):
    forward, backward_input, backward_weight, hop = costs
    if label.startswith("zb-auto"):
        limit = pp if label == "zb-auto p" else 2 * pp - 1
        return zb_auto(pp, microbatches, forward, backward_input, backward_weight, hop, limit)
    if label == "zbv-auto":  # each of the rank's two chunks half its costs, as zbv's row here
        return zbv_auto(pp, microbatches, forward / 2, backward_input / 2, backward_weight / 2, hop)
    if label not in GENERATORS:
        raise ScheduleUnavailableError(f"{label} is not generated here")
    chunks = 2 if label in ("interleaved-1f1b", "zbv", "interleaved-zb", "looped-bfs", "dualpipev") else 1
    return generate(label, pp, microbatches, chunks)


def measure(schedule, costs: tuple[float, float, float, float]) -> dict:
    forward, backward_input, backward_weight, hop = costs
    trace = run(schedule, forward, backward_input, backward_weight, hop)
    nccl = step_metrics(run(schedule, forward, backward_input, backward_weight, hop, production=True))
    metrics = step_metrics(trace, schedule.virtual_stages)
    span = longest_rank_span(trace)
    work = schedule.microbatches * (forward + backward_input + backward_weight)
    return {
        "makespan": metrics.makespan,
        "step_bubble": metrics.idle_fraction,  # 1 - compute / (p x makespan): transfers waited on count
        "rank_bubble": (span - work) / span,
        "peak": max(rank.peak_inflight_microbatches for rank in metrics.ranks),
        "nccl": nccl.makespan,
    }


def torch_row(label: str, pp: int, microbatches: int, costs) -> dict | None:
    name = TORCH_CLASS_OF.get(label, label)
    if name not in TORCH_CLASSES:
        return None
    try:
        return measure(torch_schedule(name, pp, microbatches), costs)
    except (ValueError, RuntimeError):  # torch refuses these sizes too
        return None


# the paper's columns against torch's order of the same class, where torch has one
TORCH_OF_COLUMN = {"1F1B-I": ("interleaved-1f1b", None), "ZB-H1": ("zb-h1", 1)}  # None: the row's chunks


def paper_table() -> None:
    """The paper's rows side by side (see the module)."""
    from benchmarks.paper_rows import bubble_rate  # noqa: PLC0415

    header = (f"{'row':<17} {'column':<7} {'paper':>7} {'nccl':>7} {'free':>7} {'torch':>7} {'nccl/free':>9}"
              f" {'order':<26} {'seconds':>7}")
    print("The zero-bubble paper's rows (bubble rate as the paper computes it; 14.6B and 28.3B held out)")
    print(header)
    print("-" * len(header))
    for row in rows():
        for column in COLUMNS:
            started = time.perf_counter()
            schedule = schedule_for(row, column)
            built = time.perf_counter() - started
            nccl, free, ratio = rates(row, schedule)
            torch_cell = "-"
            if column in TORCH_OF_COLUMN:
                name, chunks = TORCH_OF_COLUMN[column]
                theirs = torch_schedule(name, row.pp, row.microbatches, chunks or row.interleaved_chunks)
                torch_cell = f"{bubble_rate(engine.run(theirs, timing(row, theirs), engine.FREE), row):.4f}"
            paper = f"{row.paper[column]:.4f}" if column in row.paper else "held"
            order = schedule.meta.get("order", "")
            print(f"{row.label:<17} {column:<7} {paper:>7} {nccl:>7.4f} {free:>7.4f} {torch_cell:>7} {ratio:>9.4f}"
                  f" {order:<26} {built:>7.2f}")
        print()


GENERATOR_COSTS = (("paper 1.5B p8 m24", (18.522, 18.086, 9.337, 0.601), 8, 24),
                   ("F1 I.9 W.5 T.1", (1.0, 0.9, 0.5, 0.1), 8, 24),
                   ("F1 I.9 W.5 T.3", (1.0, 0.9, 0.5, 0.3), 4, 8),
                   ("F1 I.9 W.5 T.3", (1.0, 0.9, 0.5, 0.3), 8, 24))


def ratio_table() -> None:
    """Rendezvous step / free-flowing step of the same order, every generator."""
    from benchmarks.paper_rows import Row  # noqa: PLC0415

    names = [name for name in GENERATORS if name != "gpipe"] + ["gpipe"]
    print("Rendezvous (NCCL) step / free-flowing step, same order, cost-aware lowering (v = 2 unless named)")
    header = f"{'costs':<18} {'p':>2} {'m':>3}  " + " ".join(f"{name:>16}" for name in names)
    print(header)
    print("-" * len(header))
    for label, (forward, backward_input, backward_weight, hop), pp, microbatches in GENERATOR_COSTS:
        row = Row(label, pp, microbatches, forward, backward_input, backward_weight, hop, {})
        cells = []
        for name in names:
            try:
                schedule = generate(name, pp, microbatches, 2 if name in MULTI_CHUNK else 1)
            except ScheduleUnavailableError:
                cells.append(f"{'n/a':>16}")
                continue
            step_timing = timing(row, schedule)
            free = engine.run(schedule, step_timing, engine.FREE).makespan
            nccl = engine.run(lower(schedule, step_timing), step_timing, RENDEZVOUS).makespan
            cells.append(f"{nccl / free:>16.4f}")
        print(f"{label:<18} {pp:>2} {microbatches:>3}  " + " ".join(cells))
    print()


# small cases, where CP-SAT bounds every rendezvous-safe lowering (schedules.rendezvous_bound)
BOUND_COSTS = (("F1 I.9 W.5 T.1", (1.0, 0.9, 0.5, 0.1), 4, 8),
               ("F1 I.9 W.5 T.3", (1.0, 0.9, 0.5, 0.3), 4, 8),
               ("F1 I.9 W.5 T.3", (1.0, 0.9, 0.5, 0.3), 3, 6))


def bound_cells(label: str, costs, pp: int, microbatches: int, seconds: float = 20.0) -> list[tuple]:
    """Per generator on one small case: (name, rendezvous step / free-flowing step with
    ``lower``, the bound on the best rendezvous-safe program / free-flowing step, whether
    CP-SAT proved the bound optimal for its model); None where the generator has no order."""
    from benchmarks.paper_rows import Row  # noqa: PLC0415
    from schedules.rendezvous_bound import rendezvous_bound  # noqa: PLC0415

    forward, backward_input, backward_weight, hop = costs
    row = Row(label, pp, microbatches, forward, backward_input, backward_weight, hop, {})
    cells = []
    for name in [name for name in GENERATORS if name != "zb-auto"]:
        try:
            schedule = generate(name, pp, microbatches, 2 if name in MULTI_CHUNK else 1)
        except ScheduleUnavailableError:
            cells.append((name, None, None, None))
            continue
        step_timing = timing(row, schedule)
        free = engine.run(schedule, step_timing, engine.FREE).makespan
        nccl = engine.run(lower(schedule, step_timing), step_timing, RENDEZVOUS).makespan
        bound = rendezvous_bound(schedule, step_timing, seconds=seconds)
        cells.append((name, nccl / free, bound.bound / free, bound.optimal))
    return cells


def bound_table() -> None:
    """Small cases: lowering against the best rendezvous-safe program (a CP-SAT bound)."""
    print("Small cases: rendezvous step / free-flowing step with lower, and best rendezvous-safe / free "
          "(CP-SAT lower bound; a cell whose bound is above 1.01 is a gap NCCL's rule forces)")
    for label, costs, pp, microbatches in BOUND_COSTS:
        cells = bound_cells(label, costs, pp, microbatches)
        print(f"{label:<18} p {pp} m {microbatches}")
        for name, ratio, bound, optimal in cells:
            if ratio is None:
                print(f"    {name:<17} n/a")
                continue
            verdict = ("forced by NCCL's rule" if bound > 1.01 else
                       "within 1% of the best" if ratio <= 1.01 * bound else "above the bound by more than 1%")
            print(f"    {name:<17} lower/free {ratio:.4f}  best rendezvous-safe/free >= {bound:.4f}"
                  f"{'' if optimal else ' (not proven)'}  {verdict}")
    print()


def zbv_table() -> None:
    """zbv against zbv-auto at zbv's memory and below it (a half and a third of it, and the
    memory of the paper's V-Half and V-Min blocks, ``p/2 + 1`` and about ``p/3 + 1``; and
    at p/3 with the paper's share of a stash kept between I and W, 0.4, where every other
    column keeps it whole): the paper's rows (each rank's F, I, W split over its two
    chunks, the paper's bubble rate) and the F1 I.9 W.5 T.3 rows, with the most seconds
    zbv-auto took to build an order."""
    from benchmarks.paper_rows import PAPER_WEIGHT_MEMORY, Row, bubble_rate  # noqa: PLC0415
    from schedules.generators.v_blocks import v_block_order  # noqa: PLC0415

    print("zbv and zbv-auto (free-flowing transfers; bubble = (longest rank span - m(F+I+W)) / span; "
          "limit in microbatches per rank; V-Half, V-Min: at the paper's blocks' memory)")
    names = ("p", "p/2", "p/3", "V-Half", "V-Min", "p/3 .4 kept")
    header = f"{'row':<24} {'zbv':>7} " + " ".join(f"{'auto ' + name:>12}" for name in names) + f" {'seconds':>8}"
    print(header)
    print("-" * len(header))
    cases = [*rows(), *(Row(label, pp, microbatches, *costs, {}) for label, costs, pp, microbatches in GENERATOR_COSTS
                        if label.startswith("F1 I.9 W.5 T.3"))]
    for row in cases:
        forward, backward_input, backward_weight = row.forward / 2, row.backward_input / 2, row.backward_weight / 2
        zbv_order = generate("zbv", row.pp, row.microbatches, 2)
        cells, seconds = [], 0.0
        blocks = [v_block_order(name, row.pp, row.microbatches).meta["memory_microbatches"]
                  for name in ("v-half", "v-min")]
        limits = [(limit, 1.0) for limit in (row.pp, max(1, row.pp / 2), max(1, row.pp / 3), *blocks)]
        for limit, kept in [*limits, (max(1, row.pp / 3), PAPER_WEIGHT_MEMORY)]:
            v_block_order.cache_clear()  # each search builds the blocks it tries, as a user's first one does
            started = time.perf_counter()
            ours = zbv_auto(row.pp, row.microbatches, forward, backward_input, backward_weight, row.comm, limit,
                            weight_memory=kept)
            seconds = max(seconds, time.perf_counter() - started)
            cells.append(bubble_rate(engine.run(ours, timing(row, ours), engine.FREE), row))
        label = row.label
        zbv_rate = bubble_rate(engine.run(zbv_order, timing(row, zbv_order), engine.FREE), row)
        print(f"{label:<24} {zbv_rate:>7.4f} " + " ".join(f"{cell:>12.4f}" for cell in cells) + f" {seconds:>8.2f}")
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first three cases only")
    parser.add_argument("--paper", action="store_true", help="the zero-bubble paper's rows only")
    parser.add_argument("--measured", help="JSON list of measured step times to print beside the predictions")
    args = parser.parse_args()
    paper_table()
    zbv_table()
    ratio_table()
    bound_table()
    if args.paper:
        return 0
    measured = {}
    if args.measured:
        for row in json.loads(Path(args.measured).read_text()):
            measured[row["schedule"], row["pp"], row["microbatches"]] = row["step_time"]
    header = (f"{'F/I/W/T':<16} {'p':>2} {'m':>3}  {'schedule':<14} {'step bubble':>11} {'rank bubble':>11} "
              f"{'peak':>5} {'makespan':>9} {'nccl':>7} {'torch':>9} {'vs torch':>8}"
              + ("  measured" if measured else ""))
    print(header)
    print("-" * len(header))
    for costs, pp, microbatches in CASES[:3] if args.quick else CASES:
        label_costs = "/".join(f"{value:g}" for value in costs)
        for label in SCHEDULES:
            try:
                schedule = build(label, pp, microbatches, costs)
            except ScheduleUnavailableError as error:
                print(f"{label_costs:<16} {pp:>2} {microbatches:>3}  {label:<14} n/a: {str(error)[:60]}")
                continue
            ours = measure(schedule, costs)
            theirs = torch_row(label, pp, microbatches, costs)
            torch_cells = (f"{theirs['makespan']:>9.2f} {ours['makespan'] / theirs['makespan']:>8.3f}" if theirs
                           else f"{'-':>9} {'-':>8}")
            line = (f"{label_costs:<16} {pp:>2} {microbatches:>3}  {label:<14} {ours['step_bubble']:>11.2%} "
                    f"{ours['rank_bubble']:>11.2%} {ours['peak']:>5g} {ours['makespan']:>9.2f} {ours['nccl']:>7.2f} "
                    f"{torch_cells}")
            seconds = measured.get((label, pp, microbatches))
            if seconds is not None:
                line += f"  {seconds:.4g} s"
            print(line)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
