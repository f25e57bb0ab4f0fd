"""The one interface every way of moving block bytes between a client and a node implements.

:class:`PoolClient <kvpool.client.pool.PoolClient>` groups a batch by node
and offers each node's blocks to its paths in order (shared memory, bulk TCP,
gRPC); a path moves what it can and hands back the rest for the next one:

- ``get(node, idxs, run, dsts, ok)``: copy block ``i`` of ``run`` (a
  :class:`~kvpool.client.lookup.PoolRun`: its columns, no object per block)
  into ``dsts[i]`` for ``i`` in ``idxs``, set ``ok[i]`` for each block that
  arrived intact (its checksum is the one the master published), and return
  the indexes another path should try. A block the node reports gone is a
  counted miss, not handed on.
- ``put(node, idxs, keys, arrays, sizes, result)``: store ``arrays[i]``
  under ``keys[i]``, set ``result[i]`` for each block the node now holds, and
  return the indexes another path should try.

Both take the node's ``deadline`` (``time.monotonic()``): one ``io_timeout_s``
for all of a node's blocks, across its paths and every call a path makes
(each call gets what is left of it, :func:`call_timeout`); a path whose
deadline passed starts no new call and hands the rest back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np

from kvpool.client.lookup import PoolRun
from kvpool.keys import BlockKey
from kvpool.vocabulary import NodeRef

GRPC_CHUNK_BYTES = 32 << 20  # bytes per gRPC Get/Put call
LEASE_CHUNK_BYTES = 256 << 20  # bytes per bulk PUT or Reserve/Commit lease (a lease must finish in time)


class DataPath(Protocol):
    """A way to move blocks to and from one node (see the module docstring)."""

    def get(self, node: NodeRef, idxs: list[int], run: PoolRun, dsts: list[np.ndarray],
            ok: list[bool], deadline: float) -> list[int]: ...

    def put(self, node: NodeRef, idxs: list[int], keys: list[BlockKey], arrays: list[np.ndarray],
            sizes: list[int], result: list[bool], deadline: float) -> list[int]: ...


def call_timeout(deadline: float) -> float:
    """The timeout of a call made now for a node whose blocks are due by ``deadline``: what is left (0 once it
    passed: the call fails at once, DEADLINE_EXCEEDED)."""
    return max(0.0, deadline - time.monotonic())


def chunks(indexes: Sequence[int], sizes: Sequence[int], limit: int, max_keys: int) -> Iterator[list[int]]:
    """Split ``indexes`` into runs of at most ``max_keys`` whose sizes add up to at most ``limit``.

    Each run holds at least one index. ``max_keys`` is the node's limit
    (:meth:`NodeDirectory.max_keys <kvpool.client.nodes.NodeDirectory.max_keys>`).
    """
    run: list[int] = []
    total = 0
    for i in indexes:
        if run and (total + sizes[i] > limit or len(run) >= max_keys):
            yield run
            run, total = [], 0
        run.append(i)
        total += sizes[i]
    if run:
        yield run
