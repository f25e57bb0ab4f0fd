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

Writes: ``Reserve`` slots under a lease, copy the caller's bytes into them
while checksumming (:func:`~kvpool.checksum.copy_with_checksum`),
``Commit`` (the node verifies every block before publishing it). Blocks that
got no slot (too large, no room) are handed to the next path; a writer that
dies mid-put leaves slots the node reclaims when the lease lapses.

Tenants (auth on): arena rows hold *stored* keys, so reads compare rows with
this client's keys under its tenant mask (:class:`~kvpool.master_client.TenantMask`,
from the master's Info). Until the mask is known, reads take the network path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import cycle, islice
from typing import Any

import grpc
import numpy as np

from kvpool.auth import mask_keys
from kvpool.checksum import copy_with_checksum
from kvpool.client.commit_pipe import CommitPipe
from kvpool.client.datapath import LEASE_CHUNK_BYTES, call_timeout, chunks
from kvpool.client.faults import Faults, error_kind
from kvpool.client.lookup import PoolRun
from kvpool.client.nodes import NodeDirectory
from kvpool.config import ClientConfig
from kvpool.core import NodeRef
from kvpool.framing import ConnectionPool
from kvpool.keys import KEY_BYTES, BlockKey, pack_keys
from kvpool.master_client import TenantMask
from kvpool.tiers.arena import KEY_DTYPE, SharedArena
from kvpool.v1 import node_pb2

log = logging.getLogger(__name__)

