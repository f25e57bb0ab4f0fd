"""SGLang's own HiCache code driving kvpool's L3 storage backend; run in build/sglang-venv (tests/sglang_env.sh).

``python tests/sglang_driver.py SPEC.json`` (by tests/engines/test_engine_sglang.py) builds, for each engine of
the spec, what an SGLang scheduler builds at start-up with ``--enable-hierarchical-cache
--hicache-storage-backend dynamic``: a device KV pool (``MHATokenToKVPool`` / ``MLATokenToKVPool`` on
CPU) with its allocator, the host pool SGLang derives from it (``MHATokenToKVPoolHost`` /
``MLATokenToKVPoolHost``), and a controller -- ``HiCacheController``, or UnifiedRadixCache's
``HybridCacheController`` over a ``HostPoolGroup`` (``"controller": "hybrid"``) -- whose
``attach_storage_backend`` creates kvpool's backend through SGLang's ``StorageBackendFactory`` (the
``dynamic`` loader). Then it runs the spec's steps through the controller's own threads and queues:

- ``write``: host pages filled with seeded random bytes, ``write_storage`` -> backup thread ->
  ``_page_backup`` -> the backend's ``batch_set_v1`` or ``batch_set``; answers completed tokens.
- ``read``: ``prefetch`` -> prefetch thread (``_storage_hit_query``: SGLang's page hashes,
  ``batch_exists``) -> host pages allocated as the scheduler does -> ``prefetch_io_aux``'s
  ``_page_transfer`` -> ``batch_get_v1`` or ``batch_get``; answers the hit count, the tokens loaded and
  a digest of each loaded page as SGLang's ``get_data_page`` sees it.
- ``call``: one backend method with the given arguments (bad input, ``get_stats``); its answer and the
  backend's counters.

Each step prints one JSON line. Only Triton (a GPU kernel compiler, not installed) is stubbed, with
SGLang's own stub for hosts without it; the L3 path never launches a kernel. torchvision, which SGLang's
model-config registry imports, gets the two op schemas its CUDA build cannot register here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import platform
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from queue import Empty
from typing import Any
from unittest import mock

import torch

TIMEOUT_S = 60.0


def install_triton_stub() -> None:
    """SGLang's Triton stub (``sglang._platform_stubs``), which it installs itself on hosts without Triton.

    ``install_platform_stubs`` does so only on Apple Silicon; here its checks are answered as there, for the
    call only. It also adds MPS stand-ins to ``torch.mps`` and makes ``Tensor.to``/``copy_`` blocking for
    MPS targets: neither matters on CPU.
    """
    if importlib.util.find_spec("triton") is not None:
        return
    # Loaded from its file: importing the sglang package itself already needs Triton.
    package = importlib.util.find_spec("sglang")
    assert package is not None and package.submodule_search_locations, "driver: sglang is not installed"
    path = Path(list(package.submodule_search_locations)[0]) / "_platform_stubs.py"
    spec = importlib.util.spec_from_file_location("sglang_platform_stubs", path)
    assert spec is not None and spec.loader is not None, f"driver: cannot load {path}"
    _platform_stubs = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = _platform_stubs
    spec.loader.exec_module(_platform_stubs)

    with mock.patch.object(sys, "platform", "darwin"), mock.patch.object(platform, "machine", lambda: "arm64"), \
            mock.patch.object(torch.backends.mps, "is_available", lambda: True):
        _platform_stubs.install_platform_stubs()


def declare_torchvision_ops() -> None:
    """Let torchvision import with CPU torch: SGLang's model-config registry imports it (never on this path).

    PyPI's torchvision is linked against CUDA torch, so its C ops do not load here, and its import then
    fails registering fake kernels for ``torchvision::nms`` and ``qnms``. Declaring those two schemas (no
    kernels) lets the import finish; no torchvision op is ever called by the HiCache path.
    """
    for name in ("nms", "qnms"):
        with contextlib.suppress(RuntimeError):  # already there: a torchvision whose ops did load
            torch.library.define(f"torchvision::{name}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


@contextlib.contextmanager
def ranks(tp_rank: int, tp_size: int) -> Iterator[None]:
    """SGLang's parallel context as a scheduler of this TP rank has it (no process groups: one process)."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_dcp_size=1,
                                 attn_dcp_rank=0):
        yield


