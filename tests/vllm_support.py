"""What the tests that run kvpool inside the real vLLM share: the driver run (tests/vllm_driver.py in
build/vllm-venv), the test model's block and node sizes, prompts, requests and the connector's settings."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from driver_support import run_driver
from support import TESTS
from vllm_runtime import vllm_env

BLOCK = 32
DRIVER = TESTS / "vllm_driver.py"
NODE = {"dram-bytes": "64M", "max-block-bytes": "64K", "ssd-bytes": "256M"}  # a block of the test model: 64 KiB


def prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids, different for every seed."""
    return [(seed * 7919 + i * 31 + (i * i) % 97) % 500 for i in range(n)]


class Run:
    """One driver process: its results by (engine, request id), metrics and refusals by engine, and its log."""

    def __init__(self) -> None:
        self.results: dict[tuple[str, str], dict[str, Any]] = {}
        self.metrics: dict[str, dict[str, float]] = {}
        self.refused: dict[str, str] = {}
        self.stepped: dict[str, dict[str, Any]] = {}
        self.log = ""

    def tokens(self, engine: str, req: str) -> list[int]:
        return self.results[(engine, req)]["tokens"]

    def cached(self, engine: str, req: str) -> int:
        return self.results[(engine, req)]["cached"]


def drive(python: str, model: str, tmp: Path, engines: list[dict[str, Any]], *, in_process: bool = True,
          on_pause: Callable[[str], None] | None = None, timeout: float = 400) -> Run:
    """Run the engines in one vLLM driver process; ``on_pause(name)`` is called at each pause."""
    spec = tmp / f"spec-{engines[0]['name']}.json"
    spec.write_text(json.dumps({"model": model, "block_size": BLOCK, "engines": engines}))
    run = Run()

    def report(said: dict[str, Any]) -> None:
        if "refused" in said:
            run.refused[said["engine"]] = said["refused"]
        elif "metrics" in said:
            run.metrics[said["engine"]] = said["metrics"]
        elif "stepped" in said:
            run.stepped[said["engine"]] = said["stepped"]
        else:
            run.results[(said["engine"], said["id"])] = said

    run.log = run_driver(python, DRIVER, spec, vllm_env(python, in_process=in_process),
                         tmp / f"driver-{engines[0]['name']}.log", on_report=report, on_pause=on_pause, timeout=timeout)
    return run


def connector(master: str, tmp: Path, **extra: Any) -> dict[str, Any]:
    """The connector's ``kv_connector_extra_config`` for a pool whose master is ``master``."""
    config = tmp / f"kvpool-{master.replace(':', '-')}.json"
    config.write_text(json.dumps({"client": {"master": master, "lookup_timeout_s": 1.0, "io_timeout_s": 2.0}}))
    return {"kvpool_config_path": str(config), **extra}


def req(rid: str, tokens: list[int], max_tokens: int = 8, salt: str | None = None) -> dict[str, Any]:
    return {"id": rid, "prompt": tokens, "max_tokens": max_tokens, "cache_salt": salt}
