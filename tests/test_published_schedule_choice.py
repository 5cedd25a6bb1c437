"""Meta's Llama 3 405B rows publish neither v nor N. Its text gives the chunks (the first
chunk holds only the embedding, so one layer a chunk, 8 a rank), and every row takes
interleaved-auto's order within the GPU's usable memory: Megatron's interleaved order where
it fits, else an order searched to fit, as Meta ran every layout without recomputation."""

from __future__ import annotations

from dataclasses import replace

from benchmarks.published import (
    META_VIRTUAL_STAGES,
    llama3_2024,
    meta_layers_per_stage,
    predict,
    schedule_candidates,
    schedule_choice_lines,
)

ROWS = {run.label: run for run in llama3_2024()}


def test_layers_per_chunk_as_meta_balanced_them():
    # 126 layers + 2 = 128 = 16 ranks x v chunks x (layers a chunk)
    assert meta_layers_per_stage(126, 16, 2) == (3,) + (4,) * 30 + (3,)
    assert meta_layers_per_stage(126, 16, 4) == (1,) + (2,) * 62 + (1,)
    assert meta_layers_per_stage(126, 16, 8) == (0,) + (1,) * 126 + (0,)  # the embedding-only first chunk
    assert meta_layers_per_stage(126, 16, 3) is None  # 128 chunks' worth do not split into 48


def test_every_row_takes_one_layer_chunks_and_interleaved_auto_within_the_device():
    assert META_VIRTUAL_STAGES == 8
    for run in ROWS.values():
        assert (run.schedule, run.virtual_stages, run.memory_limit, run.microbatch_group) == (
            "interleaved-auto", 8, "device", None)
        assert run.layers_per_stage == (0,) + (1,) * 126 + (0,)


def test_the_candidates_are_megatron_s_order_at_each_v_and_n():
    run = ROWS["405B 16384 GPUs t8 c1 p16 d128 s8192"]
    # m = 16 = pp: Megatron's range holds N = 16 alone; v 2, 4, 8
    candidates = [candidate for candidate, _ in schedule_candidates(run)]
    assert [(c.schedule, c.virtual_stages, c.microbatch_group) for c in candidates] == [
        ("interleaved-1f1b", 2, 16), ("interleaved-1f1b", 4, 16), ("interleaved-1f1b", 8, 16)]


def test_where_megatron_s_order_fits_the_row_is_that_order():
    run = ROWS["405B 16384 GPUs t8 c1 p16 d128 s8192"]
    row = predict(run, None, with_memory=True)
    (megatron,) = [prediction for candidate, prediction in schedule_candidates(run) if candidate.virtual_stages == 8]
    assert megatron.peak_bytes <= megatron.usable_bytes
    assert row.order == "megatron" and row.step_seconds == megatron.step_seconds


def test_where_it_does_not_fit_the_row_is_an_order_that_fits_and_costs_time():
    run = ROWS["405B 8192 GPUs t8 c1 p16 d64 s8192"]
    row = predict(run, None, with_memory=True)
    (megatron,) = [prediction for candidate, prediction in schedule_candidates(run)
                   if (candidate.virtual_stages, candidate.microbatch_group) == (8, 16)]
    assert megatron.peak_bytes > megatron.usable_bytes
    assert row.order == "greedy" and row.peak_bytes <= row.usable_bytes
    assert row.step_seconds > megatron.step_seconds  # holding less is not free


def test_the_lines_say_which_order_each_row_took():
    lines = schedule_choice_lines(list(ROWS.values()))
    assert any(line.startswith("- 405B 8192 GPUs") and "an order searched to fit" in line for line in lines)
    assert any(line.startswith("- 405B 16384 GPUs t8 c1") and "Megatron's interleaved order, which fits" in line
               for line in lines)


def test_a_row_with_room_takes_megatron_s_order():
    # half the model (62 layers at v 4: 64 = 16 ranks x 4 chunks x 1 layer) fits under
    # Megatron's order, so interleaved-auto keeps it
    run = ROWS["405B 8192 GPUs t8 c1 p16 d64 s8192"]
    half = replace(run, spec=replace(run.spec, layers=62), layers_per_stage=meta_layers_per_stage(62, 16, 4),
                   virtual_stages=4)
    prediction = predict(half, None, with_memory=True)
    assert prediction.order == "megatron" and prediction.peak_bytes <= prediction.usable_bytes
