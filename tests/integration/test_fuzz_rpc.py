"""Bad input (issue 7): property-based fuzzing of every Master and Node RPC over real gRPC.

One real master and one real pool node (DRAM arena + LMDB SSD) per module, holding a known set of
blocks (tests/fuzz_support.py). Every case sends one request built by a hypothesis strategy that mixes
well-formed, malformed, oversized and boundary fields (ragged / empty / over-limit packed keys,
parallel lists of the wrong length, zero and huge sizes, unknown enum values, huge strings, bogus
leases, slots and incarnations, unknown fields, random or mutated bytes as the whole message) and checks:

- the answer is OK or a clear refusal (INVALID_ARGUMENT, or RESOURCE_EXHAUSTED for gRPC's own size
  limit) with a non-empty message, never INTERNAL / UNKNOWN / a hang (every call has a deadline);
- malformed input is refused, and well-formed input answered OK with a reply of the right shape;
- every 25 cases and after each test: both servers answer health checks and cheap calls, no server
  logged an error, the known blocks read back byte-exact with their checksums and the master's index
  still holds every one of them on the real node.

Deterministic: ``derandomize=True`` (the examples follow from the test source; no example database).
``KVPOOL_FUZZ_SCALE=4 pytest tests/integration/test_fuzz_rpc.py`` runs four times as many cases.
"""

from __future__ import annotations

import hashlib
import os
import time

import grpc
import numpy as np
import pytest
from fuzz_support import (
    EXHAUSTED,
    INVALID,
    KNOWN,
    KNOWN_KEYS,
    KNOWN_SIZES,
    KNOWN_TAG,
    LEASE_TIMEOUT_S,
    MASTER_CONFIG,
    MASTER_MAX_MESSAGE,
    NODE_MAX_MESSAGE,
    OK,
    REAL_NODE_ID,
    SLOT,
    Pool,
    any_key,
    det_bytes,
    enum_value,
    expect_status,
    fuzz_key,
    fuzz_settings,
    id_text,
    mutate,
    mutations,
    names_known,
    packed_keys,
    parallel,
    say,
    seed_request,
    short_text,
    size_value,
    tier_usage,
    tiers_valid,
    u32,
    u64,
    unknown_fields,
    weighted,
)
from hypothesis import assume, given
from hypothesis import strategies as st

from kvpool.checksum import block_checksum
from kvpool.master.servicer import MAX_BLOCK_TOKENS, MAX_REF_CHARS, MAX_REPORTED_LOOKUPS
from kvpool.v1 import common_pb2, master_pb2, node_pb2
from kvpool.vocabulary import NO_TIER
from kvpool.worker_ids import worker_id_problem

SCALE = float(os.environ.get("KVPOOL_FUZZ_SCALE", "1"))
N = max(1, int(200 * SCALE))  # cases per RPC
N_RAW = max(1, int(500 * SCALE))  # random / mutated bytes, over all methods
M = "/kvpool.v1.Master/"
NODE = "/kvpool.v1.Node/"

MASTER_METHODS = {
    "RegisterNode": (master_pb2.RegisterNodeRequest, master_pb2.RegisterNodeResponse),
    "Heartbeat": (master_pb2.HeartbeatRequest, master_pb2.HeartbeatResponse),
    "ReportBlocks": (master_pb2.ReportBlocksRequest, master_pb2.ReportBlocksResponse),
    "UnregisterNode": (master_pb2.UnregisterNodeRequest, master_pb2.UnregisterNodeResponse),
    "Lookup": (master_pb2.LookupRequest, master_pb2.LookupResponse),
    "Exists": (master_pb2.ExistsRequest, master_pb2.ExistsResponse),
    "PlaceBlocks": (master_pb2.PlaceBlocksRequest, master_pb2.PlaceBlocksResponse),
    "ReportHbm": (master_pb2.ReportHbmRequest, master_pb2.ReportHbmResponse),
    "ReportLookups": (master_pb2.ReportLookupsRequest, master_pb2.ReportLookupsResponse),
    "Score": (master_pb2.ScoreRequest, master_pb2.ScoreResponse),
    "NameBlocks": (master_pb2.NameBlocksRequest, master_pb2.NameBlocksResponse),
    "ClusterStatus": (master_pb2.ClusterStatusRequest, master_pb2.ClusterStatusResponse),
    "Info": (master_pb2.MasterInfoRequest, master_pb2.MasterInfoResponse),
    "Follow": (master_pb2.FollowRequest, master_pb2.FollowResponse),
    "Snapshot": (master_pb2.SnapshotRequest, master_pb2.SnapshotResponse),
}
NODE_METHODS = {
    "Put": (node_pb2.PutRequest, node_pb2.PutResponse),
    "Get": (node_pb2.GetRequest, node_pb2.GetResponse),
    "Exists": (node_pb2.NodeExistsRequest, node_pb2.NodeExistsResponse),
    "Remove": (node_pb2.RemoveRequest, node_pb2.RemoveResponse),
    "Locate": (node_pb2.LocateRequest, node_pb2.LocateResponse),
    "Info": (node_pb2.InfoRequest, node_pb2.InfoResponse),
    "Reserve": (node_pb2.ReserveRequest, node_pb2.ReserveResponse),
    "Commit": (node_pb2.CommitRequest, node_pb2.CommitResponse),
    "FlushReports": (node_pb2.FlushReportsRequest, node_pb2.FlushReportsResponse),
}
# Every method the two servers serve, as (server, path, request type); the health check too (same interceptor).
ALL_METHODS = ([("master", M + name, req) for name, (req, _) in MASTER_METHODS.items()]
               + [("node", NODE + name, req) for name, (req, _) in NODE_METHODS.items()]
               + [("master", "/grpc.health.v1.Health/Check", None), ("node", "/grpc.health.v1.Health/Check", None)])
