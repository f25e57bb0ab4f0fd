"""ShardedMaster's split and merge (kvpool/sharded_master.py) against in-process masters: the real servicer and
index per shard, called directly (no sockets), compared with one unsharded master holding the same blocks."""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Sequence
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from prometheus_client import CollectorRegistry

from kvpool.auth import ROLE_CLIENT, Identity, acting_as, mask_keys, tenant_mask
from kvpool.config import MasterConfig, ServerConfig
from kvpool.keys import unpack_keys
from kvpool.master.index import BlockIndex, HbmIndex
from kvpool.master.membership import Membership
from kvpool.master.servicer import MasterServicer
from kvpool.master.stats import MasterMetrics
from kvpool.master_client import MasterCalls, OnError
from kvpool.sharded_master import ShardedMaster
from kvpool.shards import shard_of
from kvpool.v1 import common_pb2, master_pb2
from kvpool.wire import CallError

DRAM, SSD = common_pb2.TIER_DRAM, common_pb2.TIER_SSD
NODES = ("node-a", "node-b", "node-c")


class _Context:
    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise CallError(code, details)


class InProcessMaster(MasterCalls):
    """One master's servicer called directly; ``fail`` makes every call UNAVAILABLE; ``calls`` counts them."""

    def __init__(self, max_keys_per_call: int = 65536, identity: Identity | None = None):
        config = MasterConfig(server=ServerConfig(max_keys_per_call=max_keys_per_call))
        self.index = BlockIndex()
        self.hbm = HbmIndex()
        self.membership = Membership(self.index, self.hbm, node_timeout_s=60.0, worker_timeout_s=60.0)
        metrics = MasterMetrics(CollectorRegistry(), self.index, self.hbm, self.membership)
        self.metrics = metrics
        self.servicer = MasterServicer(config, self.index, self.hbm, self.membership, metrics)
        self.identity = identity  # the caller every client call is served as (None: auth off)
        self.fail = False
        self.calls: list[str] = []
        self.sent: list[Message] = []
        self.incarnation: dict[str, int] = {}
        for node in NODES:
            reply = self.servicer.RegisterNode(master_pb2.RegisterNodeRequest(
                node=common_pb2.NodeRef(node_id=node, address=f"{node}:1"),
                tiers=[common_pb2.TierUsage(tier=DRAM, capacity_bytes=1 << 30)], dram_max_block_bytes=1 << 20),
                _Context())
            self.incarnation[node] = reply.incarnation

    def call(self, name: str, request: Message, timeout: float | None) -> Any:
        self.calls.append(name)
        self.sent.append(request)
        if self.fail:
            raise CallError(grpc.StatusCode.UNAVAILABLE, f"{name}: this shard is down")
        with acting_as(self.identity):
            return getattr(self.servicer, name)(request, _Context())

    def call_nowait(self, name: str, request: Message, timeout: float | None, on_error: OnError) -> None:
        try:
            self.call(name, request, timeout)
        except grpc.RpcError as exc:
            on_error(exc)

    def info(self) -> master_pb2.MasterInfoResponse | None:
        with acting_as(self.identity):
            return self.servicer.Info(master_pb2.MasterInfoRequest(), _Context())

    def close(self) -> None:
        pass

    # -- what nodes and workers would report ---------------------------------------------------------

    def store(self, node: str, tier: Any, keys: list[bytes], removed: Sequence[bytes] = ()) -> None:
        self.servicer.ReportBlocks(master_pb2.ReportBlocksRequest(
            node_id=node, incarnation=self.incarnation[node], tier=tier, added_keys=b"".join(keys),
            added_sizes=[len(k) * 10 for k in keys], added_checksums=[int.from_bytes(k[:8], "little") for k in keys],
            removed_keys=b"".join(removed)), _Context())


