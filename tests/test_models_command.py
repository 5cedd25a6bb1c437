"""``pipesim models``: one row for every name ``--model`` takes, sizes against the
published counts, the parts read from the configs by hand, and the JSON beside the
table."""

from __future__ import annotations

import json

import pytest

from pipesim.cli import main


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[str, dict]:
    path = tmp_path_factory.mktemp("models") / "models.json"
    assert main(["models", "--json", str(path)]) == 0
    return {item["name"]: item for item in json.loads(path.read_text())}


def test_every_name_has_a_row_presets_first(rows) -> None:
    # 9 presets (gpt3 x 3, llama3 x 3, mixtral, two DeepSeeks); 22 shipped files less the 3 a preset shadows
    assert len(rows) == 28
    assert list(rows)[:9] == ["gpt3-1.3b", "gpt3-13b", "gpt3-175b", "llama3-8b", "llama3-70b", "llama3-405b",
                              "mixtral-8x7b", "deepseek-v3", "deepseek-v2-lite"]
    assert {rows[name]["from"] for name in list(rows)[:9]} == {"preset"}
    assert {rows[name]["from"] for name in list(rows)[9:]} == {"config.json"}


@pytest.mark.parametrize("name,total,active", [
    ("deepseek-v3", 671e9, 37e9),  # the DeepSeek-V3 report: 671B total, 37B activated
    ("qwen3-30b-a3b", 30.5e9, 3.3e9),  # Qwen's model card
    ("mixtral-8x7b", 46.7e9, 12.9e9),  # Jiang et al. 2024: 47B, 13B active
])
def test_sizes_are_the_published_ones(rows, name: str, total: float, active: float) -> None:
    assert rows[name]["params"] == pytest.approx(total, rel=0.01)
    assert rows[name]["active"] == pytest.approx(active, rel=0.03)


def test_the_parts_are_the_configs(rows) -> None:
    """By hand from the config.json files: Qwen3-30B-A3B 48 layers of 128 experts, top 8,
    32 query heads on 4 key/value heads of 128; gpt-oss-120b's 36 layers alternate a
    128-token window with full attention and carry sinks; Falcon-7B has one key/value head;
    DeepSeek-V3 attends through latent attention."""
    qwen = rows["qwen3-30b-a3b"]
    assert (qwen["layers"], qwen["hidden"], qwen["heads"], qwen["kv"], qwen["head dim"]) == (48, 2048, 32, 4, 128)
    assert (qwen["experts"], qwen["attention"]) == ("128 top-8", "grouped")
    assert rows["gpt-oss-120b"]["attention"] == "grouped, window 128 in 18/36, sinks"
    assert rows["falcon-7b"]["attention"] == "multi-query"
    assert (rows["deepseek-v3"]["attention"], rows["deepseek-v3"]["experts"]) == ("latent", "256 top-8 +1 shared")
    assert rows["llama3-8b"]["experts"] == "-"


def test_the_table_has_a_line_a_model(capsys) -> None:
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["name", "from", "params", "active"]
    assert len(lines) == 1 + 28 + 1
    assert lines[-1] == "(9 presets and 19 shipped config.json files; any other config.json is taken by its path)"
    qwen = next(line for line in lines if line.startswith("qwen3-30b-a3b "))
    assert "30.53 B" in qwen and "3.35 B" in qwen


def test_an_unwritable_json_is_one_line(capsys, tmp_path) -> None:
    status = main(["models", "--json", str(tmp_path / "missing" / "models.json")])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1 and "does not exist" in err
