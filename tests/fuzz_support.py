"""Shared by the fuzz tests (test_fuzz_rpc.py, test_fuzz_frames.py): a real master and pool node holding a
known set of blocks, the key namespaces, hypothesis strategies for malformed / oversized / boundary
fields, and the checks every case ends with.

Key namespaces (how "stored data is unchanged" stays provable):
- Known blocks have keys whose first byte is ``KNOWN_TAG``; :data:`fuzz_key` never produces that byte
  (and the master indexes keys by their first 16 bytes, so no fuzz key can even share an index entry).
- Read-only calls (Lookup, Exists, PlaceBlocks, Get, node Exists, Locate) may name known keys.
- Mutating calls (Put, Remove, Reserve, ReportHbm, ReportBlocks for a node the fuzzer registered, bulk
  PUT with valid checksums) name only fuzz keys. Known keys appear in a mutating call only in forms that
  are invalid by construction: packed keys of a ragged length, ReportBlocks / UnregisterNode /
  Heartbeat for the real node with a wrong incarnation, Commit of slots the lease does not own, bulk
  PUT with wrong checksums. Those must change nothing, and :meth:`Pool.check_known` proves it.
- The real node's id is never drawn for RegisterNode (that would legitimately replace its entries).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import random
import uuid
from collections.abc import Sequence
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from support import wait_until

from kvpool.checksum import block_checksum
from kvpool.config import MasterConfig, NodeConfig
from kvpool.keys import KEY_BYTES, BlockKey
from kvpool.master import MasterServer
from kvpool.master.server import max_message_bytes as master_max_message_bytes
from kvpool.node.daemon import PoolNode
from kvpool.node.master_link import MasterLink
from kvpool.v1 import common_pb2, master_pb2, node_pb2
from kvpool.vocabulary import NO_TIER

# -- the pool under test -------------------------------------------------------------------------------

REAL_NODE_ID = "fuzz-real-node"
KNOWN_TAG = 0xA5
SLOT = 16 << 10
DRAM_SLOTS = 32
NODE_MAX_MESSAGE = 4 << 20
LEASE_TIMEOUT_S = 0.5
MASTER_CONFIG = MasterConfig.of(host="127.0.0.1", port=0, metrics_port=0, call_port=0,
                                node_timeout_s=30.0,  # generous: 2 busy cores must not starve heartbeats
                                max_workers_per_tenant=1 << 20)  # every fuzzed worker id is one: never refused as new
MASTER_MAX_KEYS = MASTER_CONFIG.server.max_keys_per_call
NODE_MAX_KEYS = NodeConfig().server.max_keys_per_call
MASTER_MAX_MESSAGE = master_max_message_bytes(MASTER_CONFIG)
# 1 B .. a whole slot in DRAM, and one block larger than a slot (it lives on SSD only).
KNOWN_SIZES = [1, 100, 4096, SLOT - 1, SLOT, 40 << 10]


def known_key(i: int) -> BlockKey:
    return BlockKey(bytes([KNOWN_TAG]) + hashlib.sha256(f"fuzz-known-{i}".encode()).digest()[1:])


def det_bytes(seed: int, n: int) -> bytes:
    """``n`` deterministic pseudo-random bytes (cheaper than drawing them byte by byte from hypothesis)."""
    return random.Random(seed).randbytes(n)


KNOWN_KEYS = [known_key(i) for i in range(len(KNOWN_SIZES))]
KNOWN_DATA = [det_bytes(1000 + i, n) for i, n in enumerate(KNOWN_SIZES)]
KNOWN_SUMS = [block_checksum(d) for d in KNOWN_DATA]
KNOWN = dict(zip(KNOWN_KEYS, zip(KNOWN_SIZES, KNOWN_SUMS, KNOWN_DATA)))

CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
# The statuses a kvpool server may answer bad input with (see docs/reliability.md):
# - INVALID_ARGUMENT: the servicers' validation (a ValueError) and undecodable requests;
# - RESOURCE_EXHAUSTED: gRPC's own message-size limit, before any kvpool code runs.
# Not here on purpose: UNAVAILABLE (PlaceBlocks with no live node; the real node is always live here, so
# it would mean the node was lost), NOT_FOUND / FAILED_PRECONDITION (the contract answers unknown nodes
# with known=false and bogus leases with stored=0, never an error), and INTERNAL / UNKNOWN (an unhandled
# exception: a bug). UNIMPLEMENTED is allowed only for a method that does not exist.
ALLOWED = {OK, INVALID, EXHAUSTED}
REJECTED = {INVALID, EXHAUSTED}

# KVPOOL_FUZZ_EXPLORE=1: random examples instead (reproduce a run with pytest's --hypothesis-seed=N).
FUZZ_SETTINGS: dict[str, Any] = dict(
    deadline=None, derandomize=os.environ.get("KVPOOL_FUZZ_EXPLORE") != "1", database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                           HealthCheck.large_base_example],
)


def fuzz_settings(max_examples: int) -> settings:
    """Deterministic (derandomize: the examples follow from the test's source), no deadline, no example database."""
    return settings(max_examples=max_examples, **FUZZ_SETTINGS)


class _ErrorLog(logging.Handler):
    """Collects ERROR records of kvpool's loggers: an unhandled exception in a server is always logged."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}\n{record.exc_text or ''}")


class Pool:
    """A real master and one real pool node on loopback, with the known blocks stored (see module docstring)."""

    def __init__(self, tmp) -> None:
        self.errors = _ErrorLog()
        logging.getLogger("kvpool").addHandler(self.errors)
        self.cases: collections.Counter[str] = collections.Counter()
        self.statuses: collections.Counter[str] = collections.Counter()  # status names of the fuzzed calls
        self._since_check = 0
        self.master = MasterServer(MASTER_CONFIG).start()
        self.node: PoolNode | None = None
        self.channels: list[grpc.Channel] = []
        try:
            self.arena = f"kvpool-fuzz-{uuid.uuid4().hex[:8]}"
            self.node = PoolNode(NodeConfig.of(
                master=self.master.address, host="127.0.0.1", port=0, metrics_port=0, data_port=0,
                node_id=REAL_NODE_ID, arena=self.arena, dram_bytes=DRAM_SLOTS * SLOT, max_block_bytes=SLOT,
                ssd_dir=str(tmp / "ssd"), ssd_bytes=256 << 20, max_message_bytes=NODE_MAX_MESSAGE,
                lease_timeout_s=LEASE_TIMEOUT_S,
            )).start()
            self.master_channel = self._channel(self.master.address)
            self.node_channel = self._channel(self.node.address)
            wait_until(lambda: self.node.link.registered, timeout=20)
            reply = self.call(self.node_channel, "/kvpool.v1.Node/Put", node_pb2.PutRequest(
                keys=b"".join(KNOWN_KEYS), sizes=KNOWN_SIZES, data=b"".join(KNOWN_DATA), checksums=KNOWN_SUMS),
                node_pb2.PutResponse)
            assert reply[0] == OK and list(reply[1].stored) == [1] * len(KNOWN_KEYS), reply
            self.check_known()
        except BaseException:
            self.close()
            raise

    def _channel(self, address: str) -> grpc.Channel:
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.channels.append(channel)
        return channel

    @property
    def running_node(self) -> PoolNode:
        """The node, once started (the fuzzers run only then)."""
        assert self.node is not None, "fuzz pool: the node is not started"
        return self.node

    @property
    def real_incarnation(self) -> int:
        link = self.running_node.link
        assert isinstance(link, MasterLink), "fuzz pool: the node follows one master (no shards)"
        return link.incarnation

    # -- calls ------------------------------------------------------------------------------------------

    @staticmethod
    def call_raw(channel: grpc.Channel, path: str, body: bytes, reply_type: Any = None,
                 timeout: float = 15.0) -> tuple[grpc.StatusCode, Any]:
        """Send ``body`` as the whole serialized request; (status, reply or error details). Never raises RpcError."""
        fn: grpc.UnaryUnaryMultiCallable[bytes, Any] = channel.unary_unary(
            path, request_serializer=None, response_deserializer=None if reply_type is None else reply_type.FromString
        )
        try:
            return OK, fn(body, timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()

    def call(self, channel: grpc.Channel, path: str, request: Any, reply_type: Any,
             extra: bytes = b"") -> tuple[grpc.StatusCode, Any]:
        return self.call_raw(channel, path, request.SerializeToString() + extra, reply_type)

    # -- checks -----------------------------------------------------------------------------------------

    def count(self, name: str) -> None:
        """One fuzz case of ``name`` ran; every 25 cases, the servers must be up and the known data intact."""
        self.cases[name] += 1
        self._since_check += 1
        if self._since_check >= 25:
            self._since_check = 0
            self.check_alive()
            self.check_known()

    def check_no_errors_logged(self) -> None:
        assert not self.errors.records, "a server logged an error (unhandled exception?):\n" + \
            "\n".join(self.errors.records[:5])

    def check_alive(self) -> None:
        """Both servers answer health checks and cheap calls, and nothing was logged at ERROR."""
        for channel in (self.master_channel, self.node_channel):
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        code, status = self.call(self.master_channel, "/kvpool.v1.Master/ClusterStatus",
                                 master_pb2.ClusterStatusRequest(), master_pb2.ClusterStatusResponse)
        assert code == OK, status
        assert REAL_NODE_ID in [n.node.node_id for n in status.nodes]
        code, info = self.call(self.node_channel, "/kvpool.v1.Node/Info", node_pb2.InfoRequest(),
                               node_pb2.InfoResponse)
        assert code == OK and info.node.node_id == REAL_NODE_ID, info
        self.check_no_errors_logged()

    def check_known(self) -> None:
        """The known blocks read back byte-exact (checksums too) and the master's index holds every one."""
        assert self.node is not None
        code, got = self.call(self.node_channel, "/kvpool.v1.Node/Get", node_pb2.GetRequest(keys=b"".join(KNOWN_KEYS)),
                              node_pb2.GetResponse)
        assert code == OK, got
        assert NO_TIER not in got.tiers, f"a known block is gone from the node: tiers {list(got.tiers)}"
        assert list(got.sizes) == KNOWN_SIZES and list(got.checksums) == KNOWN_SUMS
        assert got.data == b"".join(KNOWN_DATA), "known blocks changed on the node"
        self.node.link.flush()  # changes (demotions, promotions) the link has not sent yet

        def indexed() -> bool:
            code, run = self.call(self.master_channel, "/kvpool.v1.Master/Lookup",
                                  master_pb2.LookupRequest(keys=b"".join(KNOWN_KEYS)), master_pb2.LookupResponse)
            assert code == OK, run
            if len(run.tiers) != len(KNOWN_KEYS):
                return False
            assert list(run.sizes) == KNOWN_SIZES and list(run.checksums) == KNOWN_SUMS, run
            assert [n.node_id for n in run.nodes] == [REAL_NODE_ID], run.nodes
            return True

        wait_until(indexed, timeout=10)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        if self.node is not None:
            self.node.stop()
        self.master.stop()
        logging.getLogger("kvpool").removeHandler(self.errors)


def expect_status(code: grpc.StatusCode, detail: Any, expect: str, allowed: set = ALLOWED) -> None:
    """``expect``: "invalid" (must be refused), "valid" (must be OK) or "either"."""
    assert code in allowed, f"status {code.name}: {detail}"
    if code != OK:
        assert isinstance(detail, str) and detail.strip(), f"{code.name} without a message"
    if expect == "invalid":
        assert code in REJECTED, f"malformed input was accepted: {detail}"
    elif expect == "valid":
        assert code == OK, f"well-formed input was refused: {code.name}: {detail}"


# -- strategies -------------------------------------------------------------------------------------------


def weighted(*options: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of the strategies, picked in proportion to the weights (``one_of`` would pick each distinct one
    equally often, however often it is listed)."""
    strategies = [s for _, s in options]
    picks = [i for i, (w, _) in enumerate(options) for _ in range(w)]
    return st.sampled_from(picks).flatmap(lambda i: strategies[i])


def _not_known(b: bytes) -> bytes:
    return b if b[0] != KNOWN_TAG else bytes([KNOWN_TAG ^ 0xFF]) + b[1:]


fuzz_key = st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES).map(_not_known)
any_key = weighted((2, fuzz_key), (1, st.sampled_from(KNOWN_KEYS)))

U64_EDGES = [0, 1, 2, 255, 256, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1]
u64 = weighted((1, st.sampled_from(U64_EDGES)), (1, st.integers(0, 2**64 - 1)))
u32 = weighted((1, st.sampled_from([0, 1, 2**31 - 1, 2**31, 2**32 - 1])), (1, st.integers(0, 2**32 - 1)))
enum_value = weighted((2, st.sampled_from([0, 1, 2])),
                      (1, st.sampled_from([3, 255, -1, 2**31 - 1, -(2**31)])), (1, st.integers(-(2**31), 2**31 - 1)))
size_value = weighted((2, st.integers(1, SLOT + 1)),
                      (1, st.sampled_from([0, 1, SLOT - 1, SLOT, SLOT + 1, 64 << 20, 2**63, 2**64 - 1])), (1, u64))
short_text = st.text(max_size=24)
id_text = weighted((4, short_text), (1, st.text(min_size=1020, max_size=1030)), (1, st.just("i" * 100_000)))

OVER_KEYS = max(MASTER_MAX_KEYS, NODE_MAX_KEYS) + 1
# Too many keys for one call (well packed: one fuzz key repeated): always refused. 2 MiB each, built once.
over_limit_keys = st.sampled_from([bytes([0x11]) * KEY_BYTES * OVER_KEYS, bytes([0x12]) * KEY_BYTES * (OVER_KEYS + 99)])


def packed_keys(key: st.SearchStrategy, max_keys: int = 8) -> st.SearchStrategy:
    """(packed keys field, number of keys or None if the field is malformed)."""
    ragged = st.binary(max_size=160).filter(lambda b: len(b) % KEY_BYTES).map(lambda b: (b, None))
    # Known keys in front of a ragged tail: such a field must be refused whole.
    known_ragged = st.tuples(st.lists(st.sampled_from(KNOWN_KEYS), max_size=3), st.integers(1, KEY_BYTES - 1)).map(
        lambda t: (b"".join(t[0]) + b"\x00" * t[1], None))
    return weighted(
        (8, st.lists(key, max_size=max_keys).map(lambda ks: (b"".join(ks), len(ks)))),
        (1, st.lists(key, min_size=1, max_size=2).map(lambda ks: (b"".join(ks) * 50, 50 * len(ks)))),
        (2, ragged), (1, known_ragged), (1, over_limit_keys.map(lambda b: (b, None))),
    )


def parallel(n: int | None, values: st.SearchStrategy) -> st.SearchStrategy:
    """A list parallel to ``n`` keys, usually of the right length, sometimes one off or empty."""
    if n is None:
        return st.lists(values, max_size=10)
    return weighted((4, st.lists(values, min_size=n, max_size=n)), (1, st.lists(values, max_size=n + 2)))


def unknown_fields() -> st.SearchStrategy:
    """Well-formed fields with numbers no kvpool message uses (>= 100): a decoder must skip them."""

    def varint(v: int) -> bytes:
        out = bytearray()
        while True:
            b = v & 0x7F
            v >>= 7
            out.append(b | (0x80 if v else 0))
            if not v:
                return bytes(out)

    def field(t: tuple[int, int, int, bytes]) -> bytes:
        number, wire, value, payload = t
        tag = varint(number << 3 | wire)
        if wire == 0:
            return tag + varint(value)
        if wire == 1:
            return tag + value.to_bytes(8, "little")
        if wire == 5:
            return tag + (value & 0xFFFFFFFF).to_bytes(4, "little")
        return tag + varint(len(payload)) + payload

    one = st.tuples(st.integers(100, 2**29 - 1), st.sampled_from([0, 1, 2, 5]), st.integers(0, 2**64 - 1),
                    st.binary(max_size=40)).map(field)
    return st.lists(one, max_size=3).map(b"".join)


def tier_usage() -> st.SearchStrategy:
    return st.builds(common_pb2.TierUsage, tier=enum_value, capacity_bytes=u64, used_bytes=u64, blocks=u64)


def tiers_valid(tiers: Sequence[common_pb2.TierUsage]) -> bool:
    seen = [t.tier for t in tiers]
    return all(t in (1, 2) for t in seen) and len(set(seen)) == len(seen)


def mutate(data: bytes, ops: Sequence[tuple[int, int, int]]) -> bytes:
    """Apply (kind, position, value) edits: flip a byte, truncate, insert a byte, duplicate a span."""
    buf = bytearray(data)
    for kind, pos, value in ops:
        at = pos % (len(buf) + 1)
        if kind == 0 and buf:
            buf[at % len(buf)] ^= value or 1
        elif kind == 1:
            del buf[at:]
        elif kind == 2:
            buf.insert(at, value)
        else:
            buf[at:at] = buf[at : at + value % 16]
    return bytes(buf)


mutations = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2**16), st.integers(0, 255)), min_size=1, max_size=4)


def names_known(raw: bytes) -> bool:
    """Whether serialized bytes contain a known key or the real node's id anywhere."""
    return any(k in raw for k in KNOWN_KEYS) or REAL_NODE_ID.encode() in raw


def seed_request(request_type) -> bytes:
    """A well-formed request of ``request_type`` with every field set, naming fuzz keys only."""
    if request_type is None:
        return b""
    keys = b"".join(bytes([0x33, i]) + bytes(30) for i in range(3))
    fill = {
        "node": common_pb2.NodeRef(node_id="fuzz-raw", address="fuzz.invalid:1", host_id="h", arena="a"),
        "tiers": [common_pb2.TierUsage(tier=common_pb2.TIER_DRAM, capacity_bytes=1 << 20, used_bytes=1, blocks=1)],
        "keys": keys, "added_keys": keys, "removed_keys": keys[:32], "data": b"d" * 30,
        "sizes": [10, 10, 10], "added_sizes": [1, 2, 3], "checksums": [1, 2, 3], "added_checksums": [1, 2, 3],
        "slots": [1, 2, 3], "node_id": "fuzz-raw", "worker_id": "w", "incarnation": 7, "lease": 3,
        "dram_max_block_bytes": 4096, "tier": 1, "full_sync": True, "promote": True,
        "hbm_prefix_blocks": 2,
        "block_tokens": 16, "lookups": 1, "requested_blocks": 1, "hbm_blocks": 1,
    }
    request = request_type()
    for field in request_type.DESCRIPTOR.fields:
        if field.name not in fill:  # a field added since: left unset
            continue
        value = fill[field.name]
        if field.message_type is not None and not field.is_repeated:
            getattr(request, field.name).CopyFrom(value)
        elif field.is_repeated:
            getattr(request, field.name).extend(value)
        else:
            setattr(request, field.name, value)
    return request.SerializeToString()


def say(request: pytest.FixtureRequest, *lines: str) -> None:
    """Print ``lines`` past output capture (as ``capsys.disabled()``, which a module fixture cannot take): a fuzz
    module's summary of what it ran."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        print()
        for line in lines:
            print(line)
