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
    from kvpool.vocabulary import BlockMeta

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


# -- fragmentation: what a block that finds no free extent long enough evicts ------------------------------------


class Removed:
    """Records the keys on_change reports removed."""

    def __init__(self) -> None:
        self.keys: list[BlockKey] = []

    def __call__(self, added, removed):
        self.keys += removed


def test_a_large_put_among_small_holes_evicts_about_its_size_and_only_the_oldest_blocks(arena_name):
    """Issue 26: 8 MiB free in 4 KiB holes, LRU order scattered across addresses; one 1 MiB put.

    Blocks outside one 1.25 MiB stretch are read again, every other one (the hot ones, spread across the arena),
    so every window of 1 MiB but those around the stretch holds a block read in the second pass: the put must
    evict <= 1 MiB of one window, no block of the second pass, and exactly the window an exhaustive search over
    every position finds cheapest (its newest block read longest ago). Before: LRU rounds of 1 MiB until a run
    appeared.
    """
    n, small, big = 8192, 4096, 1 << 20
    sink, removed = Sink(), Removed()
    s = DramStore.create(arena_name, n * small, high_watermark=1.0, low_watermark=1.0, on_evict=sink,
                         on_change=removed)
    rng = np.random.default_rng(26)
    try:
        keys = [key(i) for i in range(n)]
        for i in range(0, n, 512):
            assert s.put(keys[i : i + 512], [block(j) for j in range(i, i + 512)]) == [True] * 512
        assert s.remove(keys[::4]) == n // 4
        kept = [k for i, k in enumerate(keys) if i % 4]
        cell = {k: ref.offset // small for k, ref in zip(kept, s.locate(kept))}  # its 4 KiB cell of the arena
        stretch = range(3072, 3072 + 320)  # cells 3072..3391: 1.25 MiB
        outside = sorted((k for k in kept if cell[k] not in stretch), key=cell.get)
        hot = set(outside[::2])
        order = [kept[i] for i in rng.permutation(len(kept))] + [k for k in rng.permutation(sorted(hot)).tolist()]
        rank: dict[BlockKey, int] = {}
        for r, k in enumerate(order):  # one read each in a random order, then the hot ones again
            s.locate([BlockKey(bytes(k))], touch=True)
            rank[BlockKey(bytes(k))] = r
        removed.keys.clear()
        assert s.usage()[1] == (n // 4) * small and s.usage()[2] == small  # 8 MiB free, in 4 KiB holes only

        assert s.put([key(10**6)], [np.ones(big, np.uint8)]) == [True]

        gone = removed.keys
        assert len(gone) * small <= big, f"a 1 MiB put evicted {len(gone) * small >> 10} KiB"
        assert sorted(gone) == sorted(sink.keys) and not any(s.contains(gone))  # reported, demoted, gone
        assert all(sink.data[k] == block(int.from_bytes(k[:4], "big")) for k in gone)  # demoted byte-exact
        assert not hot & set(gone)  # cold blocks suffice: no block of the second pass goes
        assert max(cell[k] for k in gone) - min(cell[k] for k in gone) < big // small  # one 1 MiB run
        by_cell = {cell[k]: rank[k] for k in kept}
        cheapest = min(max((by_cell.get(c, -1) for c in range(a, a + big // small)), default=-1)
                       for a in range(n - big // small + 1))
        assert max(rank[k] for k in gone) == cheapest
        assert all(s.contains([k])[0] for k in kept if k not in set(gone))
        s._alloc.check()
        used, free, _ = s.usage()
        assert used + free == n * small and used == (len(kept) - len(gone)) * small + big
    finally:
        s.close()


def test_a_block_no_window_can_hold_is_refused_at_once_and_evicts_nothing(arena_name):
    """Every 64 KiB run of the arena holds a leased slot (not evictable): a 64 KiB put finds no window. Before,
    it evicted every block, round after round, and was refused all the same."""
    sink = Sink()
    s = DramStore.create(arena_name, 64 * SLOT, high_watermark=1.0, low_watermark=1.0, on_evict=sink)
    try:
        for g in range(8):  # 8 groups of [a leased 4 KiB slot, 7 blocks], in address order
            assert s.reserve([key(1000 + g)], [SLOT], None).lease
            assert s.put([key(8 * g + j) for j in range(7)], [block(8 * g + j) for j in range(7)]) == [True] * 7
        assert s.usage()[1] == 0
        assert s.put([key(999)], [np.ones(16 * SLOT, np.uint8)]) == [False]
        assert sink.keys == [] and s.stats().evictions == 0
        assert all(s.contains([key(8 * g + j) for g in range(8) for j in range(7)]))
        s._alloc.check()
    finally:
        s.close()


def _value(i: int, n: int) -> np.ndarray:
    v = np.full(n, i % 251, np.uint8)
    v[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
    return v


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_random_mixed_sizes_keep_every_invariant_with_readers_racing(arena_name, monkeypatch, seed):
    """Puts of mixed sizes (batches, some of one size), reads, removes and a lease that comes and goes, on an
    arena that is full most of the time, with two reader threads reading (and stamping) blocks all along. After
    every step: the allocator's invariants hold and agree with the slots; the LRU is exactly the committed blocks;
    what on_change reported is exactly what the store holds; every block evicted went through the sink with its
    own bytes and is gone; every put was stored (a window always exists: the lease is one 64 KiB slot). Readers
    only ever get a block's own bytes."""
    import threading

    import kvpool.tiers.dram as dram
    from kvpool.checksum import block_checksum

    searches: list[int] = []  # windows found per search: the test must reach the window rule, not only the LRU

    def counted(*args, **kwargs):
        found = search(*args, **kwargs)
        searches.append(len(found))
        return found

    search = dram.cheapest_windows
    monkeypatch.setattr(dram, "cheapest_windows", counted)
    sizes = [1000, 4096, 9000, 65536, 200_000, 1 << 20]
    rng = np.random.default_rng(seed)
    held: dict[BlockKey, int] = {}  # what on_change reported: key -> size
    length: dict[BlockKey, int] = {}  # every key ever written -> its size
    demoted: list[BlockKey] = []
    errors: list[str] = []

    def on_change(added, removed):
        for m in added:
            held[m.key] = m.size
        for k in removed:
            assert held.pop(k, None) is not None, "removed a key it never reported"

    def sink(keys, views, sums):
        for k, v in zip(keys, views):
            if not np.array_equal(np.asarray(v), _value(int.from_bytes(k[:4], "big"), len(v))):
                errors.append(f"sink saw wrong bytes for {k[:4].hex()}")
            demoted.append(k)

    s = DramStore.create(arena_name, 8 << 20, high_watermark=1.0, low_watermark=1.0, on_evict=sink,
                         on_change=on_change)
    stop = threading.Event()
    reads = [0, 0]

    def reader(seed: int) -> None:
        r = np.random.default_rng(seed)
        while not stop.is_set():
            ks = list(length)
            if not ks:
                continue
            k = ks[int(r.integers(0, len(ks)))]
            out = np.empty(length[k], np.uint8)
            if s.get_into([k], [out]) == [True]:
                reads[seed] += 1
                if not np.array_equal(out, _value(int.from_bytes(k[:4], "big"), out.size)):
                    errors.append(f"reader got wrong bytes for {k[:4].hex()}")

    threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    lease: tuple[int, BlockKey, int] | None = None
    next_id = 0
    try:
        for step in range(700):
            r = rng.random()
            removed_by_call: list[BlockKey] = []
            before = set(held)
            if r < 0.55:
                n = int(rng.integers(1, 5))
                ids = list(range(next_id, next_id + n))
                next_id += n
                ks = [key(i) for i in ids]
                one = int(rng.choice(sizes)) if rng.random() < 0.3 else 0  # a batch of one size: runs side by side
                vs = [_value(i, one or int(rng.choice(sizes))) for i in ids]
                for k, v in zip(ks, vs):
                    length[k] = v.size
                assert s.put(ks, vs) == [True] * n, f"step {step}: a put was refused"
            elif r < 0.8 and held:
                ks = [k for k in held if rng.random() < 0.05][:8]
                assert s.get_into(ks, [np.empty(held[k], np.uint8) for k in ks]) == [True] * len(ks)
            elif r < 0.92 and held:
                removed_by_call = [k for k in held if rng.random() < 0.1]
                assert s.remove(removed_by_call) == len(removed_by_call)
            elif lease is None:
                k = key(next_id)
                v = _value(next_id, 65536)
                next_id += 1
                res = s.reserve([k], [v.size], None)
                if res.lease:
                    s.arena.block(res.slots[0], v.size)[:] = v
                    lease = (res.lease, k, res.slots[0])
                    length[k] = v.size
            else:
                lease_id, k, slot = lease
                checksum = block_checksum(_value(int.from_bytes(k[:4], "big"), 65536))
                assert s.commit(lease_id, [k], [slot], [checksum]) == [True]  # never evicted nor moved while leased
                lease = None
            gone = before - set(held) - set(removed_by_call)
            assert not any(s.contains(sorted(gone | set(removed_by_call)))), f"step {step}: a key reported gone is held"
            assert gone <= set(demoted), f"step {step}: a block left DRAM without going through the sink"
            with s._lock:
                s._alloc.check()
                slots = np.flatnonzero(s._extent[:, 1])
                assert int(s._extent[slots, 1].sum()) == s._used == s._alloc.total - s._alloc.free_units
                assert sorted(np.flatnonzero(s._lru_gen).tolist()) == sorted(s._blocks.values())
                assert set(s._blocks) == set(held) and not s._demoting
            assert not errors, errors[:3]
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        s.close()
    assert not errors, errors[:3]
    assert min(reads) > 0 and s.stats().evictions > 100 and len(searches) > 20 and all(searches)


def test_a_window_that_changed_during_its_search_is_chosen_again_and_a_fresh_block_in_it_stays(arena_name,
                                                                                                monkeypatch):
    """The search runs outside the lock: while it runs, one block of the window it will choose is removed and a
    new block takes its place. The choice is checked under the lock, dropped, and searched again: the new block
    (just written) is not evicted, and the put is stored."""
    import kvpool.tiers.dram as dram

    n = 64
    removed = Removed()
    s = DramStore.create(arena_name, n * SLOT, high_watermark=1.0, low_watermark=1.0, on_change=removed)
    search = dram.cheapest_windows
    raced: list[BlockKey] = []

    searches = []

    def racing(*args, **kwargs):
        found = search(*args, **kwargs)
        searches.append(found)
        if not raced:  # meanwhile, on another thread: a block of the window goes and a fresh one takes its place
            victim = s._key_of(int(s_slots[found[0].victims[0]])) if found[0].victims.size else None
            if victim is not None:
                assert s.remove([victim]) == 1  # with the holes around it: the only free run of 12 KiB
                assert s.put([key(500)], [block(500, 3 * SLOT)]) == [True]
                start = found[0].start * 64
                assert start <= s.locate([key(500)])[0].offset < start + 4 * SLOT  # inside the window
                raced.append(victim)
        return found

    def table(*args):
        nonlocal s_slots
        t = window_table(*args)
        s_slots = t[0]
        return t

    s_slots = np.empty(0, np.int64)
    window_table = dram._window_table
    monkeypatch.setattr(dram, "_window_table", table)
    monkeypatch.setattr(dram, "cheapest_windows", racing)
    try:
        assert s.put([key(i) for i in range(n)], [block(i) for i in range(n)]) == [True] * n
        assert s.remove([key(i) for i in range(0, n, 2)]) == n // 2  # 4 KiB holes only
        for i in range(1, n, 2):
            s.locate([key(i)], touch=True)
        removed.keys.clear()
        assert s.put([key(999)], [np.ones(4 * SLOT, np.uint8)]) == [True]
        assert raced and len(searches) == 2 and s.contains([key(500), key(999)]) == [True, True]
        assert raced[0] in removed.keys and len(removed.keys) == len(set(removed.keys)) <= 3
        s._alloc.check()
    finally:
        s.close()


def test_writers_racing_for_windows_keep_the_store_whole(arena_name):
    """Three writer threads put mixed sizes into a full arena at once (their searches race: a window one chooses
    another may take), a reader checks bytes all along. At the end: the allocator and the LRU agree with the slots,
    on_change's account is exactly what the store holds, nothing left in flight; readers only got true bytes.

    on_change is called outside the store's lock, so two threads' events may arrive in either order (a block one
    thread stored, another evicted): listeners reconcile (the master link asks ``contains`` at send time). The
    account is therefore kept as counts, which add up whatever the order: per key, adds - removes is 1 if the
    store holds it and 0 if not, and no key is removed more often than it was added."""
    import threading
    from collections import Counter

    sizes = [4096, 9000, 65536, 200_000, 1 << 20]
    held: dict[BlockKey, int] = {}  # every key an add event named, with its size (the reader's choice)
    adds: Counter[BlockKey] = Counter()
    removes: Counter[BlockKey] = Counter()
    guard = threading.Lock()
    errors: list[str] = []
    stored = [0, 0, 0]
    refused = [0, 0, 0]

    def on_change(added, removed):
        with guard:
            for m in added:
                held[m.key] = m.size
                adds[m.key] += 1
            for k in removed:
                removes[k] += 1

    s = DramStore.create(arena_name, 8 << 20, high_watermark=1.0, low_watermark=1.0, on_change=on_change)
    stop = threading.Event()

    def writer(w: int) -> None:
        rng = np.random.default_rng(w)
        for j in range(150):
            i = 10_000 * (w + 1) + j
            ok = s.put([key(i)], [_value(i, int(rng.choice(sizes)))])[0]
            stored[w] += ok
            refused[w] += not ok

    def reader() -> None:
        rng = np.random.default_rng(9)
        while not stop.is_set():
            with guard:
                ks = list(held.items())
            if not ks:
                continue
            k, n = ks[int(rng.integers(0, len(ks)))]
            out = np.empty(n, np.uint8)
            if s.get_into([k], [out]) == [True] and not np.array_equal(out, _value(int.from_bytes(k[:4], "big"), n)):
                errors.append(f"reader got wrong bytes for {k[:4].hex()}")

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    rd = threading.Thread(target=reader, daemon=True)
    rd.start()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
        assert not any(t.is_alive() for t in threads)
    finally:
        stop.set()
        rd.join(timeout=30)
    try:
        assert not errors, errors[:3]
        assert sum(refused) <= sum(stored) // 50, (stored, refused)  # a rare refusal under contention is a miss
        with s._lock:
            s._alloc.check()
            assert int(s._extent[:, 1].sum()) == s._used == s._alloc.total - s._alloc.free_units
            assert sorted(np.flatnonzero(s._lru_gen).tolist()) == sorted(s._blocks.values())
            holds = set(s._blocks)
            assert not s._demoting and s._nfree + len(s._blocks) == s.arena.num_slots
        named = set(adds) | set(removes)
        assert holds <= named  # no block held that no event announced
        assert {k: adds[k] - removes[k] for k in named} == {k: int(k in holds) for k in named}
        assert s.stats().evictions > 100
    finally:
        s.close()


def test_a_batch_of_large_blocks_gets_a_run_each_even_where_runs_must_be_freed_one_after_another(arena_name):
    """Between two leased slots, 32 KiB of 4 KiB blocks with holes; a batch of two 16 KiB blocks needs both halves,
    which a single search cannot hand out at once (its runs must be parted by a block kept): the second block's
    run is found in the next round. Both are stored, and nothing outside that stretch is evicted."""
    s = DramStore.create(arena_name, 16 * SLOT, high_watermark=1.0, low_watermark=1.0)
    try:
        assert s.reserve([key(100)], [SLOT], None).lease
        assert s.put([key(i) for i in range(8)], [block(i) for i in range(8)]) == [True] * 8
        assert s.reserve([key(101)], [SLOT], None).lease
        assert s.put([key(i) for i in range(8, 14)], [block(i) for i in range(8, 14)]) == [True] * 6
        assert s.remove([key(1), key(3), key(5), key(7)]) == 4 and s.remove([key(13)]) == 1
        for i in range(8, 13):
            s.locate([key(i)], touch=True)  # the blocks after the second lease: read last
        assert s.put([key(200), key(201)], [np.ones(4 * SLOT, np.uint8), np.ones(4 * SLOT, np.uint8)]) == [True] * 2
        assert s.contains([key(i) for i in range(8, 13)]) == [True] * 5
        s._alloc.check()
    finally:
        s.close()
