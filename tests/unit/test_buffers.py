"""ScratchPool: reusable temporaries, smallest fitting buffer first, bounded idle bytes."""

from __future__ import annotations

import numpy as np

from kvpool.buffers import ScratchPool


def test_buffers_are_reused_smallest_fitting_first():
    pool = ScratchPool(4096)
    a, b = pool.take(1000), pool.take(2000)
    assert (a.size, b.size, a.dtype) == (1000, 2000, np.uint8)
    pool.give(a)
    pool.give(b)
    c = pool.take(1500)
    assert c.size == 1500 and np.shares_memory(c, b)  # the 2000-byte one: the smallest that fits
    d = pool.take(900)
    assert np.shares_memory(d, a)
    e = pool.take(3000)
    assert not np.shares_memory(e, a) and not np.shares_memory(e, b)  # none fits: a new one


def test_idle_buffers_stay_within_the_bound():
    pool = ScratchPool(4096)
    kept, dropped = np.empty(3000, np.uint8), np.empty(2000, np.uint8)
    pool.give(kept)
    pool.give(dropped)  # 3000 + 2000 > 4096: not kept
    assert np.shares_memory(pool.take(1500), kept)
    assert not np.shares_memory(pool.take(1500), dropped)
