"""The layout search behind ``pipesim plan``: the layouts of a space
(``pipesim.plan.layouts``) simulated in order of a lower bound on their step time, so
layouts that provably cannot reach the top are never simulated, screened first and the
finalists simulated exactly. Simulating one is the same call as ``pipesim simulate``
with those flags (the caller's evaluator makes it: ``pipesim.plan.evaluate``), so a
plan's numbers are exactly what ``simulate`` prints for the chosen layout.

Every considered layout lands in exactly one bucket, and the buckets add up: ruled out
by a divisibility rule or a constraint while enumerating, rejected before simulation (it
provably cannot fit), simulated (then ranked, out of memory, or not buildable), or
pruned (its lower bound cannot reach the top).
"""

from __future__ import annotations

import functools
import math
import sys
import time
from bisect import insort
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Protocol

from pipesim.plan.layouts import LAYOUT_FIELDS, Layout, layout_fields
from pipesim.plan.workers import (
    Feeder,
    judge,
    judge_places,
    start_worker,
    timed,
    timed_in_worker,
    worker_context,
)
from schedules.collector import collector_paused


@dataclass
class PlanResult:
    """Ranked rows (best first) and every other considered layout's bucket and cause.

    ``considered = ruled out + screened + simulated + pruned`` and ``simulated = ranked +
    failed``; each Counter holds its bucket's causes. ``others`` are the layouts that were
    not ranked but were looked at (screened, simulated and failed, pruned), each with its
    bucket, cause and what is known of it (its lower bound, for a chart): kept as found
    (``found_others``: a row, or a layout and its facts) and spelt out when first read, a
    chart being the one reader of the thousands a search prunes."""

    rows: list[dict]
    considered: int
    ruled_out: Counter
    screened: Counter
    failed: Counter
    simulated: int
    pruned: int
    seconds: float
    found_others: list = field(default_factory=list)
    refined: int = 0
    values_left_out: dict[str, dict] = field(default_factory=dict)  # ``values_left_out``
    # a ranked layout's order where the plan built it from the layout's costs, for ``to_dict``
    # (``LayoutEvaluator.planned_order``: what ``pipesim run --plan`` runs); None: none written
    order_of: Callable[[Layout], dict | None] | None = field(default=None, repr=False, compare=False)

    @functools.cached_property
    def others(self) -> list[dict]:
        return [entry if isinstance(entry, dict) else {**layout_fields(entry[0]), **entry[1]}
                for entry in self.found_others]

    @property
    def ranked(self) -> int:
        return len(self.rows)

    def ranked_rows(self, top: int) -> list[dict]:
        """The ``top`` best rows (all with ``top`` 0), each with ``order``, the compute order
        the plan simulated, where it built that order from the layout's costs (zb-auto,
        zbv-auto; zb-h1 and zb-h2 adapted): a run has no costs to build it again."""
        rows = self.rows[:top] if top else self.rows
        if self.order_of is None:
            return rows
        ordered = []
        for row in rows:
            order = self.order_of(Layout(**{key: row[key] for key in Layout._fields}))
            ordered.append({**row, "order": order} if order is not None else row)
        return ordered

    def to_dict(self, top: int) -> dict:
        return {
            "ranked": self.ranked_rows(top),
            "considered": self.considered,
            "ruled_out": sum(self.ruled_out.values()),
            "rejected_before_simulation": sum(self.screened.values()),
            "simulated": self.simulated,
            "simulated_and_ranked": self.ranked,
            "simulated_and_failed": sum(self.failed.values()),
            "pruned_by_bound": self.pruned,
            "causes": {"ruled_out": dict(self.ruled_out), "rejected_before_simulation": dict(self.screened),
                       "simulated_and_failed": dict(self.failed)},
            "simulated_exactly": self.refined,
            "seconds": self.seconds,
            "simulated_per_second": self.simulated / self.seconds if self.seconds else None,
            **({"values_left_out": self.values_left_out} if self.values_left_out else {}),
        }


