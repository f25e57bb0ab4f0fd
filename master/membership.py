"""Who is in the pool: registered nodes (with liveness and tier usage) and recently seen workers.

Invariants:

- A live node has exactly one :class:`NodeInfo`, keyed by node id, with a
  node number that the :class:`~kvpool.master.index.BlockIndex` has open.
  Slots count up from 0 and are never reused within one master process, so
  an index entry can never be mistaken for another node's.
- Every registration gets a fresh incarnation, strictly greater than any this
  process handed out and derived from ``time.time_ns()``, so incarnations
  from before a master restart are (practically) never accepted after it.
  Heartbeats and reports carry the incarnation; a mismatch answers "unknown"
  and the node registers again.
- Dropping a node (re-register, unregister, expiry) removes it from the
  membership table first, under the lock, and then drops its index entries
  outside the lock. Between the two, lookups may still see entries on its number;
  :meth:`Membership.refs` no longer resolves the number, and the caller treats
  that as a miss. Reports still in flight are refused by the closed number.
- A node silent (no heartbeat or report) for longer than ``node_timeout_s``
  is dropped by :meth:`Membership.expire`; a worker silent for longer than
  ``worker_timeout_s`` loses its HBM entries.
- Silence is counted only while the master itself ran: time it could not
  run (its sweeper woke that late: a stopped process, a starved or swapping
  host) is told to :meth:`Membership.stalled` and is not held against any
  node, whose heartbeats wait in its sockets meanwhile. A node's silence still
  grows by the sweeper's interval at every sweep, so a dead node is dropped
  however often the master stalls.
- Workers are known by their scoped ids (:mod:`kvpool.worker_ids`): one
  tenant's calls never refresh or count as another tenant's worker. A tenant
  has at most ``max_workers_per_tenant`` workers: a new one past it is a
  ValueError (INVALID_ARGUMENT) naming the setting, until one times out.

- Warm standby (:mod:`~kvpool.master.follower`): a standby mirrors its
  leader's nodes with :meth:`Membership.adopt` / :meth:`Membership.forget`
  (the leader's numbers and incarnations). Elected, it marks them all
  *inherited* (:meth:`Membership.inherit`): their silence counts from then,
  and their heartbeats and reports answer "unknown", so each node registers
  again and re-syncs. Re-registering an inherited node keeps its old number's
  entries (lookups hit them, resolved to the node) as *retiring* until the
  node's full sync completes (:meth:`Membership.synced`) or the new
  registration goes (dropped, expired, registered again): only then are they
  dropped. So lookups hit from the election on, and the index reconciles.

The lock is taken only with ``with``; the only calls made under it are the
constant-time :meth:`BlockIndex.open_node` and :meth:`HbmIndex.drop_worker`
(lock order: membership, then index).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvpool.master.index import BlockIndex, HbmIndex
from kvpool.vocabulary import NodeRef, Tier, TierStats
from kvpool.worker_ids import split_scoped_id

log = logging.getLogger(__name__)


@dataclass(slots=True)
class NodeInfo:
    """One registered node. Copies handed out by :class:`Membership` are snapshots."""

    ref: NodeRef
    number: int  # its node number in the BlockIndex (never reused)
    incarnation: int
    tiers: dict[Tier, TierStats]
    dram_max_block_bytes: int  # largest block its DRAM tier takes
    last_heartbeat: float  # time.monotonic()
    max_block_bytes: int = 0  # largest block it stores at all (on SSD if larger); 0: dram_max_block_bytes
    stalled_at_heartbeat: float = 0.0  # the master's stalled time (Membership.stalled) at its last heartbeat
    inherited: bool = False  # followed from the old leader: its calls answer "unknown" until it registers again
    retiring: int = -1  # the number of its inherited entries, kept until its full sync completes (-1: none)

    def snapshot(self) -> NodeInfo:
        return dataclasses.replace(self, tiers={t: dataclasses.replace(s) for t, s in self.tiers.items()})


class Membership:
    """Node and worker liveness; owns the node numbers of a :class:`BlockIndex`. Thread-safe."""

    def __init__(
        self,
        index: BlockIndex,
        hbm: HbmIndex,
        *,
        node_timeout_s: float,
        worker_timeout_s: float,
        max_workers_per_tenant: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if node_timeout_s <= 0 or worker_timeout_s <= 0:
            raise ValueError("node_timeout_s and worker_timeout_s must be positive")
        if max_workers_per_tenant < 1:
            raise ValueError("max_workers_per_tenant must be positive")
        self._index = index
        self._hbm = hbm
        self.node_timeout_s = node_timeout_s
        self.worker_timeout_s = worker_timeout_s
        self.max_workers_per_tenant = max_workers_per_tenant
        self._clock = clock
        self._lock = threading.Lock()
        self._nodes: dict[str, NodeInfo] = {}
        self._by_number: dict[int, NodeInfo] = {}
        self._workers: dict[str, float] = {}  # scoped worker id -> last seen (monotonic)
        self._tenant_workers: dict[str, int] = {}  # tenant -> how many of _workers are its
        self._next_number = 0
        self._last_incarnation = 0
        self._stalled_s = 0.0  # seconds the master did not run, in all (see stalled())

    def now(self) -> float:
        """The clock that heartbeat times are measured on."""
        return self._clock()

    # -- nodes --------------------------------------------------------------------------

    def register(self, ref: NodeRef, tiers: Iterable[TierStats], dram_max_block_bytes: int,
                 max_block_bytes: int = 0) -> NodeInfo:
        """Add (or re-add) a node; its previous incarnation's index entries are dropped first.

        Returns a snapshot of the new entry (its ``incarnation`` goes back to the node).
        """
        with self._lock:
            old = self._nodes.pop(ref.node_id, None)
            drop: list[int] = []  # numbers whose entries go now
            retiring = -1
            if old is not None:
                drop = [n for n in (old.retiring,) if n >= 0]
                for n in (old.number, *drop):
                    self._by_number.pop(n, None)
                if old.inherited:  # its entries stay, resolved to the node, until its full sync completes
                    retiring = old.number
                else:
                    drop.append(old.number)
            self._last_incarnation = max(time.time_ns(), self._last_incarnation + 1)
            info = NodeInfo(
                ref=ref,
                number=self._next_number,
                incarnation=self._last_incarnation,
                tiers={s.tier: s for s in tiers},
                dram_max_block_bytes=dram_max_block_bytes,
                last_heartbeat=self._clock(),
                max_block_bytes=max_block_bytes,
                stalled_at_heartbeat=self._stalled_s,
                retiring=retiring,
            )
            self._next_number += 1
            self._index.open_node(info.number)
            self._nodes[ref.node_id] = info
            self._by_number[info.number] = info
            if retiring >= 0:
                self._by_number[retiring] = info  # lookups of its inherited entries resolve to the node
            snapshot = info.snapshot()
        dropped = sum(self._index.drop_node(number) for number in drop)
        if old is not None:
            log.info("node %s re-registered: %s", ref.node_id,
                     f"dropped {dropped} entries of its previous incarnation" if retiring < 0 else
                     f"its inherited entries stay until its full sync completes (number {retiring})")
        return snapshot

    def heartbeat(self, node_id: str, incarnation: int, tiers: Iterable[TierStats] = ()) -> bool:
        """Mark a node alive and update its tier usage; False if no such node/incarnation is registered.

        An empty ``tiers`` keeps the usage last reported.
        """
        return self.touch(node_id, incarnation, tiers) is not None

    def touch(self, node_id: str, incarnation: int, tiers: Iterable[TierStats] = ()) -> int | None:
        """Like :meth:`heartbeat`, returning the node's number (None: unknown node or stale incarnation)."""
        usage = {s.tier: s for s in tiers}
        with self._lock:
            info = self._nodes.get(node_id)
            if info is None or info.incarnation != incarnation or info.inherited:
                return None
            info.last_heartbeat = self._clock()
            info.stalled_at_heartbeat = self._stalled_s
            if usage:
                info.tiers = usage
            return info.number

    def unregister(self, node_id: str, incarnation: int) -> bool:
        """Remove a node and its entries now; False (nothing changes) for an unknown node or stale incarnation."""
        with self._lock:
            info = self._nodes.get(node_id)
            if info is None or info.incarnation != incarnation:
                return False
            del self._nodes[node_id]
            numbers = self._unmap(info)
        for number in numbers:
            self._index.drop_node(number)
        return True

    def _unmap(self, info: NodeInfo) -> list[int]:
        """Remove a node's numbers (its own and a retiring one) from ``_by_number``; returns them (lock held)."""
        numbers = [n for n in (info.number, info.retiring) if n >= 0]
        for number in numbers:
            self._by_number.pop(number, None)
        return numbers

    def stalled(self, seconds: float) -> None:
        """The master did not run for ``seconds`` (its sweeper woke that late): no node's silence counts them."""
        if not seconds >= 0:
            raise ValueError(f"stalled: {seconds} is no number of seconds")
        with self._lock:
            self._stalled_s += seconds

    def _silent_for(self, info: NodeInfo, now: float) -> float:
        """How long ``info`` has been silent while the master ran (caller holds the lock)."""
        return now - info.last_heartbeat - (self._stalled_s - info.stalled_at_heartbeat)

    def expire(self, now: float | None = None) -> list[str]:
        """Drop nodes silent longer than ``node_timeout_s`` (not counting the master's own stalls) and forget
        workers silent longer than ``worker_timeout_s``; returns the dropped node ids."""
        now = self._clock() if now is None else now
        with self._lock:
            dead = [(info, self._silent_for(info, now)) for info in self._nodes.values()
                    if self._silent_for(info, now) > self.node_timeout_s]
            for info, _ in dead:
                del self._nodes[info.ref.node_id]
                self._unmap(info)
            gone_workers = [w for w, seen in self._workers.items() if now - seen > self.worker_timeout_s]
            for worker in gone_workers:
                del self._workers[worker]
                self._forget_one(split_scoped_id(worker)[0])
                self._hbm.drop_worker(worker)  # under the lock: a worker seen again cannot lose a fresh report
        for info, silent in dead:
            dropped = sum(self._index.drop_node(n) for n in (info.number, info.retiring) if n >= 0)
            stalls = now - info.last_heartbeat - silent
            log.warning(
                "node %s (%s) silent for %.1fs%s: dropped with %d index entries",
                info.ref.node_id, info.ref.address, silent,
                f" (and {stalls:.1f}s while the master itself stalled)" if stalls >= 0.05 else "", dropped,
            )
        return [info.ref.node_id for info, _ in dead]

    def drop_all(self) -> int:
        """Forget every node (with its index entries) and worker: a master that stops leading keeps no state, so
        that leading again starts from the nodes' full reports. Returns how many nodes went."""
        with self._lock:
            gone = list(self._nodes.values())
            self._nodes.clear()
            self._by_number.clear()
            self._workers.clear()
            self._tenant_workers.clear()
            self._hbm.clear()
        for info in gone:
            for number in (info.number, info.retiring):
                if number >= 0:
                    self._index.drop_node(number)
        return len(gone)

    # -- warm standby (see the module docstring) ----------------------------------------

    def adopt(self, ref: NodeRef, number: int, incarnation: int, tiers: Iterable[TierStats],
              dram_max_block_bytes: int, max_block_bytes: int) -> None:
        """Mirror the leader's registration of a node as number ``number`` (a standby following its log):
        a previous number of the node goes with its entries; the same number again only updates the node."""
        with self._lock:
            old = self._nodes.get(ref.node_id)
            if old is not None and old.number > number:
                return  # the snapshot already holds a later registration (the log replays an earlier one)
            drop = [] if old is None or old.number == number else self._unmap(old)
            info = NodeInfo(ref=ref, number=number, incarnation=incarnation, tiers={s.tier: s for s in tiers},
                            dram_max_block_bytes=dram_max_block_bytes, last_heartbeat=self._clock(),
                            max_block_bytes=max_block_bytes, stalled_at_heartbeat=self._stalled_s)
            if old is None or old.number != number:
                self._index.open_node(number)
            self._nodes[ref.node_id] = info
            self._by_number[number] = info
            self._next_number = max(self._next_number, number + 1)
            self._last_incarnation = max(self._last_incarnation, incarnation)
        for n in drop:
            self._index.drop_node(n)

    def forget(self, node_id: str) -> int:
        """Mirror the leader dropping a node (unregistered or expired) with its entries; returns how many went."""
        with self._lock:
            info = self._nodes.pop(node_id, None)
            numbers = self._unmap(info) if info is not None else []
        return sum(self._index.drop_node(n) for n in numbers)

    def inherit(self) -> int:
        """This standby was elected with its leader's nodes: mark them inherited (see the module docstring), their
        silence counted from now. Returns how many."""
        with self._lock:
            now = self._clock()
            for info in self._nodes.values():
                info.inherited = True
                info.last_heartbeat = now
                info.stalled_at_heartbeat = self._stalled_s
            return len(self._nodes)

    def synced(self, node_id: str, incarnation: int) -> int:
        """The node's full sync completed: its retiring entries go. Returns how many."""
        with self._lock:
            info = self._nodes.get(node_id)
            if info is None or info.incarnation != incarnation or info.retiring < 0:
                return 0
            number, info.retiring = info.retiring, -1
            self._by_number.pop(number, None)
        return self._index.drop_node(number)

    def live_nodes(self) -> list[NodeInfo]:
        """Snapshots of all registered nodes, in registration order."""
        with self._lock:
            return [info.snapshot() for info in self._nodes.values()]

    def refs(self, numbers: Iterable[int]) -> dict[int, NodeRef]:
        """Addresses of the given node numbers; numbers of dropped nodes are absent."""
        with self._lock:
            return {n: self._by_number[n].ref for n in set(numbers) if n in self._by_number}

    def node_count(self) -> int:
        with self._lock:
            return len(self._nodes)

    # -- workers ------------------------------------------------------------------------

    def worker_seen(self, worker: str) -> None:
        """Note that a worker (its scoped id) is alive: it reported its HBM or looked something up.

        ValueError for a new worker of a tenant that has ``max_workers_per_tenant`` already.
        """
        now = self._clock()
        tenant = split_scoped_id(worker)[0]
        with self._lock:
            if worker not in self._workers:
                count = self._tenant_workers.get(tenant, 0)
                if count >= self.max_workers_per_tenant:
                    whose = f"tenant {tenant!r} has" if tenant else "the master has"
                    raise ValueError(f"{whose} {count} workers, max_workers_per_tenant: a new worker is refused "
                                     f"until one is silent for worker_timeout_s ({self.worker_timeout_s:g} s)")
                self._tenant_workers[tenant] = count + 1
            self._workers[worker] = now

    def _forget_one(self, tenant: str) -> None:
        """One worker of ``tenant`` went (lock held)."""
        left = self._tenant_workers[tenant] - 1
        if left:
            self._tenant_workers[tenant] = left
        else:
            del self._tenant_workers[tenant]

    def worker_count(self) -> int:
        with self._lock:
            return len(self._workers)
