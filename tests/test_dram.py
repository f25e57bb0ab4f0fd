"""DRAM tier: LRU order, watermarks, demotion hand-off, bad input."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvpool.keys import BlockKey
from kvpool.tiers.arena import shm_path
from kvpool.tiers.dram import DramStore

SLOT = 4096


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(4, "big") * 8)


def block(i: int, size: int = SLOT) -> bytes:
    return bytes([i % 251]) * size


class Sink:
    """Records what the DRAM tier demotes, in order, copying the bytes it is shown."""

    def __init__(self) -> None:
        self.keys: list[BlockKey] = []
        self.data: dict[BlockKey, bytes] = {}

    def __call__(self, keys, views, checksums):
        for k, v in zip(keys, views):
            self.keys.append(k)
            self.data[k] = bytes(v)


@pytest.fixture
def store(arena_name):
    sink = Sink()
    s = DramStore.create(arena_name, 10 * SLOT, SLOT, high_watermark=0.8, low_watermark=0.5, on_evict=sink)
    s.sink = sink
    yield s
    s.close()


def test_put_get_byte_exact_with_short_blocks(store):
    values = [np.random.default_rng(i).integers(0, 256, SLOT - i * 7, dtype=np.uint8) for i in range(4)]
    assert store.put([key(i) for i in range(4)], values) == [True] * 4
    outs = [np.empty_like(v) for v in values]
    assert store.get_into([key(i) for i in range(4)], outs) == [True] * 4
    assert all((o == v).all() for o, v in zip(outs, values))
    assert store.stats().bytes_in == sum(v.size for v in values)


def test_crossing_the_high_watermark_demotes_lru_first_down_to_the_low_one(store):
    store.put([key(i) for i in range(8)], [block(i) for i in range(8)])  # 8 = high watermark
    assert store.sink.keys == []
    store.get_into([key(0)], [bytearray(SLOT)])  # touch 0: now most recently used
    assert store.contains([key(1)]) == [True]  # looking does not refresh
    store.put([key(8)], [block(8)])
    assert store.sink.keys == [key(1), key(2), key(3), key(4)]  # 9 - 4 = 5 = low watermark
    assert all(store.sink.data[key(i)] == block(i) for i in range(1, 5))
    assert store.keys() == [key(5), key(6), key(7), key(0), key(8)]
    assert store.contains([key(i) for i in range(9)]) == [True, False, False, False, False, True, True, True, True]
    assert store.stats().evictions == 4


def test_a_batch_larger_than_capacity_stores_what_fits(store):
    ok = store.put([key(i) for i in range(12)], [block(i) for i in range(12)])
    assert ok.count(True) == 10 and ok[:10] == [True] * 10
    assert store.stats().blocks == 10


def test_present_keys_and_repeats_in_a_batch_are_not_written_twice(store):
    store.put([key(1)], [block(1)])
    assert store.put([key(1), key(2), key(2)], [block(9), block(2), block(2)]) == [True, True, True]
    out = bytearray(SLOT)
    store.get_into([key(1)], [out])
    assert bytes(out) == block(1)  # first write wins: a key names its bytes
    assert store.stats().puts == 2


def test_a_failing_demotion_sink_drops_blocks_and_keeps_serving(arena_name):
    def broken(keys, views, sums):
        raise OSError("disk gone")

    s = DramStore.create(arena_name, 2 * SLOT, SLOT, high_watermark=1.0, low_watermark=1.0, on_evict=broken)
    try:
        assert s.put([key(0), key(1)], [block(0), block(1)]) == [True, True]
        assert s.put([key(2)], [block(2)]) == [True]
        assert s.contains([key(0), key(1), key(2)]) == [False, True, True]
    finally:
        s.close()


def test_remove_frees_slots(store):
    store.put([key(i) for i in range(3)], [block(i) for i in range(3)])
    assert store.remove([key(0), key(0), key(7)]) == 1
    assert store.contains([key(0), key(1)]) == [False, True]
    assert store.get_into([key(0)], [bytearray(SLOT)]) == [False]


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.put([key(5)], [b"x" * (SLOT + 1)]),  # larger than a slot
        lambda s: s.put([b"short"], [block(5)]),  # malformed key
        lambda s: s.put([key(5), key(6)], [block(5)]),  # length mismatch
        lambda s: s.put([key(5)], [42]),  # not a buffer
        lambda s: s.get_into([key(1)], [bytes(SLOT)]),  # read-only output
        lambda s: s.put([key(5)], [np.zeros((64, 64), np.float32)[:, ::2]]),  # non-contiguous
    ],
)
def test_bad_input_is_a_value_error_and_changes_nothing(store, call):
    store.put([key(1)], [block(1)])
    before = (store.keys(), store.stats())
    with pytest.raises(ValueError):
        call(store)
    assert (store.keys(), store.stats()) == before


class Changes:
    """Records on_change calls; fails the test if the store's lock is held during one."""

    def __init__(self) -> None:
        self.store: DramStore | None = None
        self.calls: list[tuple[list, list]] = []

    def __call__(self, added, removed):
        assert self.store is not None
        free = self.store._lock.acquire(blocking=False)  # called outside the lock
        assert free, "on_change called under the DRAM lock"
        self.store._lock.release()
        self.calls.append((list(added), list(removed)))


