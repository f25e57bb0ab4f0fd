"""Same-host writes through leased arena slots: DramStore.reserve/commit, the node's Reserve/Commit and reaper."""

from __future__ import annotations

import importlib.util
import time

import grpc
import numpy as np
import pytest
from support import free_port, wait_until

from kvpool.checksum import block_checksum, copy_with_checksum
from kvpool.config import NodeConfig
from kvpool.keys import BlockKey, opaque_key, pack_keys
from kvpool.node.daemon import PoolNode
from kvpool.rpc import channel_options
from kvpool.tiers.arena import SharedArena
from kvpool.tiers.dram import DramStore
from kvpool.v1 import node_pb2, node_pb2_grpc
from kvpool.vocabulary import NO_TIER, Tier

SLOT = 4096
HAVE_MASTER = importlib.util.find_spec("kvpool.master.server") is not None


def key(i: int) -> BlockKey:
    return opaque_key(f"lease-test-{i}")


def block(i: int, size: int = SLOT) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


class Changes:
    def __init__(self) -> None:
        self.added: list[BlockKey] = []
        self.removed: list[BlockKey] = []

    def __call__(self, added, removed) -> None:
        self.added += [m.key for m in added]
        self.removed += list(removed)


@pytest.fixture
def dram(arena_name):
    changes = Changes()
    store = DramStore.create(arena_name, 4 * SLOT, SLOT, high_watermark=1.0, low_watermark=1.0, on_change=changes)
    store.changes = changes
    yield store
    store.close()


def write(store: DramStore, slot: int, value: np.ndarray) -> int:
    return copy_with_checksum(store.arena.block(slot, value.size), value)


# -- DramStore ---------------------------------------------------------------------------------------


def test_reserved_slots_are_unreadable_until_committed_then_hold_exactly_the_bytes(dram):
    values = [block(1), block(2, 100)]
    res = dram.reserve([key(1), key(2)], [SLOT, 100], timeout_s=5.0)
    assert res.lease and res.held == [False, False]
    assert all(g % 2 == 1 for g in res.gens) and len(set(res.slots)) == 2
    assert dram.leased_slots == 2
    assert dram.contains([key(1), key(2)]) == [False, False] and dram.locate([key(1)]) == [None]
    sums = [write(dram, s, v) for s, v in zip(res.slots, values)]
    assert dram.changes.added == []
    assert dram.commit(res.lease, [key(1), key(2)], res.slots, sums) == [True, True]
    assert dram.leased_slots == 0 and dram.changes.added == [key(1), key(2)]
    outs = [np.empty_like(v) for v in values]
    assert dram.get_into([key(1), key(2)], outs) == [True, True]
    assert all(np.array_equal(o, v) for o, v in zip(outs, values))
    assert dram.commit(res.lease, [key(1)], res.slots[:1], sums[:1]) == [False]  # a lease commits once


def test_a_commit_whose_bytes_do_not_match_the_checksum_is_published_but_never_read(dram):
    """The node does not hash a commit again (the writer hashed it while copying): a block whose bytes do not
    match its checksum is published, and every read of it is a miss, never those bytes."""
    res = dram.reserve([key(1), key(2)], [SLOT, SLOT], timeout_s=5.0)
    good = write(dram, res.slots[0], block(1))
    bad = write(dram, res.slots[1], block(2)) ^ 1
    assert dram.commit(res.lease, [key(1), key(2)], res.slots, [good, bad]) == [True, True]
    assert dram.leased_slots == 0
    outs = [np.zeros(SLOT, dtype=np.uint8) for _ in range(2)]
    assert dram.get_into([key(1), key(2)], outs) == [True, False]
    assert np.array_equal(outs[0], block(1))
    scribbled = dram.arena.block(res.slots[0], SLOT)  # a writer scribbling after its commit: a miss too
    scribbled[0] ^= 0xFF
    assert dram.get_into([key(1)], outs[:1]) == [False]


def test_slots_the_commit_does_not_name_or_names_wrongly_are_released(dram):
    res = dram.reserve([key(1), key(2), key(3)], [SLOT] * 3, timeout_s=5.0)
    sums = [write(dram, s, block(i + 1)) for i, s in enumerate(res.slots)]
    # key 2 claims key 1's slot: not the lease's slot for that key
    assert dram.commit(res.lease, [key(1), key(2)], [res.slots[0], res.slots[0]], sums[:2]) == [True, False]
    assert dram.contains([key(1), key(2), key(3)]) == [True, False, False]
    assert dram.leased_slots == 0


