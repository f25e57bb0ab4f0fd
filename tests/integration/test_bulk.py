"""The bulk data path over the wire: the node listener's GET and PUT, the client, fallback to gRPC (127.0.0.1)."""

from __future__ import annotations

import importlib.util
import os
import socket
import struct
import threading
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import free_port, wait_until

from kvpool import wire
from kvpool.checksum import block_checksum
from kvpool.client.bulk_client import CHANGED, CORRUPT, GONE, OK, BulkClient, BulkFailed, BulkUnavailable
from kvpool.config import NodeConfig
from kvpool.keys import BlockKey, opaque_key
from kvpool.metrics import error_counts
from kvpool.node.daemon import PoolNode
from kvpool.tcp import recv_exact
from kvpool.v1 import node_pb2
from kvpool.vocabulary import Tier
from kvpool.wire import Method

MIB = 1 << 20
SLOT = 8 * MIB
HAVE_MASTER = importlib.util.find_spec("kvpool.master.server") is not None


def key(i: int) -> BlockKey:
    return opaque_key(f"bulk-test-{i}")


def block(i: int, size: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def node_config(tmp_path, arena: str, **over) -> NodeConfig:
    values: dict[str, Any] = dict(
        master=f"127.0.0.1:{free_port()}", host="127.0.0.1", port=0, metrics_port=0, data_port=0, arena=arena,
        dram_bytes=6 * SLOT, max_block_bytes=SLOT, high_watermark=1.0, low_watermark=1.0, ssd_dir=str(tmp_path / "ssd"),
        ssd_bytes=128 * MIB)
    values.update(over)
    return NodeConfig.of(**values)


@pytest.fixture
def node(tmp_path, arena_name):
    n = PoolNode(node_config(tmp_path, arena_name)).start()
    yield n
    n.stop()


@pytest.fixture
def bulk_client():
    c = BulkClient(timeout_s=10.0)
    yield c
    c.close()


def put(c: BulkClient, n: PoolNode, ids: list[int], values: list[np.ndarray]) -> list[bool]:
    return c.put(n.data_address, [key(i) for i in ids], values, [block_checksum(v) for v in values])


def get(c: BulkClient, n: PoolNode, ids: list[int], sizes: list[int], sums: list[int]) -> tuple[list[int], list]:
    outs = [np.zeros(s, np.uint8) for s in sizes]
    return c.get_into(n.data_address, [key(i) for i in ids], outs, sums), outs


# -- the listener and the client, directly --------------------------------------------------------------


def test_the_node_advertises_its_bulk_address(node):
    from kvpool.v1 import node_pb2, node_pb2_grpc

    host, port = node.data_address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) == node.bulk.port != node.port
    with grpc.insecure_channel(node.address) as channel:
        info = node_pb2_grpc.NodeStub(channel).Info(node_pb2.InfoRequest(), timeout=10)
    assert info.node.data_address == node.data_address


SIZES = [1, 4095, 64 << 10, MIB, SLOT]  # 8 MiB: a whole slot


def test_put_then_get_is_byte_exact_for_several_sizes_in_one_batch(node, bulk_client):
    values = [block(i, n) for i, n in enumerate(SIZES)]
    ids = list(range(len(SIZES)))
    assert put(bulk_client, node, ids, values) == [True] * len(ids)
    assert node.store.where([key(i) for i in ids]) == [Tier.DRAM] * len(ids)
    assert node.store.dram.leased_slots == 0
    order = [4, 0, 3, 1, 2]
    status, outs = get(bulk_client, node, order, [SIZES[i] for i in order], [block_checksum(values[i]) for i in order])
    assert status == [OK] * 5
    assert all(np.array_equal(o, values[i]) for o, i in zip(outs, order))
    assert put(bulk_client, node, [0, 9], [values[0], block(9, 100)]) == [True, True]  # 0: already held