def test_on_change_reports_puts_evictions_and_removes(arena_name):
    from kvpool.checksum import block_checksum
    from kvpool.core import BlockMeta

    changes, sink = Changes(), Sink()
    s = DramStore.create(arena_name, 4 * SLOT, SLOT, high_watermark=1.0, low_watermark=1.0,
                         on_evict=sink, on_change=changes)
    changes.store = s
    try:
        s.put([key(0), key(1)], [block(0), block(1, 100)])
        assert changes.calls == [([BlockMeta(key(0), SLOT, block_checksum(block(0))),
                                   BlockMeta(key(1), 100, block_checksum(block(1, 100)))], [])]
        s.put([key(0)], [block(0)])  # already held: the key set did not change, no call
        assert len(changes.calls) == 1
        s.put([key(i) for i in range(2, 5)], [block(i) for i in range(2, 5)])  # one over: key(1) is LRU
        added, removed = changes.calls[-1]
        assert [m.key for m in added] == [key(2), key(3), key(4)] and removed == [key(1)]
        assert sink.keys == [key(1)]
        assert s.remove([key(3), key(9)]) == 1
        assert changes.calls[-1] == ([], [key(3)])
        assert sorted(s.inventory(), key=lambda m: m.key) == sorted(
            [BlockMeta(key(i), SLOT, block_checksum(block(i))) for i in (0, 2, 4)], key=lambda m: m.key)
    finally:
        s.close()


def test_a_failing_listener_does_not_fail_the_put(arena_name):
    def broken(added, removed):
        raise RuntimeError("listener bug")

    s = DramStore.create(arena_name, 2 * SLOT, SLOT, on_change=broken)
    try:
        assert s.put([key(0)], [block(0)]) == [True]
        assert s.contains([key(0)]) == [True]
    finally:
        s.close()


def test_a_refused_store_leaves_no_arena_behind(arena_name):
    with pytest.raises(ValueError, match="low <= high"):
        DramStore.create(arena_name, 1 << 20, 64 << 10, high_watermark=0.5, low_watermark=0.9)
    assert not os.path.exists(shm_path(arena_name))
    with pytest.raises(ValueError, match="max_block_bytes must be > 0"):
        DramStore.create(arena_name, 1 << 20, 0)
    assert not os.path.exists(shm_path(arena_name))


# -- any block size, and an LRU that sees every reader --------------------------------------------


