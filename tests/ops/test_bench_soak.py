"""`kvpool bench soak`: a few seconds through the CLI, then the report's fields; and the flatness rule itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvpool.bench.procstat import (
    FlatRule,
    ProcSample,
    ProcSeries,
    read_proc,
    slope_per_minute,
)
from kvpool.bench.soak import PREFIX, remove_stale
from kvpool.tiers.arena import SHM_DIR


def series(name: str, rss: list[int], fds: list[int], threads: list[int] | None = None) -> ProcSeries:
    s = ProcSeries(name, 1)
    for i, (r, f) in enumerate(zip(rss, fds)):
        s.add(ProcSample(float(i), r, r, 0, 0, f, (threads or [10] * len(rss))[i]))
    return s


def test_slope_and_rule_tell_a_leak_from_noise() -> None:
    assert abs(slope_per_minute([0, 30, 60], [100, 200, 300]) - 200.0) < 1e-9
    assert slope_per_minute([5], [1]) == 0.0
    rule = FlatRule(rss_pct=5, rss_mib=16)
    # Noise: RSS wobbles, a transient fd now and then (floors unchanged).
    noisy = series("noisy", [100_000, 100_400, 99_900, 100_300] * 5, [12, 14, 12, 12] * 5)
    # A pool that opened two more connections half-way (a step, within the slack).
    stepped = series("stepped", [100_000] * 20, [12] * 10 + [14] * 10)
    assert rule.check(noisy, warmup_s=0) == [] and rule.check(stepped, warmup_s=0) == []
    # A leak: one fd more every other sample, RSS up 20%.
    leaky = series("leaky", [100_000 + 1_000 * i for i in range(20)], [12 + i // 2 for i in range(20)])
    reasons = rule.check(leaky, warmup_s=0)
    assert any("private memory grew" in r for r in reasons) and any("fds floor 12 -> 19" in r for r in reasons)
    # Growth during the warm-up is not judged.
    warm = series("warm", [50_000] * 5 + [100_000] * 15, [5] * 5 + [12] * 15)
    assert rule.check(warm, warmup_s=5) == []
    assert "fewer than 2 samples" in rule.check(warm, warmup_s=100)[0]
    # Mapped-file pages (LMDB's data file growing to its map size) are not private memory.
    mapped = ProcSeries("mapped", 1)
    for i in range(20):
        mapped.add(ProcSample(float(i), 100_000 + 2_000 * i, 60_000, 40_000 + 2_000 * i, 0, 12, 10))
    assert rule.check(mapped, warmup_s=0) == []


def test_read_proc_sees_this_process() -> None:
    s = read_proc(os.getpid(), 1.5)
    assert s is not None and s.t == 1.5 and s.rss_kib > 0 and s.fds > 0 and s.threads >= 1
    assert s.anon_kib + s.file_kib + s.shmem_kib <= s.rss_kib + 4
    assert read_proc(2**22 + 12345, 0.0) is None  # no such pid


def test_leftovers_of_a_killed_driver_are_removed(tmp_path) -> None:
    dead, alive = 4_194_399, os.getpid()  # above any pid_max: never a live process
    shm = os.path.join(SHM_DIR, f"{PREFIX}{dead}-abc123-n0")
    open(shm, "wb").close()
    (tmp_path / f"{PREFIX}{dead}-xyz").mkdir()
    (tmp_path / f"{PREFIX}{alive}-xyz").mkdir()
    try:
        removed = remove_stale(str(tmp_path))
    finally:
        if os.path.exists(shm):
            os.unlink(shm)
    assert shm in removed and str(tmp_path / f"{PREFIX}{dead}-xyz") in removed
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{PREFIX}{alive}-xyz"]


def test_short_soak_through_the_cli(tmp_path) -> None:
    out = tmp_path / "soak.json"
    before = set(os.listdir(SHM_DIR))
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool.cli", "bench", "soak", "--duration", "6", "--clients", "2", "--churn", "1",
         "--nodes", "1", "--block-bytes", "16K", "--dram-bytes", "1M", "--ssd-bytes", "4M", "--hbm-blocks", "16",
         "--interval", "0.5", "--ssd-dir", str(tmp_path), "--no-progress", "--json", str(out),
         # Six seconds (3 samples a quarter) cannot show a slow leak, and the churn process's counts swing with
         # every client it opens: wide limits keep this a test of the machinery, not of noise.
         "--rss-growth-pct", "50", "--rss-growth-mib", "64", "--count-slack", "32"],
        capture_output=True, text=True, timeout=90, check=False,
    )
    assert out.exists(), proc.stderr[-3000:]
    report = json.loads(out.read_text())
    t = report["totals"]
    assert t["requests"] > 0 and t["blocks"] > 0 and t["put_blocks"] > 0
    assert t["wrong_blocks"] == 0 and t["errors"] == {} and t["exceptions"] == {}
    assert sum(t["hits"].values()) > 0 and 0 < t["overall_hit_ratio"] <= 1
    assert t["clients_opened"] == t["clients_closed"] >= 3  # the churn process made and closed clients
    assert 0 < t["max_request_s"] < 30
    assert report["pool_errors"] == {} and report["died"] == {}
    names = {p["name"] for p in report["processes"]}
    assert names == {"master", "node0", "client0", "client1", "churn2"}
    for p in report["processes"]:
        assert len(p["samples"]) >= 8, p["name"]
        s = p["summary"]
        assert s["rss_kib"]["start"] > 0 and s["fds"]["end"] > 0 and s["threads"]["max"] >= 1
    assert report["verdict"]["ok"], report["verdict"]["reasons"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| master |" in proc.stdout and "Verdict: PASS" in proc.stdout
    # Everything it started is gone: no arena left in /dev/shm, no temporary directory left.
    assert not {n for n in set(os.listdir(SHM_DIR)) - before if n.startswith("kvpool-soak-")}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("kvpool-soak-")]
