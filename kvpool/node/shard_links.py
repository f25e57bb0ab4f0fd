"""A node's links to a sharded cluster: one :class:`~kvpool.node.master_link.MasterLink` per index shard.

A node whose master is ``etcd://HOSTS/CLUSTER`` reads the cluster's shard map
(:func:`kvpool.shards.settled_shard_map`) and keeps one link per shard, each
following that shard's leader (``MasterConnection(..., shard=K)``). A node
with a fixed ``host:port`` master keeps one plain link (:func:`master_links`).

Invariants:

- Membership is replicated: every link registers, heartbeats and sends usage
  to its own shard's leader, so each shard leader knows every node and its
  liveness on its own.
- Each link reports only its shard's keys: store changes are split by
  :func:`kvpool.shards.shard_of` before they are queued, and a link's full
  sync sends the inventory filtered to its shard (:class:`ShardView`). With
  one shard nothing is split or filtered: the one link sees the stores as
  they are.
- The links are independent (a thread pair and a connection each): a shard
  leader the node cannot reach delays or drops only that shard's link, which
  registers again and re-syncs its shard when the leader answers; the other
  shards keep hearing heartbeats and reports.
- The shard count is read once, once it is settled: a node started before
  any master of its cluster (no map, and no leader of shard 0 yet:
  :func:`kvpool.shards.settled_shard_map`) waits for one, so that it never
  takes a sharded cluster for one shard. etcd refusing the node's credentials
  is the same start-up ValueError a single link gives; etcd unreachable or no
  master yet at start is not: the node starts, and the links are made and started once etcd answers
  (until then ``registered`` is False, ``flush`` returns False and store
  changes are not queued: each link's registration snapshot covers them).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from kvpool.etcd import EtcdAccess, EtcdClient, EtcdRefused, EtcdTarget
from kvpool.keys import BlockKey
from kvpool.node.master_link import InventoryStore, MasterLink
from kvpool.shards import settled_shard_map, shards_of_packed, split_by_shard
from kvpool.tiers.base import ChangeListener
from kvpool.v1 import common_pb2
from kvpool.vocabulary import BlockMeta, Tier, TierStats

log = logging.getLogger(__name__)

MAP_RETRY_S = 0.5  # etcd unreachable at start: the shard map is read again this often


class ShardView:
    """A tier store as one shard's link sees it: its inventory holds only that shard's keys."""

    def __init__(self, store: InventoryStore, count: int, shard: int):
        self._store, self._count, self._shard = store, count, shard

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        return self._store.contains(keys)

    def inventory(self) -> list[BlockMeta]:
        held = self._store.inventory()
        if not held:
            return held
        mine = np.flatnonzero(shards_of_packed(b"".join(m.key for m in held), self._count) == self._shard)
        return [held[i] for i in mine.tolist()]

    def stats(self) -> TierStats:
        return self._store.stats()


class ShardLinks:
    """One :class:`MasterLink` per index shard of an ``etcd://`` cluster, with the surface the daemon uses
    (see the module docstring)."""

    def __init__(self, master: str, node_ref: common_pb2.NodeRef, stores: Mapping[Tier, InventoryStore], *,
                 etcd_access: EtcdAccess | None = None, **link_options: Any):
        target = EtcdTarget.parse(master)
        if target is None:
            raise ValueError(f"ShardLinks: master {master!r} is not etcd://HOSTS/CLUSTER")
        self.master = master
        self._target = target
        self._node_ref = node_ref
        self._stores = dict(stores)
        self._access = etcd_access
        self._options = link_options
        self._lock = threading.Lock()
        self._links: list[MasterLink] | None = None  # made once the shard count is known
        self._said_waiting = False  # "no master yet" was logged
        self._listeners: dict[Tier, list[ChangeListener]] = {}  # per tier, each link's listener, by shard
        self._started = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        rpc_timeout = float(link_options.get("rpc_timeout_s", 2.0))
        self._etcd = EtcdClient(target.endpoints, timeout_s=min(rpc_timeout, 2.0), access=etcd_access)
        try:
            count = self._read_count()
            if count is not None:
                self._make(count)
        except BaseException:
            self._etcd.close()
            raise
        if count is not None:
            self._etcd.close()  # read once: each link follows its leader with its own connection's etcd client

    # -- the daemon's surface -------------------------------------------------------------

    @property
    def links(self) -> list[MasterLink]:
        """The per-shard links, by shard (empty until the shard count is known)."""
        return list(self._links or [])

    @property
    def registered(self) -> bool:
        """Registered with every shard's leader (and each has this node's whole inventory of its shard)."""
        links = self._links
        return links is not None and len(links) > 0 and all(link.registered for link in links)

    @property
    def registrations(self) -> int:
        return sum(link.registrations for link in self._links or [])

    def listener(self, tier: Tier) -> ChangeListener:
        """The ``on_change`` for the store of ``tier``: each shard's part of the change goes to its link."""
        if tier not in self._stores:
            raise ValueError(f"master links have no {tier.label} store")

        def on_change(added: Sequence[BlockMeta], removed: Sequence[BlockKey]) -> None:
            listeners = self._listeners.get(tier) if self._links is not None else None
            if listeners is None:  # no links yet: their registrations' snapshots cover this change
                return
            if len(listeners) == 1:
                listeners[0](added, removed)
                return
            count = len(listeners)
            adds = split_by_shard([m.key for m in added], count) if added else None
            gone = split_by_shard(removed, count) if removed else None
            for shard, call in enumerate(listeners):
                part_added = [added[i] for i in adds[shard]] if adds is not None else []
                part_removed = [removed[i] for i in gone[shard]] if gone is not None else []
                if part_added or part_removed:
                    call(part_added, part_removed)

        return on_change

    def start(self) -> None:
        """Start every link; if the shard count is not known yet, a thread reads it, then makes and starts them."""
        with self._lock:
            if self._started:
                raise RuntimeError("master links already started")
            self._started = True
            links = self._links
        if links is not None:
            for link in links:
                link.start()
            return
        self._thread = threading.Thread(target=self._wait_for_map, name="kvpool-shard-map", daemon=True)
        self._thread.start()

    def flush(self) -> bool:
        """Send every link's queued changes now; True if every shard's leader has them (each link is flushed,
        whatever the others answer)."""
        links = self._links
        if not links:
            return False
        done = [link.flush() for link in links]
        return all(done)

    def stop(self, unregister: bool = True) -> None:
        """Stop every link (each tells its leader we leave, best effort); idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            links = self._links or []
        for link in links:
            link.stop(unregister=unregister)
        self._etcd.close()

    # -- inside ---------------------------------------------------------------------------

    def _read_count(self) -> int | None:
        """The cluster's shard count; None while it is not settled (no master has started:
        :func:`~kvpool.shards.settled_shard_map`) or etcd cannot be reached. ValueError if etcd refuses us."""
        try:
            found = settled_shard_map(self._etcd, self._target.cluster)
            if found is None and not self._said_waiting:
                log.info("node: no master of %s has started yet; waiting for one to learn its shard count",
                         self.master)
                self._said_waiting = True
            return found.count if found is not None else None
        except EtcdRefused as exc:
            raise ValueError(f"etcd refused to name the master of {self.master}: {exc.details()}") from None
        except grpc.RpcError as exc:
            log.warning("node: cannot read the shard map of %s (%s); retrying", self.master, exc.code().name)
            return None
        except ValueError as exc:  # a map that is not one: say so, and read again later
            log.warning("node: %s", exc)
            return None

    def _make(self, count: int) -> list[MasterLink]:
        links = [MasterLink(self.master, self._node_ref,
                            {t: ShardView(s, count, k) if count > 1 else s for t, s in self._stores.items()},
                            etcd_access=self._access, shard=k, **self._options) for k in range(count)]
        self._listeners = {tier: [link.listener(tier) for link in links] for tier in self._stores}
        self._links = links
        if count > 1:
            log.info("node: %s has %d index shards: one master link each", self.master, count)
        return links

    def _wait_for_map(self) -> None:
        while not self._stop.wait(MAP_RETRY_S):
            try:
                count = self._read_count()
            except ValueError as exc:  # refused now: keep trying (the credentials or roles may be fixed)
                log.warning("node: %s", exc)
                continue
            if count is None:
                continue
            with self._lock:
                if self._stop.is_set():
                    return
                try:
                    links = self._make(count)
                except ValueError as exc:
                    log.warning("node: %s", exc)
                    continue
            self._etcd.close()
            for link in links:
                link.start()
            return


def master_links(master: str, node_ref: common_pb2.NodeRef, stores: Mapping[Tier, InventoryStore],
                 **options: Any) -> MasterLink | ShardLinks:
    """The node's link(s) to its master: :class:`ShardLinks` for an ``etcd://`` cluster, else one
    :class:`MasterLink`."""
    if EtcdTarget.parse(master) is not None:
        return ShardLinks(master, node_ref, stores, **options)
    return MasterLink(master, node_ref, stores, **options)
