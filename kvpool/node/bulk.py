"""The node's bulk listener: block bytes over plain TCP, straight between the arena and the socket.

gRPC costs a copy into a ``bytes`` message at each end and tops out well
below what a socket carries, so remote reads and writes use this small
binary protocol instead (gRPC ``Get``/``Put`` stay as the fallback). The
listener's address is ``NodeRef.data_address``.

The protocol (frames, ops, statuses) is :mod:`kvpool.bulkwire`'s, the one module the client
shares with this listener.

Invariants:
- GET sends DRAM blocks from their arena slot (``sendmsg`` of the slot's
  memory: no copy in Python) and re-checks each slot's gen after sending:
  a slot reused mid-send is reported invalid. The client verifies every
  block's checksum anyway, so a torn send is a miss, never wrong bytes.
  SSD-resident blocks are read (and promoted into DRAM) through
  ``TieredStore.get_into`` into a scratch buffer of at most ``SCRATCH_BYTES``
  at a time, then sent.
- PUT receives each block that fits a DRAM slot straight into a slot the
  node reserved for it (``recvmsg_into``), then commits the lease: the key
  becomes visible only after its bytes match its checksum. The listener's
  own leases last as long as their request: they are released in a
  ``finally`` if the request fails, so a client that disconnects, or whose
  request passes its deadline (below), leaves nothing behind. Blocks with no
  DRAM slot (larger than a slot, or no room) go through a scratch buffer to
  ``TieredStore.put`` (SSD). PUT replies only after the master link
  flushed, as gRPC ``Put`` does.
- Deadlines and room (:class:`kvpool.framing.TcpListener`): a connection's
  first header (with an auth file: its AUTH) must arrive within
  ``FIRST_FRAME_S``; each request, from its first byte to its reply's last,
  within ``REQUEST_DEADLINE_S`` (30 s): the connection is then cut, and a
  PUT's reserved slots are released. A full listener closes its readiest
  connection (silent, idle longest, stalled mid-request) for a newcomer.
- Memory follows bytes that arrived: keys and sizes are allocated as they
  come, never from the header's count. A GET's hits may hold at most
  ``MAX_GET_BYTES`` or ``max_request_bytes``, whichever is larger (ERROR
  otherwise, before anything is sent; a client asks for less), and a
  request holds at most ``SCRATCH_BYTES`` of scratch (or one block) and a
  sendmsg's worth of views at once, so a peer that never reads its reply
  pins little besides its kernel buffers, and only until its deadline.
- Bad input (bad magic or version, unknown op, too many keys, a size of 0 or
  one no tier takes) gets an ERROR reply naming the problem, counted as
  ``invalid_argument``; the node then half-closes, drops what the peer still
  sends (for up to ``ERROR_DRAIN_S``) and closes. Nothing a peer sends stops
  the listener.
- One thread per connection, at most ``max_connections``; a newcomer the
  listener has no room for (every connection mid-request) gets an ERROR
  reply, or, if its first bytes are a fast call, a fast-call refusal
  (RESOURCE_EXHAUSTED, flagged refused), and is closed.
- With an auth file the first frame on a connection must be AUTH (bulk op 3
  or the fast-call AUTH frame) with a known token; anything else, or an
  unknown token, gets an ERROR reply starting "unauthenticated" and the
  connection closes. The keys of GET and PUT are the client's tenant's
  (:func:`kvpool.auth.mask_keys`), and a PUT passes the tenant's quota
  (:mod:`kvpool.node.quota`). The blocks of one PUT may hold at most
  ``max_request_bytes``.
"""

from __future__ import annotations

import logging
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool.auth import MAX_TOKEN_BYTES, Authority, Peer
from kvpool.bulkwire import (
    HEADER,
    MAGIC,
    MAX_GET_BYTES,
    OP_AUTH,
    OP_GET,
    OP_PUT,
    STATUS_OK,
    VERSION,
    ProtocolError,
    error_frame,
)
from kvpool.calls import CALL_MAGIC, CallHandler, refusal_frame
from kvpool.checksum import block_checksum
from kvpool.framing import (
    IOV_MAX,
    Connection,
    TcpListener,
    recv_buffers,
    recv_exact,
    recv_incremental,
    send_buffers,
    send_final,
)
from kvpool.keys import KEY_BYTES, BlockKey, unpack_keys
from kvpool.metrics import ErrorMetrics
from kvpool.node.quota import Charge, QuotaLedger
from kvpool.rpc import MISS
from kvpool.tiers.base import Tier
from kvpool.tiers.tiered import TieredStore