def test_held_keys_repeats_and_no_room(dram):
    dram.put([key(1)], [block(1)])
    res = dram.reserve([key(1), key(2), key(2), key(3), key(4), key(5)], [SLOT] * 6, timeout_s=5.0)
    assert res.held == [True, False, False, False, False, False]
    assert res.gens[0] == 0 and res.gens[2] == 0  # held; a repeat
    # 4 slots: key 1 holds one; 2, 3, 4 get the others by evicting nothing ... and 5 evicts key 1 (LRU)
    assert [g != 0 for g in res.gens] == [False, True, False, True, True, True]
    assert dram.contains([key(1)]) == [False] and dram.changes.removed == [key(1)]
    more = dram.reserve([key(6)], [SLOT], timeout_s=5.0)  # every slot is leased: no room, no victim
    assert more.lease == 0 and more.gens == [0]
    assert dram.put([key(7)], [block(7)]) == [False]
    with pytest.raises(ValueError):
        dram.reserve([key(8)], [SLOT + 1], timeout_s=5.0)
    with pytest.raises(ValueError):
        dram.reserve([key(8)], [0], timeout_s=5.0)


def test_expired_leases_give_their_slots_back_and_a_late_commit_stores_nothing(dram):
    res = dram.reserve([key(i) for i in range(4)], [SLOT] * 4, timeout_s=0.001)
    sums = [write(dram, s, block(i)) for i, s in enumerate(res.slots)]
    assert dram.put([key(9)], [block(9)]) == [False]  # all four slots are leased
    assert dram.expire(now=time.monotonic() + 1.0) == 4  # a second later: past its deadline
    assert dram.leased_slots == 0
    assert dram.put([key(i) for i in range(10, 14)], [block(i) for i in range(10, 14)]) == [True] * 4
    assert dram.commit(res.lease, [key(i) for i in range(4)], res.slots, sums) == [False] * 4
    assert dram.contains([key(i) for i in range(4)]) == [False] * 4
    out = np.empty(SLOT, np.uint8)
    assert dram.get_into([key(10)], [out]) == [True] and np.array_equal(out, block(10))


def test_a_commit_after_the_deadline_but_before_the_reaper_stores_nothing(dram):
    res = dram.reserve([key(1)], [SLOT], timeout_s=0.0)
    sums = [write(dram, res.slots[0], block(1))]
    assert dram.commit(res.lease, [key(1)], res.slots, sums) == [False]
    assert dram.leased_slots == 0 and dram.contains([key(1)]) == [False]


def test_reserve_demotes_lru_blocks_like_put(arena_name):
    demoted: list[BlockKey] = []
    store = DramStore.create(arena_name, 4 * SLOT, SLOT, high_watermark=1.0, low_watermark=0.5,
                             on_evict=lambda keys, views, sums: demoted.extend(keys))
    try:
        store.put([key(i) for i in range(4)], [block(i) for i in range(4)])
        res = store.reserve([key(9)], [SLOT], timeout_s=5.0)
        assert res.gens[0] != 0
        assert demoted == [key(0), key(1), key(2)]  # LRU first, down to the low watermark counting the new one
        assert store.release(res.lease) == 1 and store.leased_slots == 0
    finally:
        store.close()


def test_a_committed_lease_reaches_ssd_too_with_write_through(tmp_path, arena_name):
    from kvpool.tiers.node_store import NodeStore
    from kvpool.tiers.ssd import SsdStore

    store = NodeStore(DramStore.create(arena_name, 4 * SLOT, SLOT), SsdStore(str(tmp_path / "ssd"), 1 << 20),
                        write_through=True)
    try:
        res = store.dram.reserve([key(1)], [SLOT], timeout_s=5.0)
        sums = [write(store.dram, res.slots[0], block(1))]
        assert store.commit(res.lease, [key(1)], res.slots, sums) == [True]
        out = np.empty(SLOT, np.uint8)
        assert store.ssd.get_into([key(1)], [out]) == [True] and np.array_equal(out, block(1))
    finally:
        store.close()


