"""The Master gRPC service: validate, translate proto <-> domain, delegate.

Invariants:

- Every request is validated in full before anything changes: malformed
  packed keys, parallel fields whose lengths differ from the key count, more
  than ``max_keys_per_call`` keys, unknown tiers, an empty node id, a worker
  id that :mod:`kvpool.worker_ids` refuses (any call: 1 to 256 characters, no
  control characters) are a ValueError, which
  :class:`kvpool.rpc.ErrorInterceptor` answers with INVALID_ARGUMENT and the
  message.
- Workers are their tenant's: Lookup, ReportHbm, ReportLookups and Score key a worker by its
  scoped id (:func:`kvpool.worker_ids.scoped_id` of the caller's tenant), so
  no call of one tenant reads, changes, refreshes or lists another tenant's
  workers; a Score naming another tenant's worker id scores the caller's own
  worker of that name (unknown: empty HBM). A tenant's new worker past
  ``max_workers_per_tenant`` is INVALID_ARGUMENT naming the setting.
- Lookup counts a client reports (ReportLookups, Lookup's
  ``hbm_prefix_blocks`` and ``block_tokens``) are checked against
  what that many lookups can hold (:meth:`MasterServicer._check_reported`);
  a report out of bounds is INVALID_ARGUMENT and counts nothing. Counts are
  recorded under the caller's tenant (the ``tenant`` label).
- Score's work is bounded: duplicate worker ids are answered once (first
  seen order), and keys x distinct workers is at most
  :data:`MAX_SCORE_CELLS`; the HBM index's lock is taken per worker.
- An unknown node id or stale incarnation in Heartbeat / ReportBlocks is not
  an error: the answer is ``known = false`` and the node registers again.
  UnregisterNode of an unknown node is a no-op.
- No live node for PlaceBlocks is UNAVAILABLE ("no pool nodes"). A block no
  live node takes (larger than every node's DRAM and SSD limits) is flagged
  ``too_large`` in the reply, counted (``kvpool_errors_total{kind=
  "block_too_large"}``, ``ClusterStatus.blocks_too_large``) and logged once
  with the setting to change; the rest of the batch is placed.
- A NodeRef string longer than ``MAX_REF_CHARS`` is INVALID_ARGUMENT: refs
  are echoed in every Lookup / PlaceBlocks / ClusterStatus reply.
- Keys a client names (Lookup, Exists, PlaceBlocks, ReportHbm, Score, NameBlocks) are mapped to
  its tenant's stored keys (:func:`kvpool.auth.caller_keys`) before the index
  sees them; nodes report stored keys as they are. With auth off both are
  the keys as sent.
- Lookup returns only blocks whose node still resolves: a run entry on a node
  dropped mid-call ends the run there (a miss, never a dangling reference).
- A master of index shard K of S (``shards`` > 1) takes in ReportBlocks (a node's full sync too) only keys
  whose :func:`kvpool.shards.shard_of` is K: a report naming another shard's key is INVALID_ARGUMENT and
  changes nothing. Lookup, Exists and Score of another shard's keys miss (the index never holds them).
- On a standby (an election says this master does not lead) every call but
  ``Info`` is UNAVAILABLE before it reads or changes anything; ``Info`` says
  ``standby`` and where the leader is.
- Every accepted change to membership and index (RegisterNode,
  UnregisterNode, ReportBlocks known) is applied and noted in the change log
  as one step (:meth:`~kvpool.master.changelog.ChangeLog.applying`): what warm
  standbys follow with ``Follow`` and ``Snapshot`` (leader only; with auth on,
  the master token only: the stream is every tenant's keys).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import grpc
import numpy as np

from kvpool import __version__
from kvpool.auth import ROLE_CLIENT, caller, caller_keys, caller_tenant
from kvpool.config import MasterConfig
from kvpool.keys import KEY_BYTES, BlockKey, unpack_keys
from kvpool.master.changelog import ChangeLog, followed_node
from kvpool.master.engine_names import EngineNames
from kvpool.master.index import BlockIndex, HbmIndex
from kvpool.master.lookup_reply import RunReply, encode_runs, lookup_replies, node_field, reply
from kvpool.master.membership import Membership
from kvpool.master.stats import MasterMetrics
from kvpool.placement import TOO_LARGE, Candidate, NoPoolNodes, place
from kvpool.rpc import flag_bytes, tier_usage
from kvpool.shards import foreign_keys
from kvpool.v1 import common_pb2, master_pb2, master_pb2_grpc
from kvpool.vocabulary import NO_TIER, NodeRef, Tier, TierStats
from kvpool.worker_ids import check_worker_id, scoped_id

_NODE_TIERS = (Tier.DRAM, Tier.SSD)
MAX_REF_CHARS = 1024  # longest NodeRef string field RegisterNode accepts
MAX_SCORE_WORKERS = 4096  # most worker ids one Score call may name (duplicates included)
# Most keys x distinct workers one Score may ask for: its work (one HBM set lookup per cell, at worst) is about
# 0.1 s of master CPU. A router's real calls (e.g. 512 keys x 64 workers, 32,768) are far below it.
MAX_SCORE_CELLS = 1 << 21
MAX_REPORTED_LOOKUPS = 1 << 22  # most lookups one ReportLookups may report (clients: ~1 s worth)
MAX_BLOCK_TOKENS = 1 << 20  # most tokens per block a Lookup or ReportLookups may say
_U64_MAX = (1 << 64) - 1


class MasterServicer(master_pb2_grpc.MasterServicer):
    """The ``kvpool.v1.Master`` service over an index, a membership table and metrics."""

    def __init__(
        self, config: MasterConfig, index: BlockIndex, hbm: HbmIndex, membership: Membership, metrics: MasterMetrics,
        names: EngineNames | None = None,
    ):
        self._config = config
        self._index = index
        self._hbm = hbm
        self._membership = membership
        self._metrics = metrics
        self.call_port = 0  # the fast-call listener's port, once bound (0: none)
        # With an election (MasterServer, etcd): whether this master leads now, and where the leader is.
        self.leading: Callable[[], bool] = lambda: True
        self.leader_address: Callable[[], str] = lambda: ""
        self.cluster = ""
        self.shard, self.shard_count = config.shard, config.shards  # this group's index shard, of how many
        self._elected_at = 0.0  # monotonic time of this master's last election (0: never, or no etcd)
        self._resyncing: set[str] = set()  # nodes that registered soon after it, their inventories not yet whole
        self.names = names  # engines' block hashes for KV events (None: events off)
        self.events_server_key = ""  # the KV event ports' CURVE public key, told to clients (auth and events on)
        self._lookup = LookupSteps(self)
        self.together = {"Lookup": self._lookup}  # fast calls answered together (kvpool.wire.Together)
        self.changes = ChangeLog(membership, index)  # off until reset(on=True): MasterServer turns it on when leading

    def elected(self) -> None:
        """This master was just elected: nodes registering within ``node_timeout_s`` count as following from the
        old leader, and the time until each one's inventory is whole is observed."""
        self._resyncing.clear()
        self._elected_at = time.monotonic()

    def _lead(self, context: Any) -> None:
        """UNAVAILABLE on a standby: only the leader serves nodes and clients (they follow it, see
        :mod:`kvpool.master_client`)."""
        if not self.leading():
            where = self.leader_address()
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"standby master of cluster {self.cluster}: not the leader"
                          + (f" (the leader is {where})" if where else " (no leader elected yet)"))

    # -- validation helpers -------------------------------------------------------------

    def _count_keys(self, packed: bytes, what: str = "keys") -> int:
        """How many keys ``packed`` holds; ValueError if it is ragged or over max_keys_per_call."""
        if len(packed) % KEY_BYTES:
            raise ValueError(f"packed {what}: {len(packed)} bytes is not a multiple of {KEY_BYTES}")
        n = len(packed) // KEY_BYTES
        most = self._config.server.max_keys_per_call
        if n > most:
            raise ValueError(f"too many keys in {what}: {n} > max_keys_per_call {most}")
        return n

    def _keys(self, packed: bytes, what: str = "keys") -> list[BlockKey]:
        self._count_keys(packed, what)
        return unpack_keys(packed)

    def _client_keys(self, packed: bytes, what: str = "keys") -> list[BlockKey]:
        """Like :meth:`_keys`, as the calling client's tenant's stored keys."""
        self._count_keys(packed, what)
        return unpack_keys(caller_keys(packed))

    def _worker(self, worker_id: str, where: str) -> str:
        """The scoped id of a worker the caller named; ValueError if it is no valid worker id."""
        return scoped_id(caller_tenant(), check_worker_id(worker_id, where))

    def _check_reported(self, request: master_pb2.ReportLookupsRequest) -> None:
        """ValueError unless the counts of a ReportLookups are what that many lookups can hold.

        Per lookup at most ``max_hbm_keys_per_worker`` HBM hits (a longer HBM prefix is more than the master
        keeps of any worker), ``max_keys_per_call`` pool hits, and the two together asked for; hits at most
        the blocks asked for; at most :data:`MAX_REPORTED_LOOKUPS` lookups and :data:`MAX_BLOCK_TOKENS`
        tokens a block. Clients report about a second's lookups at a time.
        """
        r = request
        hbm_most, pool_most = self._config.max_hbm_keys_per_worker, self._config.server.max_keys_per_call
        self._check_block_tokens("ReportLookups", r.block_tokens)
        if r.lookups > MAX_REPORTED_LOOKUPS:
            raise ValueError(f"ReportLookups: lookups {r.lookups} > {MAX_REPORTED_LOOKUPS} in one report")
        for field, count, most in (("hbm_blocks", r.hbm_blocks, hbm_most),
                                   ("dram_blocks + ssd_blocks", r.dram_blocks + r.ssd_blocks, pool_most),
                                   ("requested_blocks", r.requested_blocks, hbm_most + pool_most)):
            if count > r.lookups * most:
                raise ValueError(f"ReportLookups: {field} {count} > {most} a lookup x lookups {r.lookups}")
        hits = r.hbm_blocks + r.dram_blocks + r.ssd_blocks
        if hits > r.requested_blocks:
            raise ValueError(f"ReportLookups: {hits} hits (hbm + dram + ssd) but requested_blocks "
                             f"{r.requested_blocks}")

    def _check_shard(self, packed: bytes, field: str) -> None:
        """ValueError unless every key in ``packed`` is this master's index shard's (:func:`kvpool.shards.shard_of`):
        a master never indexes another shard's keys."""
        foreign = foreign_keys(packed, self.shard_count, self.shard)
        if foreign:
            raise ValueError(f"ReportBlocks: {foreign} of the {field} belong to another index shard than this "
                             f"master's ({self.shard} of {self.shard_count}); report each key to its shard's leader")

    @staticmethod
    def _check_block_tokens(where: str, block_tokens: int) -> None:
        if block_tokens > MAX_BLOCK_TOKENS:
            raise ValueError(f"{where}: block_tokens {block_tokens} > {MAX_BLOCK_TOKENS}")

    @staticmethod
    def _same_length(keys: Sequence[BlockKey], field: str, values: Sequence[int]) -> None:
        if len(values) != len(keys):
            raise ValueError(f"{field}: {len(values)} values for {len(keys)} keys")

    @staticmethod
    def _tier(value: int, allowed: Iterable[Tier] = _NODE_TIERS) -> Tier:
        allowed = tuple(allowed)
        if value not in [int(t) for t in allowed]:
            names = ", ".join(f"TIER_{t.name}" for t in allowed)
            raise ValueError(f"tier {value} is not one of {names}")
        return Tier(value)

    def _tier_stats(self, usage: Iterable[common_pb2.TierUsage]) -> list[TierStats]:
        stats: list[TierStats] = []
        for u in usage:
            tier = self._tier(u.tier)
            if any(s.tier == tier for s in stats):
                raise ValueError(f"tier TIER_{tier.name} reported twice")
            stats.append(TierStats(tier, capacity_bytes=u.capacity_bytes, used_bytes=u.used_bytes, blocks=u.blocks))
        return stats

    @staticmethod
    @functools.lru_cache(maxsize=4096)
    def _node_ref(ref: NodeRef) -> common_pb2.NodeRef:
        """The wire form of ``ref``, made once per ref (a reply copies it in; nobody changes it)."""
        return common_pb2.NodeRef(
            node_id=ref.node_id, address=ref.address, host_id=ref.host_id, arena=ref.arena,
            data_address=ref.data_address,
        )

    @staticmethod
    @functools.lru_cache(maxsize=4096)
    def _node_field(ref: NodeRef) -> bytes:
        """:meth:`_node_ref` as a Lookup reply's ``nodes`` field (:func:`~kvpool.master.lookup_reply.node_field`),
        made once per ref."""
        return node_field(MasterServicer._node_ref(ref).SerializeToString())

    # -- nodes ----------------------------------------------------------------------------

    def RegisterNode(self, request: master_pb2.RegisterNodeRequest, context: Any) -> master_pb2.RegisterNodeResponse:
        self._lead(context)
        ref = request.node
        if not ref.node_id:
            raise ValueError("RegisterNode: node.node_id must not be empty")
        for field in ("node_id", "address", "host_id", "arena", "data_address"):
            # Every NodeRef is echoed in Lookup / PlaceBlocks / ClusterStatus replies: a huge one would push
            # those replies over the message limit for every caller.
            if len(getattr(ref, field)) > MAX_REF_CHARS:
                raise ValueError(f"RegisterNode: node.{field} is longer than {MAX_REF_CHARS} characters")
        if not ref.address:
            raise ValueError(f"RegisterNode: node {ref.node_id!r} has no address")
        tiers = self._tier_stats(request.tiers)
        with self.changes.applying() as note:
            info = self._membership.register(
                NodeRef(ref.node_id, ref.address, ref.host_id, ref.arena, ref.data_address), tiers,
                request.dram_max_block_bytes, request.max_block_bytes,
            )
            note(master_pb2.IndexChange(joined=followed_node(info)), 0)
        if self._elected_at and time.monotonic() - self._elected_at <= self._config.node_timeout_s:
            self._resyncing.add(ref.node_id)
        return master_pb2.RegisterNodeResponse(
            incarnation=info.incarnation,
            heartbeat_interval_s=self._config.heartbeat_interval_s,
            node_timeout_s=self._config.node_timeout_s,
            max_keys_per_call=self._config.server.max_keys_per_call,
        )

    def Heartbeat(self, request: master_pb2.HeartbeatRequest, context: Any) -> master_pb2.HeartbeatResponse:
        self._lead(context)
        tiers = self._tier_stats(request.tiers)
        known = self._membership.heartbeat(request.node_id, request.incarnation, tiers)
        return master_pb2.HeartbeatResponse(known=known)

    def ReportBlocks(self, request: master_pb2.ReportBlocksRequest, context: Any) -> master_pb2.ReportBlocksResponse:
        self._lead(context)
        tier = self._tier(request.tier)
        added = self._keys(request.added_keys, "added_keys")
        removed = self._keys(request.removed_keys, "removed_keys")
        self._check_shard(request.added_keys, "added_keys")
        self._check_shard(request.removed_keys, "removed_keys")
        self._same_length(added, "added_sizes", request.added_sizes)
        self._same_length(added, "added_checksums", request.added_checksums)
        number = self._membership.touch(request.node_id, request.incarnation)
        if number is None:
            return master_pb2.ReportBlocksResponse(known=False)
        sizes, checksums = list(request.added_sizes), list(request.added_checksums)
        with self.changes.applying() as note:
            if request.full_sync:
                known = self._index.replace_node_tier(number, tier, added, sizes, checksums)
            else:
                known = self._index.add(number, tier, added, sizes, checksums) if added else True
            if removed:  # after the additions: a key in both lists ends up absent
                known = self._index.remove(number, tier, removed) and known
            if known:
                note(functools.partial(_followed_blocks, number, request), len(added) + len(removed))
        if request.sync_complete and known:
            self._membership.synced(request.node_id, request.incarnation)  # its inherited entries go (if any)
        if request.sync_complete and known and request.node_id in self._resyncing:
            try:
                self._resyncing.remove(request.node_id)
            except KeyError:  # a concurrent report of the same node counted it
                pass
            else:
                self._metrics.failover_resync_seconds.observe(time.monotonic() - self._elected_at)
        return master_pb2.ReportBlocksResponse(known=known)

    def UnregisterNode(
        self, request: master_pb2.UnregisterNodeRequest, context: Any
    ) -> master_pb2.UnregisterNodeResponse:
        self._lead(context)
        with self.changes.applying() as note:
            if self._membership.unregister(request.node_id, request.incarnation):
                note(master_pb2.IndexChange(left=request.node_id), 0)
        return master_pb2.UnregisterNodeResponse()

    # -- warm standbys --------------------------------------------------------------------

    def Follow(self, request: master_pb2.FollowRequest, context: Any) -> master_pb2.FollowResponse:
        """The change log after ``after_seq`` (:mod:`~kvpool.master.changelog`)."""
        self._lead(context)
        return self.changes.follow(request.log_id, request.after_seq)

    def Snapshot(self, request: master_pb2.SnapshotRequest, context: Any) -> master_pb2.SnapshotResponse:
        """One chunk of a consistent copy of the index and nodes (:mod:`~kvpool.master.changelog`)."""
        self._lead(context)
        return self.changes.snapshot(request.snapshot_id, request.offset)

    # -- clients --------------------------------------------------------------------------

    def Lookup(self, request: master_pb2.LookupRequest, context: Any) -> master_pb2.LookupResponse:
        """(gRPC's; the fast-call wire answers with :class:`LookupSteps`' bytes as they are.)"""
        return master_pb2.LookupResponse.FromString(self._lookup.alone(request, context))

    def Exists(self, request: master_pb2.ExistsRequest, context: Any) -> master_pb2.ExistsResponse:
        self._lead(context)
        self._count_keys(request.keys)
        return master_pb2.ExistsResponse(present=flag_bytes(self._index.exists_packed(caller_keys(request.keys))))

    def PlaceBlocks(self, request: master_pb2.PlaceBlocksRequest, context: Any) -> master_pb2.PlaceBlocksResponse:
        self._lead(context)
        keys = self._client_keys(request.keys)
        self._same_length(keys, "sizes", request.sizes)
        if any(size == 0 for size in request.sizes):
            raise ValueError("sizes: a block must have at least one byte")
        nodes = self._membership.live_nodes()
        candidates = [
            Candidate(
                info.ref.node_id,
                info.tiers[Tier.DRAM].capacity_bytes if Tier.DRAM in info.tiers else 0,
                info.tiers[Tier.DRAM].used_bytes if Tier.DRAM in info.tiers else 0,
                info.dram_max_block_bytes,
                info.max_block_bytes,
            )
            for info in nodes
        ]
        try:
            choice = place(keys, list(request.sizes), candidates)
        except NoPoolNodes as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        present = self._index.exists(keys)
        used: dict[int, int] = {}  # candidate index -> index into response.nodes
        response = master_pb2.PlaceBlocksResponse(present=flag_bytes(present))
        refused = [size for c, size, held in zip(choice, request.sizes, present) if c == TOO_LARGE and not held]
        if refused:
            largest = max(c.largest_block for c in candidates)
            self._metrics.record_too_large(len(refused), max(refused), largest)
            response.too_large = bytes(c == TOO_LARGE for c in choice)
        for c in choice:
            if c == TOO_LARGE:
                response.node_indexes.append(0)
                continue
            if c not in used:
                used[c] = len(used)
                response.nodes.append(self._node_ref(nodes[c].ref))
            response.node_indexes.append(used[c])
        return response

    def ReportHbm(self, request: master_pb2.ReportHbmRequest, context: Any) -> master_pb2.ReportHbmResponse:
        self._lead(context)
        worker = self._worker(request.worker_id, "ReportHbm")
        added = self._client_keys(request.added_keys, "added_keys")
        removed = self._client_keys(request.removed_keys, "removed_keys")
        self._membership.worker_seen(worker)  # refuses a tenant's worker past max_workers_per_tenant
        not_kept = self._hbm.report(worker, added, removed, full_sync=request.full_sync)
        if not_kept:
            self._metrics.record_hbm_not_kept(not_kept, worker, self._hbm.max_keys_per_worker,
                                              self._hbm.max_keys_per_tenant)
        return master_pb2.ReportHbmResponse()

    def ReportLookups(self, request: master_pb2.ReportLookupsRequest,
                      context: Any) -> master_pb2.ReportLookupsResponse:
        """Count lookups a worker answered without this master, as its own Lookups are counted."""
        self._lead(context)
        worker = self._worker(request.worker_id, "ReportLookups")
        self._check_reported(request)
        self._membership.worker_seen(worker)  # refuses a tenant's worker past max_workers_per_tenant
        r = request
        if r.lookups:
            self._metrics.record_lookup(r.hbm_blocks, r.dram_blocks, r.ssd_blocks, r.requested_blocks,
                                        r.block_tokens, r.lookups, caller_tenant())
        return master_pb2.ReportLookupsResponse()

    def Score(self, request: master_pb2.ScoreRequest, context: Any) -> master_pb2.ScoreResponse:
        """Per worker: its HBM's leading run of the prompt, then the pool's leading run of the rest by tier.

        It answers what that worker's Lookup would hit: the client checks its own HBM first and asks the pool
        for the keys after its HBM run (the index holds only open nodes' entries, so every run block resolves).
        Workers are the caller's tenant's: the ids it names, each once in first-seen order, or all of its
        workers that reported HBM.
        """
        self._lead(context)
        started = time.perf_counter()
        n_keys = self._count_keys(request.keys)
        if len(request.worker_ids) > MAX_SCORE_WORKERS:
            raise ValueError(f"Score: {len(request.worker_ids)} worker ids; at most {MAX_SCORE_WORKERS} per call")
        tenant = caller_tenant()
        named = dict.fromkeys(check_worker_id(w, "Score") for w in request.worker_ids)  # distinct, in order
        workers = list(named) or self._hbm.worker_ids(tenant)[:MAX_SCORE_WORKERS]
        if n_keys * len(workers) > MAX_SCORE_CELLS:
            raise ValueError(f"Score: {n_keys} keys x {len(workers)} distinct workers is more than MAX_SCORE_CELLS "
                             f"({MAX_SCORE_CELLS}) per call; ask for fewer keys or name fewer workers")
        packed = caller_keys(request.keys)
        tiers = self._index.best_tiers(packed)
        runs = self._hbm.held_runs([scoped_id(tenant, w) for w in workers], unpack_keys(packed)) if workers else []
        # One pass for every worker: where the pool's run from position h ends, and its DRAM/SSD blocks so far.
        absent = np.flatnonzero(tiers == NO_TIER)
        dram = np.concatenate(([0], np.cumsum(tiers == Tier.DRAM)))
        ssd = np.concatenate(([0], np.cumsum(tiers == Tier.SSD)))

        def pool_run(h: int) -> tuple[int, int]:
            at = int(np.searchsorted(absent, h))
            end = int(absent[at]) if at < len(absent) else len(tiers)
            return int(dram[end] - dram[h]), int(ssd[end] - ssd[h])

        response = master_pb2.ScoreResponse()
        response.pool_dram_blocks, response.pool_ssd_blocks = pool_run(0)
        for worker, held in zip(workers, runs):
            d, s = pool_run(held)
            response.workers.append(master_pb2.WorkerScore(worker_id=worker, hbm_blocks=held, dram_blocks=d,
                                                           ssd_blocks=s))
        self._metrics.score_seconds.observe(time.perf_counter() - started)
        return response

    def NameBlocks(self, request: master_pb2.NameBlocksRequest, context: Any) -> master_pb2.NameBlocksResponse:
        """Keep the engine's hash of each key for KV events (nothing without events: the answer says 0), in the
        caller's tenant's share of the name table (:class:`~kvpool.master.engine_names.EngineNames`)."""
        self._lead(context)
        n = self._count_keys(request.keys)
        if len(request.engine_hashes) != n:
            raise ValueError(f"engine_hashes: {len(request.engine_hashes)} values for {n} keys")
        if self.names is None or n == 0:
            return master_pb2.NameBlocksResponse(named=0)
        words = np.frombuffer(caller_keys(request.keys), np.uint64).reshape(-1, KEY_BYTES // 8)
        k0, k1 = np.ascontiguousarray(words[:, 0]), np.ascontiguousarray(words[:, 1])
        named = self.names.learn(k0, k1, np.array(request.engine_hashes, np.uint64), self._index.holds,
                                 caller_tenant())
        return master_pb2.NameBlocksResponse(named=named)

    # -- status ---------------------------------------------------------------------------

    def Info(self, request: master_pb2.MasterInfoRequest, context: Any) -> master_pb2.MasterInfoResponse:
        who = caller()
        client = who is not None and who.role == ROLE_CLIENT
        return master_pb2.MasterInfoResponse(call_port=self.call_port, version=__version__,
                                             tenant_mask=who.mask if who is not None else b"",
                                             standby=not self.leading(), leader_address=self.leader_address(),
                                             cluster=self.cluster,
                                             kv_events_server_key=self.events_server_key if client else "",
                                             max_keys_per_call=self._config.server.max_keys_per_call,
                                             shard=self.shard, shard_count=self.shard_count)

    def ClusterStatus(self, request: master_pb2.ClusterStatusRequest, context: Any) -> master_pb2.ClusterStatusResponse:
        self._lead(context)
        now = self._membership.now()
        response = master_pb2.ClusterStatusResponse()
        for info in self._membership.live_nodes():
            response.nodes.append(
                master_pb2.NodeStatus(
                    node=self._node_ref(info.ref),
                    tiers=[tier_usage(s) for s in sorted(info.tiers.values(), key=lambda s: s.tier)],
                    seconds_since_heartbeat=max(0.0, now - info.last_heartbeat),
                    incarnation=info.incarnation,
                    dram_max_block_bytes=info.dram_max_block_bytes,
                    max_block_bytes=info.max_block_bytes,
                )
            )
        totals = self._metrics.lookup_totals()
        response.indexed_blocks = len(self._index)
        response.workers = self._membership.worker_count()
        response.hbm_blocks = self._hbm.blocks()
        # Saturate: ReportLookups may add up to 2**64 - 1 per call, and a uint64 field refuses more (ValueError).
        response.lookups = min(totals.lookups, _U64_MAX)
        response.requested_blocks = min(totals.requested_blocks, _U64_MAX)
        response.hit_blocks_hbm = min(totals.hit_blocks_hbm, _U64_MAX)
        response.hit_blocks_dram = min(totals.hit_blocks_dram, _U64_MAX)
        response.hit_blocks_ssd = min(totals.hit_blocks_ssd, _U64_MAX)
        refused = self._metrics.too_large_totals()
        response.blocks_too_large = min(refused.blocks, _U64_MAX)
        response.largest_refused_bytes = refused.largest_refused
        response.largest_block_bytes = max((max(i.dram_max_block_bytes, i.max_block_bytes) for i in
                                            self._membership.live_nodes()), default=0)
        return response


class _Begun(NamedTuple):
    """A Lookup checked and ready for the index pass."""

    request: master_pb2.LookupRequest
    keys: bytes  # packed, as stored (the caller's tenant applied)
    n_keys: int
    tenant: str
    started: float


_FIRST = np.zeros(1, np.int64)  # a run of one prompt's columns starts at row 0


class LookupSteps:
    """``Lookup`` in three steps (:class:`kvpool.wire.Together`), so that lookups that reach the fast-call loop
    together are answered with one pass over the index: ``begin`` (checks, the caller's tenant; under the
    caller's identity), ``run`` (the index, once for all), ``end`` (the reply and the metrics). Each reply is
    exactly what :meth:`MasterServicer.Lookup` answers alone; only the index pass is shared."""

    def __init__(self, servicer: MasterServicer):
        self._s = servicer

    def begin(self, request: master_pb2.LookupRequest, context: Any) -> _Begun:
        s = self._s
        s._lead(context)
        started = time.perf_counter()
        n_keys = s._count_keys(request.keys)
        if request.hbm_prefix_blocks > s._config.max_hbm_keys_per_worker:
            raise ValueError(f"Lookup: hbm_prefix_blocks {request.hbm_prefix_blocks} > max_hbm_keys_per_worker "
                             f"{s._config.max_hbm_keys_per_worker}")
        s._check_block_tokens("Lookup", request.block_tokens)
        if request.worker_id:
            s._membership.worker_seen(s._worker(request.worker_id, "Lookup"))
        return _Begun(request, caller_keys(request.keys), n_keys, caller_tenant(), started)

    def alone(self, request: master_pb2.LookupRequest, context: Any) -> bytes:
        begun = self.begin(request, context)
        return self.end(begun, self.run((begun,))[0])

    def run(self, begun: Sequence[_Begun]) -> list[RunReply]:
        replies, _ = self._s._index.leading_runs_pass(lookup_replies, [b.keys for b in begun])
        if len(begun) > 1:  # (a lookup that came alone is answered by the same steps)
            self._s._metrics.lookups_together.inc(len(begun))
        return replies

    def end(self, begun: _Begun, run: RunReply) -> bytes:
        """The serialized LookupResponse (:mod:`kvpool.master.lookup_reply`); the lookup counted."""
        s = self._s
        request = begun.request
        refs = s._membership.refs(run.nodes)
        if len(refs) < len(run.nodes):  # a node dropped while we looked
            run, refs = self._without_dropped_nodes(begun)
        response = reply(run, [s._node_field(refs[n]) for n in run.nodes])
        dram, ssd = run.dram_blocks, run.ssd_blocks
        if not request.counted_by_caller:  # (a sharded client's part: it reports the merged lookup itself)
            s._metrics.record_lookup(
                hbm=request.hbm_prefix_blocks,
                dram=dram,
                ssd=ssd,
                requested=request.hbm_prefix_blocks + begun.n_keys,
                block_tokens=request.block_tokens,
                tenant=begun.tenant,
            )
        s._metrics.lookup_seconds.observe(time.perf_counter() - begun.started)
        return response

    def _without_dropped_nodes(self, begun: _Begun) -> tuple[RunReply, dict[int, NodeRef]]:
        """The run looked up again, ending at its first block on a node that is gone (the index drops a node's
        blocks once its drop is through; meanwhile a lookup must not name it), and its nodes' refs."""
        s = self._s
        tiers, nodes, sizes, checksums = s._index.leading_run_arrays(begun.keys)
        refs = s._membership.refs(np.unique(nodes).tolist())
        gone = ~np.isin(nodes, np.fromiter(refs, np.uint32, len(refs)))
        end = int(np.argmax(gone)) if gone.any() else len(nodes)
        run = encode_runs(tiers, nodes, sizes, checksums, _FIRST, np.array([end], np.int64))[0]
        return run, refs


def _followed_blocks(number: int, request: master_pb2.ReportBlocksRequest) -> master_pb2.IndexChange:
    """An accepted report as the change log carries it (built when a follower asks)."""
    r = request
    return master_pb2.IndexChange(blocks=master_pb2.FollowedBlocks(
        number=number, tier=r.tier, full_sync=r.full_sync, added_keys=r.added_keys, added_sizes=r.added_sizes,
        added_checksums=r.added_checksums, removed_keys=r.removed_keys))
