"""kvpool's MindIE backend driven the way MindIE-LLM's own code drives a MemPool, against a real `kvpool serve`.

MindIE-LLM is not on PyPI (and needs an NPU), so its calls are reproduced here
from its public source (Ascend/MindIE-LLM; lines in docs/engines/mindie.md):

- the worker: ``plugins/prefix_cache/prefix_cache_plugin.py`` builds
  ``MemPool.create_pool(backend=..., config_path=..., role="worker",
  device_id=..., kv_caches=npu_cache)``, keys ``"{hash}_{tp_rank}_{tp_size}_{model}"``
  from ``hash_block``, and calls ``m_store.get(keys, tensors)`` /
  ``m_store.put(keys, tensors)`` with ``tensors[i] = [[npu_cache[l][0][b],
  npu_cache[l][1][b]] for l in range(num_put_layers)]``, ignoring the answers;
- the cache: ``adapter/torch_utils/kvcache_pool.py`` (kv-pool path) allocates per
  layer ``(K, V)`` (plus an index cache for DeepSeek-V3.2), shapes from
  ``utils/kvcache_settings.py``: MLA K ``kv_lora_rank`` 512, V ``qk_rope_head_dim``
  64, one head (``runtime/model_runner/model_runner.py``), NZ when enabled (the
  DeepSeek-R1 pooling example sets ``enable_nz``);
- the scheduler: ``src/block_manager/self_attn_block_manager.cpp`` builds the pool
  as ``create_pool(backend, config_path)`` and counts
  ``GetRemoteComputedBlockIds`` through ``src/include/utils/mem_pool.h``
  ``LookUp``: ``batch_exist`` if the object has it, else ``exists`` until the first miss.

The NPU is the only thing not here: caches are CPU tensors of MindIE's shapes and
dtypes, and the device copy path is exercised through an injected copier
(:class:`RecordingCopier`); the real device runtime is untested on hardware.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")

from support import PoolProcesses, free_port

from kvpool.engines.mindie import CACHE_SECTION, KVPoolMempool, MindIECache, create_pool
from kvpool.engines.staging import PieceCopier

MODEL = "dsr1"
BLOCK = 16  # MindIE's default cacheBlockSize is 128; 16 keeps the test small, every other dim is DeepSeek-R1's
# DeepSeek-R1 on one rank as MindIE configures it for pooling: MLA (1 head, K 512, V 64), NZ, layer 1's K int8.
R1 = MindIECache("bfloat16", num_layers=3, block_size=BLOCK, num_kv_heads=1, k_head_size=512, v_head_size=64,
                 nz=True, quant_layers=(1,))
NUM_BLOCKS = 10


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    procs = PoolProcesses(tmp_path_factory.mktemp("mindie-plugin"), **{"dram-bytes": "16M", "max-block-bytes": "128K"})
    procs.serve()
    yield procs
    procs.close()
    procs.assert_stopped_cleanly()


def write_config(path, master: str, cache: MindIECache = R1, **client: Any) -> str:
    section = {"master": master, "model": MODEL, "lookup_timeout_s": 2.0, "io_timeout_s": 5.0, **client}
    cache_dict = {f: getattr(cache, f) for f in cache.__dataclass_fields__}
    path.write_text(json.dumps({"client": section, CACHE_SECTION: cache_dict}))
    return str(path)


@pytest.fixture
def config(pool, tmp_path) -> str:
    return write_config(tmp_path / "kvpool.json", pool.master)


# -- MindIE's side, reproduced -------------------------------------------------------------


def npu_cache(cache: MindIECache, seed: int | None, index_cache: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """``KVCachePool.npu_cache`` on CPU: per layer (K, V[, index]), each ``[num_blocks, *block_shape]``."""
    gen = torch.Generator().manual_seed(seed or 0)

    def one(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if seed is None:
            return torch.zeros((NUM_BLOCKS, *shape), dtype=dtype)
        if dtype == torch.int8:
            return torch.randint(-128, 128, (NUM_BLOCKS, *shape), generator=gen, dtype=torch.int8)
        return torch.randn((NUM_BLOCKS, *shape), generator=gen).to(dtype)

    layers: list[tuple[torch.Tensor, ...]] = []
    for layer in range(cache.num_layers):
        k, v = one(*cache.piece(layer, 0)), one(*cache.piece(layer, 1))
        layers.append((k, v, one((BLOCK, 1, 128), torch.bfloat16)) if index_cache else (k, v))
    return layers


def plugin_tensors(cache: list[tuple[torch.Tensor, ...]], block_ids: Iterable[int]) -> list[list[list[torch.Tensor]]]:
    """The plugin's ``kvcache_tensors``: per key, per layer ``[npu_cache[l][0][b], npu_cache[l][1][b]]``."""
    return [[[cache[layer][0][b], cache[layer][1][b]] for layer in range(len(cache))] for b in block_ids]


