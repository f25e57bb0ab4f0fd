"""vllm-ascend's AscendStoreConnector backend (kvpool.engines.vllm_ascend) against a real `kvpool serve`.

The KV caches are real CPU torch tensors shaped like vllm-ascend's (per layer
a K and a V cache ``[num_blocks, block_size, heads, head_dim]``); they are
registered by ``data_ptr()`` and moved with raw addresses, as the connector does.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")

from support import PoolProcesses

from kvpool.engines.vllm_ascend import ERR_FAILED, ERR_INVALID, OK, KVPoolStoreBackend
from kvpool.layout import KVLayout

LAYOUT = KVLayout("float16", num_layers=2, num_kv_heads=2, head_dim=16, block_size=16)  # 1 KiB a piece, 4 KiB a block
NUM_BLOCKS = 10
BLOCK_LEN = LAYOUT.piece_bytes  # vllm-ascend's block_len: one block of one layer's K (or V)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    procs = PoolProcesses(tmp_path_factory.mktemp("ascend-pool"), **{"dram-bytes": "4M", "max-block-bytes": "8K"})
    procs.serve()
    yield procs
    procs.close()
    procs.assert_stopped_cleanly()


def write_config(path, master: str, layout: KVLayout | None = LAYOUT) -> str:
    section = {"master": master, "model": "qwen2-test", "lookup_timeout_s": 2.0, "io_timeout_s": 5.0}
    if layout is not None:
        section["layout"] = layout.to_dict()
    path.write_text(json.dumps({"client": section}))
    return str(path)


@pytest.fixture
def config(pool, tmp_path) -> str:
    return write_config(tmp_path / "kvpool.json", pool.master)


class KVCaches:
    """One worker's paged KV cache on CPU: per layer K and V ``[NUM_BLOCKS, *piece_shape]``, as vllm-ascend holds it."""

    def __init__(self, seed: int | None):
        gen = torch.Generator().manual_seed(seed or 0)
        shape = (NUM_BLOCKS, *LAYOUT.piece_shape)
        make = (lambda: torch.zeros(shape, dtype=torch.float16)) if seed is None else \
            (lambda: torch.randn(shape, generator=gen).to(torch.float16))
        self.layers = [(make(), make()) for _ in range(LAYOUT.num_layers)]
        self.tensors = [t for kv in self.layers for t in kv]  # the order of kv_caches_base_addr

    def register(self, backend: KVPoolStoreBackend) -> None:
        backend.register_buffer([t.data_ptr() for t in self.tensors],
                                [t.numel() * t.element_size() for t in self.tensors])

    def addrs(self, block_ids) -> tuple[list[list[int]], list[list[int]]]:
        """prepare_value(): for each block, every layer's K and V address and size."""
        addrs = [[t.data_ptr() + b * BLOCK_LEN for t in self.tensors] for b in block_ids]
        return addrs, [[BLOCK_LEN] * len(self.tensors) for _ in block_ids]

    def block(self, b: int) -> bytes:
        return b"".join(t[b].reshape(-1).view(torch.uint8).numpy().tobytes() for t in self.tensors)

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.tensors]

    def unchanged_since(self, snapshot: list[torch.Tensor]) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.tensors, snapshot))


def pool_keys(tag: str, n: int) -> list[str]:
    """PoolKey.to_string() of vllm-ascend 0.23 (config_data.py): model@pcp@dcp@rank@pp@group@role@family@hash."""
    return [f"qwen2-test@pcp0@dcp0@head_or_tp_rank:0@pp_rank:0@group:0@cache_role:kv@cache_family:default@"
            f"{tag}{i:060x}" for i in range(n)]


def test_put_from_one_worker_get_into_another_byte_exact(config):
    src, dst = KVCaches(seed=1), KVCaches(seed=None)
    writer, reader = KVPoolStoreBackend(None, config_path=config), KVPoolStoreBackend(None, config_path=config)
    try:
        writer.set_device()
        src.register(writer)
        dst.register(reader)
        keys = pool_keys("a", 3)
        assert writer.put(keys, *src.addrs([6, 1, 8])) == [OK] * 3
        assert writer.flush(timeout=10)
        assert writer.exists(keys + pool_keys("never", 1)) == [1, 1, 1, 0]
        assert reader.get(keys, *dst.addrs([0, 2, 4])) == [OK] * 3  # what pool_worker counts as loaded: 0 per key
        for s, d in zip([6, 1, 8], [0, 2, 4]):
            assert dst.block(d) == src.block(s)
        assert all(dst.block(b) == bytes(LAYOUT.block_bytes) for b in (1, 3, 5, 6, 7, 8, 9))
        # A miss is non-zero for that key only (pool_worker's record_failed_blocks marks just that block).
        again = KVCaches(seed=None)
        again.register(reader)
        assert reader.get(keys[:1] + pool_keys("never", 1), *again.addrs([3, 4])) == [OK, ERR_FAILED]
        assert again.block(3) == src.block(6) and again.block(4) == bytes(LAYOUT.block_bytes)
    finally:
        writer.close()
        reader.close()


