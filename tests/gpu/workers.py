"""What the GPU check runs in its child processes: one role a process (``python workers.py ROLE SPEC RESULT``).

``check.py`` starts each role with a JSON spec and a timeout; the role writes
its figures as JSON to RESULT (or raises: the exit status and the log say
why; what it measured before is in RESULT.partial). Roles:

- ``env``: versions, the device, and which CUDA runtime kvpool's copier loads.
- ``copier-put`` (each piece shape in turn): fills a registered region of device memory (laid out as a
  paged KV cache: one tensor a layer's K or V, so a block's pieces are
  strided) with seeded bytes and puts every block into the pool through the
  copier (``KVPoolStoreBackend``, the same code vllm-ascend drives), once a
  round under new keys; also times the copier alone and torch's own
  ``copy_`` between the device and pinned host memory, in this process.
- ``copier-get``: another process: gets those blocks into its own device
  memory (block ``b`` into slot ``n - 1 - b``) and compares every byte with
  the seeded source, each round.
- ``engine-store`` / ``engine-hit``: the transformers reference engine on
  the device; the first computes a prompt and stores its blocks, the second
  (a new process, nothing on its device) times a DRAM hit of that prefix
  against a recompute of the whole prompt, tokens compared.

``device`` is ``cuda`` or ``cpu`` (the dry run: CPU tensors, the host copier,
the same calls otherwise).
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

Spec = dict[str, Any]
Save = Callable[[dict[str, Any]], None]  # writes a partial result (a later failure keeps it)


class CheckFailed(AssertionError):
    """A check's condition does not hold (the message says which); the role exits non-zero."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    """(seconds, result) of ``fn`` with the device idle before and after."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


def gbps(nbytes: int, seconds: list[float]) -> float:
    """GB/s (10^9 bytes) at the median of ``seconds``."""
    return round(nbytes / statistics.median(seconds) / 1e9, 3)


# -- env -------------------------------------------------------------------------------------------


def env(spec: Spec, save: Save) -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__, "cpus": os.cpu_count(), "glibc": platform.libc_ver()[1],
        "shm_free_bytes": shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0,
    }
    if spec["device"] != "cuda":
        info["device"] = f"cpu ({platform.machine()}; dry run)"
        return info
    expect(torch.cuda.is_available(), "torch sees no CUDA device (torch.cuda.is_available() is False): a CPU "
                                      "build of torch, no driver, or CUDA_VISIBLE_DEVICES hides the GPUs")
    props = torch.cuda.get_device_properties(0)
    info.update(device=torch.cuda.get_device_name(0), device_count=torch.cuda.device_count(),
                device_memory_bytes=props.total_memory, capability=f"{props.major}.{props.minor}")
    info["nvidia_smi"] = _nvidia_smi()
    probe = torch.zeros(1, device="cuda")  # initializes CUDA in this process, as an engine would have
    copier = _copier_for(probe)
    lib = copier.lib
    info["libcudart"] = getattr(lib, "_name", "?")
    for what, call in (("cuda_driver_version", "cudaDriverGetVersion"),
                       ("cuda_runtime_version", "cudaRuntimeGetVersion")):
        value = ctypes.c_int()
        code = getattr(lib, call)(ctypes.byref(value))
        info[what] = _cuda_version(value.value) if code == 0 else f"error {code}"
    return info


def _cuda_version(code: int) -> str:
    return f"{code // 1000}.{code % 1000 // 10}"


