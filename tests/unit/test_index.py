"""BlockIndex and its KeyTable: growth, deletes, multi-location keys, full syncs, node drops, memory per block.

Every test checks the index against a plain-Python reference model (:class:`Reference`), and its
invariants with :func:`models.check_index`. ``tests/integration/test_master.py`` covers the index through the gRPC
service.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import subprocess
import sys
import threading
import tracemalloc

import numpy as np
import pytest
from models import check_index, index_nbytes

from kvpool.keys import BlockKey
from kvpool.master import index as index_module
from kvpool.master import keytable
from kvpool.master.index import BlockIndex, Hit
from kvpool.master.keytable import KeyTable
from kvpool.master.lookup_reply import encode_runs, lookup_replies
from kvpool.master.probe import leading_run
from kvpool.vocabulary import Tier

DRAM, SSD = Tier.DRAM, Tier.SSD


def make_keys(n: int, tag: str = "k") -> list[BlockKey]:
    return [BlockKey(hashlib.sha256(f"{tag}-{i}".encode()).digest()) for i in range(n)]


def random_keys(n: int, rng: np.random.Generator) -> list[BlockKey]:
    raw = rng.bytes(32 * n)
    return [BlockKey(raw[i : i + 32]) for i in range(0, len(raw), 32)]


class Reference:
    """What the index should say: key -> (size, checksum, {(tier, node)})."""

    def __init__(self) -> None:
        self.entries: dict[BlockKey, tuple[int, int, set[tuple[int, int]]]] = {}

    def add(self, node: int, tier: Tier, keys: list[BlockKey], sizes: list[int], checksums: list[int]) -> None:
        for key, size, checksum in zip(keys, sizes, checksums):
            locs = self.entries[key][2] if key in self.entries else set()
            locs.add((int(tier), node))
            self.entries[key] = (size, checksum, locs)

    def remove(self, node: int, tier: Tier, keys: list[BlockKey]) -> None:
        for key in keys:
            if key in self.entries:
                self.entries[key][2].discard((int(tier), node))
                if not self.entries[key][2]:
                    del self.entries[key]

    def replace(self, node: int, tier: Tier, keys: list[BlockKey], sizes: list[int], checksums: list[int]) -> None:
        self.remove(node, tier, list(self.entries))
        self.add(node, tier, keys, sizes, checksums)

    def drop(self, node: int) -> int:
        removed = 0
        for key in list(self.entries):
            locs = self.entries[key][2]
            gone = {loc for loc in locs if loc[1] == node}
            removed += len(gone)
            locs -= gone
            if not locs:
                del self.entries[key]
        return removed

    def hit(self, key: BlockKey) -> Hit:
        size, checksum, locs = self.entries[key]
        tier, node = min(locs)  # DRAM before SSD, then the lowest node number
        return Hit(Tier(tier), node, size, checksum)

    def copies(self) -> int:
        return sum(len(locs) for _, _, locs in self.entries.values())


def assert_agrees(index: BlockIndex, ref: Reference, keys: list[BlockKey]) -> None:
    """Index and reference agree on every key in ``keys``, on counts, and the invariants hold."""
    copies = check_index(index)
    assert index.exists(keys) == [key in ref.entries for key in keys]
    present = [key for key in keys if key in ref.entries]
    assert index.leading_run(present) == [ref.hit(key) for key in present]
    assert (copies, len(index)) == (ref.copies(), len(ref.entries))


def sizes_for(keys: list[BlockKey], salt: int = 0) -> tuple[list[int], list[int]]:
    return [4096 + key[0] + salt for key in keys], [int.from_bytes(key[:8], "little") ^ salt for key in keys]


def prefixes(change) -> list[bytes]:
    """Each key of a TierChange as its first 16 bytes."""
    words = np.stack([change.k0, change.k1], axis=1).astype(np.uint64)
    return [row.tobytes() for row in words]


def opened(*nodes: int) -> BlockIndex:
    index = BlockIndex(min_capacity=64)
    for node in nodes:
        index.open_node(node)
    return index


# -- growth, deletes ---------------------------------------------------------------------


def test_growth_with_deletes_and_reinserts_matches_the_reference():
    index, ref = opened(0, 1), Reference()
    keys = make_keys(6000, "grow")
    start_bytes = index_nbytes(index)
    for lo in range(0, 4000, 500):  # grows from 64 slots, many times
        node = lo // 500 % 2
        sizes, sums = sizes_for(keys[lo : lo + 500])
        assert index.add(node, DRAM, keys[lo : lo + 500], sizes, sums)
        ref.add(node, DRAM, keys[lo : lo + 500], sizes, sums)
    assert index_nbytes(index) > 50 * start_bytes
    assert_agrees(index, ref, keys)

    gone = keys[0:4000:2]  # delete half, through both nodes (each holds only its own batches)
    for node in (0, 1):
        assert index.remove(node, DRAM, gone)
        ref.remove(node, DRAM, gone)
    assert len(index) == 2000
    assert_agrees(index, ref, keys)

    for lo in range(0, 6000, 700):  # re-insert the deleted ones and more, in other sizes and tiers
        batch = keys[lo : lo + 700]
        sizes, sums = sizes_for(batch, salt=1)
        assert index.add(1, SSD, batch, sizes, sums)
        ref.add(1, SSD, batch, sizes, sums)
    assert_agrees(index, ref, keys)


def test_shrinks_after_most_keys_go_and_stays_correct():
    index, ref = opened(0, 1), Reference()
    keys = make_keys(20000, "shrink")
    sizes, sums = sizes_for(keys)
    index.add(0, DRAM, keys[:19000], sizes[:19000], sums[:19000])
    ref.add(0, DRAM, keys[:19000], sizes[:19000], sums[:19000])
    index.add(1, SSD, keys[19000:], sizes[19000:], sums[19000:])
    ref.add(1, SSD, keys[19000:], sizes[19000:], sums[19000:])
    full = index_nbytes(index)

    assert index.drop_node(0) == ref.drop(0) == 19000

    assert index_nbytes(index) < full / 4  # 1,000 keys left in a table sized for 19,000: compacted
    assert_agrees(index, ref, keys)


def test_randomised_reports_match_the_reference():
    rng = random.Random(7)
    keys = make_keys(1500, "fuzz")
    index, ref = opened(0, 1, 2), Reference()
    open_nodes, next_node = [0, 1, 2], 3
    for step in range(300):
        node = rng.choice(open_nodes)
        tier = rng.choice([DRAM, SSD])
        batch = [rng.choice(keys) for _ in range(rng.randint(0, 200))]  # repeats included
        sizes = [rng.randrange(1, 1 << 64) for _ in batch]
        sums = [rng.randrange(0, 1 << 64) for _ in batch]
        roll = rng.random()
        if roll < 0.5:
            assert index.add(node, tier, batch, sizes, sums)
            ref.add(node, tier, batch, sizes, sums)
        elif roll < 0.8:
            assert index.remove(node, tier, batch)
            ref.remove(node, tier, batch)
        elif roll < 0.95:
            assert index.replace_node_tier(node, tier, batch, sizes, sums)
            ref.replace(node, tier, batch, sizes, sums)
        else:
            assert index.drop_node(node) == ref.drop(node)
            open_nodes.remove(node)
            index.open_node(next_node)
            open_nodes.append(next_node)
            next_node += 1
        if step % 25 == 0:
            assert_agrees(index, ref, keys)
    assert_agrees(index, ref, keys)


# -- locations ---------------------------------------------------------------------------


def test_a_key_on_many_locations_is_served_best_first_and_falls_back():
    index, ref = opened(3, 5, 9), Reference()
    k = make_keys(3, "multi")
    sizes, sums = sizes_for(k)
    for node, tier in [(9, SSD), (5, SSD), (9, DRAM), (3, SSD), (5, DRAM)]:  # k[0] ends on five locations
        assert index.add(node, tier, k[:1], sizes[:1], sums[:1])
        ref.add(node, tier, k[:1], sizes[:1], sums[:1])
    assert index.add(3, SSD, k[1:], sizes[1:], sums[1:])
    ref.add(3, SSD, k[1:], sizes[1:], sums[1:])
    assert index.leading_run(k[:1]) == [Hit(DRAM, 5, sizes[0], sums[0])]
    assert check_index(index) == 7
    assert_agrees(index, ref, k)

    steps = [
        lambda: (index.remove(5, DRAM, k[:1]), ref.remove(5, DRAM, k[:1])),  # best goes: DRAM on 9 next
        lambda: (index.drop_node(9), ref.drop(9)),  # two of its locations at once: 3 SSD, 5 SSD left
        lambda: (index.remove(3, SSD, k), ref.remove(3, SSD, k)),  # k[1], k[2] gone; k[0] on 5 SSD only
    ]
    expected = [Hit(DRAM, 9, sizes[0], sums[0]), Hit(SSD, 3, sizes[0], sums[0]), Hit(SSD, 5, sizes[0], sums[0])]
    for step, hit in zip(steps, expected):
        step()
        assert index.leading_run(k[:1]) == [hit]
        assert_agrees(index, ref, k)
    assert index.exists(k) == [True, False, False]
    assert index.remove(5, SSD, k[:1])
    assert len(index) == 0 and check_index(index) == 0


def test_latest_report_sets_size_and_checksum_and_the_last_repeat_wins():
    index = opened(0, 1)
    k = make_keys(2, "latest")
    assert index.add(0, DRAM, [k[0], k[1], k[0]], [10, 20, 30], [1, 2, 3])
    assert index.leading_run(k) == [Hit(DRAM, 0, 30, 3), Hit(DRAM, 0, 20, 2)]
    assert index.add(1, SSD, k[1:], [21], [22])  # a copy elsewhere: one size and checksum per key
    assert index.leading_run(k) == [Hit(DRAM, 0, 30, 3), Hit(DRAM, 0, 21, 22)]
    assert check_index(index) == 3


def test_full_sync_removes_stale_keys_of_that_node_tier_only():
    index, ref = opened(0, 1, 2), Reference()
    keys = make_keys(3000, "sync")
    sizes, sums = sizes_for(keys)

    def add(node: int, tier: Tier, lo: int, hi: int) -> None:
        assert index.add(node, tier, keys[lo:hi], sizes[lo:hi], sums[lo:hi])
        ref.add(node, tier, keys[lo:hi], sizes[lo:hi], sums[lo:hi])

    add(0, DRAM, 0, 2000)
    add(0, SSD, 1000, 2500)  # 1000..2000 on both tiers of node 0
    add(1, DRAM, 1500, 2200)
    for node in (1, 2):  # keys 0..10 on four locations: the multi-location path
        add(node, SSD, 0, 10)
    add(2, DRAM, 0, 10)

    new = list(range(500, 1200)) + list(range(2500, 3000))  # keeps 500..1200, drops the rest, adds 2500..3000
    batch = [keys[i] for i in new]
    assert index.replace_node_tier(0, DRAM, batch, [sizes[i] for i in new], [sums[i] for i in new])
    ref.replace(0, DRAM, batch, [sizes[i] for i in new], [sums[i] for i in new])

    assert_agrees(index, ref, keys)
    assert index.leading_run(keys[:1]) == [Hit(DRAM, 2, sizes[0], sums[0])]  # its node-0 DRAM copy went
    assert index.leading_run(keys[1500:1501]) == [Hit(DRAM, 1, sizes[1500], sums[1500])]
    assert index.leading_run(keys[2300:2301]) == [Hit(SSD, 0, sizes[2300], sums[2300])]
    assert index.exists(keys[200:210]) == [False] * 10

    assert index.replace_node_tier(0, DRAM, [], [], [])  # an empty full sync: nothing left there
    ref.replace(0, DRAM, [], [], [])
    assert_agrees(index, ref, keys)


def test_drop_node_after_growth_leaves_other_nodes_intact():
    rng = np.random.default_rng(3)
    index, ref = opened(0, 1, 2), Reference()
    keys = random_keys(60000, rng)
    spans = [(0, 0, 30000, DRAM), (1, 20000, 50000, DRAM), (2, 25000, 60000, SSD), (0, 40000, 45000, SSD)]
    for node, lo, hi, tier in spans:
        sizes, sums = sizes_for(keys[lo:hi])
        assert index.add(node, tier, keys[lo:hi], sizes, sums)
        ref.add(node, tier, keys[lo:hi], sizes, sums)

    assert index.drop_node(0) == ref.drop(0) == 35000

    assert not index.add(0, DRAM, keys[:1], [1], [1])  # closed slot: refused, nothing changes
    assert not index.remove(0, DRAM, keys[20000:20001])
    assert not index.replace_node_tier(0, DRAM, [], [], [])
    assert_agrees(index, ref, keys[::7])
    assert len(index) == 40000
    assert index.drop_node(0) == 0  # twice: nothing left


# -- the table underneath ----------------------------------------------------------------


def test_keytable_makes_room_by_hopping_and_by_growing(monkeypatch):
    hops = 0
    displace = KeyTable._displace

    def counting(self, *args):
        nonlocal hops
        hops += 1
        return displace(self, *args)

    monkeypatch.setattr(KeyTable, "_displace", counting)
    rng = np.random.default_rng(11)
    table = KeyTable({"v": np.uint32}, min_capacity=1 << 14)
    k = rng.integers(0, 1 << 63, (int(table.capacity * keytable.MAX_LOAD), 2), dtype=np.uint64) * 2 + 1
    for lo in range(0, len(k), 2000):  # up to the load limit of the first capacity
        part = k[lo : lo + 2000]
        assert table.insert(part[:, 0], part[:, 1], {"v": np.arange(lo, lo + len(part), dtype=np.uint32)}) == len(part)
    assert table.capacity == 1 << 14 and hops > 0  # full neighbourhoods were made room in, not grown for
    table.check()
    rows = table.find(k[:, 0], k[:, 1])
    assert (rows >= 0).all() and np.array_equal(table.rec["v"][rows], np.arange(len(k)))

    table.delete(rows[::2])
    assert (table.find(k[::2, 0], k[::2, 1]) == -1).all()
    monkeypatch.setattr(keytable, "REACH", 0)  # no hopping: every full neighbourhood grows the table
    more = rng.integers(0, 1 << 63, (20000, 2), dtype=np.uint64) * 2
    assert table.insert(more[:, 0], more[:, 1], {"v": np.zeros(len(more), np.uint32)}) == len(more)
    table.check()
    assert (table.find(more[:, 0], more[:, 1]) >= 0).all()
    assert np.array_equal(table.rec["v"][table.find(k[1::2, 0], k[1::2, 1])], np.arange(1, len(k), 2))


def test_the_compiled_kernels_find_exactly_what_a_search_of_the_table_finds():
    """KeyTable.find and the leading-run kernels (master/probe.py, compiled) against a plain search of every live
    row, on a table grown, hopped and emptied in part: keys whose first word's top 16 bits are 0 (fingerprint 1),
    keys sharing a first word, keys given as read-only strided words of a packed buffer or as arrays of their
    own. A run stops at its first absent key and carries each hit's tier, node, size and checksum."""
    rng = np.random.default_rng(7)
    table = KeyTable({"loc1": np.uint32, "size": np.uint64, "checksum": np.uint64}, min_capacity=1 << 10)
    k = rng.integers(0, 1 << 63, (3000, 2), dtype=np.uint64) * 2 + 1
    k[:50, 0] >>= np.uint64(20)  # top 16 bits 0
    k[50:100, 0] = k[100:150, 0]  # a shared first word, told apart by the second
    n = np.arange(3000, dtype=np.uint64)
    loc = ((n % 3) << np.uint64(30) | n % 5).astype(np.uint32)  # tier << 30 | node
    assert table.insert(k[:, 0].copy(), k[:, 1].copy(), {"loc1": loc, "size": n + 7, "checksum": n * 11}) == 3000
    table.delete(table.find(k[::3, 0], k[::3, 1]))
    table.check()
    live = table.live_rows()
    where = {(int(a), int(b)): int(r) for a, b, r in zip(table.k0[live], table.k1[live], live)}
    absent = rng.integers(0, 1 << 63, (200, 2), dtype=np.uint64) * 2
    queries = np.concatenate([k, absent])[rng.permutation(3200)]
    expected = [where.get((int(a), int(b)), -1) for a, b in queries]
    packed = np.frombuffer(np.concatenate([queries, queries], axis=1).tobytes(), np.uint64).reshape(-1, 4)
    for q0, q1 in ((queries[:, 0].copy(), queries[:, 1].copy()), (packed[:, 0], packed[:, 1])):
        assert table.find(q0, q1).tolist() == expected

    cols = table.cols
    columns = (cols["loc1"], cols["size"], cols["checksum"], np.uint64(30))

    def run_of(rows: list[int]) -> list[list[int]]:
        at = np.array(rows, np.intp)
        return [(cols["loc1"][at] >> 30).tolist(), (cols["loc1"][at] & (1 << 30) - 1).tolist(),
                cols["size"][at].tolist(), cols["checksum"][at].tolist()]

    first_miss = expected.index(-1)
    present = [e for e in expected if e >= 0]
    words = packed.ravel()
    assert [c.tolist() for c in leading_run(words, *table.probed(), *columns)] == run_of(expected[:first_miss])
    whole = np.frombuffer(packed[np.array(expected) >= 0].tobytes(), np.uint64)
    assert [c.tolist() for c in leading_run(whole, *table.probed(), *columns)] == run_of(present)
    assert [len(c) for c in leading_run(words[:0], *table.probed(), *columns)] == [0] * 4
    # several prompts in one call (the Lookups' pass, encoding each run): each stops at its own first miss
    starts = np.array([0, 0, first_miss + 3, 2000, 3200], np.int64)
    replies = lookup_replies(words, starts, *table.probed(), *columns)
    for p in range(4):
        lo, hi = int(starts[p]), int(starts[p + 1])
        end = next((i for i in range(lo, hi) if expected[i] < 0), hi)
        run = [np.array(c, t) for c, t in zip(run_of(expected[lo:end]), (np.uint8, np.uint32, np.uint64, np.uint64))]
        assert replies[p] == encode_runs(*run, np.array([0]), np.array([end - lo]))[0]


