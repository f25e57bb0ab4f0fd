"""PoolRun and LookupResult: a lookup's blocks as columns, and the prefix invariant."""

from __future__ import annotations

import numpy as np
import pytest
from client_fakes import block, key, node, run_of

from kvpool.checksum import block_checksum
from kvpool.client.lookup import EMPTY_RUN, BlockLocation, LookupResult, PoolRun
from kvpool.vocabulary import Tier


def test_columns_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="different lengths"):
        PoolRun([key(1), key(2)], bytes([1, 1]), [0, 0], [node()], [10], [1, 2])


def test_indexing_builds_the_location_of_one_block_from_the_columns():
    a, b = node("a"), node("b")
    blocks = [block(i, 100 + i) for i in range(3)]
    run = PoolRun([key(i) for i in range(3)], bytes([1, 2, 1]), [1, 0, 1], [a, b], [x.size for x in blocks],
                  [block_checksum(x) for x in blocks])
    assert len(run) == 3
    assert run[1] == BlockLocation(key(1), Tier.SSD, a, 101, block_checksum(blocks[1]))
    assert [loc.node for loc in run] == [b, a, b]
    assert run.count(Tier.DRAM) == 2 and run.count(Tier.SSD) == 1


def test_a_slice_is_a_run_over_the_same_nodes():
    a, b = node("a"), node("b")
    blocks = [block(i, 10) for i in range(4)]
    run = run_of([key(i) for i in range(4)], blocks, [a, b], [0, 1, 1, 0])
    part = run[1:3]
    assert isinstance(part, PoolRun) and len(part) == 2
    assert part.nodes is run.nodes
    assert [loc.key for loc in part] == [key(1), key(2)] and [loc.node for loc in part] == [b, b]


def test_of_turns_locations_into_columns_with_each_node_once_and_keeps_a_run_as_it_is():
    a, b = node("a"), node("b")
    locations = [BlockLocation(key(i), Tier.DRAM, n, 8, i) for i, n in enumerate([a, b, a])]
    run = PoolRun.of(locations)
    assert list(run.nodes) == [a, b] and run.node_indexes.tolist() == [0, 1, 0]
    assert list(run) == locations
    assert run.sizes.dtype == np.uint64 and run.checksums.tolist() == [0, 1, 2]
    assert PoolRun.of(run) is run
    assert len(PoolRun.of([])) == 0 and len(EMPTY_RUN) == 0


def test_a_lookup_result_counts_hits_per_tier_and_refuses_a_run_longer_than_the_request():
    blocks = [block(i, 10) for i in range(3)]
    run = PoolRun([key(i) for i in range(3)], bytes([1, 1, 2]), [0] * 3, [node()], [10] * 3,
                  [block_checksum(b) for b in blocks])
    result = LookupResult(requested=6, hbm_blocks=2, pool=run)
    assert (result.hit_blocks, result.miss_blocks) == (5, 1)
    assert result.by_tier() == {"hbm": 2, "dram": 2, "ssd": 1}
    with pytest.raises(AssertionError):
        LookupResult(requested=4, hbm_blocks=2, pool=run)