def test_blocks_of_any_size_share_the_arena_byte_exact(arena_name):
    rng = np.random.default_rng(3)
    sizes = [1, 63, 64, 65, 4096, 250_000, 7 << 20, 3 << 20]
    s = DramStore.create(arena_name, 16 << 20, high_watermark=1.0, low_watermark=1.0)
    try:
        values = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
        keys = [key(i) for i in range(len(sizes))]
        assert s.put(keys, values) == [True] * len(sizes)
        outs = [np.empty_like(v) for v in values]
        assert s.get_into(keys, outs) == [True] * len(sizes)
        assert all((o == v).all() for o, v in zip(outs, values))
        used, free, _ = s.usage()
        assert used + free == 16 << 20 and used == sum(-(-n // 64) * 64 for n in sizes)
        with pytest.raises(ValueError, match="takes blocks of 1"):
            s.put([key(99)], [np.zeros((16 << 20) + 1, np.uint8)])  # larger than the whole arena
        # a block larger than any free extent evicts LRU blocks until one is long enough
        assert s.put([key(50)], [np.ones(9 << 20, np.uint8)]) == [True]
        held = s.contains(keys + [key(50)])
        assert held[-1] and not all(held[:-1])
        assert s.usage()[0] <= 16 << 20
    finally:
        s.close()


def test_max_block_bytes_bounds_what_dram_takes(arena_name):
    s = DramStore.create(arena_name, 1 << 20, 64 << 10)
    try:
        assert s.max_block_bytes == 64 << 10
        assert s.put([key(1)], [np.zeros(64 << 10, np.uint8)]) == [True]
        with pytest.raises(ValueError, match=r"1\.\.65536 B"):
            s.put([key(2)], [np.zeros((64 << 10) + 1, np.uint8)])
        assert s.contains([key(2)]) == [False]
    finally:
        s.close()


def test_eviction_is_exactly_lru_over_reads_and_writes(arena_name):
    """A random mix of puts and reads: after every step DRAM holds exactly what an exact LRU would."""
    from collections import OrderedDict

    capacity = 16
    s = DramStore.create(arena_name, capacity * SLOT, SLOT, high_watermark=1.0, low_watermark=1.0)
    model: OrderedDict[BlockKey, None] = OrderedDict()
    rng = np.random.default_rng(11)
    out = np.empty(SLOT, np.uint8)
    try:
        for _ in range(2000):
            k = key(int(rng.integers(0, 40)))
            if rng.random() < 0.5:
                assert s.put([k], [block(k[0] + k[3])]) == [True]
                model[k] = None
            elif s.get_into([k], [out]) == [True]:
                assert k in model
            else:
                assert k not in model
                continue
            model.move_to_end(k)
            while len(model) > capacity:
                model.popitem(last=False)
            assert s.keys() == list(model)
            assert s.stats().used_bytes == int(s.arena.table["length"].sum()) == len(model) * SLOT
    finally:
        s.close()


READ_AND_STAMP = """
import sys
import numpy as np
from kvpool.tiers.arena import SharedArena
arena = SharedArena.attach(sys.argv[1])
key = bytes.fromhex(sys.argv[2])
ref = arena.find(key)
out = bytearray(ref.length)
ok = arena.read_into(ref, key, out)
arena.touch([ref.slot])
print("read" if ok else "miss", flush=True)
arena.close()
"""


def test_a_read_in_another_process_keeps_its_block_alive(arena_name):
    import subprocess
    import sys

    s = DramStore.create(arena_name, 4 * SLOT, SLOT, high_watermark=1.0, low_watermark=1.0)
    try:
        assert s.put([key(i) for i in range(4)], [block(i) for i in range(4)]) == [True] * 4
        done = subprocess.run([sys.executable, "-c", READ_AND_STAMP, arena_name, key(0).hex()], capture_output=True,
                              text=True, timeout=60, check=True)
        assert done.stdout.strip() == "read"
        assert s.put([key(4)], [block(4)]) == [True]  # one must go: not key 0, the same-host reader just read it
        assert s.contains([key(i) for i in range(5)]) == [True, False, True, True, True]
    finally:
        s.close()


def test_locate_touch_refreshes_and_plain_locate_does_not(arena_name):
    s = DramStore.create(arena_name, 2 * SLOT, SLOT, high_watermark=1.0, low_watermark=1.0)
    try:
        s.put([key(0), key(1)], [block(0), block(1)])
        s.locate([key(0)])
        s.put([key(2)], [block(2)])
        assert s.contains([key(0), key(1)]) == [False, True]
        s.locate([key(1)], touch=True)
        s.put([key(0)], [block(0)])
        assert s.contains([key(1), key(2)]) == [True, False]
    finally:
        s.close()


def test_small_blocks_fill_a_default_arena_to_its_bytes_not_to_its_rows(arena_name):
    n = 3000  # 4 KiB blocks: the default slot count is one row per 4 KiB, so every byte is usable
    s = DramStore.create(arena_name, n * 4096)
    try:
        for i in range(0, n, 500):
            assert s.put([key(j) for j in range(i, i + 500)], [block(j) for j in range(i, i + 500)]) == [True] * 500
        assert s.stats().blocks == n and s.stats().evictions == 0
    finally:
        s.close()
