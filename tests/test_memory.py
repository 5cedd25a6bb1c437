"""Memory per rank: activation stashes from the Trace, static state, OOM flags."""

from __future__ import annotations

import json

import pytest

from pipesim.cli import main
from pipesim.costs import Costs, StageCost
from pipesim.memory import BytesPerParam, OutOfMemoryError, check_memory, parse_bytes_per_param
from pipesim.simulation import run_simulation
from pipesim.topology import ideal_topology
from pipesim.topology_file import topology_from_dict
from schedules import generate

STASH = 1e9


def stash_costs(num_stages: int, param_bytes: float = 0.0, act_bytes: float = 0.0) -> Costs:
    stage = StageCost(fwd=1.0, bwd=2.0, stash_bytes=STASH, param_bytes=param_bytes, act_bytes=act_bytes)
    return Costs(stages=(stage,) * num_stages)


@pytest.mark.parametrize("pp,microbatches", [(4, 8), (4, 12), (3, 5)])
def test_rank0_stash_peak_is_p_for_1f1b_and_m_for_gpipe(pp, microbatches):
    one_f_one_b = run_simulation(generate("1f1b", pp, microbatches), stash_costs(pp), ideal_topology())
    gpipe = run_simulation(generate("gpipe", pp, microbatches), stash_costs(pp), ideal_topology())
    assert one_f_one_b.memory[0].peak_stash_bytes == pp * STASH
    assert gpipe.memory[0].peak_stash_bytes == microbatches * STASH
    assert one_f_one_b.memory[-1].peak_stash_bytes == STASH
    timeline = gpipe.memory[0].timeline
    assert timeline[0][0] == 0.0 and timeline[-1][1] == 0.0  # all stashes freed by the end
    assert max(value for _, value in timeline) == microbatches * STASH


def test_static_memory_is_16_bytes_per_parameter_by_default_and_buffers_per_peer():
    params = 1e9  # 2e9 bytes of bf16 weights per stage
    result = run_simulation(generate("1f1b", 2, 2), stash_costs(2, param_bytes=2 * params, act_bytes=1e6),
                            ideal_topology())
    rank = result.memory[0]
    assert rank.static_bytes == pytest.approx(16 * params)
    assert rank.buffer_bytes == pytest.approx(2 * 1e6)  # one peer: activation out, gradient in
    assert rank.peak_bytes == pytest.approx(16 * params + 2e6 + 2 * STASH)
    assert parse_bytes_per_param("4,4,8") == BytesPerParam(4, 4, 8)
    with pytest.raises(ValueError, match="WEIGHTS,GRADS,OPTIMIZER"):
        parse_bytes_per_param("2,2")


SMALL_GPUS = {
    "devices": [{"name": "g0", "memory_bytes": 10e9}, {"name": "g1", "memory_bytes": 10e9}],
    "links": [{"src": "g0", "dst": "g1", "bandwidth": 10e9, "latency": 1e-6}],
}


def test_a_plan_that_does_not_fit_is_flagged():
    result = run_simulation(generate("gpipe", 2, 16), stash_costs(2), topology_from_dict(SMALL_GPUS))
    assert result.oom and result.memory[0].oom
    document = result.to_dict()
    assert document["oom"] is True
    assert document["ranks"][0]["peak_memory_bytes"] == 16 * STASH
    assert "warning: rank 0 on g0 needs 16.00 GB but the device holds 10.00 GB" in result.summary()
    with pytest.raises(OutOfMemoryError, match="rank 0 on g0 peaks at 16.00 GB .* holds 10.00 GB"):
        check_memory(result.memory)
    fits = run_simulation(generate("1f1b", 2, 16), stash_costs(2), topology_from_dict(SMALL_GPUS))
    assert not fits.oom


def test_simulate_fail_on_oom_exits_non_zero_naming_the_rank(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["simulate", "--model", "gpt3-175b", "--pp", "2", "--topology", "nvlink", "--json", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text())["oom"] is True
    assert "out of memory" in capsys.readouterr().out
    assert main([*argv, "--fail-on-oom"]) == 3
    error = capsys.readouterr().err
    assert "out of memory: rank 0 on n0.gpu0 peaks at" in error and "holds 80.00 GB" in error
