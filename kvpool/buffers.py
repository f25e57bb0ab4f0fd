"""Byte views of caller buffers: the one way kvpool touches bytes it does not own.

Stores accept anything with the buffer protocol (bytes, bytearray, memoryview,
numpy arrays, ``mmap``). torch tensors are turned into buffers on the client
side (:mod:`kvpool.client`), so the service never imports torch.
"""

from __future__ import annotations

from typing import Union

import numpy as np

BufferLike = Union[bytes, bytearray, memoryview, np.ndarray]


def byte_view(buf: BufferLike, *, writable: bool = False) -> memoryview:
    """Return a flat ``uint8`` memoryview of ``buf`` without copying.

    Raises ValueError if ``buf`` has no buffer interface, is not C-contiguous,
    or (with ``writable=True``) is read-only.
    """
    try:
        view = memoryview(buf)
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
