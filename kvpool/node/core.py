"""The node core: what a node's transports (the gRPC servicer, the wire listener) do with its store, once.

Both :mod:`kvpool.node.servicer` (gRPC, and the fast calls Locate / Reserve /
Commit) and :mod:`kvpool.node.bulk` (the wire's bulk GET and PUT) translate
their requests and call this; neither looks into the tiers for itself.

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
  two looks at the gen); :meth:`NodeCore.intact` is the look after bytes
  were sent.
- Every access to arena bytes from node code is :meth:`NodeCore.block_bytes`.
- Admission: a tenant's new blocks pass its quota (:mod:`kvpool.node.quota`);
  slots leased to a writer are charged from :meth:`NodeCore.reserve` until
  the lease ends (commit, release, or the reaper).
- A key is in the master's index only after its bytes and checksum are
  complete here: the stores report a change only once it is committed, and
  the master link sends it in the background, off the writer's path;
  :meth:`NodeCore.flush_reports` is the barrier for a writer that needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpool.auth import caller_keys, caller_tenant
from kvpool.buffers import BufferLike, byte_view
from kvpool.checksum import block_checksum
from kvpool.core import Tier
from kvpool.keys import KEY_BYTES, BlockKey, unpack_keys
from kvpool.metrics import ErrorMetrics
from kvpool.node.quota import Charge, QuotaLedger
from kvpool.tiers.arena import SlotRef
from kvpool.tiers.node_store import NodeStore

AHEAD_SHARE = 256  # slots one writer holds ahead take at most 1/AHEAD_SHARE of DRAM...
AHEAD_ONE_SHARE = 16  # ...or one block of at most 1/AHEAD_ONE_SHARE of it (so a put of large blocks is one Commit)


@dataclass
class Leased:
    """What :meth:`NodeCore.reserve` leased: per request index, the slot and gen of blocks that got one."""

    lease: int
    slots: dict[int, tuple[int, int]]  # index -> (slot, odd gen)
    held: list[bool]  # per key: the node holds it already (nothing to write)
    refused: set[int] = field(default_factory=set)  # over the tenant's quota: not to be stored


class NodeCore:
    """One node's store as its transports see it (see the module docstring)."""

    def __init__(self, store: NodeStore, *, max_keys_per_call: int, errors: ErrorMetrics | None = None,
                 quota: QuotaLedger | None = None, report: Callable[[], bool] | None = None):
        self.store = store
        self.max_keys_per_call = max_keys_per_call
        self.errors = errors
        self.quota = quota
        self.report = report  # sends pending changes to the master: True once it has them (the master link)

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
        store = self.store
        for i, n in enumerate(sizes):
            if n == 0:
                raise ValueError(f"block {i} is empty (a block of 0 bytes)")
            if not store.fits_dram(n) and (store.ssd is None or not store.ssd.fits(n)):
                raise ValueError(f"a {n}-byte block fits neither DRAM (at most {store.dram.max_block_bytes} B) "
                                 "nor the SSD tier")

    # -- lookups --------------------------------------------------------------------------------------

    def locate(self, keys: Sequence[BlockKey], *, promote: bool) -> list[SlotRef | None]:
        """Per key its DRAM copy for a same-host reader, stamped read (``promote``: SSD blocks brought in first,
        after the request's DRAM blocks were stamped: see NodeStore.locate)."""
        return self.store.locate(keys, promote=promote)

    def sizes(self, keys: Sequence[BlockKey]) -> list[tuple[int, int] | None]:
        """Per key (size, checksum) from whichever tier holds it, or None (no recency change)."""
        found: list[tuple[int, int] | None] = [None if r is None else (r.length, r.checksum)
                                               for r in self.store.dram.locate(keys)]
        missing = [i for i, f in enumerate(found) if f is None]
        if missing and self.store.ssd is not None:
            for i, meta in zip(missing, self.store.ssd_meta([keys[i] for i in missing])):
                if meta is not None:
                    found[i] = (meta.size, meta.checksum)
        return found

    def read_refs(self, keys: Sequence[BlockKey], lo: int, sizes: np.ndarray, sums: np.ndarray, tiers: np.ndarray,
                  slots: np.ndarray, gens: np.ndarray) -> None:
        """For a read of ``keys`` (entries ``lo`` on of the arrays): each key's size, checksum, tier and, in DRAM,
        slot and gen; DRAM hits count as reads for recency. Misses are left as they are (size 0)."""
        lower: list[int] = []  # keys not in DRAM now
        for i, ref in enumerate(self.store.dram.locate(keys, touch=True), lo):
            if ref is None:
                lower.append(i)
            else:
                sizes[i], sums[i], tiers[i] = ref.length, ref.checksum, Tier.DRAM
                slots[i], gens[i] = ref.slot, ref.gen
        if lower and self.store.ssd is not None:
            for i, meta in zip(lower, self.store.ssd_meta([keys[i - lo] for i in lower])):
                if meta is not None:
                    sizes[i], sums[i], tiers[i] = meta.size, meta.checksum, Tier.SSD

    def block_bytes(self, slot: int, length: int) -> Any:
        """The first ``length`` bytes of DRAM row ``slot``'s extent: the one place node code touches arena memory.

        A view, not a copy: valid to read only while :meth:`intact` says the
        row is still the block whose (slot, gen) the caller read; written only
        under a lease the caller holds.
        """
        return self.store.dram.arena.block(slot, length)

    def intact(self, slots: np.ndarray, gens: np.ndarray) -> np.ndarray:
        """Per (slot, gen): whether the row is still that block (not reused since the gen was read)."""
        return self.store.dram.arena.unchanged(slots, gens)

    def record_reads(self, hits: int, misses: int, bytes_out: int) -> None:
        self.store.dram.record_reads(hits, misses, bytes_out)

    def load(self, keys: Sequence[BlockKey], outs: Sequence[BufferLike]) -> list[Tier | None]:
        """Read blocks from whichever tier holds them into ``outs`` (an SSD hit is promoted into DRAM)."""
        return self.store.get_into(keys, outs)

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
        store = self.store
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

    def commit(self, lease: int, keys: Sequence[BlockKey], slots: Sequence[int], checksums: Sequence[int], *,
               owner: object = None, keep: bool = False) -> list[bool]:
        """Publish the lease's slots with their writer's checksums, not hashed again (see DramStore.commit)."""
        return self.store.commit(lease, keys, slots, checksums, owner=owner, keep=keep)

    def lease_ahead(self, sizes: Sequence[int], timeout_s: float | None, *, owner: object = None) -> Leased:
        """Slots for ``owner``'s next put, keys not known yet (none for a tenant under a quota: its charge is per
        key, and sizes no DRAM extent takes get none)."""
        tenant = caller_tenant()
        if self.quota is not None and tenant:
            return Leased(0, {}, [])
        fit: list[int] = []
        data = self.store.dram.arena.data_bytes
        budget = data // AHEAD_SHARE  # what one writer may hold ahead (slots held ahead are DRAM no block uses)
        for n in (int(n) for n in sizes):
            if not n or not self.store.fits_dram(n) or (n > budget and (fit or n > data // AHEAD_ONE_SHARE)):
                break
            fit.append(n)
            budget -= n
        if not fit:
            return Leased(0, {}, [])
        res = self.store.dram.lease_ahead(fit, timeout_s, owner=owner)
        return Leased(res.lease, {i: (s, g) for i, (s, g) in enumerate(zip(res.slots, res.gens)) if g}, [])

    def release(self, lease: int) -> None:
        self.store.dram.release(lease)

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
            for i, ok in zip(good, self.store.put([keys[i] for i in good], [values[i] for i in good])):
                stored[i] = ok
        return stored

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