def hash_combine(seed: int, value: int) -> int:
    """prefix_cache_plugin.py ``hash_combine`` (a boost-style combine, never 0)."""
    seed ^= value + 0x9E3779B97F4A7C15 + (seed << 6) + (seed >> 2)
    return (1 if seed == 0 else seed) % 2**64


def block_hashes(tokens: list[int]) -> list[int]:
    """prefix_cache_plugin.py ``hash_block`` over each full block, chained through the previous hash."""
    hashes, prefix = [], 0
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        seed = hash_combine(0, prefix) if prefix else 0
        for token in tokens[start : start + BLOCK]:
            seed = hash_combine(seed, token)
        prefix = hash_combine(seed, 0)
        hashes.append(prefix)
    return hashes


def prefix_key(hash_value: int, tp_rank: int = 0, tp_size: int = 1) -> str:
    """prefix_cache_plugin.py ``get_prefix_keys`` (and the C++ key in GetRemoteComputedBlockIds)."""
    return f"{hash_value}_{tp_rank}_{tp_size}_{MODEL}"


def look_up(pool: Any, keys: list[str]) -> list[bool]:
    """mem_pool.h ``MemPool::LookUp``: ``batch_exist`` if ``hasattr``, else ``exists`` until the first miss."""
    if not keys:
        return []
    if hasattr(pool, "batch_exist"):
        answer = pool.batch_exist(keys)
        assert all(type(a) is bool for a in answer), answer  # cast<std::vector<bool>>
        return list(answer)  # res.assign(tmp): the answer's own length
    res, i, single = [False] * len(keys), 0, True
    while i < len(keys) and single:
        single = pool.exists(keys[i])
        assert type(single) is bool
        res[i] = single
        i += 1
    return res


def remote_computed_blocks(pool: Any, hashes: list[int], computed: int, tp_size: int) -> int:
    """self_attn_block_manager.cpp ``GetRemoteComputedBlockIds``: HBM hits plus the pool's leading run / tp_size."""
    keys = [prefix_key(h, tp, tp_size) for h in hashes[computed:] for tp in range(tp_size)]
    found = look_up(pool, keys)
    run = 0
    while run < len(found) and found[run]:
        run += 1
    return computed + run // tp_size


class ExistsOnly:
    """A MemPool object without ``batch_exist`` (MindIE's base class has none): LookUp's other branch."""

    def __init__(self, pool: KVPoolMempool):
        self.pool = pool
        self.asked: list[str] = []

    def exists(self, key: str, **kwargs: Any) -> bool:
        self.asked.append(key)
        return self.pool.exists(key, **kwargs)


def block_bytes(cache: list[tuple[torch.Tensor, ...]], b: int) -> bytes:
    """Block ``b`` as MindIE's backends move it: layer 0 K, layer 0 V, layer 1 K, ... (flatten_tensors order)."""
    return b"".join(cache[layer][part][b].reshape(-1).view(torch.uint8).numpy().tobytes()
                    for layer in range(len(cache)) for part in (0, 1))


