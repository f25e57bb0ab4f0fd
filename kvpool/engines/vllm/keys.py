"""Block keys for vLLM requests: the same in every vLLM process and on every host.

vLLM's own block hashes start from a random seed unless ``PYTHONHASHSEED``
is set, so they cannot name a block across processes. These keys are
kvpool's chained sha256 over the token ids (:mod:`kvpool.keys`) in a
namespace made only of what decides whether two processes' KV for the same
tokens is interchangeable:

- the model (``client.model`` in the kvpool config, else vLLM's served
  model name);
- the KV layout: dtype, layers, KV heads of one tensor-parallel rank, head
  size, block size, and vLLM's physical KV cache layout on this device type
  (the bytes of a block are laid out as vLLM holds them);
- the tensor-parallel and pipeline-parallel sizes: each (stage, rank)
  stores its own shard of a block, under :func:`shard_key` of the key the
  scheduler computes (shard 0's);
- the tenant: the request's ``cache_salt``, its LoRA adapter and, for
  multimodal prompts, the identifiers of their inputs, so tenants and
  adapters never share blocks.

:class:`RequestKeys` extends one request's chain as its tokens (prompt, then
generated) fill blocks; keys of blocks already hashed are never recomputed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from kvpool.keys import BlockKey, KeyNamespace, chain_block_keys
from kvpool.layout import KVLayout

_TAG_SHARD = b"kvpool.v1/vllm-shard\x00"


@dataclass(frozen=True, slots=True)
class VllmKeySpace:
    """What the keys of one vLLM deployment share (everything but the request's own salt)."""

    model: str
    layout: KVLayout
    cache_layout: str  # vLLM's physical KV cache layout name and device type, e.g. "cpu/LBHNC"
    tp_size: int = 1
    pp_size: int = 1

    def namespace(self, tenant: str) -> KeyNamespace:
        fingerprint = f"{self.layout.fingerprint()}/vllm:{self.cache_layout}/pp{self.pp_size}"
        return KeyNamespace(self.model, fingerprint, 0, self.tp_size, tenant)


def request_tenant(request: Any) -> str:
    """The salt of a vLLM request: ``cache_salt``, LoRA name and multimodal input ids ("" for none)."""
    parts: dict[str, object] = {}
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts["salt"] = str(salt)
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts["lora"] = str(getattr(lora, "lora_name", "") or getattr(lora, "lora_int_id", ""))
    features = getattr(request, "mm_features", None) or []
    ids = [str(getattr(f, "identifier", "")) for f in features]
    if ids:
        parts["mm"] = ids
    return json.dumps(parts, sort_keys=True, separators=(",", ":")) if parts else ""


def shard_key(key: BlockKey, shard: int) -> BlockKey:
    """The key of shard ``shard`` (``pp_rank * tp_size + tp_rank``) of the block shard 0 stores under ``key``."""
    if shard == 0:
        return key
    return BlockKey(hashlib.sha256(_TAG_SHARD + shard.to_bytes(4, "little") + key).digest())


@dataclass(slots=True)
class RequestKeys:
    """The keys of one request's full blocks, extended as its tokens grow (see the module docstring)."""

    namespace: KeyNamespace
    block_size: int
    keys: list[BlockKey] = field(default_factory=list)

    def upto(self, tokens: Any, n_blocks: int) -> list[BlockKey]:
        """The keys of blocks ``[0, n_blocks)``; ``tokens`` (all of the request's so far) must cover them."""
        have = len(self.keys)
        if n_blocks > have:
            parent = self.keys[-1] if self.keys else None
            new = list(tokens[have * self.block_size : n_blocks * self.block_size])
            if len(new) < (n_blocks - have) * self.block_size:
                raise ValueError(f"{n_blocks} blocks asked for, the request has {len(tokens)} tokens")
            self.keys += chain_block_keys(new, self.block_size, self.namespace, parent)
        return self.keys[:n_blocks]
