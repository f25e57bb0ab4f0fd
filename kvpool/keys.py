"""Block keys: fixed-width, namespaced, chained hashes of full token blocks.

Invariants:
- A :data:`BlockKey` is exactly :data:`KEY_BYTES` (32) bytes.
- ``key_i = sha256(TAG_BLOCK || key_(i-1) || tokens_i as uint32 little-endian)``
  with ``key_(-1)`` the namespace root (:meth:`KeyNamespace.root`), so a key
  names its whole prefix *and* its namespace; same tokens under another model,
  layout, TP rank/size or tenant never collide.
- Only full blocks get keys: 164 tokens at block size 128 give one key.
- Nothing depends on ``PYTHONHASHSEED`` or the process: the same inputs give
  the same keys on every machine.
- Engine-chosen opaque keys (MindIE's ``"{hash}_{tp_rank}_{tp_size}_{model}"``
  strings) map to BlockKeys with :func:`opaque_key`, under their own tag, so
  they never collide with chained token keys.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NewType, cast

import numpy as np

KEY_BYTES = 32
BlockKey = NewType("BlockKey", bytes)

MAX_OPAQUE_KEY_BYTES = 1024
MAX_TOKEN_ID = 2**32 - 1

_TAG_ROOT = b"kvpool.v1/root\x00"
_TAG_BLOCK = b"kvpool.v1/block\x00"
_TAG_OPAQUE = b"kvpool.v1/opaque\x00"


@dataclass(frozen=True, slots=True)
class KeyNamespace:
    """Everything besides the tokens that decides whether two KV blocks are interchangeable.

    ``layout`` is a :meth:`kvpool.layout.KVLayout.fingerprint`; ``tenant`` is a
    salt (vLLM's ``cache_salt``): tenants with different salts never share keys.
    """

    model: str
    layout: str
    tp_rank: int = 0
    tp_size: int = 1
    tenant: str = ""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("namespace needs a model id")
        if not self.layout:
            raise ValueError("namespace needs a KV layout fingerprint")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"bad tensor-parallel rank/size: {self.tp_rank}/{self.tp_size}")

    def root(self) -> BlockKey:
        """The key that the first block of every prompt chains from."""
        fields = [self.model, self.layout, self.tp_rank, self.tp_size, self.tenant]
        canonical = json.dumps(fields, separators=(",", ":"), ensure_ascii=True).encode()
        return BlockKey(hashlib.sha256(_TAG_ROOT + canonical).digest())


def token_block_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as uint32 little-endian bytes; ValueError for ids outside [0, 2**32)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID:
        raise ValueError("token ids must lie in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def chain_block_keys(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    namespace: KeyNamespace,
    parent: BlockKey | None = None,
) -> list[BlockKey]:
    """Keys of every *full* block of ``tokens``; a trailing partial block gets none.

    ``parent`` continues a chain (the key of the block before ``tokens[0]``);
    by default the chain starts at the namespace root.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    raw = token_block_bytes(tokens)
    stride = block_size * 4
    prev = namespace.root() if parent is None else check_key(parent)
    keys: list[BlockKey] = []
    for start in range(0, len(raw) - stride + 1, stride):
        prev = BlockKey(hashlib.sha256(_TAG_BLOCK + prev + raw[start : start + stride]).digest())
        keys.append(prev)
    return keys


def opaque_key(name: str | bytes, namespace: KeyNamespace | None = None) -> BlockKey:
    """Map an engine-chosen key (e.g. MindIE's ``"{hash}_{rank}_{size}_{model}"``) to a BlockKey.

    Without a namespace the engine's string is trusted to carry its own (MindIE's
    does); with one, the same string in two namespaces gives two keys.
    """
    if isinstance(name, str):
        if not name:
            raise ValueError("opaque key must not be empty")
        data = name.encode("utf-8")
    elif isinstance(name, bytes):
        data = name
    else:
        raise ValueError(f"opaque key must be str or bytes, got {type(name).__name__}")
    if not data or len(data) > MAX_OPAQUE_KEY_BYTES:
        raise ValueError(f"opaque key must be 1..{MAX_OPAQUE_KEY_BYTES} bytes, got {len(data)}")
    scope = namespace.root() if namespace is not None else b""
    return BlockKey(hashlib.sha256(_TAG_OPAQUE + scope + data).digest())


def check_key(key: object) -> BlockKey:
    """Return ``key`` as a BlockKey, or raise ValueError saying what is wrong with it."""
    if type(key) is bytes and len(key) == KEY_BYTES:  # the common case, first (hot path)
        return BlockKey(key)
    if isinstance(key, (bytearray, memoryview)):
        key = bytes(key)
    if not isinstance(key, bytes):
        raise ValueError(f"block key must be bytes, got {type(key).__name__}")
    if len(key) != KEY_BYTES:
        raise ValueError(f"block key must be {KEY_BYTES} bytes, got {len(key)}")
    return BlockKey(key)


def check_keys(keys: Iterable[object]) -> list[BlockKey]:
    """Validate a batch of keys (all or nothing)."""
    items = list(keys)
    if not items:
        return []
    if set(map(type, items)) == {bytes}:  # the fast path: no Python call per key
        raw = cast("list[bytes]", items)  # every item is exactly bytes (checked just above)
        if set(map(len, raw)) == {KEY_BYTES}:
            return cast("list[BlockKey]", raw)  # a BlockKey is any bytes of KEY_BYTES
    return [check_key(k) for k in items]


def pack_keys(keys: Iterable[BlockKey]) -> bytes:
    """Concatenate keys into one bytes field (the wire form of a key batch)."""
    return b"".join(check_keys(keys))


def unpack_keys(packed: bytes) -> list[BlockKey]:
    """Split a packed key batch; ValueError if its length is not a multiple of KEY_BYTES."""
    if len(packed) % KEY_BYTES:
        raise ValueError(f"packed keys: {len(packed)} bytes is not a multiple of {KEY_BYTES}")
    return [BlockKey(packed[i : i + KEY_BYTES]) for i in range(0, len(packed), KEY_BYTES)]


def leading_hits(hits: Sequence[bool]) -> int:
    """Length of the leading run of True: only a prefix of blocks can be reused."""
    for i, hit in enumerate(hits):
        if not hit:
            return i
    return len(hits)