def tokens(tag: int, n_blocks: int) -> list[int]:
    return [(tag * 7919 + i * 31) % 150000 for i in range(n_blocks * BLOCK + 3)]  # +3: a partial block, never keyed


# -- the tests -------------------------------------------------------------------------------------


FRESH_WORKER = textwrap.dedent("""
    import hashlib, json, sys
    import torch
    from kvpool.engines.mindie import create_pool
    config, keys, block_ids, shapes = json.loads(sys.argv[1])
    cache = [tuple(torch.zeros(shape, dtype=getattr(torch, dtype)) for shape, dtype in layer) for layer in shapes]
    store = create_pool(backend="kvpool", config_path=config, role="worker", device_id=3, kv_caches=cache)
    tensors = [[[cache[l][0][b], cache[l][1][b]] for l in range(len(cache))] for b in block_ids]
    answer = store.get(keys, tensors)
    digest = lambda b: hashlib.sha256(b"".join(cache[l][p][b].reshape(-1).view(torch.uint8).numpy().tobytes()
                                               for l in range(len(cache)) for p in (0, 1))).hexdigest()
    print(json.dumps({"answer": answer, "blocks": [digest(b) for b in range(cache[0][0].shape[0])],
                      "hits": store.stats["get_hits"]}))
    store.close()
""")


def test_a_deepseek_r1_worker_stores_and_a_fresh_worker_process_gets_byte_exact_hits(config):
    assert R1.piece(0, 0) == ((32, BLOCK, 16), torch.bfloat16) and R1.piece(0, 1) == ((4, BLOCK, 16), torch.bfloat16)
    assert R1.piece(1, 0) == ((16, BLOCK, 32), torch.int8)  # unequal pieces: K 16 KiB, V 2 KiB, int8 K 8 KiB
    source = npu_cache(R1, seed=1, index_cache=True)  # DeepSeek-V3.2's third (index) cache is not pooled
    prompt = tokens(1, 4)
    hashes = block_hashes(prompt)
    keys = [prefix_key(h) for h in hashes]
    writer = create_pool(backend="kvpool", config_path=config, role="worker", device_id=0, kv_caches=source)
    scheduler = create_pool("kvpool", config)  # the C++ block manager's call: role defaulted to "scheduler"
    try:
        assert remote_computed_blocks(scheduler, hashes, 0, 1) == 0
        # put_prefix_kvcache_to_mempool: the request's full blocks after its remote hits, in its block table
        assert writer.put(keys, plugin_tensors(source, [7, 2, 9, 4])) == [True] * 4
        assert writer.flush(timeout=10)
        assert remote_computed_blocks(scheduler, hashes, 0, 1) == 4
        assert remote_computed_blocks(scheduler, hashes, 1, 1) == 4  # HBM held the first: the pool is asked after it
        assert remote_computed_blocks(scheduler, block_hashes(tokens(2, 4)), 0, 1) == 0  # another prompt
        assert writer.session.put_stager.pinned == torch.cuda.is_available()  # pinned where torch can pin; not here

        # A new worker process (a MindIE restart, another instance) loads the blocks into blocks 0..3 of its cache.
        shapes = [[(list(t.shape), str(t.dtype).removeprefix("torch.")) for t in layer[:2]] for layer in source]
        child = subprocess.run([sys.executable, "-c", FRESH_WORKER, json.dumps([config, keys, [0, 1, 2, 3], shapes])],
                               capture_output=True, text=True, timeout=120)
        assert child.returncode == 0, child.stderr
        reply = json.loads(child.stdout.strip().splitlines()[-1])
        assert reply["answer"] == [True] * 4 and reply["hits"] == 4
        expected = [hashlib.sha256(block_bytes(source, b)).hexdigest() for b in (7, 2, 9, 4)]
        zero = hashlib.sha256(bytes(R1.block_bytes)).hexdigest()
        assert reply["blocks"] == expected + [zero] * (NUM_BLOCKS - 4)  # byte-exact, and nothing else written
    finally:
        writer.close()
        scheduler.close()