assert len(MASTER_METHODS) == len(master_pb2.DESCRIPTOR.services_by_name["Master"].methods)
assert len(NODE_METHODS) == len(node_pb2.DESCRIPTOR.services_by_name["Node"].methods)

FUZZ = fuzz_settings(N)


@pytest.fixture(scope="module")
def pool(tmp_path_factory, request):
    """The module's pool; at its end (whatever order the tests ran in) the servers must be fine, and when the
    whole module ran, every RPC must have had its N cases (see :func:`report_cases`)."""
    p = Pool(tmp_path_factory.mktemp("fuzz-rpc"))
    try:
        yield p
        finish(p)
        report_cases(p, request)
    finally:
        p.close()


@pytest.fixture(autouse=True)
def finish_each(request):
    """The end of every test: servers up, nothing logged, known data intact (checked after the test, so no test
    relies on running after another)."""
    yield
    if "pool" in request.fixturenames:
        finish(request.getfixturevalue("pool"))


def master_call(pool: Pool, name: str, request, extra: bytes = b""):
    return pool.call(pool.master_channel, M + name, request, MASTER_METHODS[name][1], extra)


def node_call(pool: Pool, name: str, request, extra: bytes = b""):
    return pool.call(pool.node_channel, NODE + name, request, NODE_METHODS[name][1], extra)


def checked(pool: Pool, service: str, name: str, request, extra: bytes, expect: str):
    """Call and check the status; a request over the server's message limit must be refused whatever it says."""
    limit = MASTER_MAX_MESSAGE if service == "master" else NODE_MAX_MESSAGE
    if request.ByteSize() + len(extra) > limit:
        expect = "invalid"
    call = master_call if service == "master" else node_call
    code, reply = call(pool, name, request, extra)
    pool.statuses[code.name] += 1
    expect_status(code, reply, expect)
    return code, reply


def valid_if(ok: object) -> str:
    return "valid" if ok else "invalid"


def keys_of(packed: bytes) -> list[bytes]:
    return [packed[i : i + 32] for i in range(0, len(packed), 32)]


def other_than(value: int, avoid: int) -> int:
    return value if value != avoid else (value + 1) % 2**64


def finish(pool: Pool) -> None:
    """The end of every test: servers up, nothing logged, known data intact."""
    pool.check_alive()
    pool.check_known()


# -- Master: membership ------------------------------------------------------------------------------------


@st.composite
def register_requests(draw):
    ref = common_pb2.NodeRef(node_id=draw(id_text.filter(lambda s: s != REAL_NODE_ID)), address=draw(id_text),
                             host_id=draw(id_text), arena=draw(short_text), data_address=draw(short_text))
    tiers = draw(st.lists(tier_usage(), max_size=4))
    request = master_pb2.RegisterNodeRequest(node=ref, tiers=tiers, dram_max_block_bytes=draw(u64))
    fields = (ref.node_id, ref.address, ref.host_id, ref.arena, ref.data_address)
    ok = ref.node_id and ref.address and tiers_valid(tiers) and all(len(f) <= MAX_REF_CHARS for f in fields)
    return request, "valid" if ok else "invalid"


@FUZZ
@given(case=register_requests(), extra=unknown_fields())
def test_register_node(pool, case, extra):
    request, expect = case
    code, reply = checked(pool, "master", "RegisterNode", request, extra, expect)
    if code == OK:
        assert reply.incarnation > 0 and reply.node_timeout_s > 0 and reply.heartbeat_interval_s > 0
    pool.count("Master.RegisterNode")


@FUZZ
@given(real=st.booleans(), node_id=id_text.filter(lambda s: s != REAL_NODE_ID), incarnation=u64,
       tiers=st.lists(tier_usage(), max_size=4), extra=unknown_fields())
def test_heartbeat(pool, real, node_id, incarnation, tiers, extra):
    if real:  # the real node's id, never with its incarnation
        node_id, incarnation = REAL_NODE_ID, other_than(incarnation, pool.real_incarnation)
    request = master_pb2.HeartbeatRequest(node_id=node_id, incarnation=incarnation, tiers=tiers)
    code, reply = checked(pool, "master", "Heartbeat", request, extra, valid_if(tiers_valid(tiers)))
    if code == OK:
        assert reply.known is False  # no node the fuzzer can name has this incarnation
    pool.count("Master.Heartbeat")


def _register(pool: Pool, node_id: str) -> int:
    code, reply = master_call(pool, "RegisterNode", master_pb2.RegisterNodeRequest(
        node=common_pb2.NodeRef(node_id=node_id, address="fuzz.invalid:1"), dram_max_block_bytes=SLOT))
    assert code == OK, reply
    return reply.incarnation


