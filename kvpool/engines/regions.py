"""Registered memory: raw addresses from an engine, turned into memory only inside regions it registered.

vllm-ascend's store backends are handed raw pointers (each layer's K/V cache
base plus a block offset). Dereferencing any integer an engine passes would be
a wild read or write, so:

Invariants:
- Only a range ``[addr, addr + size)`` wholly inside one registered region is
  ever turned into memory; anything else is refused (None) and never touched.
- Registration is all or nothing: a batch with a bad entry (not a positive
  integer pointer and length, or partly overlapping a registered region)
  registers nothing. Registering a region again, or one inside a registered
  region, changes nothing.
- A host region (``host=True``) gets one numpy view, made once (ctypes
  ``from_address``); pieces are slices of it: no copy and no ctypes work per
  call. A device region (GPU or NPU memory, ``host=False``) gets no view and
  is never dereferenced here: :meth:`RegisteredMemory.piece` only checks
  bounds, and :mod:`.device_copy` moves its bytes.
- Lookups read an immutable snapshot, so registering during transfers is safe.
"""

from __future__ import annotations

import bisect
import ctypes
import operator
import threading
from collections.abc import Sequence
from typing import SupportsIndex, cast

import numpy as np

_MAX_ADDRESS = 1 << 64


def _as_int(value: object) -> int | None:
    """An integer (Python or numpy; not bool) as int, else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(cast(SupportsIndex, value))  # anything else raises TypeError, caught here
    except TypeError:
        return None


class RegisteredMemory:
    """Host memory regions an engine registered, and views of ranges inside them (see module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (starts, regions) replaced as a whole: regions are sorted, disjoint (start, end, view)
        self._snapshot: tuple[tuple[int, ...], tuple[tuple[int, int, np.ndarray | None], ...]] = ((), ())

    @property
    def regions(self) -> list[tuple[int, int]]:
        """Registered ``(address, length)`` pairs, by address."""
        return [(start, end - start) for start, end, _ in self._snapshot[1]]

    def register(self, ptrs: object, lengths: object, host: bool = True) -> bool:
        """Register each ``(ptrs[i], lengths[i])`` region; False (nothing registered) if any entry is bad.

        ``host`` says the memory is host-addressable (views are made); device memory gets none.
        """
        if not isinstance(ptrs, Sequence) or not isinstance(lengths, Sequence) or len(ptrs) != len(lengths):
            return False
        pairs: list[tuple[int, int]] = []
        for p, n in zip(ptrs, lengths):
            ptr, length = _as_int(p), _as_int(n)
            if ptr is None or length is None or ptr <= 0 or length <= 0 or ptr + length > _MAX_ADDRESS:
                return False
            pairs.append((ptr, length))
        with self._lock:
            spans = [(start, end) for start, end, _ in self._snapshot[1]]
            new: list[tuple[int, int]] = []
            for ptr, length in pairs:
                end = ptr + length
                if any(s <= ptr and end <= e for s, e in spans + new):
                    continue  # already registered (or inside a registered region)
                if any(ptr < e and s < end for s, e in spans + new):
                    return False  # partial overlap: ambiguous, refuse the batch
                new.append((ptr, end))
            if not new:
                return True
            regions = list(self._snapshot[1])
            for start, end in new:
                view = np.ctypeslib.as_array((ctypes.c_uint8 * (end - start)).from_address(start)) if host else None
                regions.append((start, end, view))
            regions.sort(key=lambda r: r[0])
            self._snapshot = (tuple(r[0] for r in regions), tuple(regions))
        return True

    def _find(self, addr: object, size: object) -> tuple[int, int, int, np.ndarray | None] | None:
        """(addr, size, region start, region view) if ``[addr, addr + size)`` lies inside one region, else None."""
        start_addr, nbytes = _as_int(addr), _as_int(size)
        if start_addr is None or nbytes is None or nbytes <= 0:
            return None
        starts, regions = self._snapshot
        i = bisect.bisect_right(starts, start_addr) - 1
        if i < 0:
            return None
        start, end, view = regions[i]
        if start_addr + nbytes > end:
            return None
        return start_addr, nbytes, start, view

    def piece(self, addr: object, size: object) -> tuple[int, int] | None:
        """``(addr, size)`` as ints if the range lies inside one registered region (host or device), else None."""
        found = self._find(addr, size)
        return None if found is None else (found[0], found[1])

    def view(self, addr: object, size: object) -> np.ndarray | None:
        """A writable uint8 view of ``[addr, addr + size)`` if it lies inside one registered host region, else None."""
        found = self._find(addr, size)
        if found is None:
            return None
        start_addr, nbytes, start, view = found
        return None if view is None else view[start_addr - start : start_addr - start + nbytes]

    def clear(self) -> None:
        """Forget every region (their memory is the engine's; nothing is freed)."""
        with self._lock:
            self._snapshot = ((), ())
