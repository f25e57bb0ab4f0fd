"""Device memory under the vllm-ascend store backend (kvpool.engines.device_copy) against a real `kvpool serve`.

No GPU or NPU here. The host copier runs for real. Device memory is simulated by :class:`SimDevice`: a
"device" whose addresses (from 2**60 on) are not mapped in this process, so a backend that dereferenced
one would crash the test; only its copier can reach the bytes (mocked because it needs a GPU/NPU). The
CUDA and ACL copiers' batching, per-thread device and pinning logic run against :class:`FakeRuntime`, a
stand-in for libcudart / libascendcl (their C functions, recorded; copies done with memmove).
"""

from __future__ import annotations

import ctypes
import json
import logging
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from support import PoolProcesses

from kvpool.engines.device_copy import (
    AclCopier,
    CudaCopier,
    DeviceCopyError,
    HostCopier,
    Piece,
    _cuda_device_of,
    copier_for,
    mapped_libraries,
)
from kvpool.engines.vllm_ascend import ERR_FAILED, ERR_INVALID, OK, KVPoolStoreBackend
from kvpool.engines.vllm_ascend_plugin import register_backend

PIECE = 1024
PIECES_PER_KEY = 4


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    procs = PoolProcesses(tmp_path_factory.mktemp("device-pool"), **{"dram-bytes": "4M", "max-block-bytes": "8K"})
    procs.serve()
    yield procs
    procs.close()
    procs.assert_stopped_cleanly()


@pytest.fixture
def config(pool, tmp_path) -> str:
    path = tmp_path / "kvpool.json"
    path.write_text(json.dumps({"client": {"master": pool.master, "model": "device-test", "lookup_timeout_s": 2.0,
                                           "io_timeout_s": 5.0}}))
    return str(path)


