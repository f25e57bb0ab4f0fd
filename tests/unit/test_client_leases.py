"""Unit tests of the lease-ahead stock (client/leases.py) over a real arena, no servers."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.client.leases import STOCK_BYTES, STOCK_MAX_BYTES, STOCK_SLOTS, StockShelf, ahead_sizes
from kvpool.tiers.arena import SharedArena
from kvpool.v1 import node_pb2

UNIT = 4096
NODE = "127.0.0.1:1"


@pytest.fixture
def arena(arena_name):
    a = SharedArena.create(arena_name, 64 * UNIT, 64)
    yield a
    a.close()


def leased(arena: SharedArena, slots: list[int], lease: int = 7, timeout_s: float = 60.0) -> node_pb2.ReserveResponse:
    """What a node's Commit brings back as ``next``: ``slots`` claimed (odd gens) at one unit each."""
    gens = [arena.claim(s, s * UNIT) for s in slots]
    return node_pb2.ReserveResponse(lease=lease, arena=arena.name, slots=slots, slot_gens=gens,
                                    lease_timeout_s=timeout_s)


def test_ahead_sizes_repeat_the_put_up_to_the_stock_bytes_or_the_put_itself():
    assert ahead_sizes([UNIT]) == [UNIT] * (STOCK_BYTES // UNIT)
    assert ahead_sizes([3 * STOCK_BYTES]) == [3 * STOCK_BYTES]  # one block at least
    big = [STOCK_BYTES // 2] * 6
    assert ahead_sizes(big) == big  # a put larger than a stock: its own sizes once
    assert sum(ahead_sizes([STOCK_MAX_BYTES // 4] * 8)) == STOCK_MAX_BYTES
    assert len(ahead_sizes([1])) == STOCK_SLOTS


def test_lease_hands_out_slots_of_exactly_the_size_asked_once_each(arena):
    shelf = StockShelf()
    shelf.keep(NODE, arena, leased(arena, [1, 2, 3]), [UNIT, UNIT, 2 * UNIT])
    assert shelf.slots_at(NODE) == 3
    got = shelf.lease(NODE, arena, [UNIT, 2 * UNIT, 3 * UNIT])
    assert [g is not None for g in got] == [True, True, False]  # no slot of 3 units was leased
    assert {(g.slot, g.size, g.offset, g.lease) for g in got if g is not None} <= \
        {(2, UNIT, 2 * UNIT, 7), (1, UNIT, UNIT, 7), (3, 2 * UNIT, 3 * UNIT, 7)}
    assert all(g.ours() and not g.reserved for g in got if g is not None)
    assert shelf.slots_at(NODE) == 1
    again = shelf.lease(NODE, arena, [UNIT, UNIT])
    assert again[0] is not None and again[1] is None and shelf.slots() == 0
    assert {again[0].slot, got[0].slot} == {1, 2}  # never the same slot twice


def test_a_slot_the_node_took_back_or_of_another_mapping_is_not_handed_out(arena, arena_name):
    shelf = StockShelf()
    shelf.keep(NODE, arena, leased(arena, [1, 2]), [UNIT, UNIT])
    arena.gens[1] += 2  # the node reclaimed slot 1 and leased it to someone else
    got = shelf.lease(NODE, arena, [UNIT, UNIT])
    assert [g.slot if g else None for g in got].count(1) == 0 and sum(g is not None for g in got) == 1
    other = SharedArena.create(arena_name + "-b", 8 * UNIT, 8)
    try:
        shelf.keep(NODE, arena, leased(arena, [5]), [UNIT])
        assert shelf.lease(NODE, other, [UNIT]) == [None]  # a restarted node's new segment: the stock is dropped
        assert shelf.slots_at(NODE) == 0
    finally:
        other.close()


def test_a_stock_past_half_its_lease_timeout_is_not_used(arena):
    shelf = StockShelf()
    shelf.keep(NODE, arena, leased(arena, [1], timeout_s=-1.0), [UNIT])  # its use-by time is past already
    assert shelf.lease(NODE, arena, [UNIT]) == [None]


def test_keep_ignores_replies_that_grant_nothing_or_disagree(arena):
    shelf = StockShelf()
    shelf.keep(NODE, arena, node_pb2.ReserveResponse(), [UNIT])
    shelf.keep(NODE, arena, node_pb2.ReserveResponse(lease=1, arena="other", slots=[1], slot_gens=[3]), [UNIT])
    shelf.keep(NODE, arena, node_pb2.ReserveResponse(lease=1, arena=arena.name, slots=[1, 2], slot_gens=[3, 5]),
               [UNIT])  # more slots than asked
    shelf.keep(NODE, arena, node_pb2.ReserveResponse(lease=1, arena=arena.name, slots=[1], slot_gens=[0]), [UNIT])
    assert shelf.slots() == 0


def test_drop_forgets_one_lease_and_clear_returns_the_rest(arena):
    shelf = StockShelf()
    shelf.keep(NODE, arena, leased(arena, [1], lease=1), [UNIT])
    shelf.keep(NODE, arena, leased(arena, [2], lease=2), [UNIT])
    shelf.drop(NODE, 1)
    got = shelf.lease(NODE, arena, [UNIT])
    assert got[0] is not None and got[0].lease == 2
    shelf.keep(NODE, arena, leased(arena, [3], lease=3), [UNIT])
    assert [(a, st.lease) for a, st in shelf.clear()] == [(NODE, 3)] and shelf.slots() == 0


def test_a_leased_slot_view_is_its_extent(arena):
    shelf = StockShelf()
    shelf.keep(NODE, arena, leased(arena, [4]), [UNIT])
    slot = shelf.lease(NODE, arena, [UNIT])[0]
    assert slot is not None
    slot.view()[:] = 9
    assert np.all(arena.data[4 * UNIT : 5 * UNIT] == 9) and arena.data[5 * UNIT] == 0
