"""Per-tenant byte quotas on one pool node (auth file ``quota_bytes``; docs/security.md).

What a tenant holds on a node is the bytes of its distinct blocks in DRAM or
SSD (a block in both counts once). What it *reserves* is the bytes of the
DRAM slots leased to its writers and not committed yet (:class:`Charge`).
Which tenant a stored key belongs to is its tag (:func:`kvpool.auth.tag_of`),
so nothing extra is stored with a block and the ledger is rebuilt from the
SSD inventory when the node restarts (no lease survives a restart).

Invariants:
- The ledger follows the stores' ``on_change`` events and, for each key an
  event names, re-checks whether the node holds it now (events of two threads
  may arrive out of order: the last re-check tells the truth).
- A tenant's held bytes plus its reserved bytes count against its quota.
- :meth:`QuotaLedger.admit` runs before a write of a tenant's new blocks: it
  admits them in batch order while they fit in the quota next to what the
  tenant reserves, makes room by removing that tenant's own least recently
  used blocks (never a block of the batch, never another tenant's, never a
  reservation), and refuses the rest (counted as ``quota_exceeded``). A
  block alone larger than the quota is refused.
- :meth:`QuotaLedger.reserve` is ``admit`` for blocks about to get leased
  DRAM slots: in the same locked step it charges the admitted blocks' bytes
  as reserved, so concurrent reservations of one tenant never add up to more
  than its quota. The :class:`Charge` ends exactly when the lease does
  (:class:`kvpool.tiers.dram.DramStore` ends it: on commit after the
  committed blocks were counted as held, on release, expiry or close), and
  ``keep`` narrows it to the blocks that got a slot.
- :meth:`QuotaLedger.trim` runs after the write: concurrent puts of one
  tenant may overshoot briefly; trim evicts that tenant's older blocks until
  its held and reserved bytes are within its quota again.
- Tenants without a quota cost nothing: their keys and leases are not tracked.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence

from kvpool.keys import BlockKey
from kvpool.tiers.base import ChangeListener
from kvpool.vocabulary import BlockMeta

log = logging.getLogger(__name__)


class Charge:
    """Reserved bytes of one lease of ``tenant``, counted against its quota until :meth:`end` (a LeaseCharge).

    ``admitted``: per key :meth:`QuotaLedger.reserve` was asked about, whether
    the quota admitted it; only admitted new blocks are charged. The charge
    only ever shrinks: :meth:`keep` narrows it, :meth:`end` empties it.
    """

    __slots__ = ("_ledger", "_sizes", "admitted", "tenant")

    def __init__(self, ledger: QuotaLedger, tenant: str):
        self._ledger = ledger
        self.tenant = tenant
        self.admitted: list[bool] = []
        self._sizes: dict[BlockKey, int] = {}  # the charged blocks (guarded by the ledger's lock)

    def keep(self, keys: Sequence[BlockKey]) -> None:
        """Only these keys stay charged (the blocks that got a slot); a no-op once ended."""
        self._ledger._narrow(self, set(keys))

    def end(self) -> None:
        """The lease is over: its bytes are no longer reserved. Idempotent."""
        self._ledger._narrow(self, set())


class QuotaLedger:
    """Bytes per tenant held on this node and the quota checks on its write path (see module docstring)."""

    def __init__(
        self,
        quotas: Mapping[str, int],
        tenant_of: Callable[[bytes], str | None],
        held: Callable[[Sequence[BlockKey]], list[bool]],
        evict: Callable[[list[BlockKey]], object],
        *,
        on_refused: Callable[[int], None] | None = None,
        on_evicted: Callable[[int], None] | None = None,
    ):
        if any(q <= 0 for q in quotas.values()):
            raise ValueError("quota ledger: every quota must be positive (tenants without one are not listed)")
        self.quotas = dict(quotas)
        self._tenant_of = tenant_of
        self._held = held
        self._evict = evict
        self._on_refused = on_refused
        self._on_evicted = on_evicted
        self._lock = threading.Lock()
        self._blocks: dict[str, OrderedDict[BlockKey, int]] = {t: OrderedDict() for t in self.quotas}  # LRU first
        self._used: dict[str, int] = {t: 0 for t in self.quotas}
        self._reserved: dict[str, int] = {t: 0 for t in self.quotas}  # sum of the tenant's live charges

    def _tenant(self, key: bytes) -> str | None:
        tenant = self._tenant_of(key)
        return tenant if tenant in self.quotas else None

    # -- following the stores ----------------------------------------------------------------

    def load(self, metas: Iterable[BlockMeta]) -> None:
        """Count blocks the node already holds (the SSD inventory at start-up)."""
        with self._lock:
            for meta in metas:
                tenant = self._tenant(meta.key)
                if tenant is not None and meta.key not in self._blocks[tenant]:
                    self._blocks[tenant][meta.key] = meta.size
                    self._used[tenant] += meta.size

    def listener(self, inner: ChangeListener | None) -> ChangeListener:
        """An ``on_change`` for a tier store: calls ``inner`` (the master link), then updates the ledger."""

        def on_change(added: Sequence[BlockMeta], removed: Sequence[BlockKey]) -> None:
            try:
                if inner is not None:
                    inner(added, removed)
            finally:
                self._changed(added, removed)

        return on_change

    def _changed(self, added: Sequence[BlockMeta], removed: Sequence[BlockKey]) -> None:
        sizes = {m.key: m.size for m in added if self._tenant(m.key) is not None}
        keys = list(dict.fromkeys([*sizes, *(k for k in removed if self._tenant(k) is not None)]))
        if not keys:
            return
        with self._lock:  # held-check and update together: the last event's check wins
            for key, now in zip(keys, self._held(keys)):
                tenant = self._tenant(key)
                assert tenant is not None, "quota ledger: an untracked key in a tracked batch"
                blocks = self._blocks[tenant]
                if now and key not in blocks and key in sizes:
                    blocks[key] = sizes[key]
                    self._used[tenant] += sizes[key]
                elif not now and key in blocks:
                    self._used[tenant] -= blocks.pop(key)

    def touch(self, keys: Iterable[BlockKey]) -> None:
        """Reads keep a tenant's blocks young: move them to the most recently used end."""
        with self._lock:
            for key in keys:
                tenant = self._tenant(key)
                if tenant is not None and key in self._blocks[tenant]:
                    self._blocks[tenant].move_to_end(key)

    def used(self, tenant: str) -> int:
        """Bytes ``tenant`` holds on this node now (0 for a tenant without a quota)."""
        with self._lock:
            return self._used.get(tenant, 0)

    def reserved(self, tenant: str) -> int:
        """Bytes of ``tenant``'s live leases on this node now (0 for a tenant without a quota)."""
        with self._lock:
            return self._reserved.get(tenant, 0)

    # -- the write path -----------------------------------------------------------------------

    def admit(self, tenant: str, keys: Sequence[BlockKey], sizes: Sequence[int]) -> list[bool]:
        """Per key, whether ``tenant`` may write it (held keys: yes); makes room first (see module docstring)."""
        return self._admit(tenant, keys, sizes, None)

    def reserve(self, tenant: str, keys: Sequence[BlockKey], sizes: Sequence[int]) -> Charge:
        """:meth:`admit` for blocks about to be leased slots, charging the admitted new ones until the charge ends.

        The caller hands the charge to the lease (``DramStore.reserve(..., charge=)``), which ends it.
        """
        charge = Charge(self, tenant)
        charge.admitted = self._admit(tenant, keys, sizes, charge)
        return charge

    def _narrow(self, charge: Charge, keep: set[BlockKey]) -> None:
        """Stop charging ``charge``'s blocks that are not in ``keep`` (it never grows: a no-op once ended)."""
        with self._lock:
            dropped = [k for k in charge._sizes if k not in keep]
            for key in dropped:
                self._reserved[charge.tenant] -= charge._sizes.pop(key)

    def _admit(self, tenant: str, keys: Sequence[BlockKey], sizes: Sequence[int], charge: Charge | None) -> list[bool]:
        quota = self.quotas.get(tenant)
        if quota is None or not keys:
            return [True] * len(keys)
        decided: dict[BlockKey, bool] = {}
        victims: list[BlockKey] = []
        with self._lock:
            blocks = self._blocks[tenant]
            reserved = self._reserved[tenant]
            batch = set(keys)
            room = quota - reserved - sum(blocks[k] for k in batch if k in blocks)
            new = 0
            for key, size in zip(keys, sizes):
                if key in decided:
                    continue
                if key in blocks:
                    decided[key] = True
                elif new + int(size) <= room:
                    decided[key] = True
                    new += int(size)
                    if charge is not None:
                        charge._sizes[key] = int(size)
                else:
                    decided[key] = False
            if charge is not None:
                self._reserved[tenant] += new  # from now on: concurrent admits see it
            need = self._used[tenant] + reserved + new - quota
            for key, size in blocks.items():  # LRU first; the batch's own blocks stay
                if need <= 0:
                    break
                if key not in batch:
                    victims.append(key)
                    need -= size
        refused = sum(not ok for ok in decided.values())
        if victims:
            self._remove(tenant, victims)
        if refused:
            log.debug("quota: tenant %s refused %d blocks (quota %d bytes)", tenant, refused, quota)
            if self._on_refused is not None:
                self._on_refused(refused)
        return [decided[k] for k in keys]

    def trim(self, tenant: str, protect: Iterable[BlockKey] = ()) -> int:
        """Evict ``tenant``'s least recently used blocks (not ``protect``) while held + reserved exceed its quota."""
        quota = self.quotas.get(tenant)
        if quota is None:
            return 0
        keep = set(protect)
        victims: list[BlockKey] = []
        with self._lock:
            over = self._used[tenant] + self._reserved[tenant] - quota
            for key, size in self._blocks[tenant].items():
                if over <= 0:
                    break
                if key not in keep:
                    victims.append(key)
                    over -= size
        if victims:
            self._remove(tenant, victims)
        return len(victims)

    def _remove(self, tenant: str, victims: list[BlockKey]) -> None:
        """Remove blocks from the node (outside the lock: the stores' events come back here)."""
        log.debug("quota: evicting %d blocks of tenant %s", len(victims), tenant)
        self._evict(victims)
        if self._on_evicted is not None:
            self._on_evicted(len(victims))
