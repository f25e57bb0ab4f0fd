"""The pool node's link to the master: registration, heartbeats, inventory reports.

The master holds soft state only, so the node is the source of truth and the
link's job is to keep the master's picture of this node whole:

- Register (NodeRef, tier usage, slot size), then report everything held with
  ``ReportBlocks(full_sync=True)`` per tier (chunks of at most ``chunk_keys``
  keys, fewer if the master's registration reply says it takes fewer in one
  call: the first chunk replaces, later ones add). Only then is the link
  ``registered``.
- A background thread sends queued inventory changes promptly (a
  :class:`~kvpool.node.report_window.ReportWindow` after the first change: 2 ms
  when quiet, widening up to 100 ms while reports are in flight or the master
  answers slowly, so a burst of puts is one report and a busy node's calls per
  second fall as its put rate rises: puts do not wait for it, and on a small
  machine each report costs the puts CPU). :meth:`MasterLink.flush` sends them synchronously (``FlushReports``,
  a writer's barrier, and ``Remove``).
- Heartbeats have a thread of their own, at the interval the master returned,
  from the moment ``RegisterNode`` answers: no report, full sync, lock or
  slow call of the other thread can delay them (a node the master dropped
  while its full sync ran, or while a report waited on a stalled master, lost
  every block it had reported).
- Stores report changes through ``on_change`` after commit, outside their
  locks, so two batches may arrive out of order. The link therefore queues
  only *which* keys changed (with the size and checksum of the latest add
  event, if any) and, when sending, re-checks ``contains``: a key held now is
  reported added, a key not held is reported removed. A key held now whose
  queue entry has no add event was reported added earlier (its add event
  follows the change that made it present, so an earlier send saw it held).
  Whatever order events arrive in, the last send after the last change tells
  the truth.
- ``known = false`` from the master (it restarted, or timed us out), or calls
  failing for longer than the master's ``node_timeout_s`` (it has dropped us
  by then), drops the registration; the thread registers again with backoff
  (capped at ``retry_cap_s``) and re-syncs everything. A call that fails
  sooner (a slow or briefly unreachable master; with an ``etcd://`` master it
  also makes the link read the leader again: :mod:`kvpool.master_client`)
  keeps the registration, and a report that failed goes back into the queue
  for the next send: a busy host costs a retry, not a re-registration that
  makes the master forget the node's blocks until the re-sync. While
  unregistered, changes are not queued (the re-sync's snapshot, taken after
  queueing resumes, covers them), so an outage costs no memory beyond the
  changes of ``node_timeout_s``. The master being down never raises into the
  node: flush just returns False.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import grpc

from kvpool.etcd import EtcdAccess
from kvpool.keys import BlockKey
from kvpool.master_client import MasterApi, MasterConnection
from kvpool.node.report_window import ReportWindow
from kvpool.rpc import proto_tier, tier_usage
from kvpool.tcp import ConnectionPool
from kvpool.tiers.base import ChangeListener
from kvpool.tls import client_context
from kvpool.v1 import common_pb2, master_pb2
from kvpool.vocabulary import BlockMeta, Tier, TierStats
from kvpool.wire import auth_hello

log = logging.getLogger(__name__)

CHUNK_KEYS = 50_000
_UNSTATED_MAX_KEYS = 65536  # a master that states no max_keys_per_call (one from before the field) takes this
RETRY_S = 0.25  # a failed heartbeat is tried again this soon (not a whole interval later)
# Reconnect quickly after a master restart (gRPC's default backoff grows to minutes).
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class InventoryStore(Protocol):
    """What the link needs of a tier store."""

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]: ...

    def inventory(self) -> list[BlockMeta]: ...

    def stats(self) -> TierStats: ...


class _NotKnown(Exception):
    """The master answered known = false: register again."""


_UNKNOWN = "unknown node"  # what _heartbeat says when the master answered known = false


class MasterLink:
    """Keeps the master's index of one node whole (see the module docstring)."""

    def __init__(
        self,
        master: str,
        node_ref: common_pb2.NodeRef,
        stores: Mapping[Tier, InventoryStore],
        *,
        dram_max_block_bytes: int,
        max_block_bytes: int = 0,
        max_message_bytes: int = 64 << 20,
        rpc_timeout_s: float = 2.0,
        retry_cap_s: float = 1.0,
        chunk_keys: int = CHUNK_KEYS,
        token: str = "",
        tls_ca: str = "",
        etcd_access: EtcdAccess | None = None,
        shard: int = 0,
    ):
        self.master = master
        self.shard = shard  # with an etcd:// master: the index shard whose leader this link follows
        self.node_ref = node_ref  # may be completed (bound address) until start()
        self._stores = dict(stores)
        self._dram_max_block_bytes = dram_max_block_bytes
        self._max_block_bytes = max_block_bytes  # 0: dram_max_block_bytes (no SSD)
        self._timeout = rpc_timeout_s
        self._retry_cap = retry_cap_s
        self._chunk_most = chunk_keys
        self._chunk = chunk_keys  # the keys one report names: chunk_keys, or less if the master takes less
        # token: a node token for the master (auth on); tls_ca: the master speaks TLS
        self._calls = ConnectionPool(rpc_timeout_s, tls=client_context(tls_ca) if tls_ca else None,
                                     hello=auth_hello(token) if token else None)
        # The master, or the leader etcd names (followed when it moves: the link then registers with it). Reports
        # go over fast calls; the rest over gRPC. etcd refusing etcd_access is a ValueError: the node does not start.
        self._master: MasterApi = MasterConnection(
            master, pool=self._calls, timeout_s=rpc_timeout_s, max_message_bytes=max_message_bytes, token=token,
            tls_ca=tls_ca, options=_RECONNECT_OPTIONS, etcd_access=etcd_access, refuse_start=True, shard=shard)
        self._pending_lock = threading.Lock()
        self._pending: dict[Tier, dict[BlockKey, BlockMeta | None]] = {t: {} for t in self._stores}
        self._send_lock = threading.Lock()  # one conversation with the master at a time, in order
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beats: threading.Thread | None = None
        # Registration state, changed under _pending_lock: _collect and _beating from RegisterNode's answer until
        # the link is lost, _registered once the full sync is sent too.
        self._registered = False
        self._collect = False  # queue changes?
        self._beating = False  # heartbeat the incarnation?
        self._incarnation = 0
        self._interval = 1.0
        self._node_timeout = 3.0  # the master's, from RegisterNode: calls failing this long lose the registration
        self._failing_since: float | None = None  # reports have failed since then (monotonic)
        self._warned = False
        self.registrations = 0  # successful (re-)registrations, for tests and logs
        self.window = ReportWindow()  # how long changes gather before a report (the report thread's)

    # -- what the stores call ------------------------------------------------------------

    def listener(self, tier: Tier) -> ChangeListener:
        """The ``on_change`` callback for the store of ``tier``: queue, wake the thread, return."""
        if tier not in self._stores:
            raise ValueError(f"master link has no {tier.label} store")

        def on_change(added: Sequence[BlockMeta], removed: Sequence[BlockKey]) -> None:
            with self._pending_lock:
                if not self._collect:  # not registered: the next registration's snapshot covers this
                    return
                pending = self._pending[tier]
                for key in removed:
                    pending.setdefault(key, None)  # keep a meta heard of before: events may be out of order
                for meta in added:
                    pending[meta.key] = meta
            self._wake.set()

        return on_change

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def registered(self) -> bool:
        return self._registered

    @property
    def incarnation(self) -> int:
        return self._incarnation

    def start(self) -> None:
        """Start the background thread; it registers (retrying until the master answers)."""
        if self._thread is not None:
            raise RuntimeError("master link already started")
        self._thread = threading.Thread(target=self._run, name="kvpool-master-link", daemon=True)
        self._beats = threading.Thread(target=self._heartbeats, name="kvpool-heartbeat", daemon=True)
        self._thread.start()
        self._beats.start()

    def stop(self, unregister: bool = True) -> None:
        """Stop the thread, then tell the master we are leaving (best effort); idempotent."""
        self._stop.set()
        self._wake.set()
        for thread in (self._thread, self._beats):
            if thread is not None:
                thread.join(timeout=10)
        with self._send_lock:  # after this, flush() returns False without touching the channel
            if unregister and self._registered:
                try:
                    self._master.unregister_node(
                        master_pb2.UnregisterNodeRequest(node_id=self.node_ref.node_id, incarnation=self._incarnation),
                        timeout=min(self._timeout, 1.0),
                    )
                except grpc.RpcError as exc:
                    log.info("node %s: unregister failed (%s); the master will time us out",
                             self.node_ref.node_id, _status(exc))
            self._drop_registration()
            self._master.close()
            self._calls.close()

    def flush(self) -> bool:
        """Send queued inventory changes now; True if the master has them all.

        Returns False at once while not registered (registration re-syncs everything).
        """
        if not self._registered:
            return False
        with self._send_lock:
            if not self._registered:
                return False
            return self._send_pending()

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        """Registration and reports (heartbeats are :meth:`_heartbeats`')."""
        backoff = 0.05
        quiet_since = time.monotonic()  # when the last report went (the window narrows as it grows quiet)
        while not self._stop.is_set():
            if not self._registered:
                if not self._register():
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, self._retry_cap)
                    continue
                backoff = 0.05
            self._wake.clear()
            with self._pending_lock:
                had = any(self._pending.values())
            started = time.monotonic()
            self.flush()
            if had:  # a report went: widen the window if it was busy (see ReportWindow)
                quiet_since = time.monotonic()
                self.window.sent(quiet_since - started, self._wake.is_set())
            # a change wakes us; a report that failed is tried again an interval later
            if self._registered and self._wake.wait(self._interval):
                # let a burst of puts gather: one report for all of them
                self._stop.wait(self.window.woke(time.monotonic() - quiet_since))

    def _heartbeats(self) -> None:
        """The heartbeat thread: every interval while an incarnation is to be kept alive, and nothing else."""
        beating, last_ok = 0, time.monotonic()  # the incarnation beaten for, and its last answered heartbeat
        while True:
            with self._pending_lock:
                incarnation = self._incarnation if self._beating else 0
            started = time.monotonic()
            if incarnation != beating:
                beating, last_ok = incarnation, started
            wait = self._interval
            if incarnation:
                failed = self._heartbeat(incarnation)
                now = time.monotonic()
                if failed is None:
                    last_ok = now
                elif failed == _UNKNOWN:
                    self._lost("master does not know us (restarted, or timed us out)", incarnation)
                elif now - last_ok > self._node_timeout:
                    self._lost(f"no heartbeat answered for {now - last_ok:.1f}s ({failed})", incarnation)
                else:  # a slow or briefly unreachable master: keep the registration, try again soon
                    log.debug("node %s: heartbeat failed (%s); trying again", self.node_ref.node_id, failed)
                    wait = RETRY_S
            if self._stop.wait(max(0.0, started + wait - time.monotonic())):
                return

    def _usage(self) -> list[common_pb2.TierUsage]:
        return [tier_usage(store.stats()) for store in self._stores.values()]

    def _register(self) -> bool:
        with self._send_lock:
            try:
                reply = self._master.register_node(
                    master_pb2.RegisterNodeRequest(node=self.node_ref, tiers=self._usage(),
                                                   dram_max_block_bytes=self._dram_max_block_bytes,
                                                   max_block_bytes=self._max_block_bytes),
                    timeout=self._timeout,
                )
                if reply.heartbeat_interval_s > 0:
                    self._interval = reply.heartbeat_interval_s
                if reply.node_timeout_s > 0:
                    self._node_timeout = reply.node_timeout_s
                # a report names at most what this master takes in one call (an operator may lower it)
                self._chunk = min(self._chunk_most, reply.max_keys_per_call or _UNSTATED_MAX_KEYS)
                self._failing_since = None
                with self._pending_lock:  # the snapshots below cover everything changed so far
                    self._incarnation = reply.incarnation
                    self._collect = self._beating = True  # heartbeats from now on, through the full sync
                    for pending in self._pending.values():
                        pending.clear()
                blocks = 0
                tiers = list(self._stores.items())
                for n, (tier, store) in enumerate(tiers):
                    held = store.inventory()
                    self._report(tier, held, (), full_sync=True, sync_complete=n == len(tiers) - 1)
                    blocks += len(held)
                with self._pending_lock:  # unless the heartbeat thread lost this incarnation meanwhile
                    self._registered = self._beating and self._incarnation == reply.incarnation
                if not self._registered:
                    raise _NotKnown()
            except (grpc.RpcError, _NotKnown) as exc:
                self._drop_registration()
                level = logging.DEBUG if self._warned else logging.WARNING  # once per outage
                self._warned = True
                log.log(level, "node %s: cannot register with master %s (%s); retrying",
                        self.node_ref.node_id, self.master, _status(exc))
                return False
            self._warned = False
            self.registrations += 1
        log.info("node %s: registered with master %s (incarnation %d, %d blocks reported)",
                 self.node_ref.node_id, self.master, self._incarnation, blocks)
        return True

    def _heartbeat(self, incarnation: int) -> str | None:
        """One heartbeat; None if the master answered that it knows us, else what went wrong."""
        try:
            reply = self._master.heartbeat(
                master_pb2.HeartbeatRequest(node_id=self.node_ref.node_id, incarnation=incarnation,
                                            tiers=self._usage()),
                timeout=self._timeout,
            )
        except grpc.RpcError as exc:
            return _status(exc)
        return None if reply.known else _UNKNOWN

    def _lost(self, why: str, incarnation: int) -> None:
        """Drop registration ``incarnation`` (never a newer one: the heartbeat thread may be late); wake the thread."""
        registered = self._registered
        if self._drop_registration(incarnation):
            if registered:
                log.warning("node %s: lost master %s: %s; registering again", self.node_ref.node_id, self.master, why)
            self._wake.set()

    def _drop_registration(self, incarnation: int = 0) -> bool:
        """Not registered any more: queued changes are moot (registration re-syncs everything). With
        ``incarnation``, only if that is the current one and still beating; True if dropped."""
        with self._pending_lock:
            if incarnation and (incarnation != self._incarnation or not self._beating):
                return False
            self._registered = self._collect = self._beating = False
            for pending in self._pending.values():
                pending.clear()
        return True

    # -- reports (caller holds _send_lock) -----------------------------------------------

    def _send_pending(self) -> bool:
        with self._pending_lock:
            batch = {t: p for t, p in self._pending.items() if p}
            for tier in batch:
                self._pending[tier] = {}
            incarnation = self._incarnation
        try:
            for tier, changes in batch.items():
                keys = list(changes)
                now = self._stores[tier].contains(keys)
                added = [m for k, held in zip(keys, now) if held and (m := changes[k]) is not None]
                removed = [k for k, held in zip(keys, now) if not held]
                # held but with no add event queued: an earlier send reported it (see the module docstring)
                self._report(tier, added, removed, full_sync=False)
        except _NotKnown:
            self._lost("master does not know us (restarted, or timed us out)", incarnation)  # the re-sync covers it
            return False
        except grpc.RpcError as exc:
            self._report_failed(batch, _status(exc), incarnation)
            return False
        self._failing_since = None
        return True

    def _report_failed(self, batch: dict[Tier, dict[BlockKey, BlockMeta | None]], why: str, incarnation: int) -> None:
        """A report the master did not answer: back into the queue (a newer change of a key wins), unless reports
        have failed for longer than ``node_timeout_s``: then the registration is lost (the re-sync covers it)."""
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        if now - self._failing_since > self._node_timeout:
            self._lost(f"reports failing for {now - self._failing_since:.1f}s ({why})", incarnation)
            return
        log.debug("node %s: report failed (%s); sending it again", self.node_ref.node_id, why)
        with self._pending_lock:
            if not self._collect or incarnation != self._incarnation:
                return  # lost meanwhile: the next registration's snapshot covers the batch
            for tier, changes in batch.items():
                pending = self._pending[tier]
                for key, meta in changes.items():
                    if pending.get(key) is None:  # absent, or only removed since: the batch's add event stays
                        pending[key] = meta

    def _report(self, tier: Tier, added: Sequence[BlockMeta], removed: Sequence[BlockKey], *, full_sync: bool,
                sync_complete: bool = False) -> None:
        """ReportBlocks in chunks; with ``full_sync`` the first chunk (maybe empty) replaces the master's set.
        ``sync_complete`` marks the last chunk (the registration's inventory is all sent)."""
        starts = range(0, max(len(added), 1 if full_sync else 0), self._chunk)
        for start in starts:
            part = added[start : start + self._chunk]
            self._call_report(tier, full_sync and start == 0, part, (), sync_complete and start == starts[-1])
        for start in range(0, len(removed), self._chunk):
            self._call_report(tier, False, (), removed[start : start + self._chunk])

    def _call_report(
        self, tier: Tier, full_sync: bool, added: Sequence[BlockMeta], removed: Sequence[BlockKey],
        sync_complete: bool = False,
    ) -> None:
        reply = self._master.report_blocks(
            master_pb2.ReportBlocksRequest(
                node_id=self.node_ref.node_id,
                incarnation=self._incarnation,
                tier=proto_tier(tier),
                full_sync=full_sync,
                added_keys=b"".join(m.key for m in added),
                added_sizes=[m.size for m in added],
                added_checksums=[m.checksum for m in added],
                removed_keys=b"".join(removed),
                sync_complete=sync_complete,
            ),
            timeout=self._timeout,
        )
        if not reply.known:
            raise _NotKnown()


def _status(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError):
        code: Callable[[], grpc.StatusCode] | None = getattr(exc, "code", None)
        if code is not None:
            return code().name
    if isinstance(exc, _NotKnown):
        return "unknown node"
    return type(exc).__name__
