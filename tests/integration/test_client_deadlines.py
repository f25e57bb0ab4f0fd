"""No client setting stretches a call past its deadline (issue 26): real processes, stopped with SIGSTOP.

A pool call is a miss by its timeout (``lookup_timeout_s`` for the master, ``io_timeout_s`` for a node's
blocks), however the time is spent: the reply spin (``spin_wait_us``), finding the master's fast-call
address, a new connection's AUTH, re-reading the leader from etcd after a failure, read-your-writes waits,
a flush over several nodes, a node's blocks in several calls. Every process stopped here is continued in a
``finally``; every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from support import EtcdServer, PoolProcesses, free_port, kvpool_process, stop_process, wait_until

from kvpool.client.pool import PoolClient
from kvpool.config import MAX_SPIN_WAIT_US, ClientConfig, load_config
from kvpool.etcd import EtcdClient
from kvpool.keys import BlockKey, opaque_key
from kvpool.master_client import leader_address
from kvpool.metrics import error_counts

LOOKUP_S = 1.0  # the clients' lookup_timeout_s
IO_S = 5.0  # their io_timeout_s, unless a test says otherwise: far beyond LOOKUP_S, so borrowing it shows
SLACK_S = 0.5  # scheduling on a loaded 2-core machine; below any second timeout a bug would add
BLOCK = 64 << 10


@contextlib.contextmanager
def stopped(*procs: subprocess.Popen) -> Iterator[None]:
    """SIGSTOP every process for the block, entered once every thread of each is stopped; SIGCONT always follows.

    A SIGSTOP takes effect when one of the process's threads next runs: on a busy machine another thread,
    woken by a request, can still answer it first. So the block starts only once /proc shows them stopped.
    """
    try:
        for p in procs:
            os.kill(p.pid, signal.SIGSTOP)
        for p in procs:
            wait_until(lambda pid=p.pid: all_threads_stopped(pid), timeout=10, interval=0.005)
        yield
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)


def all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (``T``) now."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
        if state not in ("T", "t"):
            return False
    return True


def keys(tag: str, n: int) -> list[BlockKey]:
    return [opaque_key(f"deadline-{tag}-{i}") for i in range(n)]


def values(n: int) -> list[np.ndarray]:
    return [np.full(BLOCK, i + 1, np.uint8) for i in range(n)]


def timeouts(pool: PoolClient) -> float:
    return error_counts(pool.registry).get("timeout", 0)


def answers(pool: PoolClient, ks: list[BlockKey]) -> bool:
    """Whether a lookup now gets the master's answer (no new fault)."""
    before = sum(error_counts(pool.registry).get(kind, 0) for kind in ("timeout", "unavailable"))
    pool.lookup(ks)
    return before == sum(error_counts(pool.registry).get(kind, 0) for kind in ("timeout", "unavailable"))


def timed(fn, *args):
    """(result, wall seconds, CPU seconds of this thread)."""
    wall, cpu = time.monotonic(), time.thread_time()
    result = fn(*args)
    return result, time.monotonic() - wall, time.thread_time() - cpu


def config(procs: PoolProcesses, **over) -> ClientConfig:
    values = {"master": procs.master, "shared_memory": False, "lookup_timeout_s": LOOKUP_S, "io_timeout_s": IO_S}
    return ClientConfig(**{**values, **over})


def test_spin_wait_us_has_an_upper_bound_in_every_way_it_can_be_set():
    assert ClientConfig(spin_wait_us=MAX_SPIN_WAIT_US).spin_wait_us == MAX_SPIN_WAIT_US
    for bad in (MAX_SPIN_WAIT_US + 1, 10**12):
        with pytest.raises(ValueError, match=rf"client\.spin_wait_us: must be 0 to {MAX_SPIN_WAIT_US}.*\(got {bad}\)"):
            ClientConfig(spin_wait_us=bad)
        with pytest.raises(ValueError, match=r"client\.spin_wait_us"):
            load_config(env={"KVPOOL_CLIENT_SPIN_WAIT_US": str(bad)})


@pytest.mark.parametrize("spin_s", [None, 3.0], ids=["largest-allowed-spin", "3s-spin"])
def test_a_lookup_against_a_stopped_master_is_a_miss_by_its_deadline_whatever_the_spin(procs, spin_s):
    """The reply spin ends at the call's deadline and the blocking read gets only what it left. ``3s-spin`` sets
    the connection pool's spin past what the config allows (as an unbounded ``spin_wait_us`` did): a lookup took
    ~4 s and 3 s of CPU."""
    serve = procs.serve()
    ks = keys("spin", 4)
    with PoolClient(config(procs, spin_wait_us=MAX_SPIN_WAIT_US)) as pool:
        if spin_s is not None:
            pool._calls.spin_wait_s = spin_s
        assert pool.store(ks, values(4)) == [True] * 4
        assert pool.flush(10)
        assert len(pool.lookup(ks)) == 4  # the fast-call connection is pooled and its address known
        before = timeouts(pool)
        with stopped(serve):
            run, wall, cpu = timed(pool.lookup, ks)
        assert len(run) == 0 and timeouts(pool) == before + 4  # a miss, counted
        assert wall <= LOOKUP_S + SLACK_S, wall
        # The spin polls (and burns CPU) for at most spin_wait_us, and never past the deadline.
        assert cpu <= (LOOKUP_S + 0.2 if spin_s else 0.05), cpu
        wait_until(lambda: len(pool.lookup(ks)) == 4, timeout=10)  # continued: hits again
    print(f"\nFIGURES stopped master, spin {spin_s or MAX_SPIN_WAIT_US * 1e-6}s: lookup {wall:.2f}s "
          f"(timeout {LOOKUP_S}s), client thread CPU {cpu * 1e3:.1f} ms")


