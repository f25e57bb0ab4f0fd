"""PoolClient's data paths in a chain, with fake paths and fake nodes (no master, no node): a block a path hands on
goes to the next path, a block a path missed is a miss, a stalled node's blocks go to no slower path, and every pool
fault is a counted miss, never an exception."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from client_fakes import (
    FakeArena,
    FakeBulkClient,
    FakeNodes,
    RecordingPath,
    block,
    hands_on_all,
    key,
    moves_all,
    node,
    run_of,
)

from kvpool.client.bulk_client import BulkUnavailable
from kvpool.client.bulk_path import BulkPath
from kvpool.client.cluster import ClusterView
from kvpool.client.faults import PoolFault
from kvpool.client.grpc_path import GrpcPath
from kvpool.client.local_index import LocalIndex
from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig
from kvpool.metrics import error_counts
from kvpool.v1 import common_pb2, master_pb2

PATHS = ("shared_memory", "bulk", "grpc")
HOST = "this-host"


@pytest.fixture
def client():
    # No master there (a closed port): nothing here may ask it; the paths and the view are fakes.
    c = PoolClient(ClientConfig(master="127.0.0.1:1", worker_id="unit", lookup_timeout_s=0.2, io_timeout_s=5.0))
    yield c
    c.close()


def moved(client: PoolClient, op: str) -> dict[str, float | None]:
    return {p: client.registry.get_sample_value("kvpool_path_blocks_total", {"path": p, "op": op}) for p in PATHS}


def odd_handed_on(node, idxs):
    return [i for i in idxs if i % 2 == 0], [i for i in idxs if i % 2]


def test_a_get_offers_each_path_only_what_the_faster_ones_handed_on(client):
    blocks = [block(i, 256) for i in range(6)]
    run = run_of([key(i) for i in range(6)], blocks, [node("n1")])
    shared = RecordingPath("shared", odd_handed_on, blocks)
    bulk = RecordingPath("bulk", lambda n, idxs: ([1], [i for i in idxs if i != 1]), blocks)
    last = RecordingPath("grpc", lambda n, idxs: ([3], []), blocks)  # block 5: a miss it counted
    client.paths = [shared, bulk, last]
    outs = [np.zeros(256, np.uint8) for _ in blocks]
    assert client.get_into(run, outs) == [True, True, True, True, True, False]
    assert [o for _, _, o in shared.offers] == [[0, 1, 2, 3, 4, 5]]
    assert [o for _, _, o in bulk.offers] == [[1, 3, 5]] and [o for _, _, o in last.offers] == [[3, 5]]
    assert all(np.array_equal(outs[i], blocks[i]) for i in range(5)) and not outs[5].any()
    assert moved(client, "get") == {"shared_memory": 3, "bulk": 1, "grpc": 1}


def test_a_block_a_path_missed_is_not_offered_to_the_next(client):
    blocks = [block(i, 64) for i in range(3)]
    shared = RecordingPath("shared", lambda n, idxs: ([0], []), blocks)  # 1 and 2 gone: misses, not handed on
    later = RecordingPath("bulk", moves_all, blocks)
    client.paths = [shared, later, later]
    assert client.get_into(run_of([key(i) for i in range(3)], blocks, [node()]),
                           [np.zeros(64, np.uint8) for _ in blocks]) == [True, False, False]
    assert later.offers == []


def test_each_nodes_blocks_go_through_the_paths_as_one_batch(client):
    a, b = node("a"), node("b")
    blocks = [block(i, 32) for i in range(5)]
    run = run_of([key(i) for i in range(5)], blocks, [a, b], [1, 0, 1, 0, 1])
    shared = RecordingPath("shared", moves_all, blocks)
    client.paths = [shared, RecordingPath("bulk", moves_all), RecordingPath("grpc", moves_all)]
    assert client.get_into(run, [np.zeros(32, np.uint8) for _ in blocks]) == [True] * 5
    assert sorted(shared.offers) == [("get", "a", [1, 3]), ("get", "b", [0, 2, 4])]


def test_a_stalled_nodes_blocks_are_counted_misses_not_handed_to_a_slower_path():
    with PoolClient(ClientConfig(master="127.0.0.1:1", io_timeout_s=0.05)) as client:
        blocks = [block(i, 16) for i in range(3)]
        stalled = RecordingPath("shared", hands_on_all, stall=True)
        slower = RecordingPath("bulk", moves_all, blocks)
        client.paths = [stalled, slower, slower]
        assert client.get_into(run_of([key(i) for i in range(3)], blocks, [node()]),
                               [np.zeros(16, np.uint8) for _ in blocks]) == [False] * 3
        assert slower.offers == [] and error_counts(client.registry) == {"timeout": 3}


def test_a_node_that_is_down_on_every_path_is_a_counted_miss_and_in_strict_mode_a_pool_fault():
    for strict in (False, True):
        with PoolClient(ClientConfig(master="127.0.0.1:1", strict=strict)) as client:
            nodes = FakeNodes(data_addresses={"n1.invalid:1": "n1.invalid:2"})
            bulk = BulkPath(client.config, nodes, client.faults)
            bulk.bulk = FakeBulkClient(raises=[BulkUnavailable("refused")])
            grpc_path = GrpcPath(client.config, nodes, client.faults)
            nodes.stub("n1.invalid:1").fail = grpc.StatusCode.UNAVAILABLE
            client.paths = [RecordingPath("shared", hands_on_all), bulk, grpc_path]
            blocks = [block(i, 16) for i in range(2)]
            run = run_of([key(i) for i in range(2)], blocks, [node("n1")])
            outs = [np.zeros(16, np.uint8) for _ in blocks]
            if strict:
                with pytest.raises(PoolFault):
                    client.get_into(run, outs)
            else:
                assert client.get_into(run, outs) == [False, False]
                assert error_counts(client.registry) == {"unavailable": 2}
                assert nodes.unreachable == ["n1.invalid:1"]  # and the bulk listener is skipped for a while


def test_blocks_the_bulk_listener_cannot_take_arrive_over_grpc(client):
    nodes = FakeNodes(data_addresses={"n1.invalid:1": "n1.invalid:2"})
    bulk = BulkPath(client.config, nodes, client.faults)
    bulk.bulk = FakeBulkClient(raises=[BulkUnavailable("refused")])
    blocks = [block(i, 100) for i in range(3)]
    nodes.stub("n1.invalid:1").held = {key(i): b.tobytes() for i, b in enumerate(blocks)}
    client.paths = [RecordingPath("shared", hands_on_all), bulk,
                    GrpcPath(client.config, nodes, client.faults)]
    outs = [np.zeros(100, np.uint8) for _ in blocks]
    assert client.get_into(run_of([key(i) for i in range(3)], blocks, [node("n1")]), outs) == [True] * 3
    assert all(np.array_equal(o, b) for o, b in zip(outs, blocks))
    assert moved(client, "get") == {"shared_memory": 0, "bulk": 0, "grpc": 3}
    assert error_counts(client.registry) == {}


class Master:
    """ClusterStatus of one node on this (fake) host; counts the asks."""

    def __init__(self) -> None:
        self.asked = 0

    def __call__(self) -> master_pb2.ClusterStatusResponse:
        self.asked += 1
        reply = master_pb2.ClusterStatusResponse()
        s = reply.nodes.add(node=common_pb2.NodeRef(node_id="n1", address="n1.invalid:1", host_id=HOST),
                            dram_max_block_bytes=1 << 20)
        s.tiers.add(tier=common_pb2.TIER_DRAM, capacity_bytes=1 << 30)
        return reply


def placed_by_view(client: PoolClient) -> Master:
    """Placement from a fake cluster view, whose node's (fake) arena answers lookups: no master, no FlushReports."""
    master = Master()
    client.cluster = ClusterView(master, refresh_s=3600)
    nodes = FakeNodes(host_id=HOST, arenas={"n1": FakeArena(file_id=None)})
    client.local = LocalIndex(client.cluster, nodes, None)  # type: ignore[arg-type]
    return master


