"""Communication overlapped with compute, and what the overlap costs the compute.

Today's stacks run most collectives beside the compute instead of between it:
Megatron-Core's ``--overlap-grad-reduce`` and ``--overlap-param-gather`` (the
distributed optimizer's gradient reduce-scatter during the backward, the updated
parameters' all-gather during the next step's forwards; FSDP2 prefetches its gathers the
same way), ``--tp-comm-overlap`` (Transformer Engine's userbuffers pipeline the
tensor-parallel all-gathers and reduce-scatters of sequence parallelism with the GEMMs
they feed; torch's async TP does the same), context parallelism's ring under the
attention, and DualPipe's expert all-to-alls under the other half of a pair.

Overlap is not free. A collective's kernels take SMs and HBM bandwidth from the compute
beside it: Lee et al. 2025 ("Characterizing Compute-Communication Overlap in
GPU-Accelerated Distributed Deep Learning: Performance and Power Implications",
arXiv:2507.03114) measured GPT and Llama training kernels on A100, H100, MI250 and MI210
running beside NCCL collectives at **18.9% slower on average** (40.0% at worst) than
alone, while overlapped execution was still 10.2% faster on average than running the
two one after the other. DeepSeek-V3 gives its communication 20 of the H800's 132 SMs
(15%) for the same reason. pipesim charges that as a rate: while a collective runs
beside it, compute advances at ``1 / (1 + slowdown)`` of its speed alone (``slowdown``
default 0.189, ``--overlap-slowdown``), and the collective keeps its own time.

With ``G`` seconds of compute alone and ``C`` seconds of communication beside it, both
started together:

    overlapped  max(C, G + min(C, G (1 + k)) k / (1 + k))        k = slowdown

the communication hidden while it fits under the slowed compute (the compute then takes
``G + C k / (1 + k)``), and exposed beyond it (``C`` when ``C >= G (1 + k)``). With
``k = 0`` this is ``max(G, C)``, the ideal overlap. ``exposed_seconds`` is what the pair
adds to the compute: ``overlapped - G``, never more than ``C`` (overlap never loses to
running them in turn).
"""

from __future__ import annotations

OVERLAP_SLOWDOWN = 0.189  # Lee et al. 2025, arXiv:2507.03114: mean slowdown of compute beside a collective


def check_slowdown(slowdown: float) -> float:
    """``slowdown`` if it is a finite fraction >= 0; else a one-line error naming the flag."""
    if not isinstance(slowdown, (int, float)) or not slowdown >= 0 or slowdown == float("inf"):
        raise ValueError(f"--overlap-slowdown must be a finite number >= 0 (the share compute slows by beside a "
                         f"collective, e.g. 0.189), got {slowdown!r}")
    return float(slowdown)


def overlapped_seconds(compute: float, comm: float, slowdown: float = OVERLAP_SLOWDOWN) -> float:
    """Seconds ``compute`` seconds of compute and ``comm`` seconds of communication take
    when started together side by side (see the module)."""
    if comm <= 0:
        return compute
    beside = min(comm, compute * (1 + slowdown))  # the collective's seconds that run beside compute
    return max(comm, compute + beside * slowdown / (1 + slowdown))


def exposed_seconds(compute: float, comm: float, slowdown: float = OVERLAP_SLOWDOWN) -> float:
    """What ``comm`` seconds of communication overlapped with ``compute`` seconds of
    compute add to the compute alone: the part it does not hide plus the slowdown of the
    part it does."""
    return overlapped_seconds(compute, comm, slowdown) - compute


def slowed_by(beside: float, slowdown: float = OVERLAP_SLOWDOWN) -> float:
    """Seconds compute loses to ``beside`` seconds of communication that ran while it
    computed: it advanced ``beside / (1 + k)`` where alone it would have advanced
    ``beside``."""
    return beside * slowdown / (1 + slowdown)
