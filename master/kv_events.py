"""The master's KV event feed: the index's tier transitions as vLLM-format event batches (:mod:`kvpool.events`).

Invariants:

- One or more batches per changing index call, each encoding to at most
  :data:`~kvpool.events.MAX_BATCH_BYTES` (a dropped node's millions of blocks go out in many), published
  from under that index's lock (the publisher only queues), so each tenant's stream is in the order the
  changes were applied.
- Pool batches (media ``CPU`` for DRAM, ``STORAGE`` for SSD) go out on ``PREFIX/pool``, a worker's HBM
  batches (``GPU``) on ``PREFIX/hbm/WORKER``, ``PREFIX`` being the tenant's
  (:func:`~kvpool.events.tenant_prefix`): ``TOPIC`` with auth off, ``TOPIC/<tenant>`` with an auth file.
- With an auth file a block is its tenant's, the one whose tag its stored key ends with
  (:mod:`kvpool.auth`): its events go to that tenant only, in that tenant's sequence, named as that
  tenant names it: by its engine's hash where the tenant gave one (:mod:`~kvpool.master.engine_names`),
  else by :func:`~kvpool.events.key_hash` of the tenant's own key (the stored key's first 8 bytes with the
  tenant's mask taken off), what its router computes. A block of no known tenant is published to no one
  (counted). With auth off every block is the one tenant ""'s, named by the key as stored.
- A stored event means the key's first copy in that tier appeared on some node, a removed event that its
  last copy there went: a router that applies its stream to an empty set knows, per key, the tiers the pool
  holds it in, exactly, until a gap (a dropped batch) or ``AllBlocksCleared`` (sent to every tenant when the
  feed starts and when its master is elected: the index starts empty).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvpool.auth import Authority, tag_of
from kvpool.event_publisher import EventPublisher
from kvpool.events import (
    EVENT_BYTES,
    HASH_BYTES,
    MAX_BATCH_BYTES,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    KVEvent,
    removed,
    stored,
    tenant_prefix,
)
from kvpool.keys import BlockKey
from kvpool.master.engine_names import EngineNames
from kvpool.master.index import TierChange, key_tags
from kvpool.vocabulary import Tier
from kvpool.worker_ids import split_scoped_id

MEDIUM = {Tier.DRAM: MEDIUM_CPU, Tier.SSD: MEDIUM_STORAGE, Tier.HBM: MEDIUM_GPU}
BATCH_ROOM = MAX_BATCH_BYTES - 64  # bytes for a batch's events (its timestamp and headers take the rest)
U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]
Change = tuple[bool, str, list[int]]  # (stored, medium, hashes)


def key_hashes(k0: U64) -> U64:
    """:func:`~kvpool.events.key_hash` of keys whose first word (8 key bytes, native order) is ``k0``."""
    return np.frombuffer(np.ascontiguousarray(k0).tobytes(), ">u8").astype(np.uint64)


@dataclass(frozen=True)
class Tenants:
    """The tenants of an auth file as the feed needs them: by tag, with each one's mask's first word."""

    names: tuple[str, ...]
    tags: U32  # sorted native-order tags; names[order[i]] has tags[i]
    order: npt.NDArray[np.intp]
    mask0: U64  # per tenant (in names' order): its mask's first 8 bytes as a native word

    @classmethod
    def of(cls, authority: Authority) -> Tenants:
        names = tuple(authority.tenants)
        masks = [authority.mask(t) for t in names]
        tags = np.array([np.frombuffer(tag_of(m), np.uint32)[0] for m in masks], np.uint32)
        order = np.argsort(tags)
        mask0 = np.array([np.frombuffer(m[:8], np.uint64)[0] for m in masks], np.uint64)
        return cls(names, tags[order], order, mask0)

    def of_tags(self, tags: U32) -> npt.NDArray[np.intp]:
        """Per tag, the index of its tenant in ``names``; -1 for a tag of no tenant."""
        if not len(self.tags):
            return np.full(len(tags), -1, np.intp)
        at = np.minimum(np.searchsorted(self.tags, tags), len(self.tags) - 1)
        return np.where(self.tags[at] == tags, self.order[at], -1)


class MasterEventFeed:
    """Publishes a master's index changes on ``publisher`` (which it closes with :meth:`close`); ``tenants``
    with an auth file, None without."""

    def __init__(self, publisher: EventPublisher, topic: str, names: EngineNames | None = None,
                 tenants: Tenants | None = None):
        self.publisher = publisher
        self.names = names
        self.tenants = tenants
        self._prefixes = [tenant_prefix(topic, t) for t in (tenants.names if tenants is not None else ("",))]
        self._unattributed = publisher.metrics.refused.labels("tenant")
        self.cleared()

    @property
    def pool_topic(self) -> str:
        """The pool topic of auth off (tests, logs)."""
        return self._prefixes[0] + "pool"

    def hbm_topic(self, worker: str, tenant: int = 0) -> str:
        return f"{self._prefixes[tenant]}hbm/{worker}"

    def cleared(self) -> None:
        """Tell every tenant's subscribers the pool's view starts empty (a fresh or newly elected master)."""
        for who, prefix in enumerate(self._prefixes):
            self.publisher.publish([AllBlocksCleared()], prefix + "pool", self._tenant(who))

    def pool_changed(self, changes: list[TierChange]) -> None:
        """:class:`~kvpool.master.index.BlockIndex`'s sink."""
        per_tenant: dict[int, list[Change]] = {}
        for change in changes:
            for who, k0, k1 in self._split(change.k0, change.k1, change.tag):
                per_tenant.setdefault(who, []).append((change.stored, MEDIUM[change.tier], self._hashes(k0, k1, who)))
        for who, parts in per_tenant.items():
            self._publish(parts, self._prefixes[who] + "pool", who)

    def hbm_changed(self, worker: str, held: list[BlockKey], gone: list[BlockKey]) -> None:
        """:class:`~kvpool.master.index.HbmIndex`'s sink; ``worker``: the master's worker id, with an auth file
        scoped (:func:`kvpool.worker_ids.scoped_id`): its tenant part is then the only tenant it publishes for
        (a plain id: each key's tenant by its tag)."""
        tenant, worker_id = split_scoped_id(worker) if self.tenants is not None else ("", worker)
        only = self._index_of(tenant) if tenant else None
        per_tenant: dict[int, list[Change]] = {}
        for keys, is_stored in ((held, True), (gone, False)):
            if not keys:
                continue
            packed = b"".join(keys)
            words = np.frombuffer(packed, np.uint64).reshape(-1, 4)
            for who, k0, k1 in self._split(words[:, 0], words[:, 1], key_tags(packed), only):
                per_tenant.setdefault(who, []).append((is_stored, MEDIUM_GPU, self._hashes(k0, k1, who)))
        for who, parts in per_tenant.items():
            self._publish(parts, self.hbm_topic(worker_id, who), who)

    def close(self) -> None:
        self.publisher.close()

    # -- internals --------------------------------------------------------------------------------

    def _tenant(self, who: int) -> str:
        return self.tenants.names[who] if self.tenants is not None else ""

    def _index_of(self, tenant: str) -> int:
        assert self.tenants is not None
        return self.tenants.names.index(tenant) if tenant in self.tenants.names else -1

    def _split(self, k0: U64, k1: U64, tags: U32 | None, only: int | None = None) -> Iterator[tuple[int, U64, U64]]:
        """(tenant index, k0, k1) per tenant among the keys; keys of no tenant (or not of ``only``) counted."""
        if self.tenants is None:
            yield 0, k0, k1
            return
        assert tags is not None, "MasterEventFeed: an auth file's feed needs the index to keep tags"
        owners = self.tenants.of_tags(tags)
        if only is not None:
            owners = np.where(owners == only, owners, -1)
        lost = int(np.count_nonzero(owners < 0))
        if lost:
            self._unattributed.inc(lost)
        for who in np.unique(owners[owners >= 0]).tolist():
            mine = owners == who
            yield who, k0[mine], k1[mine]

    def _hashes(self, k0: U64, k1: U64, who: int) -> list[int]:
        """Each key's name in events, as its tenant sees it: its engine's hash if it has one, else its key's."""
        own = k0 if self.tenants is None else k0 ^ self.tenants.mask0[who]
        hashes = key_hashes(own)
        if self.names is not None:
            named = self.names.names_of(k0, k1)
            hashes = np.where(named != 0, named, hashes)
        return hashes.tolist()

    def _publish(self, parts: list[Change], topic: str, who: int) -> None:
        """``parts`` as batches of at most MAX_BATCH_BYTES, in order."""
        tenant = self._tenant(who)
        for batch in _batches(parts):
            self.publisher.publish(batch, topic, tenant)


def _batches(parts: list[Change]) -> Iterator[list[KVEvent]]:
    """Events for ``parts``, cut into batches whose encoding fits :data:`BATCH_ROOM` (each hash at most
    HASH_BYTES, each event's own fields EVENT_BYTES)."""
    batch: list[KVEvent] = []
    room = BATCH_ROOM
    for is_stored, medium, hashes in parts:
        make = stored if is_stored else removed
        at = 0
        while at < len(hashes):
            fits = (room - EVENT_BYTES) // HASH_BYTES
            if fits <= 0:
                yield batch
                batch, room = [], BATCH_ROOM
                continue
            part = hashes[at:at + fits]
            at += len(part)
            batch.append(make(part, medium))
            room -= EVENT_BYTES + HASH_BYTES * len(part)
    if batch:
        yield batch
