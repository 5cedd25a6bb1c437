"""Meta's Llama 3 405B rows publish neither v nor N: the benchmark takes one assumed (v, N)
for every row, names the fastest candidate that would fit, and splits the layers as Meta
did (one fewer on the first and last chunk)."""

from __future__ import annotations

from dataclasses import replace

from benchmarks.published import (
    ASSUMED_VIRTUAL_STAGES,
    llama3_2024,
    meta_layers_per_stage,
    predict,
    schedule_candidates,
    schedule_choice,
)


def test_layers_per_chunk_as_meta_balanced_them():
    # 126 layers + 2 = 128 = 16 ranks x v chunks x (layers a chunk)
    assert meta_layers_per_stage(126, 16, 2) == (3,) + (4,) * 30 + (3,)
    assert meta_layers_per_stage(126, 16, 4) == (1,) + (2,) * 62 + (1,)
    assert meta_layers_per_stage(126, 16, 8) == (0,) + (1,) * 126 + (0,)  # the embedding-only first chunk
    assert meta_layers_per_stage(126, 16, 3) is None  # 128 chunks' worth do not split into 48


def test_every_row_takes_the_assumed_layout_whatever_fits():
    run = next(run for run in llama3_2024() if run.label == "405B 16384 GPUs t8 c1 p16 d128 s8192")
    # m = 16 = pp: Megatron's range holds N = 16 alone; v 2, 4, 8
    assert [(c.virtual_stages, c.microbatch_group) for c, _ in schedule_candidates(run)] == [(2, 16), (4, 16), (8, 16)]
    assert (run.virtual_stages, run.microbatch_group) == (ASSUMED_VIRTUAL_STAGES, 16)
    chosen, _ = schedule_choice(run)
    assert (chosen.virtual_stages, chosen.microbatch_group) == (ASSUMED_VIRTUAL_STAGES, 16)


def test_the_reason_names_the_fastest_candidate_that_fits():
    # half the model (62 layers: 64 = 16 x 2 x 2 = 16 x 4 x 1) fits at v 2 and v 4
    base = next(run for run in llama3_2024() if run.label == "405B 16384 GPUs t8 c1 p16 d128 s8192")
    half = replace(base, spec=replace(base.spec, layers=62))
    chosen, reason = schedule_choice(half)
    steps = {}
    for virtual_stages in (2, 4):
        layout = (2 * 2 // virtual_stages - 1,) + (2 * 2 // virtual_stages,) * (16 * virtual_stages - 2) + (
            2 * 2 // virtual_stages - 1,)
        prediction = predict(replace(half, virtual_stages=virtual_stages, layers_per_stage=layout,
                                     microbatch_group=16), None, with_memory=True)
        assert prediction.peak_bytes <= prediction.usable_bytes
        steps[virtual_stages] = prediction.step_seconds
    assert chosen.virtual_stages == ASSUMED_VIRTUAL_STAGES
    assert reason.endswith(f"the fastest that fits would be v {min(steps, key=steps.get)} N 16")
