"""What kvpool adds behind vLLM's own CPU offloading tier, beside the KVPoolConnector, in the real vLLM here.

    bash tests/vllm_env.sh                                     # once: build/vllm-venv
    .venv/bin/python benchmarks/vllm_offload_tier.py [--prompts 3] [--keep]     # ~3 min here

Model, prompts and engine as ``benchmarks/vllm_ttft.py``: Qwen2-0.5B's shape with vLLM's dummy
weights, ``--prompt-tokens`` (2,048) random token ids, ``max_tokens=1``, blocks of 32 tokens (one block across
all layers: 768 KiB in float32), OpenMP on cores 0-1, in-process engine core, TTFT vLLM's own
(``first_token_latency``); one ``kvpool serve`` this script starts. Five vLLM processes, one after another, each
serving a warm-up prompt ``W`` first:

1. tier fill: vLLM's ``OffloadingConnector`` with ``TieringOffloadingSpec`` and kvpool's tier (the extra config
   docs/engines/vllm.md gives), each ``Pi`` cold: its chunks go to vLLM's CPU tier and on to the pool. vLLM's
   CUDA-only offloading worker is stood in (``CpuStandInTieringSpec``, tests/vllm_offload_standins.py: the same
   block copies between vLLM's KV cache and the CPU tier, on CPU tensors). The process exits.
2. tier hit, a fresh process (its CPU tier empty): each ``Pi`` served from the pool through the tier
   (``tier``: one scheduler step for the lookup, the promotion into the CPU tier, then the worker's copy), then
   again (``own``: vLLM's own prefix-cache hit, the ceiling), then, after ``reset_prefix_cache()`` (vLLM's
   prefix cache only; the connector's CPU tier is kept), once more (``cpu_tier``: a hit in vLLM's own CPU tier,
   what vLLM's offloading does without kvpool).
3. tier hit again, a fresh process, with ``kvpool_switch_interval_us: 0`` (Python's own 5 ms GIL switch interval
   while the tier's jobs run, instead of 0.2 ms): ``tier_py``, then ``own_py``.
4. connector fill and 5. connector hit: ``KVPoolConnector`` the same way (``connector``: a fresh process
   loads the prefix from the pool's DRAM, then ``own_after_connector``).

Checks before numbers: every hit row reused 2,016 tokens; ``tier`` rows loaded all 63 chunks from the pool
(``vllm:kvpool_tier_loaded_blocks``) and ``cpu_tier`` rows none; ``connector`` rows loaded 63 blocks with no
errors. Reported: medians, and per hit row, over the prompts, the median of TTFT / and - the ``own`` hit of the
same prompt in the same process (``paired``): what each path adds to vLLM's own hit. The part the tier adds
(pool -> CPU tier) is host-side work that a GPU deployment does the same way; the stand-in's copies into vLLM's
KV cache are what a GPU's copy engine does there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
TIER = {"type": "KVPoolSecondaryTier", "module_path": "kvpool.engines.vllm.offload_tier"}
STANDIN = {"spec_name": "CpuStandInTieringSpec", "spec_module_path": "vllm_offload_standins"}
LABELS = {"cold": "cold prefill, tier on", "own": "vLLM's own prefix-cache hit (ceiling)",
          "cpu_tier": "vLLM's CPU tier hit (its offloading alone)",
          "tier": "kvpool tier hit, fresh process (pool -> CPU tier -> KV cache)",
          "tier_py": "the same, Python's own 5 ms switch interval (kvpool_switch_interval_us 0)",
          "connector_cold": "cold prefill, connector on",
          "connector": "KVPoolConnector hit, fresh process (pool -> KV cache)"}
PAIRED = {"tier": "own", "cpu_tier": "own", "tier_py": "own_py", "connector": "own_after_connector"}


# -- the vLLM side ----------------------------------------------------------------------------------------


_TRACE: dict[str, float] = {}


def _trace_tier() -> None:
    """Time (never change) the tier's parts in this process: a load job, and in it the pool lookup and the pool
    read into the CPU tier's rows. Totals in seconds go to ``_TRACE``, read per request like the counters."""
    import functools

    import vllm_ttft

    from kvpool.client.pool import PoolClient
    from kvpool.engines.vllm.offload_jobs import TierJobs

    timed = functools.partial(vllm_ttft.timed, _TRACE)

    PoolClient.lookup = timed("lookup", PoolClient.lookup)  # type: ignore[method-assign]
    PoolClient.get_into = timed("read", PoolClient.get_into)  # type: ignore[method-assign]
    TierJobs._load = timed("load_job", TierJobs._load)  # type: ignore[method-assign]