class SimDevice:
    """A copier for simulated device memory: ``nbytes`` at unmapped addresses from ``base`` (see module docstring)."""

    kind = "sim-device"

    def __init__(self, nbytes: int, base: int = 1 << 60, seed: int | None = None):
        self.base = base
        self.memory = np.zeros(nbytes, np.uint8) if seed is None else \
            np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
        self.calls: Counter = Counter()
        self.pins: list[tuple[int, int, bool]] = []
        self.batches: list[int] = []  # pieces per call
        self.fail = False

    def _at(self, addr: int, size: int) -> np.ndarray:
        offset = addr - self.base
        assert 0 <= offset and offset + size <= self.memory.size, "copier asked for memory outside the device"
        return self.memory[offset : offset + size]

    def set_device(self) -> None:
        self.calls["set_device"] += 1

    def pin(self, addr: int, nbytes: int, already_pinned: bool = False) -> None:
        self.pins.append((addr, nbytes, already_pinned))

    def to_host(self, pieces: Sequence[Piece], dst: int) -> None:
        self.calls["to_host"] += 1
        self.batches.append(len(pieces))
        if self.fail:
            raise DeviceCopyError("sim: device lost")
        for addr, size in pieces:
            ctypes.memmove(dst, self._at(addr, size).ctypes.data, size)
            dst += size
        self.calls["sync"] += 1

    def to_device(self, src: int, pieces: Sequence[Piece]) -> None:
        self.calls["to_device"] += 1
        self.batches.append(len(pieces))
        if self.fail:
            raise DeviceCopyError("sim: device lost")
        for addr, size in pieces:
            ctypes.memmove(self._at(addr, size).ctypes.data, src, size)
            src += size
        self.calls["sync"] += 1

    def addrs(self, blocks: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Each block's pieces as vllm-ascend's prepare_value gives them: every layer's K and V, strided."""
        stride = self.memory.size // PIECES_PER_KEY  # one region per layer's K or V, block after block
        return ([[self.base + b * PIECE + p * stride for p in range(PIECES_PER_KEY)] for b in blocks],
                [[PIECE] * PIECES_PER_KEY for _ in blocks])

    def block(self, b: int) -> bytes:
        stride = self.memory.size // PIECES_PER_KEY
        return b"".join(self._at(self.base + b * PIECE + p * stride, PIECE).tobytes() for p in range(PIECES_PER_KEY))


def keys(tag: str, n: int) -> list[str]:
    return [f"device-test@pcp0@dcp0@head_or_tp_rank:0@pp_rank:0@group:0@cache_role:kv@cache_family:default@"
            f"{tag}{i:060x}" for i in range(n)]


def backend_on(device: SimDevice, config: str, staging_bytes: int = 1 << 20) -> KVPoolStoreBackend:
    backend = KVPoolStoreBackend(None, config_path=config, copier=device, staging_bytes=staging_bytes)
    backend.set_device()
    backend.register_buffer([device.base], [device.memory.size])
    return backend


def test_device_blocks_go_to_the_pool_and_back_in_one_batch_per_staged_chunk(config):
    src, dst = SimDevice(PIECE * PIECES_PER_KEY * 4, seed=1), SimDevice(PIECE * PIECES_PER_KEY * 4, base=1 << 61)
    block = PIECE * PIECES_PER_KEY
    # staging for 2 blocks: 3 blocks are 2 chunks, so 2 copier calls each way, each with all its chunk's pieces
    writer, reader = backend_on(src, config, staging_bytes=2 * block), backend_on(dst, config, staging_bytes=2 * block)
    try:
        assert writer.memory.regions == [(src.base, src.memory.size)]
        assert writer.memory.view(src.base, 16) is None  # device memory: never a host view
        assert writer.put(keys("d", 3), *src.addrs([2, 0, 3])) == [OK] * 3
        assert src.calls["to_host"] == 2 and src.calls["sync"] == 2 and src.batches == [8, 4]
        assert writer.flush(timeout=10)
        assert reader.get(keys("d", 3) + keys("never", 1), *dst.addrs([1, 3, 0, 2])) == [OK] * 3 + [ERR_FAILED]
        assert dst.calls["to_device"] == 2 and dst.batches == [8, 4]
        assert [dst.block(b) for b in (1, 3, 0)] == [src.block(b) for b in (2, 0, 3)]
        assert dst.block(2) == bytes(block)  # the miss left its block alone
        # the staging buffer is pinned for the device runtime, the whole buffer, once a chunk (pin is idempotent)
        staged = writer.session.put_stager
        assert staged is not None and {(n, already) for _, n, already in src.pins} == {(staged.allocated_bytes, False)}
        assert src.calls["set_device"] == 1
    finally:
        writer.close()
        reader.close()


def test_bounds_are_checked_before_the_copier_moves_anything(pool, config):
    device = SimDevice(PIECE * PIECES_PER_KEY * 2, seed=2)
    backend = backend_on(device, config)
    try:
        addrs, sizes = device.addrs([0, 1])
        end = device.base + device.memory.size
        straddling = [addrs[0], addrs[1][:-1] + [end - PIECE // 2]]
        before = pool.status().indexed_blocks
        assert backend.put(keys("b", 2), straddling, sizes) == [ERR_INVALID] * 2
        assert backend.get(keys("b", 2), [addrs[0], [1 << 59] * PIECES_PER_KEY], sizes) == [ERR_INVALID] * 2
        assert device.calls["to_host"] == device.calls["to_device"] == 0
        assert backend.flush(timeout=10) and pool.status().indexed_blocks == before
    finally:
        backend.close()


def test_a_failing_device_copy_is_a_miss_and_nothing_is_stored(pool, config):
    device, other = SimDevice(PIECE * PIECES_PER_KEY * 2, seed=3), SimDevice(PIECE * PIECES_PER_KEY * 2, base=1 << 61)
    writer, reader = backend_on(device, config), backend_on(other, config)
    try:
        device.fail = True
        assert writer.put(keys("f", 2), *device.addrs([0, 1])) == [ERR_FAILED] * 2
        assert writer.flush(timeout=10) and writer.exists(keys("f", 2)) == [0, 0]
        device.fail = False
        assert writer.put(keys("f", 2), *device.addrs([0, 1])) == [OK] * 2
        assert writer.flush(timeout=10)
        other.fail = True
        assert reader.get(keys("f", 2), *other.addrs([0, 1])) == [ERR_FAILED] * 2
        assert other.memory.sum() == 0
        assert writer.stats["faults"] == 1  # one chunk
        assert reader.stats["faults"] == 2  # the leading run, then the later block the pool holds: each tried once
    finally:
        writer.close()
        reader.close()


def test_the_host_copier_moves_pieces_back_to_back():
    memory = np.random.default_rng(4).integers(0, 256, 4096, dtype=np.uint8)
    staging = np.zeros(300, np.uint8)
    base = memory.ctypes.data
    pieces = [(base + 1000, 100), (base + 17, 150), (base + 4000, 50)]
    HostCopier().to_host(pieces, staging.ctypes.data)
    assert staging.tobytes() == memory[1000:1100].tobytes() + memory[17:167].tobytes() + memory[4000:4050].tobytes()
    target = np.zeros(4096, np.uint8)
    HostCopier().to_device(staging.ctypes.data, [(target.ctypes.data + 7, 200), (target.ctypes.data + 3000, 100)])
    assert target[7:207].tobytes() == staging[:200].tobytes() and target[3000:3100].tobytes() == staging[200:].tobytes()
    assert target[:7].sum() == 0 and target[207:3000].sum() == 0


def test_copier_choice_on_a_machine_without_a_gpu_or_npu():
    assert isinstance(copier_for([4096, 8192]), HostCopier)
    assert isinstance(copier_for([4096], host_memory=True), HostCopier)
    with pytest.raises(DeviceCopyError, match="no NPU or GPU"):
        copier_for([4096], host_memory=False)


class FakeRuntime:
    """libcudart / libascendcl stand-in: the C functions the copiers call, recorded; copies are memmoves."""

    def __init__(self, register_code: int = 0, fail_copy: bool = False):
        self.log: list[tuple[Any, ...]] = []
        self.register_code = register_code
        self.fail_copy = fail_copy
        names = {"cudaMemcpyAsync": self._copy_async, "cudaStreamSynchronize": self._sync,
                 "cudaStreamCreateWithFlags": self._create, "cudaHostRegister": self._register,
                 "cudaSetDevice": self._set, "cudaGetLastError": lambda: 0,
                 "aclrtMemcpyAsync": self._acl_copy_async, "aclrtMemcpy": self._acl_copy,
                 "aclrtSynchronizeStream": self._sync, "aclrtCreateStream": self._create,
                 "aclrtHostRegister": self._acl_register, "aclrtSetDevice": self._set}
        for name, fn in names.items():
            setattr(self, name, _CFunction(fn))

    def _copy_async(self, dst: int, src: int, size: int, kind: int, stream: int) -> int:
        self.log.append(("async", kind))
        if self.fail_copy:
            return 1
        ctypes.memmove(dst, src, size)
        return 0

    def _acl_copy_async(self, dst: int, dmax: int, src: int, size: int, kind: int, stream: int) -> int:
        assert dmax >= size
        return self._copy_async(dst, src, size, kind, stream)

    def _acl_copy(self, dst: int, dmax: int, src: int, size: int, kind: int) -> int:
        self.log.append(("sync-copy", kind))
        ctypes.memmove(dst, src, size)
        return 0

    def _sync(self, stream: Any) -> int:
        self.log.append(("sync",))
        return 0

    def _create(self, stream: Any, *flags: Any) -> int:
        stream._obj.value = 0x5EED
        self.log.append(("stream",))
        return 0

    def _register(self, addr: int, size: int, flags: int) -> int:
        self.log.append(("register", size))
        return self.register_code

    def _acl_register(self, addr: int, size: int, kind: int, mapped: Any) -> int:
        return self._register(addr, size, kind)

    def _set(self, device: int) -> int:
        self.log.append(("set_device", device, threading.get_ident()))
        return 0


class _CFunction:
    """A Python function that takes ``argtypes`` like a ctypes function does."""

    def __init__(self, fn: Any):
        self.fn = fn
        self.argtypes: list[Any] = []

    def __call__(self, *args: Any) -> int:
        return int(self.fn(*args))


@pytest.mark.parametrize("make", [CudaCopier, AclCopier])
def test_stream_copiers_queue_every_piece_then_synchronize_once(make):
    runtime = FakeRuntime()
    copier = make(runtime, 3)
    memory = np.random.default_rng(5).integers(0, 256, 1 << 14, dtype=np.uint8)
    staging = np.zeros(3000, np.uint8)
    copier.pin(staging.ctypes.data, staging.size)
    copier.pin(staging.ctypes.data, staging.size)  # idempotent
    pieces = [(memory.ctypes.data + 4096 * i, 1000) for i in range(3)]
    expected = b"".join(memory[4096 * i : 4096 * i + 1000].tobytes() for i in range(3))
    copier.to_host(pieces, staging.ctypes.data)
    assert staging.tobytes() == expected
    copier.to_device(staging.ctypes.data, [(memory.ctypes.data + 8192, 3000)])
    assert memory[8192:11192].tobytes() == expected
    events = [e[0] for e in runtime.log]
    assert events == ["register", "set_device", "stream", "async", "async", "async", "sync", "async", "sync"]
    assert [e[1] for e in runtime.log if e[0] == "async"] == [2, 2, 2, 1]  # device to host, then host to device
    assert runtime.log[1][1] == 3  # the copier's device
    # another thread makes the device current for itself, once, and copies on a stream of its own
    for _ in range(2):
        other = threading.Thread(target=lambda: copier.to_host(pieces[:1], staging.ctypes.data))
        other.start()
        other.join()
    assert sum(1 for e in runtime.log if e[0] == "set_device") == 3 and [e[0] for e in runtime.log].count("stream") == 3


def test_acl_copies_unpinned_host_memory_synchronously_and_cuda_reports_failures():
    runtime = FakeRuntime(register_code=507899)  # ACL refuses the registration
    acl = AclCopier(runtime, 0)
    memory = np.arange(4096, dtype=np.uint8)
    staging = np.zeros(200, np.uint8)
    acl.pin(staging.ctypes.data, staging.size)
    acl.pin(staging.ctypes.data, staging.size)  # refused once, not asked again
    acl.to_host([(memory.ctypes.data, 100), (memory.ctypes.data + 1000, 100)], staging.ctypes.data)
    assert staging.tobytes() == memory[:100].tobytes() + memory[1000:1100].tobytes()
    assert [e[0] for e in runtime.log] == ["register", "set_device", "sync-copy", "sync-copy"]

    failing = FakeRuntime(fail_copy=True)
    cuda = CudaCopier(failing, 0)
    with pytest.raises(DeviceCopyError, match="memcpy async failed"):
        cuda.to_host([(memory.ctypes.data, 100)], staging.ctypes.data)
    assert [e[0] for e in failing.log][-2:] == ["async", "sync"]  # nothing left in flight on the stream
    cuda.pin(staging.ctypes.data, staging.size, already_pinned=True)  # torch pinned it: nothing to register
    assert "register" not in [e[0] for e in failing.log]


def test_pointer_attributes_leave_room_for_cuda_13s_reserved_words():
    # CUDA 13's struct cudaPointerAttributes is type, device, devicePointer, hostPointer, long reserved[8]: 88 bytes,
    # all written by cudaPointerGetAttributes. A 24-byte struct (CUDA 12's) would be overrun: heap corruption.
    seen: list[int] = []

    def get_attributes(attrs: Any, addr: int) -> int:
        struct = attrs._obj
        seen.append(ctypes.sizeof(struct))
        assert ctypes.sizeof(struct) >= 88, "cudaPointerGetAttributes would write past the struct"
        assert bytes(struct)[24:] == bytes(ctypes.sizeof(struct) - 24), "reserved words must be zero"
        cuda13 = (ctypes.c_int * 2)(2, 5)  # cudaMemoryTypeDevice on device 5, then the pointers and reserved words
        ctypes.memmove(ctypes.addressof(struct), cuda13, ctypes.sizeof(cuda13))
        ctypes.memset(ctypes.addressof(struct) + 24, 0, 64)
        return 0 if addr != 1 else 1  # address 1: an error (not CUDA memory)

    runtime = FakeRuntime()
    runtime.cudaPointerGetAttributes = _CFunction(get_attributes)
    assert _cuda_device_of(runtime, 0x7000) == 5
    assert _cuda_device_of(runtime, 1) is None
    assert seen == [88, 88]


def test_the_cuda_runtime_torch_mapped_is_found_by_its_path(tmp_path):
    # pip's torch keeps libcudart in site-packages/nvidia/*/lib: the copier loads that one, not another copy
    runtime = "/venv/lib/python3.12/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12"
    maps = tmp_path / "maps"
    maps.write_text("\n".join([
        "55d0c0000000-55d0c0001000 r--p 00000000 08:01 1234 /usr/bin/python3.12",
        f"7f1a00000000-7f1a00010000 r--p 00000000 08:01 77 {runtime}",
        f"7f1a00010000-7f1a00080000 r-xp 00010000 08:01 77 {runtime}",
        "7f1a00080000-7f1a00090000 rw-p 00000000 00:00 0 ",
        "7f1a00090000-7f1a000a0000 r-xp 00000000 08:01 78 /opt/cuda/lib64/libcudart_static_helper.so",
        "7f1a000a0000-7f1a000b0000 r-xp 00000000 08:01 79 /usr/lib/libcudart.so.13.0.48",
        "7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]",
    ]))
    assert mapped_libraries("libcudart.so", str(maps)) == [runtime, "/usr/lib/libcudart.so.13.0.48"]
    assert mapped_libraries("libcudart.so", str(tmp_path / "absent")) == []
    assert mapped_libraries("libcudart.so") == []  # this process (CPU torch) has no CUDA runtime


def test_the_vllm_plugin_is_silent_where_vllm_ascend_cannot_be_imported(caplog):
    caplog.set_level(logging.INFO)
    register_backend()  # vllm_ascend is not installed in this Python
    register_backend()
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []
