"""tests/gpu/check.sh's dry run (``--cpu``: CPU tensors, the host copier, the same flow), so the GPU check does
not rot where no GPU is: a real pool, every child process, the summary it writes, and what it does when a step
fails. The GPU run itself needs an NVIDIA GPU (tests/gpu/README.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import TESTS

GPU = TESTS / "gpu"


def run_check(out: Path, *flags: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(GPU / "check.sh"), "--cpu", "--no-install", "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_the_dry_run_passes_every_check_and_writes_its_summary(tmp_path):
    done = run_check(tmp_path / "out")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert summary["mode"] == "cpu" and summary["ok"] is True
    checks = summary["checks"]
    assert set(checks) == {"env", "pool", "copier", "engine"} and all(c["ok"] for c in checks.values()), checks
    assert summary["env"]["device"].startswith("cpu") and summary["env"]["torch"]
    assert set(summary["step_seconds"]) == {"env", "pool", "copier-put", "copier-get", "engine-store", "engine-hit"}

    shapes = checks["copier"]["shapes"]
    assert set(shapes) == {"per-layer", "whole-block"}
    for shape in shapes.values():
        assert shape["copier"] == "host" and shape["bytes_equal"] is True
        blocks = shape["bytes"] // (shape["pieces"] * shape["piece_bytes"])
        assert shape["put_stats"] == {"put_blocks": 3 * blocks, "put_accepted": 3 * blocks}  # 3 rounds, new keys
        assert shape["get_stats"] == {"get_blocks": 3 * blocks, "get_hits": 3 * blocks}  # every round loaded all
        for figure in ("put_gbps", "get_gbps", "copier_d2h_gbps", "copier_h2d_gbps", "torch_d2h_gbps",
                       "torch_h2d_gbps"):
            assert shape[figure] > 0, figure

    engine = checks["engine"]
    assert engine["tokens_equal"] is True and engine["tokens_stable_across_rounds"] is True
    assert engine["reused_tokens"] == 8 * 16 and engine["prompt_tokens"] == 8 * 16 + 8  # every full block, from DRAM
    assert engine["hit_ttft_ms"] > 0 and engine["recompute_ttft_ms"] > 0
    assert engine["store_tokens"] == engine["hit_tokens"] == engine["layerwise_tokens"] == engine["recompute_tokens"]
    assert engine["layerwise_hit_ttft_ms"] > 0 and engine["own_forward_ms"] > 0

    table = (tmp_path / "out" / "gpu-check.txt").read_text()
    assert table in done.stdout and "overall: PASS" in table and "FAIL" not in table


def test_a_step_that_times_out_fails_the_run_and_the_summary_says_why(tmp_path):
    done = run_check(tmp_path / "out", "--timeout-scale", "0.0001", timeout=60)  # env gets 6 ms: it cannot finish
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert summary["ok"] is False
    assert "no result within" in summary["checks"]["env"]["error"]
    assert {name: c["ok"] for name, c in summary["checks"].items()} == dict.fromkeys(("env", "pool", "copier",
                                                                                      "engine"), False)
    assert "overall: FAIL" in done.stdout


def _check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", GPU / "check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_pool_is_fitted_to_dev_shm_or_refused_with_a_clear_message():
    check = _check_module()
    work = check.plan(cpu=False)
    full = check.pool_bytes(work)
    assert check.fit_to_shm(work, 2 * full) == "" and check.pool_bytes(work) == full  # room: nothing shrinks
    small = check.plan(cpu=False)
    note = check.fit_to_shm(small, full // 2)
    assert "--shm-size" in note and check.pool_bytes(small) <= full // 2 * 0.9
    assert small["copier"]["bytes"] % (2 << 20) == 0  # still whole blocks of every shape
    with pytest.raises(check.StepError, match="/dev/shm has 64 MiB free"):  # Docker's default
        check.fit_to_shm(check.plan(cpu=False), 64 << 20)
