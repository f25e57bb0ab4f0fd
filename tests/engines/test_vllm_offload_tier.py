"""kvpool as a secondary tier behind vLLM's own CPU offloading tier (kvpool/engines/vllm/offload_tier.py).

Three parts:

- :class:`~kvpool.engines.vllm.offload_jobs.TierJobs` and the tier's settings and keys, without vLLM, against a
  real ``kvpool serve``: rows stored by one client load byte for byte into another's, a pool fault is a miss, a
  store past the queue bound or one no node can take fails at once, never blocking.
- vLLM's own tiering classes without a model (tests/vllm_offload_driver.py, in build/vllm-venv):
  ``OffloadingSpecFactory`` builds the ``TieringOffloadingSpec`` from the ``kv_connector_extra_config`` a user
  writes, its manager builds kvpool's tier through ``SecondaryTierFactory`` (``type`` + ``module_path``), and two
  such managers in two processes share chunks through one pool, through faults and a stalled pool.
- The real vLLM engine (tests/vllm_driver.py) with vLLM's ``OffloadingConnector``: a fresh process is served
  from the pool behind its own CPU tier, greedy tokens equal to a run without any connector.

Only vLLM's CUDA-only CPU offloading worker is stood in, named as such: tests/vllm_offload_standins.py.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from driver_support import run_driver
from fault.faultkit import kill_9, stopped
from support import TESTS, PoolProcesses, wait_until
from vllm_runtime import save_model, vllm_env, vllm_python
from vllm_support import drive, prompt, req

from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig
from kvpool.engines.vllm.offload_jobs import (
    DEFAULT_STORE_QUEUE_BYTES,
    JobDone,
    SwitchInterval,
    TierJobs,
    model_name,
    offload_namespace,
    pool_keys,
    strict_mode,
    tier_settings,
)

ROW = 64 << 10  # one primary-tier row (a chunk): 2 layers of 32 tokens of the driver's fp32 "model"
NODE = {"dram-bytes": "64M", "max-block-bytes": "64K", "ssd-bytes": "256M"}
DRIVER = TESTS / "vllm_offload_driver.py"
TIER = {"type": "KVPoolSecondaryTier", "module_path": "kvpool.engines.vllm.offload_tier"}
BLOCK = 32
pytestmark = pytest.mark.timeout(300)


def client_config(master: str, **fields: Any) -> ClientConfig:
    return ClientConfig(master=master, lookup_timeout_s=1.0, io_timeout_s=2.0, **fields)


def rows_of(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, ROW), dtype=np.uint8)


def namespace(tenant: str = "", **row: Any) -> Any:
    return offload_namespace("m", tenant, {"row_bytes": ROW, **row})


def offload_keys(tag: str, n: int) -> list[bytes]:
    """vLLM-like offload keys: a 32-byte block hash and a 4-byte group index."""
    return [tag.encode().ljust(32, b".")[:28] + i.to_bytes(4, "big") + (0).to_bytes(4, "big") for i in range(n)]


def results(jobs: TierJobs, n: int, timeout: float = 30.0) -> dict[int, JobDone]:
    """The next ``n`` finished jobs by id; each job is reported once."""
    got: dict[int, JobDone] = {}

    def collect() -> bool:
        for done in jobs.finished():
            assert done.job_id not in got, f"job {done.job_id} reported twice"
            got[done.job_id] = done
        return len(got) >= n

    wait_until(collect, timeout=timeout)
    return got


@pytest.fixture
def pool(tmp_path: Path):
    p = PoolProcesses(tmp_path, **NODE)
    yield p
    p.close()
    p.assert_stopped_cleanly()


# -- settings and keys ---------------------------------------------------------------------------------------


def test_tier_fields_are_parsed_strictly_and_errors_name_the_field(tmp_path):
    config = tmp_path / "kv.json"
    config.write_text(json.dumps({"client": {"master": "127.0.0.1:7777", "model": "qwen", "tenant": "t1"}}))
    settings = tier_settings({"kvpool_config_path": str(config), "kvpool_store_queue_bytes": "8M",
                              "locality": "REMOTE"})
    assert (settings.client.master, settings.store_queue_bytes, settings.locality) == ("127.0.0.1:7777", 8 << 20,
                                                                                        "REMOTE")
    assert tier_settings({"locality": "local"}).locality == "LOCAL" and tier_settings({}).locality == ""
    assert tier_settings({}).switch_interval_us == 200
    assert tier_settings({"kvpool_switch_interval_us": 0}).switch_interval_us == 0
    assert tier_settings({}).store_queue_bytes == DEFAULT_STORE_QUEUE_BYTES
    assert model_name(settings.client, "/models/qwen-7b") == "qwen"  # the kvpool config names the model
    assert model_name(tier_settings({}).client, "/models/qwen-7b") == "/models/qwen-7b"  # else vLLM's
    assert strict_mode({"kvpool_strict": "true"}) and not strict_mode({"kvpool_strict": "false"})
    assert not strict_mode({})
    for fields, named in [({"kvpool_config_pth": "x"}, "kvpool_config_pth"), ({"root_dir": "/x"}, "root_dir"),
                          ({"kvpool_config_path": 5}, "kvpool_config_path"),
                          ({"kvpool_store_queue_bytes": 0}, "kvpool_store_queue_bytes"),
                          ({"kvpool_store_queue_bytes": "lots"}, "kvpool_store_queue_bytes"),
                          ({"kvpool_store_queue_bytes": True}, "kvpool_store_queue_bytes"),
                          ({"locality": "NEARBY"}, "locality"), ({"locality": 1}, "locality"),
                          ({"kvpool_switch_interval_us": 5001}, "kvpool_switch_interval_us"),
                          ({"kvpool_switch_interval_us": "200"}, "kvpool_switch_interval_us"),
                          ({"kvpool_config_path": str(tmp_path / "missing.json")}, "missing.json")]:
        with pytest.raises(ValueError, match=named):
            tier_settings(fields)
    with pytest.raises(ValueError, match="kvpool_strict"):
        strict_mode({"kvpool_strict": 2})


def test_chunk_keys_differ_by_row_format_model_and_tenant_and_are_the_same_everywhere_else():
    keys = offload_keys("r", 3)
    same = pool_keys(keys, namespace())
    assert same == pool_keys(keys, namespace()) and len(set(same)) == 3 and all(len(k) == 32 for k in same)
    others = [namespace(tenant="t1"), namespace(parallel=[2, 2, 1, 1, 1]), namespace(dtype="bfloat16"),
              namespace(blocks_per_chunk=2), offload_namespace("other-model", "", {"row_bytes": ROW})]
    seen = {tuple(same)}
    for ns in others:
        seen.add(tuple(pool_keys(keys, ns)))
    assert len(seen) == 1 + len(others)
    group1 = [k[:-4] + (1).to_bytes(4, "big") for k in keys]  # the same hash in another KV cache group
    assert not set(pool_keys(group1, namespace())) & set(same)


def test_the_switch_interval_is_lowered_while_anyone_is_inside_and_put_back_after_the_last():
    before = sys.getswitchinterval()
    with SwitchInterval(200e-6):
        assert sys.getswitchinterval() == pytest.approx(200e-6)
        with SwitchInterval(100e-6):  # the first holder's value stands
            assert sys.getswitchinterval() == pytest.approx(200e-6)
        assert sys.getswitchinterval() == pytest.approx(200e-6)
    assert sys.getswitchinterval() == before
    with SwitchInterval(0):  # off: Python's own
        assert sys.getswitchinterval() == before
    with SwitchInterval(1.0):  # never raised above what it was
        assert sys.getswitchinterval() == before


# -- TierJobs against a real pool ----------------------------------------------------------------------------


def test_chunks_stored_through_one_client_load_into_another_byte_for_byte(pool):
    pool.serve()
    keys = pool_keys(offload_keys("share", 6), namespace())
    src, dst = rows_of(8, 1), np.zeros((8, ROW), dtype=np.uint8)
    writer = TierJobs(PoolClient(client_config(pool.master)), src)
    reader = TierJobs(PoolClient(client_config(pool.master, shared_memory=False)), dst)  # the bulk TCP path
    try:
        writer.submit_store(7, keys, np.array([5, 0, 1, 2, 3, 4]))
        assert results(writer, 1)[7].blocks_ok == [True] * 6
        assert reader.exists(keys + pool_keys(offload_keys("never", 1), namespace())) == [True] * 6 + [False]
        reader.submit_load(9, keys[:4], np.array([7, 6, 5, 4]))
        done = results(reader, 1)[9]
        assert done.ok and done.nbytes == 4 * ROW and done.is_load
        for s, d in zip([5, 0, 1, 2], [7, 6, 5, 4]):
            assert np.array_equal(dst[d], src[s])
        assert not dst[:4].any()  # rows the job was not given are untouched
        assert writer.take_stats() == {"stored_blocks": 6} and reader.take_stats() == {"loaded_blocks": 4}

        # A block of another size under one of our keys (another deployment's rows) is never copied into a row.
        odd = pool_keys(offload_keys("odd", 1), namespace())
        PoolClient(client_config(pool.master)).store(odd, [np.ones(ROW // 2, dtype=np.uint8)])
        reader.submit_load(10, odd, np.array([0]))
        assert results(reader, 1)[10].blocks_ok == [False] and not dst[0].any()
    finally:
        writer.close()
        reader.close()


def test_a_pool_fault_is_a_miss_and_a_load_that_fails_is_reported_failed(pool):
    serve = pool.serve()
    keys = pool_keys(offload_keys("fault", 3), namespace())
    src, dst = rows_of(4, 2), np.zeros((4, ROW), dtype=np.uint8)
    writer = TierJobs(PoolClient(client_config(pool.master)), src)
    reader = TierJobs(PoolClient(client_config(pool.master, shared_memory=False)), dst)
    try:
        writer.submit_store(1, keys, np.arange(3))
        assert results(writer, 1)[1].ok
        assert reader.exists(keys) == [True] * 3
        kill_9(serve)  # master and node at once
        assert reader.exists(keys) == [False] * 3  # a lookup the pool cannot answer: misses, no exception
        reader.submit_load(2, keys, np.arange(3))
        done = results(reader, 1)[2]
        assert done.blocks_ok == [False] * 3 and done.nbytes == 0
        writer.submit_store(3, keys, np.arange(3))  # a store into a dead pool: a failed job, not an exception
        assert not results(writer, 1)[3].ok
        assert reader.take_stats()["load_failed_blocks"] == 3
        assert writer.drain(5) and reader.drain(5)
    finally:
        writer.close()
        reader.close()


def test_stores_past_the_queue_bound_drop_at_once_while_the_pool_is_stalled(pool):
    serve = pool.serve()
    jobs = TierJobs(PoolClient(client_config(pool.master)), rows_of(8, 3), store_queue_bytes=3 * ROW)
    got: dict[int, JobDone] = {}
    try:
        with stopped(serve):  # a pool that answers nothing
            took = []
            for job_id, n in [(1, 2), (2, 1), (3, 2), (4, 1)]:
                start = time.monotonic()
                jobs.submit_store(job_id, pool_keys(offload_keys(f"bp{job_id}", n), namespace()), np.arange(n))
                took.append(time.monotonic() - start)
            assert max(took) < 0.5, took  # never waits on the pool
            # 1 (2 rows) and 2 (1 row) fill the bound; 3 and 4 are dropped at once, reported failed.
            got.update(results(jobs, 2, timeout=5))
            assert {3, 4} <= set(got) and not got[3].ok and not got[4].ok
        assert jobs.drain(30)  # once the pool answers (or its calls time out), the admitted two finish
        for done in jobs.finished():
            assert done.job_id not in got, f"job {done.job_id} reported twice"
            got[done.job_id] = done
        assert set(got) == {1, 2, 3, 4}
        stats = jobs.take_stats()
        assert stats["dropped_blocks"] == 3
        assert stats["stored_blocks"] + stats["store_failed_blocks"] == 3
        jobs.submit_store(5, pool_keys(offload_keys("after", 3), namespace()), np.arange(3))  # room again
        assert results(jobs, 1)[5].ok
    finally:
        jobs.close()


def test_a_block_no_node_can_take_fails_its_store_at_once(tmp_path):
    small = PoolProcesses(tmp_path, **{**NODE, "max-block-bytes": "32K", "ssd": "false"})  # a row: 64 KiB
    try:
        small.serve()
        jobs = TierJobs(PoolClient(client_config(small.master)), rows_of(2, 4))
        try:
            start = time.monotonic()
            jobs.submit_store(1, pool_keys(offload_keys("big", 2), namespace()), np.arange(2))
            done = results(jobs, 1)[1]
            assert done.blocks_ok == [False, False] and time.monotonic() - start < 5
            assert jobs.take_stats() == {"store_failed_blocks": 2}
        finally:
            jobs.close()
    finally:
        small.close()
    small.assert_stopped_cleanly()


def test_a_tier_that_is_off_misses_and_fails_every_job_at_once():
    rows = rows_of(2, 5)
    jobs = TierJobs(None, rows)
    keys = pool_keys(offload_keys("off", 2), namespace())
    assert jobs.exists(keys) == [False, False]
    jobs.submit_store(1, keys, np.arange(2))
    jobs.submit_load(2, keys, np.arange(2))
    done = results(jobs, 2, timeout=1)
    assert not done[1].ok and not done[2].ok and jobs.pending() == 0
    assert np.array_equal(rows, rows_of(2, 5))  # nothing touched the rows
    with pytest.raises(ValueError, match="outside"):
        jobs.submit_load(3, keys, np.array([0, 2]))
    with pytest.raises(ValueError, match="2 keys"):
        jobs.submit_store(4, keys, np.arange(3))
    jobs.close()


# -- vLLM's own tiering classes, in vLLM's environment ----------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_model(tmp_path_factory.mktemp("model") / "qwen2-test", "test", seed=0))


@pytest.fixture(scope="module")
def python() -> str:
    found = vllm_python()
    assert found is not None, "no vLLM here: run `bash tests/vllm_env.sh` (tests/run.sh does)"
    return found


def user_extra_config(kvpool_config: Path, **tier: Any) -> dict[str, Any]:
    """The OffloadingConnector's ``kv_connector_extra_config`` as docs/engines/vllm.md tells a user to write it."""
    return {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 16 << 20,
            "secondary_tiers": [{**TIER, "kvpool_config_path": str(kvpool_config), **tier}]}