@FUZZ
@given(data=st.data())
def test_report_blocks(pool, data):
    """ReportBlocks for the real node (wrong incarnation: known keys allowed, nothing may change), for a node
    the fuzzer registered (right or wrong incarnation: fuzz keys only) and for unknown ids."""
    inc = _register(pool, "fuzz-reporter")
    target = data.draw(st.sampled_from(["real", "fuzz-right", "fuzz-wrong", "other"]))
    key = any_key if target == "real" else fuzz_key
    node_id = {"real": REAL_NODE_ID, "other": data.draw(id_text.filter(lambda s: s != REAL_NODE_ID))}.get(
        target, "fuzz-reporter")
    incarnation = data.draw(u64)
    incarnation = {"real": other_than(incarnation, pool.real_incarnation), "fuzz-right": inc,
                   "fuzz-wrong": other_than(incarnation, inc)}.get(target, incarnation)
    added, n_added = data.draw(packed_keys(key))
    removed, n_removed = data.draw(packed_keys(key))
    sizes = data.draw(parallel(n_added, u64))
    sums = data.draw(parallel(n_added, u64))
    tier = data.draw(enum_value)
    request = master_pb2.ReportBlocksRequest(node_id=node_id, incarnation=incarnation, tier=tier,
                                             full_sync=data.draw(st.booleans()), added_keys=added, added_sizes=sizes,
                                             added_checksums=sums, removed_keys=removed)
    ok = tier in (1, 2) and None not in (n_added, n_removed) and len(sizes) == len(sums) == n_added
    code, reply = checked(pool, "master", "ReportBlocks", request, data.draw(unknown_fields()), valid_if(ok))
    if code == OK:
        assert reply.known == (target == "fuzz-right")
        if reply.known:  # what was added and not removed is in the index now (keys match on 16 bytes)
            gone = {k[:16] for k in keys_of(removed)}
            kept = [k for k in keys_of(added) if k[:16] not in gone]
            code, present = master_call(pool, "Exists", master_pb2.ExistsRequest(keys=b"".join(kept)))
            assert code == OK and list(present.present) == [1] * len(kept)
    pool.count("Master.ReportBlocks")


@FUZZ
@given(target=st.sampled_from(["real", "fuzz-right", "fuzz-wrong", "other"]), incarnation=u64,
       node_id=id_text.filter(lambda s: s != REAL_NODE_ID), extra=unknown_fields())
def test_unregister_node(pool, target, incarnation, node_id, extra):
    inc = _register(pool, "fuzz-leaver")
    if target == "real":
        node_id, incarnation = REAL_NODE_ID, other_than(incarnation, pool.real_incarnation)
    elif target.startswith("fuzz"):
        node_id = "fuzz-leaver"
        incarnation = inc if target == "fuzz-right" else other_than(incarnation, inc)
    code, reply = checked(pool, "master", "UnregisterNode", master_pb2.UnregisterNodeRequest(
        node_id=node_id, incarnation=incarnation), extra, "valid")
    code, beat = master_call(pool, "Heartbeat", master_pb2.HeartbeatRequest(node_id="fuzz-leaver", incarnation=inc))
    assert code == OK and beat.known == (target != "fuzz-right")  # only the right incarnation leaves
    if target == "real":
        code, status = master_call(pool, "ClusterStatus", master_pb2.ClusterStatusRequest())
        assert code == OK and REAL_NODE_ID in [n.node.node_id for n in status.nodes]
    pool.count("Master.UnregisterNode")


# -- Master: lookups and placement ------------------------------------------------------------------------


def read_keys() -> st.SearchStrategy:
    """Packed keys for read-only calls: any keys, or a run of known keys in order followed by anything."""
    known_run = st.tuples(st.integers(1, len(KNOWN_KEYS)), st.lists(any_key, max_size=4)).map(
        lambda t: (b"".join(KNOWN_KEYS[: t[0]]) + b"".join(t[1]), t[0] + len(t[1])))
    return weighted((3, packed_keys(any_key)), (1, known_run))


HBM_MOST = MASTER_CONFIG.max_hbm_keys_per_worker
POOL_MOST = MASTER_CONFIG.server.max_keys_per_call
small_u32 = weighted((2, st.integers(0, 1000)), (1, u32))  # counts clients send, and any others
small_u64 = weighted((2, st.integers(0, 1000)), (1, u64))


def worker_ok(worker: str) -> bool:
    return worker_id_problem(worker) is None


