"""Measured against predicted: one step's time, per-rank busy and idle, bubble fraction,
and the signed relative error of the prediction.

Pure functions of Traces and step times, so they hold for any source of either. The
measured step time is the median over the run's steps after the warm-up ones: a single
step on a shared CPU can be preempted, and the prediction is of a typical step. Beside it
the steps' spread, and warnings when the spread or the machine's load make an error of a
few percent meaningless.

Idle time and the bubble and idle fractions are taken against the step time (not against
the span of the trace's events), so that what the step spends outside the pipeline
actions (the optimizer step, the loss all-reduce) counts as idle on both sides alike. The
bubble fraction is the pipeline bubble of the time accounting (``schedules.accounting``),
as ``pipesim simulate`` reports it; the idle fraction every moment not computing. On the
measured side busy and bubble come from the one step the Trace holds (the last), so they
are set against that step's own time, not the median: against the median, a traced step
slower than the median once gave rank 1 of a tp 2 run 821.7 ms busy in an 803.9 ms
"step", a measured idle of -17.7 ms (its own step took 922.2 ms: 100.5 ms idle).

Busy is what the executor's compute actions hold: on the predicted side the compute plus
the tp collectives, ep all-to-alls and ring attention's waits the simulator charges on
streams of their own (``INSIDE_COMPUTE``), since the executor runs those inside its
actions and measures them as part of them. Without that a tp run's predicted idle time
would count its collectives, and the measured one would not. For the same reason the
predicted busy leaves out the runtime's time before each action (``Costs.action_overhead``,
``launch_overheads``): the simulator charges it inside each compute event, the executor's
trace has it between its events, and counted as busy on one side only it read every
rank's compute stretch 2-6% low.
"""

from __future__ import annotations

import statistics

from pipesim.model.costs import Costs
from schedules.action import COMPUTE_KINDS, Action
from schedules.metrics import step_metrics
from schedules.runtime_gaps import gaps_by_rank
from schedules.schedule import Schedule
from schedules.trace import Trace


def busy_per_rank(trace: Trace) -> list[float]:
    """Compute seconds of each rank (the ``compute`` stream)."""
    return [rank.busy for rank in step_metrics(trace).ranks]


def _busy_and_bubble(trace: Trace) -> tuple[list[float], float]:
    """Each rank's compute seconds, and the ranks' pipeline bubble summed (waiting for a
    peer's data, fill and drain: ``schedules.accounting``)."""
    ranks = step_metrics(trace).ranks
    return [rank.busy for rank in ranks], sum(rank.bubble for rank in ranks)


# A comparison is judged by errors of a few percent (docs/calibration.md), so a run whose
# own steps differ by more than that cannot tell a good prediction from a bad one.
MIN_STEPS = 5  # kept steps below which a spread says little
SPREAD_LIMIT = 0.05  # interquartile range of the kept steps over their median
STRETCH_LIMIT = 0.05  # compute slower (or faster) in the run than profiled, beyond which to say so
TRANSFER_LIMIT = 2.0  # predicted over measured seconds per transfer (or its inverse) beyond which to say so


def kept_steps(step_times: list[float], warmup_steps: int) -> list[float]:
    """The step times after the first ``warmup_steps`` (all of them if fewer)."""
    if not step_times:
        raise ValueError("the run recorded no step times")
    return step_times[warmup_steps:] or list(step_times)


def traced_step(trace: Trace, step_times: list[float]) -> int:
    """The index in ``step_times`` of the step ``trace`` holds: ``meta["step"]`` where the
    executor wrote it, else the last step (the one it keeps)."""
    step = trace.meta.get("step")
    step = len(step_times) - 1 if step is None else int(step)
    if not 0 <= step < len(step_times):
        raise ValueError(f"the measured Trace holds step {step}, but the run recorded {len(step_times)} step times")
    return step


def measured_step_time(step_times: list[float], warmup_steps: int) -> float:
    """Median of the step times after the first ``warmup_steps`` (all of them if fewer)."""
    return statistics.median(kept_steps(step_times, warmup_steps))


def step_spread(kept: list[float]) -> dict[str, float]:
    """How much the kept steps differ: min, quartiles, max, and the interquartile range
    over the median (``relative_spread``), which one slow step does not set (quartiles
    by linear interpolation between the sorted steps)."""
    ordered = sorted(kept)
    if len(ordered) == 1:
        q1 = q3 = ordered[0]
    else:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    median = statistics.median(ordered)
    return {"min": ordered[0], "q1": q1, "median": median, "q3": q3, "max": ordered[-1],
            "relative_spread": (q3 - q1) / median if median > 0 else 0.0}


