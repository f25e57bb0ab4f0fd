"""MindIE's MemPool backend (kvpool.engines.mindie) against a real `kvpool serve` on loopback.

Paged caches are real CPU torch tensors shaped like MindIE's
(``npu_cache[layer][k_or_v]`` = ``[num_blocks, block_size, heads, head_dim]``);
a block goes in from one worker and comes out into another's cache.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

import numpy as np
import pytest

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")

from support import PoolProcesses, free_port

from kvpool.client.kvclient import KVCacheClient
from kvpool.config import load_config
from kvpool.engines.mindie import KVPoolMempool, create_pool
from kvpool.keys import opaque_key
from kvpool.layout import KVLayout

LAYOUT = KVLayout("bfloat16", num_layers=3, num_kv_heads=2, head_dim=16, block_size=16)  # 1 KiB a piece, 6 KiB a block
NUM_BLOCKS = 12
MODEL = "qwen2-test"


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    procs = PoolProcesses(tmp_path_factory.mktemp("mindie-pool"), **{"dram-bytes": "4M", "max-block-bytes": "8K"})
    procs.serve()
    yield procs
    procs.close()
    procs.assert_stopped_cleanly()


def write_config(path, master: str, layout: KVLayout | None = LAYOUT, **client) -> str:
    section = {"master": master, "model": MODEL, "lookup_timeout_s": 2.0, "io_timeout_s": 5.0, **client}
    if layout is not None:
        section["layout"] = layout.to_dict()
    path.write_text(json.dumps({"client": section}))
    return str(path)


@pytest.fixture
def config(pool, tmp_path) -> str:
    return write_config(tmp_path / "kvpool.json", pool.master)


def paged_cache(seed: int | None) -> list[list[torch.Tensor]]:
    """MindIE's npu_cache on CPU: per layer [K, V], each [num_blocks, *piece_shape]; zeros if seed is None."""
    gen = torch.Generator().manual_seed(seed or 0)
    shape = (NUM_BLOCKS, *LAYOUT.piece_shape)

    def one() -> torch.Tensor:
        if seed is None:
            return torch.zeros(shape, dtype=torch.bfloat16)
        return torch.randn(shape, generator=gen).to(torch.bfloat16)

    return [[one(), one()] for _ in range(LAYOUT.num_layers)]


def blocks(cache, block_ids) -> list[list[list[torch.Tensor]]]:
    """The plugin's ``tensors`` argument: [N][num_layers][2] views of the paged cache."""
    return [[[cache[layer][0][b], cache[layer][1][b]] for layer in range(LAYOUT.num_layers)] for b in block_ids]


def block_bytes(cache, b: int) -> bytes:
    """Block ``b`` in layer_kv byte order: layer 0 K, layer 0 V, layer 1 K, ..."""
    return b"".join(cache[layer][kv][b].reshape(-1).view(torch.uint8).numpy().tobytes()
                    for layer in range(LAYOUT.num_layers) for kv in (0, 1))


def mindie_keys(tag: str, n: int, tp_rank: int = 0, tp_size: int = 1) -> list[str]:
    """Keys as the prefix-cache plugin builds them: "{prefix_hash}_{tp_rank}_{tp_size}_{model_name}"."""
    hashes = [int.from_bytes(hashlib.sha256(f"{tag}-{i}".encode()).digest()[:8], "little") for i in range(n)]
    return [f"{h}_{tp_rank}_{tp_size}_{MODEL}" for h in hashes]


def indexed(pool: PoolProcesses) -> int:
    return pool.status().indexed_blocks


def test_a_block_put_by_one_worker_is_read_byte_exact_by_another(config):
    source, target = paged_cache(seed=1), paged_cache(seed=None)
    keys = mindie_keys("exact", 3)
    writer = create_pool("kvpool", config, "worker", device_id=0, kv_caches=source)
    reader = create_pool("kvpool", config, "worker", device_id=1, kv_caches=target)
    try:
        assert writer.put(keys, blocks(source, [7, 2, 9])) == [True, True, True]
        assert writer.flush(timeout=10)
        assert reader.get(keys, blocks(target, [0, 1, 2])) == [True, True, True]
        for src, dst in zip([7, 2, 9], [0, 1, 2]):
            assert block_bytes(target, dst) == block_bytes(source, src)
        assert all(block_bytes(target, b) == bytes(LAYOUT.block_bytes) for b in range(3, NUM_BLOCKS))
        # In the pool a block is one buffer in the layout's byte order (what other adapters read).
        with KVCacheClient(load_config(config).client) as raw:
            out = np.zeros(LAYOUT.block_bytes, np.uint8)
            ns = raw.namespace()
            assert raw.get([opaque_key(keys[1], ns)], [out]) == 1
            assert out.tobytes() == block_bytes(source, 2)
        assert writer.stats["put_accepted"] == 3 and reader.stats["get_hits"] == 3
    finally:
        writer.close()
        reader.close()