def test_scheduler_client_answers_exists_only_and_takes_tp_from_the_parallel_config(config):
    cache = KVCaches(seed=2)
    parallel_config = SimpleNamespace(rank=3, tensor_parallel_size=2)  # stands in for vllm's ParallelConfig
    worker = KVPoolStoreBackend(parallel_config, config_path=config)
    scheduler = KVPoolStoreBackend.create_scheduler_client(parallel_config, config_path=config)
    try:
        assert (worker.tp_rank, worker.tp_size) == (1, 2)
        cache.register(worker)
        keys = pool_keys("s", 2)
        assert worker.put(keys, *cache.addrs([0, 1])) == [OK, OK]
        assert worker.flush(timeout=10)
        assert scheduler.exists(keys + pool_keys("never", 1)) == [1, 1, 0]
        assert scheduler.batch_is_exist(keys) == [1, 1]
        assert scheduler.session.client.hbm is None and not scheduler.session.client.config.shared_memory
        assert scheduler.session.put_stager is None and scheduler.session.get_stager is None
        cache.register(scheduler)
        assert scheduler.memory.regions == []  # it maps nothing
        assert scheduler.put(keys, *cache.addrs([0, 1])) == [ERR_INVALID] * 2
    finally:
        worker.close()
        scheduler.close()


def test_unregistered_or_straddling_addresses_are_refused_and_nothing_moves(pool, config):
    registered, stranger = KVCaches(seed=3), KVCaches(seed=4)
    backend = KVPoolStoreBackend(None, config_path=config)
    try:
        registered.register(backend)
        keys = pool_keys("u", 2)
        addrs, sizes = registered.addrs([0, 1])
        outside, _ = stranger.addrs([0, 1])
        straddling = [list(a) for a in addrs]
        straddling[1][-1] = registered.tensors[-1].data_ptr() + (NUM_BLOCKS - 1) * BLOCK_LEN + 8  # runs off the end
        before = pool.status().indexed_blocks
        assert backend.put(keys, [addrs[0], outside[1]], sizes) == [ERR_INVALID] * 2
        assert backend.put(keys, straddling, sizes) == [ERR_INVALID] * 2
        assert backend.put(keys, [outside[0], addrs[1]], sizes) == [ERR_INVALID] * 2
        assert backend.flush(timeout=10)
        assert pool.status().indexed_blocks == before and backend.exists(keys) == [0, 0]

        assert backend.put(keys, addrs, sizes) == [OK, OK]
        assert backend.flush(timeout=10)
        snapshot = stranger.snapshot()
        assert backend.get(keys, outside, sizes) == [ERR_INVALID] * 2
        assert backend.get(keys, [outside[0], addrs[1]], sizes) == [ERR_INVALID] * 2
        assert stranger.unchanged_since(snapshot)  # never written
        assert backend.stats["refused"] == 5
        # A region partly overlapping a registered one is refused whole; registering again is a no-op.
        first = registered.tensors[0]
        assert backend.memory.regions[0][1] == first.numel() * first.element_size()
        backend.register_buffer([first.data_ptr() + 64, stranger.tensors[0].data_ptr()], [1 << 20, 64])
        registered.register(backend)
        assert len(backend.memory.regions) == len(registered.tensors)
        assert backend.stats["refused"] == 6
    finally:
        backend.close()


def test_device_memory_without_a_device_runtime_is_refused_rather_than_dereferenced(config):
    cache = KVCaches(seed=7)
    backend = KVPoolStoreBackend(None, config_path=config, host_memory=False)  # device memory, and no GPU/NPU here
    try:
        cache.register(backend)
        assert backend.memory.regions == [] and backend.copier is None
        assert backend.put(pool_keys("npu", 1), *cache.addrs([0])) == [ERR_INVALID]
    finally:
        backend.close()


