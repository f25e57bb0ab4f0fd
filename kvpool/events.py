"""KV events in vLLM's format, as routers see them: the batches, their topics, and how a subscriber connects.

The wire is vLLM's (``vllm.distributed.kv_events`` in vllm 0.32, ``ZmqEventPublisher``), so a router that
subscribes to vLLM engines reads kvpool with the same code:

- a PUB socket sends each batch as three frames: its topic, the batch's sequence number (8 bytes, big
  endian) and the payload, msgpack of ``KVEventBatch`` ``[ts, events, data_parallel_rank?]``; each event a
  map tagged ``"type"``: ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``;
- a ROUTER socket replays: a request ``[b"", start_seq]`` (8 bytes, big endian) is answered with every
  batch still buffered from ``start_seq`` on, ``[b"", topic, seq, payload]`` each, then
  ``[b"", b"", -1, b""]``;
- the medium of a block is ``GPU`` for a worker's HBM, ``CPU`` for a node's DRAM, ``STORAGE`` for its SSD
  (vLLM's constants ``MEDIUM_GPU``, ``MEDIUM_CPU``, ``MEDIUM_STORAGE``);
- a block's hash is :func:`key_hash` of its kvpool key: the 64-bit int form vLLM's events use by default.

Topics. A tenant's batches go out under :func:`tenant_prefix`: ``TOPIC/`` with auth off (``TOPIC/pool``,
``TOPIC/hbm/WORKER``, as always), ``TOPIC/<tenant>/`` with an auth file, the tenant's name escaped
(:func:`escape_tenant`) so that it holds no ``/``: one tenant's prefix is never a prefix of another's.
Each tenant's batches are numbered in a sequence of its own (:mod:`kvpool.event_publisher`).

Subscribing with an auth file: the ports speak ZeroMQ's CURVE, and a subscriber's key pair is derived
from its client token (:func:`subscriber_keys`); :func:`curve_client` sets the three socket options, with
the server's public key from ``Master.Info`` (``kv_events_server_key``). docs/security.md has the raw
options for routers in other languages.

Invariants: an encoded batch is at most :data:`MAX_BATCH_BYTES` and a topic at most
:data:`MAX_TOPIC_BYTES` (the publisher refuses longer ones); :func:`subscriber_keys` of a token is the same
in every process (sha256, no randomness).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec
import zmq
from zmq.utils import z85

MEDIUM_GPU = "GPU"  # a worker's HBM, as the master sees it
MEDIUM_CPU = "CPU"  # a pool node's DRAM
MEDIUM_STORAGE = "STORAGE"  # a pool node's SSD
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_TOPIC_BYTES = 4096  # longest topic the publisher sends (TOPIC, an escaped tenant, hbm/ and a worker id)
MAX_BATCH_BYTES = 64 << 10  # longest encoded batch: a subscriber's queue is bounded as batches x this
HASH_BYTES = 9  # a 64-bit hash in msgpack, at most
EVENT_BYTES = 192  # an event's own fields in msgpack, at most (its hashes aside)
_CLIENT_KEY_LABEL = b"kvpool.v1/kv-events-client\x00"

BlockHash = bytes | int


def key_hash(key: bytes) -> int:
    """A kvpool key's hash in events: its first 8 bytes as a big-endian unsigned int (64 bits, like vLLM's
    int block hashes; the master keys its index by the first 16 bytes, so it can name every key it drops)."""
    return int.from_bytes(key[:8], "big")


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def stored(keys: Sequence[BlockHash], medium: str, block_size: int = 0,
           parent: BlockHash | None = None) -> BlockStored:
    """A ``BlockStored`` for ``keys`` (a chain, first to last) in ``medium``; no token ids (the pool has none)."""
    return BlockStored(block_hashes=list(keys), parent_block_hash=parent, token_ids=[], block_size=block_size,
                       lora_id=None, medium=medium, lora_name=None)


def removed(keys: Sequence[BlockHash], medium: str) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(keys), medium=medium)


# -- topics ---------------------------------------------------------------------------------------------


def escape_tenant(tenant: str) -> str:
    """A tenant's name as it appears in topics: ``%`` as ``%25``, ``/`` as ``%2F`` (no ``/`` left, and two
    names never escape to one)."""
    return tenant.replace("%", "%25").replace("/", "%2F")


def tenant_prefix(topic: str, tenant: str) -> str:
    """Where a tenant's topics start: ``TOPIC/`` for "" (auth off), ``TOPIC/<escaped tenant>/`` otherwise."""
    return f"{topic}/{escape_tenant(tenant)}/" if tenant else f"{topic}/"


# -- subscribing with an auth file (CURVE) --------------------------------------------------------------


def subscriber_keys(token: str) -> tuple[str, str]:
    """The CURVE key pair (public, secret; Z85 text) of the subscriber holding client ``token``: the secret
    key is ``sha256("kvpool.v1/kv-events-client" NUL token)``, the public key its Curve25519 public key."""
    secret = z85.encode(hashlib.sha256(_CLIENT_KEY_LABEL + token.encode()).digest()).decode()
    return zmq.curve_public(secret.encode()).decode(), secret


def curve_client(sock: zmq.Socket, token: str, server_key: str) -> None:
    """Make ``sock`` (a SUB or DEALER, before it connects) a CURVE client of the event ports as the tenant of
    ``token``: ``server_key`` is ``Master.Info``'s ``kv_events_server_key``."""
    public, secret = subscriber_keys(token)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_key.encode())
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public.encode())
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret.encode())