def test_get_reports_misses_changed_blocks_and_corruption(node, bulk_client):
    values = [block(1, 1000), block(2, 2000)]
    put(bulk_client, node, [1, 2], values)
    sums = [block_checksum(v) for v in values]
    status, outs = get(bulk_client, node, [1, 77, 2, 1], [1000, 5, 2001, 1000], [sums[0], 0, sums[1], sums[0] ^ 1])
    assert status == [OK, GONE, CHANGED, CHANGED]  # 2: another size; the last: another checksum
    assert np.array_equal(outs[0], values[0])
    slot = node.store.dram.locate([key(1)])[0].slot
    node.store.dram.arena.block(slot)[10] ^= 0xFF  # bytes rotting under an unchanged checksum
    status, _ = get(bulk_client, node, [1, 2], [1000, 2000], sums)
    assert status == [CORRUPT, OK]


def test_a_put_whose_bytes_do_not_match_their_checksum_is_refused(node, bulk_client):
    values = [block(1, MIB), block(2, 3 * SLOT)]  # 2 is larger than a slot: it goes through scratch to SSD
    sums = [block_checksum(v) ^ 1 for v in values]
    assert bulk_client.put(node.data_address, [key(1), key(2)], values, sums) == [False, False]
    assert node.store.where([key(1), key(2)]) == [None, None]
    assert node.store.dram.leased_slots == 0
    assert error_counts(node.registry).get("checksum", 0) == 2


def test_blocks_larger_than_a_slot_and_ssd_resident_blocks_travel_too(node, bulk_client):
    big = block(100, 3 * SLOT)
    assert put(bulk_client, node, [100], [big]) == [True]
    assert node.store.where([key(100)]) == [Tier.SSD]
    values = [block(i, SLOT) for i in range(8)]  # 6 DRAM slots: the first two are demoted to SSD
    for i, v in enumerate(values):
        assert put(bulk_client, node, [i], [v]) == [True]
    assert node.store.where([key(0), key(7)]) == [Tier.SSD, Tier.DRAM]
    ids = [0, 100, 7, 1]
    all_values = {**dict(enumerate(values)), 100: big}
    status, outs = get(bulk_client, node, ids, [all_values[i].size for i in ids],
                       [block_checksum(all_values[i]) for i in ids])
    assert status == [OK] * 4
    assert all(np.array_equal(o, all_values[i]) for o, i in zip(outs, ids))
    assert node.store.where([key(0)]) == [Tier.DRAM]  # promoted on the way out


def read_reply(sock: socket.socket) -> tuple[wire.Head, bytes]:
    return wire.read_reply(sock, None, 1 << 20)


def read_error(sock: socket.socket, *, closed: bool = True) -> str:
    """An error reply's message; ``closed``: and the node closed the connection after it."""
    head, body = read_reply(sock)
    assert head.code != 0, "expected an error reply"
    if closed:
        assert sock.recv(1) == b""
    return body.decode()


def raw(node: PoolNode) -> socket.socket:
    host, port = node.data_address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def frame(method: int, header: bytes, payload: bytes = b"", *, payload_len: int | None = None) -> bytes:
    """A request frame as raw bytes (``payload_len``: announce another length than the payload's)."""
    n = len(payload) if payload_len is None else payload_len
    return wire.pack(method, len(header), n) + header + payload


def put_header(keys: list[bytes], sizes: list[int], sums: list[int]) -> bytes:
    return node_pb2.BulkPutRequest(keys=b"".join(keys), sizes=sizes, checksums=sums).SerializeToString()