def test_the_kernels_compile_in_memory_where_their_cache_cannot_be_written_or_read(tmp_path):
    """The index's kernels are cached on disk by numba. Where that cannot be (a hardened service: read-only
    install, no home; numba then refuses ``cache=True`` at import) or the cache is damaged (its files fail to
    load), they are compiled in memory instead: the master starts, lookups work, and the log says why. Numba's
    "nowhere to write" condition is made by emptying its list of cache locations (root writes anywhere, so
    permissions cannot make it); the damage by overwriting the cache's files."""
    code = """
import logging, sys
logging.basicConfig(level=logging.INFO)
if sys.argv[1] == "nowhere":
    from numba.core import caching
    caching.CacheImpl._locator_classes = []
from kvpool.keys import opaque_key
from kvpool.master.index import BlockIndex
from kvpool.master.lookup_reply import lookup_replies
from kvpool.vocabulary import Tier
index = BlockIndex()
index.open_node(0)
keys = [opaque_key(f"k{i}") for i in range(3)]
index.add(0, Tier.DRAM, keys[:2], [1, 2], [3, 4])
replies, _ = index.leading_runs_pass(lookup_replies, [b"".join(keys)] * 2)
print(len(index.leading_run(keys)), [r.dram_blocks for r in replies], index.exists(keys))
"""
    cache = tmp_path / "numba"

    def run(case: str) -> str:
        done = subprocess.run([sys.executable, "-c", code, case], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "NUMBA_CACHE_DIR": str(cache)})
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip() == "2 [2, 2] [True, True, False]"
        return done.stderr

    assert "compiled in memory" not in run("cached")
    files = [f for f in cache.rglob("*") if f.is_file()]
    assert files  # the kernels were cached there
    for f in files:
        f.write_bytes(b"\xb1 not a cache file")
    kernels = 4  # probe.py's two and lookup_reply.py's two
    assert run("damaged").count("compiled in memory, not cached") == kernels
    assert run("nowhere").count("compiled in memory, not cached") == kernels