def reliability_warnings(spread: dict[str, float], steps: int, load: float | None, cores: int | None,
                         world_size: int) -> list[str]:
    """Why a comparison may say more about the machine than about the model, one line
    each: too few steps to know their spread, steps that differ by more than the errors
    the comparison is judged by, or a machine with more runnable work than cores (the
    1-minute load average, the run's own ``world_size`` ranks included) on which ranks
    share cores, which the cluster model does not describe (one device per rank)."""
    warnings = []
    if steps < MIN_STEPS:
        warnings.append(f"only {steps} steps measured after the warm-up: too few to know their spread "
                        f"(take --steps {MIN_STEPS + 1} or more)")
    if spread["relative_spread"] > SPREAD_LIMIT:
        warnings.append(f"the steps' interquartile range is {spread['relative_spread']:.1%} of their median "
                        f"(over {SPREAD_LIMIT:.0%}): the run is too noisy for an error of a few percent to mean much")
    if load is not None and cores and load > cores:
        warnings.append(f"machine load {load:.1f} on {cores} cores (this run: {world_size} ranks): ranks share "
                        "cores with other work, which the prediction does not model")
    return warnings


# the simulator's streams of what the executor runs inside its compute actions (timed
# apart there: executor.gather.INSIDE_STREAMS)
INSIDE_COMPUTE = ("tp", "ep", "cp")


def compute_stretch(measured_busy: list[float], predicted_busy: list[float]) -> list[float | None]:
    """Each rank's compute seconds in the run over those predicted (with the tp
    collectives, ep all-to-alls and ring waits the executor runs inside its compute actions,
    ``INSIDE_COMPUTE``; None where nothing was
    predicted): above 1 the same actions ran slower in the run than in the profile,
    the usual reason a prediction falls short on a CPU whose cores the ranks share with
    each other, the backend's threads or other work."""
    return [measured / predicted if predicted > 0 else None
            for measured, predicted in zip(measured_busy, predicted_busy, strict=True)]


def stretch_warnings(stretch: list[float | None]) -> list[str]:
    """One line when some rank's compute ran more than ``STRETCH_LIMIT`` slower or
    faster in the run than its costs say: the error is then the compute's, not the
    schedule's or the links'."""
    known = [(rank, value) for rank, value in enumerate(stretch) if value is not None]
    off = [(rank, value) for rank, value in known if abs(value - 1) > STRETCH_LIMIT]
    if not off:
        return []
    listed = ", ".join(f"rank {rank} x{value:.2f}" for rank, value in off)
    return [f"compute ran at another speed in the run than in the profile ({listed}: measured over predicted busy "
            "time); on a CPU the cores were shared differently (other work, more ranks than cores): calibrate on the "
            "run's own steps (--calibration run, the default) or profile again in the same conditions"]


def transfer_warnings(deliveries: dict | None) -> list[str]:
    """One line when the links price the transfers a rank waited through at more than
    ``TRANSFER_LIMIT`` times what they took in the run, or less than its inverse
    (``p2p_deliveries``): the error is then partly the links'. On a CPU with more ranks
    than cores the link benchmark's exchanges (every rank at once, after a barrier, the
    slowest rank's time) wait for cores that a run's transfers mostly find free."""
    if not deliveries or deliveries["measured"] <= 0 or deliveries["predicted"] <= 0:
        return []
    ratio = deliveries["predicted"] / deliveries["measured"]
    if 1 / TRANSFER_LIMIT <= ratio <= TRANSFER_LIMIT:
        return []
    each = f"{deliveries['predicted'] * 1e3:.3f} against {deliveries['measured'] * 1e3:.3f} ms each"
    return [f"the links priced the run's transfers at {ratio:.2f}x what they took ({each}, post to arrival, over "
            f"the {deliveries['transfers']} a rank waited through): the step error is partly the links'; on a CPU "
            "the link benchmark's exchanges wait for cores (every rank at once) that the run's transfers mostly find "
            "free"]


