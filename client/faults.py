"""Pool faults: how a failure on the pool's side becomes a counted miss (or, in strict mode, an error).

Every pool failure (timeout, dead node, block gone or reused, checksum
mismatch, master down) is a miss counted in ``kvpool_errors_total{kind}``:
never an exception on the engine's path. With ``ClientConfig.strict`` the
call that lost blocks raises :class:`PoolFault` instead (still counted): an
API setting for a caller that must tell a fault from a miss. The vLLM
connector's scheduler side sets it on its own client (a fault pauses its
lookups, :mod:`kvpool.engines.vllm.scheduler`); tests set it to see faults.
Caller misuse (wrong sizes, malformed keys) is a ValueError either way, and
is not counted here.
"""

from __future__ import annotations

import logging
import threading

import grpc

from kvpool.metrics import ErrorMetrics

log = logging.getLogger(__name__)


class PoolFault(RuntimeError):
    """A pool failure, raised only with ``ClientConfig.strict`` (otherwise a counted miss); ``kind`` as counted."""

    def __init__(self, kind: str, detail: object = ""):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


def error_kind(exc: BaseException) -> str:
    """The ``kind`` label of an exception: a gRPC status name (``timeout``, ``unavailable``, ...) or its type."""
    if isinstance(exc, grpc.RpcError):
        code = exc.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "timeout"
        if code == grpc.StatusCode.UNAVAILABLE:
            return "unavailable"
        return code.name.lower() if code is not None else "rpc"
    return type(exc).__name__.lower()


class Faults:
    """Counts pool failures by kind; raises :class:`PoolFault` for blocks lost when ``strict``."""

    def __init__(self, errors: ErrorMetrics, *, strict: bool):
        self.errors = errors
        self.strict = strict
        self._lock = threading.Lock()
        self._later: PoolFault | None = None

    def lost_later(self, kind: str, detail: object, n: int = 1) -> None:
        """:meth:`lost` for a failure seen off the caller's thread (a commit sent without waiting): counted now;
        in strict mode raised by the caller's next :meth:`raise_later`."""
        self.errors.count(kind, n)
        log.debug("pool fault (%s), seen in the background: %s", kind, detail)
        if self.strict:
            with self._lock:
                self._later = self._later or PoolFault(kind, detail)

    def raise_later(self) -> None:
        """Raise the first :meth:`lost_later` fault not raised yet (strict mode only has any)."""
        if self._later is None:
            return
        with self._lock:
            fault, self._later = self._later, None
        if fault is not None:
            raise fault

    def lost(self, kind: str, detail: object, n: int = 1) -> None:
        """``n`` blocks lost to one failure: counted, and raised in strict mode."""
        self.errors.count(kind, n)
        log.debug("pool fault (%s): %s", kind, detail)
        if self.strict:
            raise PoolFault(kind, detail)

    def counted(self, kind: str, n: int = 1) -> None:
        """A failure counted, never raised: one that lost nothing (another path serves the blocks, a stats
        report), or a block the pool declined by its settings (write-behind queue full, block too large, a
        node out of room), which the caller sees in the flags it gets back. A lost write is :meth:`lost`."""
        self.errors.count(kind, n)
