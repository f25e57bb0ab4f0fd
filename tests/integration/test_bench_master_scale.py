"""``benchmarks/master_scale.py --quick``: a real kvpool master and node (and Mooncake's master where its venv is
made), lookup clients in their own processes; every lookup finds exactly the half of its keys that is present
(the workers check each reply), and each point reports a rate and the master's CPU per lookup."""

from __future__ import annotations

import json
import subprocess
import sys

import master_scale  # benchmarks/, on pytest's pythonpath
from compare_mooncake import DEBIAN_LIBS, VENV


def mooncake_ready() -> bool:
    import ctypes.util

    return (VENV / "bin" / "mooncake_master").exists() and all(ctypes.util.find_library(lib) for lib in DEBIAN_LIBS)


def test_quick_run_reports_rate_and_master_cpu_per_lookup(tmp_path):
    systems = "kvpool,mooncake" if mooncake_ready() else "kvpool"
    out = tmp_path / "scale.md"
    done = subprocess.run([sys.executable, master_scale.__file__, "--quick", "--systems", systems, "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [r["clients"] for r in rows] == [1, 8]
    for row in rows:
        for system in systems.split(","):
            point = row[system]
            assert point["lookups_per_s"] > 0 and point["cpu_us"] > 0, (system, point)
    table = out.read_text()
    assert table.startswith("| clients | kvpool lookups/s | Mooncake lookups/s |") and "\n| 8 | " in table
