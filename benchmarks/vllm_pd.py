"""``benchmarks/vllm_ttft.py``'s 1P1D phase: a prefill and a decode vLLM instance hand each prompt off through the pool.

Two vLLM processes alive at once (:class:`vllm_engine.EngineProcess`, in-process engine cores),
both with the ``KVPoolConnector`` on the bench's pool: the prefill instance (``kv_role: kv_producer``) and the
decode instance (``kv_consumer``). This process plays the proxy with :mod:`kvpool.engines.vllm.pd_proxy`'s
bodies. Prompts of their own (none of them is in the pool or either vLLM's cache before), the first a warm-up
through the whole flow; for each:

- ``pd_cold``: the prompt to the prefill instance with ``max_tokens=1``: its cold prefill, which stores every
  full block of the prompt;
- ``pd_decode``: the moment that reply is back, the prompt to the decode instance with the
  ``kv_transfer_params`` it carried (``max_tokens=1``): the decode TTFT from the hand-off, vLLM's
  ``first_token_latency`` from the decode request's arrival, with any wait for the producer's blocks, their
  load and the last block's forward inside it;
- ``own_after_pd``: the same prompt to the decode instance again: vLLM's own prefix-cache hit in the same
  process, the colocated own hit ``pd_decode`` is paired with.

Checked before it is a number: every ``pd_decode`` loaded all its blocks from the pool's DRAM with no load
error and no time-out of its wait, and the prefill instance's hand-offs were all confirmed by the pool.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

from vllm_engine import EngineProcess

from kvpool.engines.vllm.pd_proxy import decode_body, prefill_body

START_S = 900.0
REQUEST_S = 900.0


class Runner(Protocol):
    """What this phase takes of ``vllm_ttft._Runner``."""

    args: Any
    python: str
    work: Any
    env: dict[str, str]

    def progress(self, text: str) -> None: ...


def pd_phase(runner: Runner, kvpool_config: str, prompt_indexes: Sequence[int]) -> list[Any]:
    """The phase of the module docstring over ``prompt_indexes`` (the first is the warm-up); its requests."""
    from vllm_ttft import Request

    args = runner.args
    prompts = json.loads((runner.work / "prompts.json").read_text())
    env = dict(runner.env, VLLM_ENABLE_V1_MULTIPROCESSING="0")  # the engine processes step their engine core
    base = {"model": str(runner.work / "model"), "dtype": args.dtype, "block_size": args.block_size,
            "load_format": "dummy", "max_model_len": args.prompt_tokens + 64,
            "max_num_batched_tokens": max(args.prompt_tokens + 64, 2048), "max_num_seqs": 4,
            "kvpool": {"kvpool_config_path": kvpool_config, "kvpool_strict": True}}
    runner.progress(f"kvpool 1P1D: a prefill and a decode vLLM process, {len(prompt_indexes)} hand-offs")
    prefill = EngineProcess(runner.python, dict(base, kv_role="kv_producer"), runner.work, "pd-prefill", env)
    decode = EngineProcess(runner.python, dict(base, kv_role="kv_consumer"), runner.work, "pd-decode", env)
    requests = []
    try:
        prefill.expect("ready", START_S)
        decode.expect("ready", START_S)
        for n, index in enumerate(prompt_indexes):
            tokens = prompts[index]
            body = {"prompt": tokens, "max_tokens": 1}
            to_prefill = prefill_body(body)
            p = prefill.generate(f"p{index}", tokens, to_prefill["max_tokens"], timeout=REQUEST_S,
                                 kv_transfer_params=to_prefill["kv_transfer_params"])
            to_decode = decode_body(body, p)
            d = decode.generate(f"d{index}", tokens, to_decode["max_tokens"], timeout=REQUEST_S,
                                kv_transfer_params=to_decode["kv_transfer_params"])
            again = decode.generate(f"o{index}", tokens, 1, timeout=REQUEST_S)
            for case, event in (("pd_cold", p), ("pd_decode", d), ("own_after_pd", again)):
                requests.append(Request("warmup" if n == 0 else case, index, event["ttft_s"], event["cached"],
                                        event["wall_s"], event["queued_to_scheduled_s"],
                                        event["scheduled_to_first_token_s"], event["counters"]))
            _check_handoff(d, args.prompt_tokens, args.block_size, index)
        if not prefill.drain():
            raise RuntimeError("vllm_ttft: the prefill instance still holds requests after its hand-offs")
        counters = prefill.counters()
        handed = (counters.get("vllm:kvpool_handoffs", 0), counters.get("vllm:kvpool_handoff_faults", 0))
        if handed != (len(prompt_indexes), 0):
            raise RuntimeError(f"vllm_ttft: the pool confirmed {handed[0]:.0f} of {len(prompt_indexes)} hand-offs "
                               f"({handed[1]:.0f} released unconfirmed)")
    finally:
        codes = [prefill.close(), decode.close()]
    if codes != [0, 0]:
        raise RuntimeError(f"vllm_ttft: the 1P1D processes exited with {codes}; logs {prefill.log_path}, "
                           f"{decode.log_path}")
    runner.progress("kvpool 1P1D: done")
    return requests


def _check_handoff(decoded: dict[str, Any], prompt_tokens: int, block_size: int, index: int) -> None:
    """The decode instance loaded every block of the hand-off from DRAM (RuntimeError naming what it did not)."""
    blocks = (prompt_tokens - 1) // block_size
    m = decoded["counters"]
    got = (m.get("vllm:kvpool_hit_blocks_dram", 0), m.get("vllm:kvpool_loaded_blocks", 0),
           m.get("vllm:kvpool_load_errors", 0), m.get("vllm:kvpool_handoff_timeouts", 0))
    if got != (blocks, blocks, 0, 0):
        raise RuntimeError(f"vllm_ttft: the decode instance's hand-off of prompt {index} found {got[0]:.0f} blocks "
                           f"in DRAM, loaded {got[1]:.0f} with {got[2]:.0f} errors and {got[3]:.0f} time-outs; "
                           f"expected all {blocks}")
