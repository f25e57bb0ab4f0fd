"""Drives vLLM's own offloading tiers for tests/engines/test_vllm_offload_tier.py: ``<vllm python> THIS SPEC.json``.

What runs is vLLM's: ``OffloadingSpecFactory`` builds the spec the user's ``kv_connector_extra_config`` names
(``TieringOffloadingSpec``), whose ``get_manager()`` makes the CPU primary tier on its shared-memory region and,
through ``SecondaryTierFactory``, every secondary tier from its ``type`` and ``module_path``: kvpool's among them.
Block hashes are vLLM's own (``Request`` with vLLM's block hasher, sha256). This driver then calls the manager as
``OffloadingConnectorScheduler`` does, one engine step at a time (lookups of a request's chunk keys in order,
``on_schedule_end`` at the end of the step). The one thing not vLLM's is ``GpuWorkerStandIn``
(tests/vllm_offload_standins.py): vLLM's CPU offloading worker copies GPU KV blocks to and from the primary tier's
rows and needs CUDA or XPU; the stand-in writes a chunk's "GPU" bytes (a function of its key, so another process
can check them) into the rows through its own mapping of the region, as that worker does, and reads them back
after a load.

SPEC: ``{"engine_id", "model", "block_size", "layers", "page_bytes", "extra_config": the user's
kv_connector_extra_config, "steps": [{"store": id, "tokens": [...], "cache_salt": s} | {"load": id, "tokens":
[...], "cache_salt": s, "timeout": seconds, "pause_on_hit": name} | {"build": name, "extra_config": another}
| {"pause": name}]}``.

Prints one JSON object a line, prefixed ``KVPOOL-TEST``: per store ``{"stored": id, "chunks", "offered":
chunks the primary tier took, "submit_s": seconds the scheduler-side calls took, "done_s"}``, per load
``{"loaded": id, "chunks", "hits", "equal": the hit chunks' bytes are the stored ones, "steps", "seconds"}``,
per build ``{"built": name, "error": why vLLM refused to start or null, "tier_on", "lookup": the tier's answer
for a chunk it does not hold}``, ``{"paused": name}`` before waiting for a line on stdin, and last ``{"stats":
vLLM's reduced offloading stats}``.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from vllm_driver import say


def pause(name: str) -> None:
    say(paused=name)
    sys.stdin.readline()


def offloading_spec(spec: dict[str, Any]) -> Any:
    """vLLM's offloading spec for a one-worker fp32 model of ``layers`` layers, from the user's extra config."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    bs = spec["block_size"]
    layers = tuple(f"model.layers.{i}.self_attn.attn" for i in range(spec["layers"]))
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=bs, layer_names=layers, group_id=0),),
        worker_kv_bytes_per_block=spec["page_bytes"], enable_kv_cache_events=False,
        extra_config=spec["extra_config"], engine_id=spec["engine_id"],
        model=OffloadingModelConfig(name=spec["model"], dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=bs, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=True),
        kv_cache_layout="NHD")
    return OffloadingSpecFactory.create_spec(config)