class Evaluator(Protocol):
    """What the search asks of a layout (``pipesim.plan.evaluate.LayoutEvaluator`` for a
    plan's job). ``screen`` and ``evaluate`` return a row with ``step_time`` and ``oom``,
    or ``{"error": cause}`` (simulated, not buildable), ``{"rejected": cause}`` (found
    before simulating that it cannot fit: rejected before simulation) or
    ``{"pruned": bound}`` (its own bound, found once it has more of the layout than
    ``lower_bound``, cannot beat ``cutoff``, the ``top``-th best step so far). ``screen``
    may be quicker than ``evaluate`` and its step a little longer, never shorter.
    ``planned_order``: a ranked layout's order where the plan built it from its costs."""

    def screen(self, layout: Layout, cutoff: float = math.inf) -> dict: ...

    def evaluate(self, layout: Layout, cutoff: float = math.inf) -> dict: ...

    def lower_bound(self, layout: Layout) -> float: ...

    def reject_cause(self, layout: Layout) -> str | None: ...

    def describe(self, layout: Layout) -> dict: ...

    def planned_order(self, layout: Layout) -> dict | None: ...


# What ``search`` runs of the evaluator: its first pass on every layout it simulates, then
# (``SCREENED``) its second on the finalists.
SCREENED = ("screen", "evaluate")
EXACT = ("evaluate",)


