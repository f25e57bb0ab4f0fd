"""Slots a same-host node leased to this client ahead of its puts (the stock), and the handle of one leased slot.

A same-host writer copies a block straight into a slot of the node's arena
that a lease gave it (an odd gen: unreadable, the lease's), then ``Commit``
publishes the slot under the block's key. Each ``Commit`` may ask for the
next lease ahead (``next_sizes``, :func:`ahead_sizes`): slots for blocks of
the sizes just written, keys not known yet, filed here as a :class:`Stock`.
So a steady writer's next put takes its slots from the stock with no round
trip, and an engine can gather its blocks straight into them
(:class:`~kvpool.client.prepared.PreparedPut`).

Invariants:
- A stock's slots are slots of one lease in one arena mapping, each for a
  block of exactly the size it was leased for; a slot leaves the stock when
  it is assigned, and is then the assignee's to fill and commit (or to leave
  to the node, which frees it when the lease lapses).
- A stock is used only within ``STOCK_USE_SHARE`` of its lease's timeout
  (it must not lapse mid-put); older stocks are dropped (their leases lapse
  on the node).
- A :class:`LeasedSlot` is usable only while its slot's gen is still the one
  the lease gave (:meth:`LeasedSlot.ours`); the node never publishes a slot
  of another lease or key, so a stale handle costs a lost write, never a
  wrong block.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import cycle, islice

import numpy as np

from kvpool.tiers.arena import SharedArena
from kvpool.v1 import node_pb2

STOCK_BYTES = 1 << 20  # a stock holds at least this many bytes of slots (one block at least)...
STOCK_MAX_BYTES = 64 << 20  # ...or the last put's sizes once, up to this (the node grants less if it must)
STOCK_SLOTS = 256  # most slots one stock leases ahead
STOCK_USE_SHARE = 0.5  # a stock is used only within this share of its lease's timeout (it must not lapse mid-put)


def ahead_sizes(run_sizes: Sequence[int], max_keys: int = STOCK_SLOTS) -> list[int]:
    """The slots to lease ahead after a put of ``run_sizes``: those sizes again and again, up to the larger of
    STOCK_BYTES and the put's own bytes (at most STOCK_MAX_BYTES), and at most STOCK_SLOTS and the node's
    ``max_keys`` per call (one block at least)."""
    limit = min(max(STOCK_BYTES, sum(run_sizes)), STOCK_MAX_BYTES)
    out: list[int] = []
    total = 0
    for n in islice(cycle(run_sizes), min(STOCK_SLOTS, max_keys)):
        if out and total + n > limit:
            break
        out.append(n)
        total += n
    return out


@dataclass(frozen=True, slots=True)
class LeasedSlot:
    """One slot of a node's arena leased to this client for one block of ``size`` bytes (see module docstring)."""

    address: str  # the node's address
    arena: SharedArena
    lease: int
    slot: int
    gen: int  # the odd gen the lease gave the slot
    offset: int  # where the slot's extent starts in the arena's data region
    size: int
    reserved: bool = False  # from a ``Reserve`` (its lease ends at its Commit), not leased ahead

    def view(self) -> np.ndarray:
        """The slot's bytes, mapped for writing (one call instead of a page fault per 4 KiB on first touch)."""
        self.arena.map_for_write(self.offset, self.size)
        return self.arena.data[self.offset : self.offset + self.size]

    def ours(self) -> bool:
        """Whether the slot is still this lease's (the node has not reclaimed it)."""
        return bool(self.arena.unchanged(np.array([self.slot], dtype=np.int64),
                                         np.array([self.gen], dtype=np.uint64))[0])


@dataclass(frozen=True, slots=True)
class FilledSlot:
    """A leased slot the block's bytes are in, and their checksum (taken as they were copied in): all its
    ``Commit`` needs."""

    slot: LeasedSlot
    checksum: int


@dataclass
class Stock:
    """Slots one node leased to this client ahead of its next puts (keys not known yet), until ``use_by``."""

    lease: int
    arena: SharedArena  # the mapping its slots are in (a restarted node's new segment is another)
    free: dict[int, list[tuple[int, int]]]  # block size -> (slot, gen) leased for blocks of exactly that size
    use_by: float  # time.monotonic() after which the lease may lapse under us: not used

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

    def keep(self, address: str, arena: SharedArena, reply: node_pb2.ReserveResponse, asked: Sequence[int]) -> None:
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

    def lease(self, address: str, arena: SharedArena, sizes: Sequence[int]) -> list[LeasedSlot | None]:
        """Per size a slot of the node's stock (None: none left of that size, or the node took it back); the
        slots given leave the shelf. No round trip."""
        out: list[LeasedSlot | None] = [None] * len(sizes)
        pending = list(range(len(sizes)))
        got: list[tuple[int, int, int, int]] = []  # (block, lease, slot, gen)
        while pending:
            stock = self.take(address, arena)
            if stock is None:
                break
            rest = []
            for j in pending:
                pool = stock.free.get(sizes[j])
                if pool:
                    slot, gen = pool.pop()
                    got.append((j, stock.lease, slot, gen))
                else:
                    rest.append(j)
            pending = rest
            if stock.left():
                self.put_back(address, stock)
                break  # its slots are of other sizes: an older stock is not looked past
        if not got:
            return out
        slots = np.fromiter((g[2] for g in got), dtype=np.int64, count=len(got))
        gens = np.fromiter((g[3] for g in got), dtype=np.uint64, count=len(got))
        usable = arena.unchanged(slots, gens)  # still our turn on the slot (the node may have reclaimed it)
        offsets = arena.table["offset"][np.where(usable, slots, 0)].tolist()  # set before the turn began
        for (j, lease, slot, gen), ok, offset in zip(got, usable.tolist(), offsets):
            if ok and offset <= arena.data_bytes - sizes[j]:
                out[j] = LeasedSlot(address, arena, lease, slot, gen, offset, int(sizes[j]))
        return out

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
