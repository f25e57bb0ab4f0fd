"""kvpool as SGLang HiCache's L3 storage (kvpool.engines.sglang), driven by the real sglang 0.5.23.

Every scenario runs in build/sglang-venv (``bash tests/sglang_env.sh``; tests/run.sh does it) as
``tests/sglang_driver.py``: SGLang's device and host KV pools on CPU, its HiCacheController attaching
kvpool's backend through its own StorageBackendFactory (``dynamic``) and moving pages with its own
prefetch and backup threads, against real kvpool processes here. Only Triton is stubbed (SGLang's own stub
for hosts without it: no GPU kernel runs on this path). This process never imports sglang.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support import REPO, TESTS, PoolProcesses, free_port

ROOT = REPO
VENV_PYTHON = ROOT / "build" / "sglang-venv" / "bin" / "python"
DRIVER = TESTS / "sglang_driver.py"
PAGE = 16  # tokens per SGLang page
MODEL = "qwen-test"
pytestmark = pytest.mark.timeout(300)


def prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids, different for every seed."""
    return [(seed * 7919 + i * 31 + (i * i) % 97) % 5000 for i in range(n)]


@pytest.fixture(scope="module")
def python() -> str:
    assert VENV_PYTHON.exists(), "no SGLang here: run `bash tests/sglang_env.sh` (tests/run.sh does)"
    return str(VENV_PYTHON)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory):
    procs = PoolProcesses(tmp_path_factory.mktemp("sglang-pool"), **{"dram-bytes": "8M", "max-block-bytes": "8K"})
    procs.serve()
    yield procs
    procs.close()
    procs.assert_stopped_cleanly()


def write_config(path: Path, master: str) -> str:
    path.write_text(json.dumps({"client": {"master": master, "model": "kvpool-test", "lookup_timeout_s": 1.0,
                                           "io_timeout_s": 5.0}}))
    return str(path)


def engine(config: str, kind: str = "mha", layout: str = "layer_first", tp_rank: int = 0, tp_size: int = 1,
           interface_v1: int = 1, controller: str = "hicache", metrics: bool = False,
           config_from_env: bool = False) -> dict[str, Any]:
    """One SGLang rank: ``controller`` "hicache" (HiCacheController) or "hybrid" (UnifiedRadixCache's);
    the kvpool config named in the extra config, or (``config_from_env``) by $KVPOOL_CONFIG_PATH only."""
    return {"config": config, "kind": kind, "layout": layout, "tp_rank": tp_rank, "tp_size": tp_size,
            "interface_v1": interface_v1, "page_size": PAGE, "model": MODEL, "controller": controller,
            "metrics": metrics, "config_from_env": config_from_env}