def search(
    layouts: list[Layout],
    evaluator: Evaluator,
    top: int,
    workers: int = 1,
    progress: Callable[[int, int], None] | None = None,
    rejected: Counter | None = None,
    passes: Sequence[str] = SCREENED,
    prune: bool = True,
    describe: bool = False,
) -> PlanResult:
    """Simulate layouts in order of their lower bound, a few at a time on each of
    ``workers`` processes, and stop simulating once the next bound cannot beat the ``top``-th best
    step time found that fits in memory. Rows are ranked by step time, ties by layout.
    Layouts with a ``reject_cause`` (they provably cannot work; checked before anything is
    simulated) are counted as rejected before simulation; ``rejected`` counts, by cause, the
    layouts ruled out before the search. With ``describe``, what is known of a layout that
    is not simulated (``evaluator.describe``: its memory floor, say) is added to its entry
    in ``PlanResult.others``.

    ``passes`` names the evaluator's methods: the first evaluates each layout simulated;
    a second (``"evaluate"`` where the first screens) is the exact evaluation of the
    finalists, the ``top`` best screened rows and every row within ``REFINE_MARGIN`` of the
    ``top``-th, ranked by what it says, ahead of the rows only screened (marked
    ``"screened": True``). With ``prune``, each layout is also given the ``top``-th best step
    found when it was sent (infinity before there are ``top``) and may answer
    ``{"pruned": bound}``, the layout then counted as pruned (what is sent, and so each
    cutoff, does not depend on timing); without it, every layout not rejected is evaluated.
    With several workers, each builds or inherits ``evaluator`` once, when it starts."""
    if not 1 <= len(passes) <= 2 or not all(callable(getattr(evaluator, name, None)) for name in passes):
        raise ValueError(f"passes {tuple(passes)!r}: one or two of the evaluator's methods, e.g. {SCREENED}")
    first, refine = passes[0], (passes[1] if len(passes) == 2 else None)
    evaluate = getattr(evaluator, first)
    started = time.perf_counter()
    ruled_out = Counter(rejected or {})
    screened: Counter = Counter()
    failed: Counter = Counter()
    others: list = []  # dicts, or (layout, facts): ``PlanResult.found_others``
    considered = len(layouts) + sum(ruled_out.values())
    rows: list[dict] = []
    seconds: dict[Layout, float] = {}  # what evaluating each layout took: the finalists' weights
    fitting: list[float] = []
    simulated = 0
    pruned_late = 0  # pruned by the evaluation's own bound (``prune``)
    window = 32 * workers if workers > 1 else 1  # layouts submitted and not yet taken
    position = 0
    # One process per worker. Layouts that share cached work go to the same one: in the
    # first pass those cut into as many stages of one shape (their stages' costs derived
    # once; ``stages_key``), in the simulations those of one order
    # (``order_key``: the generated order and its cost-aware search built once, not once per
    # worker), each new order to the worker with the fewest layouts left to do. With one
    # shared pool, 2 workers did 40% more work than 1.
    # Python's cyclic collector is off in the workers and paused here: the costs, floors,
    # bounds, orders and traces they build are acyclic and die by reference count (a whole
    # 70B plan leaves a few hundred objects of cyclic garbage), and with it on, each worker
    # spent a twentieth of its time walking the caches it keeps.
    pools = [ProcessPoolExecutor(max_workers=1, mp_context=worker_context(), initializer=start_worker,
                                 initargs=(layouts, evaluator)) for _ in range(workers)] if workers > 1 else None

    def natural_places() -> list[int]:
        """Each layout's place in ``Layout`` order: ties of bounds go by it."""
        places = [0] * len(layouts)
        for place, index in enumerate(sorted(range(len(layouts)), key=layouts.__getitem__)):
            places[index] = place
        return places

    def judge_all() -> tuple[list[tuple[str | None, float | None]], list[int]]:
        """``judge`` of every layout (in order), the layouts alike in ``stages_key`` in turn
        on one worker (their stages' costs derived there once), the largest groups first,
        each to the first worker that is free: groups of very different cost balance over
        the workers this way. A worker is sent the layouts' places in ``layouts``, which
        it was given when it started (unpickling 18,000 layouts cost a tenth of the pass).
        With them, ``natural_places``, sorted while the workers judge."""
        groups: dict = {}
        for index, layout in enumerate(layouts):
            groups.setdefault(stages_key(layout), []).append(index)
        units = sorted(groups.values(), key=len, reverse=True)
        run = functools.partial(judge_places, prune)
        results: list = [None] * len(layouts)

        def take(unit: list[int], values: list) -> None:
            for index, value in zip(unit, values, strict=True):
                results[index] = value

        if pools is None:
            for unit in units:
                take(unit, [judge(evaluator, prune, layouts[index]) for index in unit])
            return results, natural_places()
        queue = deque(units)
        running = {}
        # two units on each worker: the next one waits there while one runs, so a worker
        # never idles through the round trip to this process (on the floors and bounds of
        # the 70B plan those waits were a seventh of each worker's time)
        for pool in [*pools, *pools][:len(queue)]:
            unit = queue.popleft()
            running[pool.submit(run, unit)] = (unit, pool)
        natural = natural_places()  # while the workers judge
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                unit, pool = running.pop(future)
                take(unit, future.result())
                if queue:
                    following = queue.popleft()
                    running[pool.submit(run, following)] = (following, pool)
        return results, natural

    owners: dict[tuple, int] = {}  # order -> its worker
    waiting: list[list] = [[] for _ in range(workers)]  # per worker, its submitted futures not yet seen done

    def arguments(layout: Layout) -> tuple:
        """What the first pass is given for ``layout`` now: with ``prune`` the ``top``-th
        best step so far too."""
        if not prune:
            return (layout,)
        return layout, fitting[top - 1] if len(fitting) >= top else math.inf

    def submit(given: tuple):
        """Send the first pass's ``given`` arguments (the layout first) to the layout's order's
        worker; a new order to the worker with the least left to do now (which worker runs
        a layout changes nothing it computes)."""
        if pools is None:
            return None
        key = order_key(given[0])
        if key not in owners:
            for futures in waiting:
                futures[:] = [future for future in futures if not future.done()]
            owners[key] = min(range(workers), key=lambda worker: len(waiting[worker]))
        future = pools[owners[key]].submit(timed_in_worker, first, *given)
        waiting[owners[key]].append(future)
        return future

    with collector_paused():
        try:
            # the memory floor and the bound of every layout in one pass over the workers, layouts
            # alike in ``stages_key`` together (their stages' costs derived once)
            judged, natural = judge_all()
            kept = []
            for index, (cause, _) in enumerate(judged):
                if cause is None:
                    kept.append(index)
                else:
                    screened[cause] += 1
                    others.append((layouts[index], {"bucket": "rejected before simulation", "cause": cause}))
            # by bound, ties in ``Layout`` order (the places sorted while the workers judged)
            kept.sort(key=lambda index: (judged[index][1], natural[index]))
            order = [layouts[index] for index in kept]
            bounds = {layouts[index]: judged[index][1] for index in kept}
            # A window of layouts in flight over the workers, submitted in bound order; results
            # are taken in that order too, so what is simulated does not depend on timing. No
            # submission once the next bound cannot reach the top: every later one is larger.
            in_flight: deque = deque()
            exhausted = False
            feeder = Feeder(refine, pools, waiting, seconds) if refine is not None and pools is not None else None
            while in_flight or (position < len(order) and not exhausted):
                while position < len(order) and len(in_flight) < window:
                    if len(fitting) >= top and bounds[order[position]] >= fitting[top - 1]:
                        exhausted = True
                        break
                    layout = order[position]
                    given = arguments(layout)
                    in_flight.append((layout, given, submit(given)))
                    position += 1
                if not in_flight:
                    break
                if feeder is not None and (exhausted or position == len(order)):
                    # nothing more to submit: the finalists as they stand go to the workers
                    # as each runs out of screens, instead of after the last screen is in
                    # (on the 70B plan they were the final ones, 22 of 22, with 63 screens
                    # still in flight)
                    feeder.want(finalists(sorted(rows, key=rank_key), top))
                    feeder.run_until(in_flight[0][2])
                layout, given, future = in_flight.popleft()
                row, seconds[layout] = future.result() if future is not None else timed(evaluate, *given)
                if "pruned" in row:  # its own bound, once its order was built, cannot reach the top
                    pruned_late += 1
                    others.append((layout, {"bucket": "pruned", "cause": PRUNED_BY_ORDER,
                                            "lower_bound": row["pruned"]}))
                elif "rejected" in row:  # provably out of memory once its schedule was built: never simulated
                    screened[row["rejected"]] += 1
                    others.append((layout, {"bucket": "rejected before simulation", "cause": row["rejected"],
                                            "lower_bound": bounds[layout]}))
                elif "error" in row or row.get("oom"):
                    simulated += 1
                    cause = row.get("error") or "out of memory"
                    failed[cause] += 1
                    others.append({**{key: value for key, value in row.items() if key != "error"},
                                   **layout_fields(layout), "bucket": "simulated", "cause": cause,
                                   "lower_bound": bounds[layout]})
                else:
                    simulated += 1
                    row["lower_bound"] = bounds[layout]
                    rows.append(row)
                    insort(fitting, row["step_time"])  # kept sorted: the top-th best is fitting[top - 1]
                if progress is not None:
                    progress(position - len(in_flight), len(order))
            rows.sort(key=rank_key)
            refined = 0
            if refine is not None and rows:
                chosen = finalists(rows, top)
                if feeder is None:
                    found = [getattr(evaluator, refine)(layout) for layout in chosen]
                else:
                    feeder.want(chosen)
                    found = feeder.results(chosen)
                rows, refined = _refined(rows, chosen, found, others, failed)
        finally:
            for pool in pools or ():
                pool.shutdown()
        others += [(layout, {"bucket": "pruned", "cause": "its lower bound cannot reach the top",
                             "lower_bound": bounds[layout]}) for layout in order[position:]]
        result = PlanResult(rows, considered, ruled_out, screened, failed, simulated,
                            len(order) - position + pruned_late, time.perf_counter() - started, others, refined,
                            order_of=getattr(evaluator, "planned_order", None))
    if describe:  # what is known of the layouts never simulated
        for other in result.others:
            if other["bucket"] != "simulated":
                other.update(evaluator.describe(Layout(**{key: other[key] for key in Layout._fields})))
    return result


