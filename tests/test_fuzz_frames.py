"""Bad input (issue 7): property-based fuzzing of the two plain-TCP protocols with raw sockets.

- Fast calls (kvpool/calls.py) on the master's call port and on the node's bulk port: frames with
  random method ids (valid, 0, past the list, AUTH 0xFFFF, any u16), random / mutated / well-formed
  bodies, wrong versions, lengths over the limit, several frames on one connection, truncation anywhere.
- Bulk (kvpool/bulkwire.py, served by kvpool/node/bulk.py): requests with random magic, version, op,
  flags, count and reserved fields,
  GET / PUT / AUTH bodies with boundary sizes (0, a slot, a slot + 1, more than any tier takes),
  right and wrong checksums, several requests on one connection, truncation anywhere.

Each case is checked against a model of the protocol (what the server must answer to exactly the bytes
sent, in order): a reply of the right shape for every complete well-formed request, an error reply with
a non-empty message for a malformed one (INVALID_ARGUMENT / UNIMPLEMENTED / UNAUTHENTICATED for an AUTH
token over the limit; bulk ERROR, never "internal error") and then the connection closed, a silent close
for a truncated one, and never a hang (every read has a deadline). After each case the listener
answers a fresh connection (a cheap call on the known blocks), no DRAM slot stays leased by the bulk
listener, and every 25 cases (and after each test) the full checks of tests/fuzz_support.py run: both
servers healthy, nothing logged at ERROR, the known blocks byte-exact on the node and in the master's index.

Deterministic: ``derandomize=True``. ``KVPOOL_FUZZ_SCALE=4`` runs four times as many cases.
"""

from __future__ import annotations

import collections
import functools
import os
import socket
import struct
import threading
import time

import grpc
import numpy as np
import pytest
from fuzz_support import (
    KNOWN,
    KNOWN_KEYS,
    KNOWN_SUMS,
    MASTER_MAX_MESSAGE,
    NODE_MAX_MESSAGE,
    SLOT,
    Pool,
    any_key,
    det_bytes,
    fuzz_key,
    fuzz_settings,
    mutate,
    mutations,
    names_known,
    seed_request,
    weighted,
)
from hypothesis import assume, given
from hypothesis import strategies as st

from kvpool import bulkwire
from kvpool.auth import MAX_TOKEN_BYTES
from kvpool.calls import AUTH_METHOD, CALL_MAGIC, CALL_VERSION, FRAME, MASTER_CALLS, NODE_CALLS
from kvpool.checksum import block_checksum
from kvpool.rpc import MISS
from kvpool.v1 import master_pb2, node_pb2

SCALE = float(os.environ.get("KVPOOL_FUZZ_SCALE", "1"))
N = max(1, int(400 * SCALE))
READ_TIMEOUT_S = 15.0

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED.value[0]
OK = 0

_CODES = {code.value[0]: code.value for code in grpc.StatusCode}
TALLY: collections.Counter[str] = collections.Counter()  # what the servers answered, for the summary line
MASTER_SVC = master_pb2.DESCRIPTOR.services_by_name["Master"]
NODE_SVC = node_pb2.DESCRIPTOR.services_by_name["Node"]


def _types(service, names, module):
    return [(getattr(module, service.methods_by_name[n].input_type.name),
             getattr(module, service.methods_by_name[n].output_type.name)) for n in names]


SERVERS = {  # name -> (method names, (request, reply) types, body limit)
    "master": (MASTER_CALLS, _types(MASTER_SVC, MASTER_CALLS, master_pb2), MASTER_MAX_MESSAGE),
    "node": (NODE_CALLS, _types(NODE_SVC, NODE_CALLS, node_pb2), NODE_MAX_MESSAGE),
}
READ_ONLY = {("master", "Lookup"), ("master", "Exists"), ("master", "PlaceBlocks"), ("node", "Locate")}
# Well-formed read-only calls on exactly the known keys: their replies are checked in full.
KNOWN_BODIES = {("master", "Lookup"): master_pb2.LookupRequest(keys=b"".join(KNOWN_KEYS)).SerializeToString(),
                ("master", "Exists"): master_pb2.ExistsRequest(keys=b"".join(KNOWN_KEYS)).SerializeToString(),
                ("node", "Locate"): node_pb2.LocateRequest(keys=b"".join(KNOWN_KEYS)).SerializeToString()}


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = Pool(tmp_path_factory.mktemp("fuzz-frames"))
    try:
        yield p
        p.check_alive()
        p.check_known()
    finally:
        p.close()