def test_a_late_writer_sees_its_slot_was_handed_on(dram):
    res = dram.reserve([key(1)], [SLOT], timeout_s=0.0)
    assert dram.expire(now=time.monotonic() + 1.0) == 1
    again = dram.reserve([key(2)], [SLOT], timeout_s=5.0)
    assert again.slots == res.slots and again.gens[0] != res.gens[0]  # same slot, another writer's turn
    assert int(dram.arena.gens[res.slots[0]]) != res.gens[0]


def test_lease_ids_are_random_never_0_and_never_a_live_leases_id(dram, monkeypatch):
    import kvpool.tiers.dram as dram_module

    drawn = iter([0, 7, 7, 0, 9, 7])
    monkeypatch.setattr(dram_module.secrets, "randbits", lambda bits: next(drawn) if bits == 63 else pytest.fail())
    first = dram.reserve([key(1)], [SLOT], timeout_s=5.0)
    second = dram.reserve([key(2)], [SLOT], timeout_s=5.0)
    assert (first.lease, second.lease) == (7, 9)  # 0 and the live 7 were drawn again
    assert dram.release(first.lease) == 1
    assert dram.reserve([key(3)], [SLOT], timeout_s=5.0).lease == 7  # no longer live: may come again
    monkeypatch.undo()
    assert 0 < dram.reserve([key(4)], [SLOT], timeout_s=5.0).lease < 1 << 63


def test_a_commit_or_release_by_anyone_but_the_owner_changes_nothing(dram):
    res = dram.reserve([key(1), key(2)], [SLOT, SLOT], timeout_s=5.0, owner="a")
    sums = [write(dram, s, block(i + 1)) for i, s in enumerate(res.slots)]
    for intruder in ("b", None):
        assert dram.commit(res.lease, [key(1), key(2)], res.slots, sums, owner=intruder) == [False, False]
        assert dram.commit(res.lease, [], [], [], owner=intruder) == []
        assert dram.release(res.lease, owner=intruder) == 0
    assert dram.leased_slots == 2 and dram.contains([key(1), key(2)]) == [False, False] and dram.changes.added == []
    assert dram.commit(res.lease, [key(1), key(2)], res.slots, sums, owner="a") == [True, True]  # still the owner's
    assert dram.leased_slots == 0
    assert dram.commit(res.lease, [key(1)], res.slots[:1], sums[:1], owner="a") == [False]  # a lease commits once


def quota_ledger(store: DramStore, quota: int):
    from kvpool.node.quota import QuotaLedger

    ledger = QuotaLedger({"t": quota}, lambda k: "t", held=store.contains, evict=store.remove)
    store.on_change = ledger.listener(store.on_change)
    return ledger


def test_a_leases_quota_charge_lasts_exactly_as_long_as_the_lease(dram):
    ledger = quota_ledger(dram, 8 * SLOT)
    other = dram.reserve([key(0)], [SLOT], timeout_s=5.0, owner="x")  # one slot leased elsewhere, uncharged
    charge = ledger.reserve("t", [key(1), key(2), key(3), key(4)], [SLOT] * 4)
    assert charge.admitted == [True] * 4 and ledger.reserved("t") == 4 * SLOT  # charged before any slot is taken
    res = dram.reserve([key(1), key(2), key(3), key(4)], [SLOT] * 4, timeout_s=5.0, owner="t", charge=charge)
    assert [g != 0 for g in res.gens] == [True, True, True, False]  # three slots were left
    assert ledger.reserved("t") == 3 * SLOT  # narrowed to the blocks that got one
    sums = [write(dram, s, block(i + 1)) for i, s in enumerate(res.slots[:3])]
    assert dram.commit(res.lease, [key(1)], res.slots[:1], sums[:1], owner="u") == [False]
    assert ledger.reserved("t") == 3 * SLOT  # not its owner: the lease and its charge live on
    assert dram.commit(res.lease, [key(1), key(2)], res.slots[:2], sums[:2], owner="t") == [True, True]
    assert (ledger.used("t"), ledger.reserved("t")) == (2 * SLOT, 0)  # committed: held now; the rest freed
    assert dram.release(other.lease, owner="x") == 1

    # Release and expiry end the charge too; a reservation that got no slot ends it at once.
    for end in ("release", "expire", "no slot"):
        if end == "no slot":  # every slot leased elsewhere, no block to evict
            dram.remove([key(1), key(2)])
            assert all(dram.reserve([key(20 + i) for i in range(4)], [SLOT] * 4, timeout_s=5.0, owner="x").gens)
        charge = ledger.reserve("t", [key(9)], [SLOT])
        res = dram.reserve([key(9)], [SLOT], timeout_s=5.0, owner="t", charge=charge)
        assert ledger.reserved("t") == (0 if end == "no slot" else SLOT)
        if end == "release":
            assert dram.release(res.lease, owner="t") == 1
        elif end == "expire":
            assert dram.expire(now=time.monotonic() + 10.0) == 1
        assert ledger.reserved("t") == 0
        charge.end()  # idempotent
        charge.keep([key(9)])  # and a charge never grows back
        assert ledger.reserved("t") == 0
    charge = ledger.reserve("t", [key(9)], [SLOT])
    with pytest.raises(ValueError):
        dram.reserve([key(9)], [SLOT + 1], timeout_s=5.0, owner="t", charge=charge)
    assert ledger.reserved("t") == 0  # a refused reservation leaves no charge behind


