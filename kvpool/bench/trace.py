"""A Mooncake-format request trace as kvpool would see it: requests, chained block keys, payloads.

Each trace hash id stands for one 512-token block; :func:`block_tokens` turns
it into 512 deterministic token ids and :class:`KeyMaker` lets kvpool's own
chained hashing key them, so identical prefixes give identical keys, as real
prompts would. :class:`Payloads` derives each block's bytes from its key, so a
reader can check every byte it gets back. :func:`unbounded_bound` is the hit
ratio of a cache that never evicts (leading run per request).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.keys import KEY_BYTES, BlockKey, KeyNamespace, chain_block_keys, leading_hits

BLOCK_TOKENS = 512  # one Mooncake hash id stands for 512 tokens
VOCAB = 150_000  # token ids drawn from [0, VOCAB)
MODEL = "mooncake-replay"  # the fixed namespace's model id


@dataclass(frozen=True)
class Request:
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str, limit: int | None = None) -> list[Request]:
    """The first ``limit`` requests (all if None) of a Mooncake JSONL trace; ValueError naming a bad line."""
    requests: list[Request] = []
    try:
        f = open(path)
    except OSError as exc:
        raise ValueError(f"cannot read trace {path}: {exc.strerror}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                ids = obj["hash_ids"]
                if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0
                                                        for h in ids):
                    raise ValueError("hash_ids must be a list of non-negative integers")
                requests.append(Request(float(obj.get("timestamp", 0)), int(obj.get("input_length", 0)),
                                        int(obj.get("output_length", 0)), tuple(ids)))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"trace {path} line {lineno}: {exc}") from None
    if not requests:
        raise ValueError(f"trace {path} has no requests")
    return requests


def block_tokens(hash_id: int) -> np.ndarray:
    """The 512 token ids (uint32) that stand for one hash id: deterministic, seeded by the id."""
    return np.random.default_rng(hash_id).integers(0, VOCAB, BLOCK_TOKENS, dtype=np.uint32)


class KeyMaker:
    """Chained block keys of requests, through :func:`chain_block_keys`.

    ``keys(hash_ids)`` equals ``chain_block_keys(concat(block_tokens(h) for h in hash_ids), 512, ns)``.
    A prefix whose keys were made before is reused (memoised on (parent key, hash id), which is
    exactly what the chain hashes), and the rest is chained over its concatenated tokens.
    """

    def __init__(self, namespace: KeyNamespace):
        self.namespace = namespace
        self.root = namespace.root()
        self._memo: dict[tuple[bytes, int], BlockKey] = {}

    def keys(self, hash_ids: Sequence[int]) -> list[BlockKey]:
        out: list[BlockKey] = []
        parent = self.root
        for h in hash_ids:
            key = self._memo.get((parent, h))
            if key is None:
                break
            out.append(key)
            parent = key
        rest = hash_ids[len(out):]
        if rest:
            tokens = np.concatenate([block_tokens(h) for h in rest])
            new = chain_block_keys(tokens, BLOCK_TOKENS, self.namespace, parent=None if not out else parent)
            assert len(new) == len(rest), "replay: a hash id did not give exactly one block key"
            for h, key in zip(rest, new):
                self._memo[(parent, h)] = key
                parent = key
            out.extend(new)
        return out


@dataclass(frozen=True)
class Bound:
    """Hit ratios of a cache that never evicts (blocks seen in any earlier request)."""

    lookups: int
    leading_hits: int  # prefix semantics: the leading run of seen blocks per request
    block_hits: int  # every seen block, wherever it is in the request

    @property
    def leading(self) -> float:
        return self.leading_hits / self.lookups if self.lookups else 0.0

    @property
    def per_block(self) -> float:
        return self.block_hits / self.lookups if self.lookups else 0.0


def unbounded_bound(sequences: Iterable[Sequence[Any]]) -> Bound:
    """The unbounded-cache bound of a sequence of requests (keys or hash ids, anything hashable)."""
    seen: set[Any] = set()
    lookups = lead = block = 0
    for seq in sequences:
        hits = [x in seen for x in seq]
        lookups += len(hits)
        lead += leading_hits(hits)
        block += sum(hits)
        seen.update(seq)
    return Bound(lookups, lead, block)


@dataclass(frozen=True)
class LruReference:
    """Hits of exact LRU caches shaped like kvpool's HBM + DRAM tiers (:func:`lru_reference`)."""

    lookups: int
    hbm_hits: int
    dram_hits: int

    @property
    def hit_blocks(self) -> int:
        return self.hbm_hits + self.dram_hits

    def ratio(self, n: int) -> float:
        return n / self.lookups if self.lookups else 0.0


