"""Issue 16, routing: ``Master.Score`` on a real `kvpool serve` equals what each worker's lookup then hits;
``kvpool route`` prints it; each worker's HBM goes out as GPU events on its own topic.

Workers are real :class:`KVCacheClient` instances with an HBM tier (torch tensors on the CPU), reporting
to the master over real gRPC; the pool is one real node with a small DRAM so that some blocks live on SSD.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import grpc
import pytest
import zmq
from event_support import Collector, MediaModel
from support import PoolProcesses, free_port, metric, scrape, wait_until

from kvpool.config import ClientConfig
from kvpool.events import MEDIUM_GPU, key_hash
from kvpool.keys import opaque_key
from kvpool.routing import ScoreClient, rank
from kvpool.v1 import master_pb2, master_pb2_grpc

torch = pytest.importorskip("torch")  # the client extra; CI installs it
from kvpool.client.kvclient import KVCacheClient  # noqa: E402
from kvpool.layout import KVLayout  # noqa: E402

LAYOUT = KVLayout("float32", num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)  # 32 KiB blocks


@pytest.fixture
def procs(tmp_path):
    p = PoolProcesses(tmp_path, **{"dram-bytes": "4M", "ssd-bytes": "64M", "max-block-bytes": "64K"})
    yield p
    p.close()
    p.assert_stopped_cleanly()


def worker(procs: PoolProcesses, name: str, hbm_blocks: int = 24) -> KVCacheClient:
    return KVCacheClient(ClientConfig(master=procs.master, worker_id=name, layout=LAYOUT, hbm_blocks=hbm_blocks,
                                      lookup_timeout_s=2.0, io_timeout_s=5.0))


def tensors(n: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(LAYOUT.block_bytes // 4, generator=gen) for _ in range(n)]


def test_score_equals_what_each_workers_lookup_then_hits_and_hbm_events_name_the_worker(procs):
    pub = f"tcp://127.0.0.1:{free_port()}"
    procs.serve(**{"master-kv-events-endpoint": pub})
    ctx = zmq.Context()
    sub = Collector(ctx, pub, b"kvpool/hbm/")
    try:
        wait_until(lambda: metric(scrape(procs.master_metrics_port), "kvpool_event_subscribers") == 1)
        chains = {name: [opaque_key(f"route-{name}-{i}") for i in range(160)] for name in ("a", "b")}
        shared = [opaque_key(f"route-shared-{i}") for i in range(40)]
        with worker(procs, "w1") as w1, worker(procs, "w2") as w2:
            # 360 blocks of 32 KiB: DRAM (4 MiB) keeps the newest, the first ones are demoted to SSD.
            w1.put(shared + chains["a"], tensors(200, 1))
            w2.put(shared + chains["b"], tensors(200, 2))
            assert w1.flush(timeout=20) and w2.flush(timeout=20)
            # Each HBM (24 blocks) kept its newest puts; load some older blocks back into w2's.
            run = w2.lookup(shared)
            assert w2.get(shared, [torch.zeros(LAYOUT.block_bytes // 4) for _ in shared], run) == len(shared)
            assert w2.flush(timeout=20)
            pool_tiers = {r.ssd_blocks > 0 for r in (w1.lookup([k]) for k in shared + chains["a"][:60])}
            assert pool_tiers == {True, False}, "test setup: the pool should hold blocks in both DRAM and SSD"

            rng = random.Random(5)
            prompts = [shared[:40], shared + chains["a"][:30], chains["a"][130:], chains["b"][150:] + chains["a"][:5],
                       shared[:10] + [opaque_key("never-stored")] + chains["a"][:20], []]
            for _ in range(30):
                name = rng.choice("ab")
                start = rng.randrange(0, 160)
                prompts.append(chains[name][start:start + rng.randrange(1, 60)])
            with ScoreClient(ClientConfig(master=procs.master, lookup_timeout_s=2.0)) as scores:
                for keys in prompts:
                    score = scores.score(keys, ["w1", "w2", "w3"])
                    assert score is not None and [w.worker for w in score.workers] == ["w1", "w2", "w3"]
                    for client, got in zip((w1, w2), score.workers):
                        hit = client.lookup(keys)
                        assert (got.hbm, got.dram, got.ssd) == (hit.hbm_blocks, hit.dram_blocks, hit.ssd_blocks), \
                            (got, hit)
                    w3 = score.workers[2]  # unknown: an empty HBM, the pool's own run
                    assert (w3.hbm, w3.dram, w3.ssd) == (0, score.pool_dram, score.pool_ssd)
                everyone = scores.score(chains["a"][150:])  # no worker named: every worker the master knows
                assert everyone is not None and sorted(w.worker for w in everyone.workers) == ["w1", "w2"]
                assert rank(everyone)[0].worker == "w1"  # its HBM holds the newest blocks of chain a
            assert metric(scrape(procs.master_metrics_port), "kvpool_score_seconds_count") >= len(prompts) + 1

            # The GPU events of each worker's topic rebuild exactly what its HBM holds.
            def hbm_events_agree() -> bool:
                for name, client in (("w1", w1), ("w2", w2)):
                    model = MediaModel()
                    for topic, _, batch in list(sub.got):
                        if topic == f"kvpool/hbm/{name}".encode():
                            model.apply(batch)
                    everything = shared + chains["a"] + chains["b"]
                    held = {key_hash(k) for k, h in zip(everything, client.hbm.contains(everything)) if h}
                    if {h for h, media in model.media.items() if MEDIUM_GPU in media} != held:
                        return False
                return True

            wait_until(hbm_events_agree, timeout=10)
    finally:
        sub.close()
        ctx.term()


def test_score_refuses_bad_requests_clearly(procs):
    procs.serve()
    with grpc.insecure_channel(procs.master) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        for request, message in (
            (master_pb2.ScoreRequest(keys=b"x" * 33), "multiple of 32"),
            (master_pb2.ScoreRequest(keys=b"", worker_ids=[""]), "worker id"),
            (master_pb2.ScoreRequest(keys=b"", worker_ids=["w"] * 5000), "at most 4096"),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                stub.Score(request, timeout=5)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in caught.value.details()
        empty = stub.Score(master_pb2.ScoreRequest(keys=opaque_key("nothing")), timeout=5)
        assert list(empty.workers) == [] and (empty.pool_dram_blocks, empty.pool_ssd_blocks) == (0, 0)


def test_a_score_client_without_a_master_answers_none():
    with ScoreClient(ClientConfig(master=f"127.0.0.1:{free_port()}", lookup_timeout_s=0.5)) as scores:
        assert scores.score([opaque_key("k")]) is None


def test_kvpool_route_prints_each_workers_reuse_for_a_prompt(procs, tmp_path):
    procs.serve()
    tokens = list(range(1000, 1000 + 16 * 6 + 5))  # 6 full blocks and a partial one (no key)
    with worker(procs, "router-w1", hbm_blocks=3) as w1:
        keys = w1.block_keys(tokens)
        assert len(keys) == 6
        w1.put(keys, tensors(6, 3))
        assert w1.flush(timeout=20)
        expected = w1.lookup(keys)
        assert 0 < expected.hbm_blocks < 6 and expected.hit_blocks == 6  # HBM (3 blocks) holds part of the run
        config = tmp_path / "route.json"
        config.write_text(json.dumps({"client": {"master": procs.master, "layout": {
            "dtype": "float32", "num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "block_size": 16}}}))

        def route(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "kvpool.cli", "route", "--config", str(config), *args],
                                  capture_output=True, text=True, timeout=60)

        done = route("--tokens", ",".join(map(str, tokens)), "--workers", "router-w1,nobody")
        assert done.returncode == 0, done.stderr
        assert "prompt: 6 full blocks of 16 tokens" in done.stdout
        rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()[2:4]}
        assert rows["router-w1"] == [str(expected.hbm_blocks), str(expected.dram_blocks), str(expected.ssd_blocks),
                                     "6/6"]
        assert rows["nobody"] == ["0", "6", "0", "6/6"]  # an empty HBM: the pool serves the whole run
        assert "best: router-w1" in done.stdout
        bad = route("--tokens", "1 2 x")
        assert bad.returncode == 2 and "integers" in bad.stderr
    no_layout = subprocess.run([sys.executable, "-m", "kvpool.cli", "route", "--tokens", "1 2 3"],
                               capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert no_layout.returncode == 2 and "client.layout" in no_layout.stderr