def test_reservations_count_against_the_quota_and_are_never_evicted_to_make_room(dram):
    ledger = quota_ledger(dram, 3 * SLOT)
    assert dram.put([key(1)], [block(1)]) == [True] and ledger.used("t") == SLOT
    first = ledger.reserve("t", [key(2), key(3)], [SLOT, SLOT])
    assert first.admitted == [True, True] and ledger.reserved("t") == 2 * SLOT  # held 1 + reserved 2 = quota
    # More reservations, and puts, get only what their own held blocks can make room for: never a reservation.
    second = ledger.reserve("t", [key(4), key(5)], [SLOT, SLOT])
    assert second.admitted == [True, False] and dram.contains([key(1)]) == [False]  # its held block made room
    assert (ledger.used("t"), ledger.reserved("t")) == (0, 3 * SLOT)
    assert ledger.admit("t", [key(6)], [SLOT]) == [False]
    assert ledger.reserve("t", [key(7)], [SLOT]).admitted == [False] and ledger.reserved("t") == 3 * SLOT
    first.end()
    assert ledger.reserved("t") == SLOT and ledger.admit("t", [key(6), key(7)], [SLOT, SLOT]) == [True, True]
    second.end()
    assert ledger.reserved("t") == 0


# -- the node: Reserve, Commit, the reaper ----------------------------------------------------------

NODE_SLOT = 64 << 10
NODE_SLOTS = 4


@pytest.fixture
def node(tmp_path, arena_name):
    cfg = NodeConfig.of(master=f"127.0.0.1:{free_port()}", host="127.0.0.1", port=0, metrics_port=0, data_port=0,
                     arena=arena_name, dram_bytes=NODE_SLOTS * NODE_SLOT, max_block_bytes=NODE_SLOT,
                     high_watermark=1.0, low_watermark=1.0, ssd_enabled=False, ssd_dir=str(tmp_path / "ssd"),
                     lease_timeout_s=0.3)
    n = PoolNode(cfg).start()
    yield n
    n.stop()


@pytest.fixture
def stub(node):
    channel = grpc.insecure_channel(node.address, options=channel_options(16 << 20))
    yield node_pb2_grpc.NodeStub(channel)
    channel.close()


def put(stub, ids: list[int]) -> list[int]:
    values = [block(i, NODE_SLOT).tobytes() for i in ids]
    return list(stub.Put(node_pb2.PutRequest(keys=pack_keys([key(i) for i in ids]), sizes=[NODE_SLOT] * len(ids),
                                             data=b"".join(values)), timeout=10).stored)