def test_keys_sharing_a_first_word_are_told_apart_by_the_second():
    index = opened(0)
    head = os.urandom(8)
    keys = [BlockKey(head + os.urandom(24)) for _ in range(20)]  # one home, one fingerprint
    assert index.add(0, DRAM, keys[:10], list(range(10)), list(range(10)))
    assert index.exists(keys) == [True] * 10 + [False] * 10
    assert [hit.size for hit in index.leading_run(keys[:10])] == list(range(10))
    assert index.remove(0, DRAM, keys[3:5])
    assert index.exists(keys[:10]) == [True] * 3 + [False] * 2 + [True] * 5
    check_index(index)


def test_keys_equal_in_their_first_16_bytes_are_one_entry():
    """Documented: the index keys by 128-bit prefixes (the node checks the full key: a miss, never wrong bytes)."""
    index = opened(0)
    a, b = BlockKey(bytes(16) + b"a" * 16), BlockKey(bytes(16) + b"b" * 16)
    assert index.add(0, DRAM, [a], [1], [2])
    assert index.exists([b]) == [True] and len(index) == 1


def test_a_flood_of_keys_on_one_home_is_refused_not_grown_for(caplog):
    index = opened(0)
    head = bytes(8)
    keys = [BlockKey(head + i.to_bytes(24, "little")) for i in range(100)]  # all on one home: not sha256 keys
    with caplog.at_level(logging.WARNING, logger="kvpool.master.index"):
        assert index.add(0, DRAM, keys, [1] * 100, [2] * 100)
    held = sum(index.exists(keys))
    assert held == keytable.H  # one neighbourhood's worth; the rest are misses
    assert "not indexed" in caplog.text
    assert index_nbytes(index) < 1 << 20  # the table did not double itself trying
    assert check_index(index) == held


