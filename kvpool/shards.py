"""Index shards: which master group owns which block keys, and where the shard map lives.

The key space of a cluster is cut into ``count`` shards by a key's first
eight bytes (keys are sha256 outputs, so shards are even). Each shard is one
master group (a leader and its standbys) elected on etcd under
:func:`kvpool.etcd.leader_key` ``(cluster, shard)``; shard 0 uses the keys an
unsharded cluster has always used, so one shard is exactly the old cluster.

Invariants:

- :func:`shard_of` is the one rule that maps a key to its shard; nodes
  (reports), clients (lookups, exists, scores, HBM reports) and masters (the
  guard on what they accept) all call it, and it depends on nothing but the
  key and the count.
- The key a shard is computed on is the *stored* key: the key as the node
  stores it and reports it, and as the master's index holds it. With auth
  off that is the key as the client sent it. With an auth file a tenant's
  client key is stored as ``(key & KEEP) ^ mask(tenant)``
  (:func:`kvpool.auth.mask_keys`; nodes and masters map a client's keys with
  :func:`kvpool.auth.caller_keys`), and the mask changes the first eight
  bytes, so a client of a tenant computes ``shard_of(mask_keys(key,
  tenant_mask))``, with the ``tenant_mask`` its master's ``Info`` tells it,
  never ``shard_of(key)``. Nodes (:mod:`kvpool.node.shard_links`) and the
  masters' guard (:func:`foreign_keys` over ``ReportBlocks``) see stored
  keys only. This holds for every keyed call a client splits: Lookup,
  Exists, Score, ReportHbm and NameBlocks (an engine's name is kept only by
  the shard whose index holds the key, and only that shard's KV events name
  it).
- The shard map (:class:`ShardMap`) is one etcd key per cluster,
  :func:`shard_map_key`. Absent means one shard once shard 0 has a leader
  (:func:`settled_shard_map`: nodes and clients wait for that). The first master started with
  a count writes it (create-if-absent); a master started with another count
  refuses to start: changing the count of a live cluster would move keys
  between groups, which is not supported (docs/scaling.md).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.etcd import EtcdClient, cluster_prefix, leader_key
from kvpool.keys import KEY_BYTES

MAX_SHARDS = 256


def check_count(count: int) -> int:
    """A shard count: 1 to :data:`MAX_SHARDS`."""
    if not 1 <= count <= MAX_SHARDS:
        raise ValueError(f"shard count {count}: use 1 to {MAX_SHARDS}")
    return count


def shard_of(key: bytes, count: int) -> int:
    """The shard that owns ``key`` in a cluster of ``count`` shards."""
    return 0 if count == 1 else int.from_bytes(key[:8], "big") % count


def split_by_shard(keys: Sequence[bytes], count: int) -> list[list[int]]:
    """For each shard, the positions in ``keys`` of the keys it owns, in ``keys``' order."""
    positions: list[list[int]] = [[] for _ in range(count)]
    if count == 1:
        positions[0] = list(range(len(keys)))
        return positions
    for i, key in enumerate(keys):
        positions[int.from_bytes(key[:8], "big") % count].append(i)
    return positions


def shards_of_packed(packed: bytes, count: int) -> np.ndarray:
    """:func:`shard_of` of each key in ``packed`` (keys of ``KEY_BYTES`` each, back to back), in one numpy pass."""
    if count == 1:
        return np.zeros(len(packed) // KEY_BYTES, dtype=np.uint64)
    heads = np.frombuffer(packed, dtype=">u8")[:: KEY_BYTES // 8]  # each key's first 8 bytes, big-endian
    return heads % np.uint64(count)


def foreign_keys(packed: bytes, count: int, shard: int) -> int:
    """How many keys in ``packed`` belong to a shard other than ``shard`` (of ``count``)."""
    if count == 1 or not packed:
        return 0
    return int(np.count_nonzero(shards_of_packed(packed, count) != np.uint64(shard)))


def shard_map_key(cluster: str) -> bytes:
    """The etcd key that holds ``cluster``'s :class:`ShardMap`."""
    return cluster_prefix(cluster) + b"shards"


@dataclass(frozen=True)
class ShardMap:
    """How many shards a cluster's index is cut into."""

    count: int = 1

    def __post_init__(self) -> None:
        check_count(self.count)

    def encode(self) -> bytes:
        return json.dumps({"shards": self.count}).encode()

    @staticmethod
    def decode(value: bytes) -> ShardMap:
        """The map in an etcd value; ValueError naming the value if it is not one."""
        try:
            return ShardMap(int(json.loads(value)["shards"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"shard map {value[:100]!r} is not {{\"shards\": N}}: {exc}") from None


def read_shard_map(etcd: EtcdClient, cluster: str, timeout: float | None = None) -> ShardMap:
    """``cluster``'s shard map; one shard where none was written."""
    kv = etcd.get(shard_map_key(cluster), timeout=timeout)
    return ShardMap() if kv is None else ShardMap.decode(kv.value)


def settled_shard_map(etcd: EtcdClient, cluster: str, timeout: float | None = None) -> ShardMap | None:
    """``cluster``'s shard map once it is settled, None before (no master of the cluster has started yet).

    A written map is settled. No map means one shard only once shard 0 has a leader: a master writes the
    map before it campaigns, so a leader without a map leads an unsharded cluster, while a node or client
    started before any master could otherwise take a sharded cluster for one shard. The leader key is read
    first and the map after it, so a map written before that leader's election is always seen."""
    leader = etcd.get(leader_key(cluster, 0), timeout=timeout)
    kv = etcd.get(shard_map_key(cluster), timeout=timeout)
    if kv is not None:
        return ShardMap.decode(kv.value)
    return ShardMap() if leader is not None else None


def publish_shard_map(etcd: EtcdClient, cluster: str, count: int, timeout: float | None = None) -> ShardMap:
    """Write ``cluster``'s shard map with ``count`` shards unless one is there; ValueError if the one there
    says another count. A cluster with no map and ``count == 1`` is left without one (one shard either way)."""
    check_count(count)
    if count > 1 and etcd.create(shard_map_key(cluster), ShardMap(count).encode(), lease=0, timeout=timeout) is None:
        return ShardMap(count)
    found = read_shard_map(etcd, cluster, timeout)
    if found.count != count:
        raise ValueError(f"cluster {cluster!r} has {found.count} index shard(s) in etcd, this master was started "
                         f"with {count}: the count of a live cluster cannot change (docs/scaling.md)")
    return found
