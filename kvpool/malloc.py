"""The C allocator of a long-running kvpool daemon: few malloc arenas, so memory one thread frees the next reuses.

glibc gives threads that allocate at the same time arenas of their own (up to
8 a core), and each arena keeps what is freed in it for reuse, up to about
twice the largest block recently freed (the sliding mmap threshold). A node
allocates large short-lived buffers (eviction batches on their way to SSD,
SSD reads, gRPC replies) from gRPC and connection threads that come and go,
so its RSS ratcheted up with each arena that acquired such a working set
(``kvpool bench soak``: +15-25 MiB a minute, towards twice the heap the node
needs; see docs/reliability.md). Python code allocates holding the GIL, so
many arenas buy it little. ``MALLOC_ARENA_MAX`` in the environment, if set,
wins over :func:`limit_arenas`.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_ARENA_MAX = -8  # glibc's mallopt parameter
DAEMON_ARENAS = 2


def limit_arenas(n: int = DAEMON_ARENAS) -> bool:
    """Cap this process's malloc arenas at ``n`` (glibc only; call before threads start); True if applied."""
    if n < 1:
        raise ValueError(f"malloc arenas must be >= 1, got {n}")
    if "MALLOC_ARENA_MAX" in os.environ or platform.libc_ver()[0] != "glibc":
        return False
    try:
        return ctypes.CDLL(None).mallopt(M_ARENA_MAX, n) == 1
    except (OSError, AttributeError):
        return False
