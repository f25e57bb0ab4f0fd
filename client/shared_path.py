"""Same-host data path: block bytes straight between the node's shared-memory arena and the caller's buffers.

Reads: which slot (arena row: one block's extent) holds a block comes from
the node's key index in the arena (:meth:`SharedArena.index_find`, no round
trip) or, for the rest (SSD blocks, or a key the index has no room for),
from ``Locate`` (calls of at most the node's keys per call; it also
promotes SSD blocks into DRAM). A slot is read only if its row (even gen,
key, length, checksum) names exactly the block asked for, and
a copy counts only if its checksum matches and the gen did not move
meanwhile (the arena's seqlock, :meth:`SharedArena.check_slots`): a stale
index entry costs a Locate, never wrong bytes. The slots about to be read are
stamped read first (the node's LRU is every reader's, and the promotions a
Locate causes then evict other blocks, not the ones this request reads).
Blocks whose slot was reused meanwhile are handed to the next path.
The checks run over the whole batch at once; only the copy-and-hash is per
block.

Writes: slots from the lease-ahead stock (:mod:`kvpool.client.leases`, no
round trip), ``Reserve`` for the rest; the caller's bytes are copied into
them while checksumming (:func:`~kvpool.checksum.copy_with_checksum`, or the
engine's own gather: :mod:`kvpool.client.prepared`); one ``Commit`` per lease
(:meth:`SharedMemoryPath.commit`), piped where it can be. The node publishes
without hashing again: every reader verifies. Blocks that got no slot (too
large, no room) are handed to the next path; a writer that dies mid-put
leaves slots the node reclaims when the lease lapses.

Tenants (auth on): arena rows hold *stored* keys, so reads compare rows with
this client's keys under its tenant mask (:class:`~kvpool.master_client.TenantMask`,
from the master's Info). Until the mask is known, reads take the network path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Sequence
from functools import partial

import grpc
import numpy as np

from kvpool.auth import mask_keys
from kvpool.checksum import copy_with_checksum
from kvpool.client.commit_pipe import CommitPipe
from kvpool.client.datapath import LEASE_CHUNK_BYTES, call_timeout, chunks
from kvpool.client.faults import Faults, error_kind
from kvpool.client.leases import LeasedSlot, StockShelf, ahead_sizes
from kvpool.client.lookup import PoolRun
from kvpool.client.nodes import NodeDirectory
from kvpool.config import ClientConfig
from kvpool.keys import KEY_BYTES, BlockKey, pack_keys
from kvpool.master_client import TenantMask
from kvpool.tcp import ConnectionPool
from kvpool.tiers.arena import KEY_DTYPE, SharedArena
from kvpool.v1 import node_pb2
from kvpool.vocabulary import NodeRef

log = logging.getLogger(__name__)

class SharedMemoryPath:
    """The :class:`~kvpool.client.datapath.DataPath` through a same-host node's arena (see module docstring)."""

    def __init__(self, config: ClientConfig, nodes: NodeDirectory, faults: Faults,
                 tenant_mask: TenantMask | None = None, calls: ConnectionPool | None = None):
        self.config = config
        self.nodes = nodes
        self.faults = faults
        self.tenant_mask = tenant_mask  # None: no token, keys are stored as sent
        self.use_index = True  # False: every read asks Locate (benchmarks measure that path)
        self.calls = calls  # the wire connections commit pipes are made from (None: every Commit waits)
        self._stock = StockShelf()
        self._lock = threading.Lock()
        self._pipes: dict[str, CommitPipe] = {}
        self._no_ahead: set[str] = set()  # nodes that lease nothing ahead to this client
        self._asking: dict[str, int] = {}  # per node: piped Commits with next_sizes not answered yet

    # -- reads ----------------------------------------------------------------------------

    def get(self, node: NodeRef, idxs: list[int], run: PoolRun, dsts: list[np.ndarray],
            ok: list[bool], deadline: float) -> list[int]:
        arena = self.nodes.arena(node)
        if arena is None:
            return idxs
        mask = b"" if self.tenant_mask is None else self.tenant_mask()
        if mask is None:  # the rows hold stored keys we cannot compute yet
            return idxs
        n = len(idxs)
        wanted = [run.keys[i] for i in idxs]
        packed = pack_keys(wanted)
        sent = np.frombuffer(packed, dtype=KEY_DTYPE)  # what the node is asked for
        keys = np.frombuffer(mask_keys(packed, mask), dtype=KEY_DTYPE)  # what its rows hold
        sizes, sums = run.sizes[idxs], run.checksums[idxs]
        slots = arena.index_find(keys) if self.use_index else np.full(n, -1, dtype=np.int64)
        gens, offsets, cand = arena.check_slots(slots, keys, sizes, sums)
        arena.touch(slots[cand])  # read now: the promotions a Locate below causes evict other blocks first
        missing = np.flatnonzero(~cand)
        if missing.size:
            found = self.locate(node, arena, packed if missing.size == n else sent[missing].tobytes(), missing.size,
                                deadline)
            if found is not None:
                slots[missing] = found
                gens[missing], offsets[missing], cand[missing] = arena.check_slots(
                    slots[missing], keys[missing], sizes[missing], sums[missing])
        copied = np.zeros(n, dtype=bool)
        data = arena.data
        for j in np.flatnonzero(cand).tolist():
            at, size = int(offsets[j]), int(sizes[j])
            copied[j] = copy_with_checksum(dsts[idxs[j]], data[at : at + size]) == int(sums[j])
        copied &= arena.unchanged(slots, gens)  # not reused while we copied
        reused = int(cand.sum() - copied.sum())
        if reused:
            self.faults.counted("slot_reused", reused)
        for j in np.flatnonzero(copied).tolist():
            ok[idxs[j]] = True
        return [i for i in idxs if not ok[i]]

    def locate(self, node: NodeRef, arena: SharedArena, packed: bytes, n: int, deadline: float) -> np.ndarray | None:
        """Per key the node's slot for it (-1: not in DRAM, or its call failed), promoting SSD blocks, in calls of
        at most the node's keys per call; None if every call failed."""
        max_keys = self.nodes.max_keys(node.address, call_timeout(deadline))
        slots = np.full(n, -1, dtype=np.int64)
        answered = False
        for lo in range(0, n, max_keys):
            hi = min(n, lo + max_keys)
            request = node_pb2.LocateRequest(keys=packed[lo * KEY_BYTES : hi * KEY_BYTES], promote=True)
            try:
                reply = self.nodes.stub(node.address).Locate(request, timeout=call_timeout(deadline))
            except grpc.RpcError as exc:
                self.faults.counted(error_kind(exc), hi - lo)
                continue
            if reply.arena != arena.name or not len(reply.slots) == len(reply.slot_gens) == hi - lo:
                continue
            found = np.array(reply.slots, dtype=np.int64)
            slots[lo:hi] = np.where(np.array(reply.slot_gens, dtype=np.uint64) != 0, found, -1)
            answered = True
        return slots if answered else None

    # -- writes ---------------------------------------------------------------------------

    def put(self, node: NodeRef, idxs: list[int], keys: list[BlockKey], arrays: list[np.ndarray],
            sizes: list[int], result: list[bool], deadline: float) -> list[int]:
        arena = self.nodes.arena(node, recheck=True)
        if arena is None:
            return idxs
        left: list[int] = []
        for run in chunks(idxs, sizes, LEASE_CHUNK_BYTES, self.nodes.max_keys(node.address, call_timeout(deadline))):
            if time.monotonic() >= deadline:
                left += run
                continue
            left += self._put_run(node, arena, run, keys, arrays, sizes, result, deadline)
        return left

    def _put_run(self, node: NodeRef, arena: SharedArena, run: list[int], keys: list[BlockKey],
                 arrays: list[np.ndarray], sizes: list[int], result: list[bool], deadline: float) -> list[int]:
        """One lease's worth: slots from the stock (leased ahead), ``Reserve`` for the rest, copy-and-hash into
        them, commit (:meth:`commit`); the blocks that got no slot are handed back."""
        self._await_stock(node.address, deadline)
        slots = self._stock.lease(node.address, arena, [sizes[i] for i in run])
        short = [j for j, s in enumerate(slots) if s is None]
        if short:
            reserved = self.reserve(node, keys, sizes, [run[j] for j in short], deadline)
            for j, got in zip(short, reserved):
                if isinstance(got, LeasedSlot):
                    slots[j] = got
                elif got:  # the node holds the key already
                    result[run[j]] = True
        mine = [(j, s) for j, s in enumerate(slots) if s is not None]
        sums = [copy_with_checksum(s.view(), arrays[run[j]]) for j, s in mine]
        stored = self.commit([keys[run[j]] for j, _ in mine], [s for _, s in mine], sums, deadline)
        for (j, _), ok in zip(mine, stored):
            result[run[j]] = ok
        return [run[j] for j, s in enumerate(slots) if s is None and not result[run[j]]]

    def lease(self, node: NodeRef, sizes: Sequence[int]) -> list[LeasedSlot | None]:
        """Per block size a slot of the node's arena leased ahead to this client, to fill and then
        :meth:`commit` (None: none in stock now, or the node is not on this host). No round trip."""
        arena = self.nodes.arena(node)
        if arena is None:
            return [None] * len(sizes)
        return self._stock.lease(node.address, arena, sizes)

    def commit(self, keys: Sequence[BlockKey], slots: Sequence[LeasedSlot], checksums: Sequence[int],
               deadline: float) -> list[bool]:
        """Publish filled slots (one node's) under ``keys``: one ``Commit`` per lease, sent without waiting
        where the node's :class:`CommitPipe` takes it (True then means "on its way": a refusal is a lost write,
        counted later); per block, whether it is stored or on its way. A lease leased ahead keeps its other
        slots for later puts; the last ``Commit`` asks for the next stock when the shelf runs low."""
        out = [False] * len(keys)
        if not keys:
            return out
        address, arena = slots[0].address, slots[0].arena
        by_lease: dict[int, list[int]] = {}
        for j, slot in enumerate(slots):
            by_lease.setdefault(slot.lease, []).append(j)
        for n, (lease, js) in enumerate(by_lease.items()):
            if time.monotonic() >= deadline:
                self.faults.lost("timeout", f"{len(js)} blocks for {address} past the deadline", len(js))
                continue
            sizes = [slots[j].size for j in js]
            last = n == len(by_lease) - 1
            wants = last and self._wants_stock(address, len(js))
            ahead = ahead_sizes(sizes, self.nodes.max_keys(address)) if wants else []
            request = node_pb2.CommitRequest(lease=lease, keys=pack_keys([keys[j] for j in js]),
                                             slots=[slots[j].slot for j in js],
                                             checksums=[checksums[j] for j in js], next_sizes=ahead,
                                             keep_lease=not slots[js[0]].reserved)
            for j, ok in zip(js, self._send_commit(address, arena, request, deadline)):
                out[j] = ok
        return out

    def _send_commit(self, address: str, arena: SharedArena, request: node_pb2.CommitRequest,
                     deadline: float) -> list[bool]:
        """One ``Commit``: piped if it can be, else waited for; per block, stored (or on its way)."""
        n = len(request.slots)
        pipe = self._pipe(address)
        if pipe is not None:
            if request.next_sizes:
                self._asking_more(address, +1)
            if pipe.send(request, partial(self._committed, address, arena, request), deadline):
                return [True] * n
            if request.next_sizes:
                self._asking_more(address, -1)
        try:
            reply = self.nodes.stub(address).Commit(request, timeout=call_timeout(deadline))
        except grpc.RpcError as exc:
            # a lost write (the node reclaims the slots when the lease lapses)
            self.faults.lost(error_kind(exc), exc, n)
            return [False] * n
        if len(reply.stored) != n:
            self.faults.lost("bad_reply", "commit reply fields disagree", n)
            return [False] * n
        self._stock.keep(address, arena, reply.next, list(request.next_sizes))
        stored = [flag != 0 for flag in reply.stored]
        refused = stored.count(False)
        if refused:
            self.faults.counted("put_refused", refused)
            self._stock.drop(address, request.lease)  # its lease may be gone: its other slots too
        return stored

    def _pipe(self, address: str) -> CommitPipe | None:
        """The node's commit pipe; None where commits must wait (TLS, see :mod:`kvpool.client.commit_pipe`)."""
        if self.calls is None or self.calls.tls is not None:
            return None
        with self._lock:
            pipe = self._pipes.get(address)
            if pipe is None:
                stub = self.nodes.stub(address)
                pipe = self._pipes[address] = CommitPipe(self.calls, stub.wire_address,
                                                         timeout_s=self.config.io_timeout_s)
            return pipe

    def _await_stock(self, address: str, deadline: float) -> None:
        """If the node's shelf is empty and a Commit in flight asked for a stock, wait (until ``deadline``) for
        the replies in flight until one brings it."""
        pipe = self._pipe(address)
        while pipe is not None and not self._stock.slots_at(address) and self._stock_coming(address):
            waiting = pipe.in_flight
            if not waiting or not pipe.wait(waiting - 1, call_timeout(deadline)):
                return

    def _stock_coming(self, address: str) -> bool:
        with self._lock:
            return self._asking.get(address, 0) > 0

    def _wants_stock(self, address: str, n: int) -> bool:
        """Whether a Commit of ``n`` blocks should lease the next stock: the node leases ahead to this client, no
        stock is on its way, and the shelf would not cover two more puts like this one."""
        with self._lock:
            if address in self._no_ahead or self._asking.get(address, 0):
                return False
        return self._stock.slots_at(address) < 2 * n

    def _asking_more(self, address: str, change: int) -> None:
        with self._lock:
            self._asking[address] = self._asking.get(address, 0) + change

    def _committed(self, address: str, arena: SharedArena, request: node_pb2.CommitRequest,
                   reply: node_pb2.CommitResponse | None, error: grpc.RpcError | None) -> None:
        """A piped Commit's answer (the pipe's reader thread): file its stock, count what it did not store.

        A Commit the node never read (a full listener) is sent again the waiting way."""
        try:
            self._answered(address, arena, request, reply, error)
        finally:
            if request.next_sizes:  # after its stock is on the shelf: a put waiting for one then finds it
                self._asking_more(address, -1)

    def _answered(self, address: str, arena: SharedArena, request: node_pb2.CommitRequest,
                  reply: node_pb2.CommitResponse | None, error: grpc.RpcError | None) -> None:
        n = len(request.slots)
        if reply is None and n and getattr(error, "not_applied", False):
            try:
                reply = self.nodes.stub(address).Commit(request, timeout=self.config.io_timeout_s)
            except grpc.RpcError as exc:
                error = exc
        if reply is None:
            if n:
                self.faults.lost_later(error_kind(error) if error is not None else "unavailable", error, n)
            return
        if len(reply.stored) != n:
            self.faults.lost_later("bad_reply", "commit reply fields disagree", n)
        else:
            refused = reply.stored.count(0)
            if refused:
                self.faults.lost_later("put_refused", f"{address} refused {refused} of {n} committed blocks", refused)
                self._stock.drop(address, request.lease)  # its lease may be gone: its other slots too
        asked = list(request.next_sizes)
        if asked and not reply.next.lease:
            with self._lock:
                self._no_ahead.add(address)  # e.g. a tenant under a quota: no stock comes, so none is asked for
        self._stock.keep(address, arena, reply.next, asked)

    def settle(self, timeout: float, addresses: Collection[str] | None = None) -> bool:
        """Wait until every Commit sent without waiting (to the nodes at ``addresses``, None: all) is answered
        (what this client stored there is published), then raise the first fault they left in strict mode;
        False on timeout (one ``timeout`` for all the nodes)."""
        with self._lock:
            pipes = [pipe for address, pipe in self._pipes.items() if addresses is None or address in addresses]
        deadline = time.monotonic() + timeout
        ok = all([pipe.wait(0, call_timeout(deadline)) for pipe in pipes])
        self.faults.raise_later()
        return ok

    def reserve(self, node: NodeRef, keys: Sequence[BlockKey], sizes: Sequence[int], run: Sequence[int],
                deadline: float) -> list[LeasedSlot | bool | None]:
        """Per block of ``run`` (indexes into ``keys`` and ``sizes``) a slot of a new lease (one ``Reserve``),
        True if the node holds the key already, None if it got no slot (not on this host, no room, too large, or
        the call failed). The lease ends at the slots' :meth:`commit`."""
        arena = self.nodes.arena(node)
        out: list[LeasedSlot | bool | None] = [None] * len(run)
        if arena is None:
            return out
        max_keys = self.nodes.max_keys(node.address, call_timeout(deadline))
        if len(run) > max_keys:  # one lease per call the node takes
            return [got for lo in range(0, len(run), max_keys)
                    for got in self.reserve(node, keys, sizes, run[lo : lo + max_keys], deadline)]
        request = node_pb2.ReserveRequest(keys=pack_keys([keys[i] for i in run]), sizes=[sizes[i] for i in run])
        try:
            reply = self.nodes.stub(node.address).Reserve(request, timeout=call_timeout(deadline))
        except grpc.RpcError as exc:
            log.debug("Reserve on %s failed (%s); sending the blocks another way", node.address, error_kind(exc))
            return out
        if reply.arena != arena.name or not len(reply.slots) == len(reply.slot_gens) == len(run) or \
                len(reply.already_held) != len(run):
            self.faults.counted("bad_reply")
            return out
        slots, gens = np.asarray(reply.slots, dtype=np.int64), np.asarray(reply.slot_gens, dtype=np.uint64)
        want = np.asarray([sizes[i] for i in run], dtype=np.int64)
        usable = (gens != 0) & arena.unchanged(slots, gens)  # still our turn on the slot
        offsets = arena.table["offset"][np.where(usable, slots, 0)].astype(np.int64)  # set before the turn began
        usable &= offsets <= arena.data_bytes - want
        for j in np.flatnonzero(usable).tolist():
            out[j] = LeasedSlot(node.address, arena, reply.lease, int(slots[j]), int(gens[j]), int(offsets[j]),
                                int(want[j]), reserved=True)
        for j in np.flatnonzero(np.frombuffer(reply.already_held, dtype=np.uint8)).tolist():
            out[j] = True
        return out

    def stocked_slots(self) -> int:
        """Slots leased ahead to this client now, all nodes together."""
        return self._stock.slots()

    def close(self) -> None:
        """Wait briefly for the piped Commits, then hand the stock back (an empty Commit ends a lease; if it
        fails, the node reaps the lease)."""
        with self._lock:
            pipes, self._pipes = list(self._pipes.values()), {}
        for pipe in pipes:
            pipe.close(min(self.config.io_timeout_s, 5.0))
        for address, stock in self._stock.clear():
            try:
                self.nodes.stub(address).Commit(node_pb2.CommitRequest(lease=stock.lease),
                                                timeout=min(self.config.io_timeout_s, 1.0))
            except grpc.RpcError as exc:
                log.debug("could not hand back %d slots leased ahead by %s (%s)", stock.left(), address,
                          error_kind(exc))
