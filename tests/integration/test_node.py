"""The pool node daemon over real gRPC on loopback: data service, arena access, tiering, metrics, master link."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import free_port, wait_until

from kvpool.checksum import block_checksum
from kvpool.config import NodeConfig
from kvpool.keys import BlockKey, opaque_key, pack_keys
from kvpool.node.daemon import PoolNode
from kvpool.node.master_link import MasterLink
from kvpool.rpc import channel_options
from kvpool.tiers.arena import SharedArena, SlotRef, shm_path
from kvpool.v1 import common_pb2, master_pb2, master_pb2_grpc, node_pb2, node_pb2_grpc
from kvpool.vocabulary import NO_TIER, BlockMeta, Tier

SLOT = 64 << 10
DRAM_SLOTS = 8
HAVE_MASTER = importlib.util.find_spec("kvpool.master.server") is not None


def key(i: int) -> BlockKey:
    return opaque_key(f"node-test-{i}")


def block(i: int, size: int = SLOT) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def config(tmp_path: Path, arena: str, **over) -> NodeConfig:
    values: dict[str, Any] = dict(
        master=f"127.0.0.1:{free_port()}",  # nothing listens there unless a test says so
        host="127.0.0.1", port=0, metrics_port=-1, arena=arena, node_id="",
        dram_bytes=DRAM_SLOTS * SLOT, max_block_bytes=SLOT, high_watermark=1.0, low_watermark=1.0,
        ssd_dir=str(tmp_path / "ssd"), ssd_bytes=4 << 20, max_message_bytes=16 << 20,
    )
    values.update(over)
    return NodeConfig.of(**values)


class Client:
    """Real stubs on a channel to one node."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address, options=channel_options(64 << 20))
        self.node = node_pb2_grpc.NodeStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def put(self, ids: list[int], blocks: list[bytes], checksums: list[int] | None = None) -> list[int]:
        reply = self.node.Put(node_pb2.PutRequest(
            keys=pack_keys([key(i) for i in ids]), sizes=[len(b) for b in blocks], data=b"".join(blocks),
            checksums=[block_checksum(b) for b in blocks] if checksums is None else checksums,
        ), timeout=10)
        return list(reply.stored)

    def tiers(self, ids: list[int]) -> list[int]:
        request = node_pb2.NodeExistsRequest(keys=pack_keys([key(i) for i in ids]))
        return list(self.node.Exists(request, timeout=10).tiers)

    def get(self, ids: list[int]) -> node_pb2.GetResponse:
        return self.node.Get(node_pb2.GetRequest(keys=pack_keys([key(i) for i in ids])), timeout=10)

    def close(self) -> None:
        self.channel.close()


@pytest.fixture
def node(tmp_path, arena_name):
    n = PoolNode(config(tmp_path, arena_name)).start()
    yield n
    n.stop()


@pytest.fixture
def client(node):
    c = Client(node.address)
    yield c
    c.close()


