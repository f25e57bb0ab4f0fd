"""A real Prometheus, loading deploy/prometheus, scrapes a real `kvpool serve` under real client traffic.

One pool, one client and one Prometheus for the module (started and stopped
here): the traffic mixes HBM, DRAM and SSD hits and misses; then

- the recorded hit rate per tier (blocks and tokens) equals the one the
  client counted for that traffic;
- every query of the Grafana dashboard evaluates without error;
- ``kvpool status --prometheus`` prints those same rates and the nodes' health.

Why the recorded ratio is exact, not approximate: every counter's first
sample in the 5-minute window is the zero scraped before any traffic, and all
of a target's series share their sample timestamps, so ``rate()`` scales
every series by the same extrapolation factor and the ratio is the ratio of
increases. This holds while the module runs within 5 minutes of the first scrape.

Prometheus comes from the Debian package (.ci/run installs it); without the
binary these tests fail, they do not skip. The package's own daemon is never
used: ours listens on a free 127.0.0.1 port with its TSDB under tmp.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml
from support import REPO, PoolProcesses, free_port, metric, scrape, stop_process, wait_until

from kvpool.client.kvclient import KVCacheClient
from kvpool.config import ClientConfig
from kvpool.keys import opaque_key
from kvpool.layout import KVLayout
from kvpool.metrics import TIER_LABELS
from kvpool.status import RECORDED, ratio_percent

ROOT = REPO
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvpool-dashboard.json"
SCRAPE_S = 1
LAYOUT = KVLayout("float32", num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
DEADLINE_S = 60.0  # any single wait on Prometheus


class Prometheus:
    """A prometheus process on 127.0.0.1 with deploy/prometheus's jobs and rules, scraping ``targets``.

    The scrape config is the shipped one with its targets replaced, intervals
    set to 1 s, and rule files made absolute; jobs without a target are dropped.
    """

    def __init__(self, tmp: Path, targets: dict[str, list[str]]):
        exe = shutil.which("prometheus")
        assert exe, "prometheus not found: install it (apt-get install prometheus; .ci/run does)"
        config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
        config["global"].update(scrape_interval=f"{SCRAPE_S}s", evaluation_interval=f"{SCRAPE_S}s")
        config["rule_files"] = [str(PROMETHEUS_DIR / f) for f in config["rule_files"]]
        jobs = [job for job in config["scrape_configs"] if job["job_name"] in targets]
        assert {job["job_name"] for job in jobs} == set(targets), "a job the test scrapes is not in prometheus.yml"
        for job in jobs:
            job["static_configs"] = [{"targets": targets[job["job_name"]]}]
        config["scrape_configs"] = jobs
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "prometheus.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [exe, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT,
            )
        try:
            wait_until(self._ready, timeout=DEADLINE_S, interval=0.1)
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as reply:
                return reply.status == 200
        except (urllib.error.URLError, ConnectionError):
            return False

    def api(self, expr: str) -> dict:
        """``/api/v1/query`` for ``expr`` now: the reply's JSON (``status``, ``data`` or ``error``)."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                return json.load(reply)
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read())

    def series(self, expr: str) -> dict[tuple[tuple[str, str], ...], list[tuple[float, float]]]:
        """Raw samples of a range selector ``expr`` (``x[30s]``): {sorted labels: [(time, value)]}."""
        body = self.api(expr)
        assert body["status"] == "success", body
        return {tuple(sorted(s["metric"].items())): [(float(t), float(v)) for t, v in s["values"]]
                for s in body["data"]["result"]}

    def stop(self) -> None:
        stop_process(self.proc, timeout=20)


@dataclass
class Traffic:
    """What the client counted: blocks and tokens asked for and hit per tier."""

    lookup_blocks: float
    lookup_tokens: float
    hit_blocks: dict[str, float]
    hit_tokens: dict[str, float]
    results_blocks: dict[str, int]  # the same per tier, summed from the LookupResults


def _counted(client: KVCacheClient) -> tuple[float, float, dict[str, float], dict[str, float]]:
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in client.registry.collect() for s in family.samples}
    hit_blocks = {t: metric(samples, "kvpool_hit_blocks_total", tier=t) for t in TIER_LABELS}
    hit_tokens = {t: metric(samples, "kvpool_hit_tokens_total", tier=t) for t in TIER_LABELS}
    return (metric(samples, "kvpool_lookup_blocks_total"), metric(samples, "kvpool_lookup_tokens_total"),
            hit_blocks, hit_tokens)


