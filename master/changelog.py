"""The leader's change log: what warm standbys follow (``Follow``), and the snapshot they start from.

The leader records every change it *accepted* to its membership and index, in
the order it applied them: node registrations (``joined``), nodes dropped with
their entries (``left``: unregistered or expired), and reports (``blocks``).
A standby (:mod:`~kvpool.master.follower`) takes a :meth:`ChangeLog.snapshot`
once, then pulls :meth:`ChangeLog.follow` batches after the sequence number it
has applied, so that when elected it leads with the leader's index.

Invariants:

- **Applied and logged as one step.** Every change is applied and appended
  under :meth:`ChangeLog.applying` (one lock; lock order: log, membership,
  index), so the log's order is the order the changes were applied in, and a
  snapshot (taken under the same lock) is exactly the state after its ``seq``.
- **Bounded.** The log keeps the latest changes up to ``max_bytes`` (the
  estimated size of what a Follow reply carries for them: a report's keys,
  sizes and checksums, ~50 bytes a key); older ones are dropped. A follower
  whose ``after_seq`` is older than the oldest kept (or of another log: each
  leadership starts a new ``log_id``) is told ``behind`` and takes a snapshot.
  A Follow reply carries at most ``reply_bytes`` (and at least one change).
- **One snapshot at a time**, served in chunks of ``chunk_locations``
  locations (40 bytes each) from a copy made under the log lock (no change is
  applied meanwhile; lookups go on between the index copy's steps): its memory
  is 40 bytes per (key, node, tier) location while any follower pulls it, and
  it is dropped when a follower has taken the last chunk or nobody asked for a
  chunk for ``snapshot_idle_s``. A second standby starting meanwhile joins it
  (one that loses it mid-way is told so and starts again).
- The log records nothing while it is off (:meth:`reset` with ``on=False``: a
  standby, whose changes come from its leader's log, not from calls).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from kvpool.master.index import BlockIndex
from kvpool.master.membership import Membership, NodeInfo
from kvpool.rpc import tier_usage
from kvpool.v1 import common_pb2, master_pb2

DEFAULT_MAX_BYTES = 256 << 20  # the log: ~5 million reported keys
REPLY_BYTES = 8 << 20  # one Follow reply
CHUNK_LOCATIONS = 100_000  # one Snapshot reply: 4 MB
SNAPSHOT_IDLE_S = 30.0
LOCATION = np.dtype([("k0", "<u8"), ("k1", "<u8"), ("loc", "<u4"), ("size", "<u8"), ("checksum", "<u8"),
                     ("tag", "<u4")])
assert LOCATION.itemsize == 40
_KEY_COST = 50  # bytes a reported key costs in the log's estimate (32 key + size and checksum varints)
_ENTRY_COST = 64


def followed_node(info: NodeInfo) -> master_pb2.FollowedNode:
    """A node as the log and snapshots carry it."""
    r = info.ref
    return master_pb2.FollowedNode(
        node=common_pb2.NodeRef(node_id=r.node_id, address=r.address, host_id=r.host_id, arena=r.arena,
                                data_address=r.data_address),
        number=info.number, incarnation=info.incarnation,
        tiers=[tier_usage(s) for s in sorted(info.tiers.values(), key=lambda s: s.tier)],
        dram_max_block_bytes=info.dram_max_block_bytes, max_block_bytes=info.max_block_bytes)


@dataclass
class _Snapshot:
    id: int
    log_id: int
    seq: int
    nodes: list[master_pb2.FollowedNode]
    locations: np.ndarray  # LOCATION records
    used_at: float


Entry = tuple[int, int, Callable[[], master_pb2.IndexChange]]  # seq, estimated bytes, the change (built lazily)


class ChangeLog:
    """The leader's bounded log of accepted changes; see the module docstring. Thread-safe."""

    def __init__(self, membership: Membership, index: BlockIndex, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 reply_bytes: int = REPLY_BYTES, chunk_locations: int = CHUNK_LOCATIONS,
                 snapshot_idle_s: float = SNAPSHOT_IDLE_S, clock: Callable[[], float] = time.monotonic) -> None:
        if max_bytes < 1 or reply_bytes < 1 or chunk_locations < 1:
            raise ValueError("ChangeLog: max_bytes, reply_bytes and chunk_locations must be positive")
        self._membership = membership
        self._index = index
        self.max_bytes = max_bytes
        self.reply_bytes = reply_bytes
        self.chunk_locations = chunk_locations
        self.snapshot_idle_s = snapshot_idle_s
        self._clock = clock
        self._lock = threading.RLock()  # reentrant: an applying() step may call membership methods that note
        self._entries: collections.deque[Entry] = collections.deque()
        self._bytes = 0
        self._seq = 0
        self._on = False
        self.log_id = 0
        self._snapshot: _Snapshot | None = None

    def reset(self, on: bool) -> None:
        """Start a new log (a new ``log_id``, no entries) that records (``on``: this master leads) or not."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0
            self._seq = 0
            self._on = on
            self.log_id = secrets.randbits(63) | 1 if on else 0
            self._snapshot = None

    @contextlib.contextmanager
    def applying(self) -> Iterator[Callable[[master_pb2.IndexChange | Callable[[], master_pb2.IndexChange], int],
                                            None]]:
        """Hold the log while applying changes; yields ``note(change, keys)`` to log each accepted one (``change``
        a message or a function building it when a follower asks; ``keys`` what it carries, for the bound)."""
        with self._lock:
            yield self._note

    def _note(self, change: master_pb2.IndexChange | Callable[[], master_pb2.IndexChange], keys: int) -> None:
        if not self._on:
            return
        self._seq += 1
        cost = _ENTRY_COST + _KEY_COST * keys
        build = change if callable(change) else (lambda c=change: c)
        self._entries.append((self._seq, cost, build))
        self._bytes += cost
        while self._bytes > self.max_bytes and len(self._entries) > 1:
            self._bytes -= self._entries.popleft()[1]

    def follow(self, log_id: int, after_seq: int) -> master_pb2.FollowResponse:
        """The changes after ``after_seq`` (at most ``reply_bytes``, at least one if any), or ``behind``."""
        with self._lock:
            reply = master_pb2.FollowResponse(log_id=self.log_id)
            first = self._entries[0][0] if self._entries else self._seq + 1
            if log_id != self.log_id or after_seq > self._seq or after_seq + 1 < first:
                reply.behind = True
                return reply
            picked: list[tuple[int, Callable[[], master_pb2.IndexChange]]] = []
            size = 0
            for seq, cost, build in itertools.islice(self._entries, after_seq + 1 - first, None):
                if picked and size + cost > self.reply_bytes:
                    break
                picked.append((seq, build))
                size += cost
        for seq, build in picked:  # built outside the lock: copying a report's fields costs its size
            change = reply.changes.add()
            change.CopyFrom(build())
            change.seq = seq
        return reply

    def snapshot(self, snapshot_id: int, offset: int) -> master_pb2.SnapshotResponse:
        """One chunk of the current snapshot (``snapshot_id`` 0: the current one, or a new one); ValueError for a
        snapshot that is gone (the follower starts again with 0)."""
        now = self._clock()
        with self._lock:
            snap = self._snapshot
            if snap is not None and now - snap.used_at > self.snapshot_idle_s:
                snap = self._snapshot = None
            if snapshot_id == 0 and snap is None:
                snap = self._snapshot = self._take(now)
            if snap is None or snapshot_id not in (0, snap.id) or snap.log_id != self.log_id:
                raise ValueError(f"Snapshot: snapshot {snapshot_id} is gone; start again with snapshot_id 0")
            snap.used_at = now
            end = min(offset + self.chunk_locations, len(snap.locations))
            if end >= len(snap.locations):
                self._snapshot = None  # the last chunk: a later follower takes a fresh one
        reply = master_pb2.SnapshotResponse(snapshot_id=snap.id, log_id=snap.log_id, seq=snap.seq,
                                            total=len(snap.locations), offset=offset,
                                            locations=snap.locations[offset:end].tobytes())
        if offset == 0:
            reply.nodes.extend(snap.nodes)
        return reply

    def _take(self, now: float) -> _Snapshot:
        """Copy the membership and the index (log lock held: no change is applied meanwhile)."""
        nodes = [followed_node(info) for info in self._membership.live_nodes()]
        k0, k1, loc, size, checksum, tag = self._index.locations()
        records = np.empty(len(k0), LOCATION)
        records["k0"], records["k1"], records["loc"] = k0, k1, loc
        records["size"], records["checksum"], records["tag"] = size, checksum, tag
        return _Snapshot(secrets.randbits(63) | 1, self.log_id, self._seq, nodes, records, now)
