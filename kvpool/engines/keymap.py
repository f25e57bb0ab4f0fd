"""Engine key strings -> pool BlockKeys, in the client's namespace.

Engines name blocks with their own strings: MindIE's
``"{prefix_hash}_{tp_rank}_{tp_size}_{model}"``, vllm-ascend's
``"{model}@pcp0@dcp0@head_or_tp_rank:0@pp_rank:0@{chunk_hash}"``. They are
mapped with :func:`kvpool.keys.opaque_key` under a namespace of the client's
model, layout and tenant.

Invariants:
- The namespace's TP rank/size are always 0/1: the engine's string already
  carries its rank where blocks differ per rank, and leaves it out (or shares
  it, as vllm-ascend does for MLA) where ranks share blocks. Adding our own
  rank would stop ranks sharing what the engine means them to share.
- Two clients with the same model, layout and tenant map a string to the same
  key (a scheduler and its workers agree); different tenants or layouts never do.
- A client without a layout (raw blocks) uses the fixed layout name
  :data:`RAW_LAYOUT`, so raw and laid-out keys never collide.
- :func:`engine_hash` reads the engine's own block hash out of its string (for KV events): the number's
  last 64 bits, as vLLM's int block hashes are; 0 (no name) when the field is not such a number.
"""

from __future__ import annotations

import re

from kvpool.client.kvclient import KVCacheClient
from kvpool.keys import MAX_OPAQUE_KEY_BYTES, BlockKey, KeyNamespace, opaque_key

RAW_LAYOUT = "raw-bytes"
_MASK64 = (1 << 64) - 1
_DIGITS = {10: re.compile(r"[0-9]+"), 16: re.compile(r"[0-9a-fA-F]+")}


def engine_hash(field: str, base: int) -> int:
    """The last 64 bits of the number ``field`` spells in ``base`` (10 or 16), whole; 0 if it is not one."""
    if not _DIGITS[base].fullmatch(field):
        return 0
    return int(field[-16:] if base == 16 else field, base) & _MASK64


def engine_namespace(client: KVCacheClient) -> KeyNamespace:
    """The namespace engine strings are mapped in: the client's model, layout (or raw) and tenant, rank 0 of 1."""
    if client.layout is not None:
        return client.namespace()
    return KeyNamespace(client.config.model, RAW_LAYOUT, 0, 1, client.config.tenant)


def map_keys(names: object, namespace: KeyNamespace) -> list[BlockKey] | None:
    """BlockKeys of a list (or tuple) of engine key strings; None if it is not one or any string is unusable.

    Usable: a ``str`` of 1..:data:`~kvpool.keys.MAX_OPAQUE_KEY_BYTES` UTF-8 bytes.
    """
    if not isinstance(names, (list, tuple)):
        return None
    keys: list[BlockKey] = []
    for name in names:
        if not isinstance(name, str) or not name or len(name) > MAX_OPAQUE_KEY_BYTES:
            return None
        try:
            keys.append(opaque_key(name, namespace))
        except (ValueError, UnicodeEncodeError):  # multi-byte strings past the byte limit, lone surrogates
            return None
    return keys