def test_bad_arguments_are_refused_whole(pool, config):
    cache = KVCaches(seed=5)
    backend = KVPoolStoreBackend(None, config_path=config)
    try:
        cache.register(backend)
        keys = pool_keys("b", 2)
        addrs, sizes = cache.addrs([0, 1])
        half = [s[:-1] for s in sizes]  # pieces add up to less than a block of the layout
        bad_calls = [
            ("keys", addrs, sizes),
            ([keys[0], 7], addrs, sizes),
            (keys, addrs[:1], sizes),
            (keys, addrs, sizes[:1]),
            (keys, [a[:-1] for a in addrs], half),
            (keys, [[str(x) for x in a] for a in addrs], sizes),
            (keys, [[True] + a[1:] for a in addrs], sizes),
            (keys, addrs, [[-s for s in ss] for ss in sizes]),
            (keys, [[], []], [[], []]),
        ]
        before = pool.status().indexed_blocks
        snapshot = cache.snapshot()
        for call in bad_calls:
            # keys not a list: no per-key answer, None (pool_worker reads it as "every block failed")
            expected = [ERR_INVALID] * len(call[0]) if isinstance(call[0], list) else None
            assert backend.put(*call) == expected, call
            assert backend.get(*call) == expected, call
        assert backend.exists("keys") == [] and backend.exists([1, 2]) == [0, 0]
        assert backend.flush(timeout=10)
        assert pool.status().indexed_blocks == before and cache.unchanged_since(snapshot)
        assert backend.stats["refused"] == 2 * len(bad_calls) + 2 and backend.stats["put_blocks"] == 0
        backend.register_buffer([cache.tensors[0].data_ptr()], [0])
        backend.register_buffer("ptrs", [1])
        assert backend.stats["refused"] == 2 * len(bad_calls) + 4
    finally:
        backend.close()
    assert backend.exists(keys) == [0, 0]  # closed: refused, no exception
    assert backend.put(keys, addrs, sizes) == [ERR_INVALID] * 2
    assert backend.get(keys, addrs, sizes) == [ERR_INVALID] * 2


