"""Runs the real vLLM for tests/test_engine_vllm.py: ``<vllm python> tests/vllm_driver.py SPEC.json``.

SPEC: ``{"model": dir, "block_size": 32, "engines": [{"name": ..., "kvpool": extra-config or null,
"vllm_kv_events": {"endpoint": ..., "replay_endpoint": ...} (optional: vLLM's own KV event publisher),
"kv_transfer_config": a whole KVTransferConfig (optional: another connector instead of kvpool's),
"requests": [{"id": ..., "prompt": [token ids], "max_tokens": n, "cache_salt": s or null} | {"pause": name}]}]}``.
Engines run one after another in this process, each a new ``vllm.LLM`` (its own prefix cache), with the
KVPoolConnector when ``kvpool`` is set and without a connector otherwise. Greedy sampling.

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


def main() -> int:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

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
            params = SamplingParams(max_tokens=req.get("max_tokens", 8), temperature=0.0, detokenize=False)
            prompt = TokensPrompt(prompt_token_ids=req["prompt"])
            if req.get("cache_salt"):
                prompt["cache_salt"] = req["cache_salt"]
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            say(engine=name, id=req["id"], tokens=list(out.outputs[0].token_ids), cached=out.num_cached_tokens or 0)
        say(engine=name, metrics=metrics(llm))
        del llm
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
