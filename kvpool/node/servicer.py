"""The Node gRPC service: validate, translate proto <-> store calls, delegate to the node core.

What a request does to the store (keys, sizes, quota, leases, the seqlock
check) is :mod:`kvpool.node.core`'s, shared with the wire listener
(:mod:`kvpool.node.data_port`); this module only translates, and sees nothing of
the node but its :class:`~kvpool.node.core.NodeCore`.

Rules every handler follows:
- Bad input (packed keys of the wrong length, sizes that do not match the
  keys or the data, too many keys, a reply that would exceed the message
  limit) raises ValueError before anything changes; the ErrorInterceptor
  (kvpool.rpc) turns it into INVALID_ARGUMENT.
- Pool faults are misses, not errors: a Put block whose checksum does not
  match its bytes is refused (stored byte 0, counted as error kind
  ``checksum``); a block evicted between the size look-up and the copy is a
  Get miss.
- Put, Commit and the bulk PUT reply once the blocks are stored; the master
  link reports them in the background (a key reaches the index only after its
  bytes and checksum are complete here). ``FlushReports`` is the writer's
  barrier: it answers once the master has every change made before it.
  Remove replies only after the master has the removal.
- Get builds its reply in one preallocated buffer that the tiers copy into
  directly; the only other copy is the one protobuf needs (its bytes field
  takes ``bytes``).
- Reserve leases free DRAM slots to a same-host writer for
  ``lease_timeout_s`` (the daemon's reaper frees lapsed leases); Commit
  publishes the slots whose bytes match their checksums, and leases the
  slots ``next_sizes`` asks for ahead (keys unknown yet), so a writer's next
  put is one Commit.
- A lease belongs to its caller (:func:`kvpool.auth.caller`: the tenant's
  identity; None with auth off) and its id is random: a Commit by anyone
  else stores nothing and leaves the lease to its owner.
- Every key a request names is the caller's: with auth on, it is mapped to
  its tenant's stored key (:func:`kvpool.auth.caller_keys`) before it reaches
  a store, so a tenant can neither see nor change another's blocks. With a
  quota ledger, Put and Reserve admit a tenant's new blocks only within its
  quota (:mod:`kvpool.node.quota`; refused blocks are not stored), and the
  slots Reserve leases are charged to the tenant's quota until the lease
  ends: a tenant never holds and reserves more than its quota, and blocks
  beyond it get no slot (so they evict nothing).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool.auth import caller
from kvpool.node.core import Leased, NodeCore
from kvpool.rpc import flag_bytes, tier_bytes, tier_usage
from kvpool.v1 import common_pb2, node_pb2, node_pb2_grpc
from kvpool.vocabulary import Tier

# Room for everything in a GetResponse besides the data: tier byte, size and checksum per key, framing.
_PER_KEY_OVERHEAD = 32
_FIXED_OVERHEAD = 4096


def _counted(method: Callable[..., Any]) -> Callable[..., Any]:
    """Count a handler's ValueErrors as ``invalid_argument`` errors, then let the interceptor map them."""

    @functools.wraps(method)
    def wrapper(self: NodeServicer, request: Any, context: Any) -> Any:
        try:
            return method(self, request, context)
        except ValueError:
            if self.errors is not None:
                self.errors.count("invalid_argument")
            raise

    return wrapper


