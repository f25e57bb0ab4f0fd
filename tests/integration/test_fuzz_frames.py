"""Bad input (issue 7): property-based fuzzing of the wire (kvpool/wire.py) with raw sockets.

The one frame format, on the master's call port (fast calls) and on the node's data port (fast calls
and bulk GET / PUT): frames with random methods (served, 0, another listener's, AUTH, any u16), random /
mutated / well-formed headers, PUT headers and payloads with boundary sizes (0, a slot, a slot + 1,
more than any tier takes) and right and wrong checksums, wrong magic or version, sections over their
limits, trailers in requests, several frames on one connection, truncation anywhere.

Each case is checked against a model of the protocol (what the listener must answer to exactly the
bytes sent, in order, from the frame lengths and the listener's own limits): a reply of the right shape
(OK, or an error with a message: INVALID_ARGUMENT for bad values or an undecodable header, UNIMPLEMENTED
for a method the listener does not serve) for every frame it could read in full, after which the
connection goes on; an error reply (INVALID_ARGUMENT, UNAUTHENTICATED for a bad AUTH) and then the
connection closed for a frame out of step; a silent close for a truncated one; never INTERNAL and never
a hang (every read has a deadline). After each case the listener answers a fresh connection (a cheap
call on the known blocks), no DRAM slot stays leased by the listener, and every 25 cases (and after each
test) the full checks of tests/fuzz_support.py run: both servers healthy, nothing logged at ERROR, the
known blocks byte-exact on the node and in the master's index.

Deterministic: ``derandomize=True``. ``KVPOOL_FUZZ_SCALE=4`` runs four times as many cases.
"""

from __future__ import annotations

import collections
import functools
import os
import socket
import threading
import time
from typing import Any

import grpc
import pytest
from fuzz_support import (
    KNOWN,
    KNOWN_KEYS,
    KNOWN_SUMS,
    SLOT,
    Pool,
    any_key,
    det_bytes,
    fuzz_key,
    fuzz_settings,
    mutate,
    mutations,
    names_known,
    say,
    seed_request,
    weighted,
)
from google.protobuf.message import DecodeError
from hypothesis import assume, given
from hypothesis import strategies as st

from kvpool import wire
from kvpool.checksum import block_checksum
from kvpool.v1 import common_pb2, master_pb2, node_pb2
from kvpool.vocabulary import NO_TIER
from kvpool.wire import FRAME, MAGIC, VERSION, Method

SCALE = float(os.environ.get("KVPOOL_FUZZ_SCALE", "1"))
N = max(1, int(400 * SCALE))
READ_TIMEOUT_S = 15.0

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED.value[0]
OK = 0

_CODES = {code.value[0]: code.name for code in grpc.StatusCode}
TALLY: collections.Counter[str] = collections.Counter()  # what the servers answered, for the summary line
MASTER_SVC = master_pb2.DESCRIPTOR.services_by_name["Master"]
NODE_SVC = node_pb2.DESCRIPTOR.services_by_name["Node"]


def _types(service, calls, module) -> dict[int, tuple]:
    return {m: (getattr(module, service.methods_by_name[n].input_type.name),
                getattr(module, service.methods_by_name[n].output_type.name), n) for n, m in calls.items()}


# method -> (request type, reply type, name), per listener
SERVED = {
    "master": _types(MASTER_SVC, wire.MASTER_CALLS, master_pb2),
    "node": {**_types(NODE_SVC, wire.NODE_CALLS, node_pb2),
             Method.GET: (node_pb2.GetRequest, node_pb2.BulkGetReply, "Get"),
             Method.PUT: (node_pb2.BulkPutRequest, node_pb2.PutResponse, "Put")},
}
READ_ONLY = {("master", "Lookup"), ("master", "Exists"), ("master", "PlaceBlocks"), ("node", "Locate"),
             ("node", "Get")}
