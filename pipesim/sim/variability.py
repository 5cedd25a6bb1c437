"""What varies from one step to the next: jitter, stragglers and slow links, as draws.

A ``Variability`` says how a step's times spread; ``SampleDraws`` are one step's
multipliers of the engine's inputs, drawn from it. The rules, written once here:

- **jitter**: each action's time is its cost times a lognormal factor of mean 1 and the
  given coefficient of variation (CV), per compute kind (``F``, ``B``, ``I``, ``W``) and
  for P2P transfers (``comm``: the seconds the transfer's bytes occupy its links and the
  latency on top, both scaled). A lognormal is positive and right-skewed, the shape of
  measured kernel and transfer times; with mean 1 the expected step cost is unchanged, so
  what moves the step is the variation itself.
- **stragglers**: a straggling pipeline rank's compute actions (F, B, I, W, overlapped
  pairs) take ``factor`` times their cost. Its collectives (tp/ep/cp holds, dp
  reductions) and its transfers keep their link-bound time: what a straggler costs the
  others in them is the wait for its late compute, which the walk produces itself. A
  pipeline rank stands for its tp group, whose GPUs compute in lockstep, so one slow GPU
  slows the group: under ``--stragglers FRACTION:FACTOR`` each rank straggles with
  probability ``1 - (1 - FRACTION) ** tp``. The other dp replicas are taken to run as
  the simulated one does. A rank named and drawn keeps the larger factor.
- **slow links**: the transfers between pipeline ranks A and B (both ways) take
  ``factor`` times their time on the wire (occupancy and latency).

Each sample draws from its own generator, seeded by ``(seed, sample)``, so sample ``i``
can be drawn again alone (the Gantt of the median step) and the compiled engine and the
SimPy specification can be handed identical draws. A CV of 0 and a factor of 1 multiply
by exactly 1.0: the deterministic step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from schedules import dataflow
from schedules.engine import COMPUTE_KINDS, EngineProgram, WireArrays

JITTER_KINDS = (*COMPUTE_KINDS, "comm")


@dataclass(frozen=True)
class Variability:
    """How a step's times vary (see the module). ``jitter``: CV per kind of
    ``JITTER_KINDS``; ``stragglers``: ``{rank: factor}``; ``straggler_share``:
    ``(fraction, factor)`` of GPUs drawn per sample; ``slow_links``:
    ``{(rank_a, rank_b): factor}`` (a < b); ``samples`` steps drawn from ``seed``."""

    jitter: Mapping[str, float] = field(default_factory=dict)
    stragglers: Mapping[int, float] = field(default_factory=dict)
    straggler_share: tuple[float, float] | None = None
    slow_links: Mapping[tuple[int, int], float] = field(default_factory=dict)
    samples: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        for kind, cv in self.jitter.items():
            if kind not in JITTER_KINDS:
                raise ValueError(f"--jitter {kind}={cv}: unknown kind {kind!r}; use {', '.join(JITTER_KINDS)}")
            check_number(cv, f"--jitter {kind}", "a coefficient of variation >= 0", minimum=0.0)
        for rank, factor in self.stragglers.items():
            check_number(factor, f"--straggler {rank}:{factor}", "a slowdown factor > 0", exclusive=True)
        if self.straggler_share is not None:
            fraction, factor = self.straggler_share
            flag = f"--stragglers {fraction}:{factor}"
            check_number(fraction, flag, "a fraction of GPUs between 0 and 1", minimum=0.0, maximum=1.0)
            check_number(factor, flag, "a slowdown factor > 0", exclusive=True)
        for (rank_a, rank_b), factor in self.slow_links.items():
            check_number(factor, f"--slow-link {rank_a}-{rank_b}:{factor}", "a slowdown factor > 0", exclusive=True)
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"--samples must be a whole number >= 1, got {self.samples!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"--seed must be a whole number >= 0, got {self.seed!r}")

    @property
    def varies(self) -> bool:
        """Whether anything here changes a step (else every sample is the deterministic one)."""
        return (any(cv > 0 for cv in self.jitter.values()) or any(f != 1 for f in self.stragglers.values())
                or any(f != 1 for f in self.slow_links.values())
                or (self.straggler_share is not None and self.straggler_share[0] > 0
                    and self.straggler_share[1] != 1))

    def check_layout(self, pp: int, links: Sequence[tuple[int, int]]) -> None:
        """Refuse ranks a pipeline of ``pp`` ranks does not have, and slow links no
        transfer crosses (``links``: the rank pairs transfers go between)."""
        for rank, factor in self.stragglers.items():
            if not 0 <= rank < pp:
                raise ValueError(f"--straggler {rank}:{factor}: rank {rank} is out of range; the pipeline has ranks "
                                 f"0..{pp - 1}")
        crossed = {tuple(sorted(pair)) for pair in links}
        for pair, factor in self.slow_links.items():
            if pair not in crossed:
                named = ", ".join(f"{a}-{b}" for a, b in sorted(crossed)) or "none"
                raise ValueError(f"--slow-link {pair[0]}-{pair[1]}:{factor}: no transfer goes between ranks "
                                 f"{pair[0]} and {pair[1]}; the pipeline's links are {named}")


def check_number(value: float, flag: str, what: str, minimum: float = 0.0, maximum: float | None = None,
                 exclusive: bool = False) -> None:
    """A one-line error naming ``flag`` unless ``value`` is a finite number in range."""
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else float("nan")
    if (not math.isfinite(number) or number < minimum or (exclusive and number == minimum)
            or (maximum is not None and number > maximum)):
        raise ValueError(f"{flag}: must be {what}, got {value!r}")


# -- the flags' text ------------------------------------------------------------------------


def parse_jitter(text: str) -> dict[str, float]:
    """``0.05`` (every kind, transfers included) or ``F=0.05,B=0.08,comm=0.2``."""
    if "=" not in text:
        cv = _number(text, f"--jitter {text}", "a coefficient of variation (0.05) or KIND=CV,... (F=0.05,comm=0.2)")
        check_number(cv, f"--jitter {text}", "a coefficient of variation >= 0")
        return dict.fromkeys(JITTER_KINDS, cv)
    jitter: dict[str, float] = {}
    for part in text.split(","):
        kind, _, value = part.partition("=")
        kind = kind.strip()
        if kind not in JITTER_KINDS:
            raise ValueError(f"--jitter {text}: unknown kind {kind!r}; use {', '.join(JITTER_KINDS)}")
        jitter[kind] = _number(value, f"--jitter {text}", f"a coefficient of variation for {kind}")
        check_number(jitter[kind], f"--jitter {text}", f"a coefficient of variation >= 0 for {kind}")
    return jitter


def parse_straggler(text: str) -> tuple[int, float]:
    """``RANK:FACTOR``, e.g. ``3:1.5``."""
    rank, factor = _pair(text, "--straggler", "RANK:FACTOR, e.g. 3:1.5")
    if not rank.strip().isdigit():
        raise ValueError(f"--straggler {text}: the rank must be a whole number >= 0, got {rank!r}")
    slowdown = _number(factor, f"--straggler {text}", "a slowdown factor")
    check_number(slowdown, f"--straggler {text}", "a slowdown factor > 0", exclusive=True)
    return int(rank), slowdown


def parse_straggler_share(text: str) -> tuple[float, float]:
    """``FRACTION:FACTOR``, e.g. ``0.01:1.5``."""
    fraction, factor = _pair(text, "--stragglers", "FRACTION:FACTOR, e.g. 0.01:1.5")
    flag = f"--stragglers {text}"
    share, slowdown = _number(fraction, flag, "a fraction of GPUs"), _number(factor, flag, "a slowdown factor")
    check_number(share, flag, "a fraction of GPUs between 0 and 1", maximum=1.0)
    check_number(slowdown, flag, "a slowdown factor > 0", exclusive=True)
    return share, slowdown


def parse_slow_link(text: str) -> tuple[tuple[int, int], float]:
    """``A-B:FACTOR`` between pipeline ranks A and B, e.g. ``3-4:2``."""
    link, factor = _pair(text, "--slow-link", "A-B:FACTOR, e.g. 3-4:2")
    ends = link.split("-")
    if len(ends) != 2 or not all(end.strip().isdigit() for end in ends) or ends[0].strip() == ends[1].strip():
        raise ValueError(f"--slow-link {text}: the link must be two different ranks A-B, e.g. 3-4:2")
    rank_a, rank_b = sorted(int(end) for end in ends)
    slowdown = _number(factor, f"--slow-link {text}", "a slowdown factor")
    check_number(slowdown, f"--slow-link {text}", "a slowdown factor > 0", exclusive=True)
    return (rank_a, rank_b), slowdown


def _pair(text: str, flag: str, form: str) -> tuple[str, str]:
    left, colon, right = text.partition(":")
    if not colon or not left.strip() or not right.strip():
        raise ValueError(f"{flag} {text}: expected {form}")
    return left, right


def _number(text: str, flag: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{flag}: expected {what}, got {text.strip()!r}") from None


# -- the draws ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleDraws:
    """One sample's multipliers: per compute row of the program (jitter times its rank's
    straggler factor), per transfer key (comm jitter times its slow link's factor; None:
    every transfer 1, so the per-wire arrays are used as they are), and the straggler
    factor each rank drew."""

    compute: np.ndarray
    transfer: np.ndarray | None
    rank_factor: np.ndarray


class Sampler:
    """Draws ``SampleDraws`` for one compiled program (what depends on the program alone
    is worked out once: each row's CV, each transfer's slow-link factor)."""

    def __init__(self, program: EngineProgram, variability: Variability, tp: int = 1) -> None:
        self.program, self.variability = program, variability
        cv = np.array([variability.jitter.get(kind, 0.0) for kind in COMPUTE_KINDS])
        self.compute_sigma = lognormal_sigma(cv)[program.compute_kind]
        self.comm_sigma = float(lognormal_sigma(np.array([variability.jitter.get("comm", 0.0)]))[0])
        self.fixed_rank_factor = np.ones(program.ranks)
        for rank, factor in variability.stragglers.items():
            self.fixed_rank_factor[rank] = factor
        share = variability.straggler_share
        self.rank_straggle_chance = 1 - (1 - share[0]) ** tp if share else 0.0
        self.link_factor = transfer_link_factors(program, variability.slow_links)

    def draw(self, sample: int) -> SampleDraws:
        """Sample ``sample``'s multipliers: always the same for the same seed and sample."""
        rng = np.random.default_rng([self.variability.seed, sample])
        compute = lognormal_factors(rng, self.compute_sigma)
        transfer = None
        if self.comm_sigma > 0:
            transfer = lognormal_factors(rng, np.full(self.program.arrays.transfers, self.comm_sigma))
        if self.link_factor is not None:
            transfer = self.link_factor if transfer is None else transfer * self.link_factor
        rank_factor = self.fixed_rank_factor
        if self.rank_straggle_chance > 0:
            drawn = rng.random(self.program.ranks) < self.rank_straggle_chance
            rank_factor = np.where(drawn, np.maximum(rank_factor, self.variability.straggler_share[1]), rank_factor)
        return SampleDraws(compute * rank_factor[self.program.compute_rank], transfer, rank_factor)


