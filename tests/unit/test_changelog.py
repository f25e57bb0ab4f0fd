"""The leader's change log and a standby's Follower, in process: a snapshot plus the log rebuilds the leader's
nodes and index exactly; the log is bounded; an elected standby's inherited nodes re-register and reconcile."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from models import check_index

from kvpool.keys import BlockKey, pack_keys
from kvpool.master.changelog import ChangeLog, followed_node
from kvpool.master.follower import Follower
from kvpool.master.index import BlockIndex, HbmIndex
from kvpool.master.membership import Membership
from kvpool.rpc import proto_tier
from kvpool.v1 import master_pb2
from kvpool.vocabulary import NodeRef, Tier


class Master:
    """A leader's membership, index and log, changed as the servicer does (apply and note as one step)."""

    def __init__(self, max_bytes: int = 1 << 20, chunk: int = 7) -> None:
        self.index = BlockIndex(min_capacity=64)
        self.membership = Membership(self.index, HbmIndex(), node_timeout_s=60, worker_timeout_s=60)
        self.log = ChangeLog(self.membership, self.index, max_bytes=max_bytes, reply_bytes=2000,
                             chunk_locations=chunk)
        self.log.reset(on=True)

    def register(self, node_id: str) -> tuple[int, int]:
        with self.log.applying() as note:
            info = self.membership.register(NodeRef(node_id, f"{node_id}:1"), [], 1 << 20)
            note(master_pb2.IndexChange(joined=followed_node(info)), 0)
        return info.number, info.incarnation

    def report(self, node_id: str, tier: Tier, added: list[BlockKey], removed: Sequence[BlockKey] = (),
               full_sync: bool = False) -> None:
        number = next(i.number for i in self.membership.live_nodes() if i.ref.node_id == node_id)
        request = master_pb2.ReportBlocksRequest(node_id=node_id, tier=proto_tier(tier), full_sync=full_sync,
                                                 added_keys=pack_keys(added), added_sizes=[4096] * len(added),
                                                 added_checksums=[9] * len(added),
                                                 removed_keys=pack_keys(list(removed)))
        with self.log.applying() as note:
            if full_sync:
                self.index.replace_node_tier(number, tier, added, [4096] * len(added), [9] * len(added))
            else:
                self.index.add(number, tier, added, [4096] * len(added), [9] * len(added))
            self.index.remove(number, tier, list(removed))
            note(master_pb2.IndexChange(blocks=master_pb2.FollowedBlocks(
                number=number, tier=request.tier, full_sync=full_sync, added_keys=request.added_keys,
                added_sizes=request.added_sizes, added_checksums=request.added_checksums,
                removed_keys=request.removed_keys)), len(added) + len(removed))

    def unregister(self, node_id: str, incarnation: int) -> None:
        with self.log.applying() as note:
            if self.membership.unregister(node_id, incarnation):
                note(master_pb2.IndexChange(left=node_id), 0)


class Stub:
    """A leader's Follow and Snapshot without the network."""

    def __init__(self, master: Master) -> None:
        self.master = master

    def Follow(self, request, timeout=None):
        return self.master.log.follow(request.log_id, request.after_seq)

    def Snapshot(self, request, timeout=None):
        return self.master.log.snapshot(request.snapshot_id, request.offset)


def standby() -> Follower:
    index = BlockIndex(min_capacity=64)
    membership = Membership(index, HbmIndex(), node_timeout_s=60, worker_timeout_s=60)
    return Follower(membership, index, lambda: "", max_message_bytes=4 << 20)


def catch_up(follower: Follower, stub: Stub) -> None:
    while not follower._step(stub):  # type: ignore[arg-type]
        pass


def same(leader: Master, follower: Follower, keys: list[BlockKey]) -> None:
    """The follower's nodes and index are the leader's."""
    check_index(follower._index)
    assert [(i.ref, i.number, i.incarnation) for i in follower._membership.live_nodes()] == \
        [(i.ref, i.number, i.incarnation) for i in leader.membership.live_nodes()]
    assert follower._index.leading_run(keys) == leader.index.leading_run(keys)
    assert follower._index.exists(keys) == leader.index.exists(keys)
    assert len(follower._index) == len(leader.index)
    assert sorted(zip(*[a.tolist() for a in follower._index.locations()])) == \
        sorted(zip(*[a.tolist() for a in leader.index.locations()]))