def test_every_tensors_shape_mindie_passes_and_kwargs_everywhere(config):
    """base.py: ``keys: Union[str, List[str]]``, ``tensors: Union[Tensor, List[Tensor], List[List[Tensor]]]``."""
    source, target = npu_cache(R1, seed=2), npu_cache(R1, seed=None)
    worker = create_pool("kvpool", config, "worker", kv_caches=source, some_future_kwarg=1)
    keys = [prefix_key(h) for h in block_hashes(tokens(3, 6))]

    def nested(cache, b):  # the plugin's [layers][K, V]
        return [[cache[layer][0][b], cache[layer][1][b]] for layer in range(R1.num_layers)]

    def flat(cache, b):  # List[Tensor]: what flatten_tensors makes of it
        return [cache[layer][part][b] for layer in range(R1.num_layers) for part in (0, 1)]

    def one_tensor(cache, b):  # a Tensor: the block's bytes in one contiguous buffer
        return torch.frombuffer(bytearray(block_bytes(cache, b)), dtype=torch.uint8)

    def tuples(cache, b):  # npu_cache's own (K, V) tuples, nested any depth
        return tuple((cache[layer][0][b], (cache[layer][1][b],)) for layer in range(R1.num_layers))

    try:
        assert worker.put(keys[0], nested(source, 0), async_write=True) == [True]  # one str key: its block
        assert worker.put(keys[1], flat(source, 1)) == [True]
        assert worker.put(keys[2], one_tensor(source, 2)) == [True]
        assert worker.put(keys[3:6], [nested(source, 3), flat(source, 4), tuples(source, 5)]) == [True] * 3
        assert worker.flush(timeout=10)
        assert worker.exists(keys[2], extra="ignored") is True
        assert worker.batch_exist(keys, extra="ignored") == [True] * 6
        # Read each back through a different shape than it was written with.
        assert worker.get(keys[0], flat(target, 0), extra=1) == [True]
        assert worker.get(keys[1], tuples(target, 1)) == [True]
        assert worker.get(keys[2], nested(target, 2)) == [True]
        out = torch.zeros(R1.block_bytes, dtype=torch.uint8)
        assert worker.get([keys[3]], [out]) == [True]
        assert bytes(out.numpy()) == block_bytes(source, 3)
        assert worker.get(keys[4:6], [flat(target, 4), nested(target, 5)]) == [True, True]
        for b in (0, 1, 2, 4, 5):
            assert block_bytes(target, b) == block_bytes(source, b), b
    finally:
        worker.close(reason="test")
    assert worker.get(keys[0], flat(target, 0)) == [False]  # closed