def kvpool_config(tmp: Path, master: str, **client: Any) -> Path:
    path = tmp / f"kvpool-{len(list(tmp.glob('kvpool-*.json')))}.json"
    path.write_text(json.dumps({"client": {"master": master, "lookup_timeout_s": 1.0, "io_timeout_s": 2.0,
                                           **client}}))
    return path


class Said:
    """What one driver process printed: stores and loads by request id, vLLM's offloading stats, its log."""

    def __init__(self) -> None:
        self.stored: dict[str, dict[str, Any]] = {}
        self.loaded: dict[str, dict[str, Any]] = {}
        self.built: dict[str, dict[str, Any]] = {}
        self.stats: dict[str, float] = {}
        self.log = ""


def drive_manager(python: str, tmp: Path, engine: str, extra: dict[str, Any], steps: list[dict[str, Any]],
          on_pause: Callable[[str], None] | None = None, timeout: float = 120) -> Said:
    spec = tmp / f"offload-{engine}.json"
    spec.write_text(json.dumps({"engine_id": f"{engine}-{tmp.name}", "model": "qwen-test", "block_size": BLOCK,
                                "layers": 2, "page_bytes": ROW, "extra_config": extra, "steps": steps}))
    said = Said()

    def report(out: dict[str, Any]) -> None:
        if "stored" in out:
            said.stored[out["stored"]] = out
        elif "loaded" in out:
            said.loaded[out["loaded"]] = out
        elif "built" in out:
            said.built[out["built"]] = out
        else:
            said.stats = out["stats"]

    said.log = run_driver(python, DRIVER, spec, vllm_env(python), tmp / f"driver-{engine}.log", on_report=report,
                          on_pause=on_pause, timeout=timeout)
    return said


