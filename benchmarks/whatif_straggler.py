"""How robust is zbv against 1F1B to one slow GPU at pp 16? The figures of docs/whatif.md.

Each schedule is simulated once (pp 16, m 32, F = 1 ms, B = 2 ms of which W = 1 ms, on
one rank's share of the model; the ideal cluster), then sampled with the published
magnitudes docs/whatif.md cites:

- jitter: every action's time with a coefficient of variation of 2% (the 1-2% diurnal
  throughput swing Meta measured on Llama 3 405B's 16K H100s, from clock scaling);
- a slow GPU: one rank's compute 1.34x slower (FALCON's 1.34x average job slowdown
  from fail-slows on a 10,000-GPU cluster, applied to the one rank that sets the pace),
  on the first, a middle and the last rank in turn, jitter on top.

Columns: the deterministic step, then mean and p99 of the sampled steps, and p99 over
the deterministic step. Below, the ranking by deterministic step against the ranking by
the slow-middle-rank p99, with Kendall's tau.

Run: ``python benchmarks/whatif_straggler.py`` (``--samples N``, default 500; about
10 s). The same for one case from the command line:
``pipesim simulate --schedule zbv --pp 16 -m 32 --fwd 1e-3 --bwd 2e-3 --wgrad 1e-3
--jitter 0.02 --straggler 8:1.34 --samples 500``.
"""

from __future__ import annotations

import argparse

import pipesim
from pipesim.plan.ranking import kendall_tau

SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zbv")
PP, MICROBATCHES = 16, 32
FWD, BWD, WGRAD = 1e-3, 2e-3, 1e-3
JITTER_CV = 0.02  # Llama 3: 1-2% diurnal throughput variation
SLOW_FACTOR = 1.34  # FALCON: fail-slows delay the average job 1.34x
SLOW_RANKS = (0, PP // 2, PP - 1)


def simulated(name: str):
    job = pipesim.Job(schedule=name, pp=PP, microbatches=MICROBATCHES, fwd=FWD, bwd=BWD, wgrad=WGRAD)
    return pipesim.simulate_job(job)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=500)
    args = parser.parse_args()
    cases = [("jitter 2%", {})] + [(f"rank {rank} x{SLOW_FACTOR}", {rank: SLOW_FACTOR}) for rank in SLOW_RANKS]
    print(f"pp={PP} m={MICROBATCHES} F={FWD * 1e3:g} ms B={BWD * 1e3:g} ms W={WGRAD * 1e3:g} ms, jitter CV "
          f"{JITTER_CV}, {args.samples} samples, seed 0; times in ms")
    header = f"{'schedule':<18}{'deterministic':>14}" + "".join(f"{label:>28}" for label, _ in cases)
    print(header)
    print(f"{'':<18}{'':>14}" + "".join(f"{'mean / p99 / p99 ratio':>28}" for _ in cases))
    deterministic, slow_middle_p99 = {}, {}
    for name in SCHEDULES:
        result = simulated(name)
        step = result.metrics.makespan
        deterministic[name] = step
        cells = []
        for _, stragglers in cases:
            whatif = pipesim.whatif(result, jitter=JITTER_CV, stragglers=stragglers, samples=args.samples)
            p99 = whatif.quantiles["p99"]
            cells.append(f"{whatif.mean * 1e3:>9.2f} / {p99 * 1e3:>6.2f} / {p99 / step:>5.3f}")
            if stragglers.get(PP // 2):
                slow_middle_p99[name] = p99
        print(f"{name:<18}{step * 1e3:>14.2f}" + "".join(f"{cell:>28}" for cell in cells))
    by_step = sorted(SCHEDULES, key=deterministic.get)
    by_p99 = sorted(SCHEDULES, key=slow_middle_p99.get)
    print(f"ranked by deterministic step:        {', '.join(by_step)}")
    print(f"ranked by p99 with rank {PP // 2} x{SLOW_FACTOR}:     {', '.join(by_p99)}")
    tau = kendall_tau([deterministic[name] for name in SCHEDULES], [slow_middle_p99[name] for name in SCHEDULES])
    print(f"Kendall tau: {tau:+.3f}")
    print(f"zbv against 1f1b: {deterministic['zbv'] / deterministic['1f1b'] - 1:+.1%} deterministic, "
          f"{slow_middle_p99['zbv'] / slow_middle_p99['1f1b'] - 1:+.1%} at p99 with rank {PP // 2} x{SLOW_FACTOR}")


if __name__ == "__main__":
    main()