class Engine:
    """One SGLang rank's HiCache stack on CPU, with kvpool as its L3 storage."""

    def __init__(self, spec: dict[str, Any]):
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

        self.spec = spec
        self.page_size = int(spec["page_size"])
        self.device_pool, self.host_pool = build_pools(spec)
        allocator = PagedTokenToKVPoolAllocator(self.device_pool.size, self.page_size, self.device_pool.dtype,
                                                "cpu", self.device_pool, need_sort=False)
        extra = {"backend_name": "kvpool", "module_path": "kvpool.engines.sglang",
                 "class_name": "KVPoolHiCacheStorage", "interface_v1": int(spec.get("interface_v1", 1))}
        env = {}
        if spec.get("config_from_env"):  # no path in the extra config: kvpool reads $KVPOOL_CONFIG_PATH
            env["KVPOOL_CONFIG_PATH"] = spec["config"]
        else:
            extra["kvpool_config_path"] = spec["config"]
        self.hybrid = spec.get("controller", "hicache") == "hybrid"
        args = dict(page_size=self.page_size, tp_group=None, load_cache_event=threading.Event(), io_backend="direct",
                    storage_backend="dynamic", model_name=spec.get("model", "test-model"),
                    storage_backend_extra_config=extra, enable_storage_metrics=bool(spec.get("metrics", False)))
        with ranks(int(spec.get("tp_rank", 0)), int(spec.get("tp_size", 1))), mock.patch.dict("os.environ", env):
            if self.hybrid:  # what UnifiedRadixCache builds (hybrid_pool_assembler.build_kv_only_stack)
                from sglang.srt.mem_cache.hicache_storage import PoolName
                from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
                from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
                from sglang.srt.mem_cache.pool_host import HostPoolGroup

                layers = self.device_pool.layer_num
                group = HostPoolGroup([build_pool_entry(
                    name=PoolName.KV, host_pool=self.host_pool, device_pool=self.device_pool,
                    layer_mapping={i: i for i in range(layers)}, transfer_layer_id_max=layers, is_anchor=True)])
                self.controller = HybridCacheController(allocator, group, **args)
            else:  # the base class (what the decode KV offload manager builds)
                from sglang.srt.managers.cache_controller import HiCacheController

                self.controller = HiCacheController(allocator, self.host_pool, **args)
        self.backend = self.controller.storage_backend

    def info(self) -> dict[str, Any]:
        c = self.controller
        return {"controller": type(c).__name__,
                "backend": type(self.backend).__module__ + "." + type(self.backend).__qualname__,
                "page_get": c.page_get_func.__name__, "page_set": c.page_set_func.__name__,
                "is_mla": c.storage_config.is_mla_model, "writer": c.storage_config.is_storage_writer,
                "backup_skip": c.backup_skip, "host_pool": type(self.host_pool).__name__,
                "layout": self.host_pool.layout}

    def write(self, tokens: list[int], seed: int) -> dict[str, Any]:
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        n = len(tokens) // self.page_size * self.page_size
        host_indices = self.controller.mem_pool_host.alloc(n)
        fill_pages(self.host_pool, host_indices, seed)
        hashes = get_storage_hash_str(tokens[:n], None, page_size=self.page_size)  # as the radix tree keys pages
        op_id = self.controller.write_storage(host_indices, tokens[:n], hash_value=hashes)
        op = self.controller.ack_backup_queue.get(timeout=TIMEOUT_S)
        assert op.id == op_id, "driver: a backup ack of another operation"
        flushed = self.backend.flush(timeout=30) if hasattr(self.backend, "flush") else None
        digests = page_digests(self.host_pool, host_indices, self.page_size)
        self.controller.mem_pool_host.free(host_indices)
        return {"completed_tokens": op.completed_tokens, "digests": digests, "hashes": hashes, "flushed": flushed}

    def read(self, tokens: list[int]) -> dict[str, Any]:
        c = self.controller
        rid = f"req-{id(tokens)}"
        if self.hybrid:
            from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

            op = c.prefetch(CacheRequestHandle(rid=rid, attempt_id=0), tokens)
        else:
            op = c.prefetch(rid, tokens)
        queried = c.prefetch_hit_queue.get(timeout=TIMEOUT_S)
        assert queried is op, "driver: a hit query of another operation"
        hit = op.storage_hit_count
        out: dict[str, Any] = {"storage_hit_count": hit, "completed_tokens": 0, "digests": []}
        if hit == 0:
            op.mark_terminate()
            return out
        op.host_indices = c.alloc_prefetch_host_buffers(op, hit)  # the scheduler's allocation for a hit
        c.prefetch_buffer.put(op)
        completed = 0
        while True:
            try:
                ack = c.ack_prefetch_queue.get(timeout=TIMEOUT_S)
            except Empty:
                raise AssertionError("driver: no prefetch ack in time") from None
            if ack.operation is not op:
                continue
            if ack.completed_tokens is not None:
                completed = max(completed, int(ack.completed_tokens))
            if ack.completed_req:
                break
        out["completed_tokens"] = completed
        out["digests"] = page_digests(self.host_pool, op.host_indices[:completed], self.page_size)
        c.mem_pool_host.free(op.host_indices)
        return out

    def call(self, method: str, args: list[Any]) -> dict[str, Any]:
        """Call a backend method with decoded arguments; its answer, JSON-able."""
        decoded = [decode(a, self) for a in args]
        answer = getattr(self.backend, method)(*decoded)
        return {"answer": encode(answer), "stats": dict(self.backend.stats)}

    def close(self) -> None:
        self.controller.detach_storage_backend()