# The cause of a layout pruned by its evaluation's own bound (``prune``).
PRUNED_BY_ORDER = "its order's bound, with transfers flowing freely, cannot reach the top"

# Screened rows this much slower than the top-th are evaluated exactly too: a layout the
# exact searches speed up by more would be missed (on the 70B plan of the README they
# changed no step of the top 10; benchmarks/bench_plan.py compares with the exact search).
REFINE_MARGIN = 0.02


def rank_key(row: dict) -> tuple[float, str]:
    """Rows rank by step time, ties by layout."""
    return row["step_time"], row["layout"]


def finalists(rows: list[dict], top: int) -> list[Layout]:
    """The layouts of the screened ``rows`` (ranked) that are evaluated exactly: the
    ``top`` best and every one within ``REFINE_MARGIN`` of the ``top``-th."""
    if not rows:
        return []
    cutoff = rows[min(top, len(rows)) - 1]["step_time"] * (1 + REFINE_MARGIN)
    count = max(min(top, len(rows)), sum(row["step_time"] <= cutoff for row in rows))
    return [Layout(**{key: row[key] for key in LAYOUT_FIELDS}) for row in rows[:count]]


def _refined(rows: list[dict], chosen: list[Layout], found: list[dict], others: list,
             failed: Counter) -> tuple[list[dict], int]:
    """The ranked screened ``rows`` with the ``chosen`` finalists (their first rows) as
    their exact evaluation ``found`` them, ranked first, the rest after them marked as
    screened; how many were refined."""
    count = len(chosen)
    exact = []
    for screened_row, row in zip(rows[:count], found, strict=True):
        if "step_time" not in row or row.get("oom"):  # the exact order needs more memory than the screened one
            cause = row.get("rejected") or row.get("error") or "out of memory"
            failed[cause] += 1
            others.append({**{key: value for key, value in screened_row.items() if key != "error"},
                           "bucket": "simulated", "cause": cause})
            continue
        exact.append({**row, "lower_bound": screened_row["lower_bound"]})
    exact.sort(key=rank_key)
    return exact + [{**row, "screened": True} for row in rows[count:]], count


