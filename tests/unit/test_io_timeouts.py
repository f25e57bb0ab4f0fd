"""``kvpool.tcp.set_io_timeout``: kernel-side timeouts on a blocking socket, left alone when already close enough
(a pooled connection's calls each ask for nearly the same; the syscalls were ~10% of a fast call's client CPU)."""

from __future__ import annotations

import socket
import struct

from kvpool.tcp import TIMEOUT_SLACK_US, set_io_timeout


def kernel_timeouts_us(sock: socket.socket) -> tuple[int, int]:
    def read(option: int) -> int:
        sec, usec = struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("ll")))
        return sec * 1_000_000 + usec

    return read(socket.SO_RCVTIMEO), read(socket.SO_SNDTIMEO)


def test_timeouts_are_set_kept_when_close_and_set_again_when_not():
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(3.0)  # Python-side polling timeout: replaced by a blocking socket with kernel timeouts
        set_io_timeout(a, 0.5)
        assert a.gettimeout() is None and kernel_timeouts_us(a) == (500_000, 500_000)
        set_io_timeout(a, 0.5 - TIMEOUT_SLACK_US / 2e6)  # the same call's deadline a moment later: kept
        assert kernel_timeouts_us(a) == (500_000, 500_000)
        set_io_timeout(a, 0.2)  # a shorter deadline: set (a multiple of any jiffy: the kernel rounds up)
        assert kernel_timeouts_us(a) == (200_000, 200_000)
        set_io_timeout(a, 30.0)
        set_io_timeout(a, 30.1)  # within 1/128 of a long one: kept
        assert kernel_timeouts_us(a) == (30_000_000, 30_000_000)
        a.settimeout(1.0)  # someone changed the socket behind its back: set again whatever was remembered
        set_io_timeout(a, 30.0)
        assert a.gettimeout() is None and kernel_timeouts_us(a) == (30_000_000, 30_000_000)
        set_io_timeout(b, 0.0)  # below a microsecond is one (zero would mean none at all)
        assert min(kernel_timeouts_us(b)) > 0
