"""Byte views of caller buffers: the one way kvpool touches bytes it does not own.

Stores accept anything with the buffer protocol (bytes, bytearray, memoryview,
numpy arrays, ``mmap``). torch tensors are turned into buffers on the client
side (:mod:`kvpool.client`), so the service never imports torch.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, cast

import numpy as np

if TYPE_CHECKING:
    from typing_extensions import Buffer  # PEP 688's protocol: collections.abc.Buffer from Python 3.12

BufferLike = bytes | bytearray | memoryview | np.ndarray


def as_buffer(buf: BufferLike) -> Buffer:
    """``buf`` as the type checker's ``Buffer``, for APIs typed with it (memoryview, xxhash).

    No conversion: every ``BufferLike`` has the buffer protocol. numpy's stubs declare
    ``ndarray.__buffer__`` only for Python >= 3.12 (where the protocol became visible to
    Python code), so for the Python 3.10 that kvpool is checked against an ndarray is
    not a ``Buffer`` without this cast.
    """
    return cast("Buffer", buf)


def byte_view(buf: BufferLike, *, writable: bool = False) -> memoryview:
    """Return a flat ``uint8`` memoryview of ``buf`` without copying.

    Raises ValueError if ``buf`` has no buffer interface, is not C-contiguous,
    or (with ``writable=True``) is read-only.
    """
    try:
        view = memoryview(as_buffer(buf))
    except TypeError as exc:
        raise ValueError(f"expected a buffer (bytes, memoryview, numpy array), got {type(buf).__name__}") from exc
    if not view.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("output buffer is read-only")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def as_array(buf: BufferLike, *, writable: bool = False) -> np.ndarray:
    """Return ``buf`` as a flat uint8 numpy array sharing its memory (see :func:`byte_view`)."""
    return np.frombuffer(byte_view(buf, writable=writable), dtype=np.uint8)


def aligned_empty(nbytes: int, align: int = 4096) -> np.ndarray:
    """A new uint8 array of ``nbytes`` whose first byte is ``align``-aligned (as engines' tensors are)."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes]


class ScratchPool:
    """Reusable temporaries for big copies (thread-safe).

    A fresh multi-MiB buffer costs a page fault per 4 KiB on first touch
    (tens of milliseconds for 32 MiB on a small VM); a buffer taken from here
    was touched before. Keeps at most ``max_bytes`` of idle buffers.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._idle: list[np.ndarray] = []
        self._idle_bytes = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of exactly ``nbytes`` (a view of a pooled one when one is big enough); give it back."""
        with self._lock:
            fits = [i for i, b in enumerate(self._idle) if b.size >= nbytes]
            if fits:
                best = self._idle.pop(min(fits, key=lambda i: self._idle[i].size))  # by index: arrays have no ==
                self._idle_bytes -= best.size
                return best[:nbytes]
        return np.empty(nbytes, dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        """Return a buffer from :meth:`take` (the caller must not use it afterwards)."""
        whole = buf.base if isinstance(buf.base, np.ndarray) else buf
        with self._lock:
            if self._idle_bytes + whole.size <= self.max_bytes:
                self._idle.append(whole)
                self._idle_bytes += whole.size
