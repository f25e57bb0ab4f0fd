"""The node core: what a node's transports (the gRPC servicer, the wire listener) do with its store, once.

Both :mod:`kvpool.node.servicer` (gRPC, and the fast calls Locate / Reserve /
Commit) and :mod:`kvpool.node.data_port` (the wire's bulk GET and PUT) translate
their requests and call this; NodeCore is all they see of the node: they
import nothing from :mod:`kvpool.tiers` and never reach a store or the arena
(``tests/unit/test_boundaries.py`` holds them to it). Each method is one step of a
request, and steps a request always takes together are one method (the end
of a zero-copy read, :meth:`NodeCore.end_read`; the wire PUT's own lease,
:meth:`NodeCore.request_lease` and :meth:`NodeCore.commit_request`).

Invariants:
- Keys: every key a request names is the caller's (:func:`kvpool.auth.caller`);
  :meth:`NodeCore.keys` maps them to their tenant's stored keys and refuses
  more than ``max_keys_per_call`` (ValueError), before any store sees them.
- Sizes: a block of 0 bytes, or one no tier takes, is a ValueError
  (:meth:`NodeCore.check_sizes`), before anything changes.
- Lookups never refresh recency, except :meth:`NodeCore.read_refs` and
  :meth:`NodeCore.locate` (reads: the caller reads the blocks next). A DRAM
  row is "that block" only while its gen is the one read with its metadata
  (the arena's seqlock, :class:`~kvpool.tiers.arena.SlotRef`: read between
  two looks at the gen); :meth:`NodeCore.end_read` is the look after bytes
  were sent.
- Every access to arena bytes from node code is :meth:`NodeCore.block_bytes`
  (:meth:`NodeStore.block_bytes <kvpool.tiers.node_store.NodeStore.block_bytes>`:
  the store hides the arena).
- Admission: a tenant's new blocks pass its quota (:mod:`kvpool.node.quota`);
  slots leased to a writer are charged from :meth:`NodeCore.reserve` until
  the lease ends (commit, release, or the reaper).
- A key is in the master's index only after its bytes and checksum are
  complete here: the stores report a change only once it is committed, and
  the master link sends it in the background, off the writer's path;
  :meth:`NodeCore.flush_reports` is the barrier for a writer that needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from kvpool.auth import caller_keys, caller_tenant
from kvpool.buffers import BufferLike, ScratchPool, byte_view
from kvpool.checksum import block_checksum
from kvpool.keys import KEY_BYTES, BlockKey, unpack_keys
from kvpool.metrics import ErrorMetrics
from kvpool.node.quota import Charge, QuotaLedger
from kvpool.tiers.arena import SlotRef
from kvpool.tiers.node_store import NodeStore
from kvpool.vocabulary import Tier, TierStats

AHEAD_SHARE = 256  # slots one writer holds ahead take at most 1/AHEAD_SHARE of DRAM...
AHEAD_ONE_SHARE = 16  # ...or one block of at most 1/AHEAD_ONE_SHARE of it (so a put of large blocks is one Commit)


@dataclass
class Leased:
    """What :meth:`NodeCore.reserve` leased: per request index, the slot and gen of blocks that got one."""

    lease: int  # 0: none (nothing leased, or the lease ended)
    slots: dict[int, tuple[int, int]]  # index -> (slot, odd gen)
    held: list[bool]  # per key: the node holds it already (nothing to write)
    refused: set[int] = field(default_factory=set)  # over the tenant's quota: not to be stored


class NodeCore:
    """One node's store as its transports see it (see the module docstring)."""

    def __init__(self, store: NodeStore, *, max_keys_per_call: int, errors: ErrorMetrics | None = None,
                 quota: QuotaLedger | None = None, report: Callable[[], bool] | None = None):
        self._store = store
        self.max_keys_per_call = max_keys_per_call
        self.errors = errors
        self.quota = quota
        self.report = report  # sends pending changes to the master: True once it has them (the master link)
        self.scratch: ScratchPool = store.scratch  # temporaries for SSD reads and no-slot puts (taken, given back)

    # -- what the node is -----------------------------------------------------------------------------

    @property
    def arena_name(self) -> str:
        """The DRAM arena same-host readers and writers attach to (Locate and Reserve replies name it)."""
        return self._store.arena_name

    @property
    def dram_max_block_bytes(self) -> int:
        """The largest block DRAM takes (larger ones live on SSD only)."""
        return self._store.dram.max_block_bytes

    def stats(self) -> list[TierStats]:
        """Per tier its usage and counters, DRAM first."""
        return self._store.stats()

    # -- keys and sizes -------------------------------------------------------------------------------

    def stored_packed(self, packed: bytes) -> bytes:
        """The stored keys (the caller's tenant's) of packed keys a request names; ValueError if malformed or too
        many."""
        if len(packed) % KEY_BYTES:
            raise ValueError(f"packed keys of {len(packed)} bytes: not a whole number of {KEY_BYTES}-byte keys")
        n = len(packed) // KEY_BYTES
        if n > self.max_keys_per_call:
            raise ValueError(f"{n} keys in one request; the limit is {self.max_keys_per_call}")
        return caller_keys(packed)

    def keys(self, packed: bytes) -> list[BlockKey]:
        """:meth:`stored_packed`, unpacked."""
        return unpack_keys(self.stored_packed(packed))

    def check_sizes(self, sizes: Sequence[int]) -> None:
        """ValueError for a block of 0 bytes or one no tier takes."""
        self._store.check_fits(sizes)

    # -- lookups --------------------------------------------------------------------------------------

    def where(self, keys: Sequence[BlockKey]) -> list[Tier | None]:
        """Per key the fastest tier holding it, or None (no recency change)."""
        return self._store.where(keys)

    def locate(self, keys: Sequence[BlockKey], *, promote: bool) -> list[SlotRef | None]:
        """Per key its DRAM copy for a same-host reader, stamped read (``promote``: SSD blocks brought in first,
        after the request's DRAM blocks were stamped: see NodeStore.locate)."""
        return self._store.locate(keys, promote=promote)

    def sizes(self, keys: Sequence[BlockKey]) -> list[tuple[int, int] | None]:
        """Per key (size, checksum) from whichever tier holds it, or None (no recency change)."""
        return [None if f is None else (f[1].size, f[1].checksum) for f in self._store.where_meta(keys)]

    def read_refs(self, keys: Sequence[BlockKey], lo: int, sizes: np.ndarray, sums: np.ndarray, tiers: np.ndarray,
                  slots: np.ndarray, gens: np.ndarray) -> None:
        """For a read of ``keys`` (entries ``lo`` on of the arrays): each key's size, checksum, tier and, in DRAM,
        slot and gen; DRAM hits count as reads for recency. Misses are left as they are (size 0)."""
        store = self._store
        lower: list[int] = []  # keys not in DRAM now
        for i, ref in enumerate(store.dram.locate(keys, touch=True), lo):
            if ref is None:
                lower.append(i)
            else:
                sizes[i], sums[i], tiers[i] = ref.length, ref.checksum, Tier.DRAM
                slots[i], gens[i] = ref.slot, ref.gen
        if lower and store.ssd is not None:
            for i, meta in zip(lower, store.ssd_meta([keys[i - lo] for i in lower])):
                if meta is not None:
                    sizes[i], sums[i], tiers[i] = meta.size, meta.checksum, Tier.SSD

    def block_bytes(self, slot: int, length: int) -> np.ndarray:
        """The first ``length`` bytes of DRAM row ``slot``'s extent: the one place node code touches arena memory.

        A view, not a copy: valid to read only while :meth:`end_read` would
        find the row still the block whose (slot, gen) the caller read;
        written only under a lease the caller holds.
        """
        return self._store.block_bytes(slot, length)

    def end_read(self, slots: np.ndarray, gens: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """After DRAM rows were sent straight from the arena: which of them are still the blocks read (the
        seqlock's second look: not reused since ``gens`` were read), as a bool mask.

        The intact rows count as DRAM hits (``sizes`` bytes out), the reused ones as misses.
        """
        intact = self._store.unchanged(slots, gens)
        hits = int(intact.sum())
        self._store.dram.record_reads(hits, len(intact) - hits, int(sizes[intact].sum()))
        return intact

    def load(self, keys: Sequence[BlockKey], outs: Sequence[BufferLike]) -> list[Tier | None]:
        """Read blocks from whichever tier holds them into ``outs`` (an SSD hit is promoted into DRAM)."""
        return self._store.get_into(keys, outs)

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Tell the quota ledger these keys were read (its LRU)."""
        if self.quota is not None:
            self.quota.touch(keys)

    # -- writes ---------------------------------------------------------------------------------------

    def admit(self, keys: Sequence[BlockKey], sizes: Sequence[int], candidates: list[int]) -> list[int]:
        """The candidates (indexes of new blocks) the caller's tenant may write now; see QuotaLedger.admit."""
        tenant = caller_tenant()
        if self.quota is None or not tenant or not candidates:
            return candidates
        ok = self.quota.admit(tenant, [keys[i] for i in candidates], [sizes[i] for i in candidates])
        return [i for i, admitted in zip(candidates, ok) if admitted]

    def reserve(self, keys: Sequence[BlockKey], sizes: Sequence[int], timeout_s: float | None, *,
                owner: object = None, charge_unfit: bool = False, extend: int = 0) -> Leased:
        """Lease DRAM slots to ``owner`` for the blocks not held yet that fit a slot and the tenant's quota.

        The lease lasts ``timeout_s`` (None: until committed or released). The
        tenant's quota is charged for the leased blocks until the lease ends;
        ``charge_unfit``: also for new blocks too large for a slot (the caller
        stores those itself, through :meth:`put`, in the same request).
        ``extend``: add the slots to that lease of ``owner``'s (see
        DramStore.reserve; a tenant with a quota has none to extend).
        """
        store = self._store
        held = [t is not None for t in store.where(keys)]
        new = [i for i in range(len(keys)) if not held[i] and (charge_unfit or store.fits_dram(sizes[i]))]
        tenant = caller_tenant()
        charge: Charge | None = None
        refused: set[int] = set()
        if self.quota is not None and tenant and new:  # charged from now on; the lease ends the charge
            charge = self.quota.reserve(tenant, [keys[i] for i in new], [sizes[i] for i in new])
            refused = {i for i, admitted in zip(new, charge.admitted) if not admitted}
        fit = [i for i in new if i not in refused and store.fits_dram(sizes[i])]
        res = store.dram.reserve([keys[i] for i in fit], [sizes[i] for i in fit], timeout_s, owner=owner,
                                 charge=charge, extend=extend)
        slots = {i: (s, g) for i, s, g in zip(fit, res.slots, res.gens) if g}
        for i, h in zip(fit, res.held):
            held[i] = held[i] or h
        return Leased(res.lease, slots, held, refused)

    @contextmanager
    def request_lease(self, keys: Sequence[BlockKey], sizes: Sequence[int]) -> Iterator[Leased]:
        """:meth:`reserve` for one request of the node's own (no timeout, ``charge_unfit``): the lease lasts as
        long as the ``with`` block. Unless :meth:`commit_request` ended it, it is released on the way out, so a
        request that fails or passes its deadline leaves no slot or charge behind."""
        leased = self.reserve(keys, sizes, None, charge_unfit=True)
        try:
            yield leased
        finally:
            if leased.lease:
                self._store.dram.release(leased.lease)

    def commit_request(self, leased: Leased, keys: Sequence[BlockKey], sizes: Sequence[int],
                       checksums: Sequence[int]) -> dict[int, bool]:
        """Publish a :meth:`request_lease`'s slots whose bytes match ``checksums`` (per request index) and end the
        lease; per leased index whether it was stored. These bytes crossed the network into the slots, so the node
        hashes them here, once (a same-host writer hashed its own copy: :meth:`commit`); a mismatch (bytes torn on
        their way in) is not published, and is counted as ``checksum``."""
        matching = {i: block_checksum(self._store.block_bytes(slot, sizes[i])) == checksums[i]
                    for i, (slot, _gen) in leased.slots.items()}
        idx = [i for i, match in matching.items() if match]
        stored = dict.fromkeys(matching, False)
        ok = self._store.commit(leased.lease, [keys[i] for i in idx], [leased.slots[i][0] for i in idx],
                                [checksums[i] for i in idx]) if idx else []
        if idx:  # the commit ended the lease (freed the slots it did not name); else request_lease's exit does
            leased.lease = 0
        self.count("checksum", len(matching) - len(idx))
        self.count("commit_refused", ok.count(False))
        stored.update(zip(idx, ok))
        return stored

    def commit(self, lease: int, keys: Sequence[BlockKey], slots: Sequence[int], checksums: Sequence[int], *,
               owner: object = None, keep: bool = False) -> list[bool]:
        """Publish a same-host writer's leased slots under its checksums, not hashed again (see DramStore.commit:
        readers verify every copy). A slot not stored (the lease lapsed or is not ``owner``'s, or the slot is not
        the lease's for that key) is counted as ``commit_refused``.
        """
        stored = self._store.commit(lease, keys, slots, checksums, owner=owner, keep=keep)
        self.count("commit_refused", stored.count(False))
        return stored

    def lease_ahead(self, sizes: Sequence[int], timeout_s: float | None, *, owner: object = None) -> Leased:
        """Slots for ``owner``'s next put, keys not known yet (none for a tenant under a quota: its charge is per
        key, and sizes no DRAM extent takes get none)."""
        tenant = caller_tenant()
        if self.quota is not None and tenant:
            return Leased(0, {}, [])
        fit: list[int] = []
        data = self._store.dram_bytes
        budget = data // AHEAD_SHARE  # what one writer may hold ahead (slots held ahead are DRAM no block uses)
        for n in (int(n) for n in sizes):
            if not n or not self._store.fits_dram(n) or (n > budget and (fit or n > data // AHEAD_ONE_SHARE)):
                break
            fit.append(n)
            budget -= n
        if not fit:
            return Leased(0, {}, [])
        res = self._store.dram.lease_ahead(fit, timeout_s, owner=owner)
        return Leased(res.lease, {i: (s, g) for i, (s, g) in enumerate(zip(res.slots, res.gens)) if g}, [])

    def put(self, keys: Sequence[BlockKey], values: Sequence[BufferLike], checksums: Sequence[int] | None
            ) -> list[bool]:
        """Store the blocks whose bytes match their checksums (all, if None), within the tenant's quota.

        A mismatch is a refusal (False), counted as ``checksum``.
        """
        good = list(range(len(keys)))
        if checksums is not None:
            good = [i for i in good if block_checksum(values[i]) == checksums[i]]
            self.count("checksum", len(keys) - len(good))
        stored = [False] * len(keys)
        good = self.admit(keys, [byte_view(v).nbytes for v in values], good)
        if good:
            for i, ok in zip(good, self._store.put([keys[i] for i in good], [values[i] for i in good])):
                stored[i] = ok
        return stored

    def remove(self, keys: Sequence[BlockKey]) -> int:
        """Drop keys from every tier and tell the master before returning; how many of them the node held."""
        keys = list(dict.fromkeys(keys))
        held = sum(t is not None for t in self._store.where(keys))
        self._store.remove(keys)
        self.flush_reports()  # a removed block leaves the index before Remove returns
        return held

    def trim(self, keys: Sequence[BlockKey]) -> None:
        """Bring the caller's tenant back within its quota, never evicting ``keys``."""
        tenant = caller_tenant()
        if self.quota is not None and tenant:
            self.quota.trim(tenant, keys)

    def flush_reports(self) -> bool:
        """Send what changed to the master now; True once it has every change made before the call.

        Writers do not call this: the master link reports in the background
        (soon after each change), so a put's reply never waits for the master;
        a client that needs its writes in the index asks (FlushReports)."""
        return self.report() if self.report is not None else True

    def count(self, kind: str, n: int = 1) -> None:
        if n and self.errors is not None:
            self.errors.count(kind, n)
