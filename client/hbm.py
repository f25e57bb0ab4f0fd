"""HBM tier: an LRU block store over one preallocated device tensor, inside the inference worker.

Invariants:
- The pool is one ``uint8`` tensor of shape ``(capacity_blocks, block_bytes)``,
  allocated once in ``__init__`` and never resized; slot ``i`` is ``pool[i]``.
- The store owns every slot. A slot is either in the free list or mapped by
  exactly one key in the index; callers never get a view of a slot, only
  copies in (``put``) and out (``get_into``).
- The index is ordered least-recently-used first. ``put`` (new or present key)
  and ``get_into`` hits move a key to the most-recently-used end;
  ``contains`` never changes recency.
- No dtype conversion, ever: caller tensors must be contiguous, exactly
  ``block_bytes`` long and of the layout's dtype (or ``uint8``)
  (:meth:`KVLayout.check_block <kvpool.layout.KVLayout.check_block>`); their
  bytes are copied through a ``uint8`` view. Anything else is a ValueError
  raised before anything changes.
- ``on_change(added, removed)`` runs after each put / remove / eviction batch
  that changed the key set, outside the lock, so a worker can report its HBM
  contents to the master in batches.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvpool.client.devices import resolve_device
from kvpool.keys import BlockKey, check_keys
from kvpool.layout import KVLayout
from kvpool.tiers.base import check_batch
from kvpool.vocabulary import Tier, TierStats

ChangeCallback = Callable[[list[BlockKey], list[BlockKey]], None]


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy one flat uint8 block. Host to host goes through numpy: one plain memcpy, where
    torch's copy_ would split it over its intra-op threads (erratic on a busy 2-core host)."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        np.copyto(dst.detach().numpy(), src.detach().numpy())
    else:
        dst.copy_(src)


class HbmStore:
    """The HBM tier (the calls of :mod:`kvpool.tiers.base`) of torch tensors, backed by a device tensor pool."""

    tier = Tier.HBM

    def __init__(
        self,
        layout: KVLayout,
        capacity_blocks: int,
        device: str = "cpu",
        on_change: ChangeCallback | None = None,
    ) -> None:
        if not isinstance(capacity_blocks, int) or isinstance(capacity_blocks, bool) or capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be a positive integer, got {capacity_blocks!r}")
        self.layout = layout
        self.capacity_blocks = capacity_blocks
        self.device = resolve_device(device)
        self._on_change = on_change
        self._pool: torch.Tensor | None = torch.empty(
            (capacity_blocks, layout.block_bytes), dtype=torch.uint8, device=self.device
        )
        self._index: OrderedDict[BlockKey, int] = OrderedDict()  # key -> slot, LRU first
        self._free: list[int] = list(range(capacity_blocks - 1, -1, -1))  # pop() gives slot 0 first
        self._lock = threading.Lock()
        self._stats = TierStats(tier=Tier.HBM, capacity_bytes=capacity_blocks * layout.block_bytes)

    # -- validation (no state touched) ------------------------------------------------

    def _check_tensor(self, tensor: object) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        self.layout.check_block(tensor, what="tensor")
        return tensor

    def _check(self, keys: Sequence[object], tensors: Sequence[object]) -> tuple[list[BlockKey], list[torch.Tensor]]:
        checked = check_keys(keys)
        check_batch(checked, tensors)
        return checked, [self._check_tensor(t) for t in tensors]

    def _live_pool(self) -> torch.Tensor:
        """The pool; ValueError once closed. Call with the lock held."""
        if self._pool is None:
            raise ValueError("HbmStore is closed")
        return self._pool

    def _notify(self, added: list[BlockKey], removed: list[BlockKey]) -> None:
        if self._on_change is not None and (added or removed):
            self._on_change(added, removed)

    # -- the tier calls (kvpool.tiers.base) ----------------------------------------------------------------------

    def put(self, keys: Sequence[BlockKey], tensors: Sequence[torch.Tensor]) -> list[bool]:
        """Store blocks; True if the key is now here. A present key only refreshes recency (no copy).

        New keys take a free slot or evict the LRU block; blocks stored or
        refreshed earlier in this batch are never evicted, so when the batch
        holds more than the capacity, the later keys return False.
        """
        checked, values = self._check(keys, tensors)
        results: list[bool] = []
        added: list[BlockKey] = []
        evicted: list[BlockKey] = []
        with self._lock:
            pool = self._live_pool()
            batch: set[BlockKey] = set()
            with torch.no_grad():
                for key, value in zip(checked, values):
                    if key in self._index:
                        self._index.move_to_end(key)
                        batch.add(key)
                        results.append(True)
                        continue
                    slot = self._take_slot(batch, evicted)
                    if slot is None:
                        results.append(False)
                        continue
                    _copy(pool[slot], value.reshape(-1).view(torch.uint8))
                    self._index[key] = slot
                    batch.add(key)
                    added.append(key)
                    results.append(True)
            self._stats.puts += len(added)
            self._stats.bytes_in += len(added) * self.layout.block_bytes
            self._stats.evictions += len(evicted)
        self._notify(added, evicted)
        return results

    def _take_slot(self, protected: set[BlockKey], evicted: list[BlockKey]) -> int | None:
        """A free slot, else the LRU block's slot (evicting it) unless it is protected. Lock held."""
        if self._free:
            return self._free.pop()
        if not self._index:
            return None
        victim = next(iter(self._index))
        if victim in protected:  # protected keys are all MRU, so nothing older is left
            return None
        evicted.append(victim)
        return self._index.pop(victim)

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Copy hits into ``outs`` and mark them most recently used; misses leave their out untouched."""
        checked, targets = self._check(keys, outs)
        results: list[bool] = []
        with self._lock:
            pool = self._live_pool()
            with torch.no_grad():
                for key, out in zip(checked, targets):
                    slot = self._index.get(key)
                    if slot is None:
                        results.append(False)
                        continue
                    _copy(out.view(-1).view(torch.uint8), pool[slot])
                    self._index.move_to_end(key)
                    results.append(True)
            hits = sum(results)
            self._stats.hits += hits
            self._stats.misses += len(results) - hits
            self._stats.bytes_out += hits * self.layout.block_bytes
        return results

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per-key presence; does not change recency."""
        checked = check_keys(keys)
        with self._lock:
            self._live_pool()
            return [key in self._index for key in checked]

    def remove(self, keys: Sequence[BlockKey]) -> int:
        """Drop the given keys (absent ones are ignored); returns how many were removed."""
        checked = check_keys(keys)
        removed: list[BlockKey] = []
        with self._lock:
            self._live_pool()
            for key in checked:
                slot = self._index.pop(key, None)
                if slot is not None:
                    self._free.append(slot)
                    removed.append(key)
        self._notify([], removed)
        return len(removed)

    def stats(self) -> TierStats:
        """A snapshot of the counters (a copy; later calls do not change it)."""
        with self._lock:
            self._live_pool()
            s = self._stats
            blocks = len(self._index)
            return TierStats(
                tier=s.tier,
                capacity_bytes=s.capacity_bytes,
                used_bytes=blocks * self.layout.block_bytes,
                blocks=blocks,
                hits=s.hits,
                misses=s.misses,
                puts=s.puts,
                bytes_in=s.bytes_in,
                bytes_out=s.bytes_out,
                evictions=s.evictions,
                corrupt=s.corrupt,
            )

    def keys(self) -> list[BlockKey]:
        """A snapshot of the stored keys, least recently used first."""
        with self._lock:
            self._live_pool()
            return list(self._index)

    def close(self) -> None:
        """Free the pool; reports every stored key as removed. Idempotent; other calls then raise ValueError."""
        with self._lock:
            if self._pool is None:
                return
            removed = list(self._index)
            self._index.clear()
            self._free.clear()
            self._pool = None
        self._notify([], removed)
