"""How many routed copies this process's experts ran in each forward the memory tracker
records: the share of a dropless mixture of experts' activations that follows the data.

Under expert parallelism a rank's experts keep what the tokens routed to them bring
(their inputs, their activation's inputs and outputs), and a dropless router sends
each rank what the data asks for, not the balanced share the memory model prices (it
cannot know the data). On a small run the spread is wide: a shrunk Qwen3-30B-A3B at
dp 16, ep 8 measured 21-28% above its balanced prediction on every rank. The tracker
(``executor.memory``) opens a count at each ``F`` and the dispatcher
(``executor.expert_parallel.run_experts``) adds the rows it runs, so the prediction
beside the run (``pipesim.cli.run_memory``) can be taken at the run's own routing.
"""

from __future__ import annotations


class RoutedRows:
    """Rows the local experts ran, per ``(stage, microbatch)`` forward, while open."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int, int], int] = {}
        self.current: tuple[int, int] | None = None

    def reset(self) -> None:
        """A new step: nothing counted."""
        self.counts = {}
        self.current = None

    def open(self, stage: int, microbatch: int) -> None:
        """Count what follows as the forward of ``(stage, microbatch)``."""
        self.current = (stage, microbatch)
        self.counts.setdefault(self.current, 0)

    def close(self) -> None:
        self.current = None

    def add(self, rows: int) -> None:
        """``rows`` routed copies ran through this process's experts (outside a recorded
        forward, e.g. a recompute inside a backward, nothing is counted)."""
        if self.current is not None:
            self.counts[self.current] += rows


ROUTED_ROWS = RoutedRows()
