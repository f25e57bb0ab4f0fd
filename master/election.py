"""Leader election among masters through etcd: one leads, the others stand by.

The leader holds the cluster's leader key (:func:`kvpool.etcd.leader_key`)
under an etcd lease of ``ttl_s`` seconds and renews the lease every
``ttl_s / 3``; a standby polls the key and campaigns (a transaction that
creates the key only if it is absent) when it is gone. A killed leader's
lease expires ``ttl_s`` after its last renewal, and the key with it.

Invariants:

- :meth:`Election.leading` is True only while this master holds the key
  under a lease that cannot have expired in etcd yet: until the moment the
  last successful grant or renewal was *sent* plus the TTL etcd answered,
  less a safety margin. etcd starts that TTL when it receives the request,
  which is later, so two masters never both lead as long as their clocks run
  at the same rate (within the margin). A leader cut off from etcd therefore
  stops leading by itself, whether or not its thread runs.
- ``on_elected`` and ``on_deposed`` run on the election thread, alternately,
  ``on_elected`` first; ``on_deposed`` also runs at :meth:`stop` if leading.
- :meth:`stop` resigns: the lease is revoked, so a standby takes over within
  its poll interval instead of waiting for the TTL.
- Each renewal also rewrites the leader key (same value, only if it is still
  this master's), so its mod revision moves on at least every ``ttl_s / 3``:
  that is how a standby sees the leader alive. When a standby is elected,
  :attr:`Election.failover_s` is the time since it last saw the old leader's
  key move: the old leader's last renewal to this election, give or take one
  poll. After a ``kill -9`` that is the time from the kill to the election
  plus up to ``ttl_s / 3`` (the renewal came before the kill).
- Every running master, leader or standby, keeps a member key
  (:func:`kvpool.etcd.members_prefix` + its id) under a lease of its own, so
  ``kvpool status`` can list the standbys; a killed master's key goes with
  that lease.
- :func:`check_access` is what a master asks etcd before it starts: a
  master etcd refuses (TLS, user and password, or a role that may not write
  the leader and member keys) never starts to stand by for ever.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from kvpool.etcd import EtcdClient, EtcdRefused, EtcdUnavailable, LeaderInfo, cluster_prefix, leader_key, members_prefix

log = logging.getLogger(__name__)

MIN_TTL_S = 2  # etcd grants no shorter lease with its default timings


def check_access(etcd: EtcdClient, cluster: str, timeout: float | None = None, shard: int = 0) -> None:
    """Whether etcd lets this master campaign in ``cluster``'s index shard ``shard``: read and write its leader key
    and a member key, checked without writing either. ValueError (one line, what to fix) if etcd refuses; if etcd
    cannot be reached now, a warning: the master stands by until it can."""
    try:
        for key in (leader_key(cluster, shard), members_prefix(cluster, shard) + b"check"):
            etcd.check(key, write=True, timeout=timeout)
    except EtcdRefused as exc:
        hint = f"; its role needs readwrite on the prefix {cluster_prefix(cluster).decode()}" \
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED else ""
        raise ValueError(f"etcd refused this master: {exc.details()}{hint} (docs/operations.md)") from None
    except EtcdUnavailable as exc:
        log.warning("master: %s; standing by until etcd answers", exc.details())


class Election:
    """Campaign for the leader key of ``cluster``'s index shard ``shard`` (:mod:`kvpool.shards`; shard 0 is the
    unsharded cluster's key) as ``me``; see the module docstring."""

    def __init__(self, etcd: EtcdClient, cluster: str, me: LeaderInfo, ttl_s: int, *,
                 on_elected: Callable[[], None], on_deposed: Callable[[], None], poll_s: float | None = None,
                 shard: int = 0):
        if ttl_s < MIN_TTL_S:
            raise ValueError(f"leader TTL must be at least {MIN_TTL_S} s")
        self.etcd = etcd
        self.cluster = cluster
        self.me = me
        self.ttl_s = ttl_s
        self.shard = shard
        self.key = leader_key(cluster, shard)
        self._group = cluster if shard == 0 else f"{cluster} shard {shard}"  # as the log names it
        self.poll_s = min(0.5, ttl_s / 4) if poll_s is None else poll_s
        self.margin_s = min(1.0, ttl_s * 0.2)
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._lock = threading.Lock()
        self._lease = 0
        self._valid_until = 0.0  # monotonic; leading only before this
        self._elected = False  # on_elected ran and on_deposed has not yet
        self._leader: LeaderInfo | None = None  # the leader as last read
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._member_key = members_prefix(cluster, shard) + me.id.encode()
        self._member_lease = 0
        self.elections = 0  # times this master became leader
        self.elected_at = 0.0  # monotonic time of the last election (0: never)
        self.failover_s: float | None = None  # at the last election: since the old leader's key last moved
        self._moved: tuple[int, float] | None = None  # another leader's key: (mod revision, when first seen)
        self._refusal: str | None = None  # why etcd last refused a campaign (logged once a reason)

    # -- what the master asks -------------------------------------------------------------

    def leading(self) -> bool:
        """Whether this master leads now (see the module docstring)."""
        with self._lock:
            return self._elected and time.monotonic() < self._valid_until

    def leader(self) -> LeaderInfo | None:
        """The leader as this master last saw it (itself while leading); None if there is none. Never itself once
        :meth:`leading` is False, even before the thread has noticed its lease is gone."""
        if self.leading():
            return self.me
        with self._lock:
            return None if self._leader == self.me else self._leader

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> Election:
        self._thread = threading.Thread(target=self._run, name="kvpool-master-election", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop campaigning; a leader resigns (revokes its lease, so its key goes at once). Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        with self._lock:
            lease, self._lease = self._lease, 0
            was = self._elected
            self._elected = False
            self._valid_until = 0.0
        if was:
            self._on_deposed()
        for gone in (self._member_lease,):
            if gone:
                try:
                    self.etcd.revoke(gone, timeout=1.0)
                except grpc.RpcError:
                    pass  # it expires by itself
        if lease:
            try:
                self.etcd.revoke(lease, timeout=1.0)
            except grpc.RpcError as exc:
                log.info("master: could not resign in etcd (%s); the lease expires in %d s", exc.code().name,
                         self.ttl_s)

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._elected:
                    self._renew()
                    self._announce()  # after the renewal: a slow etcd must not delay it
                    self._stop.wait(self.ttl_s / 3)
                else:
                    self._announce()
                    if not self._campaign():
                        self._stop.wait(self.poll_s)
            except Exception:  # a bug here must be loud, and must not leave a leader that cannot step down
                log.exception("master election failed; standing down")
                self._depose("election error")
                self._stop.wait(self.poll_s)

    def _announce(self) -> None:
        """Keep this master's member key (best effort: only ``kvpool status`` reads it)."""
        try:
            if self._member_lease and self.etcd.keep_alive(self._member_lease, timeout=self.poll_s) > 0:
                return
            self._member_lease, _ = self.etcd.grant(self.ttl_s, timeout=self.poll_s)
            self.etcd.put(self._member_key, self.me.encode(), lease=self._member_lease, timeout=self.poll_s)
        except grpc.RpcError:
            self._member_lease = 0

    def _campaign(self) -> bool:
        """Try to take the key; True if this master leads now."""
        sent = time.monotonic()
        try:
            current = self.etcd.get(self.key)
            if current is not None:
                info = LeaderInfo.decode(current.value)
                if info is not None and current.lease:
                    self._saw(info)
                    if self._moved is None or self._moved[0] != current.mod_revision:
                        self._moved = (current.mod_revision, sent)
                    return False
                # Not a leader's key (no lease, or not ours to read): it would block every election. Remove it,
                # if it still holds what we read, and campaign.
                log.warning("master: the leader key of cluster %s holds %r%s; removing it", self._group,
                            current.value[:80], "" if current.lease else " with no lease")
                self.etcd.delete_if(self.key, current.value)
            lease, ttl = self.etcd.grant(self.ttl_s)
            held = self.etcd.create(self.key, self.me.encode(), lease)
        except EtcdRefused as exc:  # its credentials or role changed since the start: say so (once a reason)
            if exc.details() != self._refusal:
                self._refusal = exc.details()
                log.warning("master: cannot campaign: %s", exc.details())
            return False
        except grpc.RpcError as exc:
            log.debug("master: campaign failed (%s)", exc.code().name)
            return False
        if held is not None:
            self._saw(LeaderInfo.decode(held.value))
            try:
                self.etcd.revoke(lease)
            except grpc.RpcError:
                pass  # it expires by itself
            return False
        with self._lock:
            self._lease = lease
            self._valid_until = sent + ttl - self.margin_s
            self._elected = True
            self._leader = self.me
        self.elections += 1
        self.elected_at = time.monotonic()
        self.failover_s = None if self._moved is None else self.elected_at - self._moved[1]
        self._moved = None
        log.info("master %s: elected leader of cluster %s (lease %x, TTL %d s)", self.me.address, self._group,
                 lease, ttl)
        self._on_elected()
        return True

    def _renew(self) -> None:
        """Renew the lease and check the key is still ours; stand down once the lease may have expired."""
        with self._lock:
            lease = self._lease
        sent = time.monotonic()
        try:
            ttl = self.etcd.keep_alive(lease, timeout=max(0.2, self.ttl_s / 3))
            ours = ttl > 0 and self.etcd.put_if(self.key, self.me.encode(), lease, timeout=max(0.2, self.ttl_s / 3))
        except grpc.RpcError as exc:
            if time.monotonic() >= self._deadline():
                self._depose(f"etcd unreachable past the lease ({exc.code().name})")
            return
        if ttl <= 0:
            self._depose("the lease expired in etcd")
            return
        if not ours:
            self._depose("the leader key is no longer this master's")
            return
        with self._lock:
            self._valid_until = sent + ttl - self.margin_s

    def _deadline(self) -> float:
        with self._lock:
            return self._valid_until

    def _depose(self, why: str) -> None:
        with self._lock:
            was = self._elected
            self._elected = False
            self._valid_until = 0.0
            self._lease = 0
            self._leader = None
        if was:
            log.warning("master %s: no longer leader of cluster %s: %s", self.me.address, self._group, why)
            self._on_deposed()

    def _saw(self, leader: LeaderInfo | None) -> None:
        with self._lock:
            self._leader = leader
