"""Copies between an engine's registered memory (host, CUDA or Ascend device) and a host staging buffer.

vllm-ascend hands its store backend raw addresses of each block's pieces; on
a GPU or an NPU they are device pointers the CPU cannot dereference. A
:class:`Copier` moves a batch of pieces between such memory and one
contiguous host buffer (the stager's, which the pool client reads from and
writes into): at most one host staging copy between the device block and the
pool's own buffer.

- :class:`HostCopier`: host memory, ``memmove`` per piece.
- :class:`CudaCopier`: the CUDA runtime (``libcudart`` by ctypes):
  ``cudaMemcpyAsync`` per piece on one non-blocking stream, one
  ``cudaStreamSynchronize`` per call; host buffers pinned with ``cudaHostRegister``.
- :class:`AclCopier`: Ascend's ACL runtime (``libascendcl.so`` by ctypes):
  ``aclrtMemcpyAsync`` per piece on one stream, one ``aclrtSynchronizeStream``
  per call, into host memory pinned with ``aclrtHostRegister``; where pinning
  is refused, synchronous ``aclrtMemcpy`` per piece.

Invariants:
- One call is one batch: every piece of it is queued, then the call waits
  once (one stream synchronisation), so a call that returns has moved every
  byte, and one that raises :class:`DeviceCopyError` may have moved some: the
  caller treats the whole batch as failed (a miss), never as loaded. Nothing
  queued is still in flight when a call returns or raises.
- A copier never checks bounds: callers copy only ranges inside registered
  regions (:mod:`.regions`), and the host side is the caller's buffer.
- ``pin`` is idempotent per address; a registration the runtime refuses
  leaves the buffer usable, only slower (and, for ACL, copied synchronously).
- Device copiers use the device that was current when they were made (the
  engine's worker thread has set it); each thread that copies makes it
  current for itself once (the engine's transfer threads start without it)
  and copies on a stream of its own.

Neither device path has run on hardware in this repository's tests (no GPU or
NPU here); both follow their runtime's documented C API, and their batching,
bounds and staging logic is tested through an injected copier.
``tests/gpu/check.sh`` runs the CUDA path on a real GPU (put from one
process's device memory, get into another's, bytes compared).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

log = logging.getLogger(__name__)

Piece = tuple[int, int]  # (address in the engine's memory, bytes)

HOST, CUDA, NPU = "host", "cuda", "npu"


class DeviceCopyError(RuntimeError):
    """A device runtime call failed; the batch it was part of did not (wholly) move."""


class Copier(Protocol):
    """Moves batches of pieces between registered memory of one kind and host buffers (see module docstring)."""

    kind: str

    def set_device(self) -> None:
        """Make this copier's device current in the calling thread (nothing for host memory)."""

    def pin(self, addr: int, nbytes: int, already_pinned: bool = False) -> None:
        """Page-lock the host buffer ``[addr, addr + nbytes)`` for this runtime's DMA, once per address.

        ``already_pinned``: its allocator pinned it (torch's ``pin_memory``); only remember that.
        """

    def to_host(self, pieces: Sequence[Piece], dst: int) -> None:
        """Copy the pieces back to back into host memory starting at ``dst``; returns when all arrived."""

    def to_device(self, src: int, pieces: Sequence[Piece]) -> None:
        """Copy host memory from ``src`` on, back to back, into the pieces; returns when all arrived."""


class HostCopier:
    """Registered memory is host memory: plain memmove."""

    kind = HOST

    def set_device(self) -> None:
        pass

    def pin(self, addr: int, nbytes: int, already_pinned: bool = False) -> None:
        pass

    def to_host(self, pieces: Sequence[Piece], dst: int) -> None:
        for addr, size in pieces:
            ctypes.memmove(dst, addr, size)
            dst += size

    def to_device(self, src: int, pieces: Sequence[Piece]) -> None:
        for addr, size in pieces:
            ctypes.memmove(addr, src, size)
            src += size