def test_a_new_client_meeting_a_stopped_master_misses_by_its_deadline(procs):
    """The master's fast-call address (its ``Info``) is asked within the call's deadline, not before it: a first
    lookup took lookup_timeout_s twice."""
    serve = procs.serve()
    with stopped(serve), PoolClient(config(procs)) as pool:
        run, wall, _ = timed(pool.lookup, keys("new", 2))
        assert len(run) == 0 and timeouts(pool) == 2
    assert wall <= LOOKUP_S + SLACK_S, wall
    print(f"\nFIGURES new client, stopped master: first lookup {wall:.2f}s (timeout {LOOKUP_S}s)")


def test_a_new_authenticated_connection_to_a_stopped_master_waits_for_the_lookup_deadline_not_io_timeout(
        procs, tmp_path):
    """Two lookups at once need two connections; the second one's AUTH went by io_timeout_s (5 s)."""
    token = secrets.token_hex(32)
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"secret": secrets.token_hex(32), "node_tokens": [secrets.token_hex(32)],
                                "clients": {token: {"tenant": "a"}}}))
    master = procs.start_master(**{"auth-file": str(auth)})
    with PoolClient(config(procs, token=token)) as pool:
        pool.lookup(keys("auth", 1))  # one connection, authenticated, pooled; the call address known
        assert timeouts(pool) == 0
        walls: list[float] = []
        start = threading.Barrier(2)

        def lookup() -> None:
            start.wait(5)
            walls.append(timed(pool.lookup, keys("auth", 1))[1])

        threads = [threading.Thread(target=lookup) for _ in range(2)]
        with stopped(master):
            for t in threads:
                t.start()
            for t in threads:
                t.join(IO_S + 5)
        assert len(walls) == 2 and timeouts(pool) == 2
    assert max(walls) <= LOOKUP_S + SLACK_S, walls
    print(f"\nFIGURES stopped master, a new authenticated connection: lookups {walls[0]:.2f}s, {walls[1]:.2f}s "
          f"(timeout {LOOKUP_S}s, io_timeout_s {IO_S}s)")


def test_following_the_leader_after_a_failed_call_does_not_stretch_it(tmp_path):
    """After a failure the client re-reads the leader key; with etcd stalled too, that read added up to
    lookup_timeout_s to the failed lookup. It runs in the background now, and the client still follows."""
    etcd = EtcdServer(tmp_path)
    cluster = f"deadlines-{secrets.token_hex(4)}"
    master = kvpool_process("master", "--port", str(free_port()), "--metrics-port", str(free_port()),
                            "--call-port", str(free_port()), "--etcd", f"http://{etcd.endpoint}", "--cluster", cluster,
                            "--leader-ttl-s", "3", log_path=tmp_path / "master.log")
    reader = EtcdClient([etcd.endpoint])
    try:
        wait_until(lambda: leader_address(reader, cluster) is not None, timeout=20)
        cfg = ClientConfig(master=f"etcd://{etcd.endpoint}/{cluster}", shared_memory=False,
                           lookup_timeout_s=LOOKUP_S, io_timeout_s=IO_S)
        with PoolClient(cfg) as pool:
            ks = keys("etcd", 1)
            pool.lookup(ks)
            assert timeouts(pool) == 0
            with stopped(master, etcd.proc):
                run, wall, _ = timed(pool.lookup, ks)
                assert len(run) == 0 and timeouts(pool) == 1
            wait_until(lambda: answers(pool, ks), timeout=10)  # continued: the client follows the leader again
    finally:
        reader.close()
        stop_process(master)
        etcd.stop()
    assert wall <= LOOKUP_S + SLACK_S, wall
    print(f"\nFIGURES stopped leader and etcd: lookup {wall:.2f}s (timeout {LOOKUP_S}s)")