GET1 = node_pb2.GetRequest(keys=b"k" * 32).SerializeToString()
# Frames the node cannot trust to be in step: an error reply, then the connection closes.
GARBAGE = {
    "bad magic": (os.urandom(64), "magic"),
    "bad version": (struct.pack("<4sHHIIQII", b"KVPW", 9, Method.GET, 0, len(GET1), 0, 0, 0) + GET1, "version"),
    "an over-long header": (wire.pack(Method.GET, 1 << 30), "over the limit"),
    "a payload over the limit": (wire.pack(Method.PUT, 10, 1 << 40), "over the limit"),
    "a trailer in a request": (wire.pack(Method.GET, len(GET1), 0, 5) + GET1, "over the limit"),
}
# Requests read in full and refused: an error reply, and the connection stays usable.
REFUSED = {
    "unknown method": (frame(77, b"k" * 32), "no method 77"),
    "undecodable header": (frame(Method.GET, b"\xff\xff\xff"), "undecodable"),
    "too many keys": (frame(Method.GET, node_pb2.GetRequest(keys=b"k" * 32 * 65537).SerializeToString()), "limit"),
    "an empty block": (frame(Method.PUT, put_header([b"k" * 32], [0], [0])), "0 bytes"),
    "a block no tier takes": (frame(Method.PUT, put_header([b"k" * 32], [1 << 40], [0]), b"x" * 10), "fits neither"),
    "sizes that do not match the payload": (frame(Method.PUT, put_header([b"k" * 32], [20], [0]), b"x" * 10),
                                            "payload holds 10"),
    "keys without sizes": (frame(Method.PUT, put_header([b"k" * 32], [], []), b""), "need one each"),
}


@pytest.mark.parametrize("case", list(GARBAGE))
def test_garbage_gets_an_error_and_the_node_keeps_serving(node, bulk_client, case):
    payload, message = GARBAGE[case]
    with raw(node) as sock:
        sock.sendall(payload)
        assert message in read_error(sock)
    assert error_counts(node.registry).get("invalid_argument", 0) == 1
    values = [block(5, 5000)]
    assert put(bulk_client, node, [5], values) == [True]  # the listener still serves ...
    status, outs = get(bulk_client, node, [5], [5000], [block_checksum(values[0])])
    assert status == [OK] and np.array_equal(outs[0], values[0])
    with grpc.insecure_channel(node.address) as channel:  # ... and so does the gRPC service
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refused_request_gets_an_error_and_its_connection_stays_usable(node, case):
    request, message = REFUSED[case]
    value = block(6, 3000)
    with raw(node) as sock:
        sock.sendall(request)
        assert message in read_error(sock, closed=False)
        # the same connection: a PUT, then a GET of what it stored
        sock.sendall(frame(Method.PUT, put_header([key(6)], [value.size], [block_checksum(value)]), value.tobytes()))
        head, body = read_reply(sock)
        assert head.code == 0 and node_pb2.PutResponse.FromString(body).stored == b"\x01"
        sock.sendall(frame(Method.GET, node_pb2.GetRequest(keys=key(6)).SerializeToString()))
        head, body = read_reply(sock)
        assert head.code == 0 and head.payload == value.size
        assert list(node_pb2.BulkGetReply.FromString(body).sizes) == [value.size]
        data = bytes(recv_exact(sock, head.payload))
        assert data == value.tobytes()
        assert node_pb2.BulkGetTrailer.FromString(bytes(recv_exact(sock, head.trailer))).valid == b"\x01"
    assert node.store.dram.leased_slots == 0


def test_half_a_header_then_a_hang_up_is_dropped_quietly(node, bulk_client):
    with raw(node) as sock:
        sock.sendall(b"KVPW\x02")
    wait_until(lambda: node.bulk.connections == 0)
    assert put(bulk_client, node, [3], [block(3, 10)]) == [True]


