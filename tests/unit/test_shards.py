"""The shard rule and the shard map's encoding (kvpool/shards.py)."""

import hashlib

import pytest

from kvpool.etcd import leader_key, members_prefix
from kvpool.shards import MAX_SHARDS, ShardMap, foreign_keys, shard_of, shards_of_packed, split_by_shard


def keys(n: int) -> list[bytes]:
    return [hashlib.sha256(str(i).encode()).digest() for i in range(n)]


def test_one_shard_owns_every_key_and_keeps_the_unsharded_etcd_keys():
    assert {shard_of(k, 1) for k in keys(100)} == {0}
    assert leader_key("prod") == leader_key("prod", 0) == b"/kvpool/prod/master/leader"
    assert members_prefix("prod", 0) == b"/kvpool/prod/master/members/"
    assert leader_key("prod", 3) == b"/kvpool/prod/shard/3/master/leader"
    assert not members_prefix("prod", 1).startswith(members_prefix("prod", 0))


@pytest.mark.parametrize("count", [2, 3, 16])
def test_keys_spread_evenly_and_split_keeps_order(count):
    ks = keys(8000)
    parts = split_by_shard(ks, count)
    assert sorted(i for part in parts for i in part) == list(range(len(ks)))
    for shard, part in enumerate(parts):
        assert part == sorted(part)
        assert all(shard_of(ks[i], count) == shard for i in part)
        assert abs(len(part) - len(ks) / count) < 0.1 * len(ks) / count


def test_the_map_round_trips_and_refuses_nonsense():
    assert ShardMap.decode(ShardMap(4).encode()) == ShardMap(4)
    for bad in (b"", b"{}", b'{"shards": 0}', b'{"shards": "x"}', b"[1]"):
        with pytest.raises(ValueError):
            ShardMap.decode(bad)
    with pytest.raises(ValueError):
        ShardMap(MAX_SHARDS + 1)


@pytest.mark.parametrize("count", [1, 2, 3, 256])
def test_the_packed_rule_is_shard_of_and_counts_foreign_keys(count):
    some = keys(500)
    packed = b"".join(some)
    assert shards_of_packed(packed, count).tolist() == [shard_of(k, count) for k in some]
    for shard in range(min(count, 3)):
        assert foreign_keys(packed, count, shard) == sum(shard_of(k, count) != shard for k in some)
    assert foreign_keys(b"", count, 0) == 0
