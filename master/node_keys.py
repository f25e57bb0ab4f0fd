"""Per node number, the keys it was reported holding: what lets dropping a node cost that node's blocks.

:class:`NodeKeys` keeps, for each open node number of a
:class:`~kvpool.master.index.BlockIndex`, a growable numpy array of the keys
(their first 16 bytes as two uint64 words, as the index keys them) that reports
linked to that node, in any tier. Dropping the node, or replacing one of its
tiers by a full sync, then looks these keys up instead of scanning every row.

Invariants (the owner serialises all calls; this class has no lock):

- **Superset.** Every key the index holds on node ``n`` is in ``n``'s list.
  The list may also hold keys ``n`` no longer holds (removed since, or refused
  by a full table) and the same key several times: removals do not touch it.
- **Lazily compacted, bounded.** When an append would overflow a list's
  array, the list is first compacted: each key kept once, and only if the
  owner's ``held`` says the node still holds it. The array then grows by
  :data:`GROWTH` only if the compacted list plus the append would fill more
  than ``1 / GROWTH`` of it. So an array holds at most ``GROWTH`` times (plus
  the one append) the keys its node held at the last compaction, and each
  compaction (O(list) work) follows at least ``capacity * (1 - 1 / GROWTH)``
  appended keys: O(1) amortised per reported location.
- Memory: 16 bytes a slot; an array has at most ``GROWTH`` times as many slots
  as its node held keys at its last compaction (plus one append), ~24 bytes
  per (key, node) location at steady state. It does not shrink when a node's
  blocks go (it follows the node's peak); it goes with the node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

U64 = npt.NDArray[np.uint64]
Held = Callable[[int, U64, U64], tuple[U64, U64]]  # (node, k0, k1) -> the distinct ones node still holds

GROWTH = 1.5
MIN_CAPACITY = 1024


@dataclass(slots=True)
class _List:
    words: U64  # (capacity, 2): k0, k1 per slot; rows [0, size) are used
    size: int = 0


class NodeKeys:
    """Node number -> a superset of the keys it holds (see the module docstring)."""

    def __init__(self, held: Held) -> None:
        """``held(node, k0, k1)``: of these keys, the distinct ones ``node`` still holds (the owner's truth, for
        compaction)."""
        self._held = held
        self._lists: dict[int, _List] = {}

    def open(self, node: int) -> None:
        self._lists[node] = _List(np.empty((0, 2), np.uint64))

    def append(self, node: int, k0: U64, k1: U64) -> None:
        """Note that ``node`` now holds these keys (duplicates are fine)."""
        lst = self._lists[node]
        n = len(k0)
        if lst.size + n > len(lst.words):
            self._compact(node, lst)
            need = lst.size + n
            if need * GROWTH > len(lst.words):
                grown = np.empty((max(MIN_CAPACITY, int(need * GROWTH)), 2), np.uint64)
                grown[: lst.size] = lst.words[: lst.size]
                lst.words = grown
        lst.words[lst.size : lst.size + n, 0] = k0
        lst.words[lst.size : lst.size + n, 1] = k1
        lst.size += n

    def keys(self, node: int) -> tuple[U64, U64]:
        """The node's list (views, valid until the next call); empty for an unknown number."""
        lst = self._lists.get(node)
        if lst is None:
            return np.empty(0, np.uint64), np.empty(0, np.uint64)
        used = lst.words[: lst.size]
        return used[:, 0], used[:, 1]

    def close(self, node: int) -> tuple[U64, U64]:
        """Forget the node's list, returning it (the keys to look up when dropping it)."""
        lst = self._lists.pop(node, None)
        if lst is None:
            return np.empty(0, np.uint64), np.empty(0, np.uint64)
        used = lst.words[: lst.size]
        return used[:, 0], used[:, 1]

    def nbytes(self) -> int:
        """Bytes held by every list's array."""
        return sum(lst.words.nbytes for lst in self._lists.values())

    def _compact(self, node: int, lst: _List) -> None:
        """Keep each key once, and only if the node still holds it."""
        if lst.size == 0:
            return
        used = lst.words[: lst.size]
        k0, k1 = self._held(node, used[:, 0], used[:, 1])
        lst.words[: len(k0), 0] = k0
        lst.words[: len(k0), 1] = k1
        lst.size = len(k0)
