"""The DRAM arena's offset allocator: extents never overlap, frees merge, one block size packs exactly."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvpool.tiers.extents import GRANULE, PINNED, ExtentAllocator, cheapest_windows, units_for


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


# -- the window search (what to evict when no free extent is long enough) --------------------------------------


def _layout(rng: random.Random, total: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random disjoint taken extents of [0, total) in a random order, with costs (some pinned, some tied)."""
    starts, lengths, pos = [], [], 0
    while True:
        pos += rng.choice([0, 0, 0, 1, 2, 5, 9])
        n = rng.choice([1, 1, 2, 3, 4, 8, 13])
        if pos + n > total:
            break
        starts.append(pos)
        lengths.append(n)
        pos += n
    perm = list(range(len(starts)))
    rng.shuffle(perm)
    costs = [PINNED if rng.random() < 0.08 else rng.randrange(0, 60) for _ in perm]
    return (np.array([starts[i] for i in perm], np.uint32), np.array([lengths[i] for i in perm], np.uint32),
            np.array(costs, np.int64))


def _brute(starts, lengths, costs, total, units, start) -> tuple[int, int, list[int]]:
    """(cost, units evicted, victims) of the run [start, start + units), by looking at every extent."""
    over = [i for i in range(starts.size) if starts[i] < start + units and starts[i] + lengths[i] > start]
    cost = max((int(costs[i]) for i in over), default=-1)
    return cost, sum(int(lengths[i]) for i in over), sorted(over, key=lambda i: int(starts[i]))


def test_the_cheapest_window_is_the_one_a_search_of_every_position_finds():
    rng = random.Random(5)
    for _ in range(300):
        total = rng.randrange(20, 160)
        starts, lengths, costs = _layout(rng, total)
        units = rng.randrange(1, total + 1)
        got = cheapest_windows(starts, lengths, costs, total, units)
        options = [_brute(starts, lengths, costs, total, units, a) for a in range(total - units + 1)]
        best = min(((c, e) for c, e, _ in options if c != PINNED), default=None)
        if best is None:
            assert got == []
            continue
        (w,) = got
        assert (w.cost, w.evicted) == best
        assert _brute(starts, lengths, costs, total, units, w.start)[::2] == (w.cost, list(w.victims))


def test_runs_for_several_blocks_are_exact_disjoint_and_parted_by_a_kept_extent():
    rng = random.Random(9)
    for _ in range(200):
        total = rng.randrange(40, 300)
        starts, lengths, costs = _layout(rng, total)
        units = rng.randrange(1, 40)
        windows = cheapest_windows(starts, lengths, costs, total, units, count=6)
        assert sum(w.blocks for w in windows) <= 6
        if windows:  # the first run is where one block alone would go
            assert windows[0].start == cheapest_windows(starts, lengths, costs, total, units)[0].start
        order = np.argsort(starts)
        rank = {int(i): r for r, i in enumerate(order)}
        spans = []
        for w in windows:
            cost, evicted, victims = _brute(starts, lengths, costs, total, units * w.blocks, w.start)
            assert (cost, evicted, victims) == (w.cost, w.evicted, list(w.victims)) and cost != PINNED
            assert w.start + units * w.blocks <= total
            # what it frees runs from the end of the kept extent before it to the start of the kept one after it
            first = rank[victims[0]] if victims else int(np.searchsorted(starts[order], w.start))
            last = rank[victims[-1]] if victims else first - 1
            spans.append((first - 1, last + 1))  # ranks of the kept extents around it
        for (_, b1), (a2, _) in zip(sorted(spans), sorted(spans)[1:]):
            assert b1 <= a2, "two runs share an extent or touch"


def test_blocks_cheapest_side_by_side_get_one_run():
    """Between two pinned extents, 2 x 8 units of old extents; elsewhere only newer ones. Two blocks of 8: one run
    holding both (separate runs would have to be parted by a kept extent, which leaves room for only one)."""
    starts = np.array([0, 1, 5, 9, 13, 17, 18, 22, 26, 30], np.uint32)
    lengths = np.array([1, 4, 4, 4, 4, 1, 4, 4, 4, 4], np.uint32)
    costs = np.array([PINNED, 1, 2, 3, 4, PINNED, 50, 60, 70, 80], np.int64)
    (w,) = cheapest_windows(starts, lengths, costs, 34, 8, count=2)
    assert (w.start, w.blocks, w.cost, list(w.victims)) == (1, 2, 4, [1, 2, 3, 4])
    one, two = cheapest_windows(starts, lengths, costs, 34, 8, count=3)  # a third block: the newer stretch
    assert (one.blocks, two.start, two.blocks, two.cost) == (2, 18, 1, 60)


def test_a_window_search_past_its_extent_limit_looks_at_the_stretch_around_near(monkeypatch):
    import kvpool.tiers.extents as extents

    monkeypatch.setattr(extents, "WINDOW_EXTENTS", 64)
    n = 1000  # one-unit extents with one-unit holes; the cheap ones (cost 0) are far from `near`
    starts = np.arange(n, dtype=np.uint32) * 2
    costs = np.full(n, 50, np.int64)
    costs[10:20] = 0
    lengths = np.ones(n, np.uint32)
    (w,) = cheapest_windows(starts, lengths, costs, 2 * n, 7, near=1200)
    assert 1200 - 2 * 64 <= w.start and w.start + 7 <= 1200 + 2 * 64 and w.cost == 50
    (w,) = cheapest_windows(starts, lengths, costs, 2 * n, 7, near=30)
    assert w.cost == 0 and 19 <= w.start and w.start + 7 <= 40  # inside the cheap stretch (units 20..39)


def test_alloc_from_merged_run_and_spans_follow_the_free_list():
    alloc = ExtentAllocator(100)
    a, b, c = alloc.alloc(10), alloc.alloc(10), alloc.alloc(10)  # [0,10) [10,20) [20,30), free [30,100)
    assert alloc.merged_run(b, 10) == (10, 10) and alloc.merged_run(c, 10) == (20, 80)
    alloc.free(a, 10)
    assert alloc.merged_run(b, 10) == (0, 20)
    assert alloc.spans(0, 25, [(10, 10), (20, 10)]) and alloc.spans(5, 60, [(10, 10), (20, 10)])
    assert not alloc.spans(0, 25, [(20, 10)])  # [10, 20) is taken and not named
    assert alloc.alloc_from(10, 5) is None and alloc.alloc_from(30, 71) is None
    assert alloc.alloc_from(30, 20) == 30 and alloc.alloc_from(50, 50) == 50
    assert not alloc.spans(25, 40, [(20, 10)])  # [30, 40) was just taken
    alloc.check()
    assert alloc.free_units == 10


def test_would_hold_counts_freed_extents_merged_with_their_free_neighbours():
    alloc = ExtentAllocator(100)
    for _ in range(10):
        alloc.alloc(10)  # ten 10-unit extents, nothing free
    alloc.free(20, 10)  # free: [20, 30)
    assert alloc.would_hold([10, 10], [(30, 10)])  # the freed extent holds one, the free one the other
    assert not alloc.would_hold([10, 10, 10], [(30, 10)])
    assert alloc.would_hold([20], [(10, 10)]) and not alloc.would_hold([21], [(10, 10)])  # [10, 30), freed
    assert alloc.would_hold([30], [(10, 10), (30, 10)])  # [10, 40): both freed, the free one between
    assert not alloc.would_hold([30], [(10, 10), (50, 10)])
    assert alloc.would_hold([], []) and alloc.would_hold([10], []) and not alloc.would_hold([11], [])
    alloc.check()