# Well-formed read-only calls on exactly the known keys: their replies are checked in full.
KNOWN_BODIES = {("master", Method.LOOKUP): master_pb2.LookupRequest(keys=b"".join(KNOWN_KEYS)).SerializeToString(),
                ("master", Method.EXISTS): master_pb2.ExistsRequest(keys=b"".join(KNOWN_KEYS)).SerializeToString(),
                ("node", Method.LOCATE): node_pb2.LocateRequest(keys=b"".join(KNOWN_KEYS)).SerializeToString(),
                ("node", Method.GET): node_pb2.GetRequest(keys=b"".join(KNOWN_KEYS)).SerializeToString()}
SIZE_EDGES = [0, 1, SLOT - 1, SLOT, SLOT + 1, 300 << 20, 2**40, 2**64 - 1]


@pytest.fixture(scope="module")
def pool(tmp_path_factory, request):
    """The module's pool; at its end (whatever order the tests ran in) the servers must be fine, and when the
    whole module ran, each listener must have had its N cases (see :func:`report_cases`)."""
    p = Pool(tmp_path_factory.mktemp("fuzz-frames"))
    try:
        yield p
        p.check_alive()
        p.check_known()
        report_cases(p, request)
    finally:
        p.close()


def port_of(pool: Pool, server: str) -> int:
    return pool.master.servicer.call_port if server == "master" else pool.running_node.bulk.port


def handler_of(pool: Pool, server: str) -> wire.WireHandler:
    if server == "master":
        listener: Any = pool.master._calls
        return listener._serve.__self__  # the WireHandler behind the master's call listener
    return pool.running_node.bulk.handler


def exchange(port: int, stream: bytes) -> bytes:
    """Send ``stream`` (from a thread: the server may answer while we send), half-close, read to EOF."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S)
    sent_error: list[BaseException] = []

    def send() -> None:
        try:
            sock.sendall(stream)
            sock.shutdown(socket.SHUT_WR)
        except OSError as exc:  # the server may close first (a refused frame): not the point here
            sent_error.append(exc)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    got = bytearray()
    deadline = time.monotonic() + READ_TIMEOUT_S
    try:
        while True:
            assert time.monotonic() < deadline, f"no EOF within {READ_TIMEOUT_S}s (a hang)"
            try:
                chunk = sock.recv(1 << 20)
            except ConnectionResetError:
                break  # as EOF; the parser fails the case if a reply it expects is missing
            except TimeoutError:
                raise AssertionError(f"server neither answered nor closed within {READ_TIMEOUT_S}s") from None
            if not chunk:
                break
            got += chunk
    finally:
        sender.join(READ_TIMEOUT_S)
        sock.close()
    assert not sender.is_alive(), "sending never finished (the server stopped reading without closing)"
    return bytes(got)


class Reader:
    """Consumes a reply stream; every read must find the bytes there."""

    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0

    def take(self, n: int, what: str) -> bytes:
        assert self.pos + n <= len(self.data), f"reply stream ends inside {what}"
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def done(self) -> bool:
        return self.pos == len(self.data)


# -- what to send ----------------------------------------------------------------------------------------


@st.composite
def put_request(draw) -> tuple[bytes, bytes]:
    """A PUT's header and payload: keys (known ones are held: never overwritten), boundary sizes, checksums."""
    known = draw(st.booleans())
    keys = draw(st.lists(any_key if known else fuzz_key, max_size=6))
    sizes = [draw(weighted((12, st.integers(1, 48 << 10)), (1, st.sampled_from(SIZE_EDGES)))) for _ in keys]
    blocks = [det_bytes(draw(st.integers(0, 2**32)), s) if s <= 1 << 20 else b"" for s in sizes]
    sums = [block_checksum(b) ^ (draw(st.booleans()) or k in KNOWN) for k, b in zip(keys, blocks)]
    header = node_pb2.BulkPutRequest(keys=b"".join(keys), sizes=sizes, checksums=sums).SerializeToString()
    return header, b"".join(blocks)