STOCK_BYTES = 1 << 20  # slots leased ahead per stock: a put's sizes again and again, up to this many bytes (one
# block at least); a stock serves several puts (each Commit keeps the lease's other slots), and the next is leased
# before it runs out
STOCK_SLOTS = 256  # most slots one stock leases ahead
STOCK_USE_SHARE = 0.5  # a stock is used only within this share of its lease's timeout (it must not lapse mid-put)


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
        stub = self.nodes.stub(node.address)
        left: list[int] = []
        for run in chunks(idxs, sizes, LEASE_CHUNK_BYTES, self.nodes.max_keys(node.address, call_timeout(deadline))):
            if time.monotonic() >= deadline:
                left += run
                continue
            left += self._put_run(node, arena, stub, run, keys, arrays, sizes, result, deadline)
        return left

    def _put_run(self, node: NodeRef, arena: SharedArena, stub: Any, run: list[int], keys: list[BlockKey],
                 arrays: list[np.ndarray], sizes: list[int], result: list[bool], deadline: float) -> list[int]:
        """One lease's worth: slots from the stock (leased ahead), Reserve for the rest, copy, one Commit (sent
        without waiting where the node's :class:`CommitPipe` takes it)."""
        run_sizes = np.array([sizes[i] for i in run], dtype=np.int64)
        n = len(run)
        slots, gens = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.uint64)
        held = np.zeros(n, dtype=bool)
        pipe = self._pipe(node.address)
        stock = self._take_stock(node.address, arena, pipe, deadline)
        lease = 0
        if stock is not None:
            lease = stock.lease
            stock.assign(run_sizes.tolist(), slots, gens)
        short = np.flatnonzero(gens == 0)
        if short.size:
            reply = self._reserve(node, stub, arena, [run[j] for j in short.tolist()], keys, sizes, lease, deadline)
            if reply is None and lease:  # the stock's lease lapsed or was refused: a fresh one for the whole run
                stock = None
                lease, slots[:], gens[:] = 0, 0, 0
                short = np.arange(n)
                reply = self._reserve(node, stub, arena, run, keys, sizes, 0, deadline)
            if reply is None:
                if not lease:
                    return run
            else:
                lease = reply.lease or lease
                slots[short] = np.asarray(reply.slots, dtype=np.int64)
                gens[short] = np.asarray(reply.slot_gens, dtype=np.uint64)
                held[short] = np.frombuffer(reply.already_held, dtype=np.uint8) != 0
        usable = (gens != 0) & arena.unchanged(slots, gens)  # still our turn on the slot
        offsets = arena.table["offset"][np.where(usable, slots, 0)].astype(np.int64)  # set before the turn began
        usable &= offsets <= arena.data_bytes - run_sizes
        mine: list[int] = []
        sums: list[int] = []
        data = arena.data
        for j in np.flatnonzero(usable).tolist():
            i, at = run[j], int(offsets[j])
            arena.map_for_write(at, sizes[i])  # one call instead of a page fault per 4 KiB on first touch
            sums.append(copy_with_checksum(data[at : at + sizes[i]], arrays[i]))
            mine.append(j)
        for j in np.flatnonzero(held).tolist():
            result[run[j]] = True
        left = [run[j] for j in np.flatnonzero(~usable & ~held).tolist()]
        if not lease:
            return left
        keep = stock is not None and stock.lease == lease and stock.left() > 0  # the rest for the next puts
        if stock is not None and keep:
            self._stock.put_back(node.address, stock)
        wants = self._wants_stock(node.address, n)
        ahead = ahead_sizes(run_sizes.tolist(), self.nodes.max_keys(node.address)) if wants else []
        commit = node_pb2.CommitRequest(lease=lease, keys=pack_keys([keys[run[j]] for j in mine]),
                                        slots=slots[mine].tolist(), checksums=sums, next_sizes=ahead,
                                        keep_lease=keep)
        if pipe is not None:
            if ahead:
                self._asking_more(node.address, +1)
            if pipe.send(commit, partial(self._committed, node.address, arena, commit), deadline):
                for j in mine:  # in the node's slots, the Commit on its way: a refusal is a lost write, counted later
                    result[run[j]] = True
                return left
            if ahead:
                self._asking_more(node.address, -1)
        try:
            reply = stub.Commit(commit, timeout=call_timeout(deadline))
        except grpc.RpcError as exc:
            # a lost write (the node reclaims the slots when the lease lapses)
            self.faults.lost(error_kind(exc), exc, len(mine))
            return left
        if len(reply.stored) != len(mine):
            self.faults.lost("bad_reply", "commit reply fields disagree", len(mine))
            return left
        self._stock.keep(node.address, arena, reply.next, ahead)
        refused = 0
        for j, flag in zip(mine, reply.stored):
            result[run[j]] = flag != 0
            refused += flag == 0
        if refused:
            self.faults.counted("put_refused", refused)
            self._stock.drop(node.address, lease)  # its lease may be gone: its other slots too
        return left

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

    def _take_stock(self, address: str, arena: SharedArena, pipe: CommitPipe | None,
                    deadline: float) -> Stock | None:
        """A stock for the next put, waiting (until ``deadline``) for the replies in flight if the shelf is empty
        and one brings a stock."""
        stock = self._stock.take(address, arena)
        while stock is None and pipe is not None and self._stock_coming(address):
            waiting = pipe.in_flight
            if not waiting or not pipe.wait(waiting - 1, call_timeout(deadline)):
                break
            stock = self._stock.take(address, arena)
        return stock

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

    def _reserve(self, node: NodeRef, stub: Any, arena: SharedArena, run: list[int], keys: list[BlockKey],
                 sizes: list[int], lease: int, deadline: float) -> node_pb2.ReserveResponse | None:
        """Slots for ``run`` (added to ``lease`` if non-zero); None if the call failed or that lease is gone."""
        request = node_pb2.ReserveRequest(keys=pack_keys([keys[i] for i in run]), sizes=[sizes[i] for i in run],
                                          lease=lease)
        try:
            reply = stub.Reserve(request, timeout=call_timeout(deadline))
        except grpc.RpcError as exc:
            log.debug("Reserve on %s failed (%s); sending the blocks another way", node.address, error_kind(exc))
            return None
        if reply.arena != arena.name or not len(reply.slots) == len(reply.slot_gens) == len(run) or \
                len(reply.already_held) != len(run):
            self.faults.counted("bad_reply")
            return None
        if lease and reply.lease != lease:  # the lease to extend is gone: nothing was reserved
            return None
        return reply

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


