"""Ring attention's math and messages, on one process: the cp ranks are threads whose
ring passes tensors through queues, so shapes can be varied freely (hypothesis) in a
fraction of a second. Held to whole-sequence causal attention (torch's
``scaled_dot_product_attention``) and its autograd gradients, and to the messages
``simulate --cp-comm p2p`` prices (``pipesim.sim.context_parallel``): ``cp - 1`` of
``S`` bytes forward; ``S``, ``cp - 2`` of ``2 S`` and ``S`` backward.
"""

from __future__ import annotations

import queue
import threading

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch spelling
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.context_parallel import chunk_positions
from executor.ring_attention import Ring, ring_attention

pytestmark = pytest.mark.timeout(120)


class ThreadRing(Ring):
    """A ring whose ranks are threads of this process, messages passed through queues."""

    def __init__(self, cp: int, cp_index: int, positions: list[torch.Tensor], boxes: dict) -> None:
        super().__init__(None, cp, cp_index, positions, sent=[])
        self.boxes = boxes
        self.types: list[torch.dtype] = []  # of each message sent

    def exchange(self, tensor: torch.Tensor, to: int, source: int):
        me, cp = self.cp_index, self.cp
        self.sent.append(tensor.numel())
        self.types.append(tensor.dtype)
        self.boxes[me, (me + to) % cp].put(tensor.detach().clone())
        received = torch.empty_like(tensor)
        box = self.boxes[(me + source) % cp, me]

        class Work:
            def wait(self) -> None:
                received.copy_(box.get(timeout=20))

        return received, [Work()]


def run_ring(q, k, v, weight, cp):
    """Every cp rank's output and gradients (``q``, ``k``, ``v`` of its positions) for the
    loss ``sum(out * weight)``, each rank a thread; and the rings (their messages)."""
    seq = q.shape[2]
    positions = [chunk_positions(seq, cp, rank) for rank in range(cp)]
    boxes = {(a, b): queue.Queue() for a in range(cp) for b in range(cp)}
    rings = [ThreadRing(cp, rank, positions, boxes) for rank in range(cp)]
    results, errors = [None] * cp, []

    def rank_body(rank: int) -> None:
        try:
            mine = positions[rank]
            leaves = [x[:, :, mine].clone().requires_grad_() for x in (q, k, v)]
            out = ring_attention(*leaves, rings[rank])
            (out * weight[:, :, mine]).sum().backward()
            results[rank] = (out.detach(), *(leaf.grad for leaf in leaves))
        except Exception as error:  # noqa: BLE001 - handed to the test thread
            errors.append(error)

    threads = [threading.Thread(target=rank_body, args=(rank,)) for rank in range(cp)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
    return results, positions, rings


def reference(q, k, v, weight):
    """Whole-sequence causal attention and its gradients (GQA by repeating heads)."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(leaves[0], leaves[1].repeat_interleave(groups, dim=1),
                                         leaves[2].repeat_interleave(groups, dim=1), is_causal=True)
    (out * weight).sum().backward()
    return (out.detach(), *(leaf.grad for leaf in leaves))


def random_case(cp: int, chunk: int, kv_heads: int, groups: int, dim: int, v_dim: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    batch, seq, heads = 2, 2 * cp * chunk, kv_heads * groups

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    return (draw(batch, heads, seq, dim), draw(batch, kv_heads, seq, dim), draw(batch, kv_heads, seq, v_dim),
            draw(batch, heads, seq, v_dim))


@settings(max_examples=12, deadline=None)
@given(cp=st.integers(2, 4), chunk=st.integers(1, 3), kv_heads=st.integers(1, 2), groups=st.integers(1, 3),
       dim=st.sampled_from([2, 4]), v_dim=st.sampled_from([2, 3]), seed=st.integers(0, 2**16))
def test_ring_equals_whole_sequence_attention_and_its_gradients(cp, chunk, kv_heads, groups, dim, v_dim, seed):
    q, k, v, weight = random_case(cp, chunk, kv_heads, groups, dim, v_dim, seed)
    expected = reference(q, k, v, weight)
    results, positions, _ = run_ring(q, k, v, weight, cp)
    for rank, mine in enumerate(positions):
        for name, got, want in zip(("out", "dq", "dk", "dv"), results[rank], expected, strict=True):
            assert torch.allclose(got, want[:, :, mine], atol=1e-12, rtol=0), (rank, name)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_messages_are_the_ones_the_simulator_prices(cp: int) -> None:
    """GQA, 2 key/value heads of width 4 (values 3 wide), batch 2, 2 tokens a chunk: a
    rank's keys and values are S = 2 x 2 x (2 x 2 tokens) x (4 + 3) = 112 elements. The
    forward sends S at each of its first cp - 1 steps; the backward S (keys and values),
    cp - 2 times 2S (keys, values and their gradients), then S (the gradients home)."""
    q, k, v, weight = random_case(cp, 2, 2, 2, 4, 3, seed=cp)
    _, _, rings = run_ring(q, k, v, weight, cp)
    size = 2 * 2 * 4 * (4 + 3)
    for ring in rings:
        assert ring.sent == [size] * (cp - 1) + [size] + [2 * size] * (cp - 2) + [size]


def test_latent_attention_shapes_run_the_ring() -> None:
    """MLA's shapes: as many key heads as query heads, values narrower than keys."""
    q, k, v, weight = random_case(3, 2, 3, 1, 5, 2, seed=7)
    expected = reference(q, k, v, weight)
    results, positions, _ = run_ring(q, k, v, weight, 3)
    for rank, mine in enumerate(positions):
        assert torch.allclose(results[rank][2], expected[2][:, :, mine], atol=1e-12, rtol=0)


def test_bfloat16_travels_as_bfloat16_and_is_computed_in_float32() -> None:
    """Under bf16 the ring sends keys, values and their gradients in bf16 (the bytes the
    simulator prices with 2-byte elements) and merges in float32: the output is the
    float32 reference's rounded to bf16, within bf16's resolution."""
    q, k, v, weight = random_case(3, 2, 2, 2, 4, 4, seed=3)
    expected = reference(q.float(), k.float(), v.float(), weight.float())
    low = [x.to(torch.bfloat16) for x in (q, k, v, weight)]
    results, positions, rings = run_ring(*low, cp=3)
    assert all(kind == torch.bfloat16 for ring in rings for kind in ring.types)
    for rank, mine in enumerate(positions):
        out = results[rank][0]
        assert out.dtype == torch.bfloat16
        assert torch.allclose(out.float(), expected[0][:, :, mine].float(), atol=3e-2, rtol=0)