@FUZZ
@given(case=read_keys(), worker=id_text, hbm=small_u32, tokens=small_u32, extra=unknown_fields())
def test_lookup(pool, case, worker, hbm, tokens, extra):
    packed, n = case
    pool.node.link.flush()
    request = master_pb2.LookupRequest(keys=packed, worker_id=worker, hbm_prefix_blocks=hbm, block_tokens=tokens)
    valid = n is not None and (not worker or worker_ok(worker)) and hbm <= HBM_MOST and tokens <= MAX_BLOCK_TOKENS
    code, run = checked(pool, "master", "Lookup", request, extra, valid_if(valid))
    if code == OK:
        keys = keys_of(packed)
        end = len(run.tiers)
        assert end <= n and len(run.node_indexes) == len(run.sizes) == len(run.checksums) == end
        assert set(run.tiers) <= {1, 2} and run.dram_blocks + run.ssd_blocks == end
        assert all(i < len(run.nodes) for i in run.node_indexes)
        lead = 0
        while lead < len(keys) and keys[lead] in KNOWN:
            lead += 1
        assert end >= lead, "a known block is missing from the master's index"
        for i in range(end):
            if keys[i] in KNOWN:
                assert (run.sizes[i], run.checksums[i]) == KNOWN[keys[i]][:2]
                assert run.nodes[run.node_indexes[i]].node_id == REAL_NODE_ID
    pool.count("Master.Lookup")


@FUZZ
@given(case=read_keys(), workers=st.lists(id_text, max_size=4), extra=unknown_fields())
def test_score(pool, case, workers, extra):
    packed, n = case
    pool.node.link.flush()
    valid = n is not None and all(worker_ok(w) for w in workers)
    code, reply = checked(pool, "master", "Score", master_pb2.ScoreRequest(keys=packed, worker_ids=workers), extra,
                          valid_if(valid))
    if code == OK:
        keys = keys_of(packed)
        lead = 0
        while lead < len(keys) and keys[lead] in KNOWN:
            lead += 1
        assert lead <= reply.pool_dram_blocks + reply.pool_ssd_blocks <= n, "the pool's run misses a known block"
        named, scored = list(dict.fromkeys(workers)), [w.worker_id for w in reply.workers]
        if named:
            assert scored == named  # each once, in the order first named
        else:  # every worker that reported HBM (what other tests reported too), by id
            assert scored == sorted(set(scored))
        for w in reply.workers:  # no fuzzed worker holds HBM the known run would start with
            assert w.hbm_blocks + w.dram_blocks + w.ssd_blocks <= n
    pool.count("Master.Score")


@FUZZ
@given(data=st.data())
def test_name_blocks(pool, data):
    packed, n = data.draw(packed_keys(fuzz_key))
    names = data.draw(parallel(n, u64))
    valid = n is not None and len(names) == n
    code, reply = checked(pool, "master", "NameBlocks", master_pb2.NameBlocksRequest(keys=packed,
                          engine_hashes=names), data.draw(unknown_fields()), valid_if(valid))
    if code == OK:
        assert reply.named <= n  # the fuzz pool publishes no events: it keeps no names, and says so
    pool.count("Master.NameBlocks")


@FUZZ
@given(case=packed_keys(any_key), extra=unknown_fields())
def test_master_exists(pool, case, extra):
    packed, n = case
    pool.node.link.flush()
    request = master_pb2.ExistsRequest(keys=packed)
    code, reply = checked(pool, "master", "Exists", request, extra, valid_if(n is not None))
    if code == OK:
        keys = keys_of(packed)
        assert len(reply.present) == n
        assert all(p == 1 for k, p in zip(keys, reply.present) if k in KNOWN)
    pool.count("Master.Exists")


@FUZZ
@given(data=st.data())
def test_place_blocks(pool, data):
    packed, n = data.draw(packed_keys(any_key))
    sizes = data.draw(parallel(n, size_value))
    if n is None or len(sizes) != n or 0 in sizes:
        expect = "invalid"
    else:  # the real node takes anything up to its slot size; larger blocks depend on what else registered
        expect = "valid" if all(s <= SLOT for s in sizes) else "either"
    code, reply = checked(pool, "master", "PlaceBlocks", master_pb2.PlaceBlocksRequest(keys=packed, sizes=sizes),
                          data.draw(unknown_fields()), expect)
    if code == OK:
        assert len(reply.node_indexes) == len(reply.present) == n
        assert all(i < len(reply.nodes) for i in reply.node_indexes)
        assert all(p == 1 for k, p in zip(keys_of(packed), reply.present) if k in KNOWN)
    pool.count("Master.PlaceBlocks")


@FUZZ
@given(worker=id_text, added=packed_keys(fuzz_key), removed=packed_keys(fuzz_key), full=st.booleans(),
       extra=unknown_fields())
def test_report_hbm(pool, worker, added, removed, full, extra):
    request = master_pb2.ReportHbmRequest(
        worker_id=worker, added_keys=added[0], removed_keys=removed[0], full_sync=full)
    ok = worker_ok(worker) and None not in (added[1], removed[1])
    checked(pool, "master", "ReportHbm", request, extra, valid_if(ok))
    pool.count("Master.ReportHbm")


@FUZZ
@given(worker=id_text, lookups=small_u64, requested=small_u64, hbm=small_u64, dram=small_u64, ssd=small_u64,
       tokens=small_u32, extra=unknown_fields())
