"""``benchmarks/route.py`` on a bounded multi-turn trace: kvpool's score routes each dialog to the worker whose
HBM holds its earlier rounds; round robin does not. Two real engine workers, a real embedded pool."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import route  # benchmarks/, on pytest's pythonpath
import tracegen


def run_route(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, route.__file__, *args], capture_output=True, text=True, timeout=300)


def test_score_routing_reaches_the_bound_where_round_robin_does_not(tmp_path):
    pytest.importorskip("transformers")
    trace = tmp_path / "dialogs.jsonl"
    assert tracegen.main(["--pattern", "multi-turn", "--requests", "80", "--set", "sessions=12", "--set",
                          "max_first_tokens=8192", "--set", "max_context_tokens=32768", "--out", str(trace)]) == 0
    done = run_route("--trace", str(trace), "--start", "0", "--requests", "80", "--workers", "2",
                     "--configs", "small-pool", "--json", "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    by = {r["policy"]: r for r in report["results"]}
    bound = report["bound"]
    assert bound > 0.3, "test setup: the dialogs should reuse their earlier rounds"
    score, rr = by["score"], by["round-robin"]
    assert score["hit_ratio"]["overall"] >= bound - 0.02  # the aim: within 2 points of an unbounded cache
    assert score["hit_ratio"]["hbm"] > rr["hit_ratio"]["hbm"] + 0.05
    assert score["fallbacks"] == 0 and sum(score["per_worker"]) == 80 and min(score["per_worker"]) >= 20
