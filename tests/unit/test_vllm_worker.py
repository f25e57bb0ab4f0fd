"""The vLLM connector's worker side with real tensors and a pool stand-in: block copies, async loads, layer-wise
streaming, and the scheduler side's async plan.

The pool stand-in (:class:`FakePool`) holds blocks by key, can fail blocks (a checksum that does not match, as
the real client reports it: False) and can hold reads at a gate, so a test sees what the worker does while a
load is in flight without sleeping to win a race.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from support import wait_until

from kvpool.client.lookup import BlockLocation
from kvpool.client.prepared import PreparedPut
from kvpool.engines.vllm.async_loads import AsyncLoads
from kvpool.engines.vllm.keys import VllmKeySpace
from kvpool.engines.vllm.layerwise import LayerThread, LayerwiseLoad, LayerwiseSave
from kvpool.engines.vllm.scheduler import LoadJob, PoolScheduler, SaveJob, StepPlan
from kvpool.engines.vllm.worker import PoolWorker, _gather, _scatter, block_layers
from kvpool.keys import BlockKey
from kvpool.layout import KVLayout
from kvpool.vocabulary import NodeRef, Tier

NUM_BLOCKS = 40
NODE = NodeRef("n0", "127.0.0.1:1")


@pytest.mark.parametrize("shape", [(NUM_BLOCKS, 2, 32, 128), (2, NUM_BLOCKS, 32, 2, 64)], ids=["cpu", "flash"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blocks_gathered_then_scattered_elsewhere_are_the_same_bytes(shape, dtype):
    gen = torch.Generator().manual_seed(0)
    caches = {f"layer{i}": torch.randn(*shape, generator=gen).to(dtype) for i in range(3)}
    layers = block_layers(caches, NUM_BLOCKS)
    assert [lay.block_dim for lay in layers] == [shape.index(NUM_BLOCKS)] * 3
    src, dst = torch.tensor([3, 7, 8]), torch.tensor([30, 1, 22])
    staging = torch.zeros(len(src), len(layers), layers[0].piece_bytes, dtype=torch.uint8)
    for i, layer in enumerate(layers):
        _gather(layer, src, staging[:, i])
    before = {name: t.clone() for name, t in caches.items()}
    for i, layer in enumerate(layers):
        _scatter(layer, dst, staging[:, i])
    for name, t in caches.items():
        dim = shape.index(NUM_BLOCKS)
        assert torch.equal(t.index_select(dim, dst), t.index_select(dim, src))
        untouched = torch.tensor([b for b in range(NUM_BLOCKS) if b not in dst.tolist()])
        assert torch.equal(t.index_select(dim, untouched), before[name].index_select(dim, untouched))


def test_caches_without_a_block_dimension_or_of_different_slices_are_refused():
    with pytest.raises(ValueError, match="no dimension of 40 blocks"):
        block_layers({"l0": torch.zeros(39, 2, 32, 128)}, NUM_BLOCKS)
    with pytest.raises(ValueError, match="different block slices"):
        block_layers({"l0": torch.zeros(40, 2, 32, 128), "l1": torch.zeros(40, 1, 32, 128)}, NUM_BLOCKS)


# -- a worker over real caches, against a pool stand-in --------------------------------------------------------


class FakePool:
    """``get_into``/``put``/``lookup`` as :class:`PoolWorker` calls them; ``bad`` keys arrive corrupt (False),
    ``gate`` (when set up) holds every read until it is opened, ``reads`` counts the reads started."""

    def __init__(self) -> None:
        self.blocks: dict[BlockKey, bytes] = {}
        self.bad: set[BlockKey] = set()
        self.gate: threading.Event | None = None
        self.reads = 0
        self.puts: list[tuple[BlockKey, bytes]] = []
        self.raise_on_read = False

    def get_into(self, locations: Sequence[BlockLocation], outs: Sequence[np.ndarray]) -> list[bool]:
        self.reads += 1
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the gate"
        if self.raise_on_read:
            raise RuntimeError("a bug in the pool client")
        ok = []
        for loc, out in zip(locations, outs):
            data = self.blocks.get(loc.key)
            good = data is not None and loc.key not in self.bad
            if data is not None and good:
                out[:] = np.frombuffer(data, dtype=np.uint8)
            ok.append(good)
        return ok

    def put(self, keys: Sequence[BlockKey], values: Sequence[np.ndarray], names: Any = None) -> list[bool]:
        self.puts += [(k, bytes(v)) for k, v in zip(keys, values)]
        return [True] * len(keys)

    def prepare_put(self, keys: Sequence[BlockKey], sizes: Sequence[int]) -> PreparedPut:
        return PreparedPut(list(keys), list(sizes), [None] * len(keys))  # host scratch targets

    def complete_put(self, prepared: PreparedPut, names: Any = None) -> list[bool]:
        assert not prepared.unfilled(), "the worker queued a block it never filled"
        return self.put(prepared.keys, prepared.targets, names)


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(32, "big"))


@dataclass
class Rig:
    """Two layers of CPU-layout caches; the pool holds blocks 0..9's bytes under keys 0..9."""

    caches: dict[str, torch.Tensor]
    pool: FakePool
    worker: PoolWorker
    sources: dict[int, bytes] = field(default_factory=dict)

    def block_bytes(self, block: int) -> bytes:
        """vLLM block ``block`` as a pool block: each layer's piece, in layer order."""
        return b"".join(t[block].contiguous().view(torch.uint8).numpy().tobytes() for t in self.caches.values())

    def job(self, req: str, keys: list[int], block_ids: list[int]) -> LoadJob:
        size = self.worker.block_bytes
        return LoadJob(req, [key(k) for k in keys], block_ids, [BlockLocation(key(k), Tier.DRAM, NODE, size, 0)
                                                                 for k in keys])