class _StreamCopier(ABC):
    """What the CUDA and ACL copiers share: per thread a current device and a stream; pinned host buffers.

    Subclasses supply the five runtime calls (:class:`CudaCopier`, :class:`AclCopier`); each returns the
    runtime's error code, 0 for success."""

    kind = ""
    to_host_kind = 0
    to_device_kind = 0

    def __init__(self, lib: ctypes.CDLL, device: int):
        self.lib = lib
        self.device = device
        self._thread = threading.local()
        self._lock = threading.Lock()
        self._pinned: dict[int, int] = {}

    # -- runtime specifics -------------------------------------------------------------------

    def _check(self, call: str, code: int) -> None:
        if code != 0:
            raise DeviceCopyError(f"{self.kind}: {call} failed with error {code}")

    @abstractmethod
    def _set_device(self) -> int:
        ...

    @abstractmethod
    def _create_stream(self, stream: ctypes.c_void_p) -> int:
        ...

    @abstractmethod
    def _sync(self, stream: ctypes.c_void_p) -> int:
        ...

    @abstractmethod
    def _copy_async(self, dst: int, src: int, size: int, kind: int, stream: ctypes.c_void_p) -> int:
        ...

    @abstractmethod
    def _register(self, addr: int, nbytes: int) -> int:
        ...

    def _copy_sync(self, dst: int, src: int, size: int, kind: int) -> int | None:
        """A synchronous copy for unpinned host memory; None: the async path works for it too."""
        return None

    # -- the copier --------------------------------------------------------------------------

    def set_device(self) -> None:
        if getattr(self._thread, "ready", False):
            return
        self._check("set device", self._set_device())
        self._thread.ready = True

    def pin(self, addr: int, nbytes: int, already_pinned: bool = False) -> None:
        with self._lock:
            known = self._pinned.get(addr, 0)
            if known < 0 or known >= nbytes:
                return
            code = 0 if already_pinned else self._register(addr, nbytes)
            if code != 0:
                log.warning("kvpool %s: pinning %d host bytes failed (error %d): copies will be slower",
                            self.kind, nbytes, code)
                self._pinned[addr] = -1  # refused: do not ask again for this buffer
                return
            self._pinned[addr] = nbytes

    def _is_pinned(self, addr: int) -> bool:
        with self._lock:
            return any(start <= addr < start + size for start, size in self._pinned.items() if size > 0)

    def _stream_handle(self) -> ctypes.c_void_p:
        """This thread's stream (the engine's send and receive threads never wait on each other's copies)."""
        stream = getattr(self._thread, "stream", None)
        if stream is None:
            stream = ctypes.c_void_p()
            self._check("create stream", self._create_stream(stream))
            self._thread.stream = stream
        return stream

    def _batch(self, copies: list[tuple[int, int, int]], kind: int, host: int) -> None:
        self.set_device()
        if not self._is_pinned(host):
            for dst, src, size in copies:
                code = self._copy_sync(dst, src, size, kind)
                if code is None:
                    break  # this runtime copies unpinned memory asynchronously too
                self._check("memcpy", code)
            else:
                return
        stream = self._stream_handle()
        for dst, src, size in copies:
            code = self._copy_async(dst, src, size, kind, stream)
            if code != 0:
                self._sync(stream)  # copies already queued finish before the caller reuses its buffer
                self._check("memcpy async", code)
        self._check("stream synchronize", self._sync(stream))

    def to_host(self, pieces: Sequence[Piece], dst: int) -> None:
        copies, offset = [], dst
        for addr, size in pieces:
            copies.append((offset, addr, size))
            offset += size
        self._batch(copies, self.to_host_kind, dst)

    def to_device(self, src: int, pieces: Sequence[Piece]) -> None:
        copies, offset = [], src
        for addr, size in pieces:
            copies.append((addr, offset, size))
            offset += size
        self._batch(copies, self.to_device_kind, src)


class CudaCopier(_StreamCopier):
    """CUDA device memory through the CUDA runtime API (cudaMemcpyAsync, cudaStreamSynchronize, cudaHostRegister)."""

    kind = CUDA
    to_host_kind = 2  # cudaMemcpyDeviceToHost
    to_device_kind = 1  # cudaMemcpyHostToDevice
    _ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered

    def __init__(self, lib: ctypes.CDLL, device: int):
        super().__init__(lib, device)
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                        ctypes.c_void_p]
        lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaSetDevice.argtypes = [ctypes.c_int]

    def _set_device(self) -> int:
        return int(self.lib.cudaSetDevice(self.device))

    def _create_stream(self, stream: ctypes.c_void_p) -> int:
        return int(self.lib.cudaStreamCreateWithFlags(ctypes.byref(stream), 1))  # cudaStreamNonBlocking

    def _sync(self, stream: ctypes.c_void_p) -> int:
        return int(self.lib.cudaStreamSynchronize(stream))

    def _copy_async(self, dst: int, src: int, size: int, kind: int, stream: ctypes.c_void_p) -> int:
        return int(self.lib.cudaMemcpyAsync(dst, src, size, kind, stream))

    def _register(self, addr: int, nbytes: int) -> int:
        code = int(self.lib.cudaHostRegister(addr, nbytes, 0))  # cudaHostRegisterDefault
        if code == self._ALREADY_REGISTERED:  # torch's pinned allocator got there first
            self.lib.cudaGetLastError()  # reset this thread's last-error state
            return 0
        return code


