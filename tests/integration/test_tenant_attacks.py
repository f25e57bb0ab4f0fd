"""One tenant attacking another through a node's write leases (issue 11), over the wire.

Real `kvpool master` and `kvpool node` processes on 127.0.0.1 with an auth
file: tenant a (no quota) and tenant b (a 256 KiB quota: four 64 KiB slots
of the node's 32). Each tenant talks to the node with its own token over
gRPC, and writes into the node's arena like a same-host client does:
Reserve, copy into the mapped slots, Commit. The node has no SSD tier, so a
block evicted from DRAM is gone, and leases last long enough (60 s) that
none lapses while a test runs: every lease a test makes, it ends itself.
"""

from __future__ import annotations

import itertools
import json
import secrets

import numpy as np
import pytest
from support import PoolProcesses, metric, scrape

from kvpool.checksum import copy_with_checksum
from kvpool.keys import BlockKey, opaque_key, pack_keys
from kvpool.rpc import make_channel
from kvpool.tiers.arena import SharedArena
from kvpool.v1 import node_pb2, node_pb2_grpc
from kvpool.vocabulary import NO_TIER, Tier

SLOT = 64 << 10
SLOTS = 32
QUOTA_B = 4 * SLOT  # 256 KiB
NODE_TOKEN = secrets.token_hex(32)
TOKEN_A = secrets.token_hex(32)
TOKEN_B = secrets.token_hex(32)


def key(name: str) -> BlockKey:
    return opaque_key(f"tenant-attack-{name}")


def value(name: str) -> np.ndarray:
    return np.random.default_rng(list(name.encode())).integers(0, 256, SLOT, dtype=np.uint8)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A master and one node (no SSD, 32 slots of 64 KiB, 60 s leases), both with the auth file."""
    tmp = tmp_path_factory.mktemp("tenant-attacks")
    auth = tmp / "auth.json"
    auth.write_text(json.dumps({
        "secret": secrets.token_hex(32),
        "node_tokens": [NODE_TOKEN],
        "clients": {TOKEN_A: {"tenant": "a"}, TOKEN_B: {"tenant": "b", "quota_bytes": QUOTA_B}},
    }))
    config = tmp / "kvpool.json"
    config.write_text(json.dumps({
        "master": {"server": {"auth_file": str(auth)}},
        "node": {"server": {"auth_file": str(auth)}, "token": NODE_TOKEN,
                 "tiers": {"ssd": {"enabled": False}, "dram": {"lease_timeout_s": 60.0}}},
    }))
    procs = PoolProcesses(tmp, **{"dram-bytes": str(SLOTS * SLOT), "max-block-bytes": str(SLOT), "config": str(config)})
    try:
        procs.start_master(config=str(config))
        procs.start_node("n0")
        yield procs
    finally:
        procs.close()


class Tenant:
    """A tenant's gRPC stub to the node and its mapping of the node's arena."""

    def __init__(self, pool: PoolProcesses, token: str):
        self.channel = make_channel(pool.node_address("n0"), max_message_bytes=64 << 20, token=token)
        self.stub = node_pb2_grpc.NodeStub(self.channel)
        self.arena: SharedArena | None = None

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
        self.channel.close()

    def reserve(self, names: list[str]) -> node_pb2.ReserveResponse:
        reply = self.stub.Reserve(node_pb2.ReserveRequest(keys=pack_keys([key(n) for n in names]),
                                                          sizes=[SLOT] * len(names)), timeout=10)
        if self.arena is None:
            self.arena = SharedArena.attach(reply.arena)
        return reply

    def write(self, reply: node_pb2.ReserveResponse, names: list[str]) -> tuple[list[int], list[int]]:
        """Copy each named block into its reserved slot; (slots, checksums) of those that got one."""
        assert self.arena is not None
        slots, sums = [], []
        for name, slot, gen in zip(names, reply.slots, reply.slot_gens):
            if gen:
                sums.append(copy_with_checksum(self.arena.block(slot, SLOT), value(name)))
                slots.append(slot)
        return slots, sums

    def commit(self, lease: int, names: list[str], slots: list[int], sums: list[int]) -> list[int]:
        reply = self.stub.Commit(node_pb2.CommitRequest(lease=lease, keys=pack_keys([key(n) for n in names]),
                                                        slots=slots, checksums=sums), timeout=10)
        return list(reply.stored)

    def put(self, names: list[str]) -> list[int]:
        reply = self.stub.Put(node_pb2.PutRequest(keys=pack_keys([key(n) for n in names]), sizes=[SLOT] * len(names),
                                                  data=b"".join(value(n).tobytes() for n in names)), timeout=10)
        return list(reply.stored)

    def tiers(self, names: list[str]) -> list[int]:
        return list(self.stub.Exists(node_pb2.NodeExistsRequest(keys=pack_keys([key(n) for n in names])),
                                     timeout=10).tiers)

    def readable(self, names: list[str]) -> bool:
        """Whether the node serves exactly these blocks' bytes to this tenant."""
        got = self.stub.Get(node_pb2.GetRequest(keys=pack_keys([key(n) for n in names])), timeout=10)
        return list(got.tiers) == [Tier.DRAM] * len(names) and got.data == b"".join(value(n).tobytes() for n in names)

    def remove(self, names: list[str]) -> None:
        self.stub.Remove(node_pb2.RemoveRequest(keys=pack_keys([key(n) for n in names])), timeout=10)


