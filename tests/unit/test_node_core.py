"""The node core (kvpool/node/core.py): what both transports do with the store, against a real arena."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvpool.checksum import block_checksum
from kvpool.keys import opaque_key, pack_keys
from kvpool.node.core import NodeCore
from kvpool.tiers.dram import DramStore
from kvpool.tiers.node_store import NodeStore
from kvpool.tiers.ssd import SsdStore

SLOT = 64 << 10


@pytest.fixture
def store(arena_name):
    s = NodeStore(DramStore.create(arena_name, 4 * SLOT, SLOT, high_watermark=1.0, low_watermark=1.0))
    yield s
    s.close()


@pytest.fixture
def core(store):
    return NodeCore(store, max_keys_per_call=8)


def block(i: int, n: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


def test_a_dram_row_read_through_the_core_is_that_block_until_its_slot_is_reused(core, store):
    """The seqlock check: (slot, gen) from locate names the block until the row is reused; end_read says so and
    counts the read as a hit (intact) or a miss (reused)."""
    k, v = opaque_key("core-0"), block(0, 1000)
    assert core.put([k], [v], [block_checksum(v)]) == [True]
    (ref,) = core.locate([k], promote=False)
    slot, gen, size = ref.slot, ref.gen, ref.length
    assert (size, ref.checksum) == (1000, block_checksum(v))
    assert bytes(core.block_bytes(slot, size)) == v.tobytes()
    before = store.dram.stats()
    row = (np.array([slot]), np.array([gen], np.uint64), np.array([size], np.uint64))
    assert core.end_read(*row).tolist() == [True]
    assert core.remove([k, k]) == 1  # named twice, held once
    others = [opaque_key(f"core-{i}") for i in range(1, 5)]  # the next put reuses the freed row
    assert core.put(others, [block(i, 500) for i in range(1, 5)], None) == [True] * 4
    assert core.locate([k], promote=False) == [None]
    assert core.end_read(*row).tolist() == [False]
    after = store.dram.stats()
    assert (after.hits - before.hits, after.misses - before.misses, after.bytes_out - before.bytes_out) == (1, 1, 1000)


def test_keys_and_sizes_are_refused_before_anything_changes(core):
    with pytest.raises(ValueError, match="9 keys in one request; the limit is 8"):
        core.keys(pack_keys([opaque_key(f"k{i}") for i in range(9)]))
    with pytest.raises(ValueError, match="whole number"):
        core.keys(b"x" * 33)
    with pytest.raises(ValueError, match="0 bytes"):
        core.check_sizes([10, 0])
    with pytest.raises(ValueError, match="fits neither"):
        core.check_sizes([SLOT + 1])  # no SSD tier here
    core.check_sizes([1, SLOT])


def test_the_core_names_the_arena_and_the_largest_block_its_transports_may_offer(core, arena_name, tmp_path):
    """What Locate, Reserve and Info reply with comes from the core (the transports never see the store)."""
    assert core.arena_name == arena_name and core.dram_max_block_bytes == SLOT
    ssd = SsdStore(str(tmp_path / "ssd"), capacity_bytes=16 << 20)
    with_ssd = NodeStore(DramStore.create(arena_name + "-ssd", 4 * SLOT, SLOT), ssd)
    try:
        NodeCore(with_ssd, max_keys_per_call=8).check_sizes([SLOT + 1])  # SSD takes it
        with pytest.raises(ValueError, match=f"fits neither DRAM .* nor SSD store {re.escape(str(ssd.path))}"):
            NodeCore(with_ssd, max_keys_per_call=8).check_sizes([64 << 20])
    finally:
        with_ssd.close()


def test_a_reservation_leases_slots_for_new_blocks_only_and_commit_checks_the_slot_not_the_bytes(core, store):
    held, new, big = opaque_key("held"), opaque_key("new"), opaque_key("big")
    v = block(9, 2000)
    assert core.put([held], [v], None) == [True]
    leased = core.reserve([held, new, big], [2000, 2000, SLOT + 1], None)
    assert leased.held == [True, False, False] and list(leased.slots) == [1]  # too large for a slot: none
    slot, gen = leased.slots[1]
    assert gen % 2 == 1 and store.dram.leased_slots == 1
    core.block_bytes(slot, 2000)[:] = v
    assert core.commit(leased.lease, [held], [slot], [block_checksum(v)]) == [False]  # not the slot of that key
    assert core.where([new]) == [None] and store.dram.leased_slots == 0
    leased = core.reserve([new], [2000], None)
    slot, _ = leased.slots[0]
    core.block_bytes(slot, 2000)[:] = v
    assert core.commit(leased.lease, [new], [slot], [block_checksum(v)]) == [True]
    assert core.sizes([new, big]) == [(2000, block_checksum(v)), None]


def test_a_request_lease_ends_with_its_request_committed_or_not(core, store):
    """The wire PUT's lease: committed blocks are stored and the lease ends; a request that fails before its
    commit leaves no slot leased."""
    a, b = opaque_key("req-a"), opaque_key("req-b")
    va, vb = block(20, 3000), block(21, 3000)
    with pytest.raises(RuntimeError, match="peer went away"), core.request_lease([a], [3000]) as leased:
        assert list(leased.slots) == [0] and store.dram.leased_slots == 1
        raise RuntimeError("peer went away")  # before the commit
    assert store.dram.leased_slots == 0 and core.where([a]) == [None]
    with core.request_lease([a, b], [3000, 3000]) as leased:
        for i, v in enumerate((va, vb)):
            core.block_bytes(leased.slots[i][0], 3000)[:] = v
        stored = core.commit_request(leased, [a, b], [3000, 3000], [block_checksum(va), block_checksum(vb) ^ 1])
        assert stored == {0: True, 1: False} and leased.lease == 0  # b torn on its way in: hashed here, refused
    assert store.dram.leased_slots == 0
    assert core.sizes([a, b]) == [(3000, block_checksum(va)), None]