def test_a_flush_over_stopped_nodes_returns_false_by_its_timeout(procs):
    """The reports of several nodes share the flush's timeout; the second node's call got a timeout of 0,
    which a socket reads as none at all: the flush never returned."""
    procs.node_flags.update({"dram-bytes": "16M"})
    procs.start_master()
    nodes = [procs.start_node(name) for name in ("n0", "n1")]
    procs.wait_nodes(2)
    ks = keys("flush", 16)
    with PoolClient(config(procs)) as pool:
        assert pool.store(ks, values(16)) == [True] * 16
        assert {loc.node.node_id for loc in pool.lookup(ks)} == {"n0", "n1"}
        done: list[tuple[bool, float]] = []

        def flush() -> None:
            done.append(timed(pool.flush, LOOKUP_S)[:2])

        thread = threading.Thread(target=flush, daemon=True)
        with stopped(*nodes):
            thread.start()
            thread.join(LOOKUP_S + SLACK_S + 5)
            returned = bool(done)
        thread.join(IO_S + 5)  # continued: a hung flush is answered and ends
    assert returned, "flush did not return while both nodes were stopped"
    ok, wall = done[0]
    assert ok is False and wall <= LOOKUP_S + SLACK_S, done
    print(f"\nFIGURES two stopped nodes: flush({LOOKUP_S}) returned False after {wall:.2f}s")


def test_a_lookup_after_a_put_the_stopped_node_never_answered_misses_by_the_lookup_deadline(procs):
    """Read-your-writes waits for this client's piped commits within the lookup's deadline: it waited
    io_timeout_s (5 s) on a stopped node first."""
    serve = procs.serve()
    with PoolClient(config(procs, shared_memory=True)) as pool:
        first, second = keys("piped-1", 1), keys("piped-2", 1)
        assert pool.store(first, values(1)) == [True]  # leases a slot ahead for the next put
        assert pool.flush(10) and pool.shared_path.stocked_slots() >= 1
        with stopped(serve):
            _, put_wall, _ = timed(pool.store, second, values(1))  # a slot at hand: the Commit is piped
            assert pool.shared_path.settle(0.05) is False  # ...and not answered
            _, lookup_wall, _ = timed(pool.lookup, second)
            _, exists_wall, _ = timed(pool.exists, second)
        assert put_wall <= SLACK_S, put_wall
        assert lookup_wall <= LOOKUP_S + SLACK_S and exists_wall <= LOOKUP_S + SLACK_S, (lookup_wall, exists_wall)
        assert pool.flush(10)  # continued: the piped Commit is answered
    print(f"\nFIGURES piped Commit unanswered: lookup {lookup_wall:.2f}s, exists {exists_wall:.2f}s "
          f"(lookup_timeout_s {LOOKUP_S}s, io_timeout_s {IO_S}s)")


def test_a_stopped_node_costs_a_read_in_several_calls_one_io_timeout(procs, monkeypatch):
    """A node's blocks share one io_timeout_s across every call made for them: a read in 4 gRPC calls (no
    bulk listener reachable) of a stopped node took 4 timeouts."""
    monkeypatch.setattr("kvpool.client.grpc_path.GRPC_CHUNK_BYTES", BLOCK)  # one block a call
    serve = procs.serve()
    io_s = 1.0
    ks = keys("chunks", 4)
    with PoolClient(config(procs, io_timeout_s=io_s)) as pool:
        pool.nodes.data_address = lambda address, timeout=None: None  # the bulk listener is out of reach
        assert pool.store(ks, values(4)) == [True] * 4
        assert pool.flush(10)
        run = pool.lookup(ks)
        assert len(run) == 4
        outs = [np.zeros(BLOCK, np.uint8) for _ in ks]
        before = timeouts(pool)
        with stopped(serve):
            ok, wall, _ = timed(pool.get_into, run, outs)
        assert ok == [False] * 4 and timeouts(pool) == before + 4
        assert pool.get_into(run, outs) == [True] * 4  # continued: read in full
    assert wall <= io_s + SLACK_S, wall
    print(f"\nFIGURES stopped node, a read in 4 gRPC calls: {wall:.2f}s (io_timeout_s {io_s}s)")


def test_a_read_waits_for_its_nodes_piped_commits_within_that_nodes_io_timeout(procs):
    """A read's wait for this client's piped commits (read-your-writes) counts against the node's one
    io_timeout_s: it came first, with an io_timeout_s of its own, and then the read's Locate waited another."""
    serve = procs.serve()
    io_s = 1.0
    with PoolClient(config(procs, shared_memory=True, io_timeout_s=io_s)) as pool:
        first, second = keys("rw-1", 1), keys("rw-2", 1)
        assert pool.store(first, values(1)) == [True]  # leases a slot ahead for the next put
        assert pool.flush(10) and pool.shared_path.stocked_slots() >= 1
        run = pool.lookup(first)
        assert len(run) == 1
        pool.shared_path.use_index = False  # every same-host read asks the node's Locate (as an SSD block does)
        out = np.zeros(BLOCK, np.uint8)
        with stopped(serve):
            assert pool.store(second, values(1)) == [True]  # piped, never answered
            ok, wall, _ = timed(pool.get_into, run, [out])
        assert ok == [False]  # the node must answer the Locate: a miss
        assert wall <= io_s + SLACK_S, wall
    print(f"\nFIGURES stopped node, piped Commit unanswered, read by Locate: {wall:.2f}s (io_timeout_s {io_s}s)")