def test_bad_input_returns_false_and_changes_nothing(pool, config):
    source, target = npu_cache(R1, seed=3), npu_cache(R1, seed=None)
    worker = KVPoolMempool(config, "worker", kv_caches=source)
    keys = [prefix_key(h) for h in block_hashes(tokens(4, 2))]
    good = plugin_tensors(source, [0, 1])
    try:
        swapped = plugin_tensors(source, [0, 1])
        swapped[1][0] = [swapped[1][0][1], swapped[1][0][0]]  # V where K belongs: MLA pieces differ in size
        quant_as_bf16 = plugin_tensors(source, [0, 1])
        quant_as_bf16[0][1][0] = torch.zeros((16, BLOCK, 32), dtype=torch.bfloat16)  # layer 1's K must be int8
        nd_for_nz = plugin_tensors(source, [0, 1])
        nd_for_nz[0][0][0] = torch.zeros((BLOCK, 1, 512), dtype=torch.bfloat16)  # right bytes, ND instead of NZ
        strided = plugin_tensors(source, [0, 1])
        strided[1][2][1] = torch.zeros((BLOCK, 4, 16), dtype=torch.bfloat16).transpose(0, 1)  # not contiguous
        no_v = plugin_tensors(source, [0, 1])
        no_v[1][2] = no_v[1][2][:1]
        extra = plugin_tensors(source, [0, 1])
        extra[0].append([source[0][0][5], source[0][1][5]])  # one layer too many
        short_buffer = [good[0], torch.zeros(R1.block_bytes - 2, dtype=torch.uint8)]
        bad_calls = [
            (None, good), (keys[0], good),  # keys not str/list; a str key with a list of blocks
            ([keys[0], 7], good), ([keys[0], ""], good), (keys, good[:1]), (keys, "tensors"), (keys, good[0][0][0]),
            (keys, [good[0], None]), (keys, [good[0], [[1, 2]]]),
            (keys, swapped), (keys, quant_as_bf16), (keys, nd_for_nz), (keys, strided), (keys, no_v), (keys, extra),
            (keys, short_buffer),
        ]
        before = pool.status().indexed_blocks
        for args in bad_calls:
            assert worker.put(*args) == [False], args
        assert worker.flush(timeout=10)
        assert pool.status().indexed_blocks == before and worker.stats["put_blocks"] == 0
        assert worker.batch_exist(keys) == [False, False]

        assert worker.put(keys, good) == [True, True]
        assert worker.flush(timeout=10)
        bad_gets = [(keys, plugin_tensors(target, [0])), (keys, [plugin_tensors(target, [0])[0], swapped[1]]),
                    ([keys[0], b"bytes"], plugin_tensors(target, [0, 1]))]
        for args in bad_gets:
            assert worker.get(*args) == [False], args
        assert all(torch.count_nonzero(t) == 0 for layer in target for t in layer)  # untouched
        assert worker.exists(5) is False and worker.exists(b"key") is False
        assert worker.batch_exist("not-a-list") == [False] and worker.batch_exist([keys[0], 3]) == [False]
        refused = len(bad_calls) + len(bad_gets) + 4
        assert worker.stats["refused"] == refused and worker.stats["get_blocks"] == 0
        assert worker.get(keys, plugin_tensors(target, [0, 1])) == [True, True]  # the same call, well-formed
        assert block_bytes(target, 1) == block_bytes(source, 1)
    finally:
        worker.close()


def test_the_schedulers_probe_with_and_without_batch_exist_counts_only_blocks_every_rank_holds(config):
    hashes = block_hashes(tokens(5, 4))
    rank0, rank1 = npu_cache(R1, seed=4), npu_cache(R1, seed=5)
    worker0 = KVPoolMempool(config, "worker", kv_caches=rank0)
    worker1 = KVPoolMempool(config, "worker", kv_caches=rank1)
    scheduler = KVPoolMempool(config)
    try:
        # TP 2: each rank stores its own shard under its own key; rank 1 has blocks 0, 1 and 3 (not 2).
        assert worker0.put([prefix_key(h, 0, 2) for h in hashes], plugin_tensors(rank0, [0, 1, 2, 3])) == [True] * 4
        keys1 = [prefix_key(hashes[i], 1, 2) for i in (0, 1, 3)]
        assert worker1.put(keys1, plugin_tensors(rank1, [0, 1, 3])) == [True] * 3
        assert worker0.flush(timeout=10) and worker1.flush(timeout=10)

        probe = [prefix_key(h, tp, 2) for h in hashes for tp in (0, 1)]
        assert look_up(scheduler, probe) == [True] * 5 + [False, True, True]  # batch_exist: every answer
        assert remote_computed_blocks(scheduler, hashes, 0, 2) == 2  # leading run 5 keys -> 2 whole blocks

        one_by_one = ExistsOnly(scheduler)
        assert look_up(one_by_one, probe) == [True] * 5 + [False] * 3
        assert one_by_one.asked == probe[:6]  # stopped at the first miss
        assert remote_computed_blocks(ExistsOnly(scheduler), hashes, 0, 2) == 2  # both branches count the same

        # Bad keys: batch_exist's [False] (one answer for eight keys) counts no block, as LookUp's assign makes it.
        assert look_up(scheduler, probe[:7] + [""]) == [False]
        # Each rank's worker loads its own shard.
        target = npu_cache(R1, seed=None)
        assert worker1.get(keys1, plugin_tensors(target, [5, 6, 7])) == [True] * 3
        assert [block_bytes(target, b) for b in (5, 6, 7)] == [block_bytes(rank1, b) for b in (0, 1, 3)]
    finally:
        for store in (worker0, worker1, scheduler):
            store.close()


