"""The Hugging Face config.json files pipesim ships, taken by ``--model NAME``: each name
reads its file as a path would, against the families' published parameter counts; a
preset keeps its own name; an unknown name lists every name; ``simulate``, ``plan`` and
``run`` take them alike; and the files are package data, so an installed pipesim has
them too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipesim.cli import main
from pipesim.model.errors import ModelSpecError
from pipesim.model.spec import BUNDLED_CONFIGS, PRESETS, bundled_models, load_model, model_names
from tests.test_cli_errors import assert_one_line_error

ROOT = Path(__file__).resolve().parents[1]


def test_every_shipped_file_is_a_name_but_those_a_preset_shadows() -> None:
    files = {path.stem for path in BUNDLED_CONFIGS.glob("*.json")}
    assert set(bundled_models()) == files - set(PRESETS)
    assert {"deepseek-v3", "deepseek-v2-lite", "mixtral-8x7b"} <= files - set(bundled_models())
    assert model_names() == [*PRESETS, *sorted(files - set(PRESETS))]


@pytest.mark.parametrize("name", sorted(bundled_models()))
def test_a_name_reads_its_file_as_the_path_does(name: str) -> None:
    by_name, by_path = load_model(name), load_model(str(BUNDLED_CONFIGS / f"{name}.json"))
    assert by_name.name == name
    assert by_name.total_params() == by_path.total_params()
    assert by_name.active_params() == by_path.active_params()
    assert (by_name.layers, by_name.hidden, by_name.seq_len) == (by_path.layers, by_path.hidden, by_path.seq_len)


@pytest.mark.parametrize("name,total,active", [
    ("qwen3-30b-a3b", 30.5e9, 3.3e9),  # Qwen's model card: 30.5B total, 3.3B activated
    ("qwen3-235b-a22b", 235e9, 22e9),  # 235B total, 22B activated
    ("olmoe-1b-7b", 6.9e9, 1.3e9),  # the OLMoE paper: 6.9B total, 1.3B active
])
def test_named_families_have_their_published_sizes(name: str, total: float, active: float) -> None:
    spec = load_model(name)
    assert spec.total_params() == pytest.approx(total, rel=0.01)
    assert spec.active_params() == pytest.approx(active, rel=0.03)


def test_a_preset_keeps_its_name_over_a_file_of_the_same_name() -> None:
    """``deepseek-v3`` is the preset (BF16); its shipped config.json, with the FP8
    ``quantization_config`` DeepSeek published, is read by path."""
    assert load_model("deepseek-v3") is PRESETS["deepseek-v3"]
    assert not PRESETS["deepseek-v3"].fp8
    assert load_model(str(BUNDLED_CONFIGS / "deepseek-v3.json")).fp8


def test_an_unknown_name_lists_the_presets_and_the_shipped_files() -> None:
    with pytest.raises(ModelSpecError) as error:
        load_model("qwen3-31b")
    message = str(error.value)
    assert "unknown model 'qwen3-31b'" in message and "llama3-8b" in message and "qwen3-30b-a3b" in message
    assert "gpt-oss-120b" in message and message.endswith("or a config.json")


@pytest.mark.parametrize("typed,meant", [("qwen3-30b", "qwen3-30b-a3b"), ("Llama3-8B", "llama3-8b"),
                                         ("gpt-oss-120", "gpt-oss-120b")])
def test_a_near_miss_names_the_nearest(typed: str, meant: str) -> None:
    with pytest.raises(ModelSpecError, match=f"unknown model '{typed}' \\(did you mean {meant}"):
        load_model(typed)


def test_simulate_takes_a_shipped_name(capsys, tmp_path) -> None:
    out = tmp_path / "result.json"
    assert main(["simulate", "--model", "qwen3-30b-a3b", "--pp", "2", "-m", "4", "--ep", "4", "--dp", "4",
                 "--topology", "ib", "--nodes", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "model qwen3-30b-a3b: 30.5 B params (3.35 B active)" in printed
    document = json.loads(out.read_text())
    assert document["makespan"] > 0
    assert document["model"]["name"] == "qwen3-30b-a3b"
    assert document["model"]["params"] == pytest.approx(30.5e9, rel=0.01)  # Qwen's model card


def test_simulate_help_lists_the_shipped_names(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "a shipped Hugging Face config by name:" in text
    for name in ("gpt-oss-120b", "qwen3-235b-a22b", "llama-4-scout", "gemma-3-1b"):
        assert name in text


def test_simulate_refuses_an_unknown_name_in_one_line(capsys) -> None:
    status = main(["simulate", "--model", "qwen3-31b", "--pp", "2", "-m", "4"])
    assert_one_line_error(status, capsys.readouterr().err, "unknown model 'qwen3-31b'", "qwen3-30b-a3b")


def test_run_takes_a_shipped_name_shrunk(capsys) -> None:
    status = main(["run", "--model", "qwen3-0.6b", "--layers", "2", "--pp", "1", "--batch-size", "2",
                   "--microbatches", "1", "--steps", "1", "--quiet"])
    out = capsys.readouterr().out
    assert status == 0
    assert out.splitlines()[0].startswith("pipesim run: model qwen3-0.6b: layers 28->2, ")
    assert "step 0: loss" in out


def test_the_files_are_package_data() -> None:
    """An installed (not editable) pipesim carries the files: the package-data glob of
    pyproject.toml and the source distribution's MANIFEST.in name them."""
    package_data = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.package-data]")[1].split("\n[")[0]
    line = next(line for line in package_data.splitlines() if line.startswith('"pipesim.model"'))
    assert '"data/hf_configs/*.json"' in line
    assert "include pipesim/model/data/hf_configs/*.json" in (ROOT / "MANIFEST.in").read_text().splitlines()
    assert BUNDLED_CONFIGS == ROOT / "pipesim" / "model" / "data" / "hf_configs"
