"""The node core (kvpool/node/core.py): what both transports do with the store, against a real arena."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.checksum import block_checksum
from kvpool.keys import opaque_key, pack_keys
from kvpool.node.core import NodeCore
from kvpool.tiers.dram import DramStore
from kvpool.tiers.node_store import NodeStore

SLOT = 64 << 10


@pytest.fixture
def core(arena_name):
    store = NodeStore(DramStore.create(arena_name, 4 * SLOT, SLOT, high_watermark=1.0, low_watermark=1.0))
    c = NodeCore(store, max_keys_per_call=8)
    yield c
    store.close()


def block(i: int, n: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


def test_a_dram_row_read_through_the_core_is_that_block_until_its_slot_is_reused(core):
    """The seqlock check: (slot, gen) from locate names the block until the row is reused; intact says so."""
    k, v = opaque_key("core-0"), block(0, 1000)
    assert core.put([k], [v], [block_checksum(v)]) == [True]
    (ref,) = core.locate([k], promote=False)
    slot, gen, size = ref.slot, ref.gen, ref.length
    assert (size, ref.checksum) == (1000, block_checksum(v))
    assert bytes(core.block_bytes(slot, size)) == v.tobytes()
    assert core.intact(np.array([slot]), np.array([gen], np.uint64)).tolist() == [True]
    core.store.remove([k])
    others = [opaque_key(f"core-{i}") for i in range(1, 5)]  # the next put reuses the freed row
    assert core.put(others, [block(i, 500) for i in range(1, 5)], None) == [True] * 4
    assert core.locate([k], promote=False) == [None]
    assert core.intact(np.array([slot]), np.array([gen], np.uint64)).tolist() == [False]


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


def test_a_reservation_leases_slots_for_new_blocks_only_and_commit_checks_their_bytes(core):
    held, new, big = opaque_key("held"), opaque_key("new"), opaque_key("big")
    v = block(9, 2000)
    assert core.put([held], [v], None) == [True]
    leased = core.reserve([held, new, big], [2000, 2000, SLOT + 1], None)
    assert leased.held == [True, False, False] and list(leased.slots) == [1]  # too large for a slot: none
    slot, gen = leased.slots[1]
    assert gen % 2 == 1 and core.store.dram.leased_slots == 1
    core.block_bytes(slot, 2000)[:] = v
    assert core.commit(leased.lease, [new], [slot], [block_checksum(v) ^ 1]) == [False]  # bytes do not match
    assert core.store.where([new]) == [None] and core.store.dram.leased_slots == 0
    leased = core.reserve([new], [2000], None)
    slot, _ = leased.slots[0]
    core.block_bytes(slot, 2000)[:] = v
    assert core.commit(leased.lease, [new], [slot], [block_checksum(v)]) == [True]
    assert core.sizes([new, big]) == [(2000, block_checksum(v)), None]
