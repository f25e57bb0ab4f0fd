"""`kvpool bench fragmentation`: one block size packs DRAM exactly; mixed sizes still use most of it."""

from __future__ import annotations

from kvpool.bench.fragmentation import MIB, run_mix


def test_one_size_fills_dram_to_the_last_whole_block_and_mixed_sizes_keep_most_of_it():
    one = run_mix("one-size", 64 * MIB, 2.5)
    assert one.refused == 0 and one.evictions > 0
    assert abs(one.usable_mean - (64 // 7) * 7 / 64) < 0.01  # 9 blocks of 7 MiB: every whole block, always
    mixed = run_mix("five-models", 64 * MIB, 2.5)
    assert mixed.refused == 0 and mixed.evictions > 0
    assert 0.6 < mixed.usable_mean <= 1.0