def _run_traffic(client: KVCacheClient) -> dict[str, int]:
    """Fill DRAM past its watermark (demotions to SSD), then look up and get a mix; per-tier hits seen."""
    keys = [opaque_key(f"ops-{i}") for i in range(24)]
    absent = [opaque_key(f"ops-absent-{i}") for i in range(3)]
    rng = np.random.default_rng(7)
    values = [rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8) for _ in keys]
    for k, v in zip(keys, values):  # one at a time: the oldest blocks are demoted to SSD in LRU order
        assert client.put([k], [v]) == [True]
        assert client.flush(timeout=10)
    seen = dict.fromkeys(TIER_LABELS, 0)

    def lookup(ks):
        result = client.lookup(ks)
        for tier, n in result.by_tier().items():
            seen[tier] += n
        return result

    lookup(keys[20:])  # the last four puts: HBM only
    old = lookup(keys[:6])  # demoted: SSD
    lookup(keys[10:20])  # DRAM
    lookup(keys)  # SSD then DRAM (block 0 is not in HBM, so the pool serves the whole run)
    lookup(keys[20:] + absent)  # HBM, then misses
    lookup(absent)  # misses
    outs = [np.zeros(LAYOUT.block_bytes, np.uint8) for _ in range(6)]
    assert client.get(keys[:6], outs, old) == 6  # from SSD (promoted), into HBM
    assert all(np.array_equal(o, v) for o, v in zip(outs, values[:6]))
    lookup(keys[:6])
    lookup(keys[12:24])
    assert client.flush(timeout=10)  # HBM-only lookups reach the master with this report
    return seen


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    """serve + client + Prometheus, traffic done and scraped; yields (procs, prometheus, traffic)."""
    tmp = tmp_path_factory.mktemp("ops")
    block = LAYOUT.block_bytes
    procs = PoolProcesses(tmp, **{"dram-bytes": str(16 * block), "max-block-bytes": str(block), "ssd-bytes": "64M"})
    prometheus = None
    client = None
    try:
        procs.serve(**{"master-kv-events-endpoint": f"tcp://127.0.0.1:{free_port()}"})  # the events panels' series
        client_metrics = free_port()
        client = KVCacheClient(ClientConfig(master=procs.master, layout=LAYOUT, hbm_blocks=4, lookup_timeout_s=2.0,
                                            io_timeout_s=5.0, metrics_port=client_metrics))
        prometheus = Prometheus(tmp, {
            "kvpool-master": [f"127.0.0.1:{procs.master_metrics_port}"],
            "kvpool-node": [f"127.0.0.1:{procs.node_metrics_port('n0')}"],
            "kvpool-client": [f"127.0.0.1:{client_metrics}"],
        })
        # A zero sample of every counter before any traffic (see the module docstring).
        def all_up() -> bool:
            up = prometheus.series('up{job=~"kvpool-.*"}[1m]')
            return len(up) == 3 and all(samples[-1][1] == 1 for samples in up.values())

        wait_until(all_up, timeout=DEADLINE_S, interval=0.2)
        zero = prometheus.series('kvpool_lookup_blocks_total{job="kvpool-master"}[1m]')
        assert [v for samples in zero.values() for _, v in samples] and all(
            v == 0 for samples in zero.values() for _, v in samples)

        seen = _run_traffic(client)
        lookup_blocks, lookup_tokens, hit_blocks, hit_tokens = _counted(client)
        traffic = Traffic(lookup_blocks, lookup_tokens, hit_blocks, hit_tokens, seen)

        # The counter's final value scraped (t1), then one more scrape (t2 > t1): by then the sample
        # at t1 is committed, so any rule evaluation at or after t2 sees all the traffic.
        def scraped_after() -> float | None:
            samples = [s for ss in prometheus.series('kvpool_lookup_blocks_total{job="kvpool-master"}[1m]').values()
                       for s in ss]
            final = [t for t, v in samples if v == lookup_blocks]
            if not final:
                return None
            later = [t for t, _ in samples if t > final[0]]
            return later[0] if later else None

        t2 = wait_until(scraped_after, timeout=DEADLINE_S, interval=0.2)

        def recorded_since(t: float) -> bool:
            names = (RECORDED["blocks_by_tier"], RECORDED["blocks"], RECORDED["tokens_by_tier"], RECORDED["tokens"])
            for name in names:
                found = prometheus.series(f"{name}[1m]")
                if not found or any(samples[-1][0] < t for samples in found.values()):
                    return False
            return True

        wait_until(lambda: recorded_since(t2), timeout=DEADLINE_S, interval=0.2)
        yield procs, prometheus, traffic
    finally:
        if client is not None:
            client.close()
        if prometheus is not None:
            prometheus.stop()
        procs.close()
    procs.assert_stopped_cleanly()


def _instant(prometheus: Prometheus, expr: str) -> dict[str, float]:
    """An instant vector keyed by its ``tier`` label ('' when it has none)."""
    body = prometheus.api(expr)
    assert body["status"] == "success", body
    return {s["metric"].get("tier", ""): float(s["value"][1]) for s in body["data"]["result"]}


