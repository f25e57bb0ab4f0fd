"""`kvpool status` rendering: human units, node health, both sources, and ``--json``; run against live processes
here (``--json``), in test_ops_prometheus.py (rates) and test_services.py (table)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
from support import PoolProcesses, free_port, wait_until

from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig
from kvpool.keys import opaque_key
from kvpool.status import (
    DashboardRates,
    human_bytes,
    human_rate,
    human_seconds,
    node_health,
    rates_fields,
    ratio_percent,
    render_dashboard_rates,
    render_status,
)
from kvpool.v1 import common_pb2, master_pb2

GIB = 1 << 30


def _status() -> master_pb2.ClusterStatusResponse:
    dram, ssd = common_pb2.TIER_DRAM, common_pb2.TIER_SSD

    def usage(tier: common_pb2.Tier, used: int, cap: int, blocks: int) -> common_pb2.TierUsage:
        return common_pb2.TierUsage(tier=tier, used_bytes=used, capacity_bytes=cap, blocks=blocks)

    return master_pb2.ClusterStatusResponse(
        nodes=[
            master_pb2.NodeStatus(node=common_pb2.NodeRef(node_id="host-a", address="10.0.0.1:7610"),
                                  tiers=[usage(dram, 48 * GIB, 64 * GIB, 24576),
                                         usage(ssd, 900 * GIB, 1024 * GIB, 460800)],
                                  seconds_since_heartbeat=0.25),
            master_pb2.NodeStatus(node=common_pb2.NodeRef(node_id="host-b", address="10.0.0.2:7610"),
                                  tiers=[usage(dram, 0, 64 * GIB, 0)], seconds_since_heartbeat=2.6),
        ],
        indexed_blocks=485376, workers=8, hbm_blocks=1000,
        lookups=400, requested_blocks=1000, hit_blocks_hbm=100, hit_blocks_dram=500, hit_blocks_ssd=250,
    )


def test_units_are_for_humans():
    assert (human_bytes(1536), human_bytes(48 * GIB), human_bytes(900)) == ("1.5 KiB", "48.0 GiB", "900 B")
    assert (human_seconds(0.00042), human_seconds(0.35), human_seconds(4.2)) == ("0.42 ms", "350 ms", "4.2 s")
    assert (human_rate(1234.5), human_rate(0.031), human_rate(42.0)) == ("1.2 k/s", "0.03 /s", "42.0 /s")
    assert (ratio_percent(0.6667), ratio_percent(None), ratio_percent(math.nan)) == (" 66.7%", "     -", "     -")
    assert human_seconds(math.nan) == human_rate(math.nan) == "-"


def test_the_master_table_shows_health_usage_in_gib_and_hit_rates_per_tier():
    out = render_status("m:7600", _status())
    a = next(line for line in out.splitlines() if line.startswith("host-a"))
    b = next(line for line in out.splitlines() if line.startswith("host-b"))
    assert " ok " in a and "250 ms ago" in a
    assert "48.0 GiB / 64.0 GiB (75.0%, 24576 blk)" in a and "900.0 GiB / 1.0 TiB (87.9%, 460800 blk)" in a
    assert " late " in b and "2.6 s ago" in b and b.rstrip().endswith("-")  # no SSD tier
    assert "HBM  10.0%   DRAM  50.0%   SSD  25.0%   overall  85.0%" in out
    assert node_health(1.99) == "ok" and node_health(2.0) == "late"


def test_an_idle_master_shows_dashes_not_a_division_by_zero():
    out = render_status("m:7600", master_pb2.ClusterStatusResponse())
    assert "(no nodes registered)" in out and "overall      -" in out


def test_the_prometheus_part_names_down_targets_and_missing_rates():
    rates = DashboardRates(
        blocks_by_tier={"hbm": 0.1, "dram": 0.5, "ssd": 0.25}, blocks=0.85,
        tokens_by_tier={"hbm": 0.1, "dram": 0.5}, tokens=math.nan,
        tokens_saved_per_s=12500.0, lookups_per_s=40.0,
        lookup_p50_s={"kvpool-master": 0.0002}, lookup_p99_s={"kvpool-master": 0.0031},
        targets=[("kvpool-master", "m:7601", True), ("kvpool-node", "a:7611", True), ("kvpool-node", "b:7611", False)],
    )
    out = render_dashboard_rates("http://prom:9090", rates)
    assert "by blocks:  HBM  10.0%   DRAM  50.0%   SSD  25.0%   overall  85.0%" in out
    assert "by tokens:  HBM  10.0%   DRAM  50.0%   SSD      -   overall      -" in out
    assert "tokens saved: 12.5 k/s   lookups: 40.0 /s" in out
    assert "lookup latency (kvpool-master): p50 0.20 ms   p99 3.10 ms" in out
    assert "kvpool-node: 1/2 target(s) up; DOWN: b:7611" in out and "kvpool-master: 1/1 target(s) up" in out
    assert "none with job" in render_dashboard_rates("http://prom:9090", DashboardRates())


def test_unreachable_master_and_prometheus_are_each_reported():
    master, prom = f"127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    done = subprocess.run([sys.executable, "-m", "kvpool.cli", "status", "--master", master, "--timeout", "0.5",
                           "--prometheus", prom], check=False, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert "cannot reach the master" in done.stderr and f"cannot read Prometheus at {prom}" in done.stderr


# -- --json: the same numbers for scripts, stable names (docs/operations.md) ------------------------------------------

REPORT_FIELDS = {"master", "masters", "cluster", "prometheus", "errors"}
CLUSTER_FIELDS = {"master", "nodes", "indexed_blocks", "workers", "hbm_blocks", "lookups", "requested_blocks",
                  "hit_blocks", "hit_ratio", "refused_blocks", "largest_refused_bytes", "largest_block_bytes"}
NODE_FIELDS = {"node_id", "address", "health", "seconds_since_heartbeat", "incarnation", "dram", "ssd"}
TIER_FIELDS = {"used_bytes", "capacity_bytes", "blocks"}


def _status_json(*args: str) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, "-m", "kvpool.cli", "status", "--json", *args], check=False,
                          capture_output=True, text=True, timeout=60)
    return done.returncode, json.loads(done.stdout)  # one JSON document, whatever happened


def test_status_json_is_what_the_table_shows_of_a_running_pool(tmp_path):
    procs = PoolProcesses(tmp_path)
    try:
        procs.serve()
        keys = [opaque_key(f"status-json-{i}") for i in range(5)]
        with PoolClient(ClientConfig(master=procs.master, shared_memory=False, strict=True)) as pool:
            assert pool.store(keys, [np.full(64 << 10, i, np.uint8) for i in range(5)]) == [True] * 5
            assert pool.flush(30)
            assert len(pool.lookup(keys)) == 5  # one master lookup of 5 blocks, all in DRAM
        # tier usage comes with heartbeats: wait for one after the puts
        wait_until(lambda: [t.blocks for t in procs.status().nodes[0].tiers if t.tier == common_pb2.TIER_DRAM] == [5])
        code, report = _status_json("--master", procs.master)
        table = subprocess.run([sys.executable, "-m", "kvpool.cli", "status", "--master", procs.master],
                               check=True, capture_output=True, text=True, timeout=60).stdout
    finally:
        procs.close()
    assert code == 0 and set(report) == REPORT_FIELDS, report
    assert report["master"] == procs.master and report["errors"] == []
    assert report["masters"] is None and report["prometheus"] is None  # no etcd target, no --prometheus
    cluster = report["cluster"]
    assert set(cluster) == CLUSTER_FIELDS, cluster
    assert (cluster["indexed_blocks"], cluster["workers"], cluster["hbm_blocks"]) == (5, 1, 0)  # 1: the looker-up
    assert (cluster["lookups"], cluster["requested_blocks"]) == (1, 5)
    assert cluster["hit_blocks"] == {"hbm": 0, "dram": 5, "ssd": 0}
    assert cluster["hit_ratio"] == {"hbm": 0.0, "dram": 1.0, "ssd": 0.0, "overall": 1.0}
    assert cluster["refused_blocks"] == 0
    [node] = cluster["nodes"]
    assert set(node) == NODE_FIELDS, node
    assert node["node_id"] == "n0" and node["address"] == procs.node_address("n0") and node["health"] == "ok"
    assert 0 <= node["seconds_since_heartbeat"] < 2.0 and node["incarnation"] > 0
    assert set(node["dram"]) == set(node["ssd"]) == TIER_FIELDS
    assert node["dram"]["capacity_bytes"] == 8 << 20 and node["dram"]["blocks"] == 5
    assert node["dram"]["used_bytes"] >= 5 * (64 << 10) and node["ssd"]["capacity_bytes"] == 64 << 20
    # the table shows the same numbers
    assert "1 node(s), 5 blocks indexed" in table and "(1 lookups, 5 blocks asked for)" in table
    assert "DRAM 100.0%" in table and "8.0 MiB" in table


def test_status_json_says_what_could_not_be_read_and_stays_json():
    master, prom = f"127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    code, report = _status_json("--master", master, "--timeout", "0.5", "--prometheus", prom)
    assert code == 1 and set(report) == REPORT_FIELDS
    assert report["cluster"] is None and report["prometheus"] is None
    assert len(report["errors"]) == 2 and "cannot reach the master" in report["errors"][0]
    assert f"cannot read Prometheus at {prom}" in report["errors"][1]


def test_the_prometheus_part_in_json_has_nulls_where_there_is_no_rate():
    rates = DashboardRates(blocks_by_tier={"dram": 0.5}, blocks=math.nan, lookups_per_s=40.0,
                           lookup_p99_s={"kvpool-master": 0.0031}, targets=[("kvpool-node", "b:7611", False)])
    fields = rates_fields("http://prom:9090", rates)
    json.dumps(fields, allow_nan=False)  # no NaN: JSON has none
    assert fields["hit_ratio_by_blocks"] == {"hbm": None, "dram": 0.5, "ssd": None, "overall": None}
    assert fields["lookups_per_s"] == 40.0 and fields["tokens_saved_per_s"] is None
    assert fields["lookup_p99_s"] == {"kvpool-master": 0.0031}
    assert fields["targets"] == [{"job": "kvpool-node", "instance": "b:7611", "up": False}]
