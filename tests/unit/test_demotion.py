"""Background demotion (kvpool.tiers.demotion): evicted blocks stay visible until SSD has them, removes win."""

from __future__ import annotations

import threading

import numpy as np

from kvpool.checksum import block_checksum
from kvpool.keys import BlockKey
from kvpool.tiers.demotion import DemotionQueue
from kvpool.tiers.dram import DramStore
from kvpool.tiers.node_store import NodeStore
from kvpool.tiers.ssd import SsdStore
from kvpool.vocabulary import BlockMeta, Tier

SLOT = 64 << 10


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(4, "big") * 8)


def block(i: int) -> bytes:
    return bytes([i % 251]) * SLOT


def sums(*ids: int) -> list[int]:
    return [block_checksum(block(i)) for i in ids]


class Heard:
    """An SSD change listener that records what it hears."""

    def __init__(self) -> None:
        self.added: list[BlockKey] = []
        self.removed: list[BlockKey] = []

    def __call__(self, added: list[BlockMeta], removed: list[BlockKey]) -> None:
        self.added += [m.key for m in added]
        self.removed += list(removed)


def gate_writes(ssd: SsdStore) -> tuple[threading.Event, threading.Event]:
    """Hold the real store's puts until ``release`` is set; ``entered`` is set when a put is waiting."""
    entered, release = threading.Event(), threading.Event()
    real = ssd.put

    def gated(*args, **kwargs):
        entered.set()
        assert release.wait(10), "test: the gate was never released"
        return real(*args, **kwargs)

    ssd.put = gated  # type: ignore[method-assign]  # this one store's puts, gated: the point of the helper
    return entered, release


def test_pending_blocks_are_visible_then_land_on_ssd(tmp_path):
    with SsdStore(tmp_path / "ssd", 64 * SLOT) as ssd:
        heard = Heard()
        ssd.on_change = heard
        entered, release = gate_writes(ssd)
        queue = DemotionQueue(ssd, 16 * SLOT)
        try:
            views = [memoryview(block(i)) for i in range(3)]
            queue.submit([key(i) for i in range(3)], views, sums(0, 1, 2))
            assert entered.wait(10)
            assert heard.added == [key(0), key(1), key(2)]  # reported at once: the index never loses them
            assert queue.contains([key(0), key(3)]) == [True, False]
            data, checksum = queue.get(key(1))
            assert bytes(data) == block(1) and checksum == sums(1)[0]
            assert ssd.contains([key(0)]) == [False]
            release.set()
            assert queue.flush(10)
            assert ssd.contains([key(i) for i in range(3)]) == [True] * 3
            assert queue.contains([key(0)]) == [False] and queue.pending_bytes == 0
        finally:
            release.set()
            queue.close()


def test_a_remove_wins_over_a_queued_or_in_flight_write(tmp_path):
    with SsdStore(tmp_path / "ssd", 64 * SLOT) as ssd:
        entered, release = gate_writes(ssd)
        queue = DemotionQueue(ssd, 16 * SLOT)
        try:
            queue.submit([key(1)], [memoryview(block(1))], sums(1))
            assert entered.wait(10)  # key 1's write is in flight
            queue.submit([key(2)], [memoryview(block(2))], sums(2))  # key 2 is queued behind it
            assert queue.cancel([key(1), key(2), key(3)]) == 2
            assert queue.contains([key(1), key(2)]) == [False, False]
            release.set()
            assert queue.flush(10)
            assert ssd.contains([key(1), key(2)]) == [False, False]  # neither reappears
        finally:
            release.set()
            queue.close()


def test_over_the_byte_bound_the_write_is_inline(tmp_path):
    with SsdStore(tmp_path / "ssd", 64 * SLOT) as ssd:
        demoted: list[int] = []
        queue = DemotionQueue(ssd, 2 * SLOT, on_demote=demoted.append)
        try:
            queue.submit([key(i) for i in range(3)], [memoryview(block(i)) for i in range(3)], sums(0, 1, 2))
            assert ssd.contains([key(i) for i in range(3)]) == [True] * 3  # written before submit returned
            assert demoted == [3] and queue.pending_bytes == 0
        finally:
            queue.close()


def test_blocks_ssd_refuses_are_reported_removed(tmp_path):
    with SsdStore(tmp_path / "ssd", 2 * SLOT) as ssd:  # room for less than three blocks
        heard = Heard()
        ssd.on_change = heard
        queue = DemotionQueue(ssd, 16 * SLOT)
        try:
            big = np.zeros(4 * SLOT, np.uint8)  # fits no SSD of this size
            queue.submit([key(9)], [memoryview(big)], [block_checksum(big)])
            assert queue.flush(10)
            assert ssd.contains([key(9)]) == [False] and key(9) in heard.removed
        finally:
            queue.close()


def test_tiered_store_serves_blocks_while_they_are_demoted(arena_name, tmp_path):
    dram = DramStore.create(arena_name, 2 * SLOT, SLOT, high_watermark=1.0, low_watermark=1.0)
    ssd = SsdStore(tmp_path / "ssd", 64 * SLOT)
    entered, release = gate_writes(ssd)
    store = NodeStore(dram, ssd, demote_queue_bytes=16 * SLOT)
    try:
        assert store.put([key(0), key(1)], [block(0), block(1)]) == [True, True]
        assert store.put([key(2)], [block(2)]) == [True]  # evicts key 0 without waiting for SSD
        assert entered.wait(10)
        assert store.where([key(0)]) == [Tier.SSD]
        assert store.ssd_meta([key(0)])[0] == BlockMeta(key(0), SLOT, store.demotions.get(key(0))[1])
        assert store.ssd_inventory().contains([key(0)]) == [True]
        out = bytearray(SLOT)
        store.promote = False
        assert store.get_into([key(0)], [out]) == [Tier.SSD] and bytes(out) == block(0)
        release.set()
        assert store.flush_demotions(10)
        assert ssd.contains([key(0)]) == [True]
    finally:
        release.set()
        store.close()