def keys(n: int, salt: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{salt}{i}".encode()).digest() for i in range(n)]


class Cluster:
    """The same blocks in one unsharded master and in ``count`` shard masters (each its shard's keys)."""

    def __init__(self, count: int = 2, identity: Identity | None = None):
        self.one = InProcessMaster(identity=identity)
        self.shards = [InProcessMaster(identity=identity) for _ in range(count)]
        self.sharded = ShardedMaster(self.shards)
        self.count = count
        self.mask = identity.mask if identity is not None else b""

    def stored(self, ks: list[bytes]) -> list[bytes]:
        """The keys as nodes store and report them (a tenant's: masked)."""
        return [bytes(k) for k in unpack_keys(mask_keys(b"".join(ks), self.mask))] if ks else []

    def store(self, node: str, tier: Any, ks: list[bytes]) -> None:
        ks = self.stored(ks)
        self.one.store(node, tier, ks)
        for k, shard in enumerate(self.shards):
            mine = [key for key in ks if shard_of(key, self.count) == k]
            if mine:
                shard.store(node, tier, mine)

    def remove(self, node: str, tier: Any, ks: list[bytes]) -> None:
        ks = self.stored(ks)
        self.one.store(node, tier, [], ks)
        for k, shard in enumerate(self.shards):
            shard.store(node, tier, [], [key for key in ks if shard_of(key, self.count) == k])

    def hbm(self, worker: str, ks: list[bytes]) -> None:
        request = master_pb2.ReportHbmRequest(worker_id=worker, added_keys=b"".join(ks))
        self.one.report_hbm(request, None)
        self.sharded.report_hbm(request, None)


def by_block(reply: master_pb2.LookupResponse) -> list[tuple[int, str, int, int]]:
    """A run as (tier, node id, size, checksum) per block: comparable across node numberings."""
    return [(t, reply.nodes[n].node_id, size, checksum)
            for t, n, size, checksum in zip(reply.tiers, reply.node_indexes, reply.sizes, reply.checksums)]


def lookup(master: Any, ks: list[bytes], **kw: Any) -> master_pb2.LookupResponse:
    return master.lookup(master_pb2.LookupRequest(keys=b"".join(ks), **kw), None)


def shard_positions(ks: list[bytes], shard: int, count: int = 2) -> list[int]:
    return [i for i, k in enumerate(ks) if shard_of(k, count) == shard]


def test_lookup_merges_in_prompt_order_and_renumbers_nodes_by_first_use():
    c = Cluster()
    ks = keys(64)
    rng = random.Random(1)
    for k in ks:
        c.store(rng.choice(NODES), rng.choice((DRAM, SSD)), [k])
    one, merged = lookup(c.one, ks), lookup(c.sharded, ks)
    assert len(merged.tiers) == 64
    assert by_block(merged) == by_block(one)
    # One entry per node, numbered in order of first use (as one master numbers them).
    assert [n.node_id for n in merged.nodes] == [n.node_id for n in one.nodes]
    assert list(merged.node_indexes) == list(one.node_indexes)
    assert (merged.dram_blocks, merged.ssd_blocks) == (one.dram_blocks, one.ssd_blocks)
    assert merged.dram_blocks + merged.ssd_blocks == 64
    assert all(len(s.calls) == 1 for s in c.shards)  # one call per shard


def test_the_run_ends_at_the_first_key_any_shard_misses():
    c = Cluster()
    ks = keys(64)
    c.store("node-a", DRAM, ks)
    cut = shard_positions(ks, 1)[5]  # a shard-1 key in the middle
    c.remove("node-a", DRAM, [ks[cut]])
    merged = lookup(c.sharded, ks)
    assert len(merged.tiers) == cut == len(lookup(c.one, ks).tiers)
    assert by_block(merged) == by_block(lookup(c.one, ks))
    # Shard 0's own run went further; the merge cut it at shard 1's miss.
    assert len(c.shards[0].lookup(master_pb2.LookupRequest(keys=b"".join(ks[i] for i in shard_positions(ks, 0))),
                                  None).tiers) == len(shard_positions(ks, 0))


def test_a_failed_shard_is_a_miss_from_its_first_key_unless_it_is_the_only_one_asked():
    c = Cluster()
    ks = keys(64)
    c.store("node-b", DRAM, ks)
    c.shards[1].fail = True
    merged = lookup(c.sharded, ks)
    assert len(merged.tiers) == shard_positions(ks, 1)[0]
    only_shard_1 = [ks[i] for i in shard_positions(ks, 1)]
    with pytest.raises(grpc.RpcError) as raised:
        lookup(c.sharded, only_shard_1)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(lookup(c.sharded, [ks[i] for i in shard_positions(ks, 0)]).tiers) == len(shard_positions(ks, 0))
    # Exists: the failed shard's keys are absent, the others answered.
    present = c.sharded.exists(master_pb2.ExistsRequest(keys=b"".join(ks)), None).present
    assert [bool(p) for p in present] == [shard_of(k, 2) == 0 for k in ks]


def test_lookup_stats_count_the_hbm_prefix_once_and_every_requested_block():
    c = Cluster()
    ks = keys(40)
    c.store("node-a", DRAM, ks)
    lookup(c.sharded, ks, worker_id="w1", hbm_prefix_blocks=7, block_tokens=16)
    first = shard_of(ks[0], 2)
    sent = {k: s.sent[-1] for k, s in enumerate(c.shards)}
    assert sent[first].hbm_prefix_blocks == 7 and sent[1 - first].hbm_prefix_blocks == 0
    assert all(r.block_tokens == 16 and r.worker_id == "w1" for r in sent.values())
    totals = [s.metrics.lookup_totals() for s in c.shards]
    assert sum(t.requested_blocks for t in totals) == 7 + 40
    assert sum(t.hit_blocks_hbm for t in totals) == 7


def test_a_client_that_counts_lookups_counts_each_merged_lookup_once_and_the_shards_count_none():
    """With a client's counter (PoolClient's LookupStats), a lookup split over shards is counted once, as its
    merged run, and the shards leave their hit counters alone: without it, shard 0's own run past the merged
    cut would count hits the client never got, and every shard would count the lookup."""
    c = Cluster()
    counted: list[tuple[int, bytes, int, int]] = []
    c.sharded = ShardedMaster(c.shards, count_lookup=lambda *args: counted.append(args))
    ks = keys(40)
    c.store("node-a", DRAM, ks)
    cut = shard_positions(ks, 1)[3]
    c.remove("node-a", DRAM, [ks[cut]])
    merged = lookup(c.sharded, ks, worker_id="w1", hbm_prefix_blocks=7, block_tokens=16)
    assert len(merged.tiers) == cut
    assert counted == [(7, merged.tiers, 7 + 40, 16)]
    assert all(r.counted_by_caller for s in c.shards for r in s.sent)
    assert all(s.metrics.lookup_totals().lookups == 0 for s in c.shards)
    # A lookup one shard answers whole is that master's to count, as in an unsharded cluster.
    only_0 = [ks[i] for i in shard_positions(ks, 0)[:3]]
    lookup(c.sharded, only_0, block_tokens=16)
    assert len(counted) == 1 and sum(s.metrics.lookup_totals().lookups for s in c.shards) == 1


def test_exists_and_placement_merge_per_key_as_one_master_answers():
    c = Cluster()
    ks = keys(50)
    held = ks[::3]
    c.store("node-c", SSD, held)
    request = master_pb2.ExistsRequest(keys=b"".join(ks))
    assert c.sharded.exists(request, None).present == c.one.exists(request, None).present
    place = master_pb2.PlaceBlocksRequest(keys=b"".join(ks), sizes=[4096] * 50)
    one, merged = c.one.place_blocks(place, None), c.sharded.place_blocks(place, None)
    assert merged.present == one.present
    assert [merged.nodes[i].node_id for i in merged.node_indexes] == [one.nodes[i].node_id for i in one.node_indexes]
    assert len({n.node_id for n in merged.nodes}) == len(merged.nodes)


def test_score_equals_one_masters_on_the_same_blocks():
    """Random placements, HBM that the pool lacks included: every worker's merged score is the unsharded one."""
    for seed in range(40):
        rng = random.Random(seed)
        c = Cluster(rng.choice((2, 3)))
        ks = keys(rng.randint(1, 48), salt=str(seed))
        stored = [k for k in ks if rng.random() < 0.85]
        for k in stored:
            c.store(rng.choice(NODES), rng.choice((DRAM, SSD)), [k])
        workers = [f"w{i}" for i in range(4)]
        for w in workers[:3]:
            upto = rng.randint(0, len(ks))
            c.hbm(w, [k for k in ks[:upto] if rng.random() < 0.9])
        for named in (workers, []):
            request = master_pb2.ScoreRequest(keys=b"".join(ks), worker_ids=named)
            for s in c.shards:
                s.calls.clear()
            merged, one = c.sharded.score(request, None), c.one.score(request, None)
            assert merged == one, f"seed {seed}, workers {named}"


def test_score_of_a_stored_prefix_takes_one_call_per_shard():
    c = Cluster()
    ks = keys(64)
    c.store("node-a", DRAM, ks[:20])
    c.store("node-b", SSD, ks[20:40])
    c.hbm("w", ks[:10])
    request = master_pb2.ScoreRequest(keys=b"".join(ks), worker_ids=["w", "cold"])
    for s in c.shards:
        s.calls.clear()
    merged = c.sharded.score(request, None)
    assert merged == c.one.score(request, None)
    assert [(w.hbm_blocks, w.dram_blocks, w.ssd_blocks) for w in merged.workers] == [(10, 10, 20), (0, 20, 20)]
    assert all(s.calls == ["Score"] for s in c.shards)


def test_hbm_reports_split_by_shard_and_a_full_sync_reaches_every_shard():
    c = Cluster()
    ks = keys(30)
    c.sharded.report_hbm(master_pb2.ReportHbmRequest(worker_id="w", added_keys=b"".join(ks)), None)
    for k, s in enumerate(c.shards):
        mine = [key for key in ks if shard_of(key, 2) == k]
        assert s.sent[-1].added_keys == b"".join(mine)
        assert s.hbm.blocks() == len(mine)
    only_0 = [key for key in ks if shard_of(key, 2) == 0][:3]
    for s in c.shards:
        s.sent.clear()
    errors: list[grpc.RpcError] = []
    c.sharded.report_hbm_nowait(master_pb2.ReportHbmRequest(worker_id="w", added_keys=b"".join(only_0),
                                                            full_sync=True), None, errors.append)
    assert not errors
    assert [len(s.sent) for s in c.shards] == [1, 1]
    assert [s.hbm.blocks() for s in c.shards] == [3, 0]
    c.shards[1].fail = True
    c.sharded.report_hbm_nowait(master_pb2.ReportHbmRequest(worker_id="w", full_sync=True), None, errors.append)
    assert [e.code() for e in errors] == [grpc.StatusCode.UNAVAILABLE]


def test_info_is_shard_0s_with_the_least_key_limit_and_node_calls_are_refused():
    shards = [InProcessMaster(max_keys_per_call=4096), InProcessMaster(max_keys_per_call=1000)]
    sharded = ShardedMaster(shards)
    assert sharded.info().max_keys_per_call == 1000
    assert shards[0].info().max_keys_per_call == 4096  # the shard's own answer is not changed
    with pytest.raises(ValueError, match="links each index shard"):
        sharded.register_node(master_pb2.RegisterNodeRequest(), None)
    with pytest.raises(ValueError, match="links each index shard"):
        sharded.report_blocks(master_pb2.ReportBlocksRequest(), None)
    status = sharded.cluster_status(master_pb2.ClusterStatusRequest(), None)
    assert {n.node.node_id for n in status.nodes} == set(NODES)
    assert shards[1].calls == []  # membership is replicated: shard 0 answers
    sharded.close()


def test_names_split_by_shard():
    c = Cluster()
    ks = keys(20)
    c.sharded.name_blocks(master_pb2.NameBlocksRequest(keys=b"".join(ks), engine_hashes=list(range(1, 21))), None)
    for k, s in enumerate(c.shards):
        pos = shard_positions(ks, k)
        assert s.sent[-1].keys == b"".join(ks[i] for i in pos)
        assert list(s.sent[-1].engine_hashes) == [i + 1 for i in pos]


@pytest.mark.parametrize("count", [1, 2, 3])
def test_the_split_is_the_shard_rule(count):
    from kvpool.sharded_master import _Split
    from kvpool.shards import split_by_shard

    ks = keys(200)
    split = _Split(b"".join(ks), count)
    assert [p.tolist() for p in split.positions] == split_by_shard(ks, count)
    assert split.packed == [b"".join(ks[i] for i in p) for p in split_by_shard(ks, count)]


def test_a_host_port_master_is_todays_connection():
    from kvpool.master_client import MasterConnection
    from kvpool.sharded_master import connect_master

    master = connect_master("127.0.0.1:1", pool=None, timeout_s=1.0, max_message_bytes=1 << 20)
    try:
        assert type(master) is MasterConnection and master.etcd is None
    finally:
        master.close()


@pytest.mark.parametrize("count", [2, 3])
def test_a_tenants_keys_go_to_the_shard_of_their_stored_key(count):
    """With auth on, the shard is the masked key's (kvpool/shards.py); the merged answers are one master's."""
    secret = next(b for b in (bytes([i]) * 16 for i in range(256))
                  if [shard_of(k, count) for k in unpack_keys(mask_keys(b"".join(keys(40)), tenant_mask(b, "t")))]
                  != [shard_of(k, count) for k in keys(40)])  # a mask that moves keys to other shards
    c = Cluster(count, Identity(ROLE_CLIENT, "t", tenant_mask(secret, "t")))
    ks = keys(40)
    rng = random.Random(7)
    for k in ks[:30]:
        c.store(rng.choice(NODES), rng.choice((DRAM, SSD)), [k])
    c.hbm("w", ks[:12])
    one, merged = lookup(c.one, ks), lookup(c.sharded, ks)
    assert len(merged.tiers) == 30 and by_block(merged) == by_block(one)
    request = master_pb2.ExistsRequest(keys=b"".join(ks))
    assert c.sharded.exists(request, None).present == c.one.exists(request, None).present
    score = master_pb2.ScoreRequest(keys=b"".join(ks), worker_ids=["w", "x"])
    assert c.sharded.score(score, None) == c.one.score(score, None)
    assert [s.hbm.blocks() for s in c.shards] == [sum(shard_of(k, count) == i for k in c.stored(ks[:12]))
                                                   for i in range(count)]


def test_keyed_calls_wait_for_a_shard_to_tell_the_tenant_mask():
    c = Cluster()
    for s in c.shards:
        s.info = lambda: None  # no shard answered Info yet
    with pytest.raises(grpc.RpcError) as raised:
        lookup(c.sharded, keys(4))
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE and "tenant mask" in raised.value.details()


def test_a_client_made_before_the_shard_count_is_known_learns_it_and_then_splits():
    """connect_master before any master started: a ShardedMaster of shard 0 alone that asks ``settle`` in the
    background as calls come, and once it gives every shard's master, splits as a settled one does."""
    import threading

    c = Cluster()
    asked = threading.Event()
    answer: list = [None]

    def settle():
        asked.set()
        return answer[0]

    pending = ShardedMaster([c.shards[0]], settle=settle)
    ks = keys(40)
    c.store("node-a", DRAM, ks)
    first = lookup(pending, ks)  # shard 0 alone: its run ends at the first shard-1 key
    assert len(first.tiers) == shard_positions(ks, 1)[0] and pending.count == 1
    assert asked.wait(5)
    answer[0] = c.shards
    deadline = time.monotonic() + 5
    while pending.count == 1 and time.monotonic() < deadline:
        lookup(pending, ks)  # calls keep asking (at most every SETTLE_S) until settle answers
        time.sleep(0.05)
    assert pending.count == 2 and pending.masters[0] is c.shards[0]
    assert by_block(lookup(pending, ks)) == by_block(lookup(c.one, ks))
    pending.close()
