"""Where new blocks go: weighted rendezvous hashing over the live nodes.

For each key, every eligible node gets the score ``-weight / ln(u)`` with
``u`` in (0, 1) drawn deterministically from a hash of (key, node id); the
highest score wins. This is weighted rendezvous (highest-random-weight)
hashing: node ``n`` wins a key with probability ``weight_n / sum(weights)``,
and adding or removing a node moves only the keys it wins or held.

Invariants:

- Deterministic: the same keys, node ids and weights give the same choice in
  every process and on every machine (no ``hash()``, no randomness).
- ``weight = DRAM capacity * (0.1 + free fraction of DRAM)``: spreads by
  capacity, leans toward free room, and the 0.1 floor keeps full nodes (the
  steady state) taking their share while a restarted empty node gets at most
  ~11x a full node's share, not everything.
- A node is never chosen for a block larger than its ``max_block_bytes``
  (its DRAM, or its SSD for blocks larger than DRAM takes). Among the nodes
  that take a block, one whose DRAM takes it is preferred (SSD-only
  blocks cost an LMDB write on the put's path).
- No live node is :class:`NoPoolNodes` (the servicer answers UNAVAILABLE); a
  block no live node takes is ``TOO_LARGE`` in the result (the rest of the
  batch is placed as usual).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.keys import KEY_BYTES, BlockKey

FREE_FLOOR = 0.1
TOO_LARGE = -1  # place()'s answer for a block no node takes

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


class NoPoolNodes(Exception):
    """No pool node is registered: nothing can be placed."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """What placement needs to know about one live node."""

    node_id: str
    dram_capacity_bytes: int
    dram_used_bytes: int
    dram_max_block_bytes: int  # largest block its DRAM takes
    max_block_bytes: int = 0  # largest block it stores at all (SSD); 0: dram_max_block_bytes

    @property
    def largest_block(self) -> int:
        return max(self.dram_max_block_bytes, self.max_block_bytes)

    @property
    def weight(self) -> float:
        capacity = max(self.dram_capacity_bytes, 1)
        free = min(max(capacity - self.dram_used_bytes, 0), capacity) / capacity
        return capacity * (FREE_FLOOR + free)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijection of uint64 that scrambles every input bit into every output bit."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def _node_salt(node_id: str) -> np.uint64:
    return np.frombuffer(hashlib.blake2b(node_id.encode(), digest_size=8).digest(), dtype="<u8")[0]


def place(keys: Sequence[BlockKey], sizes: Sequence[int], nodes: Sequence[Candidate]) -> list[int]:
    """Per key, the index into ``nodes`` of the node that should store it, or ``TOO_LARGE``.

    Raises :class:`NoPoolNodes` if ``nodes`` is empty.
    """
    if len(keys) != len(sizes):
        raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes")
    if not nodes:
        raise NoPoolNodes("no pool nodes")
    if not keys:
        return []
    if len(nodes) == 1:  # nothing to choose between (a one-node pool): what the arithmetic below gives, directly
        only = nodes[0]
        return [0 if n <= only.largest_block else TOO_LARGE for n in sizes]
    words = np.frombuffer(b"".join(keys), dtype="<u8").reshape(len(keys), KEY_BYTES // 8)
    folded = np.bitwise_xor.reduce(words, axis=1)  # all 256 key bits feed the hash
    salts = np.array([_node_salt(n.node_id) for n in nodes], dtype=np.uint64)
    h = _mix(folded[:, None] ^ salts[None, :])  # (keys, nodes)
    u = ((h >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53  # strictly inside (0, 1)
    weights = np.array([n.weight for n in nodes], dtype=np.float64)
    scores = -weights[None, :] / np.log(u)
    sizes_arr = np.asarray(sizes, dtype=np.uint64)[:, None]
    in_dram = sizes_arr <= np.array([n.dram_max_block_bytes for n in nodes], dtype=np.uint64)[None, :]
    stored = sizes_arr <= np.array([n.largest_block for n in nodes], dtype=np.uint64)[None, :]
    # A node whose DRAM takes the block beats every node that would keep it on SSD only; among those, the same
    # rendezvous order, mapped below zero (ln(u) / weight < 0 rises with -weight / ln(u)).
    scores = np.where(in_dram, scores, np.where(stored, np.log(u) / weights[None, :], -np.inf))
    choice = np.argmax(scores, axis=1)
    return np.where(stored.any(axis=1), choice, TOO_LARGE).tolist()
