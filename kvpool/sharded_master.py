"""A :class:`~kvpool.master_client.MasterApi` over an index cut into shards: one master per shard, one answer.

:class:`ShardedMaster` holds one ``MasterApi`` per shard (``masters[k]`` serves the keys
:func:`kvpool.shards.shard_of` maps to ``k``), splits each client call's keys by shard, asks the shards in
parallel and merges their replies in the request's key order, so callers (``PoolClient``, ``ScoreClient``)
see one master. :func:`connect_master` is the one factory every client uses: ``host:port`` and one-shard
``etcd://`` clusters get today's :class:`~kvpool.master_client.MasterConnection`, a sharded cluster a
``ShardedMaster`` of one ``MasterConnection(..., shard=K)`` per shard.

Merge rules (invariants):

- ``lookup``: each shard answers the leading run *of its own keys*; the merged run ends at the first key any
  shard misses, i.e. at the earliest prompt position whose shard's run ended before it. Nodes are renumbered
  into one ``nodes`` list in order of first use (deduplicated by node id); ``dram_blocks`` / ``ssd_blocks``
  count the merged run. A shard that fails is a miss from its first key on, unless it is the only shard asked
  (then its error is raised, as from one master). Stats: ``worker_id`` and ``block_tokens`` go to every shard
  asked, ``hbm_prefix_blocks`` only to the shard of the first key, so the blocks requested and HBM hits summed
  over the shards are the cluster's. Given a ``count_lookup`` (a client's ``LookupStats.count``), a lookup
  split over shards is counted there once, merged, and its parts carry ``counted_by_caller`` so the shards
  count nothing; without one, each shard counts its part (a lookup then counts once per shard asked).
- ``exists``: split and merged in order; a failed shard's keys are absent (unless it is the only one asked).
- ``score``: exactly what one unsharded master answers for the same placement (per worker the global HBM run,
  then the pool's run after it by tier). One parallel round of ``Score`` per shard settles it whenever each
  shard's own answer covers exactly its keys in the merged window, the usual case; otherwise (a worker's HBM
  holds blocks the pool lacks, across shards) at most two more rounds of ``Score`` on windows of keys, whose
  runs are then all hits, give the exact counts (at most two calls per shard for each distinct window, so
  bounded by the workers scored). With no workers named every shard is asked (each lists the tenant's
  workers that reported HBM to it). A failed shard fails the call (the router then routes without scores).
- ``report_hbm`` / ``report_hbm_nowait``, ``name_blocks``, ``place_blocks``: split by shard (each shard keeps
  its keys' HBM holders, names and ``present`` flags; placement is the same function of the replicated
  membership on every shard). A failed shard fails the call (its error raised, or passed to ``on_error``).
  A ``full_sync`` HBM report goes to every shard, so each forgets what the worker no longer holds; an empty
  one (the worker says it is alive) to shard 0.
- ``report_lookups``, ``cluster_status``, ``info``: shard 0 (membership and tenant masks are the same on every
  shard); ``info().max_keys_per_call`` is the least of the shards' that are known, so a batch cut to it fits
  every shard.
- Node calls raise ValueError: a node links each shard separately (:mod:`kvpool.node.shard_links`).
- :func:`connect_master` reads the shard map once it is settled (:func:`kvpool.shards.settled_shard_map`):
  a client made before any master of its cluster started (or while etcd does not answer) calls shard 0's
  leader alone (none yet: UNAVAILABLE, a lookup misses) and learns the count in the background as calls
  come; it never takes a sharded cluster for one shard.
- Keys go to the shard of their *stored* key (:mod:`kvpool.shards`): with auth on, the caller's tenant mask
  (from the shards' ``Info``, asked once) applied; the keys are sent as the caller gave them (the master
  masks them itself). Until a shard has told the mask, keyed calls are UNAVAILABLE (a lookup: a miss).
- A call ends by its ``timeout``: the shards are asked at once (the calling thread asks one, a small pool of
  threads owned by the object the rest), each within the same timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import numpy as np

from kvpool.auth import MASK_BYTES, mask_keys
from kvpool.etcd import EtcdAccess, EtcdTarget
from kvpool.keys import KEY_BYTES
from kvpool.master_client import MasterApi, MasterConnection, OnError
from kvpool.shards import settled_shard_map, shards_of_packed
from kvpool.tcp import ConnectionPool
from kvpool.v1 import master_pb2
from kvpool.wire import CallError

log = logging.getLogger(__name__)

T = TypeVar("T")
SETTLE_S = 0.5  # while the shard count is not known, etcd is asked again at most this often
# Every shard's master (shard 0's first) once the cluster's shard count is settled; None until then.
Settle = Callable[[], "Sequence[MasterApi] | None"]
# Counts one lookup as the master would (hbm_blocks, the run's tier bytes, requested blocks, block_tokens):
# a client's LookupStats.count.
CountLookup = Callable[[int, bytes, int, int], None]
_NODE_CALL = ("{name}: a node links each index shard's master separately (kvpool.node.master_link); "
              "a ShardedMaster serves clients only")


class _Split:
    """A request's keys cut by shard: per shard its positions (ascending) and its packed keys."""

    def __init__(self, packed: bytes, count: int, stored: bytes | None = None):
        """``packed``: the keys as the caller sends them; ``stored``: the same keys as stored (the tenant's mask
        applied), which decide the shard (None: the same as ``packed``)."""
        if len(packed) % KEY_BYTES:
            raise ValueError(f"packed keys: {len(packed)} bytes is not a multiple of {KEY_BYTES}")
        self.n = n = len(packed) // KEY_BYTES
        self.shard = shards_of_packed(packed if stored is None else stored, count).astype(np.int64)  # its shard
        order = np.argsort(self.shard, kind="stable")  # positions grouped by shard, ascending within each
        bounds = np.concatenate(([0], np.cumsum(np.bincount(self.shard, minlength=count))))
        self.positions: list[np.ndarray] = [order[bounds[k] : bounds[k + 1]] for k in range(count)]
        rows = np.frombuffer(packed, dtype=np.uint8).reshape(n, KEY_BYTES)
        self.packed = [rows[pos].tobytes() if len(pos) else b"" for pos in self.positions]
        self.asked = [k for k, pos in enumerate(self.positions) if len(pos)]

    def end(self, k: int, run: int) -> int:
        """The prompt position where shard ``k``'s run of ``run`` of its keys ends (``n``: past the last key)."""
        pos = self.positions[k]
        return int(pos[run]) if run < len(pos) else self.n

    def first_at(self, k: int, at: int) -> int:
        """Index among shard ``k``'s keys of its first key at prompt position ``at`` or later."""
        return int(np.searchsorted(self.positions[k], at))