def scrape(node: PoolNode) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text; 0 if absent."""
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return 0.0


# -- the data service ---------------------------------------------------------------------


def test_put_then_get_is_byte_exact_for_several_sizes_in_one_batch(client):
    sizes = [1, 100, 4096, 12345, SLOT - 1, SLOT]
    blocks = [block(i, n) for i, n in enumerate(sizes)]
    assert client.put(list(range(len(sizes))), blocks) == [1] * len(sizes)
    order = [3, 99, 0, 5, 1, 4, 2]  # shuffled, with a key nobody stored
    reply = client.get(order)
    assert list(reply.tiers) == [NO_TIER if i == 99 else Tier.DRAM for i in order]
    assert list(reply.sizes) == [0 if i == 99 else sizes[i] for i in order]
    assert list(reply.checksums) == [0 if i == 99 else block_checksum(blocks[i]) for i in order]
    assert reply.data == b"".join(blocks[i] for i in order if i != 99)


def test_exists_and_remove(client):
    client.put([1, 2], [block(1), block(2)])
    assert client.tiers([1, 2, 3]) == [Tier.DRAM, Tier.DRAM, NO_TIER]
    reply = client.node.Remove(node_pb2.RemoveRequest(keys=pack_keys([key(1), key(3), key(1)])), timeout=10)
    assert reply.removed == 1
    assert client.tiers([1, 2]) == [NO_TIER, Tier.DRAM]
    assert list(client.get([1]).tiers) == [NO_TIER]


def test_locate_then_read_the_arena_directly(node, client):
    blocks = [block(1, 5000), block(2)]
    client.put([1, 2], blocks)
    reply = client.node.Locate(node_pb2.LocateRequest(keys=pack_keys([key(1), key(2), key(3)])), timeout=10)
    assert reply.arena == node.node_ref.arena
    assert list(reply.sizes) == [5000, SLOT, 0]
    assert list(reply.checksums) == [block_checksum(b) for b in blocks] + [0]
    assert reply.slot_gens[2] == 0 and reply.slot_gens[0] % 2 == 0 and reply.slot_gens[0] > 0
    arena = SharedArena.attach(reply.arena)
    try:
        for i, b in enumerate(blocks):
            out = bytearray(len(b))
            ref = located(arena, reply, i)
            assert arena.read_into(ref, key(i + 1), out) and bytes(out) == b
        client.node.Remove(node_pb2.RemoveRequest(keys=pack_keys([key(1)])), timeout=10)
        stale = located(arena, reply, 0)
        assert not arena.read_into(stale, key(1), bytearray(5000))  # released: a miss, never other bytes
    finally:
        arena.close()


def located(arena: SharedArena, reply: node_pb2.LocateResponse, i: int) -> SlotRef:
    """The ref a same-host reader makes of a Locate reply's i-th block (its extent's offset from the row)."""
    slot = reply.slots[i]
    return SlotRef(slot, reply.slot_gens[i], int(arena.table["offset"][slot]), reply.sizes[i], reply.checksums[i])


def fill_and_demote(client: Client, extra: int = 2) -> None:
    """Fill DRAM, then put ``extra`` more: keys 0..extra-1 are demoted to SSD (LRU first)."""
    n = DRAM_SLOTS + extra
    for i in range(n):
        assert client.put([i], [block(i)]) == [1]
    assert client.tiers(list(range(n))) == [Tier.SSD] * extra + [Tier.DRAM] * DRAM_SLOTS


def test_locate_with_promote_brings_an_ssd_block_into_dram(client):
    fill_and_demote(client)
    plain = client.node.Locate(node_pb2.LocateRequest(keys=pack_keys([key(0)])), timeout=10)
    assert list(plain.slot_gens) == [0]  # on SSD only: a miss for a shared-memory reader
    assert client.tiers([0]) == [Tier.SSD]  # and Locate without promote moved nothing
    reply = client.node.Locate(node_pb2.LocateRequest(keys=pack_keys([key(0)]), promote=True), timeout=10)
    assert reply.slot_gens[0] != 0 and list(reply.sizes) == [SLOT]
    assert client.tiers([0]) == [Tier.DRAM]
    arena = SharedArena.attach(reply.arena)
    try:
        out = bytearray(SLOT)
        assert arena.read_into(located(arena, reply, 0), key(0), out)
        assert bytes(out) == block(0)
    finally:
        arena.close()


def test_dram_full_demotes_to_ssd_and_a_get_hit_there_is_promoted_back(node, client):
    before = scrape(node)
    assert sample(before, "kvpool_demotions_total") == 0
    assert sample(before, "kvpool_tier_used_bytes", tier="ssd") == 0
    fill_and_demote(client)
    assert node.store.flush_demotions(10)  # demotion runs in the background
    after = scrape(node)
    assert sample(after, "kvpool_demotions_total") == 2
    assert sample(after, "kvpool_tier_used_bytes", tier="ssd") > 0
    assert sample(after, "kvpool_tier_used_bytes", tier="dram", node=node.node_ref.node_id) == DRAM_SLOTS * SLOT
    reply = client.get([0, 5])
    assert list(reply.tiers) == [Tier.SSD, Tier.DRAM]
    assert reply.data == block(0) + block(5)
    assert client.tiers([0]) == [Tier.DRAM]  # promoted, pushing DRAM's LRU block down
    assert node.store.flush_demotions(10)
    text = scrape(node)
    assert sample(text, "kvpool_promotions_total") == 1
    assert sample(text, "kvpool_demotions_total") == 3
    assert sample(text, "kvpool_get_seconds_count") == 1


def test_a_block_larger_than_a_slot_is_stored_on_ssd(client):
    big = block(7, 3 * SLOT + 5)
    assert client.put([7, 8], [big, block(8)]) == [1, 1]
    assert client.tiers([7, 8]) == [Tier.SSD, Tier.DRAM]
    reply = client.get([8, 7])
    assert list(reply.tiers) == [Tier.DRAM, Tier.SSD] and reply.data == block(8) + big


def test_a_checksum_mismatch_refuses_that_block_only(node, client):
    blocks = [block(1), block(2)]
    sums = [block_checksum(blocks[0]), block_checksum(blocks[1]) ^ 1]
    assert client.put([1, 2], blocks, checksums=sums) == [1, 0]
    assert client.tiers([1, 2]) == [Tier.DRAM, NO_TIER]
    assert sample(scrape(node), "kvpool_errors_total", kind="checksum") == 1


BAD_PUTS = {
    "ragged keys": lambda: node_pb2.PutRequest(keys=pack_keys([key(1)]) + b"x", sizes=[SLOT], data=block(1)),
    "sizes do not sum to data": lambda: node_pb2.PutRequest(
        keys=pack_keys([key(1), key(2)]), sizes=[SLOT, SLOT], data=block(1) + block(2)[:-1]),
    "fewer sizes than keys": lambda: node_pb2.PutRequest(
        keys=pack_keys([key(1), key(2)]), sizes=[2 * SLOT], data=block(1) + block(2)),
    "checksums not one per key": lambda: node_pb2.PutRequest(
        keys=pack_keys([key(1), key(2)]), sizes=[SLOT, SLOT], data=block(1) + block(2),
        checksums=[block_checksum(block(1))]),
    "an empty block": lambda: node_pb2.PutRequest(keys=pack_keys([key(1), key(2)]), sizes=[SLOT, 0], data=block(1)),
    "a block that fits nowhere": lambda: node_pb2.PutRequest(
        keys=pack_keys([key(1), key(2)]), sizes=[SLOT, 5 << 20], data=block(1) + bytes(5 << 20)),  # SSD: 4 MiB
}


@pytest.mark.parametrize("case", list(BAD_PUTS))
def test_bad_put_is_invalid_argument_and_stores_nothing(node, client, case):
    client.put([9], [block(9)])
    usage = [(t.tier, t.blocks, t.used_bytes) for t in client.node.Info(node_pb2.InfoRequest(), timeout=10).tiers]
    with pytest.raises(grpc.RpcError) as err:
        client.node.Put(BAD_PUTS[case](), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details()
    assert client.tiers([1, 2, 9]) == [NO_TIER, NO_TIER, Tier.DRAM]
    after = [(t.tier, t.blocks, t.used_bytes) for t in client.node.Info(node_pb2.InfoRequest(), timeout=10).tiers]
    assert after == usage
    assert sample(scrape(node), "kvpool_errors_total", kind="invalid_argument") == 1


def test_bad_keys_on_reads_are_invalid_argument(client):
    for call, request in [(client.node.Get, node_pb2.GetRequest(keys=b"short")),
                          (client.node.Exists, node_pb2.NodeExistsRequest(keys=b"x" * 33)),
                          (client.node.Locate, node_pb2.LocateRequest(keys=b"x" * 31, promote=True)),
                          (client.node.Remove, node_pb2.RemoveRequest(keys=b"x" * 65))]:
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_get_whose_reply_would_exceed_the_message_limit_is_refused(tmp_path, arena_name):
    with PoolNode(config(tmp_path, arena_name, max_message_bytes=3 * SLOT)) as n:
        c = Client(n.address)
        try:
            for i in range(3):
                assert c.put([i], [block(i)]) == [1]
            with pytest.raises(grpc.RpcError) as err:
                c.get([0, 1, 2])
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert c.get([0, 1]).data == block(0) + block(1)
        finally:
            c.close()


def test_health_info_and_an_unreachable_master_do_not_stop_the_node(node, client):
    for service in ("", "kvpool.v1.Node"):
        reply = client.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    info = client.node.Info(node_pb2.InfoRequest(), timeout=10)
    assert info.node.address == f"127.0.0.1:{node.port}" and node.port != 0
    assert info.node.node_id.endswith(f":{node.port}")
    assert info.node.arena == node.node_ref.arena and info.node.host_id
    assert info.dram_max_block_bytes == SLOT
    assert [t.tier for t in info.tiers] == [Tier.DRAM, Tier.SSD]
    assert info.tiers[0].capacity_bytes == DRAM_SLOTS * SLOT
    assert not node.link.registered  # no master: puts still work, the link keeps retrying
    assert client.put([1], [block(1)]) == [1]


def test_stop_unlinks_the_arena_and_a_stale_one_is_replaced(tmp_path, arena_name, caplog):
    with open(shm_path(arena_name), "wb") as f:  # what a node killed with SIGKILL leaves behind
        f.write(b"junk" * 1024)
    with caplog.at_level(logging.WARNING, logger="kvpool.node.daemon"):
        n = PoolNode(config(tmp_path, arena_name)).start()
    try:
        assert any("already exists" in r.getMessage() for r in caplog.records)
        c = Client(n.address)
        assert c.put([1], [block(1)]) == [1]
        c.close()
    finally:
        n.stop()
    assert not os.path.exists(shm_path(arena_name))
    # DRAM does not survive a node restart (write-back: the block never reached SSD)
    with PoolNode(config(tmp_path, arena_name, dram_bytes=SLOT)) as again:
        c = Client(again.address)
        try:
            assert c.tiers([1]) == [NO_TIER]
        finally:
            c.close()


def test_ssd_keeps_demoted_blocks_across_a_node_restart(tmp_path, arena_name):
    with PoolNode(config(tmp_path, arena_name)) as n:
        c = Client(n.address)
        fill_and_demote(c)
        c.close()
    with PoolNode(config(tmp_path, arena_name)) as n:
        c = Client(n.address)
        try:
            reply = c.get([0, 1, 5])
            assert list(reply.tiers) == [Tier.SSD, Tier.SSD, NO_TIER] and reply.data == block(0) + block(1)
        finally:
            c.close()


# -- with a real master -----------------------------------------------------------------------

needs_master = pytest.mark.skipif(not HAVE_MASTER, reason="kvpool.master.server is not available")


def start_master(port: int = 0):
    from kvpool.config import MasterConfig
    from kvpool.master.server import MasterServer

    return MasterServer(MasterConfig.of(port=port, metrics_port=0)).start()


def lookup(master_address: str, ids: list[int]) -> master_pb2.LookupResponse:
    with grpc.insecure_channel(master_address) as channel:
        return master_pb2_grpc.MasterStub(channel).Lookup(
            master_pb2.LookupRequest(keys=pack_keys([key(i) for i in ids])), timeout=10)


@needs_master
def test_a_put_is_in_the_masters_index_once_flush_reports_answers(tmp_path, arena_name):
    master = start_master()
    try:
        with PoolNode(config(tmp_path, arena_name, master=master.address)) as n:
            wait_until(lambda: n.link.registered)
            c = Client(n.address)
            try:
                blocks = [block(1), block(2, 777)]
                assert c.put([1, 2], blocks) == [1, 1]  # stored; the node reports it in the background
                assert c.node.FlushReports(node_pb2.FlushReportsRequest(), timeout=10).indexed  # the barrier
                reply = lookup(master.address, [1, 2, 3])
                assert list(reply.tiers) == [Tier.DRAM, Tier.DRAM]
                assert list(reply.sizes) == [SLOT, 777]
                assert list(reply.checksums) == [block_checksum(b) for b in blocks]
                assert reply.nodes[reply.node_indexes[0]].address == n.address
                assert reply.nodes[reply.node_indexes[0]].arena == n.node_ref.arena
                c.node.Remove(node_pb2.RemoveRequest(keys=pack_keys([key(1)])), timeout=10)
                assert len(lookup(master.address, [1, 2]).tiers) == 0  # the leading run is gone
            finally:
                c.close()
        assert len(lookup(master.address, [2]).tiers) == 0  # the node unregistered on stop
    finally:
        master.stop()


@needs_master
def test_demotions_reach_the_master_and_a_restarted_master_is_refilled(tmp_path, arena_name):
    master = start_master()
    port = master.port
    try:
        with PoolNode(config(tmp_path, arena_name, master=master.address)) as n:
            wait_until(lambda: n.link.registered)
            c = Client(n.address)
            try:
                fill_and_demote(c)
                ids = list(range(DRAM_SLOTS + 2))
                expected = [Tier.SSD] * 2 + [Tier.DRAM] * DRAM_SLOTS
                wait_until(lambda: list(lookup(master.address, ids).tiers) == expected)
                registrations = n.link.registrations
                master.stop()
                assert c.put([50], [block(50)]) == [1]  # the master is down: puts still work
                held = c.tiers(ids + [50])
                assert held == [Tier.SSD] * 3 + [Tier.DRAM] * (DRAM_SLOTS - 1) + [Tier.DRAM]  # 2 went down
                master = start_master(port)  # a fresh master on the same port knows nothing ...
                # ... until the node notices, registers again and re-reports everything it holds
                wait_until(lambda: list(lookup(master.address, ids + [50]).tiers) == held, timeout=20)
                assert n.link.registrations > registrations
            finally:
                c.close()
    finally:
        master.stop()


@needs_master
def test_master_link_chunks_its_full_sync_and_trusts_contains_over_event_order(arena_name):
    from kvpool.tiers.dram import DramStore

    master = start_master()
    dram = DramStore.create(arena_name, 32 * 1024, 1024)
    sizes = [100 + i for i in range(10)]
    dram.put([key(i) for i in range(10)], [bytes([i]) * sizes[i] for i in range(10)])
    ref = common_pb2.NodeRef(node_id="link-node", address="127.0.0.1:1", host_id="link-host", arena=arena_name)
    link = MasterLink(master.address, ref, {Tier.DRAM: dram}, dram_max_block_bytes=1024, chunk_keys=3)
    on_change = link.listener(Tier.DRAM)  # events are fed by hand below, to reorder them
    link.start()
    try:
        wait_until(lambda: link.registered)
        assert list(lookup(master.address, list(range(10))).sizes) == sizes  # synced in 4 chunks
        dram.put([key(20)], [b"x" * 20])
        added = BlockMeta(key(20), 20, block_checksum(b"x" * 20))
        on_change([added], [])
        on_change([], [key(20)])  # a stale removal arriving late: the key is still held
        assert link.flush()
        assert list(lookup(master.address, [20]).tiers) == [Tier.DRAM]
        gone = dram.inventory()[0]
        assert gone.key == key(0) and dram.remove([key(0)]) == 1
        on_change([], [key(0)])
        on_change([gone], [])  # a stale add arriving late: the key is gone
        assert link.flush()
        assert list(lookup(master.address, [0, 1]).tiers) == []
        assert list(lookup(master.address, [1]).tiers) == [Tier.DRAM]
    finally:
        link.stop()
        master.stop()
        dram.close()
    assert not link.registered and not link.flush()


@needs_master
def test_a_report_stuck_in_a_slow_store_call_does_not_delay_heartbeats(arena_name):
    """Regression: the thread that sent reports also sent the heartbeats, so a report stuck past node_timeout_s (here
    the store's ``contains``, as under a lock held by a slow write on a busy host) silenced the node: the master
    dropped it with its blocks, and the node registered again and re-sent everything."""
    from kvpool.config import MasterConfig
    from kvpool.master.server import MasterServer
    from kvpool.tiers.dram import DramStore

    stuck_s = 2.5  # more than twice node_timeout_s
    master = MasterServer(MasterConfig.of(port=0, metrics_port=0, node_timeout_s=1.0, heartbeat_interval_s=0.2)).start()
    dram = DramStore.create(arena_name, 32 * 1024, 1024)
    slow, returned = threading.Event(), threading.Event()

    class SlowStore:  # the DRAM store, with one slow contains() once ``slow`` is set
        def contains(self, keys):
            if slow.is_set():
                slow.clear()
                time.sleep(stuck_s)
                returned.set()
            return dram.contains(keys)

        def inventory(self):
            return dram.inventory()

        def stats(self):
            return dram.stats()

    dram.put([key(0)], [b"a" * 100])
    ref = common_pb2.NodeRef(node_id="busy-node", address="127.0.0.1:1", host_id="busy-host", arena=arena_name)
    link = MasterLink(master.address, ref, {Tier.DRAM: SlowStore()}, dram_max_block_bytes=1024)
    on_change = link.listener(Tier.DRAM)
    link.start()
    try:
        wait_until(lambda: link.registered)
        incarnation = link.incarnation
        slow.set()
        dram.put([key(1)], [b"b" * 100])
        on_change([BlockMeta(key(1), 100, block_checksum(b"b" * 100))], [])  # the link's thread reports it: stuck
        assert returned.wait(stuck_s + 10)
        assert link.flush()
        assert list(lookup(master.address, [0, 1]).tiers) == [Tier.DRAM, Tier.DRAM]
        assert link.registrations == 1 and link.incarnation == incarnation
        with grpc.insecure_channel(master.address) as channel:
            status = master_pb2_grpc.MasterStub(channel).ClusterStatus(master_pb2.ClusterStatusRequest(), timeout=10)
        assert [n.incarnation for n in status.nodes] == [incarnation]
    finally:
        link.stop()
        master.stop()
        dram.close()


def test_get_closes_the_gap_of_a_block_evicted_between_size_lookup_and_copy(arena_name):
    from kvpool.node.core import NodeCore
    from kvpool.node.servicer import NodeServicer
    from kvpool.tiers.dram import DramStore
    from kvpool.tiers.node_store import NodeStore

    store = NodeStore(DramStore.create(arena_name, 4 * SLOT, SLOT))
    servicer = NodeServicer(NodeCore(store, max_keys_per_call=16), node_ref=common_pb2.NodeRef(),
                            max_message_bytes=1 << 20)
    blocks = [block(0, 1000), block(1, 2000), block(2, 3000)]
    store.put([key(0), key(1), key(2)], blocks)
    real = store.get_into

    def evicting_get_into(keys, outs):
        store.dram.remove([key(1)])  # evicted after the node looked up sizes
        return real(keys, outs)

    store.get_into = evicting_get_into
    try:
        reply = servicer.Get(node_pb2.GetRequest(keys=pack_keys([key(0), key(1), key(2)])), None)
        assert list(reply.tiers) == [Tier.DRAM, NO_TIER, Tier.DRAM]
        assert list(reply.sizes) == [1000, 0, 3000]
        assert list(reply.checksums) == [block_checksum(blocks[0]), 0, block_checksum(blocks[2])]
        assert reply.data == blocks[0] + blocks[2]
    finally:
        store.close()


def test_the_node_imports_without_torch():
    import subprocess
    import sys

    code = "import sys; sys.modules['torch'] = None\nimport kvpool.node.daemon\nprint('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