def launch_overheads(schedule: Schedule, costs: Costs) -> list[float]:
    """Seconds of ``costs.action_overhead`` the simulation of ``schedule`` charges inside
    each rank's compute events: one per compute action, one per overlapped pair whose
    measured ``overlap_fb`` replaces its two halves (``Costs.overlap_seconds``)."""
    charged = []
    for rank, program in enumerate(schedule.programs):
        launches = sum(1 for action in program if action.kind in COMPUTE_KINDS)
        if costs.pairs_overlap:
            launches -= sum(1 for forward, _ in schedule.fused_pairs(rank) if costs.stages[forward.stage].overlap_fb)
        charged.append(launches * costs.action_overhead)
    return charged


def runtime_per_rank(measured: Trace, schedule: Schedule, costs: Costs) -> list[tuple[float, float]]:
    """Per rank, (measured, predicted) seconds of the runtime's own time between its first
    and last compute action: its loop, its P2P posts and what each wait costs beyond
    being blocked. Measured: the gaps between the rank's compute events, less the time
    its marked waits (``recv`` events: buffered P2P marks each receive's wait) cover.
    Predicted: what the costs charge there, ``action_overhead`` per compute action after
    the first and ``comm_overhead`` per SEND/RECV between the first and the last. Set
    beside busy, this tells a runtime the costs under- or over-price from compute that
    ran at another speed and from waits the simulator got wrong; read only where the
    waits are marked (under rendezvous a receive's event spans its whole group)."""
    pairs = []
    for samples in gaps_by_rank(schedule, measured, waits_timed=True):
        posts = sum(posted for _, posted, _ in samples)
        pairs.append((sum(seconds for seconds, _, _ in samples),
                      len(samples) * costs.action_overhead + posts * costs.comm_overhead))
    return pairs


def p2p_deliveries(measured: Trace, predicted: Trace, posting: float = 0.0) -> dict | None:
    """The transfers a rank waited through from before their send was posted, measured
    (the wait's end less the send's post: the post, the wire and waking the receiver)
    against what the simulator charges the same transfers (the post, ``posting``
    seconds, then its send event: departure to arrival): their count and mean seconds.
    Only these transfers show their whole delivery in a Trace (an earlier one arrived
    unseen); only a measured Trace on one timeline (``one_timeline`` in its meta: CPU
    ranks on one host) can set one rank's wait against another's post. None when there
    is no such transfer or timeline."""
    if not measured.meta.get("one_timeline"):
        return None

    def sends(trace: Trace) -> dict:
        return {event.action: event for event in trace.events if event.stream == "send"}

    posted, charged = sends(measured), sends(predicted)
    pairs = []
    for event in measured.events:
        if event.stream != "recv":
            continue
        key = str(Action(event.stage, event.kind, event.microbatch).matching())  # the SEND that feeds it
        send, predicted_send = posted.get(key), charged.get(key)
        if send is not None and predicted_send is not None and event.start <= send.start:
            pairs.append((event.end - send.start, posting + predicted_send.end - predicted_send.start))
    if not pairs:
        return None
    return {"transfers": len(pairs), "measured": statistics.fmean(m for m, _ in pairs),
            "predicted": statistics.fmean(p for _, p in pairs)}


