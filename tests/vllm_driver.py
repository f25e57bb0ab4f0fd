"""Runs the real vLLM for tests/engines/test_engine_vllm.py: ``<vllm python> tests/vllm_driver.py SPEC.json``.

SPEC: ``{"model": dir, "block_size": 32, "engines": [{"name": ..., "kvpool": extra-config or null,
"vllm_kv_events": {"endpoint": ..., "replay_endpoint": ...} (optional: vLLM's own KV event publisher),
"kv_transfer_config": a whole KVTransferConfig (optional: another connector instead of kvpool's),
"requests": [REQUEST | {"pause": name} | {"stepped": STEPPED}]}]}``, a REQUEST being
``{"id": ..., "prompt": [token ids], "max_tokens": n, "cache_salt": s or null}``.
Engines run one after another in this process, each a new ``vllm.LLM`` (its own prefix cache), with the
KVPoolConnector when ``kvpool`` is set and without a connector otherwise. Greedy sampling.

``{"stepped": {"running": REQUEST, "hits": [REQUEST, ...], "abort": [id, ...], "gate_steps": n}}`` drives
vLLM's engine step by step (``LLMEngine.add_request`` / ``step``, the engine core in this process): the
running request starts and decodes, then the hits arrive while the kvpool worker's reads of their blocks are
held at a gate (standing in for a slow pool: ``PoolWorker.fetch`` waits, nothing else changes). After each
step the driver reads each hit's status from vLLM's scheduler. The gate opens once the running request has
produced a token in ``gate_steps`` steps during which every hit was ``WAITING_FOR_REMOTE_KVS`` (or after
400 steps), the ``abort`` requests being aborted just before; then every request runs to its end and the
engine steps until vLLM's scheduler holds no request. Reported: ``{"engine", "stepped": {"timeline": [per
step: hit statuses and the running request's new tokens], "overlap_steps", "left_requests", "free_blocks":
[before, after]}}``, and each request's result as below.

Prints one JSON object a line, each prefixed ``KVPOOL-TEST``: ``{"engine", "id", "tokens", "cached"}`` per
request (``cached``: prompt tokens vLLM did not compute: its own hits plus the pool's), ``{"engine",
"metrics"}`` after an engine's requests (vLLM's ``vllm:kvpool_*`` counters and prefix-cache counters),
``{"engine", "refused"}`` if the engine would not start, and ``{"paused": name}`` before waiting for a line
on stdin (the test does something to the pool meanwhile).
"""

from __future__ import annotations

import gc
import json
import sys
from typing import Any

PREFIX = "KVPOOL-TEST "


def say(**fields: Any) -> None:
    print(PREFIX + json.dumps(fields), flush=True)


def engine(model: str, block_size: int, extra: dict[str, Any] | None, events: dict[str, str] | None = None,
           kv_transfer: dict[str, Any] | None = None) -> Any:
    from vllm import LLM
    from vllm.config import KVEventsConfig, KVTransferConfig

    kv = None
    if kv_transfer is not None:  # another connector's whole config (vLLM's OffloadingConnector)
        kv = KVTransferConfig(**kv_transfer)
    elif extra is not None:
        kv = KVTransferConfig(kv_connector="KVPoolConnector", kv_connector_module_path="kvpool.engines.vllm",
                              kv_role="kv_both", kv_connector_extra_config=extra)
    kv_events = None if events is None else KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", **events)
    return LLM(model=model, skip_tokenizer_init=True, block_size=block_size, dtype="float32", max_model_len=4096,
               enforce_eager=True, disable_log_stats=False, kv_transfer_config=kv, seed=0, kv_events_config=kv_events)


def metrics(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith(("vllm:kvpool_", "vllm:prefix_cache", "vllm:external_prefix_cache")):
            value = getattr(m, "value", None)
            if isinstance(value, (int, float)):
                out[m.name] = out.get(m.name, 0.0) + float(value)
    return out


def prompt_of(req: dict[str, Any]) -> Any:
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=req["prompt"])
    if req.get("cache_salt"):
        prompt["cache_salt"] = req["cache_salt"]
    return prompt


