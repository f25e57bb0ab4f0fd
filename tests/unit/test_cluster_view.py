"""ClusterView against a fake ClusterStatus: one synchronous ask when there is no view, background refreshes when it
is only old, the old view kept when the master fails, and the master's own placement rule."""

from __future__ import annotations

import os
import threading
import time

import pytest
from client_fakes import FakeRpcError, key

from kvpool.client.cluster import ClusterView
from kvpool.placement import TOO_LARGE, Candidate, place
from kvpool.rpc import local_host_id
from kvpool.tiers.arena import SharedArena, shm_path
from kvpool.v1 import common_pb2, master_pb2

MIB = 1 << 20


def status(*names: str, host_id: str = "other-host", max_block: int = MIB) -> master_pb2.ClusterStatusResponse:
    reply = master_pb2.ClusterStatusResponse()
    for i, name in enumerate(names):
        s = reply.nodes.add(node=common_pb2.NodeRef(node_id=name, address=f"{name}.invalid:1", host_id=host_id,
                                                     arena=f"arena-{name}", data_address=f"{name}.invalid:2"),
                            dram_max_block_bytes=max_block)
        s.tiers.add(tier=common_pb2.TIER_DRAM, capacity_bytes=64 * MIB, used_bytes=i * MIB)
    return reply


class Master:
    """ClusterStatus answers in turn (an exception is raised); ``gate``, when set, holds every answer until set."""

    def __init__(self, *answers: object):
        self.answers = list(answers)
        self.asked = 0
        self.gate: threading.Event | None = None
        self.done = threading.Event()

    def __call__(self) -> master_pb2.ClusterStatusResponse:
        self.asked += 1
        if self.gate is not None:
            assert self.gate.wait(30), "test: the gate was never opened"
        answer = self.answers[min(self.asked, len(self.answers)) - 1]
        self.done.set()
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[return-value]


def test_the_first_use_asks_the_master_and_tells_the_directory_the_nodes():
    learned = []
    master = Master(status("a", "b"))
    view = ClusterView(master, refresh_s=3600, on_nodes=learned.append)
    assert [n.ref.node_id for n in view.nodes()] == ["a", "b"]
    assert [n.node_id for n in learned[0]] == ["a", "b"] and learned[0][0].data_address == "a.invalid:2"
    assert [n.candidate for n in view.nodes()] == [Candidate("a", 64 * MIB, 0, MIB), Candidate("b", 64 * MIB, MIB, MIB)]
    assert master.asked == 1  # a fresh view is not asked again


def test_a_view_is_placed_from_as_the_master_places():
    view = ClusterView(Master(status("a", "b", "c")), refresh_s=3600)
    keys, sizes = [key(i) for i in range(50)], [4096] * 49 + [2 * MIB]
    placement = view.place(keys, sizes)
    assert placement is not None
    assert [n.node_id for n in placement.nodes] == ["a", "b", "c"]
    assert placement.node_indexes == place(keys, sizes, [n.candidate for n in view.nodes()])
    assert placement.node_indexes[-1] == TOO_LARGE and set(placement.node_indexes[:-1]) <= {0, 1, 2}


@pytest.mark.parametrize("answer", [FakeRpcError(), master_pb2.ClusterStatusResponse()],
                         ids=["master-down", "no-nodes"])
def test_no_view_places_nothing_so_the_caller_asks_the_master(answer):
    view = ClusterView(Master(answer), refresh_s=3600)
    assert view.place([key(1)], [10]) is None


def test_a_failed_refresh_keeps_the_view_it_had():
    view = ClusterView(Master(status("a"), FakeRpcError()), refresh_s=3600)
    assert view.refresh() is True
    assert view.refresh() is False
    assert [n.ref.node_id for n in view.nodes()] == ["a"]


def test_an_old_view_is_used_at_once_while_one_refresh_runs_in_the_background():
    master = Master(status("a"), status("a", "b"))
    view = ClusterView(master, refresh_s=0.0)
    assert [n.ref.node_id for n in view.nodes()] == ["a"]
    master.gate, master.done = threading.Event(), threading.Event()  # the next answer waits for the test
    try:
        assert [n.ref.node_id for n in view.nodes()] == ["a"]  # answered while the refresh is held
        assert [n.ref.node_id for n in view.nodes()] == ["a"]  # and no second refresh is started meanwhile
        assert master.asked == 2
    finally:
        master.gate.set()
    assert master.done.wait(30)
    deadline = time.monotonic() + 30
    while len(view.nodes()) != 2:
        assert time.monotonic() < deadline, "the background refresh never replaced the view"
        time.sleep(0.01)


def test_an_invalidated_view_is_asked_again_before_it_is_used():
    master = Master(status("a"), status("b"))
    view = ClusterView(master, refresh_s=3600)
    view.nodes()
    view.invalidate()
    assert [n.ref.node_id for n in view.nodes()] == ["b"] and master.asked == 2


def test_only_a_node_on_this_host_with_an_arena_here_gets_an_arena_file(arena_name):
    arena = SharedArena.create(arena_name, 1 << 16, 4)
    try:
        here = status("a", host_id=local_host_id())
        here.nodes[0].node.arena = arena_name
        (mine,) = ClusterView(Master(here), refresh_s=3600).nodes()
        st = os.stat(shm_path(arena_name))
        assert mine.arena_file == (st.st_dev, st.st_ino)
        (other,) = ClusterView(Master(status("a")), refresh_s=3600).nodes()
        assert other.arena_file is None
    finally:
        arena.close()