def test_node_reserve_write_commit_through_the_mapped_arena(node, stub):
    put(stub, [1])
    ids = [1, 2, 3]
    reply = stub.Reserve(node_pb2.ReserveRequest(keys=pack_keys([key(i) for i in ids]),
                                                 sizes=[NODE_SLOT, NODE_SLOT, 8 * NODE_SLOT]), timeout=10)
    assert reply.arena == node.node_ref.arena and reply.lease_timeout_s == pytest.approx(0.3)
    assert list(reply.already_held) == [1, 0, 0]
    assert reply.slot_gens[0] == 0 and reply.slot_gens[1] % 2 == 1 and reply.slot_gens[2] == 0  # 3: larger than a slot
    arena = SharedArena.attach(reply.arena)
    try:
        assert int(arena.gens[reply.slots[1]]) == reply.slot_gens[1]
        checksum = copy_with_checksum(arena.block(reply.slots[1], NODE_SLOT), block(2, NODE_SLOT))
    finally:
        arena.close()
    done = stub.Commit(node_pb2.CommitRequest(lease=reply.lease, keys=pack_keys([key(2)]), slots=[reply.slots[1]],
                                              checksums=[checksum]), timeout=10)
    assert list(done.stored) == [1]
    got = stub.Get(node_pb2.GetRequest(keys=pack_keys([key(2)])), timeout=10)
    assert list(got.tiers) == [Tier.DRAM] and got.data == block(2, NODE_SLOT).tobytes()
    assert got.checksums[0] == checksum == block_checksum(block(2, NODE_SLOT))


def test_a_block_committed_with_a_wrong_checksum_is_never_served(node, stub):
    """The node publishes a commit without hashing it again; its Get verifies what it sends, so the block is a
    miss over the network too (and the same-host readers verify their own copies)."""
    reply = stub.Reserve(node_pb2.ReserveRequest(keys=pack_keys([key(1)]), sizes=[NODE_SLOT]), timeout=10)
    arena = SharedArena.attach(reply.arena)
    try:
        checksum = copy_with_checksum(arena.block(reply.slots[0], NODE_SLOT), block(1, NODE_SLOT))
    finally:
        arena.close()
    done = stub.Commit(node_pb2.CommitRequest(lease=reply.lease, keys=pack_keys([key(1)]), slots=list(reply.slots),
                                              checksums=[checksum ^ 0xFF]), timeout=10)
    assert list(done.stored) == [1]  # published as the writer said: the node does not hash it again
    assert node.store.dram.leased_slots == 0
    got = stub.Get(node_pb2.GetRequest(keys=pack_keys([key(1)])), timeout=10)
    assert list(got.tiers) == [NO_TIER] and got.data == b""  # but no reader takes it


def test_an_abandoned_lease_is_reaped_after_its_deadline_and_a_late_commit_stores_nothing(node, stub):
    ids = list(range(NODE_SLOTS))
    reply = stub.Reserve(node_pb2.ReserveRequest(keys=pack_keys([key(i) for i in ids]), sizes=[NODE_SLOT] * NODE_SLOTS),
                         timeout=10)
    assert all(g != 0 for g in reply.slot_gens)  # every DRAM slot is now leased to a writer that never commits
    assert put(stub, [50]) == [0]  # no room: nothing to evict, and no SSD tier
    wait_until(lambda: node.store.dram.leased_slots == 0, timeout=10)  # the reaper, not this test, freed them
    assert put(stub, [50, 51, 52, 53]) == [1, 1, 1, 1]
    late = stub.Commit(node_pb2.CommitRequest(lease=reply.lease, keys=pack_keys([key(i) for i in ids]),
                                              slots=list(reply.slots), checksums=[0] * NODE_SLOTS), timeout=10)
    assert list(late.stored) == [0] * NODE_SLOTS
    tiers = stub.Exists(node_pb2.NodeExistsRequest(keys=pack_keys([key(i) for i in ids + [50, 53]])), timeout=10).tiers
    assert list(tiers) == [NO_TIER] * NODE_SLOTS + [Tier.DRAM, Tier.DRAM]


def test_bad_reserve_and_commit_requests_are_invalid_argument(stub):
    bad = [
        (stub.Reserve, node_pb2.ReserveRequest(keys=pack_keys([key(1)]), sizes=[])),
        (stub.Reserve, node_pb2.ReserveRequest(keys=pack_keys([key(1)]), sizes=[0])),
        (stub.Reserve, node_pb2.ReserveRequest(keys=b"x" * 33, sizes=[1])),
        (stub.Commit, node_pb2.CommitRequest(lease=1, keys=pack_keys([key(1)]), slots=[0], checksums=[])),
    ]
    for call, request in bad:
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    unknown = stub.Commit(node_pb2.CommitRequest(lease=12345, keys=pack_keys([key(1)]), slots=[0], checksums=[0]),
                          timeout=10)
    assert list(unknown.stored) == [0]


