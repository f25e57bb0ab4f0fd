"""Issue 29.1: the master's fast-call port is served by an event loop, not a thread per connection.

Against a real ``kvpool master`` process, over real sockets (raw wire frames, so each test controls what a
client sends and reads):

- 200 connections, each answered once and then held open, add no thread to the master;
- connections trickling a header byte by byte do not hold up a client making calls meanwhile;
- a client that pipelines requests and never reads its replies does not grow the master's memory (the loop
  reads one request at a time per connection: the rest stays in the kernel's buffers), and others are served;
- lookups that reach the loop together share one index pass, and each still gets its own run;
- the loop's poll for the next request (``call_poll_us``) costs an idle master, or one whose requests come
  further apart than the poll, next to nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time

import pytest
from support import PoolProcesses, cpu_seconds, metric, rss_bytes, scrape

from kvpool import wire
from kvpool.keys import opaque_key, pack_keys
from kvpool.master_client import DirectMaster
from kvpool.v1 import common_pb2, master_pb2
from kvpool.wire import Method

MIB = 1 << 20


def exists_frame(n: int, tag: str = "loop") -> bytes:
    request = master_pb2.ExistsRequest(keys=pack_keys([opaque_key(f"{tag}-{i}") for i in range(n)]))
    return b"".join(wire.request_frame(Method.EXISTS, request))


def call(sock: socket.socket, frame: bytes) -> list[int]:
    """One Exists exchange on ``sock``: the reply's ``present`` flags (an error reply fails the test)."""
    sock.sendall(frame)
    head, body = wire.read_reply(sock, None, 1 << 20)
    assert head.code == 0, body
    return list(master_pb2.ExistsResponse.FromString(body).present)


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


@pytest.fixture
def master(tmp_path):
    pool = PoolProcesses(tmp_path)
    try:
        proc = pool.start_master(**{"max-connections": "512"})
        with socket.create_connection(("127.0.0.1", pool.master_call_port), timeout=5) as sock:
            call(sock, exists_frame(1))  # the listener is up and answering
        yield pool, proc
    finally:
        pool.close()


@contextlib.contextmanager
def connections(port: int, n: int):
    socks = []
    try:
        for _ in range(n):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        yield socks
    finally:
        for s in socks:
            s.close()


def test_two_hundred_open_connections_add_no_thread_to_the_master(master):
    pool, proc = master
    before = threads_of(proc.pid)
    frame = exists_frame(4)
    with connections(pool.master_call_port, 200) as socks:
        for s in socks:
            assert call(s, frame) == [0, 0, 0, 0]  # each answered, then held open (idle, trusted)
        held = threads_of(proc.pid)
        for s in socks[::50]:  # and still served
            assert call(s, frame) == [0, 0, 0, 0]
    assert held <= before + 2, f"the master went from {before} to {held} threads with 200 connections open"


def test_connections_trickling_a_header_do_not_hold_up_other_clients(master):
    """A slowloris: 20 connections each send a frame's first bytes, then one byte at a time."""
    pool, proc = master
    stop = threading.Event()
    announced = wire.pack(Method.LOOKUP, 4096)  # a header section of 4 KiB follows, a byte at a time
    with connections(pool.master_call_port, 20) as slow:
        for s in slow:
            s.sendall(announced[:10])

        def trickle() -> None:
            i = 10
            while not stop.wait(0.05):
                for s in slow:
                    with contextlib.suppress(OSError):
                        s.send(announced[i:i + 1] if i < len(announced) else b"k")
                i += 1

        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        try:
            with socket.create_connection(("127.0.0.1", pool.master_call_port), timeout=2) as sock:
                frame = exists_frame(8)
                for _ in range(200):  # each answered within the socket's 2 s timeout while the others trickle
                    assert call(sock, frame) == [0] * 8
            for s in slow:  # the trickling connections are still open (mid-request, within their deadline)
                s.settimeout(0.0)
                with pytest.raises(BlockingIOError):
                    s.recv(1)
        finally:
            stop.set()
            t.join(5)