def driver(spec_path: str) -> int:
    """One vLLM process: its requests (``[case, prompt]``, or ``["reset", -1]``), results to ``spec["result"]``."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from vllm_ttft import counters

    spec = json.loads(Path(spec_path).read_text())
    prompts = json.loads(Path(spec["prompts"]).read_text())
    tokens = spec["prompt_tokens"]
    _trace_tier()
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, block_size=32, dtype=spec["dtype"], load_format="dummy",
              enforce_eager=True, disable_log_stats=False, max_model_len=tokens + 64,
              max_num_batched_tokens=max(tokens + 64, 2048), max_num_seqs=4, seed=0,
              kv_transfer_config=KVTransferConfig(**spec["kv_transfer_config"]))
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    results = []
    for case, index in spec["requests"]:
        if case == "reset":
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM did not reset its prefix cache")
            continue
        before = dict(counters(), **{f"trace:{k}": v for k, v in _TRACE.items()})
        out = llm.generate([TokensPrompt(prompt_token_ids=prompts[index])], params, use_tqdm=False)[0]
        after = dict(counters(), **{f"trace:{k}": v for k, v in _TRACE.items()})
        if out.metrics is None or not out.metrics.first_token_latency:
            raise RuntimeError("vLLM returned no request metrics (disable_log_stats must be False)")
        grown = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
        results.append({"case": case, "prompt": index, "ttft_s": float(out.metrics.first_token_latency),
                        "cached": int(out.num_cached_tokens or 0), "metrics": grown})
    Path(spec["result"]).write_text(json.dumps(results))
    llm.llm_engine.engine_core.shutdown()  # the tier's queued stores finish (or time out) here
    sys.stderr.flush()
    os._exit(0)  # as vllm_ttft.py's driver: no interpreter teardown


# -- this side --------------------------------------------------------------------------------------------


def phase(python: str, env: dict[str, str], work: Path, name: str, kv: dict[str, Any],
          requests: list[tuple[str, int]], base: dict[str, Any]) -> list[dict[str, Any]]:
    spec = dict(base, kv_transfer_config=kv, requests=requests, result=str(work / f"{name}.result.json"))
    (work / f"{name}.spec.json").write_text(json.dumps(spec))
    print(f"{name}: a vLLM process, {len([r for r in requests if r[0] != 'reset'])} requests", flush=True)
    start = time.monotonic()
    with open(work / f"{name}.log", "wb") as log:
        done = subprocess.run([python, str(Path(__file__).resolve()), "--driver", str(work / f"{name}.spec.json")],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{name} exited {done.returncode}:\n{(work / f'{name}.log').read_text()[-4000:]}")
    print(f"{name}: done in {time.monotonic() - start:.0f} s", flush=True)
    return json.loads((work / f"{name}.result.json").read_text())


def check(results: list[dict[str, Any]], hit_tokens: int, blocks: int) -> None:
    for r in results:
        if r["case"] in ("warmup", "flush"):
            continue
        cold = r["case"] in ("cold", "connector_cold")
        if r["cached"] != (0 if cold else hit_tokens):
            raise RuntimeError(f"{r['case']} of prompt {r['prompt']}: {r['cached']} tokens cached")
        m = r["metrics"]
        tier = m.get("vllm:kvpool_tier_loaded_blocks", 0)
        if (r["case"] in ("tier", "tier_py") and tier != blocks) or (r["case"] == "cpu_tier" and tier != 0):
            raise RuntimeError(f"{r['case']} of prompt {r['prompt']}: {tier:.0f} chunks loaded from the pool")
        if r["case"] == "connector" and (m.get("vllm:kvpool_loaded_blocks", 0), m.get("vllm:kvpool_load_errors", 0)) \
                != (blocks, 0):
            raise RuntimeError(f"connector of prompt {r['prompt']}: {m}")


PARTS = {"lookup ms": "trace:lookup_s", "pool read ms": "trace:read_s", "load job ms": "trace:load_job_s",
         "connector load ms": "vllm:kvpool_load_seconds"}


def summarize(results: list[dict[str, Any]]) -> str:
    """The table docs/benchmarks.md shows: medians, paired ratio and +ms, and the traced parts (medians)."""
    by_case: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        if r["case"] not in ("warmup", "flush"):
            by_case.setdefault(r["case"], []).append(r)
    lines = ["| case | TTFT ms median | min | max | paired / own | paired +ms | " + " | ".join(PARTS) + " |",
             "|---|" + "---:|" * (5 + len(PARTS))]
    for case, label in LABELS.items():
        rs = by_case.get(case)
        if not rs:
            continue
        ttft = [r["ttft_s"] * 1e3 for r in rs]
        ratio = plus = ""
        if case in PAIRED:
            own = {r["prompt"]: r["ttft_s"] * 1e3 for r in by_case[PAIRED[case]]}
            pairs = [(r["ttft_s"] * 1e3, own[r["prompt"]]) for r in rs]
            ratio = f"{statistics.median(t / o for t, o in pairs):.2f}"
            plus = f"{statistics.median(t - o for t, o in pairs):.1f}"
        parts = []
        for name in PARTS.values():
            values = [r["metrics"].get(name, 0.0) * 1e3 for r in rs]
            parts.append(f"{statistics.median(values):.1f}" if any(values) else "")
        lines.append(f"| {label} | {statistics.median(ttft):.1f} | {min(ttft):.1f} | {max(ttft):.1f} | {ratio} "
                     f"| {plus} | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=2047,
                        help="2,047: 63 full blocks, so every hit row reuses 2,016 tokens and computes 31 "
                             "(vLLM's offloading would load a 64th block of a 2,048-token prompt, own hits do not)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, specs, results)")
    parser.add_argument("--driver", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.driver:
        return driver(args.driver)

    import numpy as np
    from local_pool import LocalPool
    from vllm_runtime import MODELS, save_model, vllm_env, vllm_python
    from vllm_ttft import DTYPE_BYTES, MODEL, cpu_dtype

    python = vllm_python()
    if python is None:
        raise SystemExit("no Python with vLLM: run `bash tests/vllm_env.sh`")
    python = str(Path(python).absolute())
    dtype = cpu_dtype()
    shape = MODELS[MODEL]
    layers, kv_heads = int(shape["num_hidden_layers"]), int(shape["num_key_value_heads"])  # type: ignore[call-overload]
    head_dim = int(shape["hidden_size"]) // int(shape["num_attention_heads"])  # type: ignore[call-overload]
    block_bytes = layers * 2 * kv_heads * head_dim * 32 * DTYPE_BYTES[dtype]
    blocks = (args.prompt_tokens - 1) // 32  # what a hit reuses (vLLM computes at least the last token)
    chunks = (args.prompts + 1) * (blocks + 1)
    work = Path(tempfile.mkdtemp(prefix="kvpool-bench-offload-tier-"))
    env = vllm_env(python, in_process=True)
    env.update(VLLM_LOGGING_LEVEL="WARNING", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p))
    try:
        save_model(work / "model", MODEL)
        rng = np.random.default_rng(0)
        vocab = int(shape["vocab_size"])  # type: ignore[call-overload]
        flush = args.prompts + 1  # a short prompt served last in a fill: the engine steps once more, so the last
        # prompt's chunks reach vLLM's CPU tier and the pool (offline, vLLM stops stepping when generate returns)
        (work / "prompts.json").write_text(json.dumps(
            [rng.integers(0, vocab, args.prompt_tokens).tolist() for _ in range(args.prompts + 1)] + [[1, 2, 3]]))
        base = {"model": str(work / "model"), "prompts": str(work / "prompts.json"),
                "prompt_tokens": args.prompt_tokens, "dtype": dtype}
        measured = range(1, args.prompts + 1)
        results: list[dict[str, Any]] = []
        with LocalPool(dram_bytes=3 * chunks * block_bytes, max_block_bytes=block_bytes,
                       ssd_bytes=4 << 30) as pool:
            config = work / "kvpool.json"
            config.write_text(json.dumps({"client": {"master": pool.address}}))
            extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 2 * chunks * block_bytes,
                     "secondary_tiers": [{**TIER, "kvpool_config_path": str(config), "kvpool_strict": True}]}

            def offloading(engine: str, **tier: Any) -> dict[str, Any]:
                tiers = [{**extra["secondary_tiers"][0], **tier}]
                return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "engine_id": engine,
                        "kv_connector_extra_config": {**extra, "secondary_tiers": tiers, **STANDIN}}

            connector = {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.engines.vllm",
                         "kv_role": "kv_both",
                         "kv_connector_extra_config": {"kvpool_config_path": str(config), "kvpool_strict": True}}
            tier_hits: list[tuple[str, int]] = [("warmup", 0)]
            for i in measured:
                tier_hits += [("tier", i), ("own", i), ("reset", -1), ("cpu_tier", i)]
            for name, kv, requests in [
                ("tier-fill", offloading(f"fill-{work.name}"),
                 [("warmup", 0)] + [("cold", i) for i in measured] + [("flush", flush)]),
                ("tier-hit", offloading(f"hit-{work.name}"), tier_hits),
                ("tier-hit-5ms", offloading(f"hit5-{work.name}", kvpool_switch_interval_us=0),
                 [("warmup", 0)] + [r for i in measured for r in (("tier_py", i), ("own_py", i))]),
                ("connector-fill", connector,
                 [("warmup", 0)] + [("connector_cold", i) for i in measured] + [("flush", flush)]),
                ("connector-hit", connector,
                 [("warmup", 0)] + [r for i in measured for r in (("connector", i), ("own_after_connector", i))]),
            ]:
                done = phase(python, env, work, name, kv, requests, base)
                check(done, blocks * 32, blocks)  # blocks: the prompt's full blocks
                results += done
        (work / "results.json").write_text(json.dumps(results))
        print(f"\nmodel {MODEL} shape, dummy weights, {dtype}, prompt {args.prompt_tokens} tokens, blocks of 32 "
              f"({block_bytes // 1024} KiB), {args.prompts} prompts, max_tokens 1\n")
        print(summarize(results))
    finally:
        if args.keep:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