def test_a_client_that_disconnects_mid_put_leaves_no_slot_leased(node, bulk_client):
    with raw(node) as sock:
        sock.sendall(frame(Method.PUT, put_header([key(1), key(2)], [MIB, MIB], [0, 0]), payload_len=2 * MIB))
        sock.sendall(b"x" * (MIB // 2))  # half of the first block, then hang up
        wait_until(lambda: node.store.dram.leased_slots == 2)
    wait_until(lambda: node.store.dram.leased_slots == 0 and node.bulk.connections == 0)
    assert node.store.where([key(1), key(2)]) == [None, None]
    assert put(bulk_client, node, [1], [block(1, MIB)]) == [True]


def test_a_bad_frame_or_a_half_sent_payload_closes_only_its_own_connection(node, bulk_client):
    """Bad magic, an over-limit length, a payload cut off: each ends its connection, and no other."""
    value = block(7, 5000)
    assert put(bulk_client, node, [7], [value]) == [True]  # the pooled connection, kept open
    pooled = set(node.bulk._listener._conns)
    assert len(pooled) == 1
    with raw(node) as stalled:
        stalled.sendall(frame(Method.PUT, put_header([key(8)], [MIB], [0]), payload_len=MIB) + b"x" * 1000)
        wait_until(lambda: node.store.dram.leased_slots == 1)  # half a payload, then nothing more
        for bad in (b"KVPX" + bytes(28), wire.pack(Method.PUT, 10, 1 << 50)):
            with raw(node) as sock:
                sock.sendall(bad)
                assert read_error(sock)  # an error, then this connection closes
        status, outs = get(bulk_client, node, [7], [5000], [block_checksum(value)])
        assert status == [OK] and np.array_equal(outs[0], value)
        assert pooled <= set(node.bulk._listener._conns)  # the same pooled connection served it
    wait_until(lambda: node.store.dram.leased_slots == 0 and node.bulk.connections == 1)
    assert node.store.where([key(8)]) == [None]


def test_connections_are_pooled_and_a_dropped_one_is_replaced(node, bulk_client):
    values = [block(1, 100)]
    for _ in range(5):
        assert put(bulk_client, node, [1], values) == [True]
    assert node.bulk.connections == 1
    for sock in list(node.bulk._listener._conns):  # the node drops it (as after its idle timeout)
        sock.shutdown(socket.SHUT_RDWR)
    wait_until(lambda: node.bulk.connections == 0)
    status, outs = get(bulk_client, node, [1], [100], [block_checksum(values[0])])
    assert status == [OK] and np.array_equal(outs[0], values[0])


def test_too_many_connections_get_an_error(tmp_path, arena_name):
    """Every connection mid-request: a newcomer is refused with a message, and the request is not cut.

    (An idle or silent connection is closed to make room instead: tests/integration/test_listener_limits.py.)
    """
    with PoolNode(node_config(tmp_path, arena_name)) as n:
        n.bulk._listener.max_connections = 1
        entered, release = threading.Event(), threading.Event()
        trim = n.core.trim

        def slow_trim(keys):
            entered.set()
            release.wait(10)
            return trim(keys)

        n.core.trim = slow_trim  # the PUT below is being served while the second one arrives
        value = block(1, 100)
        with raw(n) as first:
            first.sendall(frame(Method.PUT, put_header([key(1)], [value.size], [block_checksum(value)]),
                                value.tobytes()))
            assert entered.wait(10)
            try:
                with raw(n) as second:
                    sock_head = second.recv(wire.FRAME.size, socket.MSG_WAITALL)
                    head = wire.parse(sock_head)
                    assert head is not None and head.flags & wire.FLAG_REFUSED
                    assert head.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
                    assert b"too many" in recv_exact(second, head.header)
                    assert second.recv(1) == b""
            finally:
                release.set()
            head, body = read_reply(first)  # the first one is still served
            assert head.code == 0 and node_pb2.PutResponse.FromString(body).stored == b"\x01"


def test_an_unreachable_listener_is_bulk_unavailable(bulk_client):
    with pytest.raises(BulkUnavailable):
        bulk_client.get_into(f"127.0.0.1:{free_port()}", [key(1)], [np.zeros(1, np.uint8)], [0])


def test_an_error_reply_is_bulk_failed(node, bulk_client):
    with pytest.raises(BulkFailed) as err:
        bulk_client.put(node.data_address, [key(1)], [np.zeros(SLOT * 1000, np.uint8)[:0]], [0])  # an empty block
    assert err.value.kind == "bulk_error" and "0 bytes" in str(err.value)
    value = block(2, 100)  # the error reply left the pooled connection usable
    assert put(bulk_client, node, [2], [value]) == [True]
    assert node.bulk.connections == 1


def test_the_default_data_port_is_next_to_the_grpc_port_or_any_if_taken(tmp_path, arena_name):
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 2))  # someone else has port + 2
        with PoolNode(node_config(tmp_path, arena_name, port=port, data_port=-1)) as n:
            assert n.bulk.port not in (0, port + 2)
    with PoolNode(node_config(tmp_path, arena_name, port=port, data_port=-1)) as n:
        assert n.bulk.port == port + 2
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 2))
        with pytest.raises(ValueError, match="cannot bind"):
            PoolNode(node_config(tmp_path, arena_name, port=port, data_port=port + 2))