def compare(measured: Trace, step_times: list[float], predicted: Trace, predicted_step_time: float,
            warmup_steps: int = 1, load: float | None = None, cores: int | None = None,
            world_size: int | None = None, overheads: list[float] | None = None,
            runtime: list[tuple[float, float]] | None = None, posting: float = 0.0) -> dict:
    """The comparison document (``pipesim compare --json``). ``load`` is the machine's
    1-minute load average at the end of the run, ``cores`` its CPU count (None: not
    known) and ``world_size`` the run's processes (default: its pipeline ranks); they
    only feed the warnings. The measured busy, idle and bubble are of the step
    ``measured`` holds (``traced_step``), against that step's time in ``step_times``.
    ``overheads``: each rank's seconds of launch overhead inside the predicted compute
    events (``launch_overheads``), left out of its predicted busy."""
    kept = kept_steps(step_times, warmup_steps)
    measured_time = statistics.median(kept)
    spread = step_spread(kept)
    # the step the measured Trace holds, whose busy and bubble are set against its own time
    traced = traced_step(measured, step_times)
    traced_time = step_times[traced]
    measured_busy, measured_bubble = _busy_and_bubble(measured)
    predicted_busy, predicted_bubble = _busy_and_bubble(predicted)
    ranks = max(len(measured_busy), len(predicted_busy))
    measured_busy += [0.0] * (ranks - len(measured_busy))
    predicted_busy += [0.0] * (ranks - len(predicted_busy))
    # the executor's compute actions hold the tp collectives, ep all-to-alls and ring
    # attention's waits issued inside them, which the simulator charges on streams of
    # their own: compared like with like
    held_inside = [0.0] * ranks
    for event in predicted.events:
        if event.stream in INSIDE_COMPUTE and event.rank < ranks:
            held_inside[event.rank] += event.duration
    charged = list(overheads or []) + [0.0] * (ranks - len(overheads or []))
    predicted_busy = [busy + held - launch for busy, held, launch in zip(predicted_busy, held_inside, charged,
                                                                         strict=True)]
    meta = measured.meta
    collectives = held_collectives(measured, predicted, ranks)
    deliveries = p2p_deliveries(measured, predicted, posting)
    return {
        "schedule": meta.get("schedule"),
        "pp": meta.get("pp"),
        "microbatches": meta.get("microbatches"),
        "virtual_stages": meta.get("virtual_stages"),
        "measured_step_time": measured_time,
        "predicted_step_time": predicted_step_time,
        "error": (predicted_step_time - measured_time) / measured_time,
        "measured_step_times": list(step_times),
        "warmup_steps": warmup_steps,
        "measured_step_time_spread": spread,
        "measured_traced_step": traced,
        "measured_traced_step_time": traced_time,
        "load_average": load,
        "cores": cores,
        "compute_stretch": (stretch := compute_stretch(measured_busy, predicted_busy)),
        "warnings": reliability_warnings(spread, len(kept), load, cores, world_size or ranks)
        + stretch_warnings(stretch) + transfer_warnings(deliveries),
        "measured_bubble_fraction": measured_bubble / (ranks * traced_time),
        "predicted_bubble_fraction": predicted_bubble / (ranks * predicted_step_time),
        "measured_idle_fraction": 1 - sum(measured_busy) / (ranks * traced_time),
        "predicted_idle_fraction": 1 - sum(predicted_busy) / (ranks * predicted_step_time),
        **({"held_collectives": collectives} if collectives else {}),
        **({"p2p_deliveries": deliveries} if deliveries else {}),
        "ranks": [
            {
                "rank": rank,
                "measured_busy": measured_busy[rank],
                "predicted_busy": predicted_busy[rank],
                "measured_idle": traced_time - measured_busy[rank],
                "predicted_idle": predicted_step_time - predicted_busy[rank],
                **({"measured_runtime": runtime[rank][0], "predicted_runtime": runtime[rank][1]}
                   if runtime is not None and rank < len(runtime) else {}),
            }
            for rank in range(ranks)
        ],
    }


# what each stream of INSIDE_COMPUTE holds a rank for, as the report names it
HELD_NAMES = {"tp": "tp collectives", "ep": "all-to-alls", "cp": "ring waits"}


def held_collectives(measured: Trace, predicted: Trace, ranks: int) -> dict[str, dict]:
    """Per stream of ``INSIDE_COMPUTE`` that either side has, the seconds it held the
    first ``ranks`` ranks in the measured step (the Trace's, the step drawn) and in the
    predicted one, and how many the run timed (``count``): the simulator charges one
    event per action for what the run times collective by collective, so the sums are
    what compare, and a sum over ``count`` is the mean of one."""
    held: dict[str, dict] = {}
    for side, trace in (("measured", measured), ("predicted", predicted)):
        for event in trace.events:
            if event.stream in INSIDE_COMPUTE and event.rank < ranks:
                entry = held.setdefault(event.stream, {"measured": 0.0, "predicted": 0.0, "count": 0})
                entry[side] += event.duration
                entry["count"] += side == "measured"
    return {stream: held[stream] for stream in INSIDE_COMPUTE if stream in held}


def held_lines(document: dict) -> list[str]:
    """One report line per stream of ``held_collectives``."""
    lines = []
    for stream, held in document.get("held_collectives", {}).items():
        each = (f": {held['measured'] / held['count'] * 1e3:.3f} / {held['predicted'] / held['count'] * 1e3:.3f} ms "
                "each" if held["count"] else "")
        lines.append(f"  {stream:<11} measured {held['measured'] * 1e3:9.2f} ms   predicted "
                     f"{held['predicted'] * 1e3:9.2f} ms   ({held['count']} {HELD_NAMES[stream]} in the drawn step"
                     f"{each})")
    return lines


