"""What every tier shares: the failure vocabulary, the change listener and the eviction sink.

Failure vocabulary (the same in every tier):
- caller misuse (malformed key, value of the wrong size, read-only output) is a
  ValueError raised *before* anything changes;
- "no room", "not here", "evicted under you", "checksum mismatch" are ``False``
  in the returned list: a miss, counted in :class:`TierStats`;
- a broken internal invariant is an AssertionError naming the component.

Every tier (:class:`~kvpool.tiers.dram.DramStore`, :class:`~kvpool.tiers.ssd.SsdStore`,
the client's :class:`~kvpool.client.hbm.HbmStore`) answers the same few batched
calls (``contains``, ``get_into``, ``put``, ``remove``, ``stats``, ``close``;
single-key calls are wrappers, not extra methods; ``contains`` never changes
recency; a False from ``get_into`` leaves that output's contents unspecified),
but there is no ``TierStore`` protocol over them, on purpose: nothing composes
tiers generically. :class:`~kvpool.tiers.node_store.NodeStore` is DRAM in
front of SSD, and every one of its steps needs what only one of the two has
(DRAM's leases, slot refs and arena inventory; SSD's metadata, fit and the
demotion queue in front of it), so typing it against a generic tier list
would add a layer and remove no branch. A second node tier, or tiers chosen
by configuration, is when such an interface earns its place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvpool.keys import BlockKey
from kvpool.vocabulary import BlockMeta

# Called by a store after each batch that changed its key set, with the blocks
# it gained (committed puts, promotions) and the keys it lost (evictions,
# demotions, removes, corrupt deletions). Called outside the store's locks, in
# the thread that made the change, after the change is visible; listeners must
# be quick and must not raise. Two batches from different threads may arrive in
# either order, so a listener that needs the current truth re-checks
# ``contains`` (see kvpool.node.master_link).
ChangeListener = Callable[[Sequence[BlockMeta], Sequence[BlockKey]], None]


def notify(listener: ChangeListener | None, added: Sequence[BlockMeta], removed: Sequence[BlockKey], who: str) -> None:
    """Call ``listener`` if there is one and anything changed; a failing listener is logged, not raised."""
    if listener is None or not (added or removed):
        return
    try:
        listener(added, removed)
    except Exception:  # bookkeeping must never fail a store operation
        logging.getLogger(__name__).exception("%s: on_change listener failed", who)


# Called with (keys, byte views of their data, their checksums) when a tier
# evicts blocks that a lower tier should keep. The views are valid only
# during the call.
EvictionSink = Callable[[Sequence[BlockKey], Sequence[memoryview], Sequence[int]], None]


def check_batch(keys: Sequence[object], values: Sequence[object]) -> None:
    """ValueError unless ``keys`` and ``values`` are sequences of the same length."""
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys but {len(values)} buffers")