def test_report_lookups(pool, worker, lookups, requested, hbm, dram, ssd, tokens, extra):
    request = master_pb2.ReportLookupsRequest(worker_id=worker, lookups=lookups, requested_blocks=requested,
                                              hbm_blocks=hbm, dram_blocks=dram, ssd_blocks=ssd, block_tokens=tokens)
    counts_ok = (lookups <= MAX_REPORTED_LOOKUPS and hbm <= lookups * HBM_MOST and dram + ssd <= lookups * POOL_MOST
                 and requested <= lookups * (HBM_MOST + POOL_MOST) and hbm + dram + ssd <= requested
                 and tokens <= MAX_BLOCK_TOKENS)
    checked(pool, "master", "ReportLookups", request, extra, valid_if(worker_ok(worker) and counts_ok))
    pool.count("Master.ReportLookups")


@FUZZ
@given(extra=unknown_fields())
def test_cluster_status(pool, extra):
    code, reply = checked(pool, "master", "ClusterStatus", master_pb2.ClusterStatusRequest(), extra, "valid")
    assert REAL_NODE_ID in [n.node.node_id for n in reply.nodes] and reply.indexed_blocks >= len(KNOWN_KEYS)
    pool.count("Master.ClusterStatus")


@FUZZ
@given(extra=unknown_fields())
def test_master_info(pool, extra):
    code, reply = checked(pool, "master", "Info", master_pb2.MasterInfoRequest(), extra, "valid")
    assert reply.call_port == pool.master.servicer.call_port and reply.version
    pool.count("Master.Info")


@FUZZ
@given(log_id=small_u64, after=small_u64, extra=unknown_fields())
def test_follow(pool, log_id, after, extra):
    """A single master keeps no change log (log id 0): any other log, or any position past its end, is "behind";
    never an error."""
    code, reply = checked(pool, "master", "Follow", master_pb2.FollowRequest(log_id=log_id, after_seq=after), extra,
                          "valid")
    assert reply.behind == (log_id != 0 or after != 0) and not reply.changes
    pool.count("Master.Follow")


@FUZZ
@given(snapshot_id=small_u64, offset=small_u64, extra=unknown_fields())
def test_snapshot(pool, snapshot_id, offset, extra):
    """A new snapshot (id 0) is a consistent copy served from ``offset``; a snapshot that is gone is
    INVALID_ARGUMENT."""
    request = master_pb2.SnapshotRequest(snapshot_id=snapshot_id, offset=offset)
    code, reply = checked(pool, "master", "Snapshot", request, extra, valid_if(snapshot_id == 0))
    if snapshot_id == 0:
        assert reply.total >= len(KNOWN_KEYS) and len(reply.locations) == 40 * max(0, min(reply.total - offset,
                                                                                          100_000))
    pool.count("Master.Snapshot")


# -- Node ---------------------------------------------------------------------------------------------------

OVERSIZED_DATA = bytes(NODE_MAX_MESSAGE + 1)


@FUZZ
@given(data=st.data())
def test_put(pool, data):
    packed, n = data.draw(packed_keys(fuzz_key))
    mode = data.draw(st.sampled_from(["exact"] * 4 + ["random"] * 3 + ["oversized"]))
    if mode == "exact" and n is not None:  # sizes that add up to the data: the well-formed shape
        sizes = data.draw(st.lists(st.integers(1, 40 << 10), min_size=n, max_size=n))
        payload = det_bytes(data.draw(st.integers(0, 2**32)), sum(sizes))
    elif mode == "oversized":
        sizes, payload = [len(OVERSIZED_DATA)], OVERSIZED_DATA
    else:
        sizes = data.draw(parallel(n, size_value))
        payload = det_bytes(data.draw(st.integers(0, 2**32)), data.draw(st.integers(0, 48 << 10)))
    views, offset = [], 0
    for s in sizes:
        views.append(payload[offset : offset + s])
        offset += s
    sums_mode = data.draw(st.sampled_from(["none", "right", "wrong", "count"]))
    if sums_mode == "none":
        sums = []
    elif sums_mode in ("right", "wrong"):
        sums = [block_checksum(v) ^ (sums_mode == "wrong") for v in views]
    else:
        sums = data.draw(st.lists(u64, max_size=10))
    ok = (n is not None and len(sizes) == n and (not sums or len(sums) == n) and sum(sizes) == len(payload)
          and 0 not in sizes)
    request = node_pb2.PutRequest(keys=packed, sizes=sizes, data=payload, checksums=sums)
    code, reply = checked(pool, "node", "Put", request, data.draw(unknown_fields()), valid_if(ok))
    if code == OK:
        assert len(reply.stored) == n
        if sums_mode in ("none", "right"):
            assert list(reply.stored) == [1] * n  # room enough: DRAM, else SSD
    pool.count("Node.Put")


@FUZZ
@given(data=st.data())
def test_get(pool, data):
    big = KNOWN_KEYS[-1]  # the 40 KiB block: ~100 copies are about one reply's limit
    if data.draw(st.integers(0, 4)) == 0:
        count = data.draw(st.integers(95, 110))
        packed, n = big * count, count
        fits = KNOWN_SIZES[-1] * count + 32 * count + 4096 <= NODE_MAX_MESSAGE  # the servicer's bound
        expect = "valid" if fits else "invalid"
    else:
        packed, n = data.draw(read_keys())
        expect = "valid" if n is not None else "invalid"
    code, reply = checked(pool, "node", "Get", node_pb2.GetRequest(keys=packed), data.draw(unknown_fields()), expect)
    if code == OK:
        assert len(reply.tiers) == len(reply.sizes) == len(reply.checksums) == n
        assert len(reply.data) == sum(reply.sizes)
        offset = 0
        for k, tier, size, checksum in zip(keys_of(packed), reply.tiers, reply.sizes, reply.checksums):
            block = reply.data[offset : offset + size]
            offset += size
            assert (tier == NO_TIER) == (size == 0)
            if k in KNOWN:
                assert tier != NO_TIER and block == KNOWN[k][2] and checksum == KNOWN[k][1]
            elif tier != NO_TIER:
                assert block_checksum(block) == checksum
    pool.count("Node.Get")