def test_the_scheduler_agrees_on_what_exists_and_holds_no_data_memory(config):
    cache = paged_cache(seed=2)
    keys = mindie_keys("sched", 2)
    with_role = KVPoolMempool(config, "worker", kv_caches=cache)
    scheduler = create_pool("kvpool", config, "scheduler")
    try:
        assert scheduler.batch_exist(keys) == [False, False]
        assert with_role.put(keys, blocks(cache, [4, 5])) == [True, True]
        assert with_role.flush(timeout=10)
        assert scheduler.batch_exist(keys + mindie_keys("never", 1)) == [True, True, False]
        assert scheduler.exists(keys[0]) is True
        assert scheduler.exists(mindie_keys("never", 1)[0]) is False
        assert with_role.batch_exist(keys) == [True, True]
        # No data memory: no HBM tier, no staging buffer, no shared-memory mapping; put/get answer False.
        assert scheduler.session.client.hbm is None and not scheduler.session.client.config.shared_memory
        assert scheduler.session.put_stager is None and scheduler.session.get_stager is None
        assert scheduler.put(keys, blocks(cache, [4, 5])) == [False, False]
        assert scheduler.get(keys, blocks(cache, [4, 5])) == [False, False]
        assert with_role.session.put_stager.allocated_bytes > 0  # the worker's, by contrast, was used
    finally:
        with_role.close()
        scheduler.close()


def test_get_fills_only_hits_reports_each_key_and_works_across_staging_chunks(config):
    source, target = paged_cache(seed=3), paged_cache(seed=None)
    keys = mindie_keys("chunks", 6)
    stored = [0, 1, 3, 5]  # 2 and 4 are never put
    # Staging of three blocks: the put takes two chunks; the get's first chunk (0, 1, 2) ends in a miss,
    # then one exists call finds 3 and 5, fetched on their own.
    writer = KVPoolMempool(config, "worker", kv_caches=source, staging_bytes=3 * LAYOUT.block_bytes)
    reader = KVPoolMempool(config, "worker", kv_caches=target, staging_bytes=3 * LAYOUT.block_bytes)
    try:
        assert writer.put([keys[i] for i in stored], blocks(source, stored)) == [True] * 4
        assert writer.flush(timeout=10)
        sentinel = torch.full(LAYOUT.piece_shape, 7.0, dtype=torch.bfloat16)
        for layer in target:
            for part in layer:
                part[:6] = sentinel
        assert reader.get(keys, blocks(target, range(6))) == [True, True, False, True, False, True]
        for b in stored:
            assert block_bytes(target, b) == block_bytes(source, b)
        for b in (2, 4):  # misses: the engine's memory is as it was
            assert all(torch.equal(target[layer][kv][b], sentinel) for layer in range(3) for kv in (0, 1))
        assert reader.session.get_stager.allocated_bytes == 3 * LAYOUT.block_bytes
    finally:
        writer.close()
        reader.close()


def test_bad_arguments_return_false_and_change_nothing(pool, config):
    cache = paged_cache(seed=4)
    worker = KVPoolMempool(config, "worker", kv_caches=cache)
    try:
        keys = mindie_keys("bad", 2)
        good = blocks(cache, [0, 1])
        wrong_shape = blocks(cache, [0, 1])
        wrong_shape[1][2][1] = torch.zeros(LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim + 1,
                                           dtype=torch.bfloat16)
        wrong_dtype = blocks(cache, [0, 1])
        wrong_dtype[0][0][0] = wrong_dtype[0][0][0].float()
        strided = blocks(cache, [0, 1])
        strided[1][1][0] = torch.empty(LAYOUT.num_kv_heads, LAYOUT.block_size, LAYOUT.head_dim,
                                       dtype=torch.bfloat16).transpose(0, 1)  # right shape, not contiguous
        bad_calls = [
            (123, good),  # keys not a list
            ([keys[0], 5], good),  # a key not a str
            ([keys[0], ""], good),  # an empty key
            (keys, good[:1]),  # length mismatch
            (keys, "tensors"),  # tensors not a list
            (keys, [good[0], good[1][:2]]),  # a block with too few layers
            (keys, [good[0], [layer[:1] for layer in good[1]]]),  # a layer without its V
            (keys, wrong_shape),
            (keys, wrong_dtype),
            (keys, strided),
            (keys, [good[0], [[np.zeros(4), np.zeros(4)]] * 3]),  # not tensors
        ]
        before = indexed(pool)
        for args in bad_calls:
            assert worker.put(*args) == [False], args
        assert worker.flush(timeout=10)
        assert indexed(pool) == before  # nothing reached the pool
        assert worker.batch_exist(keys) == [False, False]
        assert worker.stats["put_blocks"] == 0

        assert worker.put(keys, good) == [True, True]
        assert worker.flush(timeout=10)
        target = paged_cache(seed=None)
        target_blocks = blocks(target, [0, 1])
        bad_target_calls = [
            (keys, target_blocks[:1]),
            ([keys[0], None], target_blocks),
            (keys, [target_blocks[0], [[t.float() for t in layer] for layer in target_blocks[1]]]),
        ]
        for args in bad_target_calls:
            assert worker.get(*args) == [False], args
        assert all(torch.count_nonzero(t) == 0 for layer in target for t in layer)  # untouched
        assert worker.stats["get_blocks"] == 0
        assert worker.exists(42) is False and worker.batch_exist("not-a-list") == [False]
        assert worker.stats["refused"] == len(bad_calls) + len(bad_target_calls) + 2
        assert worker.get(keys, target_blocks) == [True, True]  # the same call, well-formed, works
    finally:
        worker.close()
    assert worker.put(keys, good) == [False] and worker.batch_exist(keys) == [False]  # closed: refused


