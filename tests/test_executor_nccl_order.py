"""The measuring loops (``profile``'s overheads, ``bench-comm``'s sendrecv) post their
point-to-point operations in an order NCCL completes.

Each loop runs in this process once per rank against a recording stand-in for
``torch.distributed``; the recorded per-rank streams are then played under NCCL's rule,
written out here independently of the code under test: a rank's operations run in the
order posted (one stream); between a pair of ranks the k-th send matches the k-th
receive; a batch completes once every op in it has its match posted; an unbatched
operation is a batch of one; a barrier completes once every rank reached it. The loops
as they were before the fix (16 unbatched receives, a barrier, then the sends) deadlock
under this rule, and the test says so too.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import executor.bench_comm as bench_comm_module
import executor.overheads as overheads


class Work:
    def wait(self) -> None:
        pass

    def is_completed(self) -> bool:
        return True


class RecordingDist:
    """Enough of ``torch.distributed`` for the loops; records what one rank posts."""

    ReduceOp = SimpleNamespace(MAX="max")

    def __init__(self) -> None:
        self.stream: list[tuple] = []  # ("batch", ((op, peer), ...)) or ("barrier",)

    def isend(self, tensor, dst, tag=0):
        self.stream.append(("batch", (("send", dst),)))
        return Work()

    def irecv(self, tensor, src, tag=0):
        self.stream.append(("batch", (("recv", src),)))
        return Work()

    def P2POp(self, op, tensor, peer, tag=0):  # noqa: N802 - torch's name
        return ("send" if op == self.isend else "recv", peer)

    def batch_isend_irecv(self, ops):
        self.stream.append(("batch", tuple(ops)))
        return [Work() for _ in ops]

    def barrier(self) -> None:
        self.stream.append(("barrier",))

    def all_reduce(self, tensor, op=None) -> None:
        pass


def completes_under_rendezvous(streams: dict[int, list[tuple]]) -> bool:
    """Play every rank's stream under NCCL's rule; False on a deadlock."""
    position = dict.fromkeys(streams, 0)
    posted = {rank: Counter() for rank in streams}  # ("send"|"recv", peer) -> count posted so far
    head_counted = dict.fromkeys(streams, False)
    while True:
        moved = False
        for rank, stream in streams.items():  # post the op at each rank's head (once)
            if position[rank] < len(stream) and not head_counted[rank]:
                item = stream[position[rank]]
                if item[0] == "batch":
                    for op in item[1]:
                        posted[rank][op] += 1
                head_counted[rank] = True
        for rank, stream in streams.items():
            if position[rank] >= len(stream):
                continue
            item = stream[position[rank]]
            if item[0] == "barrier":
                done = all(position[r] < len(streams[r]) and streams[r][position[r]][0] == "barrier"
                           for r in streams)
                if done:
                    for r in streams:
                        position[r] += 1
                        head_counted[r] = False
                    moved = True
                    break
                continue
            # the n-th (op, peer) of this rank matches the peer's n-th opposite op toward us
            done = all(posted[peer][("recv" if op == "send" else "send", rank)] >= posted[rank][(op, peer)]
                       for op, peer in item[1])
            if done:
                position[rank] += 1
                head_counted[rank] = False
                moved = True
        if all(position[rank] >= len(stream) for rank, stream in streams.items()):
            return True
        if not moved:
            return False


def record(monkeypatch, module, world: int, run) -> dict[int, list[tuple]]:
    streams = {}
    for rank in range(world):
        recorder = RecordingDist()
        monkeypatch.setattr(module, "dist", recorder)
        run(rank)
        streams[rank] = recorder.stream
    return streams


def test_the_rule_itself_catches_the_old_overhead_loop() -> None:
    def old(peer: int) -> list[tuple]:
        return [("batch", (("recv", peer),))] * 16 + [("barrier",)] + [("batch", (("send", peer),))] * 16

    assert not completes_under_rendezvous({0: old(1), 1: old(0)})
    paired = [("batch", (("send", 1), ("recv", 1)))] * 3
    assert completes_under_rendezvous({0: paired, 1: [("batch", (("send", 0), ("recv", 0)))] * 3})


@pytest.mark.parametrize("world", [2, 3, 4])
def test_p2p_overheads_loop_completes_under_rendezvous(monkeypatch, world: int) -> None:
    streams = record(monkeypatch, overheads, world, lambda rank: overheads.p2p_overheads(
        (2, 3), torch.float32, rank, world, torch.device("cpu"), warmup=1, repeats=1))
    assert all(item[0] == "barrier" or len(item[1]) == 2 for stream in streams.values() for item in stream)
    assert completes_under_rendezvous(streams)


@pytest.mark.parametrize("world", [3])  # a ring of distinct peers; the loop's compute makes it slow
def test_transfer_cost_loop_completes_under_rendezvous(monkeypatch, world: int) -> None:
    streams = record(monkeypatch, overheads, world, lambda rank: overheads.transfer_interference(
        (2, 3), torch.float32, rank, world, torch.device("cpu"), min_time=0.0))
    assert completes_under_rendezvous(streams)


@pytest.mark.parametrize("world", [2, 4])
def test_bench_comm_sendrecv_completes_under_rendezvous(monkeypatch, world: int) -> None:
    def run(rank: int) -> None:
        for _ in range(3):
            bench_comm_module.operation("sendrecv", 1024, rank, world, torch.device("cpu"))()

    assert completes_under_rendezvous(record(monkeypatch, bench_comm_module, world, run))