def ahead_sizes(run_sizes: Sequence[int], max_keys: int) -> list[int]:
    """The slots to lease ahead after a put of ``run_sizes``: those sizes again and again, up to STOCK_BYTES,
    STOCK_SLOTS and the node's ``max_keys`` per call (one block at least)."""
    out: list[int] = []
    total = 0
    for n in islice(cycle(run_sizes), min(STOCK_SLOTS, max_keys)):
        if out and total + n > STOCK_BYTES:
            break
        out.append(n)
        total += n
    return out


@dataclass
class Stock:
    """Slots one node leased to this client ahead of its next puts (keys not known yet), until ``use_by``."""

    lease: int
    arena: SharedArena  # the mapping its slots are in (a restarted node's new segment is another)
    free: dict[int, list[tuple[int, int]]]  # block size -> (slot, gen) leased for blocks of exactly that size
    use_by: float  # time.monotonic() after which the lease may lapse under us: not used

    def assign(self, want: list[int], slots: np.ndarray, gens: np.ndarray) -> None:
        """Give each wanted size a slot of exactly that size while there are any (gens 0: none left); the slots
        given leave the stock."""
        for j, size in enumerate(want):
            pool = self.free.get(size)
            if pool:
                slots[j], gens[j] = pool.pop()

    def left(self) -> int:
        return sum(len(pool) for pool in self.free.values())


class StockShelf:
    """Each node's :class:`Stock` s for this client, oldest first (thread-safe: a put takes a stock, puts it back
    if slots are left, and a Commit brings the next)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stock: dict[str, deque[Stock]] = {}

    def take(self, address: str, arena: SharedArena) -> Stock | None:
        """The oldest stock still usable in ``arena`` (older ones are dropped: their leases lapse on the node)."""
        now = time.monotonic()
        with self._lock:
            shelf = self._stock.get(address)
            while shelf:
                stock = shelf.popleft()
                if stock.arena is arena and now <= stock.use_by:
                    return stock
        return None

    def drop(self, address: str, lease: int) -> None:
        """Forget the stock of ``lease`` (the node refused a commit of it)."""
        with self._lock:
            shelf = self._stock.get(address)
            if shelf:
                self._stock[address] = deque(stock for stock in shelf if stock.lease != lease)

    def put_back(self, address: str, stock: Stock) -> None:
        """Return a taken stock with slots left, to be taken first."""
        with self._lock:
            self._stock.setdefault(address, deque()).appendleft(stock)

    def keep(self, address: str, arena: SharedArena, reply: node_pb2.ReserveResponse, asked: list[int]) -> None:
        """File a Commit's ``next`` (slots leased for ``asked`` sizes, in order; gen 0: not granted)."""
        if not reply.lease or reply.arena != arena.name or not len(reply.slots) == len(reply.slot_gens) <= len(asked):
            return
        free: dict[int, list[tuple[int, int]]] = {}
        for size, slot, gen in zip(asked, reply.slots, reply.slot_gens):
            if gen:
                free.setdefault(size, []).append((slot, gen))
        if not free:
            return
        stock = Stock(reply.lease, arena, free, time.monotonic() + STOCK_USE_SHARE * reply.lease_timeout_s)
        with self._lock:
            self._stock.setdefault(address, deque()).append(stock)

    def slots_at(self, address: str) -> int:
        with self._lock:
            return sum(stock.left() for stock in self._stock.get(address, ()))

    def slots(self) -> int:
        with self._lock:
            return sum(stock.left() for shelf in self._stock.values() for stock in shelf)

    def clear(self) -> list[tuple[str, Stock]]:
        """Empty the shelf; what was on it."""
        with self._lock:
            stocks, self._stock = [(a, st) for a, shelf in self._stock.items() for st in shelf], {}
        return stocks
