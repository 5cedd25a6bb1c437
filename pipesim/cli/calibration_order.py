"""When ``pipesim compare --calibration run`` runs its calibration steps and its timed
steps, all in one launch (the same processes), and how the measured result is put
together from the timed ones.

Why the order matters: the costs are read off the calibration steps and the error is
taken against the timed steps, so both must see the machine at the same speed. On a
shared CPU machine whose speed drifts over seconds, calibration steps run in two blocks
around the timed ones saw another machine than the timed steps did (the report's
``compute_stretch`` far from 1), and back-to-back compares of one config moved their
prediction more than their measured step.

- ``interleaved`` (the default): each timed step is a config of its own, of the same
  form as a calibration config (a fresh model, ``--warmup-steps`` warm-up steps, then
  the one step that counts), and the two kinds alternate (``c t c t ...``), so a slow
  spell falls on both alike. ``--steps S --warmup-steps W`` gives ``S - W`` timed
  configs of ``W + 1`` steps each: the timed steps are as many as the steps kept
  after the warm-up under ``around``.
- ``around``: half the calibration configs, then one timed config of ``--steps`` steps
  (the first ``--warmup-steps`` left out), then the rest: steps 2..S of one model.

Pure functions of counts and of the launched configs' results (no torch), so the
order and the merge are tested on hand-built inputs.
"""

from __future__ import annotations

import dataclasses

from schedules.trace import Trace

INTERLEAVED, AROUND = "interleaved", "around"
CALIBRATION_ORDERS = (INTERLEAVED, AROUND)
DEFAULT_CALIBRATION_ORDER = INTERLEAVED
CALIBRATION, TIMED = "calibration", "timed"


def check_order_steps(order: str, steps: int, warmup_steps: int) -> None:
    """Refuse, in one line, ``--steps`` and ``--warmup-steps`` that give an interleaved
    compare no timed step, or timed steps unlike the calibration steps (a fresh model's
    first step, which every calibration config leaves out as a warm-up)."""
    if order != INTERLEAVED:
        return
    if warmup_steps < 1:
        raise ValueError(f"--warmup-steps {warmup_steps} with --calibration-order interleaved would time each fresh "
                         "model's first step, which the calibration steps leave out: take --warmup-steps 1 or more, "
                         "or --calibration-order around")
    if steps <= warmup_steps:
        raise ValueError(f"--steps {steps} with --warmup-steps {warmup_steps} leaves no timed step "
                         "(--calibration-order interleaved times --steps minus --warmup-steps steps, each after "
                         "warm-up steps of its own): "
                         f"take --steps {warmup_steps + 1} or more")


def timed_configs(config, order: str, warmup_steps: int) -> list:
    """The configs whose steps are timed: under ``around`` the run's own config (all its
    ``steps``), under ``interleaved`` ``steps - warmup_steps`` configs of
    ``warmup_steps + 1`` steps each."""
    if order == AROUND:
        return [config]
    check_order_steps(order, config.steps, warmup_steps)
    return [dataclasses.replace(config, steps=warmup_steps + 1) for _ in range(config.steps - warmup_steps)]


def launch_order(calibration: int, timed: int, order: str) -> list[tuple[str, int]]:
    """The configs in the order they are launched, as ``(CALIBRATION, i)`` and ``(TIMED,
    j)``. ``around``: the first ``ceil(calibration / 2)`` calibration configs, every timed
    one, then the rest. ``interleaved``: each kind spread evenly over the launch (the
    i-th of n at ``(i + 1/2) / n`` of the way, a calibration config first on a tie), so
    equal counts alternate ``c t c t ...``."""
    if order not in CALIBRATION_ORDERS:
        raise ValueError(f"--calibration-order must be one of {', '.join(CALIBRATION_ORDERS)}, got {order!r}")
    if calibration < 1 or timed < 1:
        raise ValueError(f"need a calibration config and a timed one, got {calibration} and {timed}")
    if order == AROUND:
        before = -(-calibration // 2)
        return ([(CALIBRATION, i) for i in range(before)] + [(TIMED, j) for j in range(timed)]
                + [(CALIBRATION, i) for i in range(before, calibration)])
    # (2i + 1) / 2n compared as integers: (2i + 1) * other count, exact for any counts
    places = [((2 * i + 1) * timed, 0, CALIBRATION, i) for i in range(calibration)]
    places += [((2 * j + 1) * calibration, 1, TIMED, j) for j in range(timed)]
    return [(kind, index) for _, _, kind, index in sorted(places)]


def split_results(order: list[tuple[str, int]], results: list[dict]) -> tuple[list[dict], list[dict]]:
    """The launched configs' results (one per entry of ``order``, in launch order) as
    (calibration results, timed results), each in its own index order."""
    if len(order) != len(results):
        raise ValueError(f"launched {len(order)} configs but got {len(results)} results")
    calibration = {index: result for (kind, index), result in zip(order, results, strict=True) if kind == CALIBRATION}
    timed = {index: result for (kind, index), result in zip(order, results, strict=True) if kind == TIMED}
    return [calibration[i] for i in sorted(calibration)], [timed[j] for j in sorted(timed)]


def median_index(times: list[float]) -> int:
    """The index of the median of ``times`` (the lower of the two middle ones for an even
    count, the earlier of equal ones): a step that ran, whose Trace can be drawn."""
    ordered = sorted(range(len(times)), key=lambda index: (times[index], index))
    return ordered[(len(ordered) - 1) // 2]


def merged_timed_result(timed: list[dict]) -> dict:
    """The measured result of an interleaved compare, as a single timed config's result
    reads: ``step_times`` the last step of each timed config (the warm-up steps before
    it under ``warmup_step_times``, one list per config), ``losses`` the same steps'
    losses, and the Trace and memory of the config whose timed step is the median one
    (what the report's busy, bubble and memory and the chart read), its ``meta.step``
    that step's index in ``step_times``."""
    if not timed:
        raise ValueError("no timed config to merge")
    times = [result["step_times"][-1] for result in timed]
    chosen = median_index(times)
    trace = timed[chosen]["trace"]
    return {**timed[chosen], "step_times": times,
            "warmup_step_times": [list(result["step_times"][:-1]) for result in timed],
            "losses": [result["losses"][-1] for result in timed],
            "trace": Trace(trace.events, {**trace.meta, "step": chosen, "timed_configs": len(timed)})}