def test_a_store_offers_each_path_what_the_faster_ones_handed_on(client):
    placed_by_view(client)
    shared = RecordingPath("shared", odd_handed_on)
    bulk = RecordingPath("bulk", lambda n, idxs: ([], idxs))
    last = RecordingPath("grpc", lambda n, idxs: ([idxs[0]], []))  # the rest refused (out of room)
    client.paths = [shared, bulk, last]
    blocks = [block(i, 64) for i in range(5)]
    assert client.store([key(i) for i in range(5)], blocks) == [True, True, True, False, True]
    assert [o for _, _, o in bulk.offers] == [[1, 3]] and [o for _, _, o in last.offers] == [[1, 3]]
    assert moved(client, "put") == {"shared_memory": 3, "bulk": 0, "grpc": 1}


def test_a_duplicate_key_in_one_store_is_written_once(client):
    placed_by_view(client)
    shared = RecordingPath("shared", moves_all)
    client.paths = [shared, shared, shared]
    b = block(1, 8)
    assert client.store([key(1), key(2), key(1)], [b, block(2, 8), b]) == [True, True, True]
    assert [o for _, _, o in shared.offers] == [[0, 1]]


def test_a_store_no_path_took_makes_the_view_ask_the_master_again(client):
    master = placed_by_view(client)
    client.paths = [RecordingPath("p", moves_all) for _ in PATHS]
    assert client.store([key(1)], [block(1, 8)]) == [True]
    assert client.store([key(2)], [block(2, 8)]) == [True]
    assert master.asked == 1  # a fresh view places without asking
    client.paths = [RecordingPath("p", hands_on_all) for _ in PATHS]
    assert client.store([key(3)], [block(3, 8)]) == [False]
    assert master.asked == 2  # the view that chose a node no path reached was dropped and asked again