log = logging.getLogger(__name__)

SCRATCH_BYTES = 16 << 20  # most bytes a request holds in scratch buffers at once (SSD reads, no-slot puts),
# or one block if larger: what a connection whose peer stops reading pins, besides its kernel buffers
DISCARD_BYTES = 1 << 20  # the buffer a PUT's held or refused blocks are read past through
GET_BATCH_KEYS = 4096  # a GET looks its keys up this many at a time (per-key Python objects for one batch only)


class Unauthenticated(ProtocolError):
    """No (valid) AUTH before a request on a listener with an auth file."""

    kind = "unauthenticated"


def _unpack(packed: bytes, lo: int, hi: int) -> list[BlockKey]:
    """Keys ``lo`` to ``hi`` of a packed batch."""
    return unpack_keys(packed[lo * KEY_BYTES : hi * KEY_BYTES])


# -- the listener ----------------------------------------------------------------------------------


class BulkServer:
    """The node's bulk TCP listener over one :class:`TieredStore` (see the module docstring).

    Frames with the fast-call magic (:data:`kvpool.calls.CALL_MAGIC`) on the
    same connections go to ``calls`` (the node's Locate / Reserve / Commit).
    """

    def __init__(
        self,
        store: TieredStore,
        host: str,
        port: int,
        *,
        max_keys_per_call: int,
        max_connections: int = 64,
        errors: ErrorMetrics | None = None,
        get_seconds: Any = None,
        put_seconds: Any = None,
        after_change: Callable[[], object] | None = None,
        fallback_port: bool = False,
        calls: CallHandler | None = None,
        authority: Authority | None = None,
        quota: QuotaLedger | None = None,
        max_request_bytes: int = 1 << 40,
        tls: ssl.SSLContext | None = None,
    ):
        self.store = store
        self.max_keys_per_call = max_keys_per_call
        self.authority = authority
        self.quota = quota
        self.max_request_bytes = max_request_bytes
        self.errors = errors
        self.get_seconds = get_seconds
        self.put_seconds = put_seconds
        self.after_change = after_change
        self.calls = calls
        self._listener = TcpListener("bulk", host, port, self._serve, max_connections=max_connections,
                                     refusal=self._refusal, fallback_port=fallback_port, tls=tls, errors=errors)
        self.port: int = self._listener.port

    @staticmethod
    def _refusal(message: str, head: bytes = b"") -> bytes:
        """A full listener's refusal, in the protocol the peer's first bytes speak (bulk if none came)."""
        return refusal_frame(message) if head[:4] == CALL_MAGIC else error_frame(0, message)

    def start(self) -> BulkServer:
        self._listener.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, cut every connection, wait for their threads (they release their leases)."""
        self._listener.stop(timeout)

    @property
    def connections(self) -> int:
        return self._listener.connections

    # -- one connection ------------------------------------------------------------------------------

    def _serve(self, conn: Connection) -> None:
        op = 0
        peer = Peer(self.authority)
        sock = conn.sock
        try:
            while not self._listener.stopping:
                header = conn.next_request(HEADER.size, authenticated=not peer.needs_auth)
                if not header:
                    return  # the client closed its (pooled) connection, or the listener cut it
                magic, version, op, flags, count, _ = HEADER.unpack(header)
                if magic == CALL_MAGIC and self.calls is not None:
                    if not self.calls.serve_frame(sock, header, peer, conn):
                        return
                    continue
                if magic != MAGIC:
                    raise ProtocolError(f"not a kvpool bulk request (magic {bytes(magic)!r}, want {MAGIC!r})")
                if version != VERSION:
                    raise ProtocolError(f"bulk protocol version {version} is not supported "
                                        f"(this node speaks {VERSION})")
                if op == OP_AUTH:
                    self._auth(conn, peer, count)
                    continue
                if peer.needs_auth:
                    raise Unauthenticated("unauthenticated: the first request on a connection must be AUTH "
                                          "with a token")
                if count > self.max_keys_per_call:
                    raise ProtocolError(f"{count} keys in one request; the limit is {self.max_keys_per_call}")
                if op == OP_GET:
                    self._get(conn, count, peer)
                elif op == OP_PUT:
                    self._put(conn, count, peer)
                else:
                    raise ProtocolError(f"unknown bulk op {op} (GET is {OP_GET}, PUT is {OP_PUT}, "
                                        f"AUTH is {OP_AUTH})")
        except ProtocolError as exc:
            if self.errors is not None:
                self.errors.count(exc.kind)
            log.debug("bulk: refused a request: %s", exc)
            self._send_error(sock, op, str(exc))
        except (ConnectionError, TimeoutError, OSError) as exc:
            log.debug("bulk: connection dropped: %s", exc)
        except Exception as exc:  # a bug here must not take the node down
            log.exception("bulk: request failed")
            self._send_error(sock, op, f"internal error: {type(exc).__name__}: {exc}")

    @staticmethod
    def _send_error(sock: socket.socket, op: int, message: str) -> None:
        """Send an ERROR reply; the connection closes after it (see :func:`kvpool.framing.send_final`)."""
        send_final(sock, error_frame(op, message))

    def _auth(self, conn: Connection, peer: Peer, length: int) -> None:
        """AUTH: take the token; an unknown one is refused (and the connection closed)."""
        if length > MAX_TOKEN_BYTES:
            raise Unauthenticated(f"unauthenticated: a token of {length} bytes (at most {MAX_TOKEN_BYTES})")
        if not peer.login(bytes(recv_exact(conn.sock, length))):
            raise Unauthenticated("unauthenticated: unknown token")
        conn.serving()
        send_buffers(conn.sock, [HEADER.pack(MAGIC, VERSION, STATUS_OK, OP_AUTH, 0, 0)])

    def _keys(self, sock: socket.socket, count: int, peer: Peer) -> list[BlockKey]:
        """The request's keys as stored: the client's tenant's (unchanged with auth off).

        Allocated as they arrive: a header announcing many keys costs nothing until they come.
        """
        return unpack_keys(peer.keys(recv_incremental(sock, count * KEY_BYTES)))

    # -- GET -------------------------------------------------------------------------------------------

    def _get(self, conn: Connection, count: int, peer: Peer) -> None:
        start = time.perf_counter()
        sock = conn.sock
        packed = peer.keys(recv_incremental(sock, count * KEY_BYTES))  # as stored; allocated as the keys arrive
        conn.serving()
        dram = self.store.dram
        arena = dram.arena
        sizes = np.zeros(count, dtype="<u8")
        sums = np.zeros(count, dtype="<u8")
        tiers = np.full(count, MISS, dtype=np.uint8)
        valid = np.zeros(count, dtype=np.uint8)
        slots = np.zeros(count, dtype=np.int64)
        gens = np.zeros(count, dtype=np.uint64)
        for lo in range(0, count, GET_BATCH_KEYS):  # per-key Python objects for one batch at a time
            keys = _unpack(packed, lo, min(count, lo + GET_BATCH_KEYS))
            lower: list[int] = []  # keys not in DRAM now
            for i, ref in enumerate(dram.locate(keys, touch=True), lo):
                if ref is None:
                    lower.append(i)
                else:
                    sizes[i], sums[i], tiers[i] = ref.length, ref.checksum, Tier.DRAM
                    slots[i], gens[i] = ref.slot, ref.gen
            if lower and self.store.ssd is not None:
                for i, meta in zip(lower, self.store.ssd_meta([keys[i - lo] for i in lower])):
                    if meta is not None:
                        sizes[i], sums[i], tiers[i] = meta.size, meta.checksum, Tier.SSD
        total, limit = int(sizes.sum()), max(MAX_GET_BYTES, self.max_request_bytes)
        if total > limit:
            raise ProtocolError(f"a GET of {total} bytes; the limit is {limit} per request")
        send_buffers(sock, [HEADER.pack(MAGIC, VERSION, STATUS_OK, OP_GET, count, 0), sizes, sums, tiers])

        pending: list[Any] = []  # buffers gathered for the next sendmsg
        ssd = np.flatnonzero(tiers == Tier.SSD).tolist()
        loaded: dict[int, np.ndarray] = {}  # SSD key index -> scratch with its bytes
        next_ssd = 0
        scratch: np.ndarray | None = None  # taken from the store's pool, given back when replaced or done
        try:
            for i in range(count):
                if tiers[i] == Tier.DRAM:
                    pending.append(arena.block(int(slots[i]), int(sizes[i])))
                    if len(pending) >= IOV_MAX:  # a sendmsg's worth: few views alive at once
                        send_buffers(sock, pending)
                        pending.clear()
                elif tiers[i] == Tier.SSD:
                    if i not in loaded:
                        send_buffers(sock, pending)  # scratch is about to be replaced
                        pending.clear()
                        loaded.clear()
                        if scratch is not None:
                            self.store.scratch.give(scratch)
                            scratch = None
                        next_ssd, scratch = self._load_ssd(packed, ssd, next_ssd, sizes, loaded, valid)
                    pending.append(loaded[i])
            send_buffers(sock, pending)
            pending.clear()
        finally:
            loaded.clear()
            if scratch is not None:
                self.store.scratch.give(scratch)
        sent_dram = np.flatnonzero(tiers == Tier.DRAM)
        intact = sent_dram[arena.unchanged(slots[sent_dram], gens[sent_dram])]  # not reused while it was sent
        valid[intact] = 1
        dram.record_reads(len(intact), len(sent_dram) - len(intact), int(sizes[intact].sum()))
        send_buffers(sock, [valid])
        if self.quota is not None:
            for lo in range(0, count, GET_BATCH_KEYS):
                self.quota.touch(_unpack(packed, lo, min(count, lo + GET_BATCH_KEYS)))
        if self.get_seconds is not None:
            self.get_seconds.observe(time.perf_counter() - start)

    def _load_ssd(self, packed: bytes, ssd: list[int], pos: int, sizes: np.ndarray,
                  loaded: dict[int, np.ndarray], valid: np.ndarray) -> tuple[int, np.ndarray]:
        """Read the next run of SSD-resident blocks (at most SCRATCH_BYTES, at least one) into scratch.

        Returns the next position in ``ssd`` and the scratch buffer (the caller gives it back).
        """
        run: list[int] = []
        total = 0
        while pos < len(ssd) and (not run or total + int(sizes[ssd[pos]]) <= SCRATCH_BYTES):
            run.append(ssd[pos])
            total += int(sizes[ssd[pos]])
            pos += 1
        scratch = self.store.scratch.take(total)
        offset = 0
        for i in run:
            n = int(sizes[i])
            loaded[i] = scratch[offset : offset + n]
            offset += n
        keys = [BlockKey(packed[i * KEY_BYTES : (i + 1) * KEY_BYTES]) for i in run]
        served = self.store.get_into(keys, [loaded[i] for i in run])  # promotes into DRAM
        for i, tier in zip(run, served):
            valid[i] = tier is not None  # a miss: the (unspecified) scratch bytes go out flagged invalid
        return pos, scratch

    # -- PUT -------------------------------------------------------------------------------------------

    def _put(self, conn: Connection, count: int, peer: Peer) -> None:
        start = time.perf_counter()
        sock = conn.sock
        keys = self._keys(sock, count, peer)
        meta = recv_incremental(sock, 16 * count)
        sizes = np.frombuffer(meta, dtype="<u8", count=count).tolist()
        sums = np.frombuffer(meta, dtype="<u8", count=count, offset=8 * count).tolist()
        store = self.store
        for n in sizes:
            if n == 0:
                raise ProtocolError("a block of 0 bytes")
            if not store.fits_dram(n) and (store.ssd is None or not store.ssd.fits(n)):
                raise ProtocolError(f"a {n}-byte block fits neither DRAM (at most {store.dram.max_block_bytes} B) "
                                    "nor the SSD tier")
        if sum(sizes) > self.max_request_bytes:
            raise ProtocolError(f"a PUT of {sum(sizes)} bytes; the limit is {self.max_request_bytes} per request")
        held = [t is not None for t in store.where(keys)]
        refused: set[int] = set()  # over the tenant's quota: read past, not stored
        tenant = peer.tenant
        charge: Charge | None = None  # what this PUT's reserved slots cost the tenant's quota: ends with the lease
        if self.quota is not None and tenant:
            new = [i for i in range(count) if not held[i]]
            charge = self.quota.reserve(tenant, [keys[i] for i in new], [sizes[i] for i in new])
            refused = {i for i, admitted in zip(new, charge.admitted) if not admitted}
        fit = [i for i in range(count) if not held[i] and i not in refused and store.fits_dram(sizes[i])]
        stored = held[:]
        res = store.dram.reserve([keys[i] for i in fit], [sizes[i] for i in fit], None,  # ours: released below
                                 charge=charge)
        slot_of = {i: s for i, s, g in zip(fit, res.slots, res.gens) if g}
        for i, h in zip(fit, res.held):
            stored[i] = stored[i] or h
        committed = False
        try:  # the reservation ends with the request: its deadline cuts the connection, and this releases it
            self._receive(sock, keys, sizes, sums, slot_of, stored, refused)
            conn.serving()
            if slot_of:
                idx = list(slot_of)
                ok = store.commit(res.lease, [keys[i] for i in idx], [slot_of[i] for i in idx], [sums[i] for i in idx])
                committed = True
                bad = 0
                for i, good in zip(idx, ok):
                    stored[i] = good
                    bad += not good
                if bad and self.errors is not None:
                    self.errors.count("checksum", bad)
        finally:
            if not committed and res.lease:
                store.dram.release(res.lease)
        if self.quota is not None and tenant:
            self.quota.trim(tenant, keys)
        if self.after_change is not None:
            self.after_change()
        reply = np.fromiter(stored, dtype=np.uint8, count=count)
        send_buffers(sock, [HEADER.pack(MAGIC, VERSION, STATUS_OK, OP_PUT, count, 0), reply])
        if self.put_seconds is not None:
            self.put_seconds.observe(time.perf_counter() - start)

    def _receive(self, sock: socket.socket, keys: list[BlockKey], sizes: list[int], sums: list[int],
                 slot_of: dict[int, int], stored: list[bool], refused: set[int]) -> None:
        """Receive the data section: reserved blocks into their slots, held and refused ones discarded, the rest
        via scratch."""
        arena = self.store.dram.arena
        plan: list[Any] = []
        scratch: list[tuple[int, np.ndarray]] = []
        scratch_bytes = 0
        discard = np.empty(0, dtype=np.uint8)

        def flush() -> None:
            nonlocal scratch_bytes
            recv_buffers(sock, plan)
            plan.clear()
            if scratch:
                self._store_scratch(keys, sums, scratch, stored)
                scratch.clear()
                scratch_bytes = 0

        for i, n in enumerate(sizes):
            if i in slot_of:
                plan.append(arena.block(slot_of[i], n))
            elif stored[i] or i in refused:  # held already, or over quota: read past its bytes, a piece at a time
                if discard.size < min(n, DISCARD_BYTES):
                    discard = np.empty(DISCARD_BYTES, dtype=np.uint8)
                plan += [discard[: min(DISCARD_BYTES, n - o)] for o in range(0, n, DISCARD_BYTES)]
            else:
                if scratch and scratch_bytes + n > SCRATCH_BYTES:
                    flush()
                buf = np.empty(n, dtype=np.uint8)
                scratch.append((i, buf))
                scratch_bytes += n
                plan.append(buf)
        flush()

    def _store_scratch(self, keys: list[BlockKey], sums: list[int], scratch: list[tuple[int, np.ndarray]],
                       stored: list[bool]) -> None:
        good = [(i, buf) for i, buf in scratch if block_checksum(buf) == sums[i]]
        if len(good) < len(scratch) and self.errors is not None:
            self.errors.count("checksum", len(scratch) - len(good))
        if good:
            for (i, _), ok in zip(good, self.store.put([keys[i] for i, _ in good], [b for _, b in good])):
                stored[i] = ok