def lru_reference(sequences: Iterable[Sequence[Any]], hbm_blocks: int, dram_blocks: int) -> LruReference:
    """What the replay's client would hit if both its tiers were exact LRUs of their full capacities.

    Per request, as the replay's client does: the leading run held in HBM is a hit (each becomes HBM's most
    recent); then the leading run of the rest held in DRAM is a hit (each becomes DRAM's most recent and is
    put into HBM); every block after the loaded run is written to HBM and DRAM (each its most recent). A tier
    over capacity drops its least recently used block. No watermarks, no SSD: the reference the DRAM tier's
    hit rate is judged against.
    """
    hbm: OrderedDict[Any, None] = OrderedDict()
    dram: OrderedDict[Any, None] = OrderedDict()

    def use(cache: OrderedDict[Any, None], key: Any, capacity: int) -> None:
        if capacity <= 0:
            return
        cache[key] = None
        cache.move_to_end(key)
        if len(cache) > capacity:
            cache.popitem(last=False)

    lookups = hbm_hits = dram_hits = 0
    for seq in sequences:
        keys = list(seq)
        lookups += len(keys)
        h = leading_hits([k in hbm for k in keys])
        p = leading_hits([k in dram for k in keys[h:]])
        for k in keys[:h]:
            hbm.move_to_end(k)
        for k in keys[h : h + p]:
            use(dram, k, dram_blocks)
            use(hbm, k, hbm_blocks)
        for k in keys[h + p :]:
            use(hbm, k, hbm_blocks)
            use(dram, k, dram_blocks)
        hbm_hits += h
        dram_hits += p
    return LruReference(lookups, hbm_hits, dram_hits)


class Payloads:
    """Each key's deterministic block bytes: the key tiled to the block size, XORed with a fixed salt.

    Any other block's bytes, or these shifted, differ (the salt is random per byte). Made and
    checked in place, 8 bytes at a time, so large blocks cost about two passes over memory.
    """

    def __init__(self, block_bytes: int):
        if block_bytes % KEY_BYTES:
            raise ValueError(f"block_bytes must be a multiple of {KEY_BYTES}")
        self.block_bytes = block_bytes
        self._reps = block_bytes // KEY_BYTES
        salt = np.random.default_rng(0x6B7670).integers(0, 256, block_bytes, dtype=np.uint8)
        self._salt = salt.view(np.uint64).reshape(self._reps, KEY_BYTES // 8)
        self._scratch = np.empty((0, self._reps, KEY_BYTES // 8), dtype=np.uint64)

    def _keys64(self, keys: Sequence[BlockKey]) -> np.ndarray:
        return np.frombuffer(b"".join(keys), dtype=np.uint64).reshape(len(keys), 1, KEY_BYTES // 8)

    def _words(self, blocks: np.ndarray, n: int) -> np.ndarray:
        return blocks[:n].reshape(n, self.block_bytes).view(np.uint64).reshape(n, self._reps, KEY_BYTES // 8)

    def make(self, keys: Sequence[BlockKey], out: np.ndarray | None = None) -> np.ndarray:
        """``(len(keys), block_bytes)`` uint8: row i is key i's payload (written into ``out`` if given)."""
        n = len(keys)
        if out is None:
            out = np.empty((n, self.block_bytes), dtype=np.uint8)
        words = self._words(out, n)
        words[...] = self._salt
        words ^= self._keys64(keys)
        return out[:n]

    def wrong(self, keys: Sequence[BlockKey], got: np.ndarray) -> int:
        """How many of the first ``len(keys)`` rows of ``got`` are not their key's payload."""
        n = len(keys)
        if not n:
            return 0
        if len(self._scratch) < n:
            self._scratch = np.empty((n, self._reps, KEY_BYTES // 8), dtype=np.uint64)
        plain = np.bitwise_xor(self._words(got, n), self._salt, out=self._scratch[:n])
        return int(np.count_nonzero((plain != self._keys64(keys)).any(axis=(1, 2))))
