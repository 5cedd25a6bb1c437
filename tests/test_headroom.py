"""The headroom rule (``pipesim.sim.headroom``): each part against hand calculation from the
published figures (NCCL's buffer constants, the CUDA context, the fragmentation share), the
communicators a rank joins read off the placement, the per-rank report, and bad settings
refused in one line."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.cli import main
from pipesim.sim.headroom import (
    NCCL_CONNECTION_BYTES,
    Communicators,
    Headroom,
    nccl_buffer_bytes,
    p2p_channels_per_peer,
    parse_headroom,
)
from pipesim.sim.memory import rank_communicators
from schedules.generators import placement_of

MiB = 2**20
RING = 32 * 10 * MiB  # one peer per channel, 32 channels, 10 MiB of buffers per connection
CONTEXT = 426 * MiB
H100 = 81559 * MiB


def test_one_connection_holds_nccl_s_three_protocol_buffers_in_2_mib_pages():
    # Simple 4 MiB (NCCL_BUFFSIZE) + LL 8 lines x 512 threads x 8 steps x 16 bytes (512 KiB)
    # + LL128 120 elements x 640 threads x 8 steps x 8 bytes = 9,633,792 bytes: 4.6 pages of
    # 2 MiB, so 5 pages, the 10485760-byte allocation NCCL logs
    assert 4 * MiB + 8 * 512 * 8 * 16 + 120 * 640 * 8 * 8 == 9_633_792
    assert NCCL_CONNECTION_BYTES == 5 * 2 * MiB == 10_485_760


def test_each_communicator_kind_by_hand():
    # a middle rank of a 4-rank pipeline in a tp 8, dp 64 (x cp 2), cp 2, ep 4 job: rings
    # receive from one peer per channel, the pipeline from both neighbours, the all-to-all
    # from the 3 others, on 32 channels each (groups of one node)
    rank = Communicators(tp=8, pp_peers=2, dp=128, cp=2, ep=4, expert_dp=32, pp=4)
    assert nccl_buffer_bytes(rank) == {"tp": RING, "dp": RING, "cp": RING, "pp": 2 * RING, "ep": 3 * RING,
                                       "expert_dp": RING}
    # one rank alone joins nothing; groups of one are no communicators
    assert nccl_buffer_bytes(Communicators()) == {}
    assert nccl_buffer_bytes(Communicators(tp=1, pp_peers=1, dp=1, ep=2, expert_dp=1)) == {"pp": RING, "ep": RING}


def test_point_to_point_channels_shrink_with_the_group_as_nccl_s_do():
    # 32 channels per peer up to 8 ranks; above, halved while channels x ceil(ranks / 8) > 32
    assert [p2p_channels_per_peer(ranks) for ranks in (2, 8, 9, 16, 17, 32, 64, 128, 256, 512)] == \
        [32, 32, 16, 16, 8, 8, 4, 2, 1, 1]
    # Meta's pipeline of 16: two neighbours on 16 channels; DeepSeek-V3's ep 64: 63 peers on 4
    pipeline = Communicators(pp_peers=2, pp=16)
    assert nccl_buffer_bytes(pipeline) == {"pp": 2 * 16 * 10 * MiB}
    assert nccl_buffer_bytes(Communicators(ep=64)) == {"ep": 63 * 4 * 10 * MiB}


def test_the_pipeline_peers_come_from_the_placement():
    # 1F1B over 4 ranks: the ends have one neighbour, the middle two
    assert [c.pp_peers for c in rank_communicators(placement_of("1f1b", 4, 1), 4)] == [1, 2, 2, 1]
    # looped interleaving: rank 3's chunk feeds rank 0's next one, so every rank has two
    assert [c.pp_peers for c in rank_communicators(placement_of("interleaved-1f1b", 4, 2), 4)] == [2, 2, 2, 2]
    # over 2 ranks the two neighbours are one rank
    assert [c.pp_peers for c in rank_communicators(placement_of("interleaved-1f1b", 2, 2), 2)] == [1, 1]
    # the V: stages 0..3 then 3..0, the turn on rank 3 stays on it
    assert [c.pp_peers for c in rank_communicators(placement_of("zbv", 4, 2), 4)] == [1, 2, 2, 1]
    # the job's groups reach every rank alike
    ranks = rank_communicators(placement_of("1f1b", 2, 1), 2, tp=8, dp=16, cp=2, ep=4, expert_dp=4)
    assert ranks[0] == Communicators(tp=8, pp_peers=1, dp=16, cp=2, ep=4, expert_dp=4, pp=2)


def test_usable_memory_by_the_rule_and_by_a_number():
    rank = Communicators(tp=8, pp_peers=2, dp=64)  # tp ring, dp ring, two neighbours: 4 x 320 MiB
    auto = parse_headroom("auto")
    assert auto.usable(H100, rank) == pytest.approx((H100 - CONTEXT - 4 * RING) / 1.03)
    assert auto.of(H100, rank) == pytest.approx(H100 - (H100 - CONTEXT - 4 * RING) / 1.03)
    assert auto.parts(rank) == {"cuda_context_bytes": CONTEXT, "nccl_bytes": nccl_buffer_bytes(rank),
                                "fragmentation_share": 0.03}
    assert parse_headroom("10%").usable(H100, rank) == pytest.approx(0.9 * H100)
    assert parse_headroom("6").usable(H100, rank) == pytest.approx(H100 - 6e9)
    assert parse_headroom("10%").parts(rank) is None
    # an unbounded device keeps nothing back
    assert auto.usable(float("inf"), rank) == float("inf") and auto.of(float("inf"), rank) == 0.0


@settings(max_examples=200, deadline=None)
@given(capacity=st.floats(1e9, 1e12), peak=st.floats(0, 1e12), tp=st.integers(1, 8), peers=st.integers(0, 2),
       dp=st.integers(1, 64), ep=st.integers(1, 8))
def test_fitting_under_the_usable_limit_is_fitting_the_device(capacity, peak, tp, peers, dp, ep):
    # the module's two forms of the verdict agree: peak <= usable exactly when the peak with
    # its fragmentation, the context and the buffers is within the capacity
    rank = Communicators(tp=tp, pp_peers=peers, dp=dp, ep=ep, expert_dp=dp, pp=4)
    whole = peak * 1.03 + CONTEXT + sum(nccl_buffer_bytes(rank).values())
    usable = parse_headroom("auto").usable(capacity, rank)
    if abs(whole - capacity) > 1e-6 * capacity:
        assert (peak <= usable) == (whole <= capacity)


@settings(max_examples=100, deadline=None)
@given(st.floats(0, 99.9), st.floats(0, 1000))
def test_a_number_overrides_the_rule(percent, gigabytes):
    assert parse_headroom(f"{percent}%").usable(H100) == pytest.approx(H100 * (1 - percent / 100))
    assert parse_headroom(f"{gigabytes}").usable(H100) == pytest.approx(H100 - gigabytes * 1e9)
    assert parse_headroom(f"{gigabytes}GB").usable(H100) == pytest.approx(H100 - gigabytes * 1e9)


def test_auto_is_the_default_and_spelled_freely():
    for text in ("auto", "AUTO", " auto "):
        assert parse_headroom(text) == Headroom(text="auto", auto=True)


@pytest.mark.parametrize("value", ["automatic", "", "-5%", "10 %x"])
def test_a_bad_setting_is_one_line_exit_2(value, capsys):
    assert main(["simulate", "--pp", "2", f"--memory-headroom={value}"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and f"--memory-headroom {value!r}: expected auto" in error


def test_each_rank_reports_its_parts(tmp_path, capsys):
    # 16 H100s on two nodes: tp 2 x dp 2 x pp 4, 1F1B. Rank 0 (an end) joins the tp ring, the
    # dp ring and one neighbour; rank 1 two neighbours. The pipeline spans the two nodes, so
    # NCCL gives every pipeline peer the network's 4 channels (a 400 Gb/s NIC at 14 GB/s a
    # channel), 4 x 10 MiB. The device holds the peak with 3% of it, the context and the
    # buffers; the rank may use (capacity - context - buffers) / 1.03.
    out = tmp_path / "r.json"
    argv = ["simulate", "--pp", "4", "-m", "8", "--tp", "2", "--dp", "2", "--topology", "ib", "--nodes", "2",
            "--gpu", "h100", "--param-bytes", "2e9", "--stash-bytes", "1e9", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    ranks = json.loads(out.read_text())["ranks"]
    for rank, peers in ((0, 1), (1, 2)):
        memory = ranks[rank]["memory"]
        headroom = memory["headroom"]
        net_peer = 4 * 10 * 2**20
        nccl = {"tp": RING, "dp": RING, "pp": peers * net_peer}
        assert headroom["rule"] == "auto" and headroom["nccl_bytes"] == nccl
        assert headroom["cuda_context_bytes"] == CONTEXT and headroom["fragmentation_share"] == 0.03
        peak = ranks[rank]["peak_memory_bytes"]
        assert headroom["fragmentation_bytes"] == pytest.approx(0.03 * peak)
        assert headroom["device_bytes"] == pytest.approx(1.03 * peak + CONTEXT + 2 * RING + peers * net_peer)
        assert memory["usable_bytes"] == pytest.approx((H100 - CONTEXT - 2 * RING - peers * net_peer) / 1.03)
        assert memory["oom"] is False
    assert "headroom (GB, --memory-headroom auto)" in text
    assert "tp 0.34, dp 0.34, pp 0.04" in text and "tp 0.34, dp 0.34, pp 0.08" in text
    assert main([*argv, "--memory-headroom", "10%"]) == 0
    memory = json.loads(out.read_text())["ranks"][0]["memory"]
    assert memory["headroom"] == {"rule": "fixed"} and memory["usable_bytes"] == pytest.approx(0.9 * H100)


def test_a_sweep_row_carries_the_usable_memory_its_verdict_was_judged_against(tmp_path):
    # GPipe over 2 H100s of one node: each rank has one pipeline neighbour (32 x 10 MiB of
    # NCCL buffers), so each may use (81559 MiB - 426 MiB - 320 MiB) / 1.03, the chart's line
    out = tmp_path / "rows.json"
    assert main(["sweep", "--model", "gpt3-1.3b", "--topology", "nvlink", "--schedule", "gpipe", "--pp", "2",
                 "-m", "2", "--quiet", "--json", str(out)]) == 0
    row = json.loads(out.read_text())[0]
    assert row["memory_headroom"] == "auto" and row["capacity_bytes"] == H100
    assert row["usable_bytes"] == pytest.approx((H100 - CONTEXT - RING) / 1.03)