def test_requests_sent_back_to_back_are_answered_in_order(master):
    """Three requests and half of a fourth sent in one go: the loop reads one request at a time, the rest waiting in
    the socket (registered level-triggered: what is left is seen at the next poll, no event is lost), so three
    replies come in order, and the fourth its own once its rest arrives."""
    pool, _ = master
    frames = [exists_frame(n, f"ahead-{n}") for n in (1, 2, 3, 4)]
    half = len(frames[3]) // 2
    with socket.create_connection(("127.0.0.1", pool.master_call_port), timeout=10) as sock:
        sock.sendall(frames[0] + frames[1] + frames[2] + frames[3][:half])
        for n in (1, 2, 3):
            assert call(sock, b"") == [0] * n
        sock.sendall(frames[3][half:])
        assert call(sock, b"") == [0] * 4
        assert call(sock, exists_frame(5)) == [0] * 5  # and the connection goes on


def test_a_client_that_never_reads_its_replies_cannot_grow_the_master(master):
    """128 MiB of pipelined Exists requests (4,096 keys each) whose replies are never read: the master reads
    a request, answers it, and reads the next only once that reply went out, so what it holds for the
    connection is one request and one reply, whatever the client sends."""
    pool, proc = master
    frame = memoryview(exists_frame(4096, "unread"))
    total = 128 * MIB // len(frame) * len(frame)
    before = rss_bytes(proc.pid)
    top = before
    sent = 0
    with socket.socket() as hog:
        hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # its replies back up at once
        hog.connect(("127.0.0.1", pool.master_call_port))
        hog.setblocking(False)
        stalled_since = None
        end = time.monotonic() + 30
        while sent < total and time.monotonic() < end:
            try:
                sent += hog.send(frame[sent % len(frame):])
                stalled_since = None
            except BlockingIOError:  # the kernel's buffers are full: the master is not reading now
                stalled_since = stalled_since or time.monotonic()
                if time.monotonic() - stalled_since > 2.0:
                    break
                time.sleep(0.01)
            top = max(top, rss_bytes(proc.pid))
        with socket.create_connection(("127.0.0.1", pool.master_call_port), timeout=5) as other:
            assert call(other, exists_frame(2)) == [0, 0]  # others are served meanwhile
        top = max(top, rss_bytes(proc.pid))
    assert sent > 16 * MIB  # (the test pushed more than the bound below)
    assert top - before < 16 * MIB, f"the master's RSS grew by {(top - before) / MIB:.0f} MiB"


@pytest.mark.parametrize("stuck", [1, 2])
def test_a_slow_request_does_not_stall_the_loop(stuck):
    """Requests are answered on the loop thread; one stuck in its handler hands the loop to a standby (a second
    stuck one to the next standby), so other connections are still read and answered, and each stuck one is
    answered once its handler returns."""
    import dataclasses

    from kvpool.config import MasterConfig
    from kvpool.master import MasterServer

    release = threading.Event()
    entered = [threading.Event() for _ in range(stuck)]
    slow_keys = {pack_keys([opaque_key(f"slow{i}-0")]): i for i in range(stuck)}
    with MasterServer(MasterConfig.of(port=0, metrics_port=0, call_port=0)) as server:
        handler = server._calls.frames
        real = server.servicer.Exists

        def slow_exists(request, context):
            if request.keys in slow_keys:
                entered[slow_keys[request.keys]].set()
                release.wait(20)
            return real(request, context)

        handler.replace(Method.EXISTS, dataclasses.replace(handler.route(Method.EXISTS), fn=slow_exists))
        port = server.servicer.call_port
        with contextlib.ExitStack() as stack:
            held = [stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=20))
                    for _ in range(stuck)]
            other = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=5))
            try:
                for i, sock in enumerate(held):
                    sock.sendall(exists_frame(1, f"slow{i}"))
                    assert entered[i].wait(10)
                for _ in range(20):  # answered while the slow requests still hold their threads
                    assert call(other, exists_frame(3)) == [0, 0, 0]
                with socket.create_connection(("127.0.0.1", port), timeout=5) as newcomer:
                    assert call(newcomer, exists_frame(1)) == [0]
                # A stuck request's client sends its next request meanwhile: the loop leaves it in the socket
                # (one request at a time) and does not spin on it (its socket is quiet while another thread
                # owns the connection): the process is all but idle for a second.
                held[0].sendall(exists_frame(2, "next"))
                cpu = time.process_time()
                time.sleep(1.0)  # (a window to measure, not a wait for something to happen)
                assert time.process_time() - cpu < 0.3
                assert not release.is_set()
            finally:
                release.set()
            for sock in held:
                head, body = wire.read_reply(sock, None, 1 << 20)
                assert head.code == 0 and list(master_pb2.ExistsResponse.FromString(body).present) == [0]
            assert call(held[0], b"") == [0, 0]  # the request sent meanwhile, answered after the stuck one


