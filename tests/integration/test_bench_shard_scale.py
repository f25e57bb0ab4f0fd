"""``benchmarks/shard_scale.py --quick``: a real etcd, a one-shard and a two-shard cluster (master processes, a
node each), lookup clients in their own processes (a ShardedMaster each for S = 2); every lookup finds exactly
the half of its keys that is present (the workers check each reply, across both shards), and each point reports
both clusters' rates and master CPU per lookup, flat out and at equal load (paced: never above the offered
rate)."""

from __future__ import annotations

import json
import subprocess
import sys

import shard_scale  # benchmarks/, on pytest's pythonpath


def test_quick_run_reports_both_clusters_flat_out_and_at_equal_load(tmp_path):
    out = tmp_path / "shards.md"
    done = subprocess.run([sys.executable, shard_scale.__file__, "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [(r["lookup_keys"], r["clients"]) for r in rows] == [(64, 1), (64, 8)]
    for row in rows:
        for point in ("S1", "S2", "S1_equal", "S2_equal"):
            assert row[point]["lookups_per_s"] > 0 and row[point]["cpu_us"] > 0, (point, row[point])
        # Equal load is paced: never more than offered (0.8 x the slower cluster's flat-out rate), with slack
        # for the counted window's edges.
        offered = 0.8 * min(row["S1"]["lookups_per_s"], row["S2"]["lookups_per_s"])
        assert max(row["S1_equal"]["lookups_per_s"], row["S2_equal"]["lookups_per_s"]) < 1.2 * offered, row
    assert out.read_text().startswith("| keys/lookup | clients | fan-out |")