def test_pieces_that_are_not_one_block_are_refused_by_the_layouts_check(pool, config, caplog):
    """The backend's block gate is KVLayout.check_block over the sum of a key's pieces: its message, and nothing
    of the call moves."""
    cache = KVCaches(seed=6)
    backend = KVPoolStoreBackend(None, config_path=config)
    try:
        cache.register(backend)
        keys = pool_keys("c", 2)
        addrs, sizes = cache.addrs([0, 1])
        short = [sizes[0], [BLOCK_LEN] * (len(sizes[1]) - 1) + [BLOCK_LEN - 2]]
        before = pool.status().indexed_blocks
        with caplog.at_level("WARNING", logger="kvpool.engines.session"):
            assert backend.put(keys, addrs, short) == [ERR_INVALID] * 2
        assert backend.flush(timeout=10) and pool.status().indexed_blocks == before
        expected = f"key 1: its pieces is {LAYOUT.block_bytes - 2} bytes; one block of {LAYOUT.fingerprint()}"
        assert any(expected in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        backend.close()


def test_without_a_layout_keys_are_raw_blocks_such_as_layerwise_ones(pool, tmp_path):
    config = write_config(tmp_path / "raw.json", pool.master, layout=None)
    src, dst = KVCaches(seed=6), KVCaches(seed=None)
    writer, reader = KVPoolStoreBackend(None, config_path=config), KVPoolStoreBackend(None, config_path=config)
    try:
        src.register(writer)
        dst.register(reader)
        # Layer-wise keys (LayerPoolKey): one key per layer, its K and V of one block.
        keys = [f"qwen2-test@pcp0@dcp0@head_or_tp_rank:0@c0ffee@{layer}" for layer in range(LAYOUT.num_layers)]
        addrs = [[src.layers[layer][kv].data_ptr() + 5 * BLOCK_LEN for kv in (0, 1)] for layer in range(2)]
        into = [[dst.layers[layer][kv].data_ptr() + 2 * BLOCK_LEN for kv in (0, 1)] for layer in range(2)]
        sizes = [[BLOCK_LEN, BLOCK_LEN]] * 2
        assert writer.put(keys, addrs, sizes) == [OK, OK]
        assert writer.flush(timeout=10)
        assert reader.get(keys, into, sizes) == [OK, OK]
        assert dst.block(2) == src.block(5)
        # Without a layout to check totals against, the region bounds alone refuse a piece running off the end.
        last = src.tensors[-1]
        end = last.data_ptr() + last.numel() * last.element_size()
        assert writer.memory.view(end - 16, 16) is not None and writer.memory.view(end - 8, 16) is None
        assert writer.put(["straddle"], [[end - 8]], [[16]]) == [ERR_INVALID]
        # The same strings under a layout are other keys: raw and laid-out blocks never mix.
        laid_out = KVPoolStoreBackend(None, config_path=write_config(tmp_path / "laid.json", pool.master))
        try:
            assert laid_out.exists(keys) == [0, 0]
        finally:
            laid_out.close()
    finally:
        writer.close()
        reader.close()


def test_config_path_comes_from_the_environment_when_not_passed(config, monkeypatch):
    monkeypatch.delenv("KVPOOL_CONFIG_PATH", raising=False)
    with pytest.raises(ValueError, match="KVPOOL_CONFIG_PATH"):
        KVPoolStoreBackend(None)
    monkeypatch.setenv("KVPOOL_CONFIG_PATH", config)
    # what vllm-ascend's pool_worker._init_backend does: cls(parallel_config, lazy_init=<bool>)
    backend = KVPoolStoreBackend(None, lazy_init=True)
    try:
        assert backend.lazy_init is True and backend.exists(pool_keys("env", 1)) == [0]
    finally:
        backend.close()


def test_kv_events_name_vllm_ascends_blocks_by_vllms_own_block_hash(tmp_path):
    """Issue 16: the master's events name each block by the int form of the vLLM block hash that ends its key
    string (what vLLM's own events carry), in every tier it moves through, not by kvpool's key."""
    import msgspec
    import zmq
    from support import free_port, wait_until

    from kvpool.engines.vllm_ascend import block_hash
    from kvpool.events import BlockRemoved, BlockStored, KVEventBatch, key_hash
    from kvpool.keys import opaque_key

    replay_at = f"tcp://127.0.0.1:{free_port()}"
    procs = PoolProcesses(tmp_path, **{"dram-bytes": "64K", "max-block-bytes": "8K", "ssd-bytes": "16M"})
    ctx = zmq.Context()
    backend = None
    try:
        procs.serve(**{"master-kv-events-endpoint": f"tcp://127.0.0.1:{free_port()}",
                       "master-kv-events-replay-endpoint": replay_at})
        backend = KVPoolStoreBackend(None, config_path=write_config(tmp_path / "kvpool.json", procs.master))
        backend.set_device()
        caches = KVCaches(seed=3)
        caches.register(backend)
        keys = pool_keys("e", 41)[1:]  # 40 blocks of 4 KiB (hash 0 would mean none): DRAM (64 KiB) demotes some
        for i in range(0, 40, 4):
            assert backend.put(keys[i:i + 4], *caches.addrs([b % NUM_BLOCKS for b in range(i, i + 4)])) == [OK] * 4
            assert backend.flush(timeout=10)
        named = {block_hash(k) for k in keys}
        assert len(named) == 40 and block_hash(keys[4]) == 5  # the last 16 hex digits of the hash field
        decode = msgspec.msgpack.Decoder(type=KVEventBatch)

        def events() -> list:
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(replay_at)
            try:
                dealer.send_multipart([b"", (0).to_bytes(8, "big")])
                out: list = []
                while True:
                    assert dealer.poll(5000)
                    _, _, seq, payload = dealer.recv_multipart()
                    if seq == (-1).to_bytes(8, "big", signed=True):
                        return out
                    out += [e for e in decode.decode(payload).events if isinstance(e, (BlockStored, BlockRemoved))]
            finally:
                dealer.close(linger=0)

        def demoted_and_named() -> bool:
            seen = events()
            hashes = {h for e in seen for h in e.block_hashes}
            moved = {(type(e).__name__, e.medium) for e in seen}
            return hashes == named and {("BlockRemoved", "CPU"), ("BlockStored", "STORAGE")} <= moved

        wait_until(demoted_and_named, timeout=20)
        kvpool_hashes = {key_hash(opaque_key(k)) for k in keys}
        assert not kvpool_hashes & {h for e in events() for h in e.block_hashes}
    finally:
        if backend is not None:
            backend.close()
        ctx.destroy(linger=0)
        procs.close()
    procs.assert_stopped_cleanly()
