"""Node-limited routing (DeepSeek-V3, sections 2.1.2 and 3.2.2): a token's experts sit on
at most M nodes and it crosses to each once, so the expert all-to-all's traffic between
nodes is at most M of a token's k routed copies.

Expected by hand: DeepSeek-V3's config (n_group 8, topk_group 4, topk_method noaux_tc)
limits a token to 4 nodes; its 8 routed copies then cross between nodes as
``min(4, nodes) / 8`` of them; the all-to-all's pace is its most loaded link's pieces
over its bandwidth.
"""

from __future__ import annotations

import json

import pytest

from pipesim.cli import main
from pipesim.cluster.collectives import all_to_all
from pipesim.cluster.presets import ib
from pipesim.model.errors import ModelSpecError
from pipesim.model.experts import node_limited_share
from pipesim.model.hf_config import spec_from_hf_config
from pipesim.model.spec import BUNDLED_CONFIGS

CONFIGS = BUNDLED_CONFIGS


def config(name: str, **changes) -> dict:
    data = {**json.loads((CONFIGS / f"{name}.json").read_text()), **changes}
    return {key: value for key, value in data.items() if value is not None}


def test_deepseeks_group_limited_routing_is_read_as_a_node_limit():
    assert spec_from_hf_config(config("deepseek-v3")).moe.node_limit == 4
    assert spec_from_hf_config(config("deepseek-v3", topk_method="greedy")).moe.node_limit is None
    assert spec_from_hf_config(config("deepseek-v3", n_group=None, topk_group=None,
                                      topk_method=None)).moe.node_limit is None
    assert spec_from_hf_config(config("deepseek-v2-lite")).moe.node_limit is None  # greedy
    with pytest.raises(ModelSpecError, match="topk_method 'sparsemixer' is not a routing pipesim models"):
        spec_from_hf_config(config("deepseek-v3", topk_method="sparsemixer"))


@pytest.mark.parametrize("limit,copies,nodes,share", [
    (4, 8, 8, 0.5), (4, 8, 2, 0.25), (4, 8, 1, 1.0), (0, 8, 8, 1.0), (8, 8, 16, 1.0), (4, 8, 64, 0.5)])
def test_the_share_of_copies_that_cross_nodes(limit, copies, nodes, share):
    assert node_limited_share(limit, copies, nodes) == share


def test_the_all_to_all_carries_the_share_on_links_between_nodes():
    """16 GPUs on two nodes of the ib preset: a GPU sends 1/16 of S to each member, 7
    pieces over its NVSwitch link and 8 through its NIC; with a share of 0.25 the 8 go at
    a quarter of their bytes."""
    topology = ib(nodes=2, gpu="h800")
    group = topology.devices[:16]
    local, remote = topology.route(group[0], group[1]), topology.route(group[0], group[8])
    latency = max(local.latency, remote.latency)
    size = 1e9
    for share in (1.0, 0.25):
        pace = max(7 / 16 / local.bandwidth, share * 8 / 16 / remote.bandwidth)
        assert all_to_all(topology, group, size, (), share) == pytest.approx(size * pace + latency, rel=1e-12)


def test_deepseek_v3s_expert_all_to_all_across_two_nodes(tmp_path):
    """ep 16 over two 8-GPU nodes: with the limit a token crosses once (2 of its 8 copies
    reach at most the 2 nodes, one of them its own), without it 4 times on average."""
    spent = {}
    for name, data in (("limited", config("deepseek-v3")),
                       ("free", config("deepseek-v3", n_group=None, topk_group=None, topk_method=None))):
        path, out = tmp_path / f"{name}.json", tmp_path / f"{name}-result.json"
        path.write_text(json.dumps(data))
        assert main(["simulate", "--model", str(path), "--layers", "4", "--pp", "1", "--dp", "16", "--ep", "16",
                     "-m", "1", "--topology", "ib", "--nodes", "2", "--gpu", "h800", "--json", str(out)]) == 0
        spent[name] = json.loads(out.read_text())["ranks"][0]["ep"]
    assert 0 < spent["limited"] < spent["free"] / 2
