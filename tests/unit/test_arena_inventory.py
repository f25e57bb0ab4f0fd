"""What a same-host reader learns from a node's arena alone: which keys it holds, and in which tier.

Real shared memory (a second mapping through ``SharedArena.attach``, and one
child process) and real LMDB. The reader's answer is the arena's inventory
table (per key: the best tier, size and checksum); with the inventory state
``COMPLETE`` it must equal what the store holds.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvpool.checksum import block_checksum
from kvpool.keys import BlockKey
from kvpool.tiers.arena import KEY_DTYPE, InventoryState, SharedArena
from kvpool.tiers.bucket_table import SCALAR_QUERIES, WAYS, BucketTable, table_buckets, table_bytes
from kvpool.tiers.dram import DramStore
from kvpool.tiers.node_store import NodeStore
from kvpool.tiers.ssd import FORMAT_VERSION, HEADER_BYTES, MAGIC, SsdStore
from kvpool.vocabulary import NO_TIER, Tier

BLOCK = 16 << 10


def key(i: int) -> BlockKey:
    return BlockKey(hashlib.sha256(i.to_bytes(8, "little")).digest())


def block(i: int) -> bytes:
    return bytes([i % 251]) * BLOCK


def packed(keys: list[BlockKey]) -> np.ndarray:
    return np.frombuffer(b"".join(keys), dtype=KEY_DTYPE)


def seen(reader: SharedArena, keys: list[BlockKey]) -> list[Tier | None]:
    """The fastest tier holding each key, as the arena alone says (what a same-host lookup computes)."""
    tiers, _, _ = reader.inventory_meta(packed(keys))
    return [None if t == NO_TIER else Tier(int(t)) for t in tiers]


def held(reader: SharedArena, keys: list[BlockKey]) -> list[bool]:
    return [t is not None for t in seen(reader, keys)]


def ssd_room(blocks: int) -> int:
    """SSD capacity for exactly ``blocks`` blocks of BLOCK bytes (LMDB pages of 4 KiB, one page of overhead)."""
    return blocks * ((-(-(HEADER_BYTES + BLOCK) // 4096) + 1) * 4096)


def make(arena_name: str, ssd_dir: Path, *, dram_blocks: int = 4, ssd_blocks: int = 64, queue: int = 0,
         ssd_keys: int = 1024, slots: int = 0) -> NodeStore:
    dram = DramStore.create(arena_name, dram_blocks * BLOCK, BLOCK, ssd_keys=ssd_keys, slots=slots)
    try:
        ssd = SsdStore(ssd_dir, ssd_room(ssd_blocks))
    except BaseException:
        dram.close()
        raise
    return NodeStore(dram, ssd, demote_queue_bytes=queue)


def check_agrees(node: NodeStore, reader: SharedArena, keys: list[BlockKey]) -> None:
    """The reader's view equals the store's: tier, size and checksum of every key."""
    node.flush_demotions()
    assert reader.inventory_state() == InventoryState.COMPLETE
    assert seen(reader, keys) == node.where(keys)
    _, sizes, sums = reader.inventory_meta(packed(keys))
    want = [(0, 0) if f is None else (f[1].size, f[1].checksum) for f in node.where_meta(keys)]
    assert [(int(a), int(b)) for a, b in zip(sizes, sums)] == want


@pytest.mark.parametrize("queue", [0, 1 << 20], ids=["inline", "queued"])
def test_demoted_blocks_stay_in_the_inventory_while_they_move_down(arena_name, tmp_path, queue):
    node = make(arena_name, tmp_path / "ssd", queue=queue)
    reader = SharedArena.attach(arena_name)
    keys = [key(i) for i in range(8)]
    during: list[list[bool]] = []
    sink = node.dram.on_evict
    assert sink is not None

    def watched(ks, views, sums):  # the DRAM rows are released only after the sink returns
        sink(ks, views, sums)
        during.append(held(reader, list(ks)))

    node.dram.on_evict = watched
    try:
        assert reader.inventory_state() == InventoryState.COMPLETE  # declared once the (empty) set was filled
        node.put(keys[:4], [block(i) for i in range(4)])
        assert seen(reader, keys) == [Tier.DRAM] * 4 + [None] * 4
        node.put(keys[4:6], [block(i) for i in range(4, 6)])  # DRAM is full: 0 and 1 move down
        assert during and all(all(d) for d in during)  # held throughout: never in neither tier
        assert seen(reader, keys) == [Tier.SSD] * 2 + [Tier.DRAM] * 4 + [None] * 2
        check_agrees(node, reader, keys)  # and still once the queue wrote them
    finally:
        reader.close()
        node.close()


def test_a_reader_in_another_process_sees_the_demoted_keys(arena_name, tmp_path):
    node = make(arena_name, tmp_path / "ssd")
    try:
        node.put([key(i) for i in range(4)], [block(i) for i in range(4)])
        node.put([key(4), key(5)], [block(4), block(5)])  # DRAM is full: 0 and 1 move down
        code = (
            "import sys, hashlib, numpy as np\n"
            "from kvpool.tiers.arena import KEY_DTYPE, SharedArena\n"
            "a = SharedArena.attach(sys.argv[1])\n"
            "ks = np.frombuffer(b''.join(hashlib.sha256(i.to_bytes(8, 'little')).digest() for i in range(8)),"
            " dtype=KEY_DTYPE)\n"
            "print(int(a.inventory_state()), ''.join(str(t) if t != 255 else '-' for t in a.inventory_meta(ks)[0]))\n"
            "a.close()\n"
        )
        done = subprocess.run([sys.executable, "-c", code, arena_name], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [str(int(InventoryState.COMPLETE)), "221111--"]
    finally:
        node.close()


def test_keys_leave_the_inventory_when_ssd_evicts_or_removes_them(arena_name, tmp_path):
    node = make(arena_name, tmp_path / "ssd", ssd_blocks=3)
    reader = SharedArena.attach(arena_name)
    keys = [key(i) for i in range(10)]
    try:
        node.put(keys[:4], [block(i) for i in range(4)])
        node.put(keys[4:8], [block(i) for i in range(4, 8)])  # 0-3 demoted; SSD keeps the newest 3 of them
        assert node.ssd.keys() == keys[1:4]
        assert seen(reader, keys) == [None] + [Tier.SSD] * 3 + [Tier.DRAM] * 4 + [None] * 2
        assert node.remove([keys[2], keys[5]]) == 2
        assert seen(reader, keys) == [None, Tier.SSD, None, Tier.SSD, Tier.DRAM, None, Tier.DRAM, Tier.DRAM,
                                      None, None]
        check_agrees(node, reader, keys)
    finally:
        reader.close()
        node.close()


def test_a_corrupt_ssd_entry_leaves_the_inventory_when_it_is_deleted(arena_name, tmp_path):
    node = make(arena_name, tmp_path / "ssd")
    reader = SharedArena.attach(arena_name)
    keys = [key(i) for i in range(6)]
    try:
        node.put(keys[:4], [block(i) for i in range(4)])
        node.put(keys[4:], [block(4), block(5)])  # 0, 1 demoted: on SSD only
        data = tmp_path / "ssd" / "data.mdb"
        header = data.read_bytes().index(MAGIC + FORMAT_VERSION.to_bytes(2, "little") + bytes(2) +
                                         BLOCK.to_bytes(8, "little") + block_checksum(block(0)).to_bytes(8, "little"))
        with open(data, "r+b") as f:  # one payload byte flipped under the open store (the page cache LMDB maps)
            f.seek(header + HEADER_BYTES + 100)
            f.write(bytes([block(0)[100] ^ 0xFF]))
        assert seen(reader, keys[:2]) == [Tier.SSD, Tier.SSD]
        assert node.get_into([keys[0]], [bytearray(BLOCK)]) == [None]  # a miss, and deleted
        assert node.ssd.stats().corrupt == 1
        assert seen(reader, keys[:2]) == [None, Tier.SSD]
        check_agrees(node, reader, keys)
    finally:
        reader.close()
        node.close()


def test_an_ssd_file_found_broken_leaves_only_dram_in_the_inventory(arena_name, tmp_path):
    node = make(arena_name, tmp_path / "ssd")
    reader = SharedArena.attach(arena_name)
    keys = [key(i) for i in range(6)]
    try:
        node.put(keys[:4], [block(i) for i in range(4)])
        node.put(keys[4:], [block(4), block(5)])  # 0, 1 demoted: on SSD only
        assert seen(reader, keys).count(Tier.SSD) == 2
        os.truncate(tmp_path / "ssd" / "data.mdb", 0)  # cut under the running store
        assert node.get_into([keys[0]], [bytearray(BLOCK)]) == [None]  # the store notices, restarts empty
        assert node.ssd.keys() == []
        assert seen(reader, keys) == [None] * 2 + [Tier.DRAM] * 4
        check_agrees(node, reader, keys)
    finally:
        reader.close()
        node.close()


def test_a_failed_demotion_write_leaves_the_inventory(arena_name, tmp_path):
    node = make(arena_name, tmp_path / "ssd", queue=1 << 20)
    reader = SharedArena.attach(arena_name)
    keys = [key(i) for i in range(6)]
    ssd = node.ssd
    assert ssd is not None
    real = ssd.put

    def refusing(*args, **kwargs):  # the disk refuses this write (what a full disk looks like to the queue)
        raise OSError("test: no space left")

    ssd.put = refusing
    try:
        node.put(keys[:4], [block(i) for i in range(4)])
        node.put(keys[4:], [block(4), block(5)])  # 0, 1 queued for SSD
        assert seen(reader, keys[:2]) == [Tier.SSD, Tier.SSD]  # pending: served as on SSD
        assert node.flush_demotions(10)
        assert seen(reader, keys[:2]) == [None, None]  # dropped: a miss
        ssd.put = real
        check_agrees(node, reader, keys)
    finally:
        reader.close()
        node.close()


def test_the_inventory_is_filled_again_from_lmdb_after_a_restart(arena_name, tmp_path):
    keys = [key(i) for i in range(8)]
    node = make(arena_name, tmp_path / "ssd")
    node.put(keys[:4], [block(i) for i in range(4)])
    node.put(keys[4:], [block(i) for i in range(4, 8)])  # 0-3 demoted
    node.close()  # the arena is gone; LMDB keeps 0-3
    node = make(arena_name, tmp_path / "ssd")
    reader = SharedArena.attach(arena_name)
    try:
        assert reader.inventory_state() == InventoryState.COMPLETE
        assert seen(reader, keys) == [Tier.SSD] * 4 + [None] * 4
        check_agrees(node, reader, keys)
    finally:
        reader.close()
        node.close()


def test_an_inventory_too_small_for_what_the_node_holds_is_incomplete(arena_name, tmp_path):
    node = make(arena_name, tmp_path / "ssd", ssd_keys=2, slots=4)  # room for 4 + 2 keys
    reader = SharedArena.attach(arena_name)
    keys = [key(i) for i in range(8)]
    try:
        node.put(keys[:4], [block(i) for i in range(4)])
        node.put(keys[4:6], [block(4), block(5)])  # 2 demoted: the inventory is full, not over
        assert reader.inventory_state() == InventoryState.COMPLETE
        node.put(keys[6:7], [block(6)])  # a third SSD key finds no room
        assert reader.inventory_state() == InventoryState.INCOMPLETE
        node.remove(keys[:3])  # room again, but a reader cannot know what it missed meanwhile
        assert reader.inventory_state() == InventoryState.INCOMPLETE
    finally:
        reader.close()
        node.close()


def test_a_bare_arena_is_incomplete_until_a_node_store_declares_its_inventory(arena_name):
    dram = DramStore.create(arena_name, 4 * BLOCK, BLOCK)
    assert dram.arena.inventory_state() == InventoryState.INCOMPLETE  # nobody filled it: readers ask the master
    node = NodeStore(dram)  # DRAM only
    try:
        assert dram.arena.inventory_state() == InventoryState.COMPLETE
    finally:
        node.close()


def crafted_keys(table: BucketTable, n: int, *, same_alternate: bool) -> list[BlockKey]:
    """``n`` keys of distinct tags that all have the same home bucket in ``table`` (and, if ``same_alternate``, the
    same alternate too), found by trying random first 8 bytes (the tables are small)."""
    rng = random.Random(7)
    want: tuple[int, int] | None = None
    keys: list[BlockKey] = []
    while len(keys) < n:
        k = BlockKey(rng.randbytes(32))
        home, alt = table.homes(int.from_bytes(k[:8], "little") or 1)
        if want is None:
            want = (home, alt)
        if home == want[0] and (alt == want[1] or not same_alternate):
            keys.append(k)
    return keys


@pytest.mark.parametrize("table", ["index", "inventory"])
def test_full_buckets_cost_a_hint_in_the_key_index_and_completeness_in_the_inventory(arena_name, tmp_path, table):
    dram = DramStore.create(arena_name, 64 * BLOCK, BLOCK, slots=64, ssd_keys=1024)
    node = NodeStore(dram, SsdStore(tmp_path / "ssd", ssd_room(64)))
    reader = SharedArena.attach(arena_name)
    full = 2 * WAYS  # a home bucket and its alternate
    keys = crafted_keys(getattr(dram.arena, table), full + 1, same_alternate=True)
    assert dram.arena.index.buckets == table_buckets(64)
    try:
        node.put(keys[:full], [block(i) for i in range(full)])  # both buckets, full
        assert reader.inventory_state() == InventoryState.COMPLETE
        assert seen(reader, keys[:full]) == [Tier.DRAM] * full
        node.put(keys[full:], [block(full)])  # stored, but that table has no room for it
        assert node.where(keys[full:]) == [Tier.DRAM]
        slot = reader.index_find(packed(keys[full:]))[0]
        if table == "index":  # only a hint: the reader asks the node for that slot; the inventory still knows it
            assert slot == -1 and seen(reader, keys[full:]) == [Tier.DRAM]
            assert reader.inventory_state() == InventoryState.COMPLETE
        else:  # a reader can no longer take the inventory for everything (keys sharing buckets in the larger
            assert seen(reader, keys[full:]) == [None]  # table share them in the index too: its hint is gone too)
            assert reader.inventory_state() == InventoryState.INCOMPLETE
    finally:
        reader.close()
        node.close()


@pytest.mark.parametrize("queue", [0, 1 << 20], ids=["inline", "queued"])
def test_random_puts_gets_and_removes_keep_the_arena_s_inventory_equal_to_the_store_s(arena_name, tmp_path, queue):
    """After every step: the inventory says exactly what ``where_meta()`` says, and the key index names every DRAM
    block's slot."""
    node = make(arena_name, tmp_path / "ssd", dram_blocks=6, ssd_blocks=12, queue=queue)
    reader = SharedArena.attach(arena_name)
    keys = [key(i) for i in range(40)]
    rng = random.Random(14)
    try:
        for _ in range(300):
            picked = rng.sample(range(len(keys)), rng.randint(1, 5))
            op = rng.random()
            if op < 0.5:
                node.put([keys[i] for i in picked], [block(i) for i in picked])
            elif op < 0.85:
                node.get_into([keys[i] for i in picked], [bytearray(BLOCK) for _ in picked])
            else:
                node.remove([keys[i] for i in picked])
            check_agrees(node, reader, keys)
            arr = packed(keys)
            _, _, in_dram = reader.check_slots(reader.index_find(arr), arr)
            assert [Tier.DRAM if d else None for d in in_dram] == [t if t == Tier.DRAM else None
                                                                 for t in node.where(keys)]
        assert node.ssd is not None and node.ssd.stats().evictions > 0  # SSD's LRU took part
        assert Tier.SSD in seen(reader, keys) and node.dram.stats().evictions > 0
    finally:
        reader.close()
        node.close()