def port_of(pool: Pool, server: str) -> int:
    return pool.master.servicer.call_port if server == "master" else pool.running_node.bulk.port


def exchange(port: int, stream: bytes) -> bytes:
    """Send ``stream`` (from a thread: the server may answer while we send), half-close, read to EOF."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S)
    sent_error: list[BaseException] = []

    def send() -> None:
        try:
            sock.sendall(stream)
            sock.shutdown(socket.SHUT_WR)
        except OSError as exc:  # the server may close first (a refused request): not the point here
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


# -- fast calls --------------------------------------------------------------------------------------------


@st.composite
def call_frames(draw, server: str):
    """(frames to send, cut position or None); a frame is (header bytes, body bytes, declared length)."""
    names, types, limit = SERVERS[server]
    frames = []
    for _ in range(draw(st.integers(1, 3))):
        method = draw(weighted((6, st.integers(1, len(names))), (1, st.sampled_from([0, len(names) + 1, AUTH_METHOD])),
                               (1, st.integers(0, 0xFFFF))))
        if 1 <= method <= len(names):
            seed = seed_request(types[method - 1][0])
            known = KNOWN_BODIES.get((server, names[method - 1]))
            body = draw(weighted((3, st.just(seed)), (3, mutations.map(functools.partial(mutate, seed))),
                                 (2, st.binary(max_size=200)), (2 if known else 0, st.just(known))))
        elif method == AUTH_METHOD:
            body = draw(weighted((3, st.binary(max_size=64)), (1, st.binary(min_size=MAX_TOKEN_BYTES + 1,
                                                                            max_size=MAX_TOKEN_BYTES + 8))))
        else:
            body = draw(st.binary(max_size=64))
        header = draw(weighted((8, st.just("ok")), (1, st.just("version")), (1, st.just("over")),
                               (1 if server == "master" else 0, st.just("magic")), (1, st.just("flags"))))
        magic, version, flags, length = CALL_MAGIC, CALL_VERSION, 0, len(body)
        if header == "version":
            version = draw(st.integers(0, 0xFFFF).filter(lambda v: v != CALL_VERSION))
        elif header == "over":
            length, body = limit + draw(st.sampled_from([1, 1000, 2**31])), b""
            length = min(length, 2**32 - 1)
        elif header == "magic":
            magic = draw(st.binary(min_size=4, max_size=4).filter(lambda m: m not in (CALL_MAGIC, bulkwire.MAGIC)))
        elif header == "flags":
            flags = draw(st.integers(1, 2**32 - 1))
        frames.append((FRAME.pack(magic, version, method, flags, length), body, length))
    stream_len = sum(len(h) + len(b) for h, b, _ in frames)
    cut = draw(weighted((4, st.none()), (1, st.integers(0, max(0, stream_len - 1)))))
    return frames, cut


def expected_call_replies(frames, cut, limit: int) -> list[tuple[str, int]]:
    """What the server must answer, frame by frame: ("reply", method) / ("close-error", code) / ("eof", 0)."""
    stream_len = sum(len(h) + len(b) for h, b, _ in frames) if cut is None else cut
    out: list[tuple[str, int]] = []
    pos = 0
    for header, _body, length in frames:
        if pos + len(header) > stream_len:
            return out + [("eof", 0)]
        magic, version, method, _, _ = FRAME.unpack(header)
        pos += len(header)
        if magic != CALL_MAGIC or version != CALL_VERSION or length > limit:
            return out + [("close-error", INVALID)]
        if method == AUTH_METHOD and length > MAX_TOKEN_BYTES:
            return out + [("close-error", UNAUTHENTICATED)]
        if pos + length > stream_len:
            return out + [("eof", 0)]
        pos += length
        out.append(("reply", method))
    return out + [("eof", 0)]


def check_call_replies(data: bytes, frames, expect, server: str) -> None:
    names, types, _ = SERVERS[server]
    bodies = [b for _, b, _ in frames]
    r = Reader(data)
    for i, (kind, value) in enumerate(expect):
        if kind == "eof":
            assert r.done(), f"bytes after the last reply the server owed: {data[r.pos:r.pos + 64]!r}"
            return
        magic, version, status, _, length = FRAME.unpack(r.take(FRAME.size, "a reply header"))
        assert (magic, version) == (CALL_MAGIC, CALL_VERSION), (magic, version)
        TALLY[f"fast call {grpc.StatusCode(_CODES[status]).name if status in _CODES else status}"] += 1
        text = r.take(length, "a reply body")
        if kind == "close-error":
            assert status == value and text.strip(), (status, text)
            assert r.done(), "the connection should close after a malformed frame"
            return
        method = value
        if method == AUTH_METHOD:
            assert status == OK and not text, (status, text)  # no auth file: any short token is fine
        elif not 1 <= method <= len(names):
            assert status == UNIMPLEMENTED and text.strip(), (status, text)
        else:
            assert status in (OK, INVALID), f"{names[method - 1]}: status {status}: {text!r}"
            if status != OK:
                assert text.strip(), "an error reply without a message"
                continue
            reply = types[method - 1][1].FromString(text)
            if bodies[i] == KNOWN_BODIES.get((server, names[method - 1])):
                check_known_reply(names[method - 1], reply)
    raise AssertionError("expectation list without an end")


def check_known_reply(name: str, reply) -> None:
    """A read-only fast call on exactly the known keys."""
    if name == "Exists":
        assert list(reply.present) == [1] * len(KNOWN_KEYS)
    elif name == "Lookup":
        assert list(reply.sizes) == [KNOWN[k][0] for k in KNOWN_KEYS] and list(reply.checksums) == KNOWN_SUMS
    elif name == "Locate":
        for k, gen, size, checksum in zip(KNOWN_KEYS, reply.slot_gens, reply.sizes, reply.checksums):
            assert gen % 2 == 0 and (not gen or (size, checksum) == KNOWN[k][:2])


def cheap_fast_call(pool: Pool, server: str) -> None:
    """A fresh connection answers a well-formed read-only call on the known keys."""
    name = "Exists" if server == "master" else "Locate"
    names, types, _ = SERVERS[server]
    method = names.index(name) + 1
    body = types[method - 1][0](keys=b"".join(KNOWN_KEYS)).SerializeToString()
    if server == "master":
        pool.running_node.link.flush()
    data = exchange(port_of(pool, server), FRAME.pack(CALL_MAGIC, CALL_VERSION, method, 0, len(body)) + body)
    check_call_replies(data, [(b"", body, len(body))], [("reply", method), ("eof", 0)], server)


@pytest.mark.parametrize("server", ["master", "node"])
def test_fast_call_frames(pool, server):
    @fuzz_settings(N)
    @given(case=call_frames(server))
    def run(case):
        frames, cut = case
        stream = b"".join(h + b for h, b, _ in frames)
        names = SERVERS[server][0]
        for header, body, _ in frames:  # never a valid mutating call on the known blocks or the real node
            method = FRAME.unpack(header)[2]
            if 1 <= method <= len(names) and (server, names[method - 1]) not in READ_ONLY:
                assume(not names_known(body))
        if cut is not None:
            stream = stream[:cut]
        expect = expected_call_replies(frames, cut, SERVERS[server][2])
        pool.running_node.link.flush()  # Lookup / Exists of the known keys must find all of them
        data = exchange(port_of(pool, server), stream)
        check_call_replies(data, frames, expect, server)
        cheap_fast_call(pool, server)
        pool.count(f"fast calls ({server})")

    run()
    pool.running_node.store.dram.expire(time.monotonic() + 3600)  # fuzzed Reserve leases: do not wait for the reaper
    pool.check_alive()
    pool.check_known()


# -- bulk ------------------------------------------------------------------------------------------------------

SIZE_EDGES = [0, 1, SLOT - 1, SLOT, SLOT + 1, 300 << 20, 2**40, 2**64 - 1]


@st.composite
def bulk_request(draw, max_keys: int):
    """(header, body, known keys named in a PUT with wrong checksums are fine: a held key is never overwritten)."""
    op = draw(weighted((4, st.just(bulkwire.OP_GET)), (4, st.just(bulkwire.OP_PUT)), (1, st.just(bulkwire.OP_AUTH)),
                       (1, st.integers(0, 255))))
    count = draw(weighted((8, st.integers(0, 6)), (1, st.sampled_from([max_keys, max_keys + 1, 2**32 - 1]))))
    other = st.binary(min_size=4, max_size=4).filter(lambda m: m not in (bulkwire.MAGIC, CALL_MAGIC))
    magic = draw(weighted((10, st.just(bulkwire.MAGIC)), (1, other)))
    version = draw(weighted((10, st.just(bulkwire.VERSION)), (1, st.integers(0, 0xFFFF))))
    flags = draw(weighted((4, st.just(0)), (1, st.integers(0, 255))))
    reserved = draw(weighted((4, st.just(0)), (1, st.integers(0, 2**32 - 1))))
    header = bulkwire.HEADER.pack(magic, version, op, flags, count, reserved)
    n = min(count, 8) if count <= max_keys else 0  # keys actually sent (a huge count is cut short anyway)
    if op == bulkwire.OP_GET:
        body = b"".join(draw(st.lists(any_key, min_size=n, max_size=n)))
    elif op == bulkwire.OP_PUT:
        known = draw(st.booleans())
        keys = draw(st.lists(any_key if known else fuzz_key, min_size=n, max_size=n))
        sizes = [draw(weighted((12, st.integers(1, 48 << 10)), (1, st.sampled_from(SIZE_EDGES)))) for _ in keys]
        blocks = [det_bytes(draw(st.integers(0, 2**32)), s) if s <= 1 << 20 else b"" for s in sizes]
        sums = [block_checksum(b) ^ (draw(st.booleans()) or k in KNOWN) for k, b in zip(keys, blocks)]
        body = b"".join(keys) + np.array(sizes, "<u8").tobytes() + np.array(sums, "<u8").tobytes() + b"".join(blocks)
    elif op == bulkwire.OP_AUTH:
        body = det_bytes(count, min(count, 600))
    else:
        body = draw(st.binary(max_size=64))
    return header, body


@st.composite
def bulk_streams(draw, max_keys: int):
    reqs = [draw(bulk_request(max_keys)) for _ in range(draw(st.integers(1, 3)))]
    total = sum(len(h) + len(b) for h, b in reqs)
    last = len(reqs[-1][1])
    cut = draw(weighted((4, st.none()), (1, st.integers(0, max(0, total - 1))),  # anywhere
                        (1 if last else 0, st.integers(1, max(1, last)).map(lambda k: total - k))))  # last body
    return reqs, cut


def expected_bulk_replies(pool: Pool, reqs, cut) -> list[tuple]:
    """The bulk listener's answers to exactly these bytes (the protocol in kvpool/bulkwire.py, as a model)."""
    node = pool.running_node
    ssd = node.store.ssd

    def fits(n: int) -> bool:
        return node.store.fits_dram(n) or (ssd is not None and ssd.fits(n))

    stream = b"".join(h + b for h, b in reqs)
    end = len(stream) if cut is None else cut
    out: list[tuple] = []
    pos = 0
    for header, _ in reqs:
        if pos + len(header) > end:
            return out + [("eof",)]
        magic, version, op, _, count, _ = bulkwire.HEADER.unpack(header)
        pos += len(header)
        if magic != bulkwire.MAGIC or version != bulkwire.VERSION:
            return out + [("error",)]
        if op == bulkwire.OP_AUTH:
            if count > MAX_TOKEN_BYTES:
                return out + [("error",)]
            if pos + count > end:
                return out + [("eof",)]
            pos += count
            out.append(("auth",))
            continue
        if count > node.bulk.max_keys_per_call:
            return out + [("error",)]
        if op == bulkwire.OP_GET:
            if pos + 32 * count > end:
                return out + [("eof",)]
            keys = [stream[pos + 32 * i : pos + 32 * i + 32] for i in range(count)]
            pos += 32 * count
            out.append(("get", keys))
        elif op == bulkwire.OP_PUT:
            if pos + 48 * count > end:
                return out + [("eof",)]
            keys = [stream[pos + 32 * i : pos + 32 * i + 32] for i in range(count)]
            sizes = np.frombuffer(stream, "<u8", count, pos + 32 * count).tolist()
            pos += 48 * count
            if any(s == 0 or not fits(s) for s in sizes) or sum(sizes) > node.bulk.max_request_bytes:
                return out + [("error",)]
            if pos + sum(sizes) > end:
                return out + [("eof",)]
            pos += sum(sizes)
            out.append(("put", keys))
        else:
            return out + [("error",)]
    return out + [("eof",)]