@FUZZ
@given(case=packed_keys(any_key), extra=unknown_fields())
def test_node_exists(pool, case, extra):
    packed, n = case
    request = node_pb2.NodeExistsRequest(keys=packed)
    code, reply = checked(pool, "node", "Exists", request, extra, valid_if(n is not None))
    if code == OK:
        assert len(reply.tiers) == n
        assert all(t in (1, 2) for k, t in zip(keys_of(packed), reply.tiers) if k in KNOWN)
    pool.count("Node.Exists")


@FUZZ
@given(case=packed_keys(fuzz_key), extra=unknown_fields())
def test_remove(pool, case, extra):
    packed, n = case
    code, reply = checked(pool, "node", "Remove", node_pb2.RemoveRequest(keys=packed), extra, valid_if(n is not None))
    if code == OK:
        assert reply.removed <= len(set(keys_of(packed)))
    pool.count("Node.Remove")


@FUZZ
@given(case=read_keys(), promote=st.booleans(), extra=unknown_fields())
def test_locate(pool, case, promote, extra):
    packed, n = case
    request = node_pb2.LocateRequest(keys=packed, promote=promote)
    code, reply = checked(pool, "node", "Locate", request, extra, valid_if(n is not None))
    if code == OK:
        assert reply.arena == pool.arena
        assert len(reply.slots) == len(reply.slot_gens) == len(reply.sizes) == len(reply.checksums) == n
        for k, gen, size, checksum in zip(keys_of(packed), reply.slot_gens, reply.sizes, reply.checksums):
            assert gen % 2 == 0, "Locate named an uncommitted slot"
            if k in KNOWN and gen:
                assert (size, checksum) == KNOWN[k][:2]
            if k in KNOWN and promote and KNOWN[k][0] <= SLOT and len(set(keys_of(packed))) <= 8:
                assert gen, "a promoted known block is not in DRAM"
    pool.count("Node.Locate")


@FUZZ
@given(extra=unknown_fields())
def test_node_info(pool, extra):
    code, reply = checked(pool, "node", "Info", node_pb2.InfoRequest(), extra, "valid")
    assert reply.node.node_id == REAL_NODE_ID and reply.dram_max_block_bytes == SLOT
    pool.count("Node.Info")


@FUZZ
@given(data=st.data())
def test_reserve(pool, data):
    packed, n = data.draw(packed_keys(fuzz_key))
    sizes = data.draw(parallel(n, size_value))
    extend = data.draw(st.sampled_from([0, 0, 0]) | u64)  # a lease to extend: none, or a guessed one (never ours)
    code, reply = checked(pool, "node", "Reserve", node_pb2.ReserveRequest(keys=packed, sizes=sizes, lease=extend),
                          data.draw(unknown_fields()), valid_if(n is not None and len(sizes) == n and 0 not in sizes))
    if code == OK:
        assert len(reply.slots) == len(reply.slot_gens) == len(reply.already_held) == n
        if extend:
            assert reply.lease == 0 and not any(reply.slot_gens), "a guessed lease was extended"
        assert reply.lease_timeout_s == LEASE_TIMEOUT_S and reply.arena == pool.arena
        for size, gen in zip(sizes, reply.slot_gens):
            assert gen % 2 == 1 or gen == 0, "a reserved slot must be odd (unreadable) until committed"
            assert size <= SLOT or gen == 0
        assert (reply.lease == 0) == (not any(reply.slot_gens))
    pool.count("Node.Reserve")


_commit_ids = iter(range(1 << 62))