@pytest.fixture
def tenants(pool):
    a, b = Tenant(pool, TOKEN_A), Tenant(pool, TOKEN_B)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def leased_slots(pool: PoolProcesses) -> float:
    return metric(scrape(pool.node_metrics_port("n0")), "kvpool_leased_slots")


def test_a_tenant_committing_another_tenants_lease_id_stores_nothing_and_leaves_the_lease_to_its_owner(pool, tenants):
    a, b = tenants
    mine = ["a-lease-0", "a-lease-1"]
    reply_a = a.reserve(mine)
    assert reply_a.lease and all(reply_a.slot_gens)
    slots_a, sums_a = a.write(reply_a, mine)
    reply_b = b.reserve(["b-lease-0"])
    assert reply_b.lease and reply_b.lease != reply_a.lease
    try:
        # B commits A's lease: naming A's keys and slots with the right checksums, its own key, nothing at all.
        assert b.commit(reply_a.lease, mine, slots_a, sums_a) == [0, 0]
        assert b.commit(reply_a.lease, ["b-lease-0"], slots_a[:1], sums_a[:1]) == [0]
        assert b.commit(reply_a.lease, [], [], []) == []
        assert b.tiers(mine) == [NO_TIER, NO_TIER] and a.tiers(mine) == [NO_TIER, NO_TIER]  # nothing stored for anyone
        # A's own commit still stores A's blocks, byte for byte.
        assert a.commit(reply_a.lease, mine, slots_a, sums_a) == [1, 1]
        assert a.readable(mine)
        assert b.tiers(mine) == [NO_TIER, NO_TIER]
        assert leased_slots(pool) == 1
    finally:
        b.commit(reply_b.lease, [], [], [])  # ends B's lease
        a.remove(mine)
    assert leased_slots(pool) == 0


def test_lease_ids_cannot_be_guessed_from_ones_own(pool, tenants):
    a, b = tenants
    leases = []
    try:
        for i in range(8):
            reply = a.reserve([f"a-guess-{i}"])
            assert all(reply.slot_gens)
            leases.append(reply.lease)
            reply = b.reserve([f"b-guess-{i}"])  # one slot each: within b's quota until b ends them
            leases.append(reply.lease)
            b.commit(reply.lease, [], [], [])
        # Interleaved with b's, a's ids say nothing about the next: no two within 2**32 of each other.
        ordered = sorted(leases)
        assert 0 not in ordered and len(set(ordered)) == len(ordered)
        assert min(hi - lo for lo, hi in itertools.pairwise(ordered)) > 1 << 32, ordered
        assert ordered[-1] < 1 << 63
    finally:
        for lease in leases[::2]:
            a.commit(lease, [], [], [])
    assert leased_slots(pool) == 0


def test_a_tenant_reserving_over_and_over_gets_only_its_quota_and_never_evicts_another_tenants_blocks(pool, tenants):
    a, b = tenants
    theirs = [f"a-held-{i}" for i in range(24)]  # 24 of 32 slots: with b's 4 still under the high watermark (30)
    assert a.put(theirs) == [1] * 24
    leases: list[tuple[int, list[str], node_pb2.ReserveResponse]] = []
    try:
        granted = 0
        for attempt in range(8):  # b asks for the whole arena eight times over, holding every lease it gets
            names = [f"b-grab-{attempt}-{i}" for i in range(SLOTS)]
            reply = b.reserve(names)
            granted += sum(1 for g in reply.slot_gens if g)
            if reply.lease:
                leases.append((reply.lease, names, reply))
        assert granted == QUOTA_B // SLOT
        assert leased_slots(pool) == QUOTA_B // SLOT
        assert a.tiers(theirs) == [Tier.DRAM] * 24 and a.readable(theirs)

        # Ending b's leases ends their charge: b may reserve its quota again, and only its quota.
        lease, names, reply = leases.pop(0)
        slots, sums = b.write(reply, names)
        assert b.commit(lease, names[:1], slots[:1], sums[:1]) == [1]  # one block held, the other slots freed
        assert leased_slots(pool) == len(leases) == 0
        assert b.tiers(names[:1]) == [Tier.DRAM]
        reply = b.reserve([f"b-again-{i}" for i in range(SLOTS)])
        leases.append((reply.lease, [], reply))
        assert sum(1 for g in reply.slot_gens if g) == QUOTA_B // SLOT  # (making room, b's own block went)
        assert leased_slots(pool) == QUOTA_B // SLOT
        assert b.reserve(["b-one-more"]).lease == 0
        assert a.tiers(theirs) == [Tier.DRAM] * 24 and a.readable(theirs)
    finally:
        for lease, _, _ in leases:
            b.commit(lease, [], [], [])
        a.remove(theirs)
        b.remove([f"b-grab-{attempt}-{i}" for attempt in range(8) for i in range(SLOTS)])
    assert leased_slots(pool) == 0