def delivery_lines(document: dict) -> list[str]:
    """The ``p2p`` line: the transfers a rank waited through, per transfer, measured
    against predicted (``p2p_deliveries``)."""
    deliveries = document.get("p2p_deliveries")
    if not deliveries:
        return []
    return [f"  p2p         measured {deliveries['measured'] * 1e3:9.3f} ms   predicted "
            f"{deliveries['predicted'] * 1e3:9.3f} ms   (per transfer, post to arrival: the "
            f"{deliveries['transfers']} a rank waited through)"]


def add_spread(document: dict, predicted_times) -> dict:
    """``document`` with the spread of the step time beside the prediction's under the
    what-if flags (``predicted_times``: the sampled steps): measured p50/p90/p99 over the
    kept steps, predicted over the samples, both as order statistics."""
    from pipesim.sim.whatif import step_quantiles

    kept = document["measured_step_times"][document["warmup_steps"]:] or document["measured_step_times"]
    document["measured_step_time_quantiles"] = step_quantiles(kept)
    document["predicted_step_time_quantiles"] = step_quantiles(predicted_times)
    document["predicted_samples"] = len(predicted_times)
    return document


def spread_line(document: dict) -> str:
    """The measured steps' spread and the machine's load, as one report line."""
    kept = kept_steps(document["measured_step_times"], document["warmup_steps"])
    # a document written before the spread was part of it: taken from its steps
    spread = document.get("measured_step_time_spread") or step_spread(kept)
    load = "" if document.get("load_average") is None else (
        f"   load {document['load_average']:.1f} on {document['cores']} cores")
    return (f"  spread      {len(kept)} steps: min {spread['min'] * 1e3:.2f}  q1 {spread['q1'] * 1e3:.2f}  "
            f"q3 {spread['q3'] * 1e3:.2f}  max {spread['max'] * 1e3:.2f} ms   "
            f"IQR {spread['relative_spread']:.1%} of the median{load}")


def traced_line(document: dict) -> list[str]:
    """Which step the measured bubble, idle and busy are of, and its time (none for a
    document written before they were set against it)."""
    if "measured_traced_step" not in document:
        return []
    return [f"  traced      step {document['measured_traced_step']}, "
            f"{document['measured_traced_step_time'] * 1e3:.2f} ms: the measured bubble, idle and busy below are "
            "this step's"]


def report_lines(document: dict) -> list[str]:
    """The comparison for the terminal, in milliseconds."""
    lines = [
        f"{document['schedule']}: pp={document['pp']} microbatches={document['microbatches']} "
        f"virtual_stages={document['virtual_stages']}",
        f"  step time   measured {document['measured_step_time'] * 1e3:9.2f} ms   "
        f"predicted {document['predicted_step_time'] * 1e3:9.2f} ms   error {document['error']:+.1%}",
        spread_line(document),
        *traced_line(document),
        f"  bubble      measured {document['measured_bubble_fraction']:9.1%}      "
        f"predicted {document['predicted_bubble_fraction']:9.1%}   (waiting for a peer, fill and drain)",
        f"  idle        measured {document['measured_idle_fraction']:9.1%}      "
        f"predicted {document['predicted_idle_fraction']:9.1%}   (not computing)",
        *held_lines(document),
        *delivery_lines(document),
    ]
    if "predicted_step_time_quantiles" in document:
        measured, predicted = document["measured_step_time_quantiles"], document["predicted_step_time_quantiles"]
        kept = max(len(document["measured_step_times"]) - document["warmup_steps"], 0) or len(
            document["measured_step_times"])
        for name in measured:
            lines.append(f"  {name:<11} measured {measured[name] * 1e3:9.2f} ms   "
                         f"predicted {predicted[name] * 1e3:9.2f} ms   "
                         f"({kept} steps / {document['predicted_samples']} sampled steps)")
    lines.extend(f"  warning: {warning}" for warning in document.get("warnings", ()))
    for rank in document["ranks"]:
        lines.append(f"  rank {rank['rank']}: busy {rank['measured_busy'] * 1e3:8.2f} / "
                     f"{rank['predicted_busy'] * 1e3:8.2f} ms"
                     f"   idle {rank['measured_idle'] * 1e3:8.2f} / {rank['predicted_idle'] * 1e3:8.2f} ms"
                     + (f"   runtime {rank['measured_runtime'] * 1e3:7.2f} / {rank['predicted_runtime'] * 1e3:7.2f} ms"
                        if "measured_runtime" in rank else "")
                     + "  (measured / predicted)")
    return lines
