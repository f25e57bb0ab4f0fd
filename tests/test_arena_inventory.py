"""What a same-host reader learns from a node's arena alone: which keys it holds, and in which tier.

Real shared memory (a second mapping through ``SharedArena.attach``, and one
child process) and real LMDB. The reader's answer is the DRAM key index
checked against the rows, plus the SSD key set; with the inventory state
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
from kvpool.core import Tier
from kvpool.keys import BlockKey
from kvpool.tiers.arena import KEY_DTYPE, InventoryState, SharedArena
from kvpool.tiers.dram import DramStore
from kvpool.tiers.keytable import PROBES, table_entries
from kvpool.tiers.node_store import NodeStore
from kvpool.tiers.ssd import FORMAT_VERSION, HEADER_BYTES, MAGIC, SsdStore

BLOCK = 16 << 10
GOLDEN_INVERSE = pow(0x9E3779B97F4A7C15, -1, 1 << 64)


def key(i: int) -> BlockKey:
    return BlockKey(hashlib.sha256(i.to_bytes(8, "little")).digest())


def block(i: int) -> bytes:
    return bytes([i % 251]) * BLOCK


def packed(keys: list[BlockKey]) -> np.ndarray:
    return np.frombuffer(b"".join(keys), dtype=KEY_DTYPE)


def seen(reader: SharedArena, keys: list[BlockKey]) -> list[Tier | None]:
    """The fastest tier holding each key, as the arena alone says (what a same-host lookup computes)."""
    arr = packed(keys)
    _, _, in_dram = reader.check_slots(reader.index_find(arr), arr)
    on_ssd = reader.ssd_holds(arr)
    return [Tier.DRAM if d else Tier.SSD if s else None for d, s in zip(in_dram, on_ssd)]


def ssd_room(blocks: int) -> int:
    """SSD capacity for exactly ``blocks`` blocks of BLOCK bytes (LMDB pages of 4 KiB, one page of overhead)."""
    return blocks * ((-(-(HEADER_BYTES + BLOCK) // 4096) + 1) * 4096)


def make(arena_name: str, ssd_dir: Path, *, dram_blocks: int = 4, ssd_blocks: int = 64, queue: int = 0,
         ssd_keys: int = 1024) -> NodeStore:
    dram = DramStore.create(arena_name, dram_blocks * BLOCK, BLOCK, ssd_keys=ssd_keys)
    try:
        ssd = SsdStore(ssd_dir, ssd_room(ssd_blocks))
    except BaseException:
        dram.close()
        raise
    return NodeStore(dram, ssd, demote_queue_bytes=queue)


def check_agrees(node: NodeStore, reader: SharedArena, keys: list[BlockKey]) -> None:
    """The reader's view equals the store's, tier for tier, and the SSD set equals the SSD inventory."""
    node.flush_demotions()
    assert reader.inventory_state() == InventoryState.COMPLETE
    assert seen(reader, keys) == node.where(keys)
    assert list(reader.ssd_holds(packed(keys))) == node.ssd_inventory().contains(keys)


@pytest.mark.parametrize("queue", [0, 1 << 20], ids=["inline", "queued"])
def test_demoted_blocks_appear_in_the_ssd_set_while_their_dram_rows_still_hold_them(arena_name, tmp_path, queue):
    node = make(arena_name, tmp_path / "ssd", queue=queue)
    reader = SharedArena.attach(arena_name)
    keys = [key(i) for i in range(8)]
    during: list[list[bool]] = []
    sink = node.dram.on_evict
    assert sink is not None

    def watched(ks, views, sums):  # the DRAM rows are released only after the sink returns
        sink(ks, views, sums)
        during.append(list(reader.ssd_holds(packed(list(ks)))))

    node.dram.on_evict = watched
    try:
        assert reader.inventory_state() == InventoryState.COMPLETE  # declared once the (empty) set was filled
        node.put(keys[:4], [block(i) for i in range(4)])
        assert seen(reader, keys) == [Tier.DRAM] * 4 + [None] * 4
        node.put(keys[4:6], [block(i) for i in range(4, 6)])  # DRAM is full: 0 and 1 move down
        assert during and all(all(d) for d in during)  # in the set before DRAM let go of them
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
            "print(int(a.inventory_state()), ''.join('1' if h else '0' for h in a.ssd_holds(ks)))\n"
            "a.close()\n"
        )
        done = subprocess.run([sys.executable, "-c", code, arena_name], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [str(int(InventoryState.COMPLETE)), "11000000"]
    finally:
        node.close()


def test_keys_leave_the_set_when_ssd_evicts_or_removes_them(arena_name, tmp_path):
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


def test_a_corrupt_ssd_entry_leaves_the_set_when_it_is_deleted(arena_name, tmp_path):
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
        assert reader.ssd_holds(packed(keys[:2])).tolist() == [True, True]
        assert node.get_into([keys[0]], [bytearray(BLOCK)]) == [None]  # a miss, and deleted
        assert node.ssd.stats().corrupt == 1
        assert reader.ssd_holds(packed(keys[:2])).tolist() == [False, True]
        check_agrees(node, reader, keys)
    finally:
        reader.close()
        node.close()


def test_an_ssd_file_found_broken_empties_the_set(arena_name, tmp_path):
    node = make(arena_name, tmp_path / "ssd")
    reader = SharedArena.attach(arena_name)
    keys = [key(i) for i in range(6)]
    try:
        node.put(keys[:4], [block(i) for i in range(4)])
        node.put(keys[4:], [block(4), block(5)])  # 0, 1 demoted: on SSD only
        assert reader.ssd_holds(packed(keys)).sum() == 2
        os.truncate(tmp_path / "ssd" / "data.mdb", 0)  # cut under the running store
        assert node.get_into([keys[0]], [bytearray(BLOCK)]) == [None]  # the store notices, restarts empty
        assert node.ssd.keys() == []
        assert reader.ssd_holds(packed(keys)).sum() == 0
        check_agrees(node, reader, keys)
    finally:
        reader.close()
        node.close()


def test_a_failed_demotion_write_leaves_the_set(arena_name, tmp_path):
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
        assert reader.ssd_holds(packed(keys[:2])).tolist() == [True, True]  # pending: served as on SSD
        assert node.flush_demotions(10)
        assert reader.ssd_holds(packed(keys[:2])).tolist() == [False, False]  # dropped: a miss
        ssd.put = real
        check_agrees(node, reader, keys)
    finally:
        reader.close()
        node.close()


def test_the_set_is_filled_again_from_lmdb_after_a_restart(arena_name, tmp_path):
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


def test_a_set_too_small_for_the_ssd_tier_makes_the_inventory_incomplete(arena_name, tmp_path):
    node = make(arena_name, tmp_path / "ssd", ssd_keys=2)
    reader = SharedArena.attach(arena_name)
    keys = [key(i) for i in range(8)]
    try:
        node.put(keys[:4], [block(i) for i in range(4)])
        node.put(keys[4:6], [block(4), block(5)])  # 2 demoted: the set is full, not over
        assert reader.inventory_state() == InventoryState.COMPLETE
        node.put(keys[6:7], [block(6)])  # a third SSD key finds no room
        assert reader.inventory_state() == InventoryState.INCOMPLETE
        node.remove(keys[:3])  # room again, but a reader cannot know what it missed meanwhile
        assert reader.inventory_state() == InventoryState.INCOMPLETE
    finally:
        reader.close()
        node.close()


def test_an_ssd_tier_without_a_set_is_incomplete_and_no_ssd_tier_needs_none(arena_name, tmp_path):
    node = make(arena_name, tmp_path / "ssd", ssd_keys=0)
    try:
        assert node.dram.arena.inventory_state() == InventoryState.INCOMPLETE
    finally:
        node.close()
    node = NodeStore(DramStore.create(arena_name, 4 * BLOCK, BLOCK, ssd_keys=16))
    try:
        assert node.dram.arena.inventory_state() == InventoryState.NO_SSD_SET
    finally:
        node.close()


def colliding_keys(arena: SharedArena, n: int) -> list[BlockKey]:
    """``n`` keys whose DRAM key index entries all have the same home (first 8 bytes crafted, rest random)."""
    shift = 64 - (arena.index_cap.bit_length() - 1)
    rng = random.Random(7)
    return [BlockKey((((5 << shift) + i) * GOLDEN_INVERSE % (1 << 64)).to_bytes(8, "little") + rng.randbytes(24))
            for i in range(n)]


@pytest.mark.parametrize("with_ssd", [False, True], ids=["dram-only", "dram+ssd"])
def test_a_dram_key_index_overflow_makes_the_inventory_incomplete(arena_name, tmp_path, with_ssd):
    dram = DramStore.create(arena_name, 64 * BLOCK, BLOCK, slots=64, ssd_keys=1024)
    node = NodeStore(dram, SsdStore(tmp_path / "ssd", ssd_room(64)) if with_ssd else None)
    reader = SharedArena.attach(arena_name)
    want = InventoryState.COMPLETE if with_ssd else InventoryState.NO_SSD_SET
    keys = colliding_keys(dram.arena, PROBES + 1)
    assert dram.arena.index_cap == table_entries(64)
    try:
        assert reader.inventory_state() == want
        node.put(keys[:PROBES], [block(i) for i in range(PROBES)])  # one probe run, full
        assert reader.inventory_state() == want
        assert seen(reader, keys[:PROBES]) == [Tier.DRAM] * PROBES
        node.put(keys[PROBES:], [block(PROBES)])  # stored, but the index has no room for it
        assert node.where(keys[PROBES:]) == [Tier.DRAM] and seen(reader, keys[PROBES:]) == [None]
        assert reader.inventory_state() == InventoryState.INCOMPLETE
    finally:
        reader.close()
        node.close()


@pytest.mark.parametrize("queue", [0, 1 << 20], ids=["inline", "queued"])
def test_random_puts_gets_and_removes_keep_the_arena_s_inventory_equal_to_the_store_s(arena_name, tmp_path, queue):
    """After every step: the DRAM index (checked rows) and the SSD set say exactly what ``where()`` says."""
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
        assert node.ssd is not None and node.ssd.stats().evictions > 0  # SSD's LRU took part
        assert reader.ssd_holds(packed(keys)).any() and node.dram.stats().evictions > 0
    finally:
        reader.close()
        node.close()


def test_the_ssd_set_answers_like_a_set_through_churn_with_long_and_wrapping_runs(arena_name):
    """Owner adds and discards (backward shifts included) against a model set, read back by another mapping."""
    arena = SharedArena.create(arena_name, 4096, 1, ssd_keys=64)
    reader = SharedArena.attach(arena_name)
    table = arena.ssd_set
    assert table is not None and table.cap == table_entries(64)
    rng = random.Random(3)
    last = table.cap - 3  # a run starting near the end wraps round to entry 0
    shift = 64 - (table.cap.bit_length() - 1)
    crafted = [BlockKey(((((last << shift) + i) * GOLDEN_INVERSE) % (1 << 64)).to_bytes(8, "little") +
                        rng.randbytes(24)) for i in range(20)]  # 20 keys, one home: a run longer than a window
    pool = crafted + [key(i) for i in range(80)]
    model: set[BlockKey] = set()
    try:
        for _ in range(600):
            k = rng.choice(pool)
            if k in model or len(model) >= 64 or rng.random() < 0.3:
                arena.ssd_discard(k)
                model.discard(k)
            else:
                assert arena.ssd_add(k)
                model.add(k)
            assert reader.ssd_holds(packed(pool)).tolist() == [k in model for k in pool]
            assert arena.ssd_count == len(model)
        assert reader.inventory_state() == InventoryState.INCOMPLETE  # never declared: a set not filled yet
        arena.declare_inventory(ssd=True)
        assert reader.inventory_state() == InventoryState.COMPLETE
        full = [k for k in pool if k not in model][: 65 - len(model)]
        assert all(arena.ssd_add(k) for k in full[:-1]) and not arena.ssd_add(full[-1])  # the 65th key: no room
        assert reader.inventory_state() == InventoryState.INCOMPLETE
    finally:
        reader.close()
        arena.close()
