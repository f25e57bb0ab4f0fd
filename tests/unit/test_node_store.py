"""A node's DRAM + SSD together: demotion on eviction and promotion on hit, in LRU order."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvpool.checksum import copy_with_checksum
from kvpool.keys import BlockKey
from kvpool.tiers.dram import DramStore
from kvpool.tiers.node_store import NodeStore
from kvpool.tiers.ssd import SsdStore
from kvpool.vocabulary import Tier

SLOT = 64 << 10


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(4, "big") * 8)


def block(i: int) -> bytes:
    return bytes([i % 251]) * SLOT


def make(arena_name, tmp_path, *, write_through=False, slots=4) -> NodeStore:
    dram = DramStore.create(arena_name, slots * SLOT, SLOT, high_watermark=1.0, low_watermark=1.0)
    ssd = SsdStore(tmp_path / "ssd", 64 * SLOT)
    return NodeStore(dram, ssd, write_through=write_through)


def test_dram_eviction_demotes_to_ssd_in_lru_order(arena_name, tmp_path):
    node = make(arena_name, tmp_path)
    try:
        node.put([key(i) for i in range(4)], [block(i) for i in range(4)])
        assert node.ssd.keys() == []  # write-back: nothing on SSD until DRAM evicts
        node.get_into([key(0)], [bytearray(SLOT)])  # 0 is now the most recently used
        node.put([key(4), key(5)], [block(4), block(5)])
        assert node.ssd.keys() == [key(1), key(2)]  # demoted in LRU order
        assert node.dram.keys() == [key(3), key(0), key(4), key(5)]
        assert node.where([key(i) for i in range(7)]) == [
            Tier.DRAM, Tier.SSD, Tier.SSD, Tier.DRAM, Tier.DRAM, Tier.DRAM, None,
        ]
    finally:
        node.close()


def test_an_ssd_hit_is_served_byte_exact_and_promoted_back_to_dram(arena_name, tmp_path):
    node = make(arena_name, tmp_path)
    try:
        node.put([key(i) for i in range(4)], [block(i) for i in range(4)])
        node.put([key(4), key(5)], [block(4), block(5)])  # 0, 1 demoted
        out = bytearray(SLOT)
        assert node.get_into([key(0)], [out]) == [Tier.SSD]
        assert bytes(out) == block(0)
        assert node.where([key(0)]) == [Tier.DRAM]  # promoted...
        assert node.dram.keys()[-1] == key(0)  # ...as the most recently used,
        assert node.where([key(2)]) == [Tier.SSD]  # pushing DRAM's LRU block down
        assert node.get_into([key(0)], [out]) == [Tier.DRAM] and bytes(out) == block(0)
        assert node.ssd.stats().hits == 1 and node.dram.stats().hits == 1
    finally:
        node.close()


def test_write_through_puts_every_block_on_ssd_at_once(arena_name, tmp_path):
    node = make(arena_name, tmp_path, write_through=True)
    try:
        node.put([key(i) for i in range(3)], [block(i) for i in range(3)])
        assert node.ssd.keys() == [key(0), key(1), key(2)]
        node.put([key(i) for i in range(3, 6)], [block(i) for i in range(3, 6)])
        out = bytearray(SLOT)
        assert node.get_into([key(0)], [out]) == [Tier.SSD] and bytes(out) == block(0)
    finally:
        node.close()


def test_write_through_copies_a_committed_block_before_a_concurrent_put_can_reuse_its_slot(arena_name, tmp_path):
    """A Commit's write-through used to publish the slots first and copy them to SSD after: a put landing in
    between evicted the block and reused its slot, and SSD stored the other block's bytes under its key (its
    own verify had already passed)."""
    node = make(arena_name, tmp_path, write_through=True, slots=2)
    ssd_put = node.ssd.put
    nested = []

    def put_meanwhile(keys, values, checksums=None):
        if not nested:  # the Commit's write-through: another writer fills DRAM before SSD copies
            nested.append(True)
            assert node.put([key(10), key(11)], [block(10), block(11)]) == [True, True]
        return ssd_put(keys, values, checksums)

    node.ssd.put = put_meanwhile
    try:
        res = node.dram.reserve([key(1)], [SLOT], None, owner="w")
        sums = [copy_with_checksum(node.dram.arena.block(res.slots[0], SLOT), np.frombuffer(block(1), np.uint8))]
        assert node.commit(res.lease, [key(1)], res.slots, sums, owner="w") == [True]
        out = bytearray(SLOT)
        assert node.ssd.get_into([key(1)], [out]) == [True] and bytes(out) == block(1)
        assert nested and node.ssd.stats().corrupt == 0
    finally:
        node.close()


def test_demoted_blocks_survive_a_node_restart_on_ssd(arena_name, tmp_path):
    node = make(arena_name, tmp_path)
    node.put([key(i) for i in range(4)], [block(i) for i in range(4)])
    node.put([key(4), key(5)], [block(4), block(5)])  # 0, 1 demoted
    node.close()  # DRAM is gone with the arena; SSD keeps what was demoted
    node = make(arena_name, tmp_path)
    try:
        assert node.where([key(0), key(1), key(5)]) == [Tier.SSD, Tier.SSD, None]
        out = bytearray(SLOT)
        assert node.get_into([key(1)], [out]) == [Tier.SSD] and bytes(out) == block(1)
    finally:
        node.close()


def test_a_batch_larger_than_dram_overflows_to_ssd(arena_name, tmp_path):
    node = make(arena_name, tmp_path)
    try:
        assert node.put([key(i) for i in range(6)], [block(i) for i in range(6)]) == [True] * 6
        assert node.where([key(i) for i in range(6)]) == [Tier.DRAM] * 4 + [Tier.SSD] * 2
    finally:
        node.close()


def test_bad_input_changes_nothing(arena_name, tmp_path):
    node = make(arena_name, tmp_path)
    try:
        node.put([key(1)], [block(1)])
        with pytest.raises(ValueError):
            node.put([key(2), b"bad"], [block(2), block(3)])
        with pytest.raises(ValueError):
            node.get_into([key(1)], [bytearray(SLOT), bytearray(SLOT)])
        assert node.where([key(1), key(2)]) == [Tier.DRAM, None]
    finally:
        node.close()


def test_service_side_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import kvpool.keys, kvpool.layout, kvpool.tiers.node_store, kvpool.cli, kvpool.master\n"
        "print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_demotion_and_promotion_are_counted_and_reported_per_tier(arena_name, tmp_path):
    moves = {"demote": 0, "promote": 0}
    dram_calls, ssd_calls = [], []
    dram = DramStore.create(arena_name, 4 * SLOT, SLOT, high_watermark=1.0, low_watermark=1.0,
                            on_change=lambda a, r: dram_calls.append(([m.key for m in a], list(r))))
    ssd = SsdStore(tmp_path / "ssd", 64 * SLOT, on_change=lambda a, r: ssd_calls.append(([m.key for m in a], list(r))))
    node = NodeStore(dram, ssd, on_demote=lambda n: moves.__setitem__("demote", moves["demote"] + n),
                       on_promote=lambda n: moves.__setitem__("promote", moves["promote"] + n))
    try:
        node.put([key(i) for i in range(4)], [block(i) for i in range(4)])
        node.put([key(4)], [block(4)])  # DRAM is full: its LRU block, key(0), moves down
        assert moves == {"demote": 1, "promote": 0}
        assert ssd_calls == [([key(0)], [])]
        assert dram_calls[-1] == ([key(4)], [key(0)])
        out = bytearray(SLOT)
        assert node.get_into([key(0)], [out]) == [Tier.SSD] and bytes(out) == block(0)
        assert moves == {"demote": 2, "promote": 1}  # promoting 0 pushed DRAM's LRU block (1) down
        assert dram_calls[-1] == ([key(0)], [key(1)])
    finally:
        node.close()


def test_a_block_larger_than_a_slot_lives_on_ssd_only(arena_name, tmp_path):
    promoted = []
    node = make(arena_name, tmp_path)
    node.on_promote = promoted.append
    try:
        big = bytes(range(256)) * (SLOT // 128)  # two slots' worth
        assert node.put([key(1), key(2)], [big, block(2)]) == [True, True]
        assert node.where([key(1), key(2)]) == [Tier.SSD, Tier.DRAM]
        out = bytearray(len(big))
        assert node.get_into([key(1)], [out]) == [Tier.SSD] and bytes(out) == big
        assert node.where([key(1)]) == [Tier.SSD] and promoted == []  # never promoted
        with pytest.raises(ValueError):  # fits nowhere: nothing stored
            node.put([key(3), key(4)], [block(3), bytes(128 * SLOT)])
        assert node.where([key(3), key(4)]) == [None, None]
    finally:
        node.close()


def test_a_requests_promotions_do_not_evict_the_blocks_it_is_about_to_read(arena_name, tmp_path):
    node = make(arena_name, tmp_path)
    try:
        for i in range(6):
            node.put([key(i)], [block(i)])  # DRAM 2..5, SSD 0, 1
        assert node.where([key(0), key(1), key(2), key(3)]) == [Tier.SSD, Tier.SSD, Tier.DRAM, Tier.DRAM]
        # one request reads 2, 3 (DRAM, the least recently used there) and 0, 1 (SSD, promoted by this locate)
        refs = node.locate([key(2), key(3), key(0), key(1)], promote=True)
        assert all(r is not None for r in refs)
        assert node.where([key(i) for i in range(6)]) == [Tier.DRAM] * 4 + [Tier.SSD] * 2  # 4 and 5 went instead
        for i, ref in zip([2, 3, 0, 1], refs):
            out = bytearray(SLOT)
            assert node.dram.arena.read_into(ref, key(i), out) and bytes(out) == block(i)
    finally:
        node.close()
