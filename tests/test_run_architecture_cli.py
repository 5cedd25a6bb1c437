"""``pipesim run --model`` with an architecture, through the command line: the one line
saying what was shrunk, and one-line refusals (exit 2) of what cannot run: a ``--data``
that is missing, a directory, a FIFO or empty, flags an architecture
does not have, widths tp does not divide, a norm layout the executor does not build."""

from __future__ import annotations

import json
import os

import pytest

from pipesim.cli import main
from tests.test_cli_errors import assert_one_line_error

TOY = ("--pp", "1", "--batch-size", "2", "--microbatches", "1", "--steps", "1", "--quiet")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(["run", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_run_says_what_was_shrunk_and_trains(capsys, tmp_path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n")
    document = tmp_path / "run.json"
    status, out, _ = run(capsys, "--model", "mixtral-8x7b", "--layers", "2", "--experts", "4", "--data", str(text),
                         "--json", str(document), *TOY)
    assert status == 0
    first = out.splitlines()[0]
    assert first == ("pipesim run: model mixtral-8x7b: layers 32->2, hidden 4096->64, heads 32->4, kv-heads 8->1, "
                     "ffn-hidden 14336->224, seq-len 8192->16, vocab 32000->258, experts 8->4, expert ffn 14336->224; "
                     "load-balancing loss 0.02 per MoE layer, per sequence (the config's)")
    assert "step 0: loss" in out
    model = json.loads(document.read_text())["model"]
    assert (model["source"], model["layers"], model["hidden"], model["vocab"]) == ("mixtral-8x7b", 2, 64, 258)
    assert (model["moe"]["experts"], model["moe"]["experts_per_token"], model["moe"]["expert_ffn"]) == (4, 2, 224)
    assert model["shrunk"] == first.removeprefix("pipesim run: ")


@pytest.mark.parametrize("kind", ["missing", "directory", "fifo", "empty"])
def test_data_file_refused_in_one_line(capsys, tmp_path, kind: str) -> None:
    path = tmp_path / "data"
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "empty":
        path.write_text("")
    status, _, err = run(capsys, "--model", "llama3-8b", "--data", str(path), *TOY)
    expected = {"missing": "no such file", "directory": "is a directory", "fifo": "not a regular file",
                "empty": "is empty"}[kind]
    assert status == 2
    assert_one_line_error(status, err, "--data", expected)


@pytest.mark.parametrize("flags,expected", [
    (("--model", "deepseek-v2-lite", "--tp", "3"), ("--tp 3 must divide --heads 4",)),
    (("--model", "mixtral-8x7b", "--kv-heads", "2", "--ffn-hidden", "31", "--tp", "2"),
     ("--tp 2 must divide --ffn-hidden 31",)),
    (("--model", "qwen1.5-moe-a2.7b", "--ffn-hidden", "20", "--tp", "2"),
     ("--tp 2 must divide the experts' width (from --ffn-hidden) 5",)),
    (("--model", "llama3-8b", "--tp", "2"), ("--tp 2 must divide --kv-heads 1",)),
    (("--model", "llama3-8b", "--experts", "4"), ("--experts 4", "no mixture-of-experts")),
    (("--model", "llama3-8b", "--kv-heads", "3"), ("--kv-heads 3 must divide --heads 4",)),
    (("--model", "llama3-8b", "--hidden", "12"), ("--hidden 12", "even")),
    (("--model", "gpt", "--ffn-hidden", "8"), ("--ffn-hidden", "--model gpt")),
    (("--model", "gpt", "--data", __file__, "--vocab", "100"), ("--vocab 100 is too small",)),
    (("--model", "mlp", "--data", __file__), ("--data", "--model mlp")),
    (("--model", "mixtral-8x7b", "--capacity-factor", "0"), ("--capacity-factor must be a finite number > 0",)),
    (("--model", "mixtral-8x7b", "--capacity-factor", "nan"), ("--capacity-factor", "got nan")),
    (("--model", "mixtral-8x7b", "--kv-heads", "0"), ("--kv-heads must be at least 1",)),
    (("--model", "no-such-model"), ("--model no-such-model", "llama3-8b")),
    (("--model", "gemma-2-9b", "--cp", "2"),
     ("--cp 2", "soft-capped attention scores (cap 50)", "run without --cp")),
])
def test_what_cannot_run_is_refused_in_one_line(capsys, flags, expected) -> None:
    status, _, err = run(capsys, *flags, *TOY)
    assert status == 2
    assert_one_line_error(status, err, *expected)


def test_sizes_default_by_model_and_machine() -> None:
    """An architecture on a GPU (nccl) takes the GPU sizes, on gloo the CPU's; the toys
    keep their sizes everywhere; a flag always wins."""
    from executor.architectures.build import CPU_SIZES, GPU_SIZES  # noqa: PLC0415
    from executor.options import config_from_args  # noqa: PLC0415
    from pipesim.cli import build_parser  # noqa: PLC0415

    def sizes(*argv: str) -> dict:
        config = config_from_args(build_parser().parse_args(["run", *argv]))
        return {key: getattr(config, key) for key in CPU_SIZES}

    assert sizes("--model", "llama3-8b", "--backend", "nccl") == GPU_SIZES
    assert sizes("--model", "llama3-8b", "--backend", "gloo") == CPU_SIZES
    assert sizes("--model", "gpt", "--backend", "nccl") == CPU_SIZES
    assert sizes("--model", "llama3-8b", "--backend", "nccl", "--layers", "2")["layers"] == 2