def test_lookups_that_arrive_together_share_one_index_pass_and_each_gets_its_own_run(master):
    pool, proc = master
    keys = [opaque_key(f"together-{i}") for i in range(32)]
    grpc_master = DirectMaster(pool.master, pool=None, timeout_s=5.0, max_message_bytes=1 << 20)
    try:
        ref = common_pb2.NodeRef(node_id="n1", address="127.0.0.1:9", host_id="h", arena="a")
        usage = [common_pb2.TierUsage(tier=common_pb2.TIER_DRAM, capacity_bytes=1 << 30)]
        reg = grpc_master.register_node(master_pb2.RegisterNodeRequest(node=ref, tiers=usage,
                                                                       dram_max_block_bytes=1 << 20), 5.0)
        grpc_master.report_blocks(master_pb2.ReportBlocksRequest(
            node_id="n1", incarnation=reg.incarnation, tier=common_pb2.TIER_DRAM, added_keys=pack_keys(keys),
            added_sizes=[4096] * len(keys), added_checksums=list(range(len(keys)))), 5.0)
    finally:
        grpc_master.close()
    frames = [b"".join(wire.request_frame(Method.LOOKUP, master_pb2.LookupRequest(
        keys=pack_keys(keys[:n] + [opaque_key(f"absent-{n}")] + keys[n:])))) for n in range(1, 17)]
    with connections(pool.master_call_port, len(frames)) as socks:
        os.kill(proc.pid, signal.SIGSTOP)  # every request is in the master's socket buffers before it runs again
        try:
            for sock, frame in zip(socks, frames):
                sock.sendall(frame)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        runs = []
        for sock in socks:
            head, body = wire.read_reply(sock, None, 1 << 20)
            assert head.code == 0, body
            reply = master_pb2.LookupResponse.FromString(body)
            runs.append((len(reply.tiers), list(reply.checksums)))
    assert runs == [(n, list(range(n))) for n in range(1, 17)]
    assert metric(scrape(pool.master_metrics_port), "kvpool_master_lookups_together_total") >= 2


def test_the_loops_poll_for_the_next_request_costs_an_idle_or_quiet_master_next_to_nothing(tmp_path):
    """With the longest poll allowed (2 ms), requests 4 ms apart (each poll goes unanswered) and an idle second
    cost the master next to nothing: the poll pauses after it fails (PollPause), where polling every wait would
    spend ~0.6 s of CPU on the 300 requests."""
    pool = PoolProcesses(tmp_path)
    try:
        proc = pool.start_master(**{"call-poll-us": "2000"})
        with socket.create_connection(("127.0.0.1", pool.master_call_port), timeout=5) as sock:
            frame = exists_frame(4)
            assert call(sock, frame) == [0] * 4
            cpu = cpu_seconds(proc.pid)
            for _ in range(300):
                assert call(sock, frame) == [0] * 4
                time.sleep(0.004)  # (the pace of a quiet client, not a wait for something to happen)
            quiet = cpu_seconds(proc.pid) - cpu
            time.sleep(1.0)  # (a window to measure)
            idle = cpu_seconds(proc.pid) - cpu - quiet
            assert call(sock, frame) == [0] * 4
        assert quiet < 0.3, f"{quiet:.2f} s of master CPU for 300 requests 4 ms apart"
        assert idle < 0.1, f"{idle:.2f} s of master CPU idle for a second"
    finally:
        pool.close()