@FUZZ
@given(data=st.data())
def test_commit(pool, data):
    """Commit after a real Reserve, with the lease, keys, slots and checksums drawn from the right ones,
    known blocks' keys and slots, and bogus values: only the lease's own slots may ever be stored."""
    arena = pool.node.store.dram.arena
    fresh = [bytes([KNOWN_TAG ^ 0xFF]) + hashlib.sha256(f"commit-{next(_commit_ids)}".encode()).digest()[1:]
             for _ in range(data.draw(st.integers(1, 3)))]
    sizes = [data.draw(st.integers(1, SLOT)) for _ in fresh]
    code, res = node_call(pool, "Reserve", node_pb2.ReserveRequest(keys=b"".join(fresh), sizes=sizes))
    assert code == OK, res
    reserved_at = time.monotonic()
    rights = {}  # key -> (slot, checksum) for the keys that got a slot
    for k, slot, gen, size in zip(fresh, res.slots, res.slot_gens, sizes):
        if gen:
            arena.block(slot, size)[:] = np.frombuffer(det_bytes(slot, size), np.uint8)  # as a same-host writer does
            rights[k] = (slot, block_checksum(arena.block(slot, size)))
    known_slots = [r.slot for r in pool.node.store.dram.locate(KNOWN_KEYS) if r is not None] or [0]
    lease_kind = data.draw(st.sampled_from(["right", "next", "zero", "any"]))
    any_lease = data.draw(u64)
    lease = {"right": res.lease, "next": res.lease + 1, "zero": 0, "any": any_lease}[lease_kind]
    entry = st.tuples(st.sampled_from(fresh + KNOWN_KEYS), st.sampled_from(["right", "known", "other"]),
                      st.sampled_from(["right", "wrong"]))
    perfect = data.draw(st.integers(0, 3)) == 0
    if perfect:  # the well-formed commit: the lease, its keys, slots and checksums
        lease, items = res.lease, [(k, "right", "right") for k in fresh]
    else:
        items = data.draw(st.lists(entry, max_size=5))
    keys, slots, sums = [], [], []
    for k, slot_kind, sum_kind in items:
        right_slot, right_sum = rights.get(k, (0, 0))
        keys.append(k)
        if slot_kind == "other":
            slots.append(data.draw(u64))
        else:  # drawn the same way whatever the node holds now, so hypothesis can replay the case
            pick = data.draw(st.integers(0, len(KNOWN_KEYS) - 1))
            slots.append(right_slot if slot_kind == "right" else known_slots[pick % len(known_slots)])
        sums.append(right_sum if sum_kind == "right" else data.draw(u64))
    packed, n = b"".join(keys), len(keys)
    shape = data.draw(st.sampled_from(["ok", "ok", "ok", "ragged", "slots", "sums"]))
    shape = "ok" if perfect else shape
    if shape == "ragged":
        packed, n = packed + b"\x00" * data.draw(st.integers(1, 31)), None
    elif shape == "slots":
        slots = slots + [0]
    elif shape == "sums":
        sums = sums[:-1] if sums else [0]
    ahead = data.draw(st.lists(st.integers(0, 2 * SLOT), max_size=3))
    request = node_pb2.CommitRequest(lease=lease, keys=packed, slots=slots, checksums=sums, next_sizes=ahead)
    code, reply = checked(pool, "node", "Commit", request, data.draw(unknown_fields()), valid_if(shape == "ok"))
    if code == OK:
        assert len(reply.stored) == n
        nxt = reply.next
        if nxt.lease:  # slots leased ahead: odd, each of a size asked for that DRAM takes
            assert len(nxt.slots) == len(nxt.slot_gens) <= len(ahead)
            assert all(g % 2 == 1 for g in nxt.slot_gens if g)
            assert all(0 < ahead[i] <= SLOT for i, g in enumerate(nxt.slot_gens) if g)
            pool.node.store.dram.release(nxt.lease)
        else:
            assert not any(nxt.slot_gens)
        # the lease's own slot for that key; its checksum is the writer's word, not hashed again (readers verify)
        good = {k for k, slot in zip(keys, slots) if k in rights and rights[k][0] == slot}
        for k, stored in zip(keys, reply.stored):
            if stored:  # never a known key, never another lease's or a bogus slot
                assert k in good and lease == res.lease, (k.hex(), k in KNOWN)
        once = {k for k in keys if keys.count(k) == 1}
        torn = [k for k, checksum, stored in zip(keys, sums, reply.stored)
                if stored and k in once and checksum != rights[k][1]]
        if torn:  # published under a checksum its bytes do not have: no reader ever takes it
            code, got = node_call(pool, "Get", node_pb2.GetRequest(keys=b"".join(torn)))
            assert code == OK and list(got.tiers) == [NO_TIER] * len(torn) and got.data == b"", got
        exact = lease == res.lease and len(set(keys)) == n and set(keys) == good
        if exact and time.monotonic() - reserved_at < LEASE_TIMEOUT_S / 2:  # and the lease cannot have lapsed
            assert list(reply.stored) == [1] * n, "a well-formed commit of the lease's own slots was refused"
        pool.statuses["(Commit: blocks stored)"] += sum(reply.stored)
    if code != OK or lease != res.lease:
        pool.node.store.dram.release(res.lease)  # do not wait for the reaper: DRAM is small
    pool.count("Node.Commit")


@FUZZ
@given(extra=unknown_fields())
def test_flush_reports(pool, extra):
    code, reply = checked(pool, "node", "FlushReports", node_pb2.FlushReportsRequest(), extra, "valid")
    assert code == OK
    pool.count("Node.FlushReports")


# -- Any method: random bytes, mutated messages, oversized messages, unknown methods -----------------------


SEEDS = {path: seed_request(req) for _, path, req in ALL_METHODS}


@fuzz_settings(N_RAW)
@given(method=st.sampled_from(ALL_METHODS), data=st.data())
def test_any_method_random_or_mutated_bytes(pool, method, data):
    server, path, _ = method
    body = data.draw(weighted((1, st.binary(max_size=300)), (2, mutations.map(lambda ops: mutate(SEEDS[path], ops)))))
    assume(not names_known(body))  # never a valid mutating call on the known blocks or the real node
    channel = pool.master_channel if server == "master" else pool.node_channel
    code, detail = pool.call_raw(channel, path, body)
    pool.statuses[code.name] += 1
    expect_status(code, detail if code != OK else "", "either", allowed={OK, INVALID})
    pool.count("any method: random/mutated bytes")