def test_the_inventory_answers_like_a_dict_through_churn_with_spilled_buckets(arena_name):
    """Owner puts and discards (keys spilled to their alternate bucket included) against a model, read back by
    another mapping: tier, size and checksum."""
    arena = SharedArena.create(arena_name, 4096, 1, ssd_keys=63)  # room for 64 keys
    reader = SharedArena.attach(arena_name)
    table = arena.inventory
    assert table.buckets == table_buckets(64)
    rng = random.Random(3)
    crafted = crafted_keys(table, 20, same_alternate=False)  # 20 keys, one home bucket of 8: most spill
    pool = crafted + [key(i) for i in range(80)]
    model: dict[BlockKey, tuple[int, int, int]] = {}
    try:
        for _ in range(600):
            k = rng.choice(pool)
            if (k in model and rng.random() < 0.5) or len(model) >= 64 or rng.random() < 0.3:
                arena.inventory_discard(k)
                model.pop(k, None)
            else:
                entry = (rng.choice([Tier.DRAM, Tier.SSD]), rng.randint(1, 1 << 40), rng.getrandbits(64))
                assert arena.inventory_put(k, *entry)
                model[k] = entry
            tiers, sizes, sums = reader.inventory_meta(packed(pool))
            assert [int(t) for t in tiers] == [int(model[k][0]) if k in model else NO_TIER for k in pool]
            assert [(int(a), int(b)) for a, b, k in zip(sizes, sums, pool) if k in model] == \
                [model[k][1:] for k in pool if k in model]
            assert arena.inventory_count == len(model)
        assert reader.inventory_state() == InventoryState.INCOMPLETE  # never declared: not filled yet
        arena.declare_inventory()
        assert reader.inventory_state() == InventoryState.COMPLETE
        full = [k for k in pool if k not in model][: 65 - len(model)]
        assert all(arena.inventory_put(k, Tier.SSD, 1, 2) for k in full[:-1])
        assert not arena.inventory_put(full[-1], Tier.SSD, 1, 2)  # the 65th key: no room
        assert reader.inventory_state() == InventoryState.INCOMPLETE
    finally:
        reader.close()
        arena.close()