def _run(reply: master_pb2.LookupResponse | grpc.RpcError, keys: int) -> int:
    """How many of its ``keys`` a shard's Lookup reply covers: 0 for an error, or a reply whose fields disagree or
    name a node it does not list (then the pool client's own checks never see it: a miss from there)."""
    if isinstance(reply, grpc.RpcError):
        return 0
    run = len(reply.tiers)
    if not (len(reply.node_indexes) == len(reply.sizes) == len(reply.checksums) == run <= keys) or \
            (run and max(reply.node_indexes) >= len(reply.nodes)):
        log.debug("an index shard's Lookup reply fields disagree; its keys are a miss")
        return 0
    return run


class ShardedMaster:
    """One :class:`MasterApi` over ``masters`` (one per index shard, in shard order; see the module docstring).
    Owns them (:meth:`close`). Thread-safe."""

    def __init__(self, masters: Sequence[MasterApi], *, parallel: bool = True, count_lookup: CountLookup | None = None,
                 settle: Settle | None = None):
        """``parallel=False``: ask the shards one after another on the calling thread (no threads; for measuring
        the fan-out, ``benchmarks/shard_scale.py``). ``count_lookup`` (a client's
        :meth:`kvpool.client.lookup_stats.LookupStats.count`): a lookup split over shards is counted once, merged,
        there, and its parts ask the shards to leave their hit counters alone; None: each shard counts its part
        (a lookup then counts once per shard asked). ``settle``: the shard count is not known yet (``masters``
        is shard 0's alone, and every call goes to it); in the background, at most every ``SETTLE_S`` while
        calls come, ``settle()`` is asked for every shard's master, and once it gives them they serve."""
        if len(masters) < 1:
            raise ValueError("ShardedMaster: give one master per shard (at least one)")
        self._parallel = parallel
        self._threads: ThreadPoolExecutor | None = None
        self.masters: list[MasterApi] = []
        self.count = 0
        self._use(list(masters))
        self._mask: bytes | None = None  # this caller's tenant mask, once a shard's Info told it (b"": none)
        self._count_lookup = count_lookup
        self._settle = settle
        self._settle_lock = threading.Lock()
        self._settling = False  # a background settle() runs
        self._next_settle = 0.0

    def _use(self, masters: list[MasterApi]) -> None:
        """Serve with ``masters``, one per shard (the first is the one already serving, if any). Assigned in an
        order that keeps every caller consistent: a call that reads ``count`` finds at least that many
        ``masters``, and the thread pool before either."""
        count = len(masters)
        if count > 1 and self._parallel:
            self._threads = ThreadPoolExecutor(max_workers=count - 1, thread_name_prefix="kvpool-shards")
        self.masters = masters
        self.count = count

    def _settled(self) -> None:
        """While the shard count is not known: ask ``settle`` in the background (at most every ``SETTLE_S``)."""
        if self._settle is None:
            return
        now = time.monotonic()
        with self._settle_lock:
            if self._settling or now < self._next_settle:
                return
            self._settling, self._next_settle = True, now + SETTLE_S
        threading.Thread(target=self._settle_once, name="kvpool-shard-map", daemon=True).start()

    def _settle_once(self) -> None:
        try:
            settle = self._settle
            masters = settle() if settle is not None else None
            if masters is not None:
                self._use([self.masters[0], *masters[1:]])
                self._settle = None
                if self.count > 1:
                    log.info("kvpool: the cluster has %d index shards: a master per shard from now on", self.count)
        except Exception as exc:  # noqa: BLE001 - a background thread: say it, ask again later
            log.warning("kvpool: reading the shard map failed: %r", exc)
        finally:
            with self._settle_lock:
                self._settling = False

    def _split(self, packed: bytes) -> _Split:
        """``packed`` cut by the shards of its stored keys (:mod:`kvpool.shards`: with auth on, a tenant's key is
        stored masked, and the stored key decides its shard); UNAVAILABLE while no shard's ``Info`` has told
        this caller's tenant mask."""
        self._settled()
        if self.count == 1:
            return _Split(packed, 1)
        if self._mask is None:
            for master in self.masters:  # the mask is the same on every shard; Info is asked once per master
                info = master.info()
                if info is not None:
                    if len(info.tenant_mask) not in (0, MASK_BYTES):
                        raise CallError(grpc.StatusCode.INTERNAL, f"the master sent a tenant mask of "
                                        f"{len(info.tenant_mask)} bytes")
                    self._mask = bytes(info.tenant_mask)
                    break
            else:
                raise CallError(grpc.StatusCode.UNAVAILABLE, "no index shard's master answered Info: the tenant "
                                "mask that places this caller's keys in shards is not known yet")
        return _Split(packed, self.count, mask_keys(packed, self._mask) if self._mask else None)

    # -- the parallel fan-out ----------------------------------------------------------------

    def _each(self, shards: Sequence[int], call: Callable[[int], T]) -> dict[int, T | grpc.RpcError]:
        """``call(k)`` for each shard ``k`` at once (the last on this thread); per shard its answer or error."""
        futures: dict[int, Future[T]] = {}
        if self._threads is not None:
            for k in shards[:-1]:
                futures[k] = self._threads.submit(call, k)
        out: dict[int, T | grpc.RpcError] = {}
        for k in shards[len(futures):]:
            try:
                out[k] = call(k)
            except grpc.RpcError as exc:
                out[k] = exc
        for k, future in futures.items():
            try:
                out[k] = future.result()
            except grpc.RpcError as exc:
                out[k] = exc
        return out

    @staticmethod
    def _all(replies: dict[int, T | grpc.RpcError]) -> dict[int, T]:
        """The replies, or the first shard's error raised if any failed."""
        for reply in replies.values():
            if isinstance(reply, grpc.RpcError):
                raise reply
        return replies  # type: ignore[return-value]

    @staticmethod
    def _only_fault(replies: dict[int, Any]) -> None:
        """Raise the error when the one shard asked (or every shard asked) failed: then it is the master's."""
        failed = [r for r in replies.values() if isinstance(r, grpc.RpcError)]
        if failed and len(failed) == len(replies):
            raise failed[0]
        for reply in failed:
            log.debug("an index shard failed (%s); its keys are a miss", reply)

    # -- clients -------------------------------------------------------------------------------

    def lookup(self, request: master_pb2.LookupRequest, timeout: float | None) -> master_pb2.LookupResponse:
        split = self._split(request.keys)
        if not split.asked:
            return self.masters[0].lookup(request, timeout)
        first = int(split.shard[0])
        counted_here = self._count_lookup is not None and len(split.asked) > 1

        def ask(k: int) -> master_pb2.LookupResponse:
            return self.masters[k].lookup(master_pb2.LookupRequest(
                keys=split.packed[k], worker_id=request.worker_id, block_tokens=request.block_tokens,
                hbm_prefix_blocks=request.hbm_prefix_blocks if k == first else 0, counted_by_caller=counted_here),
                timeout)

        replies = self._each(split.asked, ask)
        self._only_fault(replies)
        if len(split.asked) == 1:
            return replies[first]  # type: ignore[return-value]
        end = min(split.end(k, _run(r, len(split.positions[k]))) for k, r in replies.items())
        merged = self._merge_run(split, replies, end)  # type: ignore[arg-type]
        if self._count_lookup is not None:
            self._count_lookup(request.hbm_prefix_blocks, merged.tiers,
                               request.hbm_prefix_blocks + len(request.keys) // KEY_BYTES, request.block_tokens)
        return merged

    @staticmethod
    def _merge_run(split: _Split, replies: dict[int, master_pb2.LookupResponse], end: int) -> \
            master_pb2.LookupResponse:
        """The leading run of ``end`` prompt positions from the shards' runs (each covers its keys before
        ``end``), its nodes renumbered in order of first use."""
        tiers: list[bytes] = []
        sizes: list[int] = []
        checksums: list[int] = []
        node_indexes: list[np.ndarray] = []
        refs: list[Any] = []  # every shard's NodeRefs, one after another
        at: list[np.ndarray] = []
        for k, reply in replies.items():
            m = split.first_at(k, end)  # its keys before ``end``, all in its run
            if not m:
                continue
            at.append(split.positions[k][:m])
            tiers.append(reply.tiers[:m])
            sizes += reply.sizes[:m]
            checksums += reply.checksums[:m]
            node_indexes.append(np.asarray(reply.node_indexes[:m], dtype=np.int64) + len(refs))
            refs += reply.nodes
        if not at:
            return master_pb2.LookupResponse()
        order = np.argsort(np.concatenate(at)).tolist()  # merged position -> its entry in the shards' lists
        merged_tiers = np.frombuffer(b"".join(tiers), dtype=np.uint8)[order].tobytes()
        response = master_pb2.LookupResponse(tiers=merged_tiers, sizes=[sizes[i] for i in order],
                                             checksums=[checksums[i] for i in order],
                                             dram_blocks=merged_tiers.count(1), ssd_blocks=merged_tiers.count(2))
        ids = {ref.node_id for ref in refs}
        if len(ids) == 1:  # the usual case: one node holds the run
            response.nodes.append(refs[0])
            response.node_indexes.extend([0] * end)
            return response
        by_entry = np.concatenate(node_indexes)[order]  # per merged position: an index into ``refs``
        numbers: dict[str, int] = {}  # node id -> index into response.nodes, in order of first use
        renumber = np.empty(len(refs), dtype=np.int64)
        used, first = np.unique(by_entry, return_index=True)
        for u in used[np.argsort(first)].tolist():
            ref = refs[u]
            if ref.node_id not in numbers:
                numbers[ref.node_id] = len(numbers)
                response.nodes.append(ref)
            renumber[u] = numbers[ref.node_id]
        response.node_indexes.extend(renumber[by_entry].tolist())
        return response

    def exists(self, request: master_pb2.ExistsRequest, timeout: float | None) -> master_pb2.ExistsResponse:
        split = self._split(request.keys)
        if len(split.asked) <= 1:
            k = split.asked[0] if split.asked else 0
            return self.masters[k].exists(request, timeout)
        replies = self._each(split.asked, lambda k: self.masters[k].exists(
            master_pb2.ExistsRequest(keys=split.packed[k]), timeout))
        self._only_fault(replies)
        present = np.zeros(split.n, dtype=np.uint8)
        for k, reply in replies.items():
            if isinstance(reply, master_pb2.ExistsResponse):
                flags = np.frombuffer(reply.present, dtype=np.uint8)
                pos = split.positions[k][: len(flags)]
                present[pos] = flags[: len(pos)]
        return master_pb2.ExistsResponse(present=present.tobytes())

    def place_blocks(self, request: master_pb2.PlaceBlocksRequest,
                     timeout: float | None) -> master_pb2.PlaceBlocksResponse:
        split = self._split(request.keys)
        if len(request.sizes) != split.n:
            raise ValueError(f"sizes: {len(request.sizes)} values for {split.n} keys")
        if len(split.asked) <= 1:
            return self.masters[split.asked[0] if split.asked else 0].place_blocks(request, timeout)
        sizes = list(request.sizes)
        replies = self._all(self._each(split.asked, lambda k: self.masters[k].place_blocks(
            master_pb2.PlaceBlocksRequest(keys=split.packed[k], sizes=[sizes[i] for i in split.positions[k]]),
            timeout)))
        present = bytearray(split.n)
        too_large = bytearray(split.n)
        chosen = [0] * split.n
        response = master_pb2.PlaceBlocksResponse()
        order: dict[str, int] = {}
        for k, reply in replies.items():
            big = reply.too_large or bytes(len(reply.node_indexes))
            mine = len(split.positions[k])
            if not len(reply.present) == len(reply.node_indexes) == len(big) == mine or any(
                    n >= len(reply.nodes) and not b for n, b in zip(reply.node_indexes, big)):
                raise CallError(grpc.StatusCode.INTERNAL, f"PlaceBlocks: index shard {k}'s reply fields disagree")
            for j, i in enumerate(split.positions[k]):
                present[i], too_large[i] = reply.present[j], big[j]
                if big[j]:
                    continue
                ref = reply.nodes[reply.node_indexes[j]]
                if ref.node_id not in order:
                    order[ref.node_id] = len(order)
                    response.nodes.append(ref)
                chosen[i] = order[ref.node_id]
        response.node_indexes.extend(chosen)
        response.present = bytes(present)
        if any(too_large):
            response.too_large = bytes(too_large)
        return response

    def name_blocks(self, request: master_pb2.NameBlocksRequest,
                    timeout: float | None) -> master_pb2.NameBlocksResponse:
        split = self._split(request.keys)
        if len(request.engine_hashes) != split.n:
            raise ValueError(f"engine_hashes: {len(request.engine_hashes)} values for {split.n} keys")
        hashes = list(request.engine_hashes)
        replies = self._all(self._each(split.asked, lambda k: self.masters[k].name_blocks(
            master_pb2.NameBlocksRequest(keys=split.packed[k], engine_hashes=[hashes[i] for i in split.positions[k]]),
            timeout)))
        return master_pb2.NameBlocksResponse(named=sum(r.named for r in replies.values()))

    def _hbm_parts(self, request: master_pb2.ReportHbmRequest) -> dict[int, master_pb2.ReportHbmRequest]:
        added, removed = self._split(request.added_keys), self._split(request.removed_keys)
        shards = range(self.count) if request.full_sync else sorted(set(added.asked) | set(removed.asked)) or [0]
        return {k: master_pb2.ReportHbmRequest(worker_id=request.worker_id, added_keys=added.packed[k],
                                               removed_keys=removed.packed[k], full_sync=request.full_sync)
                for k in shards}

    def report_hbm(self, request: master_pb2.ReportHbmRequest,
                   timeout: float | None) -> master_pb2.ReportHbmResponse:
        parts = self._hbm_parts(request)
        self._all(self._each(list(parts), lambda k: self.masters[k].report_hbm(parts[k], timeout)))
        return master_pb2.ReportHbmResponse()

    def report_hbm_nowait(self, request: master_pb2.ReportHbmRequest, timeout: float | None,
                          on_error: OnError) -> None:
        for k, part in self._hbm_parts(request).items():
            self.masters[k].report_hbm_nowait(part, timeout, on_error)

    def report_lookups(self, request: master_pb2.ReportLookupsRequest,
                       timeout: float | None) -> master_pb2.ReportLookupsResponse:
        return self.masters[0].report_lookups(request, timeout)

    def info(self) -> master_pb2.MasterInfoResponse | None:
        first = self.masters[0].info()
        if first is None or self.count == 1:
            return first
        limits = [i.max_keys_per_call for m in self.masters[1:] if (i := m.info()) is not None and
                  i.max_keys_per_call]
        if first.max_keys_per_call and limits and min(limits) < first.max_keys_per_call:
            merged = master_pb2.MasterInfoResponse()
            merged.CopyFrom(first)
            merged.max_keys_per_call = min(limits)
            return merged
        return first

    # -- routers and operators ------------------------------------------------------------------

    def score(self, request: master_pb2.ScoreRequest, timeout: float | None) -> master_pb2.ScoreResponse:
        split = self._split(request.keys)
        workers = list(request.worker_ids)
        # No workers named: each shard lists the tenant's workers that reported HBM to it; all are asked.
        shards = split.asked if workers else list(range(self.count))
        if len(shards) <= 1:
            return self.masters[shards[0] if shards else 0].score(request, timeout)
        replies = self._all(self._each(shards, lambda k: self.masters[k].score(
            master_pb2.ScoreRequest(keys=split.packed[k], worker_ids=workers), timeout)))
        return _ScoreMerge(self, split, replies, timeout, bool(workers)).merged()

    def cluster_status(self, request: master_pb2.ClusterStatusRequest,
                       timeout: float | None) -> master_pb2.ClusterStatusResponse:
        return self.masters[0].cluster_status(request, timeout)

    # -- nodes (not through here) -------------------------------------------------------------------

    def register_node(self, request: master_pb2.RegisterNodeRequest,
                      timeout: float | None) -> master_pb2.RegisterNodeResponse:
        raise ValueError(_NODE_CALL.format(name="RegisterNode"))

    def heartbeat(self, request: master_pb2.HeartbeatRequest,
                  timeout: float | None) -> master_pb2.HeartbeatResponse:
        raise ValueError(_NODE_CALL.format(name="Heartbeat"))

    def report_blocks(self, request: master_pb2.ReportBlocksRequest,
                      timeout: float | None) -> master_pb2.ReportBlocksResponse:
        raise ValueError(_NODE_CALL.format(name="ReportBlocks"))

    def unregister_node(self, request: master_pb2.UnregisterNodeRequest,
                        timeout: float | None) -> master_pb2.UnregisterNodeResponse:
        raise ValueError(_NODE_CALL.format(name="UnregisterNode"))

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False)
        for master in self.masters:
            master.close()