def check_bulk_replies(data: bytes, expect: list[tuple], reqs) -> None:
    r = Reader(data)
    for item in expect:
        kind = item[0]
        TALLY[f"bulk {kind}"] += 1
        if kind == "eof":
            assert r.done(), f"bytes after the last reply the node owed: {data[r.pos:r.pos + 64]!r}"
            return
        magic, version, status, op, count, _ = bulkwire.HEADER.unpack(r.take(bulkwire.HEADER.size, "a reply header"))
        assert (magic, version) == (bulkwire.MAGIC, bulkwire.VERSION)
        if kind == "error":
            assert status == bulkwire.STATUS_ERROR, status
            (length,) = struct.unpack("<I", r.take(4, "an error length"))
            text = r.take(length, "an error message").decode("utf-8", "replace")
            assert text.strip() and "internal error" not in text, text
            assert r.done(), "the connection should close after an ERROR reply"
            return
        assert status == bulkwire.STATUS_OK, (status, r.data[r.pos : r.pos + 200])
        if kind == "auth":
            assert (op, count) == (bulkwire.OP_AUTH, 0)
            continue
        keys = item[1]
        n = len(keys)
        assert count == n
        if kind == "put":
            assert op == bulkwire.OP_PUT
            stored = r.take(n, "stored flags")
            assert set(stored) <= {0, 1}
            continue
        assert op == bulkwire.OP_GET
        sizes = np.frombuffer(r.take(8 * n, "sizes"), "<u8").tolist()
        sums = np.frombuffer(r.take(8 * n, "checksums"), "<u8").tolist()
        tiers = r.take(n, "tiers")
        blocks = []
        for size in sizes:
            blocks.append(r.take(size, "block data"))
        valid = r.take(n, "valid flags")
        for k, size, checksum, tier, block, ok in zip(keys, sizes, sums, tiers, blocks, valid):
            assert (tier == MISS) == (size == 0) and (tier == MISS) <= (not ok)
            if k in KNOWN:
                assert tier != MISS and (size, checksum) == KNOWN[k][:2]
            if ok:  # bytes the node vouches for are the block's (a known one: exactly)
                assert block_checksum(block) == checksum
                assert k not in KNOWN or block == KNOWN[k][2]
    raise AssertionError("expectation list without an end")


