"""Every number a user gives is checked: NaN, inf, null and negative values in flags,
costs files and topology files are one-line errors naming the value and where it is;
``--json`` is strict JSON."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipesim.cli import main
from pipesim.cluster.files import TopologyError, topology_from_dict
from pipesim.model.costs import CostsError, check_number, costs_from_dict


def error_of(capsys, *argv) -> str:
    """Run the CLI expecting a usage error; return its one line of stderr."""
    assert main([str(arg) for arg in argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("flag,value", [
    ("--fwd", "nan"), ("--fwd", "inf"), ("--fwd", "-1"), ("--bwd", "nan"), ("--wgrad", "inf"),
    ("--act-bytes", "nan"), ("--act-bytes", "-5"), ("--stash-bytes", "inf"), ("--param-bytes", "nan"),
    ("--bucket-mb", "nan"), ("--bucket-mb", "0"),
])
def test_flag_numbers_must_be_finite_and_non_negative(capsys, flag, value):
    line = error_of(capsys, "simulate", "--pp", 2, "-m", 2, flag, value)
    assert flag in line and value.lstrip("-") in line.lower()


@pytest.mark.parametrize("argv,expected", [
    (["--model", "gpt3-1.3b", "--mfu", "nan"], "--mfu is a fraction of peak in (0, 1], got nan"),
    (["--model", "gpt3-1.3b", "--mfu", "1.5"], "got 1.5"),
    (["--model", "gpt3-1.3b", "--heads", "-4"], "heads must be an integer >= 1, got -4"),
    (["--model", "llama3-8b", "--kv-heads", "5"], "heads 32 is not a multiple of kv_heads 5"),
    (["--bytes-per-param", "nan,2,12"], "--bytes-per-param 'nan,2,12'"),
    (["--bytes-per-param", "2,inf,12"], "--bytes-per-param '2,inf,12'"),
])
def test_model_and_memory_flags(capsys, argv, expected):
    assert expected in error_of(capsys, "simulate", "--pp", 2, "-m", 2, *argv)


@pytest.mark.parametrize("document,expected", [
    ({"stages": [{"fwd": None, "bwd": 1}]}, "stages[0].fwd must be a number >= 0, got None"),
    ({"stages": [{"fwd": float("nan"), "bwd": 1}]}, "stages[0].fwd must be a finite number >= 0, got nan"),
    ({"stages": [{"fwd": 1, "bwd": float("inf")}]}, "stages[0].bwd must be a finite number >= 0, got inf"),
    ({"stages": [{"fwd": 1, "bwd": 2, "act_bytes": -1}]}, "stages[0].act_bytes must be a finite number >= 0"),
    ({"stages": [{"fwd": 1, "bwd": 2, "stash_bytes": "many"}]}, "stages[0].stash_bytes must be a number"),
    ({"stages": [{"fwd": 1, "bwd": 2}], "action_overhead": -5}, "action_overhead must be a finite number >= 0, got -5"),
    ({"stages": [{"fwd": 1, "bwd": 2}], "comm_overhead": float("nan")}, "comm_overhead must be a finite number"),
    ({"stages": [{"fwd": 1, "bwd": 2}], "step_overhead": None}, "step_overhead must be a number >= 0, got None"),
    ({"stages": [{"fwd": 1, "bwd": 2, "stage": -1}]}, "'stage' must be an integer >= 0, got -1"),
])
def test_costs_documents(document, expected):
    with pytest.raises(CostsError) as error:
        costs_from_dict(document, 1, name="costs.json")
    assert expected in str(error.value) and str(error.value).startswith("costs.json")


def test_costs_file_errors_reach_the_user_as_one_line(tmp_path, capsys):
    path = tmp_path / "costs.json"
    path.write_text('{"stages": [{"fwd": null, "bwd": 1}]}')
    assert "stages[0].fwd must be a number >= 0, got None" in error_of(capsys, "simulate", "--costs", path)
    path.write_text('{"stages": [{"fwd": 1, "bwd": 2}], "action_overhead": -5}')
    assert "action_overhead" in error_of(capsys, "simulate", "--costs", path)
    yaml_path = tmp_path / "costs.yaml"
    yaml_path.write_text("stages:\n  - {fwd: .nan, bwd: 1}\n")
    assert "got nan" in error_of(capsys, "simulate", "--costs", yaml_path)


TWO_GPUS = {"devices": [{"name": "g0"}, {"name": "g1"}],
            "links": [{"src": "g0", "dst": "g1", "bandwidth": 1e9, "latency": 1e-6}]}


@pytest.mark.parametrize("section,index,key,value,expected", [
    ("links", 0, "bandwidth", float("nan"), "links[0]: 'bandwidth' must be a finite number, got nan"),
    ("links", 0, "bandwidth", float("inf"), "'bandwidth' must be a finite number, got inf"),
    ("links", 0, "latency", None, "links[0]: 'latency' must be a number, got None"),
    ("links", 0, "latency", -1e-6, "'latency' must be >= 0, got -1e-06"),
    ("links", 0, "efficiency", float("nan"), "'efficiency' must be a finite number"),
    ("devices", 1, "memory_bytes", float("nan"), "devices[1]: 'memory_bytes' must be a finite number, got nan"),
    ("devices", 0, "peak_flops", -1, "devices[0]: 'peak_flops' must be > 0, got -1"),
    ("devices", 0, "memory_bandwidth", "fast", "'memory_bandwidth' must be a number, got 'fast'"),
    ("devices", 0, "gpu", "v100", "devices[0]: unknown gpu 'v100'"),
])
def test_topology_numbers(section, index, key, value, expected):
    document = json.loads(json.dumps(TWO_GPUS))
    document[section][index][key] = value
    with pytest.raises(TopologyError) as error:
        topology_from_dict(document, name="cluster.json")
    assert expected in str(error.value)


def test_topology_devices_may_name_a_gpu():
    document = json.loads(json.dumps(TWO_GPUS))
    document["devices"][0]["gpu"] = "a100-40gb"
    document["devices"][1].update(gpu="h200", memory_bytes=100e9)
    topology = topology_from_dict(document)
    assert topology.device_memory("g0") == 40960 * 2**20 and topology.device_peak_flops("g0") == 312e12
    assert topology.device_memory("g1") == 100e9 and topology.device_peak_flops("g1") == 989e12


def test_json_output_is_strict(tmp_path):
    """Unbounded capacities and every other figure parse without NaN/Infinity."""
    out = tmp_path / "r.json"
    assert main(["simulate", "--model", "gpt3-1.3b", "--pp", "2", "-m", "2", "--json", str(out)]) == 0

    def refuse(constant: str):
        raise AssertionError(f"--json wrote {constant}")

    document = json.loads(out.read_text(), parse_constant=refuse)
    assert document["ranks"][0]["memory"]["capacity_bytes"] is None


@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**6, 10**6), st.none(),
                 st.text(max_size=3), st.booleans()))
def test_check_number_accepts_exactly_the_finite_non_negative_numbers(value):
    valid = (isinstance(value, (int, float)) and not isinstance(value, bool)
             and math.isfinite(value) and value >= 0)
    if valid and value <= 1e15:  # at most a million billion seconds or bytes: no step costs more
        assert check_number(value, "x") == float(value)
    elif valid:
        with pytest.raises(CostsError, match=r"^x .* is beyond what a step can cost"):
            check_number(value, "x")
    else:
        with pytest.raises(CostsError, match=r"^x must be a"):
            check_number(value, "x")
