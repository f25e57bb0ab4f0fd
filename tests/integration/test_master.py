"""The Master Service over real gRPC: a MasterServer on 127.0.0.1:0 and real channels and stubs."""

from __future__ import annotations

import hashlib
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from models import check_index
from prometheus_client.parser import text_string_to_metric_families

from kvpool.config import MasterConfig
from kvpool.keys import BlockKey, pack_keys
from kvpool.master import MasterServer
from kvpool.master.index import BlockIndex
from kvpool.v1 import common_pb2, master_pb2, master_pb2_grpc
from kvpool.vocabulary import Tier

DRAM, SSD = common_pb2.TIER_DRAM, common_pb2.TIER_SSD
GIB = 1 << 30


# -- helpers ---------------------------------------------------------------------------


def make_keys(n: int, tag: str = "k") -> list[BlockKey]:
    return [BlockKey(hashlib.sha256(f"{tag}-{i}".encode()).digest()) for i in range(n)]


def checksum_of(key: bytes) -> int:
    return int.from_bytes(key[:8], "little")


def size_of(key: bytes) -> int:
    return 4096 + key[0]


def dram_usage(capacity: int = GIB, used: int = 0, blocks: int = 0) -> common_pb2.TierUsage:
    return common_pb2.TierUsage(tier=DRAM, capacity_bytes=capacity, used_bytes=used, blocks=blocks)


def register(
    stub: master_pb2_grpc.MasterStub, node_id: str, *, capacity: int = GIB, used: int = 0,
    dram_max_block_bytes: int = 1 << 20, max_block_bytes: int = 0,
) -> int:
    reply = stub.RegisterNode(
        master_pb2.RegisterNodeRequest(
            node=common_pb2.NodeRef(
                node_id=node_id, address=f"{node_id}.test:7610", host_id=f"host-{node_id}", arena=f"arena-{node_id}"
            ),
            tiers=[dram_usage(capacity, used), common_pb2.TierUsage(tier=SSD, capacity_bytes=4 * GIB)],
            dram_max_block_bytes=dram_max_block_bytes,
            max_block_bytes=max_block_bytes,
        )
    )
    assert reply.incarnation > 0
    return reply.incarnation


def report(
    stub: master_pb2_grpc.MasterStub,
    node_id: str,
    incarnation: int,
    tier: common_pb2.Tier,
    added: Sequence[BlockKey] = (),
    removed: Sequence[BlockKey] = (),
    full_sync: bool = False,
) -> bool:
    reply = stub.ReportBlocks(
        master_pb2.ReportBlocksRequest(
            node_id=node_id,
            incarnation=incarnation,
            tier=tier,
            full_sync=full_sync,
            added_keys=pack_keys(added),
            added_sizes=[size_of(k) for k in added],
            added_checksums=[checksum_of(k) for k in added],
            removed_keys=pack_keys(removed),
        )
    )
    return reply.known


def lookup(
    stub: master_pb2_grpc.MasterStub, keys: list[BlockKey], *, worker_id: str = "", hbm_prefix_blocks: int = 0,
    block_tokens: int = 0,
) -> master_pb2.LookupResponse:
    request = master_pb2.LookupRequest(keys=pack_keys(keys), worker_id=worker_id, hbm_prefix_blocks=hbm_prefix_blocks,
                                       block_tokens=block_tokens)
    return stub.Lookup(request)


def run_of(reply: master_pb2.LookupResponse) -> list[tuple[Tier, str]]:
    """The run as (tier, node id) pairs, checking the response's own consistency on the way."""
    n = len(reply.tiers)
    assert len(reply.node_indexes) == len(reply.sizes) == len(reply.checksums) == n
    assert reply.dram_blocks + reply.ssd_blocks == n
    assert reply.dram_blocks == sum(1 for t in reply.tiers if t == DRAM)
    return [(Tier(t), reply.nodes[i].node_id) for t, i in zip(reply.tiers, reply.node_indexes)]


def exists(stub: master_pb2_grpc.MasterStub, keys: list[BlockKey]) -> list[bool]:
    return [b == 1 for b in stub.Exists(master_pb2.ExistsRequest(keys=pack_keys(keys))).present]


def status(stub: master_pb2_grpc.MasterStub) -> master_pb2.ClusterStatusResponse:
    return stub.ClusterStatus(master_pb2.ClusterStatusRequest())