def order_key(layout: Layout) -> tuple[str, int, int, int, int | None]:
    """What a layout's order is built from besides its costs: schedule, pp, chunks,
    microbatches, microbatch group. Finer than the placement: the few hundred layouts simulated crowd into a
    few placements (pp 8 with two or four chunks), which would leave one worker doing
    most of them."""
    return layout.schedule, layout.pp, layout.virtual_stages, layout.microbatches, layout.microbatch_group


def stages_key(layout: Layout) -> tuple[int, int, int]:
    """How many stages the model is cut into (pp x chunks), tp and the microbatch size:
    layouts alike in these share their stages' costs whatever their placement on the
    ranks (V or looped), and nothing costlier with other layouts."""
    return layout.pp * layout.virtual_stages, layout.tp, layout.microbatch_size


def pareto_front(rows: list[dict], x: str = "peak_memory_bytes", y: str = "tokens_per_second") -> list[dict]:
    """Rows no other row beats on both less memory and more throughput, by memory."""
    front, best = [], -math.inf
    for row in sorted(rows, key=lambda row: (row[x], -row[y])):
        if row[y] > best:
            front.append(row)
            best = row[y]
    return front


def terminal_progress(label: str) -> Callable[[int, int], None] | None:
    """A one-line progress bar on stderr when it is a terminal, else nothing."""
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        width = 30
        filled = int(width * done / total) if total else width
        sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show
