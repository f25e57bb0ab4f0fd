"""Issue 26: a hostile tenant on the master's routing calls (Score, ReportHbm, Lookup's worker id), and the memory
and CPU one caller can make the master spend through them.

Real `kvpool master` processes on 127.0.0.1 with an auth file of two client tenants, a and b; each test talks to
them over real gRPC with a tenant's token, as a client or a router would. Memory is the master process's
resident set (``VmRSS`` in /proc), CPU its user + system time (/proc/PID/stat). No pool node is needed: the
attacked state is the master's (workers, their HBM keys, lookup counters).
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections.abc import Sequence

import grpc
import pytest
from support import PoolProcesses, metric, scrape, wait_until

from kvpool.keys import KEY_BYTES, BlockKey, opaque_key, pack_keys
from kvpool.rpc import make_channel
from kvpool.v1 import master_pb2, master_pb2_grpc

MIB = 1 << 20
NODE_TOKEN = secrets.token_hex(32)
TOKEN_A = secrets.token_hex(32)
TOKEN_B = secrets.token_hex(32)
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def key(name: str) -> BlockKey:
    return opaque_key(f"routing-attack-{name}")


def keys(prefix: str, n: int) -> list[BlockKey]:
    return [key(f"{prefix}-{i}") for i in range(n)]


def start_master(tmp, **settings: object) -> PoolProcesses:
    """A `kvpool master` with the auth file of tenants a and b and the given master settings."""
    auth = tmp / "auth.json"
    auth.write_text(json.dumps({
        "secret": secrets.token_hex(32),
        "node_tokens": [NODE_TOKEN],
        "clients": {TOKEN_A: {"tenant": "a"}, TOKEN_B: {"tenant": "b"}},
    }))
    config = tmp / "kvpool.json"
    config.write_text(json.dumps({"master": {"server": {"auth_file": str(auth)}, **settings}}))
    procs = PoolProcesses(tmp)
    procs.start_master(config=str(config))
    return procs


class Caller:
    """One tenant's gRPC stub to the master."""

    def __init__(self, procs: PoolProcesses, token: str):
        self.channel = make_channel(procs.master, max_message_bytes=64 * MIB, token=token)
        self.stub = master_pb2_grpc.MasterStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def report(self, worker: str, added: Sequence[BlockKey] = (), removed: Sequence[BlockKey] = (), *,
               full_sync: bool = False) -> master_pb2.ReportHbmResponse:
        return self.stub.ReportHbm(master_pb2.ReportHbmRequest(
            worker_id=worker, added_keys=pack_keys(added), removed_keys=pack_keys(removed), full_sync=full_sync),
            timeout=60)

    def report_lookups(self, worker: str, **counts: int) -> master_pb2.ReportLookupsResponse:
        return self.stub.ReportLookups(master_pb2.ReportLookupsRequest(worker_id=worker, **counts), timeout=60)

    def score(self, prompt: list[BlockKey], workers: Sequence[str] = ()) -> master_pb2.ScoreResponse:
        return self.stub.Score(master_pb2.ScoreRequest(keys=pack_keys(prompt), worker_ids=list(workers)), timeout=60)

    def hbm(self, worker: str, prompt: list[BlockKey]) -> int:
        (only,) = self.score(prompt, [worker]).workers
        return only.hbm_blocks

    def status(self) -> master_pb2.ClusterStatusResponse:
        return self.stub.ClusterStatus(master_pb2.ClusterStatusRequest(), timeout=10)

    def refused(self, method: str, request) -> str:
        """The details of a call the master must refuse with INVALID_ARGUMENT."""
        with pytest.raises(grpc.RpcError) as info:
            getattr(self.stub, method)(request, timeout=60)
        assert info.value.code() == INVALID, (method, info.value.code(), info.value.details())
        detail = info.value.details()
        assert detail
        return detail


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One master (default settings, auth on) for the tests that only add to its state (none may assume it is
    empty: they run in any order)."""
    procs = start_master(tmp_path_factory.mktemp("routing-attacks"))
    try:
        yield procs
    finally:
        procs.close()


@pytest.fixture
def fresh(tmp_path):
    """A master of its own (default settings, auth on), for the tests that measure its memory or list every
    worker a tenant has."""
    procs = start_master(tmp_path)
    try:
        yield procs
    finally:
        procs.close()


def tenants(procs: PoolProcesses) -> tuple[Caller, Caller]:
    return Caller(procs, TOKEN_A), Caller(procs, TOKEN_B)


def rss_mib(procs: PoolProcesses) -> float:
    with open(f"/proc/{procs.procs[0].pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def cpu_s(procs: PoolProcesses) -> float:
    with open(f"/proc/{procs.procs[0].pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


# -- item 1: worker ids are their tenant's --------------------------------------------------------------------


def test_one_tenants_calls_neither_change_nor_reveal_another_tenants_workers(fresh):
    a, b = tenants(fresh)  # a master of its own: it asserts every worker each tenant has
    try:
        prompt = keys("a-prompt", 8)
        a.report("gpu-0", prompt, full_sync=True)
        assert a.hbm("gpu-0", prompt) == 8
        workers_before = a.status().workers

        # B asks for every worker: it learns no name of A's.
        assert [w.worker_id for w in b.score(prompt).workers] == []
        # B's full sync, with nothing, under A's worker id: B's own worker of that name, not A's.
        b.report("gpu-0", [], full_sync=True)
        b.report("b-gpu", keys("b-prompt", 3))
        assert a.hbm("gpu-0", prompt) == 8, "B's full sync emptied A's worker"
        assert [w.worker_id for w in a.score(prompt).workers] == ["gpu-0"]
        assert [w.worker_id for w in b.score(prompt).workers] == ["b-gpu", "gpu-0"]
        # B naming A's worker id is B's own worker (an empty one): it learns nothing of A's.
        assert b.hbm("gpu-0", prompt) == 0
        # B's lookups under A's worker id are B's worker too; A's and B's "gpu-0" are two workers.
        b.stub.Lookup(master_pb2.LookupRequest(keys=pack_keys(prompt), worker_id="gpu-0"), timeout=10)
        assert a.status().workers == workers_before + 2
    finally:
        a.close()
        b.close()


BAD_IDS = {"257 characters": "w" * 257, "a NUL": "gpu\x000", "a newline": "gpu\n0", "a DEL": "gpu\x7f",
           "a C1 control": "gpu\x85"}


def test_worker_ids_are_checked_wherever_they_enter(shared):
    a, b = tenants(shared)
    try:
        prompt = keys("ids", 2)
        for what, bad in BAD_IDS.items():
            for method, request in (
                ("Lookup", master_pb2.LookupRequest(keys=pack_keys(prompt), worker_id=bad)),
                ("ReportHbm", master_pb2.ReportHbmRequest(worker_id=bad, added_keys=pack_keys(prompt))),
                ("Score", master_pb2.ScoreRequest(keys=pack_keys(prompt), worker_ids=["ok", bad])),
            ):
                assert "worker id" in b.refused(method, request), (what, method)
        assert "worker id" in b.refused("ReportHbm", master_pb2.ReportHbmRequest(worker_id=""))
        assert "worker id" in b.refused("Score", master_pb2.ScoreRequest(keys=pack_keys(prompt), worker_ids=[""]))
        longest = "w" * 256  # the longest id: fine everywhere
        b.report(longest, prompt)
        b.stub.Lookup(master_pb2.LookupRequest(keys=pack_keys(prompt), worker_id=longest), timeout=10)
        b.stub.Lookup(master_pb2.LookupRequest(keys=pack_keys(prompt)), timeout=10)  # no id: fine (stats only)
        assert b.hbm(longest, prompt) == 2
        b.report("é-ünïcode-gpu", prompt)  # any printable text
        assert b.hbm("é-ünïcode-gpu", prompt) == 2
    finally:
        a.close()
        b.close()


def test_huge_worker_ids_cost_the_master_no_memory(fresh):
    """20 Lookups and 20 ReportHbms with 8 MiB worker ids used to hold +564 MiB until the worker timeout.

    Each refused call still passes through the allocator (gRPC's buffer, the parsed message: ~24 MiB), whose
    arenas keep some for reuse: after a few such calls RSS stays on that plateau, whatever the number of calls.
    """
    a, b = tenants(fresh)
    try:
        huge = "h" * (8 * MIB)

        def attack(rounds: int) -> None:
            for i in range(rounds):
                b.refused("Lookup", master_pb2.LookupRequest(keys=pack_keys(keys("huge", 1)), worker_id=huge + str(i)))
                b.refused("ReportHbm", master_pb2.ReportHbmRequest(worker_id=huge + str(i), added_keys=pack_keys(
                    keys("huge", 1))))

        b.stub.Lookup(master_pb2.LookupRequest(keys=pack_keys(keys("warm", 1)), worker_id="warm"), timeout=10)
        start = rss_mib(fresh)
        attack(5)
        plateau = rss_mib(fresh)
        attack(20)
        grown = rss_mib(fresh) - plateau
        print(f"\nmaster RSS: {plateau - start:+.0f} MiB after 5 Lookups and 5 ReportHbms with 8 MiB worker ids, "
              f"then {grown:+.0f} MiB after 20 more of each")
        assert grown < 64, f"master RSS grew {grown:.0f} MiB"
        assert a.status().workers == 1  # only "warm"
    finally:
        a.close()
        b.close()


# -- item 2: reported statistics --------------------------------------------------------------------------------


def lookup_counters(procs: PoolProcesses, tenant: str) -> tuple[float, ...]:
    samples = scrape(procs.master_metrics_port)
    return (metric(samples, "kvpool_lookups_total", tenant=tenant),
            metric(samples, "kvpool_lookup_blocks_total", tenant=tenant),
            *(metric(samples, "kvpool_hit_blocks_total", tenant=tenant, tier=t) for t in ("hbm", "dram", "ssd")),
            metric(samples, "kvpool_lookup_tokens_total", tenant=tenant))


def totals(status: master_pb2.ClusterStatusResponse) -> tuple[int, ...]:
    return (status.lookups, status.requested_blocks, status.hit_blocks_hbm, status.hit_blocks_dram,
            status.hit_blocks_ssd)


def test_reported_lookup_counts_are_checked_bounded_and_counted_as_the_reporting_tenants(shared):
    """One report from B set lookups and hit_blocks_hbm to 2**64-1 in ClusterStatus and /metrics (ReportHbm
    carried the counts then; ReportLookups does now)."""
    a, b = tenants(shared)
    try:
        before = totals(a.status()), lookup_counters(shared, "a"), lookup_counters(shared, "b")
        u64 = 2**64 - 1
        b.refused("ReportLookups", master_pb2.ReportLookupsRequest(  # the attack as measured
            worker_id="stats", lookups=u64, requested_blocks=u64, hbm_blocks=u64, block_tokens=2**32 - 1))
        from kvpool.master.servicer import MAX_REPORTED_LOOKUPS

        bad = [
            dict(lookups=1, requested_blocks=u64, hbm_blocks=u64),
            dict(lookups=MAX_REPORTED_LOOKUPS + 1, requested_blocks=MAX_REPORTED_LOOKUPS + 1,
                 hbm_blocks=MAX_REPORTED_LOOKUPS + 1),
            dict(lookups=0, requested_blocks=5, hbm_blocks=5),  # blocks of no lookup
            dict(lookups=1, requested_blocks=1, hbm_blocks=1, block_tokens=2**32 - 1),
            dict(lookups=u64, requested_blocks=u64, hbm_blocks=u64),
            dict(lookups=1, requested_blocks=4, dram_blocks=5),  # more hits than asked for
            dict(lookups=1, requested_blocks=4, hbm_blocks=2, dram_blocks=2, ssd_blocks=1),
            dict(lookups=1, requested_blocks=10**9),
            dict(lookups=0, requested_blocks=3),
        ]
        for counts in bad:
            detail = b.refused("ReportLookups", master_pb2.ReportLookupsRequest(worker_id="stats", **counts))
            assert "ReportLookups" in detail, (counts, detail)
        assert b.refused("Lookup", master_pb2.LookupRequest(keys=pack_keys(keys("s", 1)), worker_id="stats",
                                                            hbm_prefix_blocks=2**32 - 1))
        assert (totals(a.status()), lookup_counters(shared, "a"), lookup_counters(shared, "b")) == before, \
            "a refused report changed the counters"

        # What clients really send passes, and is counted as b's.
        b.report_lookups("stats", lookups=3, requested_blocks=10, hbm_blocks=10, block_tokens=16)  # HBM alone
        b.report_lookups("stats", lookups=2, requested_blocks=20, hbm_blocks=4, dram_blocks=6, ssd_blocks=2,
                         block_tokens=16)  # same-host arenas
        status = totals(a.status())
        assert [now - then for now, then in zip(status, before[0])] == [5, 30, 14, 6, 2]
        assert lookup_counters(shared, "a") == before[1]
        assert [now - then for now, then in zip(lookup_counters(shared, "b"), before[2])] == [5, 30, 14, 6, 2, 30 * 16]
    finally:
        a.close()
        b.close()


# -- item 3: Score's cost ----------------------------------------------------------------------------------------


def test_score_collapses_duplicate_workers_and_bounds_keys_times_workers(shared):
    a, b = tenants(shared)
    try:
        held = keys("held", 1)
        for w in ("dup-x", "dup-y"):
            b.report(w, held)
        reply = b.score(held * 3, ["dup-y", "dup-x", "dup-y", "unknown", "dup-x"])
        assert [(w.worker_id, w.hbm_blocks) for w in reply.workers] == [("dup-y", 3), ("dup-x", 3), ("unknown", 0)]
        from kvpool.master.servicer import MAX_SCORE_CELLS

        n = 65536
        too_many = [f"w{i}" for i in range(MAX_SCORE_CELLS // n + 1)]
        detail = b.refused("Score", master_pb2.ScoreRequest(keys=pack_keys(held) * n, worker_ids=too_many))
        assert "MAX_SCORE_CELLS" in detail
        router = b.score(keys("router", 512), [f"router-{i}" for i in range(64)])  # a router's real call
        assert len(router.workers) == 64
    finally:
        a.close()
        b.close()


def test_a_worst_case_score_costs_bounded_master_cpu_and_a_report_during_one_waits_little(shared):
    """One Score of 65,536 copies of a held key x 4,096 copies of one worker id took 10.6 s of master CPU under the
    HBM lock, and a ReportHbm waited 9.6 s."""
    a, b = tenants(shared)
    try:
        held = keys("hot", 1)
        b.report("hot-0", held)
        attack = master_pb2.ScoreRequest(keys=pack_keys(held) * 65536, worker_ids=["hot-0"] * 4096)
        cpu = cpu_s(shared)
        started = time.perf_counter()
        reply = b.stub.Score(attack, timeout=120)
        wall, cpu = time.perf_counter() - started, cpu_s(shared) - cpu
        print(f"\nScore of 65,536 copies of a held key x 4,096 copies of its worker: {cpu:.2f} s master CPU, "
              f"{wall:.2f} s")
        assert [(w.worker_id, w.hbm_blocks) for w in reply.workers] == [("hot-0", 65536)]
        assert cpu < 1.5
        from kvpool.master.servicer import MAX_SCORE_CELLS

        # The most work one Score may ask for: every distinct worker holds the whole prompt.
        n = 65536
        workers = [f"hot-{i}" for i in range(MAX_SCORE_CELLS // n)]
        for w in workers:
            b.report(w, held)
        cpu = cpu_s(shared)
        reply = b.stub.Score(master_pb2.ScoreRequest(keys=pack_keys(held) * n, worker_ids=workers), timeout=120)
        cpu = cpu_s(shared) - cpu
        print(f"worst Score that passes validation ({n} keys x {len(workers)} workers): {cpu:.2f} s master CPU")
        assert [w.hbm_blocks for w in reply.workers] == [n] * len(workers)
        assert cpu < 3.0

        # A's reports while B's attack runs, three times over.
        scored = []

        def attacker() -> None:
            for _ in range(3):
                scored.append(b.stub.Score(attack, timeout=120))

        thread = threading.Thread(target=attacker)
        mine = keys("a-during", 4)
        waits = []
        thread.start()
        try:
            while thread.is_alive():
                started = time.perf_counter()
                a.report("a-during", mine)
                waits.append(time.perf_counter() - started)
        finally:
            thread.join(timeout=600)
        print(f"A's ReportHbm during B's Scores: {len(waits)} calls, longest {max(waits):.3f} s")
        assert len(scored) == 3 and max(waits) < 2.0
        assert a.hbm("a-during", mine) == 4
    finally:
        a.close()
        b.close()


# -- item 4: ReportHbm's memory ----------------------------------------------------------------------------------


def test_one_workers_hbm_keys_are_capped_and_the_rest_counted_not_kept(fresh):
    """One client took master RSS from 63 to 924 MiB in 6 s reporting HBM keys of one worker."""
    a, b = tenants(fresh)
    try:
        b.report("warm", keys("warm", 1))
        before = rss_mib(fresh)
        sent = 0
        for _ in range(40):
            b.stub.ReportHbm(master_pb2.ReportHbmRequest(worker_id="flood", added_keys=os.urandom(KEY_BYTES * 65536)),
                             timeout=60)
            sent += 65536
        grown = rss_mib(fresh) - before
        print(f"\nmaster RSS after {sent:,} HBM keys reported for one worker: {grown:+.0f} MiB")
        assert grown < 96, f"master RSS grew {grown:.0f} MiB"  # the default cap: 262,144 keys, ~30 MiB
        from kvpool.config import MasterConfig

        cap = MasterConfig().max_hbm_keys_per_worker
        status = a.status()
        assert status.hbm_blocks == cap + 1
        samples = scrape(fresh.master_metrics_port)
        assert metric(samples, "kvpool_errors_total", kind="hbm_keys_not_kept") == sent - cap
        log = (fresh.tmp / "master-0.log").read_text()
        assert log.count("HBM keys not kept") == 1, log[-2000:]
        # A's worker is untouched by B's flood and keeps what it reports.
        mine = keys("a-after-flood", 16)
        a.report("a-gpu", mine)
        assert a.hbm("a-gpu", mine) == 16
    finally:
        a.close()
        b.close()


def test_workers_and_keys_per_tenant_are_capped_and_timed_out_workers_free_room(tmp_path):
    procs = start_master(tmp_path, max_workers_per_tenant=3, max_hbm_keys_per_worker=1000,
                         max_hbm_keys_per_tenant=2500, worker_timeout_s=2.0)
    a, b = tenants(procs)
    try:
        for i in range(3):
            b.report(f"b-{i}", keys(f"b-{i}", 1000))
        new_worker = master_pb2.ReportHbmRequest(worker_id="b-3", added_keys=pack_keys(keys("x", 1)))
        assert "max_workers_per_tenant" in b.refused("ReportHbm", new_worker)
        assert "max_workers_per_tenant" in b.refused("Lookup", master_pb2.LookupRequest(worker_id="b-3"))
        # The tenant's keys stop at its total: the third worker kept 500 of its 1,000.
        assert b.hbm("b-2", keys("b-2", 1000)) == 500  # the first keys of the report are the ones kept
        assert a.status().hbm_blocks == 2500
        samples = scrape(procs.master_metrics_port)
        assert metric(samples, "kvpool_errors_total", kind="hbm_keys_not_kept") == 500
        # A is another tenant: its workers and keys have room of their own.
        for i in range(3):
            a.report(f"a-{i}", keys(f"a-{i}", 800))
        assert a.hbm("a-2", keys("a-2", 800)) == 800

        def b_timed_out() -> bool:  # A keeps reporting, B is silent
            for i in range(3):
                a.report(f"a-{i}")
            return not b.score([]).workers

        wait_until(b_timed_out, timeout=30, interval=0.2)
        b.report("b-3", keys("b-3", 10))
        assert [w.worker_id for w in b.score([]).workers] == ["b-3"]
        assert sorted(w.worker_id for w in a.score([]).workers) == ["a-0", "a-1", "a-2"]
    finally:
        a.close()
        b.close()
        procs.close()