@st.composite
def frames(draw, server: str):
    """(frames to send, cut position or None); a frame is (fixed header, header bytes, payload bytes)."""
    served = SERVED[server]
    others = [m for m in Method if m not in served and m != Method.AUTH]
    out = []
    for _ in range(draw(st.integers(1, 3))):
        method = draw(weighted((8, st.sampled_from(sorted(served))), (1, st.just(int(Method.AUTH))),
                               (1, st.sampled_from([0, *others, len(Method) + 1])), (1, st.integers(0, 0xFFFF))))
        payload = b""
        if method == Method.PUT and server == "node":
            put_seed = (seed_request(node_pb2.BulkPutRequest), b"x" * 30)  # three blocks of 10 bytes
            header, payload = draw(weighted((3, put_request()), (1, st.just(put_seed))))
            if draw(st.integers(0, 4)) == 0:
                header = mutate(header, draw(mutations))
        elif method in served:
            seed = seed_request(served[method][0])
            known = KNOWN_BODIES.get((server, method))
            header = draw(weighted((3, st.just(seed)), (3, mutations.map(functools.partial(mutate, seed))),
                                   (2, st.binary(max_size=200)), (2 if known else 0, st.just(known or b""))))
        elif method == Method.AUTH:
            token = common_pb2.AuthRequest(token=draw(st.text(max_size=40))).SerializeToString()
            header = draw(weighted((3, st.just(token)), (1, st.binary(max_size=64)),
                                   (1, st.binary(min_size=600, max_size=620))))
        else:
            header = draw(st.binary(max_size=64))
        variant = draw(weighted((10, st.just("ok")), (1, st.just("version")), (1, st.just("magic")),
                                (1, st.just("header over")), (1, st.just("payload")), (1, st.just("trailer")),
                                (1, st.just("flags"))))
        magic, version, flags, hlen, plen, tlen = MAGIC, VERSION, 0, len(header), len(payload), 0
        if variant == "version":
            version = draw(st.integers(0, 0xFFFF).filter(lambda v: v != VERSION))
        elif variant == "magic":
            magic = draw(st.binary(min_size=4, max_size=4).filter(lambda m: m != MAGIC))
        elif variant == "header over":
            hlen, header = draw(st.sampled_from([5 << 20, 2**31, 2**32 - 1])), b""
        elif variant == "payload":  # a payload announced (maybe over the limit) but not sent with it
            plen, payload = draw(st.sampled_from([1, 100, 5 << 20, 2**40])), b""
        elif variant == "trailer":
            tlen = draw(st.integers(1, 2**32 - 1))
        elif variant == "flags":
            flags = draw(st.integers(1, 2**32 - 1))
        out.append((FRAME.pack(magic, version, method, flags, hlen, plen, tlen, 0), header, payload))
    stream_len = sum(len(f) + len(h) + len(p) for f, h, p in out)
    cut = draw(weighted((4, st.none()), (1, st.integers(0, max(0, stream_len - 1)))))
    return out, cut


# -- the model ---------------------------------------------------------------------------------------------


def expected_replies(pool: Pool, server: str, stream: bytes) -> list[tuple]:
    """What the listener must answer to exactly ``stream``, frame by frame, parsed as the listener parses it:
    ("reply", method, header bytes) / ("auth",) / ("unimplemented",) / ("close", code) / ("eof",)."""
    handler = handler_of(pool, server)
    end = len(stream)
    out: list[tuple] = []
    pos = 0
    while pos < end:
        if pos + FRAME.size > end:
            return out + [("eof",)]
        magic, version, method, _, hlen, plen, tlen, _ = FRAME.unpack_from(stream, pos)
        pos += FRAME.size
        if magic != MAGIC or version != VERSION:
            return out + [("close", INVALID)]
        header = stream[pos : pos + hlen]
        if method == Method.AUTH:
            if hlen > wire.AUTH_HEADER_LIMIT or plen or tlen:
                return out + [("close", UNAUTHENTICATED)]
            if pos + hlen > end:
                return out + [("eof",)]
            pos += hlen
            try:
                common_pb2.AuthRequest.FromString(header)
            except DecodeError:
                return out + [("close", UNAUTHENTICATED)]
            out.append(("auth",))
            continue
        route = handler.route(method)
        if route is None:
            if hlen + plen + tlen > handler.max_frame_bytes:
                return out + [("close", INVALID)]
            kind: tuple = ("unimplemented",)
        elif hlen > route.header_limit or plen > route.payload_limit or tlen:
            return out + [("close", INVALID)]
        else:
            kind = ("reply", method, header)
        if pos + hlen + plen + tlen > end:
            return out + [("eof",)]
        pos += hlen + plen + tlen
        out.append(kind)
    return out + [("eof",)]