def _nvidia_smi() -> str:
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return "not found"
    try:
        out = subprocess.run([binary, "--query-gpu=name,driver_version,memory.total,pci.bus_id",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"failed: {exc}"
    return (out.stdout.strip() or out.stderr.strip())[:500]


def _copier_for(tensor: torch.Tensor) -> Any:
    """kvpool's copier for this tensor's memory; a CUDA one on the GPU, the host one in the dry run."""
    from kvpool.engines.device_copy import copier_for

    on_device = tensor.device.type != "cpu"
    copier = copier_for([tensor.data_ptr()], host_memory=not on_device)
    expect(copier.kind == ("cuda" if on_device else "host"),
           f"kvpool chose the {copier.kind} copier for {tensor.device} memory")
    return copier


# -- the copier ------------------------------------------------------------------------------------


class Region:
    """A paged KV cache's memory: ``pieces`` tensors (a layer's K or V each) of ``blocks`` pieces of
    ``piece_bytes``, one allocation ``[pieces, blocks, piece_bytes]``; block ``b`` is piece ``[p, b]`` of each."""

    def __init__(self, spec: Spec, fill_seed: int | None):
        self.device = spec["device"]
        self.blocks, self.pieces, self.piece_bytes = spec["blocks"], spec["pieces"], spec["piece_bytes"]
        self.block_bytes = self.pieces * self.piece_bytes
        self.total = self.blocks * self.block_bytes
        self.memory = torch.zeros(self.total, dtype=torch.uint8, device=self.device)
        if fill_seed is not None:
            self.memory.copy_(source_bytes(fill_seed, self.total))
        synchronize(self.device)  # the copier copies on a stream of its own: torch's writes must be done

    def addrs(self, slots: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Each slot's piece addresses and sizes, as vllm-ascend's connector hands them to its backend."""
        base = self.memory.data_ptr()
        addrs = [[base + (p * self.blocks + s) * self.piece_bytes for p in range(self.pieces)] for s in slots]
        return addrs, [[self.piece_bytes] * self.pieces for _ in slots]

    def grid(self) -> torch.Tensor:
        """The memory on the host as ``[pieces, blocks, piece_bytes]``."""
        return self.memory.view(self.pieces, self.blocks, self.piece_bytes).cpu()


def source_bytes(seed: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` seeded random bytes on the host (the same in every process)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def block_keys(tag: str, blocks: int) -> list[str]:
    return [f"gpu-check@{tag}@{b:x}" for b in range(blocks)]


def _backend(spec: Spec, region: Region) -> Any:
    from kvpool.engines.vllm_ascend import KVPoolStoreBackend

    backend = KVPoolStoreBackend(None, config_path=spec["config"], host_memory=region.device == "cpu",
                                 staging_bytes=spec["staging_bytes"])
    backend.set_device()
    backend.register_buffer([region.memory.data_ptr()], [region.total])
    copier = backend.copier
    if copier is None or backend.stats["refused"]:
        raise CheckFailed(f"register_buffer refused {region.device} memory (see the log)")
    expect(copier.kind == ("cuda" if region.device == "cuda" else "host"),
           f"kvpool chose the {copier.kind} copier for {region.device} memory")
    return backend


def copier_put(spec: Spec, save: Save) -> dict[str, Any]:
    """Every shape in ``spec["shapes"]`` in turn (the result saved after each)."""
    return _each_shape(spec, save, _put_shape)


def copier_get(spec: Spec, save: Save) -> dict[str, Any]:
    return _each_shape(spec, save, _get_shape)


def _each_shape(spec: Spec, save: Save, run: Callable[[Spec], dict[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {"shapes": {}}
    for shape in spec["shapes"]:
        result["shapes"][shape["name"]] = run({**spec, **shape})
        save(result)
    return result


def _put_shape(spec: Spec) -> dict[str, Any]:
    from kvpool.client.tensors import host_bytes

    region = Region(spec, fill_seed=spec["seed"])
    backend = _backend(spec, region)
    result: dict[str, Any] = {"copier": backend.copier.kind, "block_bytes": region.block_bytes,
                              "blocks": region.blocks, "pieces": region.pieces, "bytes": region.total}
    try:
        addrs, sizes = region.addrs(list(range(region.blocks)))
        seconds = []
        for r in range(spec["rounds"]):
            tag = f"{spec['tag']}-r{r}"

            def put(tag: str = tag) -> tuple[list[int] | None, bool]:
                return backend.put(block_keys(tag, region.blocks), addrs, sizes), backend.flush(spec["flush_s"])

            elapsed, (answers, flushed) = timed(put, region.device)
            expect(answers == [0] * region.blocks, f"put round {r}: {answers and sum(a != 0 for a in answers)} "
                                                   f"of {region.blocks} blocks not accepted")
            expect(flushed, f"put round {r}: the pool did not take the blocks within {spec['flush_s']}s")
            seconds.append(elapsed)
        result["keys_tag"] = f"{spec['tag']}-r{spec['rounds'] - 1}"
        result["put_first_s"] = round(seconds[0], 4)
        result["put_gbps"] = gbps(region.total, seconds[1:] or seconds)  # round 0 allocates staging, dials nodes

        # the copier alone, and torch's copy_, between the same device memory and pinned host memory
        pinned = host_bytes(region.total)
        copier, host = backend.copier, pinned.data_ptr()
        copier.pin(host, region.total, already_pinned=bool(pinned.is_pinned()))
        result["host_pinned"] = bool(pinned.is_pinned())
        pieces = [(a, s) for block_addrs, block_sizes in zip(addrs, sizes) for a, s in zip(block_addrs, block_sizes)]
        copy_rounds = max(3, spec["rounds"])
        d2h = [timed(lambda: copier.to_host(pieces, host), region.device)[0] for _ in range(copy_rounds)]
        expect(torch.equal(pinned.view(region.blocks, region.pieces, region.piece_bytes),
                           region.grid().transpose(0, 1)), "the copier's device-to-host copy changed bytes")
        h2d = [timed(lambda: copier.to_device(host, pieces), region.device)[0] for _ in range(copy_rounds)]
        result["copier_d2h_gbps"], result["copier_h2d_gbps"] = gbps(region.total, d2h), gbps(region.total, h2d)
        flat = torch.empty(region.total, dtype=torch.uint8, device=region.device)
        t_d2h = [timed(lambda: pinned.copy_(flat, non_blocking=True), region.device)[0] for _ in range(copy_rounds)]
        t_h2d = [timed(lambda: flat.copy_(pinned, non_blocking=True), region.device)[0] for _ in range(copy_rounds)]
        result["torch_d2h_gbps"], result["torch_h2d_gbps"] = gbps(region.total, t_d2h), gbps(region.total, t_h2d)
        result["stats"] = dict(backend.stats)
    finally:
        backend.close()
    return result


def _get_shape(spec: Spec) -> dict[str, Any]:
    region = Region(spec, fill_seed=None)
    backend = _backend(spec, region)
    result: dict[str, Any] = {"copier": backend.copier.kind, "bytes": region.total}
    try:
        source = source_bytes(spec["seed"], region.total).view(region.pieces, region.blocks, region.piece_bytes)
        keys = block_keys(spec["keys_tag"], region.blocks)
        addrs, sizes = region.addrs([region.blocks - 1 - b for b in range(region.blocks)])
        seconds = []
        for r in range(spec["rounds"]):
            region.memory.zero_()
            elapsed, answers = timed(lambda: backend.get(keys, addrs, sizes), region.device)
            expect(answers == [0] * region.blocks, f"get round {r}: {answers and sum(a != 0 for a in answers)} "
                                                   f"of {region.blocks} blocks not loaded")
            got = region.grid().flip(1)  # block b went to slot n - 1 - b
            if not torch.equal(got, source):
                bad = sorted({int(b) for b in (got != source).nonzero()[:, 1].tolist()})
                raise CheckFailed(f"get round {r}: bytes differ in {len(bad)} of {region.blocks} blocks "
                                  f"(first: block {bad[0]})")
            seconds.append(elapsed)
        result["bytes_equal"] = True
        result["get_first_s"] = round(seconds[0], 4)
        result["get_gbps"] = gbps(region.total, seconds[1:] or seconds)
        result["stats"] = dict(backend.stats)
    finally:
        backend.close()
    return result


# -- the transformers reference engine --------------------------------------------------------------


def _engine_setup(spec: Spec) -> tuple[Any, Any, list[int]]:
    """(model on the device, its pool client, the prompt)."""
    import numpy as np

    from kvpool.client.kvclient import KVCacheClient
    from kvpool.config import ClientConfig
    from kvpool.engines import hf_model
    from kvpool.engines.transformers_engine import kv_layout

    size = hf_model.ModelSize(**spec["model"])
    model = hf_model.random_qwen2(size, seed=spec["seed"], dtype=getattr(torch, spec["dtype"])).to(spec["device"])
    layout = kv_layout(model, spec["block_size"])
    client = KVCacheClient(ClientConfig(master=spec["master"], layout=layout, model=hf_model.model_id(model),
                                        lookup_timeout_s=5.0, io_timeout_s=30.0))
    rng = np.random.default_rng(spec["seed"])
    prompt = rng.integers(0, size.vocab, spec["cached_blocks"] * spec["block_size"] + spec["suffix_tokens"]).tolist()
    return model, client, prompt


def engine_store(spec: Spec, save: Save) -> dict[str, Any]:
    from kvpool.engines.transformers_engine import PrefixCachedEngine

    model, client, prompt = _engine_setup(spec)
    with client:
        engine = PrefixCachedEngine(model, client)
        generated = engine.generate(prompt, spec["new_tokens"])
        expect(generated.stored_blocks == spec["cached_blocks"],
               f"stored {generated.stored_blocks} blocks, expected {spec['cached_blocks']}")
        expect(client.flush(spec["flush_s"]), f"the pool did not take the blocks within {spec['flush_s']}s")
    return {"tokens": generated.tokens, "ttft_s": round(generated.ttft_s, 4), "stored_blocks": generated.stored_blocks,
            "block_bytes": client.layout.block_bytes if client.layout else 0, "prompt_tokens": len(prompt)}


def engine_hit(spec: Spec, save: Save) -> dict[str, Any]:
    import numpy as np

    from kvpool.engines.transformers_engine import PrefixCachedEngine

    model, client, prompt = _engine_setup(spec)
    cached = spec["cached_blocks"] * spec["block_size"]
    with client:
        hit_engine, off_engine = PrefixCachedEngine(model, client), PrefixCachedEngine(model)
        # layer-wise: the same hit, its prefix crossing to the device layer by layer beside the forward (a CUDA
        # model; on CPU the same path as hit_engine)
        lw_engine = PrefixCachedEngine(model, client, layerwise=True)
        # warm-up on another prompt: kernels, the allocator, the pool's connections and arena mapping
        warm = np.random.default_rng(spec["seed"] + 1).integers(0, 256, len(prompt)).tolist()
        off_engine.generate(warm, 2)
        hit_engine.generate(warm, 2)
        expect(client.flush(spec["flush_s"]), "warm-up: the pool did not take the blocks")
        hit_engine.generate(warm, 2)
        lw_engine.generate(warm, 2)
        hits, layerwise, recomputes, phases = [], [], [], []
        for r in range(spec["rounds"]):
            order = ("hit", "layerwise", "off") if r % 2 == 0 else ("off", "layerwise", "hit")
            for case in order:
                if case == "off":
                    recomputes.append(off_engine.generate(prompt, spec["new_tokens"]))
                    continue
                res = (hit_engine if case == "hit" else lw_engine).generate(prompt, spec["new_tokens"])
                expect(res.reused["dram"] == cached, f"round {r}: the {case} loaded {res.reused} tokens by tier, "
                                                     f"expected {cached} from DRAM")
                if case == "hit":
                    hits.append(res)
                    phases.append(res.timings)
                else:
                    layerwise.append(res)
        hit_tokens, off_tokens = hits[0].tokens, recomputes[0].tokens
        stable = (all(res.tokens == hit_tokens for res in hits + layerwise)
                  and all(res.tokens == off_tokens for res in recomputes))
        hit_ttft = statistics.median(res.ttft_s for res in hits)
        lw_ttft = statistics.median(res.ttft_s for res in layerwise)
        off_ttft = statistics.median(res.ttft_s for res in recomputes)
        # The ceiling: the whole hit's forward, its prefix already on the device (what an HBM hit costs).
        # What loading adds: TTFT above that; layer-wise hides what of the host-to-device copy it overlaps.
        own = statistics.median(p["prefill"] for p in phases)
        added, lw_added = hit_ttft - own, lw_ttft - own
    return {
        "hit_tokens": hit_tokens, "recompute_tokens": off_tokens, "tokens_stable_across_rounds": stable,
        "reused_tokens": cached, "prompt_tokens": len(prompt),
        "hit_ttft_ms": round(hit_ttft * 1e3, 2), "recompute_ttft_ms": round(off_ttft * 1e3, 2),
        "hit_over_recompute": round(hit_ttft / off_ttft, 3),
        "layerwise_tokens": layerwise[0].tokens, "layerwise_hit_ttft_ms": round(lw_ttft * 1e3, 2),
        "own_forward_ms": round(own * 1e3, 2), "whole_load_added_ms": round(added * 1e3, 2),
        "layerwise_added_ms": round(lw_added * 1e3, 2),
        "layerwise_over_whole": round(lw_added / added, 3) if added > 0 else None,
        "hit_phases_ms": {k: round(statistics.median(p.get(k, 0.0) for p in phases) * 1e3, 2)
                          for k in ("hash", "lookup", "load", "assemble", "prefill")},
    }


ROLES: dict[str, Callable[[Spec, Save], dict[str, Any]]] = {
    "env": env, "copier-put": copier_put, "copier-get": copier_get, "engine-store": engine_store,
    "engine-hit": engine_hit,
}


def main(argv: list[str]) -> int:
    role, spec_text, result_path = argv

    def save(result: dict[str, Any], final: bool = False) -> None:
        path = result_path if final else result_path + ".partial"
        with open(path + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(path + ".tmp", path)

    save(ROLES[role](json.loads(spec_text), save), final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