# -- the client: same-host put through the arena ------------------------------------------------------

needs_master = pytest.mark.skipif(not HAVE_MASTER, reason="kvpool.master.server is not available")


@needs_master
def test_client_store_on_the_same_host_goes_through_the_arena(tmp_path, arena_name, monkeypatch):
    from kvpool.client.pool import PoolClient
    from kvpool.config import ClientConfig, MasterConfig
    from kvpool.master.server import MasterServer

    master = MasterServer(MasterConfig.of(port=0, metrics_port=0)).start()
    cfg = NodeConfig.of(master=master.address, host="127.0.0.1", port=0, metrics_port=0, data_port=0, arena=arena_name,
                     dram_bytes=16 << 20, max_block_bytes=1 << 20, ssd_dir=str(tmp_path / "ssd"), ssd_bytes=64 << 20)
    try:
        with PoolNode(cfg) as n:
            wait_until(lambda: n.link.registered)
            with PoolClient(ClientConfig(master=master.address, strict=True)) as pool:
                def no_network(*args, **kwargs):
                    raise AssertionError("a same-host put went over the network")

                monkeypatch.setattr(pool.bulk_path, "put", no_network)
                monkeypatch.setattr(pool.grpc_path, "put", no_network)
                keys = [key(i) for i in range(6)]
                values = [block(i, n) for i, n in enumerate([1, 4096, 12345, 1 << 20, 1 << 20, 999])]
                stored = pool.store(keys + keys[:1], values + values[:1])  # a repeated key shares its fate
                assert stored == [True] * 7
                assert pool.flush()  # the barrier: the piped Commits answered, the node's reports at the master
                stocked = pool.shared_path.stocked_slots()
                assert stocked >= 1  # slots leased ahead for the next put (it is one Commit)
                assert n.store.dram.leased_slots == stocked
                locations = pool.lookup(keys)
                assert [loc.tier for loc in locations] == [Tier.DRAM] * 6
                outs = [np.empty_like(v) for v in values]
                assert pool.get_into(locations, outs) == [True] * 6
                assert all(np.array_equal(o, v) for o, v in zip(outs, values))
                assert pool.store(keys[:2], values[:2]) == [True, True]  # already pooled: nothing stored twice
                assert n.store.dram.stats().blocks == 6
            assert n.store.dram.leased_slots == 0  # close handed the stock back
    finally:
        master.stop()


@needs_master
def test_a_restarted_node_gets_its_new_arena_mapped_by_the_client(tmp_path, arena_name, monkeypatch):
    from kvpool.client.pool import PoolClient
    from kvpool.config import ClientConfig, MasterConfig
    from kvpool.master.server import MasterServer

    master = MasterServer(MasterConfig.of(port=0, metrics_port=0)).start()
    cfg = NodeConfig.of(master=master.address, host="127.0.0.1", port=0, metrics_port=0, data_port=0, arena=arena_name,
                     dram_bytes=8 << 20, max_block_bytes=1 << 20, ssd_enabled=False, ssd_dir=str(tmp_path / "ssd"))
    try:
        with PoolClient(ClientConfig(master=master.address, strict=True)) as pool:
            monkeypatch.setattr(pool.bulk_path, "put",
                                lambda *args: pytest.fail("a same-host put went over the network"))
            for run in range(2):  # the second node reuses the arena name: a new segment under the same name
                with PoolNode(cfg) as n:
                    # the client's cluster view (where its puts go) refreshed once the node registered
                    wait_until(lambda n=n: n.link.registered and pool.cluster.refresh() and
                               [v.ref.address for v in pool.cluster.nodes()] == [n.address])
                    keys = [key(100 * run + i) for i in range(3)]
                    values = [block(100 * run + i, 1 << 20) for i in range(3)]
                    assert pool.store(keys, values) == [True] * 3
                    assert pool.flush()
                    outs = [np.empty_like(v) for v in values]
                    assert pool.get_into(pool.lookup(keys), outs) == [True] * 3
                    assert all(np.array_equal(o, v) for o, v in zip(outs, values))
                wait_until(lambda keys=keys: not any(pool.exists(keys)))  # the master dropped the stopped node
    finally:
        master.stop()


