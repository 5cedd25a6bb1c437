"""What an overlapped forward-and-backward pair costs (DualPipe's ``OVERLAP_F_B``).

DeepSeek-V3 (technical report, 2024, section 3.2.1) runs the forward of one chunk and
the backward of another together, their pieces rearranged so that the all-to-all of
one half (expert parallelism's dispatch and combine) runs while the other half
computes: its stated aim is to hide the all-to-all entirely. With each half's compute
(``C_F``, ``C_B``: the actions' own seconds) and all-to-all (``A_F``, ``A_B``: the ep
seconds that would hold the rank after each alone), a pair costs

    C_F + C_B + max(0, A_F - C_B) + max(0, A_B - C_F)

both halves' compute, then whatever of each half's all-to-all the other half's compute
does not cover; with the slowdown a collective costs the compute beside it
(``pipesim.sim.comm_overlap``), each ``max(0, A - C)`` is ``exposed_seconds(C, A)``.
The compute keeps its own time, so the Trace keeps each half's compute action as it is
and the uncovered all-to-all holds the rank after the pair (``ep``);
tensor-parallel collectives and the context-parallel K/V exchange stay where they are,
after their half. DeepSeek gives the communication 20 of the H800's 132 SMs, which slows
the compute beside it: the slowdown above stands for that (a measured pair, given as
``overlap_fb``, has it in it).

Where the costs give each MoE layer's experts apart (``expert_fwd``, ``expert_igrad``,
``expert_wgrad``: a model's costs) the pair is priced layer by layer, as Megatron-Core
runs combined 1F1B (``TransformerLayerSchedulePlan.run``, one forward layer with one
backward layer on a compute and a communication stream):

    comm:     combine_bwd | dispatch_fwd -> dispatch_bwd          | combine_fwd
    compute:  attn_fwd    | mlp_bwd (-> mlp_bwd_dw) -> mlp_fwd    | attn_bwd

three phases, each ending when both its streams are done; in the middle one the
backward's dispatch waits for the experts' input gradient (with their weight gradient
too, unless delayed: Megatron-Core's ``--delay-wgrad-compute``, ``Costs.delayed_wgrad``,
runs it after the dispatch has started, beside it) and the forward's experts for its
dispatch. ``mlp`` is the layer's experts,
``attn`` every other part of its half (the attention, the router and the
permutations; a stage's dense layers, head and embedding spread over its MoE layers as
the windows they also are), each all-to-all the half's ep seconds split between the
dispatch and the combine by their bytes. Compute beside an all-to-all runs at ``1 / (1 +
slowdown)`` of its speed, as everywhere (``pipesim.sim.comm_overlap``). A layer's
all-to-all can only hide under the part of the other half that runs beside it, so this
exposes more than the coarse rule above, which hides all of a half's all-to-alls under
all of the other's compute (and is what costs without the experts' seconds get). MoE
layers of one half beyond the other's run alone, their all-to-alls exposed. DualPipe's
pairs are priced the same way (DeepSeek-V3's Figure 4 overlaps the same four parts of
each half; the report gives no other order).

A pair whose cost is given (``overlap_fb`` in the costs) costs that, shared between its
halves in proportion to their own seconds; its all-to-alls are taken to be inside it.

Where the executor runs a pair's halves one after the other (on a CPU: costs with
``pairs_overlap`` false, as ``pipesim compare`` sets them from the run), nothing is
hidden: each half costs what it costs alone, and what holds the rank after it is its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pipesim.sim.comm_overlap import exposed_seconds
from schedules.action import ActionKind
from schedules.schedule import Schedule

# what holds a rank after a compute action, in the order the Trace shows it (ZeRO-3's
# parameter gathers hold none: they run on the dp channel in the engine's walk)
HOLD_PARTS = ("tp", "ep", "cp")


def overlapped_pairs(schedule: Schedule, costs, durations: Mapping,
                     holds: Mapping[str, Mapping[tuple[int, str], float]], slowdown: float = 0.0
                     ) -> tuple[dict[tuple, float], dict[tuple, tuple[float, ...]]]:
    """For the actions of every overlapped pair, keyed ``(stage, kind, microbatch)``: its
    seconds (where they differ from the action alone) and what holds the rank after it,
    by part of ``HOLD_PARTS`` (where it differs from the action alone: its ep hidden,
    each all-to-all beside the other half's compute slowing it by ``slowdown``)."""
    seconds: dict[tuple, float] = {}
    hold: dict[tuple, tuple[float, ...]] = {}
    if not costs.pairs_overlap:  # one half after the other: each as it is alone
        return seconds, hold
    ep = holds.get("ep", {})
    uncovered_of: dict[tuple[int, int, str], float] = {}  # per (forward stage, backward stage, kind): alike pairs
    for rank in range(schedule.pp):
        for forward, backward in schedule.fused_pairs(rank):
            alone_f, alone_b = durations[forward[0], forward[1]], durations[backward[0], backward[1]]
            given = costs.stages[forward.stage].overlap_fb
            if given or not ep:
                pair = costs.overlap_seconds(forward.stage, backward.stage, backward.kind)
                share = alone_f / (alone_f + alone_b) if alone_f + alone_b > 0 else 0.5
                seconds[tuple(forward)], seconds[tuple(backward)] = pair * share, pair * (1 - share)
                uncovered = 0.0
            else:
                key = (forward.stage, backward.stage, backward.kind)
                if key not in uncovered_of:
                    uncovered_of[key] = _uncovered(costs, key, alone_f, alone_b,
                                                   ep.get((forward.stage, ActionKind.F), 0.0),
                                                   ep.get((backward.stage, backward.kind), 0.0), slowdown)
                uncovered = uncovered_of[key]
            if ep:
                hold[tuple(forward)] = _parts(holds, forward.stage, forward.kind, 0.0)
                hold[tuple(backward)] = _parts(holds, backward.stage, backward.kind, uncovered)
    return seconds, hold


def _parts(holds: Mapping[str, Mapping[tuple[int, str], float]], stage: int, kind: str,
           all_to_all: float) -> tuple[float, ...]:
    """The hold of an action in a pair, by part: its own tp and cp, ``all_to_all`` for ep."""
    return tuple(all_to_all if part == "ep" else holds.get(part, {}).get((stage, kind), 0.0) for part in HOLD_PARTS)


def _uncovered(costs, key: tuple[int, int, str], alone_f: float, alone_b: float, all_to_all_f: float,
               all_to_all_b: float, slowdown: float) -> float:
    """What of a pair's all-to-alls its halves' compute does not hide (see the module):
    layer by layer where the costs give the experts apart, else each half's under the
    other's whole compute."""
    stage_f, stage_b = costs.stages[key[0]], costs.stages[key[1]]
    if layered(stage_f, stage_b, all_to_all_f, all_to_all_b):
        return layered_pair_seconds(
            HalfLayers.forward(stage_f, alone_f, all_to_all_f),
            HalfLayers.backward(stage_b, key[2], alone_b, all_to_all_b, costs.delayed_wgrad),
            slowdown) - alone_f - alone_b
    return exposed_seconds(alone_b, all_to_all_f, slowdown) + exposed_seconds(alone_f, all_to_all_b, slowdown)


def layered(stage_f, stage_b, all_to_all_f: float, all_to_all_b: float) -> bool:
    """Whether a pair of these stages is priced layer by layer: both halves' stages route
    tokens to experts, with their experts' seconds and all-to-alls known."""
    return all(stage.moe_layers >= 1 and stage.expert_fwd > 0 for stage in (stage_f, stage_b)) and (
        all_to_all_f > 0 or all_to_all_b > 0)


@dataclass(frozen=True)
class HalfLayers:
    """One half of an overlapped pair, per MoE layer (see the module): ``layers`` MoE
    layers, each with ``attention`` seconds of compute outside its experts, ``experts``
    seconds of its experts that the next all-to-all waits for (the forward's; the
    backward's input gradient, and in a full backward its weight gradient too, as
    Megatron-Core runs them unless delayed), ``delayed`` seconds of the experts' weight
    gradient run after that all-to-all has started (``--delay-wgrad``), and its two
    all-to-alls in the order the pass runs them (forward: dispatch, combine; backward:
    the combine's gradient, the dispatch's)."""

    layers: int
    attention: float
    experts: float
    first_all_to_all: float
    second_all_to_all: float
    delayed: float = 0.0

    @classmethod
    def forward(cls, stage, seconds: float, all_to_all: float) -> HalfLayers:
        """The forward half: the dispatch of ``dispatch_bytes``, then the combine."""
        layers = int(stage.moe_layers)
        dispatch, combine = _split(all_to_all / layers, stage.all_to_all_bytes)
        return cls(layers, max(0.0, seconds - layers * stage.expert_fwd) / layers, stage.expert_fwd, dispatch,
                   combine)

    @classmethod
    def backward(cls, stage, kind: str, seconds: float, all_to_all: float, delayed_wgrad: bool = False
                 ) -> HalfLayers:
        """The backward half (``B``, or ``I`` of a split backward, which runs no weight
        gradient): the combine's gradient toward the experts (``dispatch_bytes``), then
        the dispatch's back (``combine_bytes``); a full backward's experts' weight
        gradient before the dispatch's, or after it has started where ``delayed_wgrad``."""
        layers = int(stage.moe_layers)
        weight_grad = stage.expert_wgrad if kind == ActionKind.B else 0.0
        experts, delayed = (stage.expert_igrad, weight_grad) if delayed_wgrad else (
            stage.expert_igrad + weight_grad, 0.0)
        toward, back = _split(all_to_all / layers, stage.all_to_all_bytes)
        return cls(layers, max(0.0, seconds - layers * (experts + delayed)) / layers, experts, toward, back, delayed)


def _split(seconds: float, sizes: tuple[float, float]) -> tuple[float, float]:
    """``seconds`` of a layer's two all-to-alls shared in proportion to their bytes."""
    total = sum(sizes)
    return (seconds * sizes[0] / total, seconds * sizes[1] / total) if total > 0 else (seconds / 2, seconds / 2)


def layered_pair_seconds(forward: HalfLayers, backward: HalfLayers, slowdown: float) -> float:
    """Seconds of an overlapped pair priced layer by layer (see the module): the pairs of
    one forward and one backward MoE layer in three phases each, the MoE layers one half
    has beyond the other alone, their compute and all-to-alls one after the other."""
    paired = min(forward.layers, backward.layers)
    one = (two_streams([forward.attention], [backward.first_all_to_all], slowdown)
           + two_streams([backward.experts, backward.delayed, forward.experts],
                         [forward.first_all_to_all, backward.second_all_to_all],
                         slowdown, compute_waits={2: 0}, comm_waits={1: 0})
           + two_streams([backward.attention], [forward.second_all_to_all], slowdown))
    alone = sum((half.layers - paired) * (half.attention + half.experts + half.delayed + half.first_all_to_all
                                          + half.second_all_to_all) for half in (forward, backward))
    return paired * one + alone


def two_streams(compute: list[float], comm: list[float], slowdown: float, compute_waits: dict[int, int] | None = None,
                comm_waits: dict[int, int] | None = None) -> float:
    """Seconds until every task is done: ``compute`` tasks one after the other on one
    stream, ``comm`` tasks one after the other on another, compute ``i`` starting only
    once comm ``compute_waits[i]`` is done and comm ``j`` once compute ``comm_waits[j]``
    is; compute advances at ``1 / (1 + slowdown)`` of its speed while a comm task runs
    (``pipesim.sim.comm_overlap``)."""
    remaining = [list(compute), list(comm)]
    waits = (compute_waits or {}, comm_waits or {})
    position, now = [0, 0], 0.0  # each stream's current task: the ones before it are done

    def ready(stream: int) -> bool:
        task = position[stream]
        if task >= len(remaining[stream]):
            return False
        needed = waits[stream].get(task)
        return needed is None or needed < position[1 - stream]

    while True:
        running = [stream for stream in (0, 1) if ready(stream)]
        if not running:
            break
        rate = [1 / (1 + slowdown) if 1 in running else 1.0, 1.0]
        ends = {stream: remaining[stream][position[stream]] / rate[stream] for stream in running}
        stream_first = min(ends, key=ends.get)
        step = ends[stream_first]
        now += step
        for stream in running:
            task = position[stream]
            remaining[stream][task] = 0.0 if stream == stream_first else max(
                0.0, remaining[stream][task] - step * rate[stream])
            if remaining[stream][task] <= 0.0:
                position[stream] += 1
    if position != [len(compute), len(comm)]:
        raise ValueError(f"tasks wait on each other in a cycle: compute {compute_waits}, comm {comm_waits}")
    return now