def cheap_bulk_get(pool: Pool) -> None:
    """A fresh connection: GET of the known keys answers their exact bytes (or an honest miss flag)."""
    keys = list(KNOWN_KEYS)
    data = exchange(pool.running_node.bulk.port, bulkwire.request_header(bulkwire.OP_GET, len(keys)) + b"".join(keys))
    check_bulk_replies(data, [("get", keys), ("eof",)], None)


def test_bulk_requests(pool):
    max_keys = pool.running_node.bulk.max_keys_per_call

    @fuzz_settings(N)
    @given(case=bulk_streams(max_keys))
    def run(case):
        reqs, cut = case
        stream = b"".join(h + b for h, b in reqs)
        expect = expected_bulk_replies(pool, reqs, cut)
        data = exchange(pool.running_node.bulk.port, stream if cut is None else stream[:cut])
        check_bulk_replies(data, expect, reqs)
        # the listener's own leases end with the request, whatever happened to it
        assert pool.running_node.store.dram.leased_slots == 0, "a bulk PUT left DRAM slots leased"
        cheap_bulk_get(pool)
        pool.count("bulk")

    run()
    pool.check_alive()
    pool.check_known()


def test_bulk_put_of_valid_fuzz_blocks_is_stored_and_read_back(pool):
    """Not fuzz: the well-formed path the model above only shape-checks, so the model is known to accept it."""
    keys = [bytes([0x44, i]) + bytes(30) for i in range(4)]
    blocks = [det_bytes(i, n) for i, n in enumerate([1, SLOT, SLOT + 1, 40 << 10])]
    body = (b"".join(keys) + np.array([len(b) for b in blocks], "<u8").tobytes()
            + np.array([block_checksum(b) for b in blocks], "<u8").tobytes() + b"".join(blocks))
    data = exchange(pool.running_node.bulk.port, bulkwire.request_header(bulkwire.OP_PUT, 4) + body
                    + bulkwire.request_header(bulkwire.OP_GET, 4) + b"".join(keys))
    r = Reader(data)
    assert bulkwire.HEADER.unpack(r.take(16, "header"))[2:5] == (bulkwire.STATUS_OK, bulkwire.OP_PUT, 4)
    assert r.take(4, "stored") == b"\x01" * 4
    check_bulk_replies(data[r.pos:], [("get", keys), ("eof",)], None)
    got = pool.running_node.store.where(keys)
    assert None not in got
    pool.count("bulk")


def test_zz_report_cases(pool, capsys, request):
    """Print how many cases ran; when the whole module ran, each protocol must have had its N cases."""
    pool.check_alive()
    pool.check_known()
    total = sum(pool.cases.values())
    with capsys.disabled():
        print(f"\n[fuzz-frames] {total} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(pool.cases.items())))
        print("[fuzz-frames] answers (cheap liveness calls included): "
              + ", ".join(f"{k} {v}" for k, v in TALLY.most_common()))
    ran = {item.originalname for item in request.session.items if item.module is request.module}
    if {"test_fast_call_frames", "test_bulk_requests"} <= ran:  # not a -k selection
        assert pool.cases["fast calls (master)"] >= N * 0.9 and pool.cases["fast calls (node)"] >= N * 0.9
        assert pool.cases["bulk"] >= N * 0.9
