"""The zero-bubble paper's layouts under its schedules, as ``pipesim simulate`` runs them.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024; arXiv:2401.10241, whose later
version adds ZB-V) measured four GPT-3-like models (its Table 3: 1.5B, 6.2B, 14.6B and
28.3B, sequence 1024) on 8 to 32 A100 SXM 80 GB, pipeline parallelism only, under 1F1B,
1F1B-I, ZB-1p, ZB-2p and ZB-V. A layout here is one of those runs: the model, the
pipeline, the microbatch size and count, and the schedule by the paper's name, with the
``pipesim simulate`` flags that run it (``argv``). ``benchmarks/published_memory.py``
compares the peaks the paper measured, ``benchmarks/published_zero_bubble.py`` the
throughput.

What the paper says and pipesim follows: the first and last stage a transformer layer short
of the others (section 5.1; ``k p - 2`` layers), 1F1B-I with one layer a chunk (section
5.1), ZB-V with ``2p`` chunks. Assumed where it is silent: Megatron's GPT vocabulary 51,200,
mixed-precision Adam (2 + 2 + 12 bytes a parameter), no flash attention (its Table 1 counts
the ``5as`` attention scores), no recompute, the ranks 8 to a node on InfiniBand.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

# the paper's name: pipesim's schedule and its --memory-limit in multiples of p (None: none)
SCHEDULE_FLAGS = {
    "ZB-1p": ("zb-auto", 1), "ZB-2p": ("zb-auto", 2), "ZB-2p*": ("zb-auto", 2), "1F1B": ("1f1b", None),
    "1F1B-I": ("interleaved-1f1b", None), "ZB-V": ("zbv", None),
}
ONE_LAYER_CHUNKS = ("1F1B-I", "ZB-V")
# Table 4's setups: (model, layers, heads, hidden, pp, microbatch size, microbatch counts)
MAIN_SETUPS = (("1.5B", 22, 24, 2304, 8, 6, (24, 32, 64)), ("6.2B", 30, 32, 4096, 8, 3, (24, 32, 64)),
               ("14.6B", 46, 40, 5120, 16, 1, (48, 64, 128)), ("28.3B", 62, 48, 6144, 32, 1, (96, 128, 256)))
# the ZB-V comparison's setups (Table 6 of the version with ZB-V): 2p - 2 layers
V_SETUPS = (("6.2B", 30, 32, 4096, 16, 6, (48, 64, 128)), ("14.6B", 46, 40, 5120, 24, 2, (72, 96, 192)),
            ("28.3B", 62, 48, 6144, 32, 2, (96, 128, 256)))
# the first three of Table 4's setups at m <= p (the ICLR version's Table 9, the later
# version's Table 12)
FEW_MICROBATCHES = ((2, 4, 8), (2, 4, 8), (4, 8, 16))


@dataclass(frozen=True)
class ZeroBubbleLayout:
    """One of the paper's runs: a model of its Table 3 on ``pp`` GPUs under ``schedule``."""

    model: str
    layers: int
    heads: int
    hidden: int
    pp: int
    microbatch_size: int
    microbatches: int
    schedule: str  # a key of SCHEDULE_FLAGS

    @property
    def label(self) -> str:
        return f"{self.model} {self.schedule} p{self.pp} m{self.microbatches} b{self.microbatch_size}"

    @property
    def samples(self) -> int:
        """Sequences a step trains."""
        return self.microbatches * self.microbatch_size

    def layers_per_stage(self) -> tuple[int, ...]:
        """One stage a rank (ZB, 1F1B): the first and last a layer short of the rest; one
        layer a chunk (1F1B-I, ZB-V): the first chunk the embedding alone and the last the
        output layer alone (the layers are ``k p - 2``)."""
        from benchmarks.published import meta_layers_per_stage  # noqa: PLC0415  the same rule as Meta's split

        one_layer = self.schedule in ONE_LAYER_CHUNKS
        layout = meta_layers_per_stage(self.layers, self.pp, max(1, (self.layers + 2) // self.pp) if one_layer else 1)
        if layout is None:
            raise ValueError(f"{self.model}: {self.layers} layers do not make one-layer chunks on pp {self.pp}"
                             if one_layer else f"{self.model}: {self.layers} layers do not split into {self.pp} "
                             f"stages, the first and last a layer short")
        return layout

    def argv(self) -> list[str]:
        """The ``pipesim simulate`` flags of the layout."""
        name, limit = SCHEDULE_FLAGS[self.schedule]
        layout = self.layers_per_stage()
        flags = ["--model", "gpt3-175b", "--layers", self.layers, "--hidden", self.hidden, "--heads", self.heads,
                 "--vocab", 51200, "--seq-len", 1024, "--microbatch-size", self.microbatch_size,
                 "--schedule", name, "--pp", self.pp, "-m", self.microbatches, "--tp", 1, "--dp", 1,
                 "--topology", "ib", "--nodes", -(-self.pp // 8), "--gpu", "a100-80gb", "--recompute", "none",
                 "--layers-per-stage", ",".join(map(str, layout)), "--no-flash-attention"]
        if name == "interleaved-1f1b":
            flags += ["-v", len(layout) // self.pp]
        if limit is not None:
            flags += ["--memory-limit", limit * self.pp]
        return [str(flag) for flag in flags]

    def command(self) -> str:
        return "pipesim simulate " + " ".join(self.argv())


def first_count_layouts(setups, schedule: str, microbatch_size_scale: float = 1.0,
                        count_scale: int = 1) -> list[ZeroBubbleLayout]:
    """Each setup under ``schedule`` at its first microbatch count (the paper prints one
    peak for a setup's counts), the microbatch and the count scaled (ZB-2p*: half and
    twice; the doubled-microbatch table: twice and once)."""
    return [ZeroBubbleLayout(model, layers, heads, hidden, pp, int(b * microbatch_size_scale), counts[0] * count_scale,
                             schedule) for model, layers, heads, hidden, pp, b, counts in setups]


def few_microbatch_layouts(schedule: str) -> list[ZeroBubbleLayout]:
    """The first three of Table 4's setups under ``schedule`` at each of their counts m <= p."""
    return [ZeroBubbleLayout(model, layers, heads, hidden, pp, b, m, schedule)
            for (model, layers, heads, hidden, pp, b, _), counts in zip(MAIN_SETUPS[:3], FEW_MICROBATCHES, strict=True)
            for m in counts]


@functools.cache  # a layout is frozen: the throughput rows and the passes share runs
def simulate_json(layout: ZeroBubbleLayout) -> dict:
    """``pipesim simulate``'s ``--json`` document for the layout, run in this process (one
    run per layout, kept: read it, do not change it)."""
    return simulate_argv_json(layout.label, layout.argv())


def simulate_argv_json(label: str, argv: list[str]) -> dict:
    """``pipesim simulate``'s ``--json`` document for ``argv``, run in this process; a
    failed run is an error naming ``label`` and what the command said."""
    from pipesim.cli import main as pipesim_main  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "run.json"
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as errors:
            status = pipesim_main(["simulate", *argv, "--json", str(out)])
        if status:
            raise RuntimeError(f"{label}: pipesim simulate exited {status}: {errors.getvalue().strip()}")
        return json.loads(out.read_text())