# -- PoolClient over the bulk path (master + node in this process) -----------------------------------

needs_master = pytest.mark.skipif(not HAVE_MASTER, reason="kvpool.master.server is not available")


@pytest.fixture
def cluster(tmp_path, arena_name):
    from kvpool.config import MasterConfig
    from kvpool.master.server import MasterServer

    master = MasterServer(MasterConfig.of(port=0, metrics_port=0)).start()
    try:
        n = PoolNode(node_config(tmp_path, arena_name, master=master.address, dram_bytes=16 * SLOT)).start()
        try:
            wait_until(lambda: n.link.registered)
            yield master, n
        finally:
            n.stop()
    finally:
        master.stop()


def pool_client(master, **over):
    from kvpool.client.pool import PoolClient
    from kvpool.config import ClientConfig

    values = dict(master=master.address, shared_memory=False, strict=True, io_timeout_s=10.0, lookup_timeout_s=5.0)
    values.update(over)
    return PoolClient(ClientConfig(**values))


def forbid(monkeypatch, pool, *names: str) -> None:
    """Make ``pool.<path>.<method>`` (names like ``grpc_path.put``) fail the test if called."""
    def fail(*args, **kwargs):
        raise AssertionError("this path must not be used here")

    for name in names:
        path, method = name.split(".")
        monkeypatch.setattr(getattr(pool, path), method, fail)


@needs_master
@pytest.mark.parametrize("batch", [1, 7])
def test_remote_store_and_get_are_byte_exact_over_tcp(cluster, monkeypatch, batch):
    master, _ = cluster
    sizes = [1, 4095, 64 << 10, MIB, SLOT, 3 * MIB, 100, SLOT]
    values = [block(i, n) for i, n in enumerate(sizes)]
    keys = [key(i) for i in range(len(sizes))]
    with pool_client(master) as pool:
        forbid(monkeypatch, pool, "grpc_path.put", "grpc_path.get")  # shared memory is off for this client
        for s in range(0, len(keys), batch):
            assert pool.store(keys[s : s + batch], values[s : s + batch]) == [True] * len(keys[s : s + batch])
        locations = pool.lookup(keys)
        assert len(locations) == len(keys)
        outs = [np.zeros(n, np.uint8) for n in sizes]
        for s in range(0, len(keys), batch):
            assert pool.get_into(locations[s : s + batch], outs[s : s + batch]) == [True] * len(keys[s : s + batch])
        assert all(np.array_equal(o, v) for o, v in zip(outs, values))


@needs_master
def test_client_falls_back_to_grpc_when_the_bulk_port_is_closed(cluster):
    master, n = cluster
    values = [block(i, MIB) for i in range(3)]
    keys = [key(i) for i in range(3)]
    n.bulk.stop()  # the port is closed now; gRPC still serves
    with pool_client(master) as pool:
        assert pool.store(keys, values) == [True] * 3
        locations = pool.lookup(keys)
        outs = [np.zeros(MIB, np.uint8) for _ in keys]
        assert pool.get_into(locations, outs) == [True] * 3
        assert all(np.array_equal(o, v) for o, v in zip(outs, values))
        assert error_counts(pool.registry).get("unavailable", 0) == 0
    assert n.registry.get_sample_value("kvpool_put_seconds_sum") > 0 and \
        n.registry.get_sample_value("kvpool_get_seconds_sum") > 0  # the gRPC handlers did the work
