"""White-box checks of product data structures, kept out of the product: only tests run them.

:func:`check_index` asserts :class:`kvpool.master.index.BlockIndex`'s invariants (its module docstring) by
reading its internals, the one place outside the class that does, so a change to its layout changes this
function and no test. O(index size).
"""

from __future__ import annotations

import numpy as np

from kvpool.master import index as index_module
from kvpool.master.index import BlockIndex

_NODE_BITS = index_module._NODE_BITS
_NODE_MASK = index_module._NODE_MASK
_MORE = index_module._MORE
_TIERS = len(index_module._TIERS)


def check_index(index: BlockIndex) -> int:
    """Assert the index's invariants; returns its copies: (key, node, tier) locations over all keys."""
    with index._lock:
        t = index._table
        t.check()
        live = t.live_rows()
        loc1, loc2 = t.rec["loc1"][live], t.rec["loc2"][live]
        assert (loc1 >> _NODE_BITS < _TIERS).all(), "BlockIndex: a row without a best location"
        two = loc2 < _MORE
        assert (loc1[two] < loc2[two]).all(), "BlockIndex: two locations not distinct and best-first"
        listed = live[loc2 == _MORE]
        more = index._more
        listed_keys = set(zip(t.k0[listed].tolist(), t.k1[listed].tolist()))
        assert listed_keys == set(more), "BlockIndex: _MORE rows and _more disagree"
        copies = live.size + int(np.count_nonzero(two))
        held = set(np.unique(loc1 & _NODE_MASK).tolist()) | set(np.unique(loc2[two] & _NODE_MASK).tolist())
        for row, (key, locs) in zip(index._rows_of(more).tolist(), more.items()):
            assert len(locs) >= 3, f"BlockIndex: key {key} listed in _more with {len(locs)} locations"
            assert all(a < b for a, b in zip(locs, locs[1:])), "BlockIndex: unsorted or duplicate locations"
            assert locs[0] == t.rec["loc1"][row] and locs[-1] >> _NODE_BITS < _TIERS, "BlockIndex: bad _more"
            copies += len(locs) - 1
            held.update(loc & int(_NODE_MASK) for loc in locs)
        assert held <= index._open, f"BlockIndex: entries on closed node numbers {sorted(held - index._open)}"
        _check_node_keys(index, live)
        return copies


def _check_node_keys(index: BlockIndex, live: np.ndarray) -> None:
    """Every (key, node) location is in that node's NodeKeys list; lists exist for open numbers only (lock held)."""
    lists = index._node_keys._lists
    assert set(lists) == index._open, "BlockIndex: NodeKeys lists and open node numbers disagree"
    listed = {node: set(zip(*(a.tolist() for a in index._node_keys.keys(node)))) for node in lists}
    t = index._table
    for row in live.tolist():
        key = t.key(row)
        loc1, loc2 = int(t.rec["loc1"][row]), int(t.rec["loc2"][row])
        locs = index._more[key] if loc2 == _MORE else [loc1] + ([loc2] if loc2 < _MORE else [])
        for loc in locs:
            assert key in listed[loc & int(_NODE_MASK)], f"BlockIndex: key {key} missing from its node's NodeKeys"


def index_nbytes(index: BlockIndex) -> int:
    """Bytes held by the index's table columns (the multi-location dict not counted)."""
    with index._lock:
        return index._table.nbytes()
