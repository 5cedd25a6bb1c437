"""The predicted CUDA allocator peak of a run (``pipesim.cli.run_memory``): what a GPU
allocates beyond the tensors counted at action boundaries, by hand. (Measured on an
H200 by ``benchmarks/gpu_memory.py``; here, on a CPU, the arithmetic.)"""

from __future__ import annotations

import pytest

from executor.config import RunConfig
from executor.models import build_model
from pipesim.cli.run_memory import allocator_extras, executor_spec, peak_lines, predicted_peaks

pytestmark = pytest.mark.timeout(120)

MIB = 2**20
GPT = dict(model="gpt", pp=1, layers=2, hidden=32, heads=4, seq_len=16, vocab=128, batch_size=8, microbatches=4)


def extras(capability=(9, 0), **fields):
    config = RunConfig(**{**GPT, **fields})
    spec, _ = executor_spec(config)
    return allocator_extras(config, spec, capability, stepped_bytes=1000.0)


def test_cublas_workspaces_by_generation():
    # two threads (forward, autograd's backward) x torch's default workspace per handle
    assert extras((9, 0)).workspace_bytes == 2 * 32 * MIB  # Hopper: ":4096:8"
    assert extras((10, 0)).workspace_bytes == 2 * 32 * MIB
    assert extras((8, 0)).workspace_bytes == 2 * (2 * 4096 + 8 * 16) * 1024  # ":4096:2:16:8"


def test_loss_backward_holds_softmax_and_gradient_of_a_microbatch():
    # microbatch 8 / 4 = 2 sequences x 16 tokens, vocab 128, float32: two tensors of 2*16*128*4 bytes
    assert extras().loss_backward_bytes == 2 * (2 * 16 * 128 * 4)
    assert extras(dtype="bfloat16").loss_backward_bytes == 2 * (2 * 16 * 128 * 4)  # the loss in float32
    assert extras(dtype="float64").loss_backward_bytes == 2 * (2 * 16 * 128 * 8)
    assert extras(cp=2).loss_backward_bytes == 2 * (2 * 8 * 128 * 4)  # this rank's half of the sequence


def test_optimizer_temporary_only_for_out_of_place_foreach_steps():
    assert extras(optimizer="adamw").optimizer_bytes == 1000.0  # the square root of the second moments
    assert extras(optimizer="sgd", weight_decay=0.0).optimizer_bytes == 0.0  # in place
    assert extras(optimizer="sgd", weight_decay=0.1).optimizer_bytes == 1000.0  # gradient + decay, out of place
    assert extras(optimizer="adamw", tp=2).optimizer_bytes == 0.0  # tp: parameter by parameter


def test_gpipe_peak_inside_first_backward():
    """GPipe on one rank, two microbatches, SGD without decay: the counted peak is after
    the second forward (parameters + both stashes); inside the first backward the
    allocator also holds every gradient (made before the stash is freed), the loss's two
    logits-sized tensors and the cuBLAS workspaces."""
    config = RunConfig(**{**GPT, "schedule": "gpipe", "microbatches": 2, "seq_len": 256, "vocab": 64,
                          "optimizer": "sgd", "weight_decay": 0.0})
    params = sum(p.numel() for p in build_model(config).build_stage(0, 1).parameters())
    counted = predicted_peaks(config)[0]["predicted_peak"]
    on_gpu = predicted_peaks(config, (9, 0))[0]["predicted_peak"]
    loss = 2 * (4 * 256 * 64 * 4)
    # the toy's output layer has a bias (vocab values) the model spec does not count
    assert on_gpu - counted == pytest.approx(2 * 32 * MIB + params * 4 + loss, abs=64 * 4)


def test_run_prints_allocator_prediction_for_cuda_rows():
    config = RunConfig(**{**GPT, "optimizer": "adamw", "steps": 2})
    predicted = predicted_peaks(config, (9, 0))[0]["predicted_peak"]
    row = {"rank": 0, "source": "cuda", "cuda_capability": [9, 0], "peak": 1.05 * predicted}
    lines = peak_lines({"memory": [row]}, config)
    assert "torch.cuda.max_memory_allocated" in lines[0]
    assert row["predicted_peak"] == predicted
    assert lines[1] == (f"  rank 0: peak measured {1.05 * predicted / MIB:.3f} MiB, "
                        f"predicted {predicted / MIB:.3f} MiB (+5.0%)")


def test_each_dualpipe_copy_pays_its_loss_backward():
    """DualPipe pp 2: rank 1 holds copy 0's last stage (1), rank 0 copy 1's (3); each
    rank's backward of its loss stage holds the loss's two logits-sized tensors, so on a
    GPU both ranks' peaks exceed the counted ones by at least them (vocab large enough
    that they dominate)."""
    config = RunConfig(**{**GPT, "schedule": "dualpipe", "pp": 2, "virtual_stages": 2, "microbatches": 4,
                          "seq_len": 256, "vocab": 65536})
    loss = 2 * (2 * 256 * 65536 * 4)  # a microbatch of 2 sequences of 256 tokens, float32: 256 MiB
    counted, on_gpu = predicted_peaks(config), predicted_peaks(config, (9, 0))
    for rank in (0, 1):
        assert on_gpu[rank]["predicted_peak"] - counted[rank]["predicted_peak"] >= loss, rank
