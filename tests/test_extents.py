"""The DRAM arena's offset allocator: extents never overlap, frees merge, one block size packs exactly."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvpool.tiers.extents import GRANULE, ExtentAllocator, units_for


def test_random_allocs_and_frees_never_overlap_and_merge_back_to_one_extent():
    rng = random.Random(7)
    total = 10_000
    alloc = ExtentAllocator(total)
    owner = np.zeros(total, dtype=np.int32)  # 0: free; else the id of the extent holding the unit
    live: dict[int, tuple[int, int]] = {}
    for step in range(1, 5001):
        if live and rng.random() < 0.45:
            ident = rng.choice(list(live))
            start, n = live.pop(ident)
            assert (owner[start : start + n] == ident).all()
            owner[start : start + n] = 0
            alloc.free(start, n)
        else:
            n = rng.choice([1, 3, 16, 17, 64, 250, 1000])
            start = alloc.alloc(n)
            if start is None:
                # refused only when no free run is sure to fit: all shorter than the power of two >= n (runs
                # between n and that are in the bin it scans partly, good fit rather than first fit)
                edges = np.flatnonzero(np.diff(np.concatenate(([1], owner != 0, [1])).astype(np.int8)))
                runs = edges[1::2] - edges[::2]
                assert runs.size == 0 or runs.max() < 1 << (n - 1).bit_length(), (n, runs.max())
                continue
            assert (owner[start : start + n] == 0).all(), "handed out units that are in use"
            owner[start : start + n] = step
            live[step] = (start, n)
        assert alloc.free_units == int((owner == 0).sum())
        if step % 500 == 0:
            alloc.check()
    for start, n in live.values():
        alloc.free(start, n)
    alloc.check()
    assert alloc.free_units == total and alloc.largest_free() == total  # everything merged back


def test_one_block_size_packs_exactly_and_reuses_freed_extents():
    block = units_for(7 << 20)
    alloc = ExtentAllocator(block * 9)
    starts = [alloc.alloc(block) for _ in range(9)]
    assert None not in starts and alloc.alloc(block) is None and alloc.free_units == 0
    alloc.free(starts[4], block)
    assert alloc.alloc(block) == starts[4]


def test_units_round_up_to_the_granule_and_misuse_is_refused():
    assert units_for(1) == 1 and units_for(GRANULE) == 1 and units_for(GRANULE + 1) == 2
    alloc = ExtentAllocator(8)
    with pytest.raises(ValueError):
        alloc.alloc(0)
    assert alloc.alloc(9) is None
    start = alloc.alloc(4)
    with pytest.raises(AssertionError, match="overlaps a free extent"):
        alloc.free(start + 4, 2)  # never handed out
    with pytest.raises(AssertionError, match="outside"):
        alloc.free(6, 4)
