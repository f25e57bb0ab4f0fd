"""Fast calls (kvpool.calls): the same protobuf messages and servicer over framed TCP, against a real master."""

from __future__ import annotations

import hashlib
import socket

import grpc
import pytest
from support import free_port

from kvpool.calls import (
    CALL_MAGIC,
    CALL_VERSION,
    FRAME,
    MASTER_CALLS,
    CallError,
    FastStub,
    MasterCallAddress,
)
from kvpool.config import MasterConfig
from kvpool.framing import ConnectionPool, recv_exact
from kvpool.keys import BlockKey, pack_keys
from kvpool.master import MasterServer
from kvpool.v1 import common_pb2, master_pb2, master_pb2_grpc

MASTER = master_pb2.DESCRIPTOR.services_by_name["Master"]


def keys(n: int) -> list[BlockKey]:
    return [BlockKey(hashlib.sha256(f"calls-{i}".encode()).digest()) for i in range(n)]


@pytest.fixture
def master():
    with MasterServer(MasterConfig(port=0, metrics_port=0, call_port=0)) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = master_pb2_grpc.MasterStub(channel)
            node = common_pb2.NodeRef(node_id="n1", address="n1.test:1", host_id="h1", arena="a1")
            inc = stub.RegisterNode(master_pb2.RegisterNodeRequest(node=node, dram_max_block_bytes=1 << 20)).incarnation
            ks = keys(8)
            stub.ReportBlocks(master_pb2.ReportBlocksRequest(
                node_id="n1", incarnation=inc, tier=common_pb2.TIER_DRAM, added_keys=pack_keys(ks[:4]),
                added_sizes=[4096] * 4, added_checksums=[7, 8, 9, 10]))
            yield server, stub


@pytest.fixture
def pool():
    p = ConnectionPool(2.0)
    yield p
    p.close()


def raw_call(port: int, method: int, body: bytes) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(FRAME.pack(CALL_MAGIC, CALL_VERSION, method, 0, len(body)) + body)
        magic, version, status, _, length = FRAME.unpack(recv_exact(sock, FRAME.size))
        assert (magic, version) == (CALL_MAGIC, CALL_VERSION)
        return status, bytes(recv_exact(sock, length))


def test_info_advertises_the_call_port_and_lookup_answers_as_over_grpc(master, pool):
    server, stub = master
    address = MasterCallAddress(stub, server.address, 2.0)
    assert address() == f"127.0.0.1:{server.servicer.call_port}" and server.servicer.call_port > 0
    fast = FastStub(stub, MASTER, MASTER_CALLS, pool, address)
    request = master_pb2.LookupRequest(keys=pack_keys(keys(8)), worker_id="w")
    over_tcp = fast.Lookup(request, timeout=2.0)
    assert over_tcp == stub.Lookup(request, timeout=2.0)
    assert len(over_tcp.tiers) == 4 and list(over_tcp.checksums) == [7, 8, 9, 10]
    assert server._calls.connections == 1  # it really went over the fast-call listener
    # Methods that are not fast calls are the gRPC stub's own.
    assert fast.ClusterStatus(master_pb2.ClusterStatusRequest(), timeout=2.0).indexed_blocks == 4


def test_bad_requests_get_a_clear_status_and_change_nothing(master, pool):
    server, stub = master
    fast = FastStub(stub, MASTER, MASTER_CALLS, pool, MasterCallAddress(stub, server.address, 2.0))
    before = stub.ClusterStatus(master_pb2.ClusterStatusRequest()).indexed_blocks
    with pytest.raises(CallError) as bad_keys:
        fast.Lookup(master_pb2.LookupRequest(keys=b"x" * 33), timeout=2.0)  # not a whole number of keys
    assert bad_keys.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "key" in bad_keys.value.details()
    with pytest.raises(CallError) as unknown:
        fast.ReportBlocks(master_pb2.ReportBlocksRequest(node_id="n1", incarnation=1, tier=77), timeout=2.0)
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The connection stays usable after error replies.
    assert len(fast.Lookup(master_pb2.LookupRequest(keys=pack_keys(keys(2))), timeout=2.0).tiers) == 2
    assert server._calls.connections == 1
    port = server.servicer.call_port
    status, text = raw_call(port, 1, b"\xff\xff\xff")  # undecodable protobuf
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"undecodable" in text
    status, text = raw_call(port, len(MASTER_CALLS) + 1, b"")
    assert status == grpc.StatusCode.UNIMPLEMENTED.value[0]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:  # not a frame at all
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        magic, _, status, _, length = FRAME.unpack(recv_exact(sock, FRAME.size))
        assert magic == CALL_MAGIC and status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        recv_exact(sock, length)
        assert sock.recv(1) == b""  # and the connection is closed
    assert stub.ClusterStatus(master_pb2.ClusterStatusRequest()).indexed_blocks == before


def test_an_unreachable_listener_falls_back_to_grpc(master, pool):
    server, stub = master
    dead = f"127.0.0.1:{free_port()}"
    lost = []
    fast = FastStub(stub, MASTER, MASTER_CALLS, pool, lambda: dead, on_unreachable=lambda: lost.append(1))
    reply = fast.Exists(master_pb2.ExistsRequest(keys=pack_keys(keys(6))), timeout=2.0)
    assert list(reply.present) == [1, 1, 1, 1, 0, 0] and lost == [1]
    fast.Exists(master_pb2.ExistsRequest(keys=pack_keys(keys(1))), timeout=2.0)
    assert lost == [1]  # marked down: no second connect attempt within the retry period
    assert server._calls.connections == 0


def test_a_stopped_master_is_an_rpc_error_not_a_hang(pool):
    server = MasterServer(MasterConfig(port=0, metrics_port=0, call_port=0)).start()
    channel = grpc.insecure_channel(server.address)
    try:
        stub = master_pb2_grpc.MasterStub(channel)
        fast = FastStub(stub, MASTER, MASTER_CALLS, pool, MasterCallAddress(stub, server.address, 1.0))
        fast.Exists(master_pb2.ExistsRequest(keys=pack_keys(keys(1))), timeout=1.0)
        server.stop()
        with pytest.raises(grpc.RpcError) as failed:  # the pooled connection is cut; gRPC finds nothing either
            fast.Exists(master_pb2.ExistsRequest(keys=pack_keys(keys(1))), timeout=1.0)
        assert failed.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        server.stop()
        channel.close()
