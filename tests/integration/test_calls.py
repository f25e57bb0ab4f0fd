"""Fast calls (kvpool.calls over kvpool.wire): the same protobuf messages and servicer over the wire, against a real
master."""

from __future__ import annotations

import dataclasses
import hashlib
import socket
import threading
import time

import grpc
import pytest
from support import free_port

from kvpool import tcp, wire
from kvpool.calls import FastStub
from kvpool.config import MasterConfig
from kvpool.keys import BlockKey, pack_keys
from kvpool.master import MasterServer
from kvpool.master_client import DirectMaster
from kvpool.tcp import ConnectionPool, await_bytes, recv_exact
from kvpool.v1 import common_pb2, master_pb2, master_pb2_grpc
from kvpool.wire import MASTER_CALLS, CallError, Method

MASTER = master_pb2.DESCRIPTOR.services_by_name["Master"]
MESSAGE_BYTES = 64 << 20


def keys(n: int) -> list[BlockKey]:
    return [BlockKey(hashlib.sha256(f"calls-{i}".encode()).digest()) for i in range(n)]


@pytest.fixture
def master():
    with MasterServer(MasterConfig.of(port=0, metrics_port=0, call_port=0)) as server:
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


def read_reply(sock: socket.socket) -> tuple[int, bytes]:
    head = wire.parse(recv_exact(sock, wire.FRAME.size))
    assert head is not None and not head.payload and not head.trailer
    return head.code, bytes(recv_exact(sock, head.header))


def raw_call(port: int, method: int, body: bytes) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(wire.pack(method, len(body)) + body)
        return read_reply(sock)


def test_info_advertises_the_call_port_and_lookup_answers_as_over_grpc(master, pool):
    server, stub = master
    fast = DirectMaster(server.address, pool=pool, timeout_s=2.0, max_message_bytes=MESSAGE_BYTES)
    try:
        info = fast.info()
        assert info is not None and info.call_port == server.servicer.call_port > 0
        request = master_pb2.LookupRequest(keys=pack_keys(keys(8)), worker_id="w")
        over_tcp = fast.lookup(request, 2.0)
        assert over_tcp == stub.Lookup(request, timeout=2.0)
        assert len(over_tcp.tiers) == 4 and list(over_tcp.checksums) == [7, 8, 9, 10]
        assert server._calls.connections == 1  # it really went over the fast-call listener
        # Methods that are not fast calls go over gRPC.
        assert fast.cluster_status(master_pb2.ClusterStatusRequest(), 2.0).indexed_blocks == 4
    finally:
        fast.close()


def test_a_spinning_pool_gets_the_same_answers_and_a_slow_reply_still_arrives(master):
    server, stub = master
    spinning = ConnectionPool(2.0, spin_wait_s=0.0003)
    try:
        fast = DirectMaster(server.address, pool=spinning, timeout_s=2.0, max_message_bytes=MESSAGE_BYTES)
        request = master_pb2.LookupRequest(keys=pack_keys(keys(8)), worker_id="w")
        assert fast.lookup(request, 2.0) == stub.Lookup(request, timeout=2.0)
        # A handler far slower than the spin: the spin gives up, the blocking read gets the reply.
        real, served = server.servicer.Lookup, []

        def slow(request, context):
            time.sleep(0.05)
            served.append(request)
            return real(request, context)

        handler = server._calls._serve.__self__  # the WireHandler behind the fast-call listener
        # (answered by fn alone: no steps to answer it in)
        handler.replace(Method.LOOKUP, dataclasses.replace(handler.route(Method.LOOKUP), fn=slow, together=None))
        assert fast.lookup(request, 2.0) == stub.Lookup(request, timeout=2.0)
        assert served == [request]  # the slow handler answered it, over the wire
        fast.close()
    finally:
        spinning.close()


def test_await_bytes_returns_when_a_byte_is_there_leaves_it_unread_and_gives_up_after_its_spin():
    a, b = socket.socketpair()
    with a, b:
        started = time.perf_counter()
        assert await_bytes(a, 0.01) is False  # nothing comes: it returns after its spin, having read nothing
        assert time.perf_counter() - started >= 0.01
        assert await_bytes(a, 0.0) is None  # no spin: it does not poll
        threading.Timer(0.002, b.sendall, (b"xy",)).start()
        assert await_bytes(a, 5.0) is True  # returns once the bytes are there, long before its spin ends
        assert time.perf_counter() - started < 4.0
        a.settimeout(1.0)
        assert a.recv(2) == b"xy"  # peeked, not consumed
        b.close()
        started = time.perf_counter()
        await_bytes(a, 5.0)  # a closed peer: at once, no error (the read that follows reports it)
        assert time.perf_counter() - started < 4.0
        assert a.recv(1) == b""


def test_one_thread_of_a_process_polls_for_its_reply_at_a_time():
    """While a thread polls for its reply, another thread's wait does not poll (it returns False at once, to
    block on its read); once the first is answered, the next wait polls again."""
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    with a, b, c, d:
        first: list[bool] = []
        poller = threading.Thread(target=lambda: first.append(await_bytes(a, 30.0)))
        poller.start()
        deadline = time.monotonic() + 10
        while tcp._SPINNING._value and time.monotonic() < deadline:  # (until the poller holds the one turn)
            time.sleep(0.001)
        assert not tcp._SPINNING._value and poller.is_alive()
        started = time.perf_counter()
        assert await_bytes(c, 30.0) is None  # not its turn: it does not poll for 30 s
        assert time.perf_counter() - started < 10.0 and poller.is_alive()
        b.sendall(b"x")
        poller.join(10)
        assert first == [True]
        d.sendall(b"y")
        assert await_bytes(c, 30.0) is True  # its turn now