@pytest.fixture
def rig() -> Rig:
    gen = torch.Generator().manual_seed(1)
    caches = {f"model.layers.{i}.attn": torch.randn(NUM_BLOCKS, 2, 32, 16, generator=gen) for i in range(2)}
    pool = FakePool()
    worker = PoolWorker(pool, block_layers(caches, NUM_BLOCKS))  # type: ignore[arg-type]
    r = Rig(caches, pool, worker)
    for b in range(10):
        pool.blocks[key(b)] = r.block_bytes(b)
    return r


def test_an_async_load_is_reported_only_after_its_blocks_are_written_and_its_failures_with_it(rig):
    loads = AsyncLoads(rig.worker)
    rig.pool.gate = threading.Event()
    rig.pool.bad.add(key(3))
    before = rig.block_bytes(22)
    loads.submit([rig.job("r1", [0, 1, 2, 3, 4], [20, 21, 22, 23, 24]), rig.job("r2", [5, 6], [30, 31])])
    wait_until(lambda: rig.pool.reads == 1, timeout=10)  # r1's read started and is held
    assert loads.take_finished() == (set(), set()) and loads.pending == 2  # nothing reported mid-load
    assert rig.block_bytes(22) == before
    rig.pool.gate.set()
    wait_until(lambda: loads.pending == 0, timeout=10)
    done, failed = loads.take_finished()
    assert done == {"r1", "r2"} and failed == {23, 24}  # from the first block that did not arrive on
    assert [rig.block_bytes(b) for b in (20, 21, 22, 30, 31)] == [rig.block_bytes(b) for b in (0, 1, 2, 5, 6)]
    assert rig.block_bytes(23) != rig.block_bytes(3)  # never copied
    assert loads.take_finished() == (set(), set())  # each reported once
    assert rig.worker.take_load_errors() == set()  # async failures go out with finished_recving, not here
    stats = rig.worker.take_stats()
    assert (stats.loaded_blocks, stats.load_errors, stats.loads) == (5, 2, 2)
    loads.close()


def test_an_idle_step_waits_for_a_load_to_finish_but_never_past_its_bound(rig):
    loads = AsyncLoads(rig.worker)
    loads.wait(5.0)  # nothing pending: at once
    rig.pool.gate = threading.Event()
    loads.submit([rig.job("r1", [0], [20])])
    start = time.monotonic()
    loads.wait(0.05)
    assert time.monotonic() - start >= 0.05 and loads.take_finished() == (set(), set())  # still held: bounded
    opener = threading.Timer(0.01, rig.pool.gate.set)
    opener.start()
    loads.wait(30.0)  # returns when the job finishes, long before the bound
    assert loads.take_finished() == ({"r1"}, set())
    loads.close()


def test_an_async_load_that_raises_is_finished_with_every_block_failed(rig):
    loads = AsyncLoads(rig.worker)
    rig.pool.raise_on_read = True
    loads.submit([rig.job("r1", [0, 1], [20, 21])])
    wait_until(lambda: loads.pending == 0, timeout=10)
    assert loads.take_finished() == ({"r1"}, {20, 21})
    loads.close()


def test_a_layerwise_load_readies_layers_as_they_land_and_a_failed_request_saves_nothing_that_step(rig):
    thread = LayerThread(rig.worker)
    rig.pool.gate = threading.Event()
    rig.pool.bad.add(key(2))
    names = list(rig.caches)
    load = LayerwiseLoad(thread, [rig.job("r1", [0, 1, 2], [20, 21, 22]), rig.job("r2", [4], [33])])
    waited = threading.Event()
    waiter = threading.Thread(target=lambda: (load.wait_layer(names[1]), waited.set()))
    waiter.start()
    wait_until(lambda: rig.pool.reads == 1, timeout=10)
    assert not waited.is_set()  # the forward's wait holds while the fetch is held
    rig.pool.gate.set()
    load.wait_layer(names[0])
    assert torch.equal(rig.caches[names[0]][20], rig.caches[names[0]][0])  # layer 0 is in
    waiter.join(10)
    assert waited.is_set()
    # The step's saves: r1's load failed, so its block computed this step is not saved; r2's is.
    save = LayerwiseSave(thread, [SaveJob("r1", [key(100)], [25]), SaveJob("r2", [key(101)], [34])])
    for name in names:
        save.gather_layer(name)
    load.finish()
    assert rig.worker.take_load_errors() == {22} and rig.worker.failed_reqs == {"r1"}
    save.finish()
    assert rig.pool.puts == [(key(101), rig.block_bytes(34))]
    assert [rig.block_bytes(b) for b in (20, 21, 33)] == [rig.block_bytes(b) for b in (0, 1, 4)]
    rig.worker.end_step()
    assert rig.worker.failed_reqs == set()
    thread.close()