def test_two_vllm_offloading_managers_share_chunks_through_one_pool(python, pool, tmp_path):
    serve = pool.serve()
    # The user's config, with vLLM's own backpressure detector on the tier: vLLM's factory builds it for us.
    extra = user_extra_config(kvpool_config(tmp_path, pool.master), kvpool_store_queue_bytes=6 * ROW,
                              backpressure={"backpressure_cls": "EMABackpressureDetector"})
    p, q = prompt(1, 5 * BLOCK + 17), prompt(2, 3 * BLOCK)
    stalled: dict[str, Any] = {}

    def on_pause(name: str) -> None:
        if name == "stall":
            stalled["cm"] = stopped(serve)
            stalled["cm"].__enter__()
        else:
            stalled["cm"].__exit__(None, None, None)

    a = drive_manager(python, tmp_path, "A", extra, [
        {"store": "p", "tokens": p}, {"store": "q-alice", "tokens": q, "cache_salt": "alice"},
        {"pause": "stall"},  # the pool stops answering: stores must neither block vLLM nor pile up
        {"store": "s1", "tokens": prompt(3, 6 * BLOCK), "timeout": 0},
        {"store": "s2", "tokens": prompt(4, 6 * BLOCK), "timeout": 0},
        {"pause": "resume"}], on_pause=on_pause)
    assert a.stored["p"]["offered"] == 5 and a.stored["q-alice"]["offered"] == 3
    assert not a.stored["p"]["pending"] and not a.stored["q-alice"]["pending"]
    assert max(a.stored[s]["submit_s"] for s in ("s1", "s2")) < 0.5  # vLLM's scheduler thread never waited
    assert a.stats["vllm:kvpool_tier_dropped_blocks"] == 6  # s2: s1's 6 chunks fill kvpool_store_queue_bytes
    assert a.stats["vllm:kvpool_tier_stored_blocks"] >= 8

    b = drive_manager(python, tmp_path, "B", extra, [  # another process: its own, empty CPU tier
        {"load": "p", "tokens": p}, {"load": "p-longer", "tokens": p + prompt(5, 2 * BLOCK)},
        {"load": "q-alice", "tokens": q, "cache_salt": "alice"}, {"load": "q-bob", "tokens": q, "cache_salt": "bob"},
        {"load": "never", "tokens": prompt(6, 4 * BLOCK)}])
    assert b.loaded["p"]["hits"] == 5 and b.loaded["p"]["equal"]
    assert b.loaded["p"]["steps"] >= 2  # vLLM's async lookup: RETRY, then the promotion, then HIT
    assert b.loaded["p-longer"]["hits"] == 5 and b.loaded["p-longer"]["equal"]  # from B's CPU tier now
    assert b.loaded["q-alice"]["hits"] == 3 and b.loaded["q-alice"]["equal"]
    assert b.loaded["q-bob"]["hits"] == 0  # cache_salt is in vLLM's block hash: tenants never share
    assert b.loaded["never"]["hits"] == 0
    assert b.stats["vllm:kvpool_tier_loaded_blocks"] == 8  # p once (p-longer is a CPU tier hit), q-alice
    assert "vllm:kvpool_tier_load_failed_blocks" not in b.stats


