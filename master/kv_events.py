"""The master's KV event feed: the index's tier transitions as vLLM-format event batches (:mod:`kvpool.events`).

Invariants:

- One batch per changing index call (several, of at most ``MAX_BATCH_BLOCKS`` hashes each, for a large one:
  a dropped node's millions of blocks), published from under that index's lock (the publisher only
  queues), so the stream's order is the order the changes were applied.
- Pool batches (media ``CPU`` for DRAM, ``STORAGE`` for SSD) go out on ``TOPIC/pool``; a worker's HBM batches
  (``GPU``) on ``TOPIC/hbm/WORKER``. Both share the publisher's one sequence.
- A block is named by its engine's hash where a client gave one (:mod:`~kvpool.master.engine_names`), by
  :func:`~kvpool.events.key_hash` otherwise.
- A stored event means the key's first copy in that tier appeared on some node, a removed event that its
  last copy there went: a router that applies the stream to an empty set knows, per key, the tiers the pool
  holds it in, exactly, until a gap (a dropped batch) or ``AllBlocksCleared`` (sent when the feed starts and
  when its master is elected: the index starts empty).
"""

from __future__ import annotations

import numpy as np

from kvpool.core import Tier
from kvpool.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    EventPublisher,
    KVEvent,
    removed,
    stored,
)
from kvpool.keys import BlockKey
from kvpool.master.engine_names import EngineNames
from kvpool.master.index import TierChange

MEDIUM = {Tier.DRAM: MEDIUM_CPU, Tier.SSD: MEDIUM_STORAGE, Tier.HBM: MEDIUM_GPU}
MAX_BATCH_BLOCKS = 65_536  # hashes in one batch: about 600 KB of msgpack


def key_hashes(k0: np.ndarray) -> np.ndarray:
    """:func:`~kvpool.events.key_hash` of keys whose first word (8 key bytes, native order) is ``k0``."""
    return np.frombuffer(np.ascontiguousarray(k0).tobytes(), ">u8").astype(np.uint64)


class MasterEventFeed:
    """Publishes a master's index changes on ``publisher`` (which it closes with :meth:`close`)."""

    def __init__(self, publisher: EventPublisher, topic: str, names: EngineNames | None = None):
        self.publisher = publisher
        self.names = names
        self.pool_topic = f"{topic}/pool"
        self._hbm_prefix = f"{topic}/hbm/"
        self.cleared()

    def hbm_topic(self, worker: str) -> str:
        return self._hbm_prefix + worker

    def cleared(self) -> None:
        """Tell subscribers the pool's view starts empty (a fresh or newly elected master)."""
        self.publisher.publish([AllBlocksCleared()], self.pool_topic)

    def pool_changed(self, changes: list[TierChange]) -> None:
        """:class:`~kvpool.master.index.BlockIndex`'s sink."""
        batch: list[KVEvent] = []
        room = MAX_BATCH_BLOCKS
        for change in changes:
            hashes, make = self._hashes(change.k0, change.k1), stored if change.stored else removed
            while hashes:
                if room == 0:
                    self.publisher.publish(batch, self.pool_topic)
                    batch, room = [], MAX_BATCH_BLOCKS
                part, hashes = hashes[:room], hashes[room:]
                batch.append(make(part, MEDIUM[change.tier]))
                room -= len(part)
        self.publisher.publish(batch, self.pool_topic)

    def _hashes(self, k0: np.ndarray, k1: np.ndarray) -> list[int]:
        """Each key's name in events: its engine's hash if it has one, else its kvpool key's."""
        hashes = key_hashes(k0)
        if self.names is not None:
            named = self.names.names_of(k0, k1)
            hashes = np.where(named != 0, named, hashes)
        return hashes.tolist()

    def hbm_changed(self, worker: str, held: list[BlockKey], gone: list[BlockKey]) -> None:
        """:class:`~kvpool.master.index.HbmIndex`'s sink."""
        events: list[KVEvent] = []
        for keys, make in ((held, stored), (gone, removed)):
            if keys:
                words = np.frombuffer(b"".join(keys), np.uint64).reshape(-1, 4)
                events.append(make(self._hashes(words[:, 0], words[:, 1]), MEDIUM_GPU))
        self.publisher.publish(events, self.hbm_topic(worker))

    def close(self) -> None:
        self.publisher.close()