def build_pools(spec: dict[str, Any]) -> tuple[Any, Any]:
    """SGLang's device KV pool on CPU and the host pool it derives from it (as sglang's own unit tests build them)."""
    page_size, layers, tokens = int(spec["page_size"]), int(spec.get("layers", 2)), int(spec.get("tokens", 256))
    dtype = getattr(torch, spec.get("dtype", "bfloat16"))
    if spec["kind"] == "mha":
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        heads, head_dim = int(spec.get("heads", 2)), int(spec.get("head_dim", 16))
        device_pool = MHATokenToKVPool(tokens, page_size, dtype, heads, head_dim, layers, "cpu", False, start_layer=0,
                                       end_layer=layers)
        host_class: Any = MHATokenToKVPoolHost
    else:
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        device_pool = MLATokenToKVPool(tokens, page_size, dtype, int(spec.get("kv_lora_rank", 32)),
                                       int(spec.get("rope_dim", 16)), layers, "cpu", False, start_layer=0,
                                       end_layer=layers)
        host_class = MLATokenToKVPoolHost
    info = device_pool.get_device_pool_infos()[0].buffer_info
    extra = {"target_layer_num": layers} if spec["kind"] == "mla" else {}
    host_pool = host_class(info, 2.0, 0, page_size, spec.get("layout", "layer_first"), pin_memory=False,
                           device="cpu", device_capacity_tokens=device_pool.size, start_layer=0, end_layer=layers,
                           **extra)
    return device_pool, host_pool


def fill_pages(host_pool: Any, host_indices: torch.Tensor, seed: int) -> None:
    """Seeded random bytes into each page, through SGLang's own page accessor (``set_from_flat_data_page``)."""
    gen = torch.Generator().manual_seed(seed)
    page_size = host_pool.page_size
    for start in host_indices[::page_size].tolist():
        page = host_pool.get_dummy_flat_data_page()
        page.copy_(torch.randn(page.shape, generator=gen).to(page.dtype))
        host_pool.set_from_flat_data_page(start, page)


def page_digests(host_pool: Any, host_indices: torch.Tensor, page_size: int) -> list[str]:
    """sha256 of each page's bytes as SGLang reads them (``get_data_page(flat=True)``)."""
    out = []
    for start in host_indices[::page_size].tolist():
        page = host_pool.get_data_page(start, flat=True).contiguous()
        out.append(hashlib.sha256(page.view(torch.uint8).numpy().tobytes()).hexdigest())
    return out


def decode(arg: Any, engine: Engine) -> Any:
    """Spec arguments: ``{"indices": n}`` -> n pages of fresh host indices, ``{"tensor": [shape, dtype]}``."""
    if isinstance(arg, dict) and "indices" in arg:
        return engine.controller.mem_pool_host.alloc(int(arg["indices"]) * engine.page_size)
    if isinstance(arg, dict) and "index_tensor" in arg:
        return torch.tensor(arg["index_tensor"], dtype=torch.int64)
    if isinstance(arg, dict) and "float_tensor" in arg:
        return torch.zeros(int(arg["float_tensor"]), dtype=torch.float32)
    if isinstance(arg, dict) and "pages" in arg:
        return [engine.host_pool.get_dummy_flat_data_page() for _ in range(int(arg["pages"]))]
    return arg


def encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, torch.Tensor):
        return {"tensor": list(value.shape)}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


def prepare() -> None:
    """What this host lacks for SGLang's imports: Triton (stubbed by SGLang's own stub), torchvision's ops."""
    install_triton_stub()
    declare_torchvision_ops()


def main(argv: list[str]) -> int:
    spec = json.loads(open(argv[1]).read())
    prepare()
    engines = {name: Engine(e) for name, e in spec["engines"].items()}
    try:
        for name, engine in engines.items():
            print(json.dumps({"engine": name, "info": engine.info()}), flush=True)
        for step in spec["steps"]:
            engine = engines[step["engine"]]
            if step["op"] == "write":
                result = engine.write(step["tokens"], int(step.get("seed", 0)))
            elif step["op"] == "read":
                result = engine.read(step["tokens"])
            else:
                result = engine.call(step["method"], step.get("args", []))
            print(json.dumps({"step": step.get("name", step["op"]), **result}), flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