def test_bad_input_raises_before_anything_changes():
    index = opened(0)
    k = make_keys(2)
    with pytest.raises(ValueError, match="32 bytes"):
        index.add(0, DRAM, [k[0], b"short"], [1, 1], [1, 1])
    with pytest.raises(ValueError, match="2 keys but 1 sizes"):
        index.add(0, DRAM, k, [1], [1, 1])
    with pytest.raises(ValueError, match=r"\[0, 2\*\*64\)"):
        index.add(0, DRAM, k, [1, -1], [1, 1])
    with pytest.raises(ValueError, match="32 bytes"):
        index.exists([b"x" * 31])
    with pytest.raises(ValueError, match="node number"):
        index.open_node(1 << 30)
    assert len(index) == 0
    check_index(index)


# -- scale -------------------------------------------------------------------------------


def test_memory_per_block_at_200k_blocks_is_under_200_bytes():
    rng = np.random.default_rng(5)
    index = BlockIndex()
    index.open_node(0)
    index.open_node(1)
    batches = [random_keys(50000, rng) for _ in range(4)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i, keys in enumerate(batches):
            assert index.add(i % 2, DRAM, keys, [1 << 20] * len(keys), [7] * len(keys))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(index) == 200000
    per_block = grown / 200000
    assert per_block < 200, f"{per_block:.0f} bytes per indexed block"
    assert index.exists([batches[3][-1], bytes(32)]) == [True, False]


def test_drop_node_costs_its_own_blocks_not_a_scan_of_the_index(monkeypatch):
    rng = np.random.default_rng(6)
    index = opened(0, 1, 2)
    keys = random_keys(200000, rng)
    assert index.add(0, DRAM, keys[:100000], [1] * 100000, [2] * 100000)
    assert index.add(1, SSD, keys[50000:], [1] * 150000, [2] * 150000)
    assert index.add(2, DRAM, keys[:10], [1] * 10, [2] * 10)

    def no_scan(*_args):
        raise AssertionError("a node drop scanned every row")

    monkeypatch.setattr(KeyTable, "chunks", no_scan)
    monkeypatch.setattr(KeyTable, "live_rows", no_scan)
    calls: list[int] = []
    find = KeyTable.find
    monkeypatch.setattr(KeyTable, "find", lambda self, k0, k1: calls.append(len(k0)) or find(self, k0, k1))
    assert index.drop_node(2) == 10
    assert calls == [10]  # the node's own keys looked up, nothing else
    monkeypatch.undo()
    assert index.drop_node(1) == 150000  # (the table then shrinks: a rehash, as any large removal makes)
    assert len(index) == 100000
    assert index.leading_run(keys[49999:50001]) == [Hit(DRAM, 0, 1, 2), Hit(DRAM, 0, 1, 2)]
    check_index(index)


def test_a_nodes_key_list_stays_bounded_under_churn_and_full_syncs_use_it():
    index, ref = opened(0, 1, 2), Reference()
    rng = np.random.default_rng(8)
    big = random_keys(100000, rng)  # on node 2: a table large enough that node 1's full sync uses its list
    index.add(2, DRAM, big, *sizes_for(big))
    ref.add(2, DRAM, big, *sizes_for(big))
    kept = random_keys(3000, rng)
    index.add(1, SSD, kept, *sizes_for(kept))
    ref.add(1, SSD, kept, *sizes_for(kept))
    for _ in range(40):  # 40 x 2,000 keys linked to node 0, never more than 2,000 held at once
        keys = random_keys(2000, rng)
        index.add(0, DRAM, keys, *sizes_for(keys))
        index.add(0, DRAM, keys[:500], *sizes_for(keys[:500]))  # repeats too
        ref.add(0, DRAM, keys, *sizes_for(keys))
        index.remove(0, DRAM, keys)
        ref.remove(0, DRAM, keys)
    assert index._node_keys.keys(0)[0].size <= 2 * 2500 + 1024  # not 100,000: compacted as it went
    synced = kept[:1000]
    assert 3000 * index_module.SCAN_RATIO < len(index._table.fp)
    index.replace_node_tier(1, SSD, synced, *sizes_for(synced))
    ref.replace(1, SSD, synced, *sizes_for(synced))
    assert_agrees(index, ref, kept)
    assert index.drop_node(1) == ref.drop(1) == 1000
    assert_agrees(index, ref, kept)


def test_leading_run_arrays_agree_with_leading_run():
    from kvpool.keys import opaque_key

    index = BlockIndex()
    index.open_node(0)
    index.open_node(1)
    keys = [opaque_key(f"arrays-{i}") for i in range(10)]
    index.add(0, Tier.DRAM, keys[:4], [10, 11, 12, 13], [1, 2, 3, 4])
    index.add(1, Tier.SSD, keys[4:7], [14, 15, 16], [5, 6, 7])
    run = index.leading_run_arrays(b"".join(keys))
    hits = index.leading_run(keys)
    assert len(hits) == 7 and run.tiers.tolist() == [int(h.tier) for h in hits]
    assert run.nodes.tolist() == [h.node for h in hits] and run.sizes.tolist() == [h.size for h in hits]
    assert run.checksums.tolist() == [h.checksum for h in hits]
    assert len(index.leading_run_arrays(b"").tiers) == 0
    with pytest.raises(ValueError):
        index.leading_run_arrays(b"x" * 33)


def test_runs_of_prompts_looked_up_together_equal_each_alone():
    """The Lookups' pass (lookup_replies: lookups that arrived together, one compiled call) cuts each prompt at
    its own first miss, whatever the others hold: empty prompts, all-present, all-absent, a miss first or last,
    in any order; each reply is its prompt's run alone, encoded."""
    from kvpool.keys import opaque_key

    rng = random.Random(29)
    index = BlockIndex()
    for node in range(3):
        index.open_node(node)
    keys = [opaque_key(f"together-{i}") for i in range(400)]
    for i in range(0, 300, 3):
        index.add(i % 3, Tier.DRAM if i % 2 else Tier.SSD, keys[i:i + 3], [i + 1] * 3, [i + 7] * 3)
    prompts = [b"", b"".join(keys[:40]), b"".join(keys[300:310]), b"", b"".join(keys[290:305]),
               b"".join(keys[:1]), b"".join(keys[399:400])]
    for _ in range(40):
        lo = rng.randrange(0, 380)
        prompts.append(b"".join(keys[lo:lo + rng.randrange(0, 20)]))
    for batch in (prompts, prompts[1:2], prompts[:1], [b"", b""], list(reversed(prompts))):
        together, starts = index.leading_runs_pass(lookup_replies, batch)
        assert len(together) == len(batch) and starts[-1] == sum(len(p) for p in batch) // 32
        for packed, reply in zip(batch, together):
            alone = index.leading_run_arrays(packed)
            assert reply == encode_runs(*alone, np.array([0]), np.array([len(alone.tiers)]))[0]
    replies, _ = index.leading_runs_pass(lookup_replies, prompts)
    assert sum(r.dram_blocks + r.ssd_blocks for r in replies) > 100  # (hits, not only misses)
    with pytest.raises(ValueError):
        index.leading_runs_pass(lookup_replies, [b"", b"x" * 33])


# -- tier transitions (the master's KV events) ----------------------------------------------


def test_change_events_are_exactly_each_keys_tier_transitions():
    """Replaying the sink's changes on an empty model rebuilds, after every call, which tiers hold each key,
    and no change repeats what the model already says (a stored tier it had, a removed tier it lacked)."""
    model: dict[bytes, set[Tier]] = {}
    calls: list[int] = []

    def sink(changes):
        calls.append(len(changes))
        for change in changes:
            for prefix in prefixes(change):
                tiers = model.setdefault(prefix, set())
                if change.stored:
                    assert change.tier not in tiers, "a stored event for a tier the key already had"
                    tiers.add(change.tier)
                else:
                    assert change.tier in tiers, "a removed event for a tier the key did not have"
                    tiers.discard(change.tier)

    rng = random.Random(11)
    keys = make_keys(600, "events")
    index, ref = BlockIndex(min_capacity=64, on_change=sink), Reference()
    open_nodes, next_node = [0, 1, 2, 3], 4
    for node in open_nodes:
        index.open_node(node)
    most = 0  # the most locations one key had: 3 or more takes the index's rare multi-location path
    for _ in range(400):
        node, tier = rng.choice(open_nodes), rng.choice([DRAM, SSD])
        batch = [rng.choice(keys) for _ in range(rng.randint(0, 120))]
        sizes, sums = sizes_for(batch)
        roll = rng.random()
        if roll < 0.5:
            index.add(node, tier, batch, sizes, sums)
            ref.add(node, tier, batch, sizes, sums)
        elif roll < 0.8:
            index.remove(node, tier, batch)
            ref.remove(node, tier, batch)
        elif roll < 0.95:
            index.replace_node_tier(node, tier, batch, sizes, sums)
            ref.replace(node, tier, batch, sizes, sums)
        else:
            index.drop_node(node)
            ref.drop(node)
            open_nodes.remove(node)
            index.open_node(next_node)
            open_nodes.append(next_node)
            next_node += 1
        expected = {key[:16]: {Tier(t) for t, _ in locs} for key, (_, _, locs) in ref.entries.items()}
        assert {k: v for k, v in model.items() if v} == expected
        most = max([most, *(len(locs) for _, _, locs in ref.entries.values())])
    assert most >= 3 and len(calls) > 100


def test_a_second_copy_or_a_repeated_report_is_no_change():
    seen: list = []
    index = BlockIndex(min_capacity=64, on_change=seen.extend)
    for node in (0, 1):
        index.open_node(node)
    keys = make_keys(5)
    sizes, sums = sizes_for(keys)
    index.add(0, DRAM, keys, sizes, sums)
    assert [(c.tier, c.stored, len(c.k0)) for c in seen] == [(DRAM, True, 5)]
    seen.clear()
    index.add(0, DRAM, keys, sizes, sums)  # the same report again
    index.add(1, DRAM, keys[:3], sizes[:3], sums[:3])  # a second node's copy
    index.remove(1, DRAM, keys[:3])  # node 0 still holds them
    assert seen == []
    index.drop_node(0)
    assert [(c.tier, c.stored, sorted(prefixes(c))) for c in seen] == [(DRAM, False, sorted(k[:16] for k in keys))]


def test_with_tags_every_transition_names_its_keys_tenant_tags():
    """Issue 26: the KV event feed (auth on) sends a block's events to its tenant, the owner of the tag its
    stored key ends with: the index keeps each key's tag and hands it over with every transition (adds, a
    removal, a full sync's replacement, a dropped node), key for key."""
    seen: list = []
    index = BlockIndex(min_capacity=64, on_change=seen.extend, tags=True)
    index.open_node(0)
    keys = [k[:28] + (i % 3).to_bytes(4, "little") for i, k in enumerate(make_keys(40, "tags"))]
    tag_of = {k[:16]: int.from_bytes(k[28:], "little") for k in keys}
    sizes, sums = sizes_for(keys)
    index.add(0, DRAM, keys, sizes, sums)
    index.add(0, SSD, keys[:10], sizes[:10], sums[:10])
    index.remove(0, DRAM, keys[:5])
    index.replace_node_tier(0, SSD, keys[5:10], sizes[5:10], sums[5:10])
    index.drop_node(0)
    assert len(seen) >= 5
    for change in seen:
        assert change.tag is not None and len(change.tag) == len(change.k0)
        assert [tag_of[k] for k in prefixes(change)] == change.tag.tolist()
    assert all(c.tag is None for c in opened_changes())


def opened_changes() -> list:
    """Transitions of an index that keeps no tags: they carry none."""
    seen: list = []
    index = BlockIndex(min_capacity=64, on_change=seen.extend)
    index.open_node(0)
    keys = make_keys(3, "no-tags")
    index.add(0, DRAM, keys, *sizes_for(keys))
    return seen


def test_a_large_change_goes_out_in_bounded_batches_in_order(monkeypatch):
    """A dropped node's blocks: consecutive batches that fit BATCH_ROOM bytes, naming each key once."""
    from kvpool.event_publisher import EventPublisher
    from kvpool.events import EVENT_BYTES, HASH_BYTES, BlockRemoved, BlockStored, key_hash
    from kvpool.master import kv_events

    monkeypatch.setattr(kv_events, "BATCH_ROOM", EVENT_BYTES + 100 * HASH_BYTES)  # 100 hashes in one event
    published: list[tuple[list, str | None]] = []
    publisher = EventPublisher("tcp://127.0.0.1:0")
    monkeypatch.setattr(publisher, "publish",
                        lambda events, topic=None, tenant="": published.append((list(events), topic)))
    try:
        feed = kv_events.MasterEventFeed(publisher, "kvpool")
        index = BlockIndex(min_capacity=64, on_change=feed.pool_changed)
        index.open_node(0)
        keys = make_keys(1050, "big")
        sizes, sums = sizes_for(keys)
        published.clear()
        index.add(0, DRAM, keys, sizes, sums)
        index.add(0, SSD, keys[:30], sizes[:30], sums[:30])
        index.drop_node(0)
        sizes_of = [sum(len(e.block_hashes) for e in events) for events, _ in published]
        # 1,050 stored in 11; 30 in 1; the drop's 1,050 + 30 removed in 12 (a second event costs room)
        assert all(n <= 100 for n in sizes_of) and len(published) == 11 + 1 + 12
        stored_hashes = [h for events, _ in published[:11] for e in events for h in e.block_hashes]
        assert all(isinstance(e, BlockStored) for events, _ in published[:12] for e in events)
        assert sorted(stored_hashes) == sorted(map(key_hash, keys))
        gone = [(e.medium, h) for events, _ in published[12:] for e in events for h in e.block_hashes]
        assert all(isinstance(e, BlockRemoved) for events, _ in published[12:] for e in events)
        want = [("CPU", key_hash(k)) for k in keys] + [("STORAGE", key_hash(k)) for k in keys[:30]]
        assert sorted(gone) == sorted(want)
        assert {topic for _, topic in published} == {"kvpool/pool"}
    finally:
        publisher.close()


# -- engine names (KV events name blocks by the engine's hash) ------------------------------------


def words_of(keys: list[BlockKey]) -> tuple[np.ndarray, np.ndarray]:
    w = np.frombuffer(b"".join(keys), np.uint64).reshape(-1, 4)
    return np.ascontiguousarray(w[:, 0]), np.ascontiguousarray(w[:, 1])


def test_engine_names_keep_indexed_keys_names_and_trim_the_rest_when_full():
    from kvpool.master.engine_names import EngineNames

    index = opened(0)
    names = EngineNames(max_names=100)
    keys = make_keys(150, "named")
    k0, k1 = words_of(keys)
    values = np.arange(1, 151, dtype=np.uint64)
    held = keys[:60]
    index.add(0, DRAM, held, *sizes_for(held))
    assert names.learn(k0[:100], k1[:100], values[:100], index.holds) == 100
    assert names.names_of(k0[:3], k1[:3]).tolist() == [1, 2, 3]
    assert names.learn(k0[:1], k1[:1], np.array([77], np.uint64), index.holds) == 1  # a new name replaces
    assert names.names_of(k0[:1], k1[:1]).tolist() == [77]
    # Full: the 40 names of keys never indexed (60..99) go first, to make room for 40 of the next 50.
    assert names.learn(k0[100:], k1[100:], values[100:], index.holds) == 40 and names.refused == 10
    assert (names.names_of(k0[:60], k1[:60]) != 0).all()  # an indexed key's name is never dropped
    assert (names.names_of(k0[60:100], k1[60:100]) == 0).all() and len(names) == 100
    assert names.learn(k0[:5], k1[:5], np.zeros(5, np.uint64), index.holds) == 0  # 0 is no name: nothing changes
    assert names.names_of(k0[1:2], k1[1:2]).tolist() == [2]


def test_engine_names_keep_each_tenant_within_its_share_and_never_drop_anothers():
    """Issue 26: a tenant at its share (max_names / tenants) drops its own names of unindexed keys, then is
    refused; another tenant's names, indexed or not, stay."""
    from kvpool.master.engine_names import EngineNames

    index = opened(0)
    names = EngineNames(max_names=100, tenants=["a", "b"])
    assert names.share == 50
    a0, a1 = words_of(make_keys(10, "tenant-a"))
    assert names.learn(a0, a1, np.arange(1, 11, dtype=np.uint64), index.holds, "a") == 10  # in flight
    b_keys = make_keys(150, "tenant-b")
    b0, b1 = words_of(b_keys)
    values = np.arange(100, 250, dtype=np.uint64)
    assert names.learn(b0[:60], b1[:60], values[:60], index.holds, "b") == 50 and names.refused == 10
    assert names.learn(b0[60:90], b1[60:90], values[60:90], index.holds, "b") == 30  # b's own stale names go
    assert names.held("b") == 30 and names.held("a") == 10
    assert names.names_of(a0, a1).tolist() == list(range(1, 11))  # a's names are all there
    index.add(0, DRAM, b_keys[60:90], *sizes_for(b_keys[60:90]))  # b's 30 names are of indexed keys now
    assert names.learn(b0[90:], b1[90:], values[90:], index.holds, "b") == 20  # room for 20 more, no more
    assert names.held("b") == 50 and names.refused == 10 + 40
    assert (names.names_of(b0[60:90], b1[60:90]) != 0).all()
    assert names.names_of(a0, a1).tolist() == list(range(1, 11))
    with pytest.raises(ValueError, match="unknown tenant"):
        names.learn(a0, a1, np.arange(1, 11, dtype=np.uint64), index.holds, "c")


def test_the_feed_names_named_blocks_by_their_engine_hash_in_every_tier():
    from kvpool.event_publisher import EventPublisher
    from kvpool.events import key_hash
    from kvpool.master import kv_events
    from kvpool.master.engine_names import EngineNames

    published: list = []
    publisher = EventPublisher("tcp://127.0.0.1:0")
    publisher.publish = lambda events, topic=None, tenant="": published.append(list(events))
    try:
        names = EngineNames()
        feed = kv_events.MasterEventFeed(publisher, "kvpool", names)
        index = BlockIndex(min_capacity=64, on_change=feed.pool_changed)
        index.open_node(0)
        keys = make_keys(4, "feed")
        k0, k1 = words_of(keys)
        names.learn(k0[:2], k1[:2], np.array([11, 12], np.uint64), index.holds)
        index.add(0, DRAM, keys, *sizes_for(keys))
        index.remove(0, DRAM, keys[:1])  # gone from the pool a moment (a demotion reported in two steps)
        index.add(0, SSD, keys[:1], *sizes_for(keys[:1]))
        index.drop_node(0)
        hashes = [sorted(h for e in events for h in e.block_hashes) for events in published[1:]]
        plain = sorted([key_hash(keys[2]), key_hash(keys[3])])
        assert hashes == [sorted([11, 12, *plain]), [11], [11], sorted([11, 12, *plain])]
    finally:
        publisher.close()


def _pairs(columns) -> list[tuple]:
    return sorted(zip(*[c.tolist() for c in columns]))


def _many_located_index() -> BlockIndex:
    """Keys on one, two and three locations (the three-location ones listed apart), over many copy steps."""
    index = BlockIndex(min_capacity=1024)
    for node in range(3):
        index.open_node(node)
    keys = make_keys(600)
    index.add(0, Tier.DRAM, keys, [4096] * 600, list(range(600)))
    index.add(1, Tier.SSD, keys[:300], [4096] * 300, list(range(300)))
    index.add(2, Tier.DRAM, keys[:100], [4096] * 100, list(range(100)))
    return index


def test_a_copy_of_every_location_is_taken_in_steps_that_let_lookups_in(monkeypatch):
    index = _many_located_index()
    with index._lock:
        whole = index._locations_in(slice(0, len(index._table.fp)))
    assert len(whole[0]) == 600 + 300 + 100
    steps = []
    real = index._locations_in
    monkeypatch.setattr(index_module, "COPY_ROWS", 64)
    monkeypatch.setattr(index, "_locations_in", lambda slots: steps.append(slots) or real(slots))
    assert _pairs(index.locations()) == _pairs(whole)
    assert len(steps) == -(-len(index._table.fp) // 64) > 1  # the lock was let go between steps


def test_a_copy_that_a_change_overtakes_is_taken_again_whole(monkeypatch):
    index = _many_located_index()
    index._lock = threading.RLock()  # so that the change below can land inside a step, as if between two
    real = index._locations_in
    steps = []

    def step_then_change(slots: slice):
        steps.append(slots)
        if len(steps) == 2:
            index.remove(0, Tier.DRAM, make_keys(600)[500:])
            index.add(1, Tier.DRAM, make_keys(50, "late"), [4096] * 50, [7] * 50)
        return real(slots)

    monkeypatch.setattr(index_module, "COPY_ROWS", 64)
    monkeypatch.setattr(index, "_locations_in", step_then_change)
    copy = index.locations()
    assert 2 < len(steps) < -(-len(index._table.fp) // 64) + 1  # stopped at the change, then one whole copy
    assert steps[-1] == slice(0, len(index._table.fp))
    with index._lock:
        after = real(slice(0, len(index._table.fp)))
    assert _pairs(copy) == _pairs(after) and len(copy[0]) == 500 + 300 + 100 + 50