class AclCopier(_StreamCopier):
    """Ascend device memory through ACL (aclrtMemcpyAsync, aclrtSynchronizeStream, aclrtHostRegister)."""

    kind = NPU
    to_host_kind = 2  # ACL_MEMCPY_DEVICE_TO_HOST
    to_device_kind = 1  # ACL_MEMCPY_HOST_TO_DEVICE

    def __init__(self, lib: ctypes.CDLL, device: int):
        super().__init__(lib, device)
        lib.aclrtMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                         ctypes.c_int, ctypes.c_void_p]
        lib.aclrtMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.aclrtSynchronizeStream.argtypes = [ctypes.c_void_p]
        lib.aclrtCreateStream.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.aclrtSetDevice.argtypes = [ctypes.c_int32]

    def _set_device(self) -> int:
        return int(self.lib.aclrtSetDevice(self.device))

    def _create_stream(self, stream: ctypes.c_void_p) -> int:
        return int(self.lib.aclrtCreateStream(ctypes.byref(stream)))

    def _sync(self, stream: ctypes.c_void_p) -> int:
        return int(self.lib.aclrtSynchronizeStream(stream))

    def _copy_async(self, dst: int, src: int, size: int, kind: int, stream: ctypes.c_void_p) -> int:
        return int(self.lib.aclrtMemcpyAsync(dst, size, src, size, kind, stream))

    def _copy_sync(self, dst: int, src: int, size: int, kind: int) -> int | None:
        return int(self.lib.aclrtMemcpy(dst, size, src, size, kind))

    def _register(self, addr: int, nbytes: int) -> int:
        register = getattr(self.lib, "aclrtHostRegister", None)
        if register is None:  # CANN releases before aclrtHostRegister: copies stay synchronous
            return -1
        register.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
        mapped = ctypes.c_void_p()
        return int(register(addr, nbytes, 0, ctypes.byref(mapped)))  # ACL_HOST_REGISTER_MAPPED


# -- choosing a copier -------------------------------------------------------------------------------


def _load(names: Sequence[str]) -> ctypes.CDLL | None:
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def mapped_libraries(prefix: str, maps: str = "/proc/self/maps") -> list[str]:
    """Paths of the shared libraries whose file name starts with ``prefix`` that this process has mapped, in
    the order first mapped (e.g. torch's own ``libcudart.so.12`` from its pip wheel's directory)."""
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found: list[str] = []
    for line in lines:
        fields = line.split(None, 5)  # address perms offset dev inode [path]
        path = fields[5].strip() if len(fields) == 6 else ""
        if path.startswith("/") and os.path.basename(path).startswith(prefix) and path not in found:
            found.append(path)
    return found


def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime this process loaded already (torch's: one runtime in the process; a bare name may find
    another copy or version, or none: pip's torch keeps its own in ``nvidia/*/lib``), else one the loader finds."""
    found = ctypes.util.find_library("cudart")
    names = (found, "libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")
    return _load([*mapped_libraries("libcudart.so"), *(n for n in names if n)])


class _CudaPointerAttributes(ctypes.Structure):
    """``struct cudaPointerAttributes``: CUDA 11 and 12 end at ``hostPointer``; CUDA 13 appends ``long
    reserved[8]`` ("must be zero": ctypes zeroes it). Room for it always, so no runtime writes past the struct."""

    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int), ("devicePointer", ctypes.c_void_p),
                ("hostPointer", ctypes.c_void_p), ("reserved", ctypes.c_long * 8)]


def _cuda_device_of(lib: ctypes.CDLL, addr: int) -> int | None:
    """The CUDA device holding ``addr`` (device or managed memory), else None."""
    attrs = _CudaPointerAttributes()
    lib.cudaPointerGetAttributes.argtypes = [ctypes.POINTER(_CudaPointerAttributes), ctypes.c_void_p]
    if lib.cudaPointerGetAttributes(ctypes.byref(attrs), addr) != 0:
        lib.cudaGetLastError()
        return None
    return attrs.device if attrs.type in (2, 3) else None  # cudaMemoryTypeDevice, cudaMemoryTypeManaged


def npu_present() -> bool:
    """Whether this process drives an Ascend NPU (torch_npu loaded and a device available)."""
    torch = sys.modules.get("torch")
    if sys.modules.get("torch_npu") is None or torch is None:
        return False
    try:
        return bool(torch.npu.is_available())
    except Exception:  # noqa: BLE001 - a broken torch_npu is no NPU
        return False


def copier_for(addrs: Sequence[int], host_memory: bool | None = None) -> Copier:
    """The copier for the memory at ``addrs``: NPU in a process that drives one, CUDA for CUDA memory, else host.

    ``host_memory`` True or False overrides the guess (True: host, False: the
    process's device). DeviceCopyError if device memory is said or seen but its
    runtime library cannot be loaded, or if ``addrs`` mix host memory and CUDA
    devices (one registration, one copier).
    """
    torch = sys.modules.get("torch")
    if host_memory is True:
        return HostCopier()
    if npu_present() and torch is not None:
        lib = _load(["libascendcl.so"])
        if lib is None:
            raise DeviceCopyError("npu: libascendcl.so cannot be loaded (source CANN's set_env.sh)")
        return AclCopier(lib, int(torch.npu.current_device()))
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    if cuda is not None and cuda.is_available() and cuda.is_initialized():
        lib = _cudart()
        if lib is None:
            raise DeviceCopyError("cuda: libcudart cannot be loaded")
        devices = {_cuda_device_of(lib, addr) for addr in addrs}
        if len(devices) > 1:
            raise DeviceCopyError(f"cuda: one registration spans host memory and devices {sorted(map(str, devices))}")
        device = devices.pop() if devices else None
        if device is not None:
            return CudaCopier(lib, device)
        if host_memory is False:
            raise DeviceCopyError("cuda: the registered memory is not CUDA device memory")
    elif host_memory is False:
        raise DeviceCopyError("device memory was said to be registered, but this process drives no NPU or GPU")
    return HostCopier()