def test_a_pool_killed_between_lookup_and_load_or_down_costs_misses_in_vllm(python, pool, tmp_path):
    serve = pool.serve()
    extra = user_extra_config(kvpool_config(tmp_path, pool.master))
    # B reads over TCP: a killed node's arena outlives it in /dev/shm, and a same-host reader could still
    # (correctly) read it, which would hide the failed load this test is about.
    b_extra = user_extra_config(kvpool_config(tmp_path, pool.master, shared_memory=False))
    p, r = prompt(7, 4 * BLOCK), prompt(8, 4 * BLOCK)
    config = str(kvpool_config(tmp_path, pool.master))
    a = drive_manager(python, tmp_path, "A", extra, [
        {"store": "p", "tokens": p}, {"store": "r", "tokens": r},
        # a config the tier cannot use: one ERROR line and the tier is off (vLLM serves), or, strict, no start
        {"build": "typo", "extra_config": user_extra_config(Path(config), kvpool_confg_path=config)},
        {"build": "typo-strict", "extra_config": user_extra_config(Path(config), kvpool_confg_path=config,
                                                                    kvpool_strict=True)},
        {"build": "strict-maybe", "extra_config": user_extra_config(Path(config), kvpool_strict="maybe")}])
    assert a.built["typo"] == {"built": "typo", "error": None, "tier_on": False, "lookup": "MISS"}
    assert a.built["strict-maybe"]["error"] is None and not a.built["strict-maybe"]["tier_on"]
    refused = a.built["typo-strict"]["error"]
    assert refused.startswith("ValueError: kvpool offload tier: unknown") and "kvpool_confg_path" in refused
    assert "kvpool_confg_path" in a.log and "kv_connector_extra_config.secondary_tiers[].kvpool_strict" in a.log
    b = drive_manager(python, tmp_path, "B", b_extra, [
        {"load": "p", "tokens": p, "pause_on_hit": "kill"},  # found, promotion queued: the pool dies now
        {"load": "r", "tokens": r, "timeout": 20}],  # and is down when r is looked up
        on_pause=lambda _: kill_9(serve))
    assert b.loaded["p"]["hits"] == 0 and b.loaded["r"]["hits"] == 0  # computed, not loaded: never wrong bytes
    assert b.stats["vllm:kvpool_tier_load_failed_blocks"] == 4  # p's promotion ran and failed
    assert "vllm:kvpool_tier_loaded_blocks" not in b.stats


