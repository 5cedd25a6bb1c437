"""A prediction says what it leaves out where that moves it: a dropless mixture of
experts' host time (the token counts Megatron-Core's dispatcher copies to the host each
MoE layer), once in ``simulate``'s output and once in ``plan``'s, and never for a dense
model or experts padded to a capacity."""

from __future__ import annotations

from dataclasses import replace

from pipesim.cli import main
from pipesim.model.layout import unmodelled_notes
from pipesim.model.spec import PRESETS

HOST_TIME = "the host's time is not modelled"
MOE = ("--pp", "2", "-m", "4", "--ep", "4", "--dp", "4", "--topology", "ib", "--nodes", "1")


def test_a_dropless_mixture_says_its_host_time_is_left_out(capsys) -> None:
    assert main(["simulate", "--model", "qwen3-30b-a3b", *MOE]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if HOST_TIME in line]
    assert len(notes) == 1
    assert notes[0].startswith("  note: qwen3-30b-a3b routes tokens to experts") and "upper bound" in notes[0]


def test_a_dense_model_and_a_capacity_say_nothing_of_it(capsys) -> None:
    assert main(["simulate", "--model", "llama3-8b", "--pp", "2", "-m", "4"]) == 0
    assert main(["simulate", "--model", "mixtral-8x7b", "--capacity-factor", "1.25", *MOE]) == 0
    assert HOST_TIME not in capsys.readouterr().out
    assert unmodelled_notes(PRESETS["llama3-70b"]) == []
    mixtral = PRESETS["mixtral-8x7b"]
    assert len(unmodelled_notes(mixtral)) == 1
    assert unmodelled_notes(replace(mixtral, moe=replace(mixtral.moe, capacity_factor=1.0))) == []


def test_plan_says_it_once_before_its_table(capsys) -> None:
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "8", "--global-batch", "8", "--topology", "nvlink",
                 "--schedules", "1f1b", "--top", "1"]) in (0, 1)
    captured = capsys.readouterr()
    assert sum(HOST_TIME in line for line in captured.err.splitlines()) == 1
    assert HOST_TIME not in captured.out
