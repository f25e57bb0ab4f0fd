"""``benchmarks/vllm_ttft.py``'s batch rows: what one request's pool load costs the requests already decoding.

Driven step by step inside one vLLM process (``LLMEngine.add_request`` /
``step``, the engine core in the process; :func:`drive`): ``running``
requests (short prompts, decoding without end) reach their decode phase,
then, one at a time, each hit prompt (its prefix in the pool) arrives with
``max_tokens=1``. Before each hit, ``settle`` steps with no hit in flight
are the baseline. Every step's wall time is one inter-token latency of
every running request (each gets one token a step). For each hit, the steps
are told apart by what vLLM's own scheduler says of the hit after the step:

- *window*: the hit is ``WAITING_FOR_REMOTE_KVS`` (async loads: its blocks
  load in the background meanwhile; the first such step is the one that
  allocated its blocks, whose load starts after its forward);
- *hit step*: the step in which it got its first token (sync loads: its
  load, before the forward, and its last block's prefill; async: the
  prefill only).

:func:`summarize` gives, per load mode, medians over the hits: baseline
ITL, window ITL (median and max over the window's steps), hit-step ITL,
the hit's TTFT (vLLM's ``first_token_latency``) and the connector's load
time. Nothing here imports vllm at module level: the driver side runs in
the vLLM Python (:mod:`vllm_ttft`'s ``--driver``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

WAITING = "WAITING_FOR_REMOTE_KVS"


def drive(llm: Any, prompts: list[list[int]], running: list[int], hits: list[int], settle: int,
          counters: Any) -> list[dict[str, Any]]:
    """Run the scenario of the module docstring on ``llm``; one record per hit prompt (``counters()``: vLLM's
    connector counters now, for the load time)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    forever = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True, detokenize=False)
    once = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    produced: dict[str, int] = {}
    firsts: dict[str, Any] = {}

    def step() -> float:
        start = time.perf_counter()
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished and out.metrics is not None:
                firsts[out.request_id] = out
        return time.perf_counter() - start

    run_ids = [f"run-{i}" for i in running]
    for rid, i in zip(run_ids, running):
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompts[i]), forever)
    while min(produced.get(r, 0) for r in run_ids) < 3:
        step()
    records = []
    for i in hits:
        baseline = [step() for _ in range(settle)]
        hid = f"hit-{i}"
        before = counters()
        internal = engine.add_request(hid, TokensPrompt(prompt_token_ids=prompts[i]), once)
        window, hit_step, steps = [], 0.0, 0
        while hid not in firsts:
            took = step()
            steps += 1
            request = scheduler.requests.get(internal)
            if request is not None and request.status.name == WAITING:
                window.append(took)
            elif hid in firsts:
                hit_step = took
            if steps > 10_000:
                raise RuntimeError(f"vllm_ttft: hit {i} got no first token in {steps} steps")
        after = counters()
        out = firsts[hid]
        records.append({"prompt": i, "baseline_s": baseline, "window_s": window, "hit_step_s": hit_step,
                        "ttft_s": float(out.metrics.first_token_latency), "cached": int(out.num_cached_tokens or 0),
                        "load_s": after.get("vllm:kvpool_load_seconds", 0.0)
                        - before.get("vllm:kvpool_load_seconds", 0.0),
                        "loaded_blocks": after.get("vllm:kvpool_loaded_blocks", 0.0)
                        - before.get("vllm:kvpool_loaded_blocks", 0.0)})
    engine.abort_request(run_ids)
    while scheduler.has_requests():
        step()
    return records


def summarize(records: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over one mode's hits (seconds; see the module docstring)."""
    def med(values: list[float]) -> float:
        return statistics.median(values) if values else 0.0

    return {"baseline": med([med(r["baseline_s"]) for r in records]),
            "window": med([med(r["window_s"]) for r in records]),
            "window_max": med([max(r["window_s"], default=0.0) for r in records]),
            "window_steps": med([len(r["window_s"]) for r in records]),
            "hit_step": med([r["hit_step_s"] for r in records]),
            "ttft": med([r["ttft_s"] for r in records]),
            "load": med([r["load_s"] for r in records]),
            "hits": len(records)}


def render(by_mode: dict[str, dict[str, float]], running: int) -> list[str]:
    """The batch rows as the table docs/benchmarks.md shows (ms)."""
    lines = [f"{running} requests decoding when each hit arrives (medians over the hits; ITL = one step's wall time):",
             "",
             "| load mode | baseline ITL ms | ITL during the load ms (median / max, steps) | ITL of the hit's step ms "
             "| hit TTFT ms | connector load ms |",
             "|---|---:|---:|---:|---:|---:|"]
    for mode, s in by_mode.items():
        window = (f"{s['window'] * 1e3:.1f} / {s['window_max'] * 1e3:.1f} ({s['window_steps']:.0f})"
                  if s["window_steps"] else "(none: in the hit's step)")
        lines.append(f"| {mode} | {s['baseline'] * 1e3:.1f} | {window} | {s['hit_step'] * 1e3:.1f} | "
                     f"{s['ttft'] * 1e3:.1f} | {s['load'] * 1e3:.1f} |")
    return lines
