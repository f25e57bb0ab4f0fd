"""The interface every tier implements, and the failure vocabulary they share (the data vocabulary is kvpool.core).

Failure vocabulary (the same in every tier):
- caller misuse (malformed key, value of the wrong size, read-only output) is a
  ValueError raised *before* anything changes;
- "no room", "not here", "evicted under you", "checksum mismatch" are ``False``
  in the returned list: a miss, counted in :class:`TierStats`;
- a broken internal invariant is an AssertionError naming the component.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

from kvpool.core import BlockMeta, Tier, TierStats
from kvpool.keys import BlockKey

Buf = TypeVar("Buf", contravariant=True)


class TierStore(Protocol, Generic[Buf]):
    """A batched key -> block store. Single-key calls are wrappers, not extra methods.

    ``get_into`` copies into caller-owned buffers and returns per-key hit flags;
    a False entry leaves that output's contents unspecified (the caller recomputes).
    ``contains`` never changes recency: looking does not keep a block alive.
    """

    tier: Tier

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]: ...

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[Buf]) -> list[bool]: ...

    def put(self, keys: Sequence[BlockKey], values: Sequence[Buf]) -> list[bool]: ...

    def remove(self, keys: Sequence[BlockKey]) -> int: ...

    def stats(self) -> TierStats: ...

    def close(self) -> None: ...


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