def check_replies(data: bytes, expect: list[tuple], server: str) -> None:
    r = Reader(data)
    for item in expect:
        kind = item[0]
        if kind == "eof":
            assert r.done(), f"bytes after the last reply the listener owed: {data[r.pos:r.pos + 64]!r}"
            return
        head = wire.parse(r.take(FRAME.size, "a reply header"))
        assert head is not None, "a reply that is not a wire frame"
        assert not head.flags, head
        TALLY[f"{server} {_CODES.get(head.code, head.code)}"] += 1
        body = r.take(head.header, "a reply header section")
        if head.code != OK or kind in ("close", "unimplemented"):
            assert not head.payload and not head.trailer, head
            assert body.strip(), "an error reply without a message"
        if kind == "close":
            assert head.code == item[1], (head.code, body)
            assert r.done(), "the connection should close after a frame out of step"
            return
        if kind == "unimplemented":
            assert head.code == UNIMPLEMENTED, (head.code, body)
            continue
        if kind == "auth":
            assert head.code == OK and body == b"", (head.code, body)  # no auth file: any token is fine
            continue
        _, method, request = item
        _, reply_type, name = SERVED[server][method]
        assert head.code in (OK, INVALID), f"{name}: status {head.code}: {body!r}"
        if head.code != OK:
            continue
        reply = reply_type.FromString(body)
        if method == Method.GET:
            check_get_reply(reply, r, head, request)
        else:
            assert not head.payload and not head.trailer, head
            if request == KNOWN_BODIES.get((server, method)):
                check_known_reply(name, reply)
    raise AssertionError("expectation list without an end")


def check_get_reply(reply, r: Reader, head: wire.Head, request: bytes) -> None:
    """A bulk GET's reply: the shape of its header, payload and trailer; known blocks exactly."""
    n = len(reply.sizes)
    assert len(reply.checksums) == len(reply.tiers) == n
    assert head.payload == sum(reply.sizes)
    blocks = [r.take(size, "block data") for size in reply.sizes]
    valid = node_pb2.BulkGetTrailer.FromString(r.take(head.trailer, "the trailer")).valid
    assert len(valid) == n
    keys = node_pb2.GetRequest.FromString(request).keys
    keys_list = [keys[32 * j : 32 * j + 32] for j in range(n)] if len(keys) == 32 * n else [b""] * n
    for k, size, checksum, tier, block, ok in zip(keys_list, reply.sizes, reply.checksums, reply.tiers, blocks,
                                                  valid):
        assert (tier == NO_TIER) == (size == 0) and (tier == NO_TIER) <= (not ok)
        if k in KNOWN:
            assert tier != NO_TIER and (size, checksum) == KNOWN[k][:2]
        if ok:  # bytes the node vouches for are the block's (a known one: exactly)
            assert block_checksum(block) == checksum
            assert k not in KNOWN or block == KNOWN[k][2]


def check_known_reply(name: str, reply) -> None:
    """A read-only fast call on exactly the known keys."""
    if name == "Exists":
        assert list(reply.present) == [1] * len(KNOWN_KEYS)
    elif name == "Lookup":
        assert list(reply.sizes) == [KNOWN[k][0] for k in KNOWN_KEYS] and list(reply.checksums) == KNOWN_SUMS
    elif name == "Locate":
        for k, gen, size, checksum in zip(KNOWN_KEYS, reply.slot_gens, reply.sizes, reply.checksums):
            assert gen % 2 == 0 and (not gen or (size, checksum) == KNOWN[k][:2])