def drive(python: str, tmp: Path, name: str, engines: dict[str, dict], steps: list[dict]) -> dict[str, Any]:
    """Run the driver on a spec; {"info": {engine: info}, step name: result}. Fails on a driver error."""
    spec = tmp / f"{name}.json"
    spec.write_text(json.dumps({"engines": engines, "steps": steps}))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ROOT / "build" / "sglang-venv" / "torch_extensions")}
    proc = subprocess.run([python, str(DRIVER), str(spec)], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, f"driver {name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    out: dict[str, Any] = {"info": {}, "log": proc.stderr}
    for line in proc.stdout.splitlines():
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if "engine" in record:
            out["info"][record["engine"]] = record["info"]
        else:
            out[record.pop("step")] = record
    return out


# Two SGLang processes for the whole module (each takes ~15 s to import SGLang): one stores, a fresh one reads.
TEN, EIGHT = prompt(1, 10 * PAGE), prompt(2, 8 * PAGE)
MLA_TOKENS, DOWN_TOKENS, HYBRID_TOKENS = prompt(4, 6 * PAGE), prompt(6, 4 * PAGE), prompt(7, 5 * PAGE)


@pytest.fixture(scope="module")
def runs(python, pool, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The writer's and the reader's results, and the pool's status before, between and after."""
    tmp = tmp_path_factory.mktemp("sglang-runs")
    config = write_config(tmp / "kvpool.json", pool.master)
    down = write_config(tmp / "down.json", f"127.0.0.1:{free_port()}")  # no pool listens there
    engines = {
        "lf": engine(config),  # MHA, layer_first host pool, zero-copy calls (interface_v1)
        "pf": engine(config, layout="page_first"),
        "generic": engine(config, interface_v1=0),  # the generic batch_get/batch_set path
        "tp1": engine(config, tp_rank=1, tp_size=2),
        "mla0": engine(config, kind="mla", tp_rank=0, tp_size=2),
        "mla1": engine(config, kind="mla", tp_rank=1, tp_size=2),
        # The controller a 0.5.23 server runs (UnifiedRadixCache's HybridCacheController), storage metrics on.
        "hybrid": engine(config, controller="hybrid", metrics=True),
        "hybrid_mla1": engine(config, kind="mla", tp_rank=1, tp_size=2, controller="hybrid"),
    }
    status = [pool.status()]
    written = drive(python, tmp, "writer", engines, [
        {"name": "lf", "op": "write", "engine": "lf", "tokens": TEN, "seed": 1},
        {"name": "pf", "op": "write", "engine": "pf", "tokens": EIGHT, "seed": 2},
        {"name": "generic", "op": "write", "engine": "generic", "tokens": EIGHT, "seed": 3},
        # MLA: rank 1 first (SGLang skips its backup), then the writer rank 0.
        {"name": "mla1", "op": "write", "engine": "mla1", "tokens": MLA_TOKENS, "seed": 5},
        {"name": "mla_after_rank1", "op": "read", "engine": "mla0", "tokens": MLA_TOKENS},
        {"name": "mla0", "op": "write", "engine": "mla0", "tokens": MLA_TOKENS, "seed": 5},
        # The backend's own guard: a set on the non-writer rank stores nothing and says the writer has it.
        {"name": "mla1_direct", "op": "call", "engine": "mla1", "method": "batch_set_v1",
         "args": [["d0", "d1"], {"indices": 2}]},
        {"name": "mla0_direct_exists", "op": "call", "engine": "mla0", "method": "batch_exists",
         "args": [["d0", "d1"]]},
        {"name": "hybrid_mla1", "op": "write", "engine": "hybrid_mla1", "tokens": HYBRID_TOKENS, "seed": 8},
        {"name": "hybrid_after_mla1", "op": "read", "engine": "mla0", "tokens": HYBRID_TOKENS},
        {"name": "hybrid", "op": "write", "engine": "hybrid", "tokens": HYBRID_TOKENS, "seed": 9},
        {"name": "hybrid_stats", "op": "call", "engine": "hybrid", "method": "get_stats"},
    ])
    status.append(pool.status())
    engines.update(down=engine(down), down_generic=engine(down, interface_v1=0),
                   lf_env=engine(config, config_from_env=True))
    read = drive(python, tmp, "reader", engines, [
        {"name": "lf", "op": "read", "engine": "lf", "tokens": TEN},
        {"name": "lf_env", "op": "read", "engine": "lf_env", "tokens": TEN},
        {"name": "pf", "op": "read", "engine": "pf", "tokens": EIGHT},
        {"name": "generic", "op": "read", "engine": "generic", "tokens": EIGHT},
        {"name": "mla0", "op": "read", "engine": "mla0", "tokens": MLA_TOKENS},
        {"name": "mla1", "op": "read", "engine": "mla1", "tokens": MLA_TOKENS},
        {"name": "hybrid", "op": "read", "engine": "hybrid", "tokens": HYBRID_TOKENS},
        {"name": "hybrid_stats", "op": "call", "engine": "hybrid", "method": "get_stats"},
        {"name": "hybrid_from_base", "op": "read", "engine": "lf", "tokens": HYBRID_TOKENS},
        # A longer prompt hits its stored leading pages only; another first page breaks the chain at once.
        {"name": "longer", "op": "read", "engine": "lf", "tokens": TEN + prompt(9, 4 * PAGE)},
        {"name": "other", "op": "read", "engine": "lf", "tokens": prompt(3, PAGE) + TEN},
        # Same tokens, another page format or TP rank: keys of their own, nothing shared.
        {"name": "pf_of_lf", "op": "read", "engine": "pf", "tokens": TEN},
        {"name": "tp1_of_lf", "op": "read", "engine": "tp1", "tokens": TEN},
        {"name": "lf_of_generic", "op": "read", "engine": "lf", "tokens": EIGHT},
        # Bad input: refused as a miss, nothing stored (the pool's index is compared below).
        {"name": "short_indices", "op": "call", "engine": "lf", "method": "batch_set_v1",
         "args": [["b0", "b1"], {"indices": 1}]},
        {"name": "float_indices", "op": "call", "engine": "lf", "method": "batch_set_v1",
         "args": [["b0"], {"float_tensor": PAGE}]},
        {"name": "outside_pool", "op": "call", "engine": "lf", "method": "batch_get_v1",
         "args": [["b0"], {"index_tensor": list(range(1 << 30, (1 << 30) + PAGE))}]},
        {"name": "bad_keys", "op": "call", "engine": "lf", "method": "batch_set_v1",
         "args": [["b0", 7], {"indices": 2}]},
        {"name": "empty_key", "op": "call", "engine": "lf", "method": "batch_exists", "args": [[""]]},
        {"name": "wrong_count", "op": "call", "engine": "generic", "method": "batch_set",
         "args": [["b0", "b1"], {"pages": 1}]},
        {"name": "wrong_size", "op": "call", "engine": "generic", "method": "get", "args": ["b0", {"float_tensor": 3}]},
        {"name": "nothing_stored", "op": "call", "engine": "lf", "method": "batch_exists", "args": [["b0", "b1"]]},
        # No pool at all: SGLang attached and serves; every lookup is a miss.
        {"name": "down_read", "op": "read", "engine": "down", "tokens": DOWN_TOKENS},
        {"name": "down_write", "op": "write", "engine": "down", "tokens": DOWN_TOKENS, "seed": 7},
        {"name": "down_read_again", "op": "read", "engine": "down", "tokens": DOWN_TOKENS},
        {"name": "down_generic", "op": "read", "engine": "down_generic", "tokens": DOWN_TOKENS},
        {"name": "down_exists", "op": "call", "engine": "down", "method": "exists", "args": ["x"]},
    ])
    status.append(pool.status())
    return {"written": written, "read": read, "status": status}


def test_sglang_builds_kvpools_backend_through_its_dynamic_loader_and_picks_the_paths_asked_for(runs):
    info = runs["written"]["info"]
    assert {i["backend"] for i in info.values()} == {"kvpool.engines.sglang.KVPoolHiCacheStorage"}
    assert info["lf"]["page_get"] == "_page_get_zero_copy" and info["lf"]["page_set"] == "_page_set_zero_copy"
    assert info["generic"]["page_get"] == "_generic_page_get" and info["generic"]["page_set"] == "_generic_page_set"
    assert info["lf"]["host_pool"] == "MHATokenToKVPoolHost" and info["pf"]["layout"] == "page_first"
    assert info["mla0"]["host_pool"] == "MLATokenToKVPoolHost"
    assert info["lf"]["controller"] == "HiCacheController" and info["hybrid"]["controller"] == "HybridCacheController"
    assert info["hybrid"]["page_get"] == "_page_get_zero_copy"


def test_pages_stored_by_one_sglang_process_are_byte_exact_hits_in_a_fresh_one(runs):
    written, read = runs["written"], runs["read"]
    assert read["lf_env"]["digests"] == written["lf"]["digests"]  # the config found through $KVPOOL_CONFIG_PATH
    for name, pages in (("lf", 10), ("pf", 8), ("generic", 8), ("hybrid", 5)):
        assert written[name]["completed_tokens"] == pages * PAGE, name
        assert written[name]["flushed"] is True
        assert len(set(written[name]["digests"])) == pages  # random pages, all different
        assert read[name]["storage_hit_count"] == pages * PAGE, name  # batch_exists' leading count
        assert read[name]["completed_tokens"] == pages * PAGE, name  # pages batch_get(_v1) loaded
        assert read[name]["digests"] == written[name]["digests"], name  # byte-exact, as SGLang reads its pages


def test_only_the_leading_run_of_stored_pages_is_a_hit(runs):
    read = runs["read"]
    assert read["longer"]["storage_hit_count"] == 10 * PAGE and read["longer"]["completed_tokens"] == 10 * PAGE
    assert read["longer"]["digests"] == runs["written"]["lf"]["digests"]
    # Pages the hybrid controller stored are the base controller's hits: same key space, same bytes.
    assert read["hybrid_from_base"]["digests"] == runs["written"]["hybrid"]["digests"]
    assert read["other"]["storage_hit_count"] == 0  # SGLang's page hashes chain: a new first page, new keys


def test_ranks_and_page_formats_that_hold_different_bytes_never_share_a_key(runs):
    read = runs["read"]
    for name in ("pf_of_lf", "tp1_of_lf", "lf_of_generic"):
        assert read[name]["storage_hit_count"] == 0, name


def test_an_mla_model_stores_once_from_the_writer_rank_and_every_rank_reads_it(runs):
    written, read = runs["written"], runs["read"]
    info = written["info"]
    assert info["mla0"]["is_mla"] and info["mla0"]["writer"] and not info["mla1"]["writer"]
    assert info["mla1"]["backup_skip"] and not info["mla0"]["backup_skip"]
    assert written["mla1"]["completed_tokens"] == 0  # SGLang's controller skips the backup on rank 1
    assert written["mla_after_rank1"]["storage_hit_count"] == 0  # and nothing reached the pool
    assert written["mla0"]["completed_tokens"] == 6 * PAGE
    assert written["mla1_direct"]["answer"] == [True, True] and written["mla1_direct"]["stats"]["writer_skips"] == 2
    assert written["mla0_direct_exists"]["answer"] == 0
    for rank in ("mla0", "mla1"):
        assert read[rank]["completed_tokens"] == 6 * PAGE, rank
        assert read[rank]["digests"] == written["mla0"]["digests"], rank
    # The same under UnifiedRadixCache's controller: its rank 1 skips the KV backup too.
    assert info["hybrid_mla1"]["backup_skip"] and written["hybrid_mla1"]["completed_tokens"] == 0
    assert written["hybrid_after_mla1"]["storage_hit_count"] == 0


def test_storage_metrics_count_the_pages_each_direction_moved(runs):
    assert runs["written"]["hybrid_stats"]["answer"]["backup_pgs"] == [5]
    assert runs["read"]["hybrid_stats"]["answer"]["prefetch_pgs"] == [5]
    assert all(bw > 0 for bw in runs["read"]["hybrid_stats"]["answer"]["prefetch_bandwidth"])


def test_the_pool_holds_one_block_per_page_and_counts_the_hits_kvpool_status_shows(runs):
    before, between, after = runs["status"]
    assert between.indexed_blocks - before.indexed_blocks == 10 + 8 + 8 + 6 + 5  # MLA's 6 once, not once per rank
    assert after.indexed_blocks == between.indexed_blocks  # the reader (bad input included) stored nothing
    hits = after.hit_blocks_dram - between.hit_blocks_dram
    assert hits >= 10 + 10 + 8 + 8 + 6 + 6 + 5 + 5 + 10  # every page the reader loaded, counted by the master


def test_bad_input_is_refused_as_a_miss_and_changes_nothing(runs):
    read = runs["read"]
    assert read["short_indices"]["answer"] == [False, False]
    assert read["float_indices"]["answer"] == [False]
    assert read["outside_pool"]["answer"] == [False]
    assert read["bad_keys"]["answer"] == [False, False]
    assert read["empty_key"]["answer"] == 0
    assert read["wrong_count"]["answer"] is False
    assert read["wrong_size"]["answer"] is None
    assert read["nothing_stored"]["answer"] == 0
    assert read["nothing_stored"]["stats"]["refused"] == 5 and read["wrong_size"]["stats"]["refused"] == 2


def test_with_the_pool_down_sglang_attaches_and_serves_and_every_lookup_is_a_miss(runs):
    read = runs["read"]
    for name in ("down_read", "down_read_again", "down_generic"):
        assert read[name]["storage_hit_count"] == 0 and read[name]["completed_tokens"] == 0, name
    assert read["down_exists"]["answer"] is False
    # A set is accepted into kvpool's write-behind queue (SGLang's backup goes on); the queue drops it when no
    # pool answers, so the same pages are still misses afterwards.
    assert read["down_write"]["completed_tokens"] == 4 * PAGE and read["down_write"]["flushed"] is True


PARSE_EXTRA = """
import json, sys, types
sys.path.insert(0, sys.argv[1])
from sglang_driver import prepare
prepare()
from kvpool.engines.sglang import KVPoolHiCacheStorage
out = []
for value in json.loads(sys.argv[3]):
    cfg = types.SimpleNamespace(extra_config={"kvpool_config_path": sys.argv[2], "interface_v1": value},
                                tp_rank=0, tp_size=1, is_mla_model=False, model_name="m", should_split_heads=False)
    try:
        backend = KVPoolHiCacheStorage(cfg)
    except ValueError as exc:
        out.append(str(exc))
        continue
    out.append(backend.interface_v1)
    backend.close()
print(json.dumps(out))
"""


def test_interface_v1_is_read_as_sglangs_controller_reads_it_or_refused_naming_the_field(python, tmp_path):
    """SGLang's controller picks the zero-copy calls with ``bool(extra_config.get("interface_v1", 0))``: the
    backend must agree, so a string (``"false"`` is true there) is refused, never read the other way round."""
    config = write_config(tmp_path / "kvpool.json", f"127.0.0.1:{free_port()}")  # the backend makes no call
    values = [True, False, 1, 0, "false", "0", "true", 2, None]
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ROOT / "build" / "sglang-venv" / "torch_extensions")}
    proc = subprocess.run([python, "-c", PARSE_EXTRA, str(DRIVER.parent), config, json.dumps(values)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got[:4] == [True, False, True, False]
    field = "hicache-storage-backend-extra-config.interface_v1 must be true or false (or 1/0)"
    for value, answer in zip(values[4:], got[4:]):
        assert isinstance(answer, str) and answer.startswith(field) and repr(value) in answer, (value, answer)
    assert "truth value" in got[4]  # why a word is refused