def test_the_traffic_mixes_hbm_dram_and_ssd_hits_and_misses(ops):
    procs, _, traffic = ops
    assert all(traffic.results_blocks[t] > 0 for t in TIER_LABELS), traffic.results_blocks
    assert traffic.hit_blocks == {t: float(n) for t, n in traffic.results_blocks.items()}  # registry == LookupResults
    assert sum(traffic.hit_blocks.values()) < traffic.lookup_blocks  # and misses
    master = scrape(procs.master_metrics_port)  # the master counted exactly what the client did
    assert metric(master, "kvpool_lookup_blocks_total", tenant="") == traffic.lookup_blocks  # auth off: tenant ""
    assert {t: metric(master, "kvpool_hit_blocks_total", tenant="", tier=t) for t in TIER_LABELS} == traffic.hit_blocks
    assert metric(scrape(procs.node_metrics_port("n0")), "kvpool_demotions_total") > 0


def test_recorded_hit_rate_per_tier_equals_what_the_client_counted(ops):
    _, prometheus, traffic = ops
    close = {"rel_tol": 1e-9, "abs_tol": 1e-12}
    for unit, asked, hits in (("blocks", traffic.lookup_blocks, traffic.hit_blocks),
                              ("tokens", traffic.lookup_tokens, traffic.hit_tokens)):
        by_tier = _instant(prometheus, RECORDED[f"{unit}_by_tier"])
        assert set(by_tier) == set(TIER_LABELS), by_tier
        for tier in TIER_LABELS:
            assert math.isclose(by_tier[tier], hits[tier] / asked, **close), (unit, tier, by_tier, hits, asked)
        overall = _instant(prometheus, RECORDED[unit])[""]
        assert math.isclose(overall, sum(hits.values()) / asked, **close), (unit, overall)
        assert math.isclose(sum(by_tier.values()), overall, **close)
    saved = _instant(prometheus, RECORDED["tokens_saved"])[""]
    saved_by_tier = _instant(prometheus, "cluster_tier:kvpool_hit_tokens:rate5m")
    assert saved > 0 and math.isclose(sum(saved_by_tier.values()), saved, rel_tol=1e-9)


_GRAFANA_VARS = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m", "node": ".*"}


def _dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL expression in the dashboard: panel targets (rows included) and query variables."""
    exprs: list[str] = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            found = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
            exprs.append(found.group(1) if found else query)  # label_values(expr, l): evaluate expr
    return exprs


def _substitute(expr: str) -> str:
    """Grafana's template variables, replaced as Grafana would ($node: All)."""
    out = re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", lambda m: _GRAFANA_VARS[m.group(1) or m.group(2)], expr)
    assert "$" not in out, f"unsubstituted variable in {expr!r}"
    return out


def test_every_grafana_query_evaluates_against_the_running_prometheus(ops):
    _, prometheus, _ = ops
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = _dashboard_queries(dashboard)
    assert len(exprs) >= 25
    failed, empty = {}, []
    for expr in exprs:
        body = prometheus.api(_substitute(expr))
        if body["status"] != "success":
            failed[expr] = body.get("error")
        elif not body["data"]["result"] and "kvpool_errors_total" not in expr:  # clean traffic has no errors
            empty.append(expr)
    assert failed == {}
    assert empty == [], "queries that match no series (a misspelt name or label?)"
    # The dashboard plots the recorded hit rates `kvpool status` prints, not its own variants.
    text = DASHBOARD.read_text()
    assert all(RECORDED[k] in text for k in ("blocks_by_tier", "blocks", "tokens_by_tier", "tokens", "tokens_saved"))


def test_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = []

    def walk(panels):
        for p in panels:
            ids.append(p["id"])
            assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
            if p["type"] != "row":
                assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for needed in ("hit rate per tier", "tokens saved", "used per tier per node", "capacity per tier per node",
                   "lookup latency", "get latency", "put latency", "evictions", "demotions", "errors by kind"):
        assert needed in titles, needed


def test_status_prints_the_dashboards_hit_rates_and_node_health(ops):
    procs, prometheus, traffic = ops
    done = subprocess.run([sys.executable, "-m", "kvpool.cli", "status", "--master", procs.master,
                           "--prometheus", prometheus.url], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for unit, asked, hits in (("blocks", traffic.lookup_blocks, traffic.hit_blocks),
                              ("tokens", traffic.lookup_tokens, traffic.hit_tokens)):
        cells = "   ".join(f"{t.upper()} {ratio_percent(hits[t] / asked)}" for t in TIER_LABELS)
        assert f"by {unit}:  {cells}   overall {ratio_percent(sum(hits.values()) / asked)}" in out, out
    assert re.search(r"^n0 .* ok +\d+(\.\d+)? ms ago", out, re.MULTILINE), out  # health and heartbeat in ms
    assert "kvpool-node: 1/1 target(s) up" in out and "kvpool-master: 1/1 target(s) up" in out, out
    assert re.search(r"lookup latency \(kvpool-client\): p50 [\d.]+ ms   p99 [\d.]+ ms", out), out
    # every lookup of this same-host client was answered from the node's arena: none reached the master's histogram
    assert "lookup latency (kvpool-master): p50 -   p99 -" in out, out
    assert re.search(r"tokens saved: [\d.]+ [kM]?/s   lookups: [\d.]+ [kM]?/s", out), out