def lognormal_sigma(cv: np.ndarray) -> np.ndarray:
    """The log-space sigma of a lognormal with coefficient of variation ``cv``:
    ``CV^2 = exp(sigma^2) - 1``."""
    return np.sqrt(np.log1p(np.square(cv)))


def lognormal_factors(rng: np.random.Generator, sigma: np.ndarray) -> np.ndarray:
    """Lognormal factors of mean 1 (``exp(sigma z - sigma^2 / 2)``); exactly 1 where
    ``sigma`` is 0 (``exp(±0.0)`` is 1.0, and a normal draw is always finite)."""
    return np.exp(sigma * rng.standard_normal(len(sigma)) - np.square(sigma) / 2)


def transfer_ends(program: EngineProgram) -> tuple[np.ndarray, np.ndarray]:
    """Per transfer key, the sending and the receiving rank."""
    arrays = program.arrays
    placement = np.asarray(arrays.schedule.placement, dtype=np.int64)
    stage, direction, _ = dataflow.transfer_parts(np.arange(arrays.transfers), arrays.microbatches)
    target = np.clip(dataflow.receiving_stage(stage, direction), 0, len(placement) - 1)
    return placement[stage], placement[target]


def crossed_links(program: EngineProgram) -> list[tuple[int, int]]:
    """The rank pairs some transfer of the program goes between."""
    sender, receiver = transfer_ends(program)
    crossing = sender != receiver
    return sorted({tuple(sorted(pair)) for pair in zip(sender[crossing].tolist(), receiver[crossing].tolist(),
                                                       strict=True)})