class NodeServicer(node_pb2_grpc.NodeServicer):
    """kvpool.v1.Node over one node's :class:`NodeCore` (see the module docstring)."""

    def __init__(
        self,
        core: NodeCore,
        *,
        node_ref: common_pb2.NodeRef,
        max_message_bytes: int,
        get_seconds: Any = None,
        put_seconds: Any = None,
        lease_timeout_s: float = 5.0,
    ):
        self.core = core
        self.lease_timeout_s = lease_timeout_s
        self.node_ref = node_ref  # the daemon fills in the bound address once the server listens
        self.max_keys_per_call = core.max_keys_per_call
        self.max_message_bytes = max_message_bytes
        self.errors = core.errors
        self.get_seconds = get_seconds
        self.put_seconds = put_seconds

    # -- the service -----------------------------------------------------------------

    @_counted
    def Put(self, request: node_pb2.PutRequest, context: Any) -> node_pb2.PutResponse:
        start = time.perf_counter()
        keys = self.core.keys(request.keys)
        sizes = list(request.sizes)
        sums = list(request.checksums)
        if len(sizes) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes")
        if sums and len(sums) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(sums)} checksums (send one per key or none)")
        if sum(sizes) != len(request.data):
            raise ValueError(f"sizes sum to {sum(sizes)} bytes but data holds {len(request.data)}")
        if len(request.data) > self.max_message_bytes:
            raise ValueError(f"{len(request.data)} bytes of data exceed the limit of {self.max_message_bytes}")
        if any(s == 0 for s in sizes):
            raise ValueError(f"block {sizes.index(0)} is empty")
        data = memoryview(request.data)
        views: list[memoryview] = []
        offset = 0
        for size in sizes:
            views.append(data[offset : offset + size])
            offset += size
        stored = self.core.put(keys, views, sums or None)
        if any(stored):
            self.core.trim(keys)
        if self.put_seconds is not None:
            self.put_seconds.observe(time.perf_counter() - start)
        return node_pb2.PutResponse(stored=bytes(1 if s else 0 for s in stored))

    @_counted
    def Get(self, request: node_pb2.GetRequest, context: Any) -> node_pb2.GetResponse:
        start = time.perf_counter()
        keys = self.core.keys(request.keys)
        found = self.core.sizes(keys)
        total = sum(f[0] for f in found if f is not None)
        if total + _PER_KEY_OVERHEAD * len(keys) + _FIXED_OVERHEAD > self.max_message_bytes:
            raise ValueError(f"the {len(keys)} blocks asked for hold {total} bytes, more than one reply "
                             f"may carry ({self.max_message_bytes}); ask for fewer keys per call")
        buf = np.empty(total, dtype=np.uint8)
        want = [i for i, f in enumerate(found) if f is not None]
        metas = [f for f in found if f is not None]  # (size, checksum) per wanted key
        spans: list[tuple[int, int]] = []  # (offset, size) in buf, per wanted key
        offset = 0
        for size, _ in metas:
            spans.append((offset, size))
            offset += size
        served = self.core.load([keys[i] for i in want], [buf[o : o + n] for o, n in spans]) if want else []
        tiers: list[Tier | None] = [None] * len(keys)
        sizes = [0] * len(keys)
        sums = [0] * len(keys)
        end = 0
        for i, (o, n), (_, checksum), tier in zip(want, spans, metas, served):
            if tier is None:
                continue  # evicted since we looked: a miss, its span is dropped below
            if o != end:  # close the gap a miss left (rare: only after a race with eviction)
                buf[end : end + n] = buf[o : o + n]
            tiers[i], sizes[i], sums[i] = tier, n, checksum
            end += n
        reply = node_pb2.GetResponse(tiers=tier_bytes(tiers), sizes=sizes, checksums=sums, data=buf[:end].tobytes())
        self.core.touch(keys)
        if self.get_seconds is not None:
            self.get_seconds.observe(time.perf_counter() - start)
        return reply

    @_counted
    def Exists(self, request: node_pb2.NodeExistsRequest, context: Any) -> node_pb2.NodeExistsResponse:
        keys = self.core.keys(request.keys)
        return node_pb2.NodeExistsResponse(tiers=tier_bytes(self.core.where(keys)))

    @_counted
    def Remove(self, request: node_pb2.RemoveRequest, context: Any) -> node_pb2.RemoveResponse:
        """Drop keys from every tier; ``removed`` counts the given keys the node held (in any tier)."""
        return node_pb2.RemoveResponse(removed=self.core.remove(self.core.keys(request.keys)))

    @_counted
    def Locate(self, request: node_pb2.LocateRequest, context: Any) -> node_pb2.LocateResponse:
        keys = self.core.keys(request.keys)
        slots, gens, sizes, sums = [], [], [], []
        for ref in self.core.locate(keys, promote=request.promote):
            slot, gen, size, checksum = (0, 0, 0, 0) if ref is None else (ref.slot, ref.gen, ref.length, ref.checksum)
            slots.append(slot)
            gens.append(gen)
            sizes.append(size)
            sums.append(checksum)
        return node_pb2.LocateResponse(arena=self.core.arena_name, slots=slots, slot_gens=gens, sizes=sizes,
                                       checksums=sums)

    @_counted
    def Reserve(self, request: node_pb2.ReserveRequest, context: Any) -> node_pb2.ReserveResponse:
        keys = self.core.keys(request.keys)
        sizes = list(request.sizes)
        if len(sizes) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes")
        if any(s == 0 for s in sizes):
            raise ValueError(f"block {sizes.index(0)} is empty")
        leased = self.core.reserve(keys, sizes, self.lease_timeout_s, owner=caller(), extend=request.lease)
        return self._reserved(leased, len(keys))

    def _reserved(self, leased: Leased, n: int) -> node_pb2.ReserveResponse:
        slots, gens = [0] * n, [0] * n
        for i, (slot, gen) in leased.slots.items():
            slots[i], gens[i] = slot, gen
        return node_pb2.ReserveResponse(arena=self.core.arena_name, lease=leased.lease, slots=slots,
                                        slot_gens=gens, already_held=flag_bytes(leased.held) if leased.held else b"",
                                        lease_timeout_s=self.lease_timeout_s)

    @_counted
    def Commit(self, request: node_pb2.CommitRequest, context: Any) -> node_pb2.CommitResponse:
        start = time.perf_counter()
        keys = self.core.keys(request.keys)
        slots, sums = list(request.slots), list(request.checksums)
        if not len(slots) == len(sums) == len(keys):
            raise ValueError(f"{len(keys)} keys, {len(slots)} slots and {len(sums)} checksums: need one each per key")
        ahead = list(request.next_sizes)
        if len(ahead) > self.core.max_keys_per_call:
            raise ValueError(f"{len(ahead)} slots to lease ahead; the limit is {self.core.max_keys_per_call}")
        stored = self.core.commit(request.lease, keys, slots, sums, owner=caller(), keep=request.keep_lease)
        if any(stored):
            self.core.trim(keys)
        reply = node_pb2.CommitResponse(stored=flag_bytes(stored))
        if ahead:
            leased = self.core.lease_ahead(ahead, self.lease_timeout_s, owner=caller())
            reply.next.CopyFrom(self._reserved(leased, len(leased.slots)))
        if self.put_seconds is not None:
            self.put_seconds.observe(time.perf_counter() - start)
        return reply

    @_counted
    def FlushReports(self, request: node_pb2.FlushReportsRequest, context: Any) -> node_pb2.FlushReportsResponse:
        return node_pb2.FlushReportsResponse(indexed=self.core.flush_reports())

    @_counted
    def Info(self, request: node_pb2.InfoRequest, context: Any) -> node_pb2.InfoResponse:
        return node_pb2.InfoResponse(
            node=self.node_ref,
            tiers=[tier_usage(s) for s in self.core.stats()],
            dram_max_block_bytes=self.core.dram_max_block_bytes,
            max_keys_per_call=self.core.max_keys_per_call,
        )