@pytest.mark.parametrize("batch", [1, 3, SCALAR_QUERIES, SCALAR_QUERIES + 1, 200])
def test_a_lookup_answers_alike_one_by_one_and_vectorised_with_spills_moves_and_deletes(batch):
    """Batches of up to SCALAR_QUERIES tags go through ``find``; larger ones through numpy: both must say where
    each tag is, wherever inserts, room-making moves and deletes left it."""
    buckets = 16
    table = BucketTable(np.zeros(table_bytes(buckets, 1), np.uint8), 0, buckets, 1)
    rng = random.Random(batch)
    truth: dict[int, int] = {}
    for step in range(3 * buckets * WAYS):
        tag = rng.randrange(1, 1 << 64)
        if truth and rng.random() < 0.3:  # delete one
            gone = rng.choice(sorted(truth))
            table.remove(gone, truth.pop(gone))
        elif table.insert(tag, (step,)) >= 0:
            truth[tag] = step
        present = rng.sample(sorted(truth), min(batch, len(truth)))
        absent = [rng.randrange(1, 1 << 64) for _ in range(batch - len(present))]
        queries = np.array(present + absent, dtype=np.uint64)
        at = table.lookup(queries)
        assert [int(table.values[0, a]) for a in at[: len(present)]] == [truth[t] for t in present]
        assert (at[len(present) :] == -1).all()
        matched = table.lookup(queries[: len(present)], np.array([truth[t] + 1 for t in present], dtype=np.uint64))
        assert (matched == -1).all()  # the value word must match too
