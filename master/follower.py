"""A warm standby: keeps a copy of its leader's nodes and index, so that when elected it leads with them.

:class:`Follower` runs on a standby master (one thread). It reads where the
leader is (the election's view of etcd), takes the leader's
:meth:`~kvpool.master.changelog.ChangeLog.snapshot` in chunks into its own
(emptied) membership and index, then pulls ``Follow`` batches after the
sequence number it applied, every ``poll_s`` when there is nothing new.

Invariants:

- **Warm** (:attr:`Follower.warm`) means: a whole snapshot was applied and
  every change of the leader's log since, up to :attr:`Follower.seq`, in
  order. Only then does the standby's state mirror the leader's (as of its
  last pull); :class:`~kvpool.master.server.MasterServer` leads with it only
  if warm when elected, and otherwise drops it and leads cold, as a master
  without a follower does.
- A leader that says ``behind`` (another log: a new leader; or changes the
  follower missed were dropped from its bounded log), a snapshot lost
  mid-way, or a change the follower cannot apply makes it cold: it empties
  its state and starts again with a snapshot. A leader that does not answer
  leaves it warm (its state is the dead leader's as of the last pull: what
  an election should start from).
- Applying is idempotent and ordered as the log is: ``joined`` is
  :meth:`~kvpool.master.membership.Membership.adopt`, ``left``
  :meth:`~kvpool.master.membership.Membership.forget`, ``blocks`` the
  report's index change on the node's number (refused if that number is not
  open, as on the leader).
- :meth:`stop` cancels the call in flight (closes the channel: an election
  never waits on a leader that does not answer) and returns once the thread
  has applied its last batch: after it, nothing changes the standby's state
  but its own calls. :meth:`start` starts cold.
- Memory: the copy of the index (what the leader holds), plus one reply at a
  time (a snapshot chunk, :data:`~kvpool.master.changelog.CHUNK_LOCATIONS`
  locations, or a Follow batch, :data:`~kvpool.master.changelog.REPLY_BYTES`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc
import numpy as np

from kvpool.keys import unpack_keys
from kvpool.master.changelog import LOCATION
from kvpool.master.index import BlockIndex
from kvpool.master.membership import Membership
from kvpool.rpc import make_channel
from kvpool.v1 import master_pb2, master_pb2_grpc
from kvpool.vocabulary import NodeRef, Tier, TierStats

log = logging.getLogger(__name__)

POLL_S = 0.05  # a caught-up follower asks again this soon (what a failover may miss, at most, plus one call)
RETRY_S = 0.5  # after a failed call


class Follower:
    """Follows the leader ``leader_address()`` names into ``membership`` and ``index``; see the module docstring."""

    def __init__(self, membership: Membership, index: BlockIndex, leader_address: Callable[[], str], *,
                 max_message_bytes: int, token: str = "", rpc_timeout_s: float = 10.0, poll_s: float = POLL_S) -> None:
        """``rpc_timeout_s``: per Follow or Snapshot call."""
        self._membership = membership
        self._index = index
        self._leader_address = leader_address
        self._max_message_bytes = max_message_bytes
        self._token = token
        self._timeout = rpc_timeout_s
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._channel: grpc.Channel | None = None  # the thread's, closed by stop() to cancel a call in flight
        self._channel_lock = threading.Lock()
        self.warm = False
        self.log_id = 0
        self.seq = 0
        self.snapshots = 0  # snapshots applied (tests, logs)
        self.changes = 0  # log changes applied

    def start(self) -> Follower:
        self.warm = False
        self.log_id = self.seq = 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvpool-master-follower", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop following; returns once the thread applied its last batch. Idempotent."""
        self._stop.set()
        with self._channel_lock:
            if self._channel is not None:
                self._channel.close()  # a call in flight ends now (CANCELLED)
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        address, channel, stub = "", None, None
        try:
            while not self._stop.is_set():
                leader = self._leader_address()
                if not leader:
                    self._stop.wait(RETRY_S)
                    continue
                if leader != address:
                    if channel is not None:
                        channel.close()
                    address = leader
                    with self._channel_lock:
                        if self._stop.is_set():
                            break
                        channel = self._channel = make_channel(address, max_message_bytes=self._max_message_bytes,
                                                               token=self._token)
                    stub = master_pb2_grpc.MasterStub(channel)
                assert stub is not None, "Follower: no stub for the leader"
                try:
                    idle = self._step(stub)
                except grpc.RpcError as exc:
                    log.debug("master follower: %s from the leader %s", exc.code().name, address)
                    self._stop.wait(RETRY_S)
                    continue
                except Exception:  # a change it cannot apply: start again from a snapshot
                    log.exception("master follower: could not apply the leader's changes; taking a snapshot")
                    self._cold()
                    self._stop.wait(RETRY_S)
                    continue
                if idle:
                    self._stop.wait(self.poll_s)
        finally:
            with self._channel_lock:
                if channel is not None:
                    channel.close()
                self._channel = None

    def _cold(self) -> None:
        self.warm = False
        self.log_id = self.seq = 0
        self._membership.drop_all()

    def _step(self, stub: master_pb2_grpc.MasterStub) -> bool:
        """Take a snapshot if cold, else one Follow batch; True when there was nothing new."""
        if not self.warm:
            self._snapshot(stub)
            return False
        reply = stub.Follow(master_pb2.FollowRequest(log_id=self.log_id, after_seq=self.seq), timeout=self._timeout)
        if reply.behind or reply.log_id != self.log_id:
            log.info("master follower: behind the leader's log; taking a snapshot")
            self._cold()
            return False
        for change in reply.changes:  # a batch is applied whole (stop waits for it)
            self._apply(change)
            self.seq = change.seq
            self.changes += 1
        return not reply.changes

    def _snapshot(self, stub: master_pb2_grpc.MasterStub) -> None:
        """Empty this standby's state and load the leader's snapshot, chunk by chunk."""
        self._cold()
        snapshot_id, offset, total = 0, 0, -1
        while total < 0 or offset < total:
            if self._stop.is_set():
                return  # stays cold
            chunk = stub.Snapshot(master_pb2.SnapshotRequest(snapshot_id=snapshot_id, offset=offset),
                                  timeout=self._timeout)
            if snapshot_id == 0:
                for node in chunk.nodes:
                    self._adopt(node)
                snapshot_id, total = chunk.snapshot_id, chunk.total
                self.log_id, self.seq = chunk.log_id, chunk.seq
            records = np.frombuffer(chunk.locations, LOCATION)
            if len(records) == 0 and offset < chunk.total:
                raise ValueError("Snapshot: an empty chunk before the end")
            self._index.restore(records["k0"].astype(np.uint64), records["k1"].astype(np.uint64),
                                records["loc"].astype(np.uint32), records["size"].astype(np.uint64),
                                records["checksum"].astype(np.uint64), records["tag"].astype(np.uint32))
            offset += len(records)
        self.warm = True
        self.snapshots += 1
        log.info("master follower: took the leader's snapshot (%d locations, %d nodes, log seq %d)", total,
                 self._membership.node_count(), self.seq)

    def _adopt(self, node: master_pb2.FollowedNode) -> None:
        r = node.node
        tiers = [TierStats(Tier(u.tier), capacity_bytes=u.capacity_bytes, used_bytes=u.used_bytes, blocks=u.blocks)
                 for u in node.tiers]
        self._membership.adopt(NodeRef(r.node_id, r.address, r.host_id, r.arena, r.data_address), node.number,
                               node.incarnation, tiers, node.dram_max_block_bytes, node.max_block_bytes)

    def _apply(self, change: master_pb2.IndexChange) -> None:
        kind = change.WhichOneof("change")
        if kind == "joined":
            self._adopt(change.joined)
        elif kind == "left":
            self._membership.forget(change.left)
        elif kind == "blocks":
            b = change.blocks
            tier = Tier(b.tier)
            added = unpack_keys(b.added_keys)
            if b.full_sync:
                self._index.replace_node_tier(b.number, tier, added, list(b.added_sizes), list(b.added_checksums))
            elif added:
                self._index.add(b.number, tier, added, list(b.added_sizes), list(b.added_checksums))
            if b.removed_keys:
                self._index.remove(b.number, tier, unpack_keys(b.removed_keys))
        else:
            raise ValueError(f"Follow: an unknown change {kind!r}")