@needs_master
def test_the_arena_key_index_saves_every_reader_the_locate_call_and_follows_a_moved_block(tmp_path, arena_name):
    from kvpool.client.pool import PoolClient
    from kvpool.config import ClientConfig, MasterConfig
    from kvpool.master.server import MasterServer

    master = MasterServer(MasterConfig.of(port=0, metrics_port=0)).start()
    cfg = NodeConfig.of(master=master.address, host="127.0.0.1", port=0, metrics_port=0, data_port=0, arena=arena_name,
                     dram_bytes=8 << 20, max_block_bytes=1 << 20, ssd_enabled=False, ssd_dir=str(tmp_path / "ssd"))
    try:
        with PoolNode(cfg) as n, PoolClient(ClientConfig(master=master.address, strict=True)) as writer, \
                PoolClient(ClientConfig(master=master.address, strict=True)) as reader:
            wait_until(lambda: n.link.registered)
            calls: list[int] = []
            for pool in (writer, reader):
                real = pool.shared_path.locate
                pool.shared_path.locate = lambda node, arena, packed, count, deadline, real=real: \
                    calls.append(count) or real(node, arena, packed, count, deadline)
            keys = [key(i) for i in range(3)]
            values = [block(i, 1 << 20) for i in range(3)]
            assert writer.store(keys, values) == [True] * 3
            outs = [np.empty_like(v) for v in values]
            assert writer.get_into(writer.lookup(keys), outs) == [True] * 3 and calls == []
            assert reader.get_into(reader.lookup(keys), outs) == [True] * 3 and calls == []  # never wrote them
            assert all(np.array_equal(o, v) for o, v in zip(outs, values))
            # move block 0: its old slot now holds another block of the same size, the index names the new one
            old_slot = n.store.dram.locate([keys[0]])[0].slot
            n.store.dram.remove([keys[0]])
            assert n.store.dram.put([key(9)], [block(9, 1 << 20)]) == [True]
            assert n.store.dram.locate([key(9)])[0].slot == old_slot
            assert n.store.dram.put([keys[0]], [values[0]]) == [True]
            assert n.store.dram.locate([keys[0]])[0].slot != old_slot
            wait_until(lambda: len(reader.lookup(keys)) == 3)
            out = np.zeros(1 << 20, np.uint8)
            assert reader.get_into(reader.lookup(keys[:1]), [out]) == [True]
            assert np.array_equal(out, values[0]) and calls == []
            reader.shared_path.use_index = False  # without the index every batch asks Locate
            assert reader.get_into(reader.lookup(keys), outs) == [True] * 3 and calls == [3]
    finally:
        master.stop()


@needs_master
def test_a_slot_reused_while_the_client_copies_is_a_miss_not_other_bytes(tmp_path, arena_name, monkeypatch):
    import kvpool.client.shared_path as shared_path_module
    from kvpool.client.pool import PoolClient
    from kvpool.config import ClientConfig, MasterConfig
    from kvpool.master.server import MasterServer

    master = MasterServer(MasterConfig.of(port=0, metrics_port=0)).start()
    cfg = NodeConfig.of(master=master.address, host="127.0.0.1", port=0, metrics_port=0, data_port=0, arena=arena_name,
                     dram_bytes=8 << 20, max_block_bytes=1 << 20, ssd_enabled=False, ssd_dir=str(tmp_path / "ssd"))
    try:
        with PoolNode(cfg) as n, PoolClient(ClientConfig(master=master.address)) as pool:
            wait_until(lambda: n.link.registered)
            assert pool.store([key(1)], [block(1, 1 << 20)]) == [True]
            locations = pool.lookup([key(1)])
            real = shared_path_module.copy_with_checksum

            def copy_while_the_node_reuses_the_slot(dst, src):
                n.store.dram.remove([key(1)])
                n.store.dram.put([key(2)], [block(1, 1 << 20)])  # same bytes, another block: same slot
                return real(dst, src)

            monkeypatch.setattr(shared_path_module, "copy_with_checksum", copy_while_the_node_reuses_the_slot)
            out = np.zeros(1 << 20, np.uint8)
            assert pool.get_into(locations, [out]) == [False]
            assert pool.errors.errors.labels("slot_reused")._value.get() == 1
            assert pool.errors.errors.labels("block_gone")._value.get() == 1  # the remote retry: it is gone
    finally:
        master.stop()
