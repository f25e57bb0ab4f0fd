"""A unary call's reply read in one go (``wire.read_reply(..., unary=True)``): whole however it arrives, and a
peer out of step is refused, not followed."""

from __future__ import annotations

import socket
import threading

import grpc
import pytest

from kvpool import wire
from kvpool.tcp import Exchange, Refused


def _reply(body: bytes, code: int = 0, flags: int = 0, payload: int = 0) -> bytes:
    return wire.pack(code, len(body), payload, flags=flags) + body


@pytest.fixture()
def pair():
    a, b = socket.socketpair()
    a.settimeout(5)
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("size", [0, 7, wire.REPLY_READ_BYTES - wire.FRAME.size, wire.REPLY_READ_BYTES * 3 + 5])
@pytest.mark.parametrize("pieces", [1, 3])
def test_a_reply_is_read_whole_however_its_bytes_arrive(pair, size, pieces):
    a, b = pair
    body = bytes(range(256)) * (size // 256) + bytes(size % 256)
    frame = _reply(body)
    n = len(frame)
    cuts = sorted({0, min(5, n), min(40, n), n}) if pieces > 1 else [0, n]

    def send() -> None:  # in pieces, the first cut inside the fixed header
        for start, end in zip(cuts, cuts[1:]):
            b.sendall(frame[start:end])

    sender = threading.Thread(target=send)
    sender.start()
    head, got = wire.read_reply(a, Exchange(), 1 << 20, unary=True)
    sender.join()
    assert head.code == 0 and got == body
    b.sendall(_reply(b"next"))  # the connection is in step: the next reply reads alone
    assert wire.read_reply(a, Exchange(), 1 << 20, unary=True)[1] == b"next"


def test_bytes_past_a_unary_reply_are_an_error_not_the_next_reply(pair):
    a, b = pair
    b.sendall(_reply(b"answer") + _reply(b"stale"))
    with pytest.raises(wire.CallError) as err:
        wire.read_reply(a, Exchange(), 1 << 20, unary=True)
    assert err.value.code() == grpc.StatusCode.INTERNAL and "past the reply" in err.value.details()


def test_a_unary_reply_with_a_payload_is_refused(pair):
    a, b = pair
    b.sendall(_reply(b"x", payload=4) + b"data")
    with pytest.raises(wire.CallError, match="payload"):
        wire.read_reply(a, Exchange(), 1 << 20, unary=True)


def test_error_replies_and_refusals_read_in_one_go(pair):
    a, b = pair
    b.sendall(wire.error_frame(grpc.StatusCode.NOT_FOUND, "no such thing"))
    head, text = wire.read_reply(a, Exchange(), 1 << 20, unary=True)
    assert wire.status_error(head, text).code() == grpc.StatusCode.NOT_FOUND and text == b"no such thing"
    b.sendall(wire.refusal_frame("full"))
    with pytest.raises(Refused, match="full"):
        wire.read_reply(a, Exchange(), 1 << 20, unary=True)


def test_a_reply_over_the_callers_limit_is_refused_before_its_body_is_read(pair):
    a, b = pair
    b.sendall(wire.pack(0, 1 << 30, 0))  # announces 1 GiB, sends nothing more
    with pytest.raises(wire.CallError) as err:
        wire.read_reply(a, Exchange(), 1 << 20, unary=True)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_peer_that_closes_before_its_reply_is_a_connection_error(pair):
    a, b = pair
    b.close()
    with pytest.raises(ConnectionError):
        wire.read_reply(a, Exchange(), 1 << 20, unary=True)