def test_a_pool_that_goes_down_is_a_miss_and_never_an_exception(tmp_path):
    procs = PoolProcesses(tmp_path, **{"dram-bytes": "8M", "max-block-bytes": "128K"})
    procs.serve()
    config = write_config(tmp_path / "down.json", procs.master, lookup_timeout_s=0.5, io_timeout_s=1.0)
    source, target = npu_cache(R1, seed=6), npu_cache(R1, seed=None)
    hashes = block_hashes(tokens(6, 2))
    keys = [prefix_key(h) for h in hashes]
    worker = create_pool("kvpool", config, "worker", kv_caches=source)
    scheduler = create_pool("kvpool", config)
    try:
        assert worker.put(keys, plugin_tensors(source, [0, 1])) == [True, True]
        assert worker.flush(timeout=10)
        assert remote_computed_blocks(scheduler, hashes, 0, 1) == 2
        procs.close()  # master and node gone
        assert remote_computed_blocks(scheduler, hashes, 0, 1) == 0
        assert remote_computed_blocks(ExistsOnly(scheduler), hashes, 0, 1) == 0
        assert worker.get(keys, plugin_tensors(target, [0, 1])) == [False, False]
        assert all(torch.count_nonzero(t) == 0 for layer in target for t in layer)
        answer = worker.put(keys, plugin_tensors(source, [2, 3]))  # queued or not: it must not raise
        assert len(answer) == 2 and all(type(a) is bool for a in answer)
        assert worker.exists(keys[0]) is False and scheduler.batch_exist(keys) == [False, False]
    finally:
        worker.close()
        scheduler.close()
        procs.close()
    procs.assert_stopped_cleanly()
    # A pool that never was: the same.
    dead = write_config(tmp_path / "dead.json", f"127.0.0.1:{free_port()}", lookup_timeout_s=0.3, io_timeout_s=0.5)
    never = create_pool("kvpool", dead, "worker", kv_caches=source)
    try:
        assert never.batch_exist(keys) == [False, False] and never.exists(keys[0]) is False
        assert never.get(keys, plugin_tensors(target, [0, 1])) == [False, False]
    finally:
        never.close()


class RecordingCopier(PieceCopier):
    """Stands in for the NPU runtime: treats every copy as a device copy, and records copies and waits.

    Only the device runtime is replaced (torch's ``copy_`` still moves the bytes, on CPU):
    what is under test is when the backend enqueues copies and when it waits for them.
    """

    def __init__(self, fail_at: int | None = None):
        self.copies: list[bool] = []  # non_blocking of each copy
        self.waits = 0
        self.fail_at = fail_at

    def device_of(self, dst: torch.Tensor, src: torch.Tensor) -> torch.device | None:
        return torch.device("meta")  # any non-host device

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        if self.fail_at is not None and len(self.copies) == self.fail_at:
            self.fail_at = None  # once
            raise RuntimeError("device copy failed (injected)")
        self.copies.append(non_blocking)
        dst.copy_(src)

    def synchronize(self, device: torch.device) -> None:
        self.waits += 1