class _ScoreMerge:
    """Per worker (and for a worker with empty HBM) the unsharded master's Score from the shards' (see the
    module docstring): the global HBM run ``H`` is where the first shard's HBM run ends; the pool's run from
    ``H`` ends at ``E``, the first position at or after ``H`` any shard's pool lacks; its DRAM and SSD blocks
    are the shards' blocks in ``[H, E)``."""

    def __init__(self, sharded: ShardedMaster, split: _Split, replies: dict[int, master_pb2.ScoreResponse],
                 timeout: float | None, named: bool):
        self._sharded, self._split, self._replies, self._timeout = sharded, split, replies, timeout
        self._shards = list(replies)  # the shards asked, in shard order
        self._named = named

    def _pool_run(self, k: int, keys_from: int, stop: int | None = None) -> tuple[int, int]:
        """Shard ``k``'s pool run (dram, ssd) over its keys from index ``keys_from`` (before position ``stop``)."""
        pos = self._split.positions[k]
        upto = len(pos) if stop is None else self._split.first_at(k, stop)
        keys = self._split.packed[k][keys_from * KEY_BYTES : upto * KEY_BYTES]
        if not keys:
            return 0, 0
        reply = self._sharded.masters[k].score(master_pb2.ScoreRequest(keys=keys), self._timeout)
        return reply.pool_dram_blocks, reply.pool_ssd_blocks

    def _run_from(self, start: int, held: dict[int, int], answered: dict[int, tuple[int, int]]) -> tuple[int, int]:
        """(dram, ssd) of the pool's run from prompt position ``start``: ``held[k]`` is shard ``k``'s HBM run
        (in its keys), ``answered[k]`` the shard's pool run from there."""
        split = self._split
        aligned = all(split.first_at(k, start) == held[k] for k in self._shards)
        if aligned:
            ends = {k: split.end(k, held[k] + sum(answered[k])) for k in self._shards}
        else:  # some shard's HBM covers keys after ``start``: its pool run from ``start`` is not known yet
            starts = {k: split.first_at(k, start) for k in self._shards}
            fresh = self._sharded._all(self._sharded._each(self._shards, lambda k: self._pool_run(k, starts[k])))
            answered = {k: fresh[k] for k in self._shards}
            ends = {k: split.end(k, starts[k] + sum(answered[k])) for k in self._shards}
            held = starts
        end = min(ends.values())
        dram = ssd = 0
        for k in self._shards:
            if ends[k] == split.end(k, split.first_at(k, end)):  # its run stops at its first key from ``end`` on
                d, s = answered[k]
            else:  # its run goes past ``end``: count its keys in [start, end) alone (all held by the pool)
                d, s = self._pool_run(k, held[k], end)
            dram, ssd = dram + d, ssd + s
        return dram, ssd

    def merged(self) -> master_pb2.ScoreResponse:
        split, replies = self._split, self._replies
        response = master_pb2.ScoreResponse()
        zero = {k: 0 for k in self._shards}
        response.pool_dram_blocks, response.pool_ssd_blocks = self._run_from(
            0, zero, {k: (r.pool_dram_blocks, r.pool_ssd_blocks) for k, r in replies.items()})
        per_shard = {k: {w.worker_id: w for w in r.workers} for k, r in replies.items()}
        for worker in self._workers():
            scores = {k: per_shard[k].get(worker) for k in self._shards}
            # A shard that does not list the worker knows no HBM of it there: its run is the pool's from 0.
            held = {k: (s.hbm_blocks if s is not None else 0) for k, s in scores.items()}
            answered = {k: ((s.dram_blocks, s.ssd_blocks) if s is not None else
                            (replies[k].pool_dram_blocks, replies[k].pool_ssd_blocks)) for k, s in scores.items()}
            hbm = min(split.end(k, held[k]) for k in self._shards)
            dram, ssd = self._run_from(hbm, held, answered)
            response.workers.append(master_pb2.WorkerScore(worker_id=worker, hbm_blocks=hbm, dram_blocks=dram,
                                                           ssd_blocks=ssd))
        return response

    def _workers(self) -> list[str]:
        """The workers scored: the ones named, as the first shard answers them, else (none named: each shard
        lists the tenant's workers that reported HBM to it) every shard's, by id, as one master lists them."""
        if self._named:
            return [w.worker_id for w in self._replies[self._shards[0]].workers]
        return sorted({w.worker_id for r in self._replies.values() for w in r.workers})