def test_a_layerwise_save_gathers_the_layers_vllm_did_not_announce_and_stores_whole_blocks(rig):
    thread = LayerThread(rig.worker)
    save = LayerwiseSave(thread, [SaveJob("r", [key(100), key(101)], [5, 9]), SaveJob("q", [], [])])
    save.gather_layer(list(rig.caches)[1])  # layer 0's never announced
    save.finish()
    assert rig.pool.puts == [(key(100), rig.block_bytes(5)), (key(101), rig.block_bytes(9))]
    assert rig.worker.take_stats().saved_blocks == 2
    thread.close()


def test_a_sync_load_that_failed_drops_the_requests_saves_of_that_step(rig):
    rig.pool.bad.add(key(1))
    rig.worker.load([rig.job("r1", [0, 1], [20, 21])])
    rig.worker.save([SaveJob("r1", [key(100)], [22]), SaveJob("r2", [key(101)], [5])])
    assert rig.worker.take_load_errors() == {21}
    assert [k for k, _ in rig.pool.puts] == [key(101)]


# -- the scheduler side of async loads ---------------------------------------------------------------------------


class FakeLookups:
    def __init__(self, held: int):
        self.held = held  # how many leading blocks the pool holds
        self.calls = 0

    def lookup(self, keys: Sequence[BlockKey], *, hbm_prefix_blocks: int = 0, block_tokens: int = 0) -> Any:
        from kvpool.client.lookup import PoolRun

        self.calls += 1
        n = min(self.held, len(keys))
        return PoolRun(list(keys[:n]), bytes([Tier.DRAM] * n), [0] * n, [NODE], [1024] * n, [0] * n)

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [i < self.held for i in range(len(keys))]


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class NewReq:
    req_id: str
    block_ids: tuple[list[int]]
    num_computed_tokens: int


@dataclass
class Cached:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[Any] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class Output:
    scheduled_new_reqs: list[NewReq] = field(default_factory=list)
    scheduled_cached_reqs: Cached = field(default_factory=Cached)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)


def scheduler(held: int, *, async_loads: bool) -> tuple[PoolScheduler, FakeLookups]:
    space = VllmKeySpace("m", KVLayout("float32", 2, 2, 16, 32), "cpu/x")
    pool = FakeLookups(held)
    return PoolScheduler(lambda: space, pool, 32, async_loads=async_loads), pool


def test_an_async_load_is_planned_in_the_allocating_step_and_a_failed_one_is_never_offered_again():
    sched, pool = scheduler(held=4, async_loads=True)
    r = Req("r", list(range(5 * 32 + 3)))
    assert sched.match(r, 0) == 4 * 32
    sched.allocated(r, list(range(10, 16)), 4 * 32)
    plan = sched.plan(Output())  # r is not in the batch: vLLM parks it in WAITING_FOR_REMOTE_KVS
    assert [(j.req_id, j.block_ids) for j in plan.async_loads] == [("r", [10, 11, 12, 13])] and not plan.loads
    assert sched.plan(Output()).async_loads == []  # planned once
    # Its first block failed: vLLM frees its blocks and asks again; the pool is not asked and answers nothing.
    sched.load_outcomes({"r"}, {10, 11, 12, 13})
    asked = pool.calls
    assert sched.match(r, 0) == 0 and pool.calls == asked
    # Another request whose load went well is asked as usual after a preemption.
    q = Req("q", list(range(1000, 1000 + 5 * 32 + 3)))
    assert sched.match(q, 0) == 4 * 32
    sched.allocated(q, list(range(20, 26)), 4 * 32)
    sched.plan(Output())
    sched.load_outcomes({"q"}, set())
    assert sched.match(q, 0) == 4 * 32


def test_a_sync_load_that_failed_saves_its_blocks_again_once_recomputed():
    sched, _ = scheduler(held=4, async_loads=False)
    r = Req("r", list(range(5 * 32 + 3)))
    assert sched.match(r, 0) == 4 * 32
    sched.allocated(r, list(range(10, 16)), 4 * 32)
    plan = sched.plan(Output([NewReq("r", (list(range(10, 16)),), 4 * 32)], num_scheduled_tokens={"r": 35}))
    assert [j.block_ids for j in plan.loads] == [[10, 11, 12, 13]]
    assert [j.block_ids for j in plan.saves] == [[14]]  # the block the step fills
    sched.load_outcomes(set(), {12})  # block 12 did not load: vLLM recomputes from it
    plan = sched.plan(Output(scheduled_cached_reqs=Cached(["r"], set(), [None], [2 * 32]),
                             num_scheduled_tokens={"r": 3 * 32 + 3}))
    assert [j.block_ids for j in plan.saves] == [[12, 13, 14]]
    assert isinstance(plan, StepPlan)
