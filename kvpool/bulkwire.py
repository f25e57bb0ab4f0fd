"""The bulk protocol: block bytes over plain TCP between a client and a node's bulk listener.

One module for both ends: the client (:mod:`kvpool.client.bulk`) and the listener
(:mod:`kvpool.node.bulk`) import their frames, ops and limits from here, so a
worker never imports the node's server (its tiers, quota ledger or LMDB).

Protocol, version 1. All integers little-endian; a key is 32 bytes. A
connection carries any number of request/reply exchanges, one at a time.

Request::

    header   16 B  magic b"KVPB" | version u16 = 1 | op u8 | flags u8 = 0 | count u32 | reserved u32 = 0
    GET (op 1)     keys       count x 32 B
    PUT (op 2)     keys       count x 32 B
                   sizes      count x u64   (each > 0)
                   checksums  count x u64   (xxh3-64 of each block)
                   data       sum(sizes) B  (the blocks, in key order)
    AUTH (op 3)    token      count B       (UTF-8, at most 512 B; see kvpool.auth)

Reply::

    header   16 B  magic b"KVPB" | version u16 = 1 | status u8 | op u8 | count u32 | reserved u32 = 0
    status 1 (ERROR): length u32 | UTF-8 message. The node closes the connection after it.
    GET, status 0  sizes      count x u64   (0: the node does not hold the key)
                   checksums  count x u64
                   tiers      count x u8    (the Tier that served it; 255: miss)
                   data       sum(sizes) B  (the hits, in key order)
                   valid      count x u8    (1: the bytes sent are the block's; 0: its slot was
                                             reused while it was sent, or its SSD copy vanished: a miss)
    PUT, status 0  stored     count x u8    (1: stored or already held; 0: no room, the tenant's
                                             quota refused it, or the bytes did not match their checksum)
    AUTH, status 0 (nothing; count 0)
"""

from __future__ import annotations

import socket
import struct

from kvpool.framing import recv_exact

MAGIC = b"KVPB"
VERSION = 1
OP_GET = 1
OP_PUT = 2
OP_AUTH = 3
STATUS_OK = 0
STATUS_ERROR = 1
HEADER = struct.Struct("<4sHBBII")  # magic, version, op|status, flags|op, count, reserved
assert HEADER.size == 16, "bulk: the header must stay 16 bytes"
_ERROR_LEN = struct.Struct("<I")
MAX_ERROR_BYTES = 64 << 10
MAX_GET_BYTES = 256 << 20  # a GET's hits may hold at most this (or max_request_bytes if larger): clients ask for less


class ProtocolError(ValueError):
    """The peer sent something this protocol does not allow (the message says what)."""

    kind = "invalid_argument"


def error_frame(op: int, message: str) -> bytes:
    text = message.encode("utf-8", "replace")[:MAX_ERROR_BYTES]
    return HEADER.pack(MAGIC, VERSION, STATUS_ERROR, op, 0, 0) + _ERROR_LEN.pack(len(text)) + text


def read_reply_header(sock: socket.socket, op: int, count: int) -> None:
    """Read a reply header; raises ProtocolError with the node's message for an ERROR reply."""
    header = recv_exact(sock, HEADER.size)
    magic, version, status, reply_op, reply_count, _ = HEADER.unpack(header)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"not a kvpool bulk reply (magic {bytes(magic)!r}, version {version})")
    if status == STATUS_ERROR:
        (length,) = _ERROR_LEN.unpack(recv_exact(sock, _ERROR_LEN.size))
        if length > MAX_ERROR_BYTES:
            raise ProtocolError("error reply too long")
        raise ProtocolError(recv_exact(sock, length).decode("utf-8", "replace"))
    if status != STATUS_OK or reply_op != op or reply_count != count:
        raise ProtocolError(f"unexpected reply (status {status}, op {reply_op}, count {reply_count})")


def request_header(op: int, count: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, op, 0, count, 0)