class Driver:
    def __init__(self, spec: dict[str, Any]):
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm_offload_standins import GpuWorkerStandIn

        init_none_hash(sha256)
        self.raw = spec
        self.block_size = spec["block_size"]
        self.hasher = get_request_block_hasher(self.block_size, sha256)
        self.spec = offloading_spec(spec)
        self.manager = self.spec.get_manager()
        self.gpu = GpuWorkerStandIn(self.spec)  # vLLM's CUDA-only worker, stood in (tests/vllm_offload_standins.py)
        self.new_req_ids: list[str] = []

    def offload_keys(self, req_id: str, tokens: list[int], salt: str | None) -> list[bytes]:
        from vllm import SamplingParams
        from vllm.v1.kv_offload.base import make_offload_key
        from vllm.v1.request import Request

        request = Request(req_id, tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
                          block_hasher=self.hasher)
        return [make_offload_key(bytes(h), 0) for h in request.block_hashes]

    def end_step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.manager.on_schedule_end(ScheduleEndContext(tuple(self.new_req_ids), ()))
        self.new_req_ids = []

    def context(self, req_id: str) -> Any:
        from vllm.v1.kv_offload.base import ReqContext

        ctx = ReqContext(req_id=req_id)
        self.manager.on_new_request(ctx)
        self.new_req_ids.append(req_id)
        return ctx

    def store(self, step: dict[str, Any]) -> None:
        keys = self.offload_keys(step["store"], step["tokens"], step.get("cache_salt"))
        ctx = self.context(step["store"])
        start = time.perf_counter()
        out = self.manager.prepare_store(keys, ctx)
        offered = 0
        if out is not None:
            offered = len(out.keys_to_store)
            self.gpu.store(out.keys_to_store, out.store_spec.chunk_ids)  # the worker's GPU -> CPU copy
            self.manager.complete_store(out.keys_to_store, ctx)  # cascades to the secondary tiers
        self.manager.on_request_finished(ctx)
        self.end_step()
        submit_s = time.perf_counter() - start
        deadline = time.monotonic() + step.get("timeout", 30)
        while self.manager.has_pending_work() and time.monotonic() < deadline:
            time.sleep(0.005)  # the engine's next step
            self.end_step()
        say(stored=step["store"], chunks=len(keys), offered=offered, submit_s=submit_s,
            done_s=time.perf_counter() - start, pending=self.manager.has_pending_work())

    def load(self, step: dict[str, Any]) -> None:
        """Look the chunks up step by step, as OffloadingConnectorScheduler._maximal_prefix_lookup does, until the
        answer is final; then the hit chunks go to the "GPU" and are compared."""
        from vllm.v1.kv_offload.base import LookupResult

        keys = self.offload_keys(step["load"], step["tokens"], step.get("cache_salt"))
        ctx = self.context(step["load"])
        start = time.perf_counter()
        deadline = time.monotonic() + step.get("timeout", 30)
        steps, hits, paused = 0, None, False
        while hits is None and time.monotonic() < deadline:
            steps += 1
            count, deferred = 0, False
            for key in keys:
                result = self.manager.lookup(key, ctx)
                if result is LookupResult.MISS:
                    break
                if result is LookupResult.HIT:
                    count += 1
                elif result is LookupResult.HIT_PENDING:
                    count, deferred = count + 1, True
                else:
                    deferred = True
            if deferred and step.get("pause_on_hit") and not paused and count:
                paused = True  # promotions queued, not yet submitted: the test faults the pool now
                pause(step["pause_on_hit"])
            hits = None if deferred else count
            self.end_step()
            if hits is None:
                time.sleep(0.005)  # the engine's next step
        equal = True
        if hits:
            load_spec = self.manager.prepare_load(keys[:hits], ctx)
            equal = self.gpu.equal(keys[:hits], load_spec.chunk_ids)  # the worker's CPU -> GPU copy
            self.manager.complete_load(keys[:hits], ctx)
        self.manager.on_request_finished(ctx)
        self.end_step()
        say(loaded=step["load"], chunks=len(keys), hits=hits, equal=equal, steps=steps,
            seconds=time.perf_counter() - start)

    def build(self, step: dict[str, Any]) -> None:
        """Another manager from another extra config (a fresh CPU tier): did vLLM start, is the kvpool tier on,
        and what does it answer for a chunk it cannot hold."""
        from vllm.v1.kv_offload.base import ReqContext

        spec = {**self.raw, "engine_id": f"{self.raw['engine_id']}-{step['build']}",
                "extra_config": step["extra_config"]}
        try:
            manager = offloading_spec(spec).get_manager()
        except Exception as exc:  # noqa: BLE001 - a refusal to start is what the test looks at
            say(built=step["build"], error=f"{type(exc).__name__}: {exc}")
            return
        try:
            tier = manager.secondary_tiers[0]
            ctx = ReqContext(req_id="build")
            answer = tier.lookup(self.offload_keys("build", list(range(self.block_size)), None)[0], ctx)
            say(built=step["build"], error=None, tier_on=tier.jobs.pool is not None, lookup=answer.name)
        finally:
            manager.shutdown()

    def stats(self) -> dict[str, float]:
        stats = self.manager.get_stats()
        return {} if stats is None else {k: float(v) for k, v in stats.reduce().items()}


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    driver = Driver(spec)
    try:
        for step in spec["steps"]:
            if "store" in step:
                driver.store(step)
            elif "load" in step:
                driver.load(step)
            elif "build" in step:
                driver.build(step)
            else:
                pause(step["pause"])
        say(stats=driver.stats())
    finally:
        driver.manager.shutdown()
        driver.gpu.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