def params_of(req: dict[str, Any]) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=req.get("max_tokens", 8), temperature=0.0, detokenize=False)


def stepped(name: str, llm: Any, spec: dict[str, Any]) -> None:
    """The ``stepped`` scenario of the module docstring."""
    import threading
    import time

    from kvpool.engines.vllm import worker as kvworker

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    gate = threading.Event()
    held: set[str] = set()  # vLLM's ids of the requests whose reads wait at the gate
    fetch = kvworker.PoolWorker.fetch

    def gated_fetch(self: Any, job: Any, blocks: Any) -> Any:
        if job.req_id in held:
            gate.wait(300)
        return fetch(self, job, blocks)

    kvworker.PoolWorker.fetch = gated_fetch  # type: ignore[method-assign]
    ids: dict[str, str] = {}  # our id -> vLLM's
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}

    def add(req: dict[str, Any]) -> str:
        ids[req["id"]] = engine.add_request(req["id"], prompt_of(req), params_of(req))
        return ids[req["id"]]

    def step() -> None:
        for out in engine.step():
            rid = out.request_id if out.request_id in ids else next(k for k, v in ids.items() if v == out.request_id)
            tokens[rid] = list(out.outputs[0].token_ids)
            if out.finished:
                cached[rid] = out.num_cached_tokens or 0

    running, hits = spec["running"], spec["hits"]
    try:
        add(running)
        while len(tokens.get(running["id"], [])) < 2:
            step()
        for req in hits:
            held.add(add(req))
        timeline, overlap, steps = [], 0, 0
        while not gate.is_set():
            before = len(tokens.get(running["id"], []))
            step()
            steps += 1
            statuses = {r["id"]: scheduler.requests[ids[r["id"]]].status.name if ids[r["id"]] in scheduler.requests
                        else "GONE" for r in hits}
            gained = len(tokens.get(running["id"], [])) - before
            timeline.append({"statuses": statuses, "running_new_tokens": gained})
            if gained and all(v == "WAITING_FOR_REMOTE_KVS" for v in statuses.values()):
                overlap += 1
            if overlap >= spec.get("gate_steps", 3) or steps >= 400 or running["id"] in cached:
                if spec.get("abort"):
                    engine.abort_request(list(spec["abort"]))
                gate.set()
        deadline = time.monotonic() + 120
        while scheduler.has_requests() and time.monotonic() < deadline:
            step()
    finally:
        gate.set()
        kvworker.PoolWorker.fetch = fetch  # type: ignore[method-assign]
    for req in [running, *hits]:
        if req["id"] in cached:
            say(engine=name, id=req["id"], tokens=tokens.get(req["id"], []), cached=cached[req["id"]])
    say(engine=name, stepped={"timeline": timeline, "overlap_steps": overlap, "left_requests": len(scheduler.requests),
                              "free_blocks": [free_before, pool.get_num_free_blocks()]})


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    for eng in spec["engines"]:
        name = eng["name"]
        try:
            llm = engine(spec["model"], spec.get("block_size", 32), eng.get("kvpool"), eng.get("vllm_kv_events"),
                         eng.get("kv_transfer_config"))
        except Exception as exc:  # noqa: BLE001 - a refusal to start is what the test looks at
            say(engine=name, refused=f"{type(exc).__name__}: {exc}")
            continue
        for req in eng["requests"]:
            if "pause" in req:
                say(paused=req["pause"])
                sys.stdin.readline()
                continue
            if "stepped" in req:
                stepped(name, llm, req["stepped"])
                continue
            out = llm.generate([prompt_of(req)], params_of(req), use_tqdm=False)[0]
            say(engine=name, id=req["id"], tokens=list(out.outputs[0].token_ids), cached=out.num_cached_tokens or 0)
        say(engine=name, metrics=metrics(llm))
        del llm
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