def transfer_link_factors(program: EngineProgram, slow_links: Mapping[tuple[int, int], float]) -> np.ndarray | None:
    """Per transfer key, the factor of the slow link it crosses (1 elsewhere); None if no link is slow."""
    if not any(factor != 1 for factor in slow_links.values()):
        return None
    sender, receiver = transfer_ends(program)
    low, high = np.minimum(sender, receiver), np.maximum(sender, receiver)
    factor = np.ones(program.arrays.transfers)
    for (rank_a, rank_b), slow in slow_links.items():
        factor[(low == rank_a) & (high == rank_b)] = slow
    return factor


class PerTransferWires:
    """``wires`` with one wire per transfer key (its wire's routes), laid out once; each
    sample then only scales every route's occupancy and latency by its transfer's factor
    (``scaled``). The engine reads transfer ``key``'s wire as wire ``key``: run it on the
    program with ``transfer_wire = arange(transfers)``."""

    def __init__(self, program: EngineProgram, wires: WireArrays) -> None:
        wire = program.transfer_wire
        routes = np.diff(wires.route_start)[wire]
        self.route_start = np.zeros(len(wire) + 1, dtype=np.int64)
        np.cumsum(routes, out=self.route_start[1:])
        # the routes of each transfer, in order: its wire's first route plus 0, 1, ...
        route = np.repeat(wires.route_start[:-1][wire] - self.route_start[:-1], routes) + np.arange(
            self.route_start[-1])
        links_per_route = np.diff(wires.link_start)[route]
        self.link_start = np.zeros(len(route) + 1, dtype=np.int64)
        np.cumsum(links_per_route, out=self.link_start[1:])
        link = np.repeat(wires.link_start[:-1][route] - self.link_start[:-1], links_per_route) + np.arange(
            self.link_start[-1])
        self.links = wires.links[link]
        self.occupancy, self.latency = wires.occupancy[route], wires.latency[route]
        self.route_transfer = np.repeat(np.arange(len(wire)), routes)
        self.link_count = wires.link_count

    def scaled(self, factor: np.ndarray) -> WireArrays:
        """The wires with each transfer's routes' occupancy and latency times ``factor[key]``."""
        route_factor = factor[self.route_transfer]
        return WireArrays(self.route_start, self.link_start, self.links, self.occupancy * route_factor,
                          self.latency * route_factor, self.link_count)


def per_transfer_wires(program: EngineProgram, wires: WireArrays, factor: np.ndarray) -> WireArrays:
    """``wires`` with one wire per transfer key, scaled by ``factor`` (``PerTransferWires``)."""
    return PerTransferWires(program, wires).scaled(factor)
