"""A put in two steps: where each block's bytes go first, then the engine fills them, then the pool takes them.

:meth:`PoolClient.prepare_put <kvpool.client.pool.PoolClient.prepare_put>`
gives each block a *target*: a slot a same-host node leased to this client
ahead of time (:class:`~kvpool.client.leases.LeasedSlot`, no round trip), or
host scratch when no slot is in stock (a remote node, the first puts, a size
not leased ahead). The engine writes each block into its target once
(:meth:`PreparedPut.fill` gathers pieces and hashes in the same pass), then
:meth:`PoolClient.complete_put <kvpool.client.pool.PoolClient.complete_put>`
hands the batch to the write-behind queue, which commits the slots (no bytes
move again) and writes the scratch blocks the usual way. So a block saved on
the same host as its node is copied once and hashed once.

Invariants:
- A target is the block's size, writable, and the batch's alone until
  ``complete_put`` (or until the batch is dropped: its slots lapse with their
  lease on the node, nothing is published).
- A slot target's checksum is the hash of exactly what landed in it, taken
  while it was written (:meth:`fill`) or right after (:meth:`seal`); the
  node publishes it without hashing again, and every reader verifies it.
- Not thread-safe: one thread fills a batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpool.checksum import block_checksum, gather_with_checksum
from kvpool.client.leases import LeasedSlot
from kvpool.keys import BlockKey


class PreparedPut:
    """The targets of one batch of blocks (see the module docstring)."""

    def __init__(self, keys: list[BlockKey], sizes: list[int], slots: Sequence[LeasedSlot | None]):
        self.keys = keys
        self.slots = list(slots)
        self.targets: list[np.ndarray] = [s.view() if s is not None else np.empty(n, dtype=np.uint8)
                                          for s, n in zip(self.slots, sizes)]
        self.checksums: list[int | None] = [None] * len(keys)  # slot targets, once filled
        self._filled = [False] * len(keys)

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def in_slots(self) -> int:
        """Blocks whose target is a leased slot (copied once, straight into the node's memory)."""
        return sum(s is not None for s in self.slots)

    def fill(self, i: int, pieces: Sequence[np.ndarray]) -> None:
        """Copy ``pieces`` (any dtypes and strides; their bytes add up to block ``i``'s size) into block ``i``'s
        target, one after another, hashing them in the same pass where the target is a slot."""
        target = self.targets[i]
        if self.slots[i] is not None:
            self.checksums[i] = gather_with_checksum(target, pieces)
        else:
            total = sum(piece.nbytes for piece in pieces)
            if total != target.size:
                raise ValueError(f"pieces hold {total} bytes, the block {target.size}")
            at = 0
            for piece in pieces:
                np.copyto(target[at : at + piece.nbytes].view(piece.dtype).reshape(piece.shape), piece)
                at += piece.nbytes
        self._filled[i] = True

    def seal(self, i: int) -> None:
        """Block ``i``'s target was written by the caller itself (e.g. one device-to-host copy): hash it."""
        if self.slots[i] is not None:
            self.checksums[i] = block_checksum(self.targets[i])
        self._filled[i] = True

    def unfilled(self) -> list[int]:
        """Blocks neither filled nor sealed."""
        return [i for i, done in enumerate(self._filled) if not done]