def cheap_call(pool: Pool, server: str) -> None:
    """A fresh connection answers a well-formed read-only call on the known keys (a bulk GET on the node)."""
    method = Method.EXISTS if server == "master" else Method.GET
    body = KNOWN_BODIES[(server, method)]
    if server == "master":
        pool.running_node.link.flush()
    data = exchange(port_of(pool, server), wire.pack(method, len(body)) + body)
    check_replies(data, [("reply", method, body), ("eof",)], server)


@pytest.mark.parametrize("server", ["master", "node"])
def test_frames(pool, server):
    @fuzz_settings(N)
    @given(case=frames(server))
    def run(case):
        frames_, cut = case
        for fixed, header, _ in frames_:  # never a valid mutating call on the known blocks or the real node
            method = FRAME.unpack(fixed)[2]
            if method in SERVED[server] and method != Method.PUT \
                    and (server, SERVED[server][method][2]) not in READ_ONLY:
                assume(not names_known(header))
        stream = b"".join(f + h + p for f, h, p in frames_)
        if cut is not None:
            stream = stream[:cut]
        expect = expected_replies(pool, server, stream)
        pool.running_node.link.flush()  # Lookup / Exists of the known keys must find all of them
        dram = pool.running_node.store.dram
        dram.expire(time.monotonic() + 3600)  # earlier cases' fuzzed Reserve leases: do not wait for the reaper
        data = exchange(port_of(pool, server), stream)
        check_replies(data, expect, server)
        if not any(FRAME.unpack(f)[2] == Method.RESERVE for f, _, _ in frames_):
            assert dram.leased_slots == 0, "a bulk PUT left DRAM slots leased"  # they end with the request
        cheap_call(pool, server)
        pool.count(f"frames ({server})")

    run()
    pool.running_node.store.dram.expire(time.monotonic() + 3600)  # fuzzed Reserve leases: do not wait for the reaper
    pool.check_alive()
    pool.check_known()


def test_a_put_of_valid_fuzz_blocks_is_stored_and_read_back(pool):
    """Not fuzz: the well-formed path the model above only shape-checks, so the model is known to accept it."""
    keys = [bytes([0x44, i]) + bytes(30) for i in range(4)]
    blocks = [det_bytes(i, n) for i, n in enumerate([1, SLOT, SLOT + 1, 40 << 10])]
    header = node_pb2.BulkPutRequest(keys=b"".join(keys), sizes=[len(b) for b in blocks],
                                     checksums=[block_checksum(b) for b in blocks]).SerializeToString()
    get = node_pb2.GetRequest(keys=b"".join(keys)).SerializeToString()
    put_fixed, get_fixed = wire.pack(Method.PUT, len(header), sum(len(b) for b in blocks)), wire.pack(Method.GET,
                                                                                                       len(get))
    sent = [(put_fixed, header, b"".join(blocks)), (get_fixed, get, b"")]
    data = exchange(pool.running_node.bulk.port, b"".join(f + h + p for f, h, p in sent))
    r = Reader(data)
    head = wire.parse(r.take(FRAME.size, "header"))
    assert head is not None and head.code == OK
    assert node_pb2.PutResponse.FromString(r.take(head.header, "stored")).stored == b"\x01" * 4
    check_replies(data[r.pos:], [("reply", Method.GET, get), ("eof",)], "node")
    got = pool.running_node.store.where(keys)
    assert None not in got
    pool.count("frames (node)")


def report_cases(pool: Pool, request: pytest.FixtureRequest) -> None:
    """Print how many cases ran; when the whole module ran (not a -k selection), each listener must have had its
    N cases."""
    total = sum(pool.cases.values())
    say(request, f"[fuzz-frames] {total} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(pool.cases.items())),
        "[fuzz-frames] answers (cheap liveness calls included): "
        + ", ".join(f"{k} {v}" for k, v in TALLY.most_common()))
    ran = {item.originalname for item in request.session.items
           if isinstance(item, pytest.Function) and item.module is request.module}
    if "test_frames" in ran:  # not a -k selection
        assert pool.cases["frames (master)"] >= N * 0.9 and pool.cases["frames (node)"] >= N * 0.9