def keys(tag: str, n: int) -> list[BlockKey]:
    rng = np.random.default_rng(abs(hash(tag)) % (1 << 32))
    raw = rng.bytes(32 * n)
    return [BlockKey(raw[i : i + 32]) for i in range(0, len(raw), 32)]


def test_a_snapshot_then_the_log_rebuild_the_leaders_nodes_and_index():
    leader = Master()
    stub = Stub(leader)
    a, b, c = keys("a", 40), keys("b", 30), keys("c", 5)
    leader.register("n1")
    leader.register("n2")
    _, inc3 = leader.register("n3")
    leader.report("n1", Tier.DRAM, a, full_sync=True)
    leader.report("n2", Tier.SSD, a[:10] + b)
    leader.report("n3", Tier.DRAM, a[:3])  # three copies of a[:3]: the index's rare list
    follower = standby()
    catch_up(follower, stub)  # snapshot in chunks of 7 locations
    assert follower.warm and follower.snapshots == 1
    same(leader, follower, a + b + c)
    leader.report("n1", Tier.DRAM, c, a[20:25])
    leader.register("n2")  # re-registered: its old entries go
    leader.report("n2", Tier.SSD, b[:4], full_sync=True)
    leader.unregister("n3", inc3)
    leader.register("n4")
    leader.report("n4", Tier.DRAM, c[:2] + b[10:12])
    catch_up(follower, stub)
    assert follower.snapshots == 1 and follower.changes == 6  # followed, not snapshotted again
    same(leader, follower, a + b + c)


def test_a_follower_behind_the_bounded_log_takes_a_snapshot_again_and_replies_are_bounded():
    leader = Master(max_bytes=3000)  # ~50 keys
    stub = Stub(leader)
    leader.register("n1")
    follower = standby()
    catch_up(follower, stub)
    base = keys("base", 10)
    leader.report("n1", Tier.DRAM, base)
    reply = leader.log.follow(follower.log_id, follower.seq)
    assert [c.seq for c in reply.changes] == [follower.seq + 1]
    for i in range(6):  # more than the log keeps
        leader.report("n1", Tier.DRAM, keys(f"burst-{i}", 20))
    assert len(leader.log._entries) < 7 and leader.log._bytes <= 3000
    assert leader.log.follow(follower.log_id, follower.seq).behind
    assert leader.log.follow(12345, 0).behind  # another leader's log
    catch_up(follower, stub)
    assert follower.snapshots == 2
    same(leader, follower, base + keys("burst-5", 20))
    leader.report("n1", Tier.DRAM, keys("more", 20))
    leader.report("n1", Tier.DRAM, keys("more2", 20))
    assert len(leader.log.follow(follower.log_id, follower.seq).changes) == 1  # 2000 bytes a reply: one at a time
    catch_up(follower, stub)
    same(leader, follower, keys("more", 20) + keys("more2", 20))


def test_an_elected_standbys_nodes_register_again_and_their_inherited_entries_stay_until_the_full_sync():
    leader = Master()
    leader.register("n1")
    held = keys("held", 20)
    leader.report("n1", Tier.DRAM, held)
    follower = standby()
    catch_up(follower, Stub(leader))
    membership, index = follower._membership, follower._index
    (old,) = membership.live_nodes()
    assert membership.inherit() == 1
    assert membership.touch("n1", old.incarnation) is None  # its heartbeats and reports: "unknown"
    new = membership.register(NodeRef("n1", "n1:2"), [], 1 << 20)
    assert new.number != old.number and new.incarnation > old.incarnation
    run = index.leading_run(held)
    assert len(run) == 20 and membership.refs([old.number]) == {old.number: NodeRef("n1", "n1:2")}
    index.replace_node_tier(new.number, Tier.DRAM, held[5:], [4096] * 15, [9] * 15)
    assert membership.synced("n1", new.incarnation) == 20  # the inherited entries go
    assert index.exists(held) == [False] * 5 + [True] * 15
    assert membership.refs([old.number]) == {}
    check_index(index)


def test_an_inherited_node_that_never_comes_back_expires_with_its_entries():
    leader = Master()
    leader.register("n1")
    leader.report("n1", Tier.DRAM, keys("x", 5))
    follower = standby()
    catch_up(follower, Stub(leader))
    membership = follower._membership
    membership.inherit()
    assert membership.expire(membership.now() + 61) == ["n1"]
    assert len(follower._index) == 0


def test_the_log_records_nothing_while_off():
    leader = Master()
    leader.log.reset(on=False)
    leader.register("n1")
    assert len(leader.log._entries) == 0 and leader.log.log_id == 0