@pytest.mark.parametrize("method", ALL_METHODS, ids=[f"{s}{p}" for s, p, _ in ALL_METHODS])
def test_any_method_over_the_message_limit(pool, method):
    server, path, _ = method
    limit = MASTER_MAX_MESSAGE if server == "master" else NODE_MAX_MESSAGE
    channel = pool.master_channel if server == "master" else pool.node_channel
    code, detail = pool.call_raw(channel, path, bytes(limit + 1))
    expect_status(code, detail, "invalid")
    assert code == EXHAUSTED
    pool.count("any method: over the message limit")


@pytest.mark.parametrize("path", ["/kvpool.v1.Master/Nope", "/kvpool.v1.Node/Lookup", "/kvpool.v2.Master/Lookup", "/x"])
def test_unknown_methods_are_unimplemented(pool, path):
    for channel in (pool.master_channel, pool.node_channel):
        code, detail = pool.call_raw(channel, path, b"\x0a\x00")
        assert code == grpc.StatusCode.UNIMPLEMENTED and detail
        pool.count("unknown method")


# -- Regressions: bugs this fuzzing found ---------------------------------------------------------------------


def test_undecodable_requests_are_invalid_argument_not_internal(pool):
    """gRPC's own decode failure is INTERNAL ('Exception deserializing request!'); the interceptor now decodes."""
    cases = [(pool.master_channel, M + "Lookup", b"\xff\xff\xff"),  # corrupt wire format
             (pool.node_channel, NODE + "Put", b"\x0a\x05abc"),  # a length past the end
             (pool.master_channel, M + "Heartbeat", b"\x0a\x01\xff"),  # node_id: invalid UTF-8
             (pool.node_channel, "/grpc.health.v1.Health/Check", b"\x0a\x01\xff")]
    for channel, path, body in cases:
        code, detail = pool.call_raw(channel, path, body)
        assert code == INVALID and "undecodable" in detail, (path, body, code, detail)
    pool.count("regression")


def test_huge_hbm_counters_are_refused_and_count_nothing(pool):
    """ReportHbm (ReportLookups since) used to add up to 2**64-1 lookups a call: ClusterStatus's uint64 totals
    overflowed (ValueError), then saturated at 2**64-1 after one report. Counts past what the reported lookups
    can hold are refused."""
    code, before = master_call(pool, "ClusterStatus", master_pb2.ClusterStatusRequest())
    assert code == OK, before
    for _ in range(3):
        code, reply = master_call(pool, "ReportLookups", master_pb2.ReportLookupsRequest(
            worker_id="fuzz-counter", lookups=2**64 - 1, requested_blocks=2**64 - 1, hbm_blocks=2**64 - 1,
            block_tokens=2**32 - 1))
        assert code == INVALID, reply
    code, status = master_call(pool, "ClusterStatus", master_pb2.ClusterStatusRequest())
    assert code == OK, status
    assert (status.lookups, status.hit_blocks_hbm) == (before.lookups, before.hit_blocks_hbm) < (2**64 - 1, 2**64 - 1)
    pool.count("regression")


def test_huge_node_refs_are_refused(pool):
    """A NodeRef is echoed in every Lookup / PlaceBlocks / ClusterStatus reply: two 8 MiB ids used to push
    ClusterStatus over the message limit for everyone (RESOURCE_EXHAUSTED) until the node timed out."""
    for field in ("node_id", "address", "host_id", "arena", "data_address"):
        ref = common_pb2.NodeRef(node_id="fuzz-huge", address="fuzz.invalid:1")
        setattr(ref, field, "x" * (MAX_REF_CHARS + 1))
        code, detail = master_call(pool, "RegisterNode", master_pb2.RegisterNodeRequest(node=ref))
        assert code == INVALID and field in detail, (field, code, detail)
    code, status = master_call(pool, "ClusterStatus", master_pb2.ClusterStatusRequest())
    assert code == OK and "fuzz-huge" not in [n.node.node_id for n in status.nodes]
    pool.count("regression")


def report_cases(pool: Pool, request: pytest.FixtureRequest) -> None:
    """Print how many cases ran; when the whole module ran (not a -k selection), every RPC must have had its N
    cases."""
    total = sum(pool.cases.values())
    say(request, f"[fuzz-rpc] {total} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(pool.cases.items())),
        "[fuzz-rpc] fuzzed calls answered: " + ", ".join(f"{k} {v}" for k, v in pool.statuses.most_common()))
    ran = {item.name for item in request.session.items
           if isinstance(item, pytest.Function) and item.module is request.module}
    if {"test_put", "test_lookup", "test_any_method_random_or_mutated_bytes"} <= ran:  # not a -k selection
        rpcs = [f"Master.{m}" for m in MASTER_METHODS] + [f"Node.{m}" for m in NODE_METHODS]
        assert all(pool.cases[r] >= N * 0.9 for r in rpcs), pool.cases
        assert pool.cases["any method: random/mutated bytes"] >= N_RAW * 0.9