def test_device_copies_are_enqueued_per_piece_and_waited_for_once_per_chunk(config):
    """The NPU path's logic (untested on hardware): batched, non-blocking, one wait per staging chunk."""
    source, target = npu_cache(R1, seed=7), npu_cache(R1, seed=None)
    keys = [prefix_key(h) for h in block_hashes(tokens(7, 5))]
    pieces = 2 * R1.num_layers
    to_host, to_device = RecordingCopier(), RecordingCopier()
    staging = 2 * R1.block_bytes  # five blocks move in three chunks
    writer = KVPoolMempool(config, "worker", kv_caches=source, staging_bytes=staging, copier=to_host)
    reader = KVPoolMempool(config, "worker", kv_caches=target, staging_bytes=staging, copier=to_device)
    broken = RecordingCopier(fail_at=2 * pieces + 2)  # a copy of the second chunk's first block
    failing = KVPoolMempool(config, "worker", kv_caches=source, staging_bytes=staging, copier=broken)
    try:
        assert writer.put(keys, plugin_tensors(source, range(5))) == [True] * 5
        assert writer.flush(timeout=10)
        assert to_host.copies == [True] * (5 * pieces) and to_host.waits == 3
        assert reader.get(keys, plugin_tensors(target, range(5))) == [True] * 5
        assert to_device.copies == [True] * (5 * pieces) and to_device.waits == 3
        assert all(block_bytes(target, b) == block_bytes(source, b) for b in range(5))
        assert writer.session.put_stager.allocated_bytes == staging

        # A device copy failing in the second chunk: still waited for, that chunk is False, the rest goes on.
        other = [prefix_key(h) for h in block_hashes(tokens(8, 5))]
        assert failing.put(other, plugin_tensors(source, range(5))) == [True, True, False, False, True]
        assert broken.waits == 3 and failing.stats["faults"] == 1
    finally:
        for store in (writer, reader, failing):
            store.close()


def test_host_copies_never_wait_on_a_device():
    copier = PieceCopier()
    pieces = [torch.arange(6, dtype=torch.bfloat16), torch.arange(4, dtype=torch.int8).reshape(2, 2)]
    region = torch.zeros(16, dtype=torch.uint8)
    copier.to_host(pieces, region)
    out = [torch.zeros_like(p) for p in pieces]
    copier.to_device(region, out)
    assert all(torch.equal(a, b) for a, b in zip(pieces, out))
    with pytest.raises(ValueError, match="bytes"):
        copier.to_host(pieces, torch.zeros(15, dtype=torch.uint8))


def test_the_cache_description_is_checked_at_start_up(pool, tmp_path, config):
    def cache_file(name: str, section: dict[str, Any], **client: Any) -> str:
        path = tmp_path / name
        path.write_text(json.dumps({"client": {"master": pool.master, "model": MODEL, **client},
                                    CACHE_SECTION: section}))
        return str(path)

    base = {f: getattr(R1, f) for f in R1.__dataclass_fields__}
    with pytest.raises(ValueError, match="unknown mindie_cache field"):
        create_pool("kvpool", cache_file("a.json", {**base, "heads": 2}))
    with pytest.raises(ValueError, match="quant_layers"):
        create_pool("kvpool", cache_file("b.json", {**base, "quant_layers": [3]}))
    with pytest.raises(ValueError, match="k_head_size"):
        create_pool("kvpool", cache_file("c.json", {**base, "k_head_size": 0}))
    with pytest.raises(ValueError, match="not both"):
        layout = {"dtype": "bfloat16", "num_layers": 3, "num_kv_heads": 1, "head_dim": 64, "block_size": BLOCK}
        create_pool("kvpool", cache_file("d.json", base, layout=layout))
    swapped = [(v, k) for k, v in npu_cache(R1, seed=None)]
    with pytest.raises(ValueError, match=r"kv_caches\[0\]\[0\]"):
        create_pool("kvpool", config, "worker", kv_caches=swapped)
    # Another cache shape is another namespace: an ND R1 never reads the NZ R1's blocks.
    nd = MindIECache("bfloat16", 3, BLOCK, 1, 512, 64, quant_layers=(1,))
    assert nd.block_bytes == R1.block_bytes and nd.fingerprint() != R1.fingerprint()
    assert MindIECache("bfloat16", 3, BLOCK, 2, 16, 16).fingerprint() == "bfloat16:L3:H2:D16:B16:layer_kv"