def connect_master(master: str, *, pool: ConnectionPool | None, timeout_s: float, max_message_bytes: int,
                   token: str = "", tls_ca: str = "", etcd_access: EtcdAccess | None = None,
                   refuse_start: bool = False, count_lookup: CountLookup | None = None) -> MasterApi:
    """The client's master for ``master`` (``host:port`` or ``etcd://HOST:PORT[,...]/CLUSTER``): a
    :class:`MasterConnection` for ``host:port`` and for a cluster of one index shard (exactly today's object), a
    :class:`ShardedMaster` of one ``MasterConnection(..., shard=K)`` per shard when the cluster's shard map
    says more. While the count is not settled (:func:`kvpool.shards.settled_shard_map`: no master of the cluster
    has started yet, or etcd cannot be reached), a :class:`ShardedMaster` of shard 0's connection alone that
    learns the count in the background as calls come. ``count_lookup``: see :class:`ShardedMaster`."""
    kw: dict[str, Any] = dict(pool=pool, timeout_s=timeout_s, max_message_bytes=max_message_bytes, token=token,
                              tls_ca=tls_ca, etcd_access=etcd_access, refuse_start=refuse_start)
    first = MasterConnection(master, **kw)
    target = EtcdTarget.parse(master)
    etcd = first.etcd
    if target is None or etcd is None:
        return first
    kw["refuse_start"] = False  # (etcd accepted us once: later connections log a refusal, as the first does)

    def shards(count: int) -> list[MasterApi]:
        made: list[MasterApi] = [first]
        try:
            for k in range(1, count):
                made.append(MasterConnection(master, shard=k, **kw))
        except BaseException:
            for m in made[1:]:
                m.close()
            raise
        return made

    def settle() -> list[MasterApi] | None:
        try:
            found = settled_shard_map(etcd, target.cluster, timeout=min(timeout_s, 2.0))
        except (grpc.RpcError, CallError) as exc:
            log.debug("kvpool: cannot read the shard map of %s (%s); asking again", master, exc)
            return None
        return shards(found.count) if found is not None else None

    try:
        settled = settle()
    except ValueError as exc:
        first.close()
        raise ValueError(f"{master}: {exc}") from None
    if settled is None:
        log.info("kvpool: the shard count of %s is not known yet (no master has started, or etcd does not "
                 "answer); shard 0 serves until it is", master)
        return ShardedMaster([first], count_lookup=count_lookup, settle=settle)
    return first if len(settled) == 1 else ShardedMaster(settled, count_lookup=count_lookup)