def offloading_connector(engine_id: str, extra: dict[str, Any]) -> dict[str, Any]:
    """vLLM's OffloadingConnector with the user's extra config; on this CPU, vLLM's CUDA-only worker stood in."""
    standin = {"spec_name": "CpuStandInTieringSpec", "spec_module_path": "vllm_offload_standins"}
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "engine_id": engine_id,
            "kv_connector_extra_config": {**extra, **standin}}


def test_a_fresh_vllm_process_is_served_from_the_pool_behind_its_own_cpu_tier(python, model, pool, tmp_path):
    pool.serve()
    extra = user_extra_config(kvpool_config(tmp_path, pool.master))
    p, q = prompt(1, 300), prompt(2, 200)
    a = drive(python, model, tmp_path, [
        {"name": "A", "kv_transfer_config": offloading_connector(f"A-{tmp_path.name}", extra),
         "requests": [req("p", p), req("q", q)]}])
    requests = [req("p+", p + prompt(5, 100)), req("q", q)]
    b = drive(python, model, tmp_path, [  # a new process: vLLM's prefix cache and CPU tier start empty
        {"name": "B", "kv_transfer_config": offloading_connector(f"B-{tmp_path.name}", extra), "requests": requests},
        {"name": "ref", "kvpool": None, "requests": [*requests, req("p", p)]}])
    assert a.cached("A", "p") == a.cached("A", "q") == 0
    assert a.tokens("A", "p") == b.tokens("ref", "p") and a.tokens("A", "q") == b.tokens("ref", "q")
    for r in requests:
        assert b.tokens("B", r["id"]) == b.tokens("ref", r["id"]), r["id"]
    # p's 9 full blocks and q's 6 came from A through the pool: B's CPU tier had none of them.
    assert b.cached("B", "p+") == 288 and b.cached("B", "q") == 192
    # Prompt blocks only (vLLM's offload_prompt_only). q's store may be counted after A's metrics are read (the
    # job ends on the tier's thread); p's is counted during q's steps. B's loads show every block arrived.
    assert 9 <= a.metrics["A"]["vllm:kvpool_tier_stored_blocks"] <= 9 + 6
    assert b.metrics["B"]["vllm:kvpool_tier_loaded_blocks"] == 9 + 6
    assert b.metrics["B"].get("vllm:kvpool_tier_load_failed_blocks", 0) == 0
