"""kvpool/node/shard_links.py: what one shard's link sees of a node's stores."""

from __future__ import annotations

import hashlib

import pytest

from kvpool.keys import BlockKey
from kvpool.node.shard_links import ShardLinks, ShardView, master_links
from kvpool.shards import shard_of
from kvpool.v1 import common_pb2
from kvpool.vocabulary import BlockMeta, Tier, TierStats


class FakeStore:
    def __init__(self, metas: list[BlockMeta]):
        self.metas = metas

    def contains(self, keys):
        held = {m.key for m in self.metas}
        return [k in held for k in keys]

    def inventory(self) -> list[BlockMeta]:
        return list(self.metas)

    def stats(self) -> TierStats:
        return TierStats(Tier.DRAM, capacity_bytes=1 << 20, used_bytes=len(self.metas) * 4096,
                         blocks=len(self.metas))


def metas(n: int) -> list[BlockMeta]:
    return [BlockMeta(BlockKey(hashlib.sha256(b"%d" % i).digest()), 4096, i) for i in range(n)]


@pytest.mark.parametrize("count", [2, 3])
def test_a_shard_view_inventories_only_its_shards_keys_in_order_and_passes_the_rest_through(count):
    store = FakeStore(metas(300))
    views = [ShardView(store, count, shard) for shard in range(count)]
    seen = [view.inventory() for view in views]
    for shard, held in enumerate(seen):
        assert held == [m for m in store.metas if shard_of(m.key, count) == shard]
    assert sum(len(h) for h in seen) == len(store.metas)
    keys = [store.metas[0].key, b"\0" * 32]
    assert views[0].contains(keys) == [True, False]  # any shard's key: the stores answer, the link filters
    assert views[1].stats() == store.stats()  # usage is the whole node's (membership is replicated)
    assert ShardView(FakeStore([]), count, 0).inventory() == []


def test_a_fixed_master_keeps_one_plain_link_and_shard_links_need_an_etcd_target():
    ref = common_pb2.NodeRef(node_id="n", address="127.0.0.1:1")
    link = master_links("127.0.0.1:1", ref, {Tier.DRAM: FakeStore([])}, dram_max_block_bytes=4096)
    try:
        assert not isinstance(link, ShardLinks)
    finally:
        link.stop(unregister=False)
    with pytest.raises(ValueError, match="not etcd://"):
        ShardLinks("127.0.0.1:1", ref, {Tier.DRAM: FakeStore([])})
