"""The layout search behind ``pipesim plan``: enumerate the ways to train a model on N
GPUs, drop the ones that cannot work (counting why), and simulate the rest in order of a
lower bound on their step time, so layouts that provably cannot reach the top are never
simulated.

A layout is a schedule, pp × tp × dp, virtual stages, microbatch size (the microbatch
count follows from the global batch), recompute, the ZeRO stage, sequence parallelism,
context parallelism (cp ranks splitting each sequence, for long ones) and, for a mixture
of experts, the expert-parallel size (ep ranks cut from dp x cp, as ``simulate --ep``
places them). Layers need not divide over the pp × v stages: each layout's split is the
balanced one ``pipesim simulate`` makes (``pipesim.model.stage_split``), chosen per
layout rather than searched. Simulating one is the same call as ``pipesim simulate`` with those flags
(the caller passes it in as ``evaluate``), so a plan's numbers are exactly what
``simulate`` prints for the chosen layout.

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
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import NamedTuple

from pipesim.plan.workers import (
    Feeder,
    each_of,
    judge,
    judge_places,
    start_worker,
    timed,
    worker_context,
)
from schedules.collector import collector_paused
from schedules.generators import MULTI_CHUNK, V_SHAPED
from schedules.generators import PLANNED_SCHEDULES as SCHEDULE_NAMES  # noqa: N814


class Layout(NamedTuple):
    """One way to run the job. ``microbatches`` per step follows from the global batch.

    A named tuple: a search makes, hashes, compares and sends tens of thousands of
    them (made and hashed several times faster than a frozen dataclass's), and they
    order field by field, as the ranking's ties need."""

    schedule: str
    pp: int
    tp: int
    dp: int
    virtual_stages: int
    microbatch_size: int
    microbatches: int
    recompute: str = "none"
    zero: int = 0
    sequence_parallel: bool = False
    ep: int = 1
    cp: int = 1

    def label(self) -> str:
        chunks = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        context = f" cp{self.cp}" if self.cp > 1 else ""
        experts = f" ep{self.ep}" if self.ep > 1 else ""
        extras = "".join([f" recompute={self.recompute}" if self.recompute != "none" else "",
                          f" zero{self.zero}" if self.zero else "", " sp" if self.sequence_parallel else ""])
        return (f"{self.schedule}{chunks} pp{self.pp} tp{self.tp}{context} dp{self.dp}{experts} "
                f"mbs{self.microbatch_size} m{self.microbatches}{extras}")


@dataclass
class SearchSpace:
    """What the search may vary, and the fixed facts of the job."""

    gpus: int
    gpus_per_node: int
    global_batch: int
    layers: int
    heads: int
    kv_heads: int
    schedules: Sequence[str] = SCHEDULE_NAMES
    microbatch_sizes: Sequence[int] = (1, 2, 4)
    virtual_stages: Sequence[int] = (2, 4)
    recompute: Sequence[str] = ("none",)
    zero: Sequence[int] = (0,)
    sequence_parallel: Sequence[bool] = (False,)
    constraints: dict[str, set[str]] = field(default_factory=dict)
    experts: int = 0  # routed experts per MoE layer (0: a dense model)
    expert_parallel: Sequence[int] | None = None  # ep sizes to try; None: every power of two dividing the experts
    seq_len: int = 0  # tokens per sequence (0: unknown, no context parallelism)
    context_parallel: Sequence[int] | None = None  # cp sizes to try; None: ``context_parallel_sizes``


def parse_constraints(texts: Iterable[str]) -> dict[str, set[str]]:
    """``["pp=8", "schedule=1f1b,zb-h1"]`` -> ``{"pp": {"8"}, "schedule": {"1f1b", "zb-h1"}}``;
    errors name the bad text and the fields that exist."""
    names = set(Layout._fields)
    constraints: dict[str, set[str]] = {}
    for text in texts:
        key, sep, value = text.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not value.strip():
            raise ValueError(f"--constraint {text!r}: expected FIELD=VALUE[,VALUE...], e.g. pp=8")
        if key not in names:
            raise ValueError(f"--constraint {text!r}: unknown field {key!r}; fields: {', '.join(sorted(names))}")
        constraints.setdefault(key, set()).update(part.strip() for part in value.split(",") if part.strip())
    return constraints


def _powers_of_two(limit: int) -> list[int]:
    return [2**power for power in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


def enumerate_layouts(space: SearchSpace) -> tuple[list[Layout], Counter]:
    """Every layout the space allows, and how many candidates each rule ruled out. A
    candidate is one choice of every dimension on a split of the GPUs (tp x pp dividing
    them); choices that only repeat another layout or describe none are not candidates:
    ZeRO or sequence parallelism with nothing to shard over, a V with other than two
    stages per rank, and at pp 1 (no pipeline: one rank runs every forward and backward)
    any schedule but one, 1F1B where it is searched."""
    rejected: Counter = Counter()
    layouts = []
    alone = "1f1b" if "1f1b" in space.schedules else space.schedules[0]  # the one schedule at pp 1
    expert_sizes = expert_parallel_sizes(space)
    splits = [(tp, pp, cp) for tp in _powers_of_two(space.gpus_per_node) for cp in context_parallel_sizes(space)
              for pp in range(1, space.layers + 3)]  # a first and a last stage may hold no layer
    for tp, pp, cp in splits:
        if space.gpus % (tp * pp * cp):
            continue  # not a split of the GPUs at all: not a layout, not counted
        dp = space.gpus // (tp * pp * cp)
        for microbatch_size in space.microbatch_sizes:
            microbatches = space.global_batch // (dp * microbatch_size)
            for schedule in (space.schedules if pp > 1 else (alone,)):
                for chunks in _chunks(schedule, space):
                    for recompute in space.recompute:
                        for zero in space.zero:
                            if zero and dp * cp == 1:
                                continue  # nothing to shard over (ZeRO shards over dp x cp): as zero 0
                            for sequence_parallel in space.sequence_parallel:
                                if sequence_parallel and tp == 1:
                                    continue  # no tensor-parallel group: the same layout
                                for ep in expert_sizes:
                                    if ep > dp * cp:
                                        continue  # its ranks are cut from dp x cp: not a layout
                                    layout = Layout(schedule, pp, tp, dp, chunks, microbatch_size, microbatches,
                                                    recompute, zero, sequence_parallel, ep, cp)
                                    cause = _ruled_out(layout, space)
                                    if cause is None:
                                        layouts.append(layout)
                                    else:
                                        rejected[cause] += 1
    return layouts, rejected


def _chunks(schedule: str, space: SearchSpace) -> Sequence[int]:
    """Stages per rank to try for ``schedule``: one for a looped one-chunk order, exactly
    two for a V (the only V there is), the searched counts for the other multi-chunk ones."""
    if schedule in V_SHAPED:
        return (2,)
    return space.virtual_stages if schedule in MULTI_CHUNK else (1,)


# Context parallelism is tried where each rank keeps at least this many tokens of a
# sequence: below it the ring's K/V exchange outweighs what splitting the attention saves
# (Llama 3 trained 8k sequences without it and turned it on for 128k, cp 16).
CP_MIN_TOKENS = 8192


def context_parallel_sizes(space: SearchSpace) -> list[int]:
    """The cp sizes to try: the given ones, else every power of two that leaves each rank
    at least ``CP_MIN_TOKENS`` of a sequence and splits it in ``2 cp`` even chunks (the
    load-balanced causal ring); 1 when the sequence is unknown."""
    if space.context_parallel is not None:
        return sorted(set(space.context_parallel))
    if not space.seq_len:
        return [1]
    return [size for size in _powers_of_two(space.seq_len // CP_MIN_TOKENS or 1)
            if space.seq_len % (2 * size) == 0 or size == 1]


def expert_parallel_sizes(space: SearchSpace) -> list[int]:
    """The ep sizes to try: 1 for a dense model, else the given ones or every power of two
    that divides the routed experts."""
    if not space.experts:
        return [1]
    if space.expert_parallel is not None:
        return sorted(set(space.expert_parallel))
    return [size for size in _powers_of_two(space.experts) if space.experts % size == 0]


def _ruled_out(layout: Layout, space: SearchSpace) -> str | None:
    """The first rule a candidate breaks, None if it keeps them all."""
    if space.heads % layout.tp or space.kv_heads % layout.tp:
        return "tp does not divide the attention (or key-value) heads"
    if space.global_batch % (layout.dp * layout.microbatch_size):
        return "global batch not divisible by dp x microbatch size"
    if layout.ep > 1 and ((layout.dp * layout.cp) % layout.ep or space.experts % layout.ep):
        return "ep does not divide dp x cp (its ranks are cut from them) or the routed experts"
    if layout.cp > 1 and space.seq_len % (2 * layout.cp):
        return "2 x cp does not divide the sequence (the causal ring's even chunks)"
    if layout.pp * layout.virtual_stages > space.layers + 2:
        return "more stages (pp x virtual stages) than layers + 2 (an embedding-only and a head-only chunk)"
    if not _allowed(layout, space.constraints):
        return "excluded by --constraint"
    return None


def _allowed(layout: Layout, constraints: dict[str, set[str]]) -> bool:
    return all(str(getattr(layout, key)) in values for key, values in constraints.items())


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

    @functools.cached_property
    def others(self) -> list[dict]:
        return [entry if isinstance(entry, dict) else {**layout_fields(entry[0]), **entry[1]}
                for entry in self.found_others]

    @property
    def ranked(self) -> int:
        return len(self.rows)

    def to_dict(self, top: int) -> dict:
        return {
            "ranked": self.rows[:top] if top else self.rows,
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
        }


def search(
    layouts: list[Layout],
    evaluate: Callable[[Layout], dict],
    bound: Callable[[Layout], float],
    top: int,
    workers: int = 1,
    progress: Callable[[int, int], None] | None = None,
    rejected: Counter | None = None,
    reject: Callable[[Layout], str | None] | None = None,
    describe: Callable[[Layout], dict] | None = None,
    refine: Callable[[Layout], dict] | None = None,
    evaluate_takes_cutoff: bool = False,
) -> PlanResult:
    """Simulate layouts in order of their lower bound, a few at a time on each of
    ``workers`` processes, and stop simulating once the next bound cannot beat the ``top``-th best
    step time found that fits in memory. ``evaluate`` returns a row with ``step_time``
    and ``oom`` (or ``error``, or ``rejected``: a cause it found before simulating, the
    layout then counted as rejected before simulation); rows are ranked by step time,
    ties by layout. ``reject``
    names a cause for layouts that provably cannot work (checked before anything is
    simulated); ``rejected`` counts, by cause, the layouts ruled out before the search.
    ``describe`` adds what is known of a layout that is not simulated (its memory floor,
    say) to its entry in ``PlanResult.others``.

    ``refine`` is the exact evaluation where ``evaluate`` screens (a step the same or a
    little longer, found faster): the finalists, the ``top`` best screened rows and every
    row within ``REFINE_MARGIN`` of the ``top``-th, are evaluated again with it and ranked
    by what it says, ahead of the rows only screened (marked ``"screened": True``). With
    ``evaluate_takes_cutoff``, ``evaluate`` is also given the ``top``-th best step found
    when the layout was sent (infinity before there are ``top``) and may answer
    ``{"pruned": bound}``: a bound of its own, found once it has more of the layout than
    ``bound`` (its schedule's order, say), that cannot beat it, the layout then counted as
    pruned (what is sent, and so each cutoff, does not depend on timing). With
    several workers, ``evaluate``, ``refine``, ``bound`` and ``reject`` run in them and
    must be module-level functions."""
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
    pruned_late = 0  # pruned by ``evaluate``'s own bound (``evaluate_takes_cutoff``)
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
                                 initargs=(layouts,)) for _ in range(workers)] if workers > 1 else None

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
        run = functools.partial(judge_places, reject, bound)
        results: list = [None] * len(layouts)

        def take(unit: list[int], values: list) -> None:
            for index, value in zip(unit, values, strict=True):
                results[index] = value

        if pools is None:
            for unit in units:
                take(unit, [judge(reject, bound, layouts[index]) for index in unit])
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
        """What ``evaluate`` is given for ``layout`` now: with ``evaluate_takes_cutoff`` the
        ``top``-th best step so far too."""
        if not evaluate_takes_cutoff:
            return (layout,)
        return layout, fitting[top - 1] if len(fitting) >= top else math.inf

    def submit(given: tuple):
        """Send ``evaluate``'s ``given`` arguments (the layout first) to the layout's order's
        worker; a new order to the worker with the least left to do now (which worker runs
        a layout changes nothing it computes)."""
        if pools is None:
            return None
        key = order_key(given[0])
        if key not in owners:
            for futures in waiting:
                futures[:] = [future for future in futures if not future.done()]
            owners[key] = min(range(workers), key=lambda worker: len(waiting[worker]))
        future = pools[owners[key]].submit(timed, evaluate, *given)
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
                    found = each_of(refine, chosen)
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
                            len(order) - position + pruned_late, time.perf_counter() - started, others, refined)
    if describe is not None:  # what is known of the layouts never simulated
        for other in result.others:
            if other["bucket"] != "simulated":
                other.update(describe(Layout(**{key: other[key] for key in Layout._fields})))
    return result


# The cause of a layout pruned by ``evaluate``'s own bound (``evaluate_takes_cutoff``).
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


def order_key(layout: Layout) -> tuple[str, int, int, int]:
    """What a layout's order is built from besides its costs: schedule, pp, chunks,
    microbatches. Finer than the placement: the few hundred layouts simulated crowd into a
    few placements (pp 8 with two or four chunks), which would leave one worker doing
    most of them."""
    return layout.schedule, layout.pp, layout.virtual_stages, layout.microbatches


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


def layout_fields(layout: Layout) -> dict:
    """The layout as plain JSON fields, plus its one-line label."""
    return {**{name: getattr(layout, name) for name in LAYOUT_FIELDS}, "layout": layout.label()}


LAYOUT_FIELDS = Layout._fields


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
