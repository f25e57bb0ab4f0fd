"""A same-host put in one round trip: placement from the client's cluster view, slots leased ahead, reports off
the put's path (issue 14)."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
from support import wait_until

from kvpool import tcp
from kvpool.calls import FastStub
from kvpool.checksum import copy_with_checksum
from kvpool.client.commit_pipe import CommitPipe, closed_by_peer
from kvpool.client.pool import PoolClient, PoolFault
from kvpool.config import ClientConfig, MasterConfig, NodeConfig
from kvpool.keys import BlockKey, opaque_key, pack_keys
from kvpool.master.server import MasterServer
from kvpool.master_client import MasterConnection
from kvpool.metrics import error_counts
from kvpool.node.daemon import PoolNode
from kvpool.tiers.dram import DramStore
from kvpool.v1 import master_pb2, node_pb2
from kvpool.wire import MASTER_CALLS, NODE_CALLS, Method

SLOT = 4096


def key(i: int) -> BlockKey:
    return opaque_key(f"put-path-{i}")


def block(i: int, size: int = SLOT) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


# -- DramStore: slots leased ahead, leases extended ----------------------------------------------------


@pytest.fixture
def dram(arena_name):
    store = DramStore.create(arena_name, 8 * SLOT, SLOT, high_watermark=1.0, low_watermark=1.0)
    yield store
    store.close()


def test_a_slot_leased_ahead_takes_any_key_once_and_only_its_owner_commits_it(dram):
    res = dram.lease_ahead([SLOT, SLOT], None, owner="a")
    assert res.lease and all(res.gens)
    assert dram.leased_slots == 2
    values = [block(1), block(2)]
    sums = [copy_with_checksum(dram.arena.block(s, SLOT), v) for s, v in zip(res.slots, values)]
    assert dram.commit(res.lease, [key(1), key(2)], res.slots, sums, owner="b") == [False, False]  # not b's
    assert dram.leased_slots == 2
    assert dram.commit(res.lease, [key(1), key(2)], res.slots, sums, owner="a") == [True, True]
    assert dram.leased_slots == 0
    out = np.empty(SLOT, dtype=np.uint8)
    assert dram.get_into([key(2)], [out]) == [True] and np.array_equal(out, values[1])


def test_a_lease_is_extended_only_by_its_owner_while_it_lives(dram):
    ahead = dram.lease_ahead([SLOT], None, owner="a")
    assert dram.reserve([key(1)], [SLOT], None, owner="b", extend=ahead.lease).lease == 0  # another's lease
    assert dram.leased_slots == 1  # nothing reserved for b
    more = dram.reserve([key(1)], [SLOT], None, owner="a", extend=ahead.lease)
    assert more.lease == ahead.lease and more.gens[0]
    values = [block(1), block(2)]
    slots = [more.slots[0], ahead.slots[0]]
    sums = [copy_with_checksum(dram.arena.block(s, SLOT), v) for s, v in zip(slots, values)]
    assert dram.commit(ahead.lease, [key(1), key(2)], slots, sums, owner="a") == [True, True]  # one commit for both
    assert dram.reserve([key(3)], [SLOT], None, owner="a", extend=ahead.lease).lease == 0  # ended with the commit
    assert dram.leased_slots == 0
    lapsed = dram.lease_ahead([SLOT], 0.0, owner="a")
    assert dram.reserve([key(3)], [SLOT], None, owner="a", extend=lapsed.lease).lease == 0  # past its deadline


def test_a_kept_lease_publishes_what_is_named_and_keeps_the_rest_until_its_deadline(dram):
    res = dram.lease_ahead([SLOT] * 4, 60.0, owner="a")
    assert res.lease and all(res.gens)
    good = copy_with_checksum(dram.arena.block(res.slots[0], SLOT), block(1))
    assert dram.commit(res.lease, [key(1), key(2)], [res.slots[0], 10 ** 6], [good, good], owner="a", keep=True) == \
        [True, False]  # the second names no slot of the lease: refused
    assert dram.leased_slots == 3  # slots 2 to 4 are still the lease's
    assert dram.commit(res.lease, [key(3)], res.slots[:1], [good], owner="a", keep=True) == [False]  # used
    third = copy_with_checksum(dram.arena.block(res.slots[2], SLOT), block(3))
    assert dram.commit(res.lease, [key(3)], [res.slots[2]], [third], owner="a", keep=True) == [True]
    assert dram.leased_slots == 2
    assert dram.expire(now=float("inf")) == 2  # a kept lease still lapses at its deadline
    assert dram.keys() == [key(1), key(3)]


def test_keep_does_not_hold_a_lease_under_a_quota_charge(dram):
    class Charge:
        ended = 0

        def keep(self, keys):
            pass

        def end(self):
            Charge.ended += 1

    res = dram.reserve([key(1), key(2)], [SLOT, SLOT], None, owner="t", charge=Charge())
    value = copy_with_checksum(dram.arena.block(res.slots[0], SLOT), block(1))
    assert dram.commit(res.lease, [key(1)], res.slots[:1], [value], owner="t", keep=True) == [True]
    assert dram.leased_slots == 0 and Charge.ended == 1  # ended as without keep: the charge is per key


# -- the client's put path --------------------------------------------------------------------------


@pytest.fixture
def pool_node(tmp_path, arena_name):
    master = MasterServer(MasterConfig.of(port=0, metrics_port=0)).start()
    cfg = NodeConfig.of(master=master.address, host="127.0.0.1", port=0, metrics_port=0, data_port=0, arena=arena_name,
                     dram_bytes=16 << 20, max_block_bytes=1 << 20, ssd_enabled=False, ssd_dir=str(tmp_path / "ssd"))
    try:
        with PoolNode(cfg) as n:
            wait_until(lambda: n.link.registered)
            yield master, n
    finally:
        master.stop()


class CallLog:
    """Every fast-call-capable method a client calls on its nodes (through FastStub.call, either transport) and
    on its master (the node's own link to the master, in this process too, is left out), every Commit it pipes,
    and how many of those leased a new stock (``next_sizes``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, pool: PoolClient):
        self.names: list[str] = []
        self.stocks_asked = 0
        call, master_call, send = FastStub.call, MasterConnection.call, CommitPipe.send

        def logged(stub, name, request, timeout=None):
            if name in NODE_CALLS:
                self.names.append(name)
            return call(stub, name, request, timeout)

        def master_logged(master, name, request, timeout):
            if master is pool.master and name in MASTER_CALLS:
                self.names.append(name)
            return master_call(master, name, request, timeout)

        def piped(pipe, request, done, deadline=None):
            self.names.append("Commit")
            self.stocks_asked += bool(request.next_sizes)
            return send(pipe, request, done, deadline)

        monkeypatch.setattr(FastStub, "call", logged)
        monkeypatch.setattr(MasterConnection, "call", master_logged)
        monkeypatch.setattr(CommitPipe, "send", piped)


def test_a_same_host_put_is_one_commit_and_no_master_call(pool_node, monkeypatch):
    master, n = pool_node
    with PoolClient(ClientConfig(master=master.address, strict=True)) as pool:
        assert pool.store([key(0)], [block(0)]) == [True]  # warm-up: the view, the first lease
        calls = CallLog(monkeypatch, pool)
        for i in range(1, 6):
            assert pool.store([key(i)], [block(i)]) == [True]
        assert calls.names == ["Commit"] * 5  # no PlaceBlocks, no Reserve: slots were leased ahead
        assert calls.stocks_asked == 0  # one stock (16 slots here) serves them all, each Commit keeping the rest
        assert pool.flush()
        assert calls.names[5:] == ["FlushReports"]
        present = master.servicer.Exists(master_pb2.ExistsRequest(keys=pack_keys([key(i) for i in range(6)])), None)
        assert present.present == b"\x01" * 6  # in the master's index once flush returned
        outs = [np.empty(SLOT, dtype=np.uint8) for _ in range(6)]
        assert pool.get_into(pool.lookup([key(i) for i in range(6)]), outs) == [True] * 6
        assert all(np.array_equal(o, block(i)) for i, o in enumerate(outs))
    assert n.store.dram.leased_slots == 0  # close handed the stock back


def test_a_put_whose_stock_lapsed_is_a_counted_lost_write_and_the_next_put_gets_fresh_slots(pool_node):
    """A stock is used only within half its lease's timeout, so only a node that ends leases early (here: the
    reaper run with the clock at infinity) refuses one: the blocks are lost writes, the stock is dropped."""
    master, n = pool_node
    with PoolClient(ClientConfig(master=master.address)) as pool:
        assert pool.store([key(0)], [block(0)]) == [True]
        assert pool.flush()
        stocked = pool.shared_path.stocked_slots()
        assert stocked > 2 and n.store.dram.leased_slots == stocked  # the stock the first Commit leased
        assert n.store.dram.expire(now=float("inf")) == stocked  # the node reaped its lease under the client
        assert pool.store([key(1), key(2)], [block(1), block(2)]) == [True, True]  # piped: refused later
        pool.flush()
        assert error_counts(pool.registry).get("put_refused") == 2
        assert pool.shared_path.stocked_slots() == 0  # dropped with the refusal, not used for more lost writes
        assert pool.lookup([key(1)]).keys == []  # a miss, never an error
        assert pool.store([key(1), key(2)], [block(1), block(2)]) == [True, True]
        assert pool.flush()
        outs = [np.empty(SLOT, dtype=np.uint8) for _ in range(2)]
        assert pool.get_into(pool.lookup([key(1), key(2)]), outs) == [True, True]
        assert np.array_equal(outs[1], block(2))


def test_a_put_of_other_sizes_takes_what_the_stock_has_and_reserves_the_rest(pool_node, monkeypatch):
    master, n = pool_node
    with PoolClient(ClientConfig(master=master.address, strict=True)) as pool:
        assert pool.store([key(0)], [block(0)]) == [True]
        assert pool.flush()  # a stock of SLOT-sized slots on the shelf
        stocked = pool.shared_path.stocked_slots()
        calls = CallLog(monkeypatch, pool)
        values = [block(1), block(2, 3 * SLOT)]  # one size in stock, one not
        assert pool.store([key(1), key(2)], values) == [True, True]
        assert calls.names == ["Reserve", "Commit", "Commit"]  # a lease for the other size; one Commit per lease
        assert pool.flush()
        assert n.store.dram.leased_slots == pool.shared_path.stocked_slots() == stocked - 1  # the rest kept
        outs = [np.empty_like(v) for v in values]
        assert pool.get_into(pool.lookup([key(1), key(2)]), outs) == [True, True]
        assert all(np.array_equal(o, v) for o, v in zip(outs, values))


def test_a_two_step_put_fills_leased_slots_once_and_the_writer_only_commits_them(pool_node, monkeypatch):
    """prepare_put hands out slots leased ahead (no call), the engine gathers its pieces straight into them,
    complete_put queues handles: the writer's only call is the Commit, and the blocks read back intact."""
    master, n = pool_node
    with PoolClient(ClientConfig(master=master.address, strict=True)) as pool:
        assert pool.put([key(0)], [block(0)]) == [True] and pool.flush()  # warm-up: the view, the first stock
        calls = CallLog(monkeypatch, pool)
        values = [block(i) for i in range(1, 4)]
        prepared = pool.prepare_put([key(i) for i in range(1, 4)], [SLOT] * 3)
        assert calls.names == [] and prepared.in_slots == 3  # slots from the stock, no round trip
        for i, v in enumerate(values):
            halves = v.reshape(2, -1)
            prepared.fill(i, [halves[0], halves[1][::-1][::-1]])  # pieces of any strides, in order
        assert n.store.dram.locate([key(1)]) == [None]  # filled, not published
        assert pool.complete_put(prepared) == [True] * 3 and pool.flush()
        assert calls.names == ["Commit", "FlushReports"]
        outs = [np.empty(SLOT, dtype=np.uint8) for _ in values]
        assert pool.get_into(pool.lookup([key(i) for i in range(1, 4)]), outs) == [True] * 3
        assert all(np.array_equal(o, v) for o, v in zip(outs, values))


def test_a_two_step_put_reserves_what_the_stock_lacks_and_put_never_does(pool_node, monkeypatch):
    master, n = pool_node
    with PoolClient(ClientConfig(master=master.address, strict=True)) as pool:
        pool.cluster.refresh()
        calls = CallLog(monkeypatch, pool)
        scratch = pool.prepare_put([key(1)], [SLOT], reserve=False)  # no stock yet, and no call allowed
        assert calls.names == [] and scratch.in_slots == 0
        prepared = pool.prepare_put([key(i) for i in range(2, 6)], [SLOT] * 4)
        assert calls.names == ["Reserve"] and prepared.in_slots == 4  # one Reserve for the blocks, then filled
        for i in range(4):
            prepared.fill(i, [block(i + 2)])
        assert pool.complete_put(prepared) == [True] * 4 and pool.flush()
        assert calls.names[1:] == ["Commit", "FlushReports"]
        outs = [np.empty(SLOT, dtype=np.uint8) for _ in range(4)]
        assert pool.get_into(pool.lookup([key(i) for i in range(2, 6)]), outs) == [True] * 4
        assert all(np.array_equal(o, block(i + 2)) for i, o in enumerate(outs))


def test_bytes_scribbled_into_a_committed_slot_are_a_miss_on_every_read_path(pool_node):
    """The node publishes a commit without hashing it again: what keeps a bad writer (one scribbling through its
    writable mapping of the arena, before or after its Commit) from making anyone read wrong bytes is that every
    reader hashes what it copied, same host and network alike."""
    master, n = pool_node
    with PoolClient(ClientConfig(master=master.address)) as writer:
        assert writer.put([key(1), key(2)], [block(1), block(2)]) == [True, True] and writer.flush()
        ref = n.store.dram.locate([key(1)])[0]
        assert ref is not None
        n.store.dram.arena.data[ref.offset + 100] ^= 0xFF  # the writer's bug, after its Commit
    for shared_memory in (True, False):
        with PoolClient(ClientConfig(master=master.address, shared_memory=shared_memory)) as reader:
            outs = [np.zeros(SLOT, dtype=np.uint8) for _ in range(2)]
            run = reader.lookup([key(1), key(2)])
            assert len(run) == 2 and reader.get_into(run, outs) == [False, True]
            assert np.array_equal(outs[1], block(2))


def test_put_copies_once_so_the_caller_may_reuse_its_buffer_and_scratch_blocks_still_arrive(pool_node):
    master, n = pool_node
    with PoolClient(ClientConfig(master=master.address, strict=True)) as pool:
        buf = block(5).copy()
        assert pool.put([key(5)], [buf]) == [True]  # no stock yet: host scratch, stored by the writer
        buf[:] = 0  # the engine reuses its buffer at once
        assert pool.flush()
        stocked = pool.shared_path.stocked_slots()
        assert stocked > 0
        buf[:] = block(6)
        assert pool.put([key(6)], [buf]) == [True]  # into a leased slot now
        buf[:] = 0
        assert pool.flush() and pool.shared_path.stocked_slots() == stocked - 1
        outs = [np.empty(SLOT, dtype=np.uint8) for _ in range(2)]
        assert pool.get_into(pool.lookup([key(5), key(6)]), outs) == [True, True]
        assert np.array_equal(outs[0], block(5)) and np.array_equal(outs[1], block(6))


def test_prepare_and_complete_refuse_bad_input(pool_node):
    master, _ = pool_node
    with PoolClient(ClientConfig(master=master.address)) as pool:
        with pytest.raises(ValueError, match="empty"):
            pool.prepare_put([key(1)], [0])
        with pytest.raises(ValueError, match="sizes"):
            pool.prepare_put([key(1)], [SLOT, SLOT])
        prepared = pool.prepare_put([key(1), key(2)], [SLOT, SLOT])
        with pytest.raises(ValueError, match="bytes"):
            prepared.fill(0, [block(1)[:10]])
        prepared.fill(0, [block(1)])
        with pytest.raises(ValueError, match="never filled"):
            pool.complete_put(prepared)
        assert pool.flush() and pool.lookup([key(1)]).keys == []  # nothing was queued


def test_the_client_places_as_the_master_would(tmp_path, arena_name):
    master = MasterServer(MasterConfig.of(port=0, metrics_port=0)).start()
    nodes = []
    try:
        for i in range(3):
            cfg = NodeConfig.of(master=master.address, host="127.0.0.1", port=0, metrics_port=0, data_port=0,
                             arena=f"{arena_name}-{i}", node_id=f"n{i}", dram_bytes=(8 + 4 * i) << 20,
                             max_block_bytes=1 << 20, ssd_enabled=False, ssd_dir=str(tmp_path / f"ssd{i}"))
            nodes.append(PoolNode(cfg).start())
        with PoolClient(ClientConfig(master=master.address)) as pool:
            wait_until(lambda: pool.cluster.refresh() and len(pool.cluster.nodes()) == 3)
            keys = [key(i) for i in range(300)]
            sizes = [SLOT * (1 + i % 5) for i in range(300)]
            mine = pool.cluster.place(keys, sizes)
            theirs = master.servicer.PlaceBlocks(master_pb2.PlaceBlocksRequest(keys=pack_keys(keys), sizes=sizes),
                                                 None)
            assert [mine.nodes[j].node_id for j in mine.node_indexes] == \
                [theirs.nodes[j].node_id for j in theirs.node_indexes]
            assert len(set(mine.node_indexes)) == 3  # every node gets some
    finally:
        for n in nodes:
            n.stop()
        master.stop()


# -- commits sent without waiting (client/commit_pipe.py) ----------------------------------------------


def hold_commits(node: PoolNode):
    """Make the node's wire Commit handler wait for ``release`` (``entered`` once one arrived); restore with
    the returned function."""
    entered, release = threading.Event(), threading.Event()
    handler = node.bulk.handler
    route = handler.route(Method.COMMIT)
    assert route is not None

    def held(request, context):
        entered.set()
        assert release.wait(30), "test: commit never released"
        return route.fn(request, context)

    handler.replace(Method.COMMIT, dataclasses.replace(route, fn=held))
    return entered, release, lambda: handler.replace(Method.COMMIT, route)


def test_a_store_returns_before_the_node_answers_and_the_next_lookup_waits_for_it(pool_node):
    master, n = pool_node
    # The lookup waits for the Commit's answer within its own deadline (lookup_timeout_s, longer than the hold
    # below; tests/integration/test_client_deadlines.py shows it ends by that deadline when the answer never comes).
    with PoolClient(ClientConfig(master=master.address, strict=True, lookup_timeout_s=10.0)) as pool:
        assert pool.store([key(0)], [block(0)]) == [True]
        assert pool.flush()
        entered, release, restore = hold_commits(n)
        try:
            assert pool.store([key(1)], [block(1)]) == [True]  # returned with the node's Commit handler held
            assert entered.wait(10) and n.store.dram.locate([key(1)]) == [None]  # not published yet
            found: list[int] = []
            reader = threading.Thread(target=lambda: found.append(len(pool.lookup([key(1)]))))
            reader.start()
            reader.join(0.5)
            assert reader.is_alive() and not found  # read-your-writes: it waits for the Commit's answer
            release.set()
            reader.join(10)
            assert found == [1]
        finally:
            release.set()
            restore()
        out = np.empty(SLOT, dtype=np.uint8)
        assert pool.get_into(pool.lookup([key(1)]), [out]) == [True] and np.array_equal(out, block(1))


def test_a_commit_the_node_refuses_after_the_store_returned_is_a_lost_write_raised_next_in_strict_mode(pool_node):
    master, n = pool_node
    with PoolClient(ClientConfig(master=master.address, strict=True)) as pool:
        assert pool.store([key(0)], [block(0)]) == [True]
        assert pool.flush()
        handler = n.bulk.handler
        route = handler.route(Method.COMMIT)
        assert route is not None

        def refuse(request, context):  # as a node does for bytes that do not match their checksums
            return node_pb2.CommitResponse(stored=bytes(len(request.slots)))

        handler.replace(Method.COMMIT, dataclasses.replace(route, fn=refuse))
        try:
            assert pool.store([key(1)], [block(1)]) == [True]
            with pytest.raises(PoolFault) as raised:
                pool.flush()
            assert raised.value.kind == "put_refused"
        finally:
            handler.replace(Method.COMMIT, route)
        assert error_counts(pool.registry).get("put_refused") == 1
        assert pool.lookup([key(1)]).keys == []  # never published: a miss, not an error
        assert pool.store([key(1)], [block(1)]) == [True] and pool.flush()  # the next Commit goes through
        assert len(pool.lookup([key(1)])) == 1


def test_commits_in_flight_when_the_node_dies_are_counted_lost_never_raised(pool_node):
    master, n = pool_node
    with PoolClient(ClientConfig(master=master.address)) as pool:  # not strict: what an engine runs
        assert pool.store([key(0)], [block(0)]) == [True]
        assert pool.flush()
        entered, release, restore = hold_commits(n)
        try:
            assert pool.store([key(1)], [block(1)]) == [True]
            assert entered.wait(10)
            n.bulk.stop()  # the wire listener goes, cutting the connection the Commit came on
            release.set()
            assert pool.shared_path.settle(10)  # every piped Commit answered or failed
        finally:
            release.set()
            restore()
        counts = error_counts(pool.registry)
        assert counts.get("unavailable", 0) + counts.get("timeout", 0) >= 1
        assert pool.store([key(2)], [block(2)]) in ([True], [False])  # a fault is a miss or a False, never raised


def test_a_pipe_connection_the_node_closed_while_idle_is_replaced_before_a_commit_is_lost_on_it(pool_node,
                                                                                                  monkeypatch):
    """A node closes a connection idle for IDLE_TIMEOUT_S; a Commit written on it then would get no answer."""
    master, n = pool_node
    with PoolClient(ClientConfig(master=master.address, strict=True)) as pool:
        assert pool.store([key(0)], [block(0)]) == [True]
        assert pool.flush()
        link = pool.shared_path._pipes[n.node_ref.address]._link
        assert link is not None
        monkeypatch.setattr(tcp, "IDLE_TIMEOUT_S", 0.2)  # read by the node's listener at each request's end
        assert pool.store([key(1)], [block(1)]) == [True]  # the connection's idle deadline is now 0.2 s away
        assert pool.flush()
        link = pool.shared_path._pipes[n.node_ref.address]._link
        assert link is not None
        wait_until(lambda: closed_by_peer(link.sock))  # the node's watchdog cut it
        assert pool.store([key(2)], [block(2)]) == [True]
        assert pool.flush()  # strict: a commit lost on the dead connection would raise here
        assert len(pool.lookup([key(2)])) == 1
        assert pool.shared_path._pipes[n.node_ref.address]._link is not link  # a fresh connection took it