def test_a_pool_pauses_its_polls_for_a_peer_whose_replies_come_after_the_spin():
    """A peer whose replies come later than the spin (a loaded master) is polled for less and less often: the
    pause after a poll that went unanswered doubles, up to MAX_POLL_PAUSE calls; the first poll that gets its
    reply ends it. Each exchange sees the spin it was given."""
    delay = [0.0]
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:  # one connection: each request frame answered "ok" after ``delay``
        conn, _ = server.accept()
        with conn:
            while True:
                try:
                    head = wire.parse(recv_exact(conn, wire.FRAME.size))
                except (ConnectionError, OSError):
                    return
                assert head is not None
                recv_exact(conn, head.header)
                time.sleep(delay[0])  # (the peer's load)
                conn.sendall(wire.pack(0, 2) + b"ok")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    spin = 0.001
    pool = ConnectionPool(10.0, spin_wait_s=spin)
    spins: list[float] = []

    def call(sock: socket.socket, state: tcp.Exchange) -> bytes:
        spins.append(state.spin_s)
        return wire.unary_exchange(sock, state, Method.LOOKUP, b"", 1 << 10)[1]

    try:
        for _ in range(3):
            assert pool.exchange(address, call) == b"ok"
        assert spins == [spin] * 3  # quick replies: polled for
        delay[0] = 0.004  # replies take 4 x the spin
        slow = 16 + 2 * tcp.MAX_POLL_PAUSE
        for _ in range(slow):
            assert pool.exchange(address, call) == b"ok"
        polls = [i for i, s in enumerate(spins[3:]) if s]
        assert polls[:5] == [0, 2, 5, 10, 19]  # pauses of 1, 2, 4, 8 calls
        assert max(b - a for a, b in zip(polls, polls[1:])) == tcp.MAX_POLL_PAUSE + 1  # and no longer
        assert slow - polls[-1] <= tcp.MAX_POLL_PAUSE + 1
        delay[0] = 0.0
        for _ in range(tcp.MAX_POLL_PAUSE + 8):
            pool.exchange(address, call)
        assert spins[-6:] == [spin] * 6  # quick again: the first poll that paid ended the pause
    finally:
        pool.close()
        server.close()
        thread.join(5)


def test_bad_requests_get_a_clear_status_and_change_nothing(master, pool):
    server, stub = master
    fast = DirectMaster(server.address, pool=pool, timeout_s=2.0, max_message_bytes=MESSAGE_BYTES)
    before = stub.ClusterStatus(master_pb2.ClusterStatusRequest()).indexed_blocks
    with pytest.raises(CallError) as bad_keys:
        fast.lookup(master_pb2.LookupRequest(keys=b"x" * 33), 2.0)  # not a whole number of keys
    assert bad_keys.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "key" in bad_keys.value.details()
    with pytest.raises(CallError) as unknown:
        fast.report_blocks(master_pb2.ReportBlocksRequest(node_id="n1", incarnation=1, tier=77), 2.0)
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The connection stays usable after error replies.
    assert len(fast.lookup(master_pb2.LookupRequest(keys=pack_keys(keys(2))), 2.0).tiers) == 2
    fast.close()
    assert server._calls.connections == 1
    port = server.servicer.call_port
    status, text = raw_call(port, Method.LOOKUP, b"\xff\xff\xff")  # undecodable protobuf
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"undecodable" in text
    status, text = raw_call(port, Method.LOCATE, b"")  # a node's method: not served here
    assert status == grpc.StatusCode.UNIMPLEMENTED.value[0]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:  # errors, then a call: one connection
        lookup = master_pb2.LookupRequest(keys=pack_keys(keys(8))).SerializeToString()
        for method, body, code in ((Method.LOOKUP, b"\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT),
                                   (Method.GET, b"", grpc.StatusCode.UNIMPLEMENTED),
                                   (Method.LOOKUP, b"x" * 33, grpc.StatusCode.INVALID_ARGUMENT),
                                   (Method.LOOKUP, lookup, grpc.StatusCode.OK)):
            sock.sendall(wire.pack(method, len(body)) + body)
            status, text = read_reply(sock)
            assert status == code.value[0], text
        assert len(master_pb2.LookupResponse.FromString(text).tiers) == 4
    for garbage in (b"GET / HTTP/1.1\r\n\r\n" + bytes(16),  # not a frame at all
                    wire.pack(Method.LOOKUP, 1 << 30) + b"x" * 1000):  # a header over the limit
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(garbage)
            status, text = read_reply(sock)
            assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and text
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
    server = MasterServer(MasterConfig.of(port=0, metrics_port=0, call_port=0)).start()
    fast = DirectMaster(server.address, pool=pool, timeout_s=1.0, max_message_bytes=MESSAGE_BYTES)
    try:
        fast.exists(master_pb2.ExistsRequest(keys=pack_keys(keys(1))), 1.0)
        server.stop()
        with pytest.raises(grpc.RpcError) as failed:  # the pooled connection is cut; gRPC finds nothing either
            fast.exists(master_pb2.ExistsRequest(keys=pack_keys(keys(1))), 1.0)
        assert failed.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        server.stop()
        fast.close()