def node_ids(stub: master_pb2_grpc.MasterStub) -> set[str]:
    return {n.node.node_id for n in status(stub).nodes}


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics over HTTP as {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def poll(condition: Callable[[], bool], deadline_s: float, tick: Callable[[], None] = lambda: None) -> bool:
    """Until ``condition()`` or the deadline; ``tick`` runs between tries (e.g. heartbeats of other nodes)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if condition():
            return True
        tick()
        time.sleep(0.02)
    return condition()


# -- fixtures --------------------------------------------------------------------------


@pytest.fixture
def start_master() -> Iterator[Callable[..., MasterServer]]:
    """Start MasterServers on ephemeral ports; all stopped at teardown."""
    started: list[MasterServer] = []

    def start(**overrides: object) -> MasterServer:
        settings: dict[str, Any] = dict(host="127.0.0.1", port=0, metrics_port=-1)
        settings.update(overrides)
        server = MasterServer(MasterConfig.of(**settings)).start()
        started.append(server)
        return server

    yield start
    for server in started:
        check_index(server.index)
        server.stop(grace=0)
        assert server.wait(timeout=5)


@pytest.fixture
def connect() -> Iterator[Callable[[MasterServer], master_pb2_grpc.MasterStub]]:
    """Stubs over real channels; channels closed at teardown."""
    channels: list[grpc.Channel] = []

    def connect(server: MasterServer) -> master_pb2_grpc.MasterStub:
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        channels.append(channel)
        return master_pb2_grpc.MasterStub(channel)

    yield connect
    for channel in channels:
        channel.close()


@pytest.fixture
def master(start_master) -> MasterServer:
    return start_master()


@pytest.fixture
def stub(master, connect) -> master_pb2_grpc.MasterStub:
    return connect(master)


# -- index, membership, lookup ---------------------------------------------------------


def test_lookup_returns_leading_run_and_stops_at_first_miss(stub):
    a, b = register(stub, "a"), register(stub, "b")
    k = make_keys(6)
    assert report(stub, "a", a, DRAM, [k[0], k[1], k[5]])
    assert report(stub, "b", b, SSD, [k[2]])
    # k[3] is nowhere: k[4] and k[5] are not part of the run, even though k[5] is held.
    assert report(stub, "b", b, DRAM, [k[4]])

    reply = lookup(stub, k, block_tokens=128)

    assert run_of(reply) == [(Tier.DRAM, "a"), (Tier.DRAM, "a"), (Tier.SSD, "b")]
    assert list(reply.sizes) == [size_of(x) for x in k[:3]]
    assert list(reply.checksums) == [checksum_of(x) for x in k[:3]]
    assert (reply.dram_blocks, reply.ssd_blocks) == (2, 1)
    assert len(reply.nodes) == 2  # each node once
    node_a = reply.nodes[reply.node_indexes[0]]
    assert (node_a.address, node_a.host_id, node_a.arena) == ("a.test:7610", "host-a", "arena-a")

    assert run_of(lookup(stub, k[3:])) == []
    assert run_of(lookup(stub, [])) == []


def test_dram_is_preferred_over_ssd(stub):
    a, b = register(stub, "a"), register(stub, "b")
    k = make_keys(2)
    assert report(stub, "a", a, SSD, k)
    assert report(stub, "b", b, DRAM, [k[0]])
    assert report(stub, "a", a, DRAM, [k[1]])  # same node, both tiers

    assert run_of(lookup(stub, k)) == [(Tier.DRAM, "b"), (Tier.DRAM, "a")]

    assert report(stub, "b", b, DRAM, removed=[k[0]])
    assert report(stub, "a", a, DRAM, removed=[k[1]])
    assert run_of(lookup(stub, k)) == [(Tier.SSD, "a"), (Tier.SSD, "a")]

    assert report(stub, "a", a, SSD, removed=[k[0]])
    assert run_of(lookup(stub, k)) == []
    assert exists(stub, k) == [False, True]


def test_full_sync_replaces_one_node_tier_only(stub):
    a, b = register(stub, "a"), register(stub, "b")
    k = make_keys(6)
    assert report(stub, "a", a, DRAM, k[0:2])
    assert report(stub, "a", a, SSD, [k[3]])
    assert report(stub, "b", b, DRAM, [k[4]])

    assert report(stub, "a", a, DRAM, [k[1], k[2]], full_sync=True)

    assert exists(stub, k) == [False, True, True, True, True, False]
    assert status(stub).indexed_blocks == 4
    assert report(stub, "a", a, DRAM, [], full_sync=True)  # empty full sync: holds nothing there
    assert exists(stub, k) == [False, False, False, True, True, False]


def test_exists_is_per_key_not_a_prefix(stub):
    a = register(stub, "a")
    k = make_keys(5)
    assert exists(stub, k) == [False] * 5
    assert report(stub, "a", a, SSD, [k[1], k[4]])
    assert exists(stub, k) == [False, True, False, False, True]
    assert exists(stub, []) == []


def test_late_report_for_a_dropped_slot_is_refused():
    index = BlockIndex()
    index.open_node(7)
    k = make_keys(2)
    assert index.add(7, Tier.DRAM, k, [1, 1], [0, 0])
    assert index.drop_node(7) == 2
    assert not index.add(7, Tier.DRAM, k, [1, 1], [0, 0])  # e.g. a report racing the node's expiry
    assert index.exists(k) == [False, False] and len(index) == 0


def test_index_stays_consistent_under_concurrent_reports_and_drops():
    index = BlockIndex()
    keys = make_keys(200, "race")
    for slot in range(8):
        index.open_node(slot)
    errors: list[BaseException] = []

    def churn(slot: int) -> None:
        try:
            rng = random.Random(slot)
            for step in range(300):
                tier = rng.choice([Tier.DRAM, Tier.SSD])
                batch = rng.sample(keys, 20)
                if step % 7 == 0:
                    index.replace_node_tier(slot, tier, batch, [1] * 20, [2] * 20)
                elif step % 3 == 0:
                    index.remove(slot, tier, batch)
                else:
                    index.add(slot, tier, batch, [1] * 20, [2] * 20)
                index.leading_run(batch)
            if slot % 2:
                index.drop_node(slot)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(slot,)) for slot in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    check_index(index)
    assert all(hit.node % 2 == 0 for hit in index.leading_run([k for k in keys if index.exists([k])[0]]))


# -- placement -------------------------------------------------------------------------


def test_place_blocks_spreads_over_nodes_and_marks_present(stub):
    register(stub, "a")
    b = register(stub, "b")
    k = make_keys(1000, "place")
    assert report(stub, "b", b, DRAM, k[:10])
    request = master_pb2.PlaceBlocksRequest(keys=pack_keys(k), sizes=[65536] * len(k))

    reply = stub.PlaceBlocks(request)

    assert len(reply.node_indexes) == len(k) and len(reply.present) == len(k)
    chosen = [reply.nodes[i].node_id for i in reply.node_indexes]
    for node in ("a", "b"):
        assert chosen.count(node) > 300, f"node {node} got {chosen.count(node)} of 1000"
    assert [p == 1 for p in reply.present] == [True] * 10 + [False] * 990
    assert stub.PlaceBlocks(request) == reply  # deterministic


def test_placement_favours_free_nodes_and_respects_what_dram_takes(stub):
    register(stub, "full", used=GIB)
    register(stub, "empty")
    register(stub, "small", dram_max_block_bytes=1024)
    k = make_keys(1000, "weights")

    reply = stub.PlaceBlocks(master_pb2.PlaceBlocksRequest(keys=pack_keys(k), sizes=[4096] * len(k)))

    chosen = [reply.nodes[i].node_id for i in reply.node_indexes]
    assert chosen.count("small") == 0  # its slots are too small for 4 KiB blocks
    # weights 0.1 vs 1.1: the full node keeps a share (~1/12), the empty one takes most.
    assert 30 < chosen.count("full") < 200
    # a block no node takes is flagged too_large (and counted); the rest of the batch is placed
    reply = stub.PlaceBlocks(master_pb2.PlaceBlocksRequest(keys=pack_keys(k[:3]), sizes=[4096, 4 << 20, 4096]))
    assert list(reply.too_large) == [0, 1, 0]
    assert [reply.nodes[reply.node_indexes[i]].node_id for i in (0, 2)] == chosen[0:3:2]
    status = stub.ClusterStatus(master_pb2.ClusterStatusRequest())
    assert (status.blocks_too_large, status.largest_refused_bytes, status.largest_block_bytes) == (1, 4 << 20, 1 << 20)


def test_placement_sends_blocks_larger_than_a_slot_to_a_node_with_ssd_and_prefers_dram(stub):
    register(stub, "dram-only", dram_max_block_bytes=1 << 20)
    register(stub, "with-ssd", dram_max_block_bytes=1 << 20, max_block_bytes=64 << 20)
    k = make_keys(200, "ssd-only")

    big = stub.PlaceBlocks(master_pb2.PlaceBlocksRequest(keys=pack_keys(k), sizes=[8 << 20] * len(k)))
    small = stub.PlaceBlocks(master_pb2.PlaceBlocksRequest(keys=pack_keys(k), sizes=[4096] * len(k)))

    assert not any(big.too_large) and {big.nodes[i].node_id for i in big.node_indexes} == {"with-ssd"}
    assert {small.nodes[i].node_id for i in small.node_indexes} == {"dram-only", "with-ssd"}  # both take those
    mixed = stub.PlaceBlocks(master_pb2.PlaceBlocksRequest(keys=pack_keys(k[:2]), sizes=[4096, 128 << 20]))
    assert list(mixed.too_large) == [0, 1]


def test_place_blocks_without_nodes_is_unavailable(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.PlaceBlocks(master_pb2.PlaceBlocksRequest(keys=pack_keys(make_keys(1)), sizes=[4096]))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no pool nodes" in err.value.details()


# -- membership ------------------------------------------------------------------------


def test_silent_node_is_dropped_with_its_keys(start_master, connect):
    server = start_master(node_timeout_s=0.5)
    stub = connect(server)
    a, b = register(stub, "a"), register(stub, "b")
    ka, kb = make_keys(3, "on-a"), make_keys(3, "on-b")
    last_a = time.monotonic()  # no later than the master's last word from "a"
    assert report(stub, "a", a, DRAM, ka)
    assert report(stub, "b", b, DRAM, kb)

    def heartbeat_b() -> None:
        assert stub.Heartbeat(master_pb2.HeartbeatRequest(node_id="b", incarnation=b)).known

    assert poll(lambda: "a" not in node_ids(stub), deadline_s=5.0, tick=heartbeat_b)
    silent_for = time.monotonic() - last_a
    assert silent_for >= 0.5, f"dropped after {silent_for:.2f}s, before node_timeout_s"

    assert node_ids(stub) == {"b"}
    assert run_of(lookup(stub, ka)) == []
    assert exists(stub, ka) == [False] * 3
    assert run_of(lookup(stub, kb)) == [(Tier.DRAM, "b")] * 3
    assert not stub.Heartbeat(master_pb2.HeartbeatRequest(node_id="a", incarnation=a)).known
    assert not report(stub, "a", a, DRAM, ka)
    assert exists(stub, ka) == [False] * 3


def test_a_masters_own_stall_is_not_its_nodes_silence():
    """Time the master did not run (Membership.stalled, told by its sweeper) is not counted against a node; a dead
    node is still dropped once it has been silent node_timeout_s of the master's own running time."""
    from kvpool.master.index import HbmIndex
    from kvpool.master.membership import Membership
    from kvpool.vocabulary import NodeRef

    clock = [1000.0]
    index = BlockIndex()
    members = Membership(index, HbmIndex(), node_timeout_s=3.0, worker_timeout_s=60.0, clock=lambda: clock[0])
    members.register(NodeRef("a", "127.0.0.1:1"), [], 1 << 20)
    clock[0] += 5.0  # the master stopped for 4.5 s of these 5: the node was silent 0.5 s while it ran
    members.stalled(4.5)
    assert members.expire() == []
    clock[0] += 2.4
    assert members.expire() == []  # 2.9 s
    clock[0] += 0.2
    assert members.expire() == ["a"]  # 3.1 s
    with pytest.raises(ValueError):
        members.stalled(float("nan"))


def test_heartbeats_keep_a_node_alive(start_master, connect):
    server = start_master(node_timeout_s=0.3)
    stub = connect(server)
    a = register(stub, "a")
    end = time.monotonic() + 1.2  # four timeouts
    while time.monotonic() < end:
        assert stub.Heartbeat(master_pb2.HeartbeatRequest(node_id="a", incarnation=a, tiers=[dram_usage(used=5)])).known
        time.sleep(0.05)
    assert node_ids(stub) == {"a"}


def test_reregister_gets_new_incarnation_and_stale_reports_are_refused(stub):
    k = make_keys(3)
    first = register(stub, "a")
    assert report(stub, "a", first, DRAM, k[:2])

    second = register(stub, "a")

    assert second > first
    assert exists(stub, k) == [False, False, False]  # the old incarnation's entries went
    assert not report(stub, "a", first, DRAM, [k[2]])
    assert exists(stub, k) == [False, False, False]
    assert not stub.Heartbeat(master_pb2.HeartbeatRequest(node_id="a", incarnation=first)).known
    assert stub.Heartbeat(master_pb2.HeartbeatRequest(node_id="a", incarnation=second)).known
    assert report(stub, "a", second, DRAM, [k[2]])
    assert exists(stub, k) == [False, False, True]

    stub.UnregisterNode(master_pb2.UnregisterNodeRequest(node_id="a", incarnation=first))  # stale: no effect
    assert node_ids(stub) == {"a"} and exists(stub, [k[2]]) == [True]
    stub.UnregisterNode(master_pb2.UnregisterNodeRequest(node_id="a", incarnation=second))
    assert node_ids(stub) == set() and exists(stub, [k[2]]) == [False]
    assert status(stub).indexed_blocks == 0


def test_restarted_master_does_not_know_old_nodes(start_master, connect):
    old = start_master()
    old_stub = connect(old)
    incarnation = register(old_stub, "a")
    assert report(old_stub, "a", incarnation, DRAM, make_keys(2))
    old.stop()

    fresh = start_master()
    stub = connect(fresh)

    assert not stub.Heartbeat(master_pb2.HeartbeatRequest(node_id="a", incarnation=incarnation)).known
    assert not report(stub, "a", incarnation, DRAM, make_keys(2))
    assert exists(stub, make_keys(2)) == [False, False]
    assert register(stub, "a") > incarnation  # unique across restarts


def test_silent_worker_loses_its_hbm_entries(start_master, connect):
    server = start_master(worker_timeout_s=0.4)
    stub = connect(server)
    stub.ReportHbm(master_pb2.ReportHbmRequest(worker_id="w1", added_keys=pack_keys(make_keys(5)), full_sync=True))
    stub.ReportHbm(master_pb2.ReportHbmRequest(worker_id="w1", removed_keys=pack_keys(make_keys(1))))
    stub.ReportHbm(master_pb2.ReportHbmRequest(worker_id="w2", added_keys=pack_keys(make_keys(2))))
    before = status(stub)
    assert (before.workers, before.hbm_blocks) == (2, 4 + 2)

    assert poll(lambda: (status(stub).workers, status(stub).hbm_blocks) == (0, 0), deadline_s=5.0)


# -- validation ------------------------------------------------------------------------

RAGGED = pack_keys(make_keys(2))[:-1]


def _bad_requests(stub, incarnation):
    """(call, expected message fragment) for each kind of bad input."""
    k = make_keys(3)
    too_many = pack_keys(make_keys(9))  # max_keys_per_call = 8 below
    return [
        (lambda: stub.Lookup(master_pb2.LookupRequest(keys=RAGGED)), "not a multiple of 32"),
        (lambda: stub.Exists(master_pb2.ExistsRequest(keys=RAGGED)), "not a multiple of 32"),
        (
            lambda: stub.ReportBlocks(
                master_pb2.ReportBlocksRequest(
                    node_id="a", incarnation=incarnation, tier=DRAM, added_keys=RAGGED, added_sizes=[1],
                    added_checksums=[1],
                )
            ),
            "not a multiple of 32",
        ),
        (
            lambda: stub.ReportBlocks(
                master_pb2.ReportBlocksRequest(
                    node_id="a", incarnation=incarnation, tier=DRAM, added_keys=pack_keys(k), added_sizes=[1, 2],
                    added_checksums=[1, 2, 3],
                )
            ),
            "added_sizes: 2 values for 3 keys",
        ),
        (
            lambda: stub.ReportBlocks(
                master_pb2.ReportBlocksRequest(
                    node_id="a", incarnation=incarnation, tier=DRAM, added_keys=pack_keys(k), added_sizes=[1, 2, 3],
                    added_checksums=[],
                )
            ),
            "added_checksums: 0 values for 3 keys",
        ),
        (
            lambda: stub.ReportBlocks(
                master_pb2.ReportBlocksRequest(node_id="a", incarnation=incarnation, tier=common_pb2.TIER_HBM)
            ),
            "tier 0 is not one of TIER_DRAM, TIER_SSD",
        ),
        (
            lambda: stub.PlaceBlocks(master_pb2.PlaceBlocksRequest(keys=pack_keys(k), sizes=[4096])),
            "sizes: 1 values for 3 keys",
        ),
        (lambda: stub.Lookup(master_pb2.LookupRequest(keys=too_many)), "too many keys"),
        (lambda: stub.Exists(master_pb2.ExistsRequest(keys=too_many)), "too many keys"),
        (
            lambda: stub.ReportBlocks(
                master_pb2.ReportBlocksRequest(node_id="a", incarnation=incarnation, tier=DRAM, removed_keys=too_many)
            ),
            "too many keys",
        ),
        (
            lambda: stub.RegisterNode(
                master_pb2.RegisterNodeRequest(node=common_pb2.NodeRef(node_id="", address="x:1"))
            ),
            "node_id must not be empty",
        ),
        (
            lambda: stub.RegisterNode(
                master_pb2.RegisterNodeRequest(
                    node=common_pb2.NodeRef(node_id="c", address="x:1"), tiers=[dram_usage(), dram_usage()]
                )
            ),
            "reported twice",
        ),
        (
            lambda: stub.ReportHbm(master_pb2.ReportHbmRequest(worker_id="", added_keys=pack_keys(k))),
            "a worker id must have 1 to 256 characters",
        ),
    ]


def _comparable(s: master_pb2.ClusterStatusResponse) -> master_pb2.ClusterStatusResponse:
    s = master_pb2.ClusterStatusResponse.FromString(s.SerializeToString())
    for node in s.nodes:
        node.seconds_since_heartbeat = 0
    return s


def test_bad_input_is_invalid_argument_and_changes_nothing(start_master, connect):
    server = start_master(max_keys_per_call=8)
    stub = connect(server)
    a = register(stub, "a")
    assert report(stub, "a", a, DRAM, make_keys(2))
    before = _comparable(status(stub))
    assert before.indexed_blocks == 2 and len(before.nodes) == 1

    for i, (call, message) in enumerate(_bad_requests(stub, a)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, f"case {i}: {err.value}"
        assert message in err.value.details(), f"case {i}: {err.value.details()!r}"
        assert _comparable(status(stub)) == before, f"case {i} changed the master's state"
    assert exists(stub, make_keys(3)) == [True, True, False]


# -- service plumbing, metrics, status -------------------------------------------------


def test_health_service_reports_serving(master):
    with grpc.insecure_channel(f"127.0.0.1:{master.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvpool.v1.Master"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(service="kvpool.v1.Nope"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_metrics_endpoint_counts_lookups_and_agrees_with_cluster_status(master, stub):
    a = register(stub, "a")
    k = make_keys(4)
    assert report(stub, "a", a, DRAM, k[:2])
    assert report(stub, "a", a, SSD, [k[2]])
    assert stub.Heartbeat(
        master_pb2.HeartbeatRequest(node_id="a", incarnation=a, tiers=[dram_usage(capacity=1000, used=250, blocks=2)])
    ).known
    no_tenant = ("tenant", "")  # auth off: the lookup counters' tenant label is empty
    lookups_total = ("kvpool_lookups_total", (no_tenant,))
    dram_hits = ("kvpool_hit_blocks_total", (no_tenant, ("tier", "dram")))
    before = scrape(master.metrics_port)

    lookup(stub, k, hbm_prefix_blocks=3, block_tokens=16)  # run: dram, dram, ssd
    lookup(stub, k[1:], block_tokens=16)  # run: dram, ssd
    lookup(stub, k[3:], block_tokens=16)  # run: none
    after = scrape(master.metrics_port)

    assert after[lookups_total] - before[lookups_total] == 3
    assert after[dram_hits] - before[dram_hits] == 3
    ssd_hits = ("kvpool_hit_blocks_total", (no_tenant, ("tier", "ssd")))
    assert after[ssd_hits] - before[ssd_hits] == 2
    assert after[("kvpool_hit_blocks_total", (no_tenant, ("tier", "hbm")))] == 3
    assert after[("kvpool_lookup_blocks_total", (no_tenant,))] == (3 + 4) + 3 + 1
    assert after[("kvpool_lookup_seconds_count", ())] == 3
    assert after[("kvpool_nodes", ())] == 1
    assert after[("kvpool_index_blocks", ())] == 3
    assert after[("kvpool_cluster_tier_used_bytes", (("node", "a"), ("tier", "dram")))] == 250
    assert after[("kvpool_cluster_tier_capacity_bytes", (("node", "a"), ("tier", "dram")))] == 1000
    assert not any(name.startswith("kvpool_tier_") for name, _ in after)  # nodes export their own, under these names
    cluster = {name for name, _ in after if name.startswith("kvpool_cluster_tier_")}
    assert cluster == {f"kvpool_cluster_tier_{g}" for g in ("capacity_bytes", "used_bytes", "blocks")}  # no movement

    s = status(stub)
    assert s.lookups == after[lookups_total] == 3
    assert s.requested_blocks == after[("kvpool_lookup_blocks_total", (no_tenant,))]
    assert (s.hit_blocks_hbm, s.hit_blocks_dram, s.hit_blocks_ssd) == (3, 3, 2)


def test_cluster_status_describes_the_cluster(stub):
    a, b = register(stub, "a"), register(stub, "b", capacity=2 * GIB)
    assert report(stub, "a", a, DRAM, make_keys(3))
    assert report(stub, "b", b, SSD, make_keys(5))  # 3 of them also on a
    heartbeat = master_pb2.HeartbeatRequest(node_id="b", incarnation=b, tiers=[dram_usage(2 * GIB, 7, 1)])
    assert stub.Heartbeat(heartbeat).known
    stub.ReportHbm(master_pb2.ReportHbmRequest(worker_id="w", added_keys=pack_keys(make_keys(2, "hbm"))))
    lookup(stub, make_keys(1), worker_id="w2", hbm_prefix_blocks=2, block_tokens=8)

    s = status(stub)

    by_id = {n.node.node_id: n for n in s.nodes}
    assert set(by_id) == {"a", "b"}
    assert by_id["a"].incarnation == a and by_id["b"].incarnation == b
    assert by_id["a"].node.address == "a.test:7610"
    assert [(t.tier, t.capacity_bytes) for t in by_id["a"].tiers] == [(DRAM, GIB), (SSD, 4 * GIB)]
    assert [(t.tier, t.capacity_bytes, t.used_bytes, t.blocks) for t in by_id["b"].tiers] == [(DRAM, 2 * GIB, 7, 1)]
    assert all(0 <= n.seconds_since_heartbeat < 5 for n in s.nodes)
    assert s.indexed_blocks == 5
    assert (s.workers, s.hbm_blocks) == (2, 2)
    assert (s.lookups, s.requested_blocks, s.hit_blocks_hbm, s.hit_blocks_dram, s.hit_blocks_ssd) == (1, 3, 2, 1, 0)


def test_run_master_logs_its_address_and_stops_on_sigterm(tmp_path):
    script = (
        "import logging; logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "from kvpool.config import MasterConfig\n"
        "from kvpool.master import run_master\n"
        "run_master(MasterConfig.of(host='127.0.0.1', port=0, metrics_port=-1))\n"
        "print('clean exit', flush=True)\n"
    )
    log_path = tmp_path / "master.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        pattern = re.compile(r"kvpool master listening on 127\.0\.0\.1:(\d+) \(fast calls :(\d+), metrics :(\d+)\)")
        assert poll(lambda: pattern.search(log_path.read_text()) is not None, deadline_s=30.0), log_path.read_text()
        port = int(pattern.search(log_path.read_text()).group(1))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            status = master_pb2_grpc.MasterStub(channel).ClusterStatus(master_pb2.ClusterStatusRequest(), timeout=5)
            assert status.lookups == 0
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "clean exit" in log_path.read_text()


def test_a_master_without_etcd_always_leads():
    with MasterServer(MasterConfig.of(port=0, metrics_port=0)) as master:
        assert master.registry.get_sample_value("kvpool_master_leader") == 1
        assert master.election is None