def test_tenants_do_not_share_blocks(pool, tmp_path):
    cache = paged_cache(seed=5)
    keys = mindie_keys("tenant", 1)
    a = KVPoolMempool(write_config(tmp_path / "a.json", pool.master, tenant="a"), "worker", kv_caches=cache)
    b = KVPoolMempool(write_config(tmp_path / "b.json", pool.master, tenant="b"), "scheduler")
    try:
        assert a.put(keys, blocks(cache, [0])) == [True]
        assert a.flush(timeout=10)
        assert a.batch_exist(keys) == [True]
        assert b.batch_exist(keys) == [False]
    finally:
        a.close()
        b.close()


def test_construction_rejects_bad_configuration(pool, tmp_path, config):
    with pytest.raises(ValueError, match="backend"):
        create_pool("mooncake", config, "worker")
    with pytest.raises(ValueError, match="role"):
        create_pool("kvpool", config, "prefill")
    with pytest.raises(ValueError, match="layout"):
        create_pool("kvpool", write_config(tmp_path / "raw.json", pool.master, layout=None), "scheduler")
    other = [[torch.zeros(NUM_BLOCKS, 8, 2, 16, dtype=torch.bfloat16)] * 2 for _ in range(LAYOUT.num_layers)]
    with pytest.raises(ValueError, match="kv_caches"):
        create_pool("kvpool", config, "worker", kv_caches=other)
    with pytest.raises(ValueError, match="device_id"):
        create_pool("kvpool", config, "worker", device_id=-1)


def test_a_dead_pool_is_a_miss_never_an_exception(tmp_path):
    config = write_config(tmp_path / "dead.json", f"127.0.0.1:{free_port()}", lookup_timeout_s=0.3, io_timeout_s=0.5)
    cache = paged_cache(seed=6)
    keys = mindie_keys("dead", 2)
    worker = create_pool("kvpool", config, "worker", kv_caches=cache)
    scheduler = create_pool("kvpool", config, "scheduler")
    try:
        assert scheduler.batch_exist(keys) == [False, False]
        worker.put(keys, blocks(cache, [0, 1]))  # accepted or not, it must not raise
        before = [t.clone() for layer in cache for t in layer]
        assert worker.get(keys, blocks(cache, [0, 1])) == [False, False]
        assert all(torch.equal(a, b) for a, b in zip(before, [t for layer in cache for t in layer]))
    finally:
        worker.close()
        scheduler.close()


def test_a_layout_and_the_same_cache_as_mindie_cache_share_blocks(pool, tmp_path, config):
    """client.layout and mindie_cache are two spellings of one cache: one key namespace."""
    spelled = tmp_path / "mindie-cache.json"
    cache = {"dtype": "bf16", "num_layers": LAYOUT.num_layers, "block_size": LAYOUT.block_size,
             "num_kv_heads": LAYOUT.num_kv_heads, "k_head_size": LAYOUT.head_dim, "v_head_size": LAYOUT.head_dim}
    spelled.write_text(json.dumps({"client": {"master": pool.master, "model": MODEL}, "mindie_cache": cache}))
    source = paged_cache(seed=7)
    keys = mindie_keys("spelled", 2)
    writer = create_pool("kvpool", config, "worker", kv_caches=source)
    scheduler = create_pool("kvpool", str(spelled))
    try:
        assert writer.put(keys, blocks(source, [3, 4])) == [True, True]
        assert writer.flush(timeout=10)
        assert scheduler.batch_exist(keys) == [True, True]
        assert scheduler.cache.fingerprint() == LAYOUT.fingerprint()
    finally:
        writer.close()
        scheduler.close()
