"""`kvpool bench fragmentation`: one block size packs DRAM exactly; mixed sizes still use most of it; a large put
among small holes evicts about its own size."""

from __future__ import annotations

from kvpool.bench.fragmentation import MIB, run_hot_spread, run_mix


def test_one_size_fills_dram_to_the_last_whole_block_and_mixed_sizes_keep_most_of_it():
    one = run_mix("one-size", 64 * MIB, 2.5)
    assert one.refused == 0 and one.evictions > 0
    assert abs(one.usable_mean - (64 // 7) * 7 / 64) < 0.01  # 9 blocks of 7 MiB: every whole block, always
    mixed = run_mix("five-models", 64 * MIB, 2.5)
    assert mixed.refused == 0 and mixed.evictions > 0
    assert 0.6 < mixed.usable_mean <= 1.0


def test_hot_spread_a_1_mib_put_among_4_kib_holes_evicts_about_1_mib():
    """Issue 26: 16 MiB free in 4 KiB holes of a 64 MiB arena, LRU order scattered, 1,000 hot blocks spread across
    it. Before: the first 1 MiB put evicted 46 MiB, 488 hot blocks among them."""
    r = run_hot_spread(64 * MIB, hot=1000, puts=8)
    assert r.free_bytes == 16 * MIB and r.refused == 0
    assert r.ratio_mean <= 1.0 and max(r.evicted_ratio) <= 1.0, r.evicted_ratio
    # 1,000 hot among 12,288 blocks: every 1 MiB run (256 cells, 192 blocks) holds ~16 of them; the cheapest few
    share = 256 * r.hot / r.blocks
    assert max(r.hot_evicted) <= 2 * share, (r.hot_evicted, share)
