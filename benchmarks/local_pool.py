"""``kvpool serve`` in a child process for a benchmark: :class:`LocalPool`, its own ports, arena and SSD directory.

The lab harnesses here (``transformers_ttft.py``, ``vllm_ttft.py``, ``vllm_offload_tier.py``,
``events_overhead.py``) each measure against a pool of their own on 127.0.0.1; this is that pool.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalPool:
    """``kvpool serve`` in a child process on 127.0.0.1 with its own ports, arena and SSD directory."""

    def __init__(self, *, dram_bytes: int, max_block_bytes: int, ssd_bytes: int, write_through: bool = False,
                 ssd_parent: str | None = None, timeout_s: float = 60.0, flags: dict[str, object] | None = None):
        """``flags``: more ``kvpool serve`` flags, e.g. ``{"master-kv-events-endpoint": "tcp://..."}``."""
        from kvpool.bench.replay import cluster_nodes

        self._tmp = tempfile.mkdtemp(prefix="kvpool-ttft-", dir=ssd_parent)
        self.arena = f"kvpool-ttft-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.address = f"127.0.0.1:{_free_port()}"
        self.metrics_port = _free_port()
        flags = {
            "master-port": self.address.rsplit(":", 1)[1], "master-metrics-port": 0, "port": _free_port(),
            "metrics-port": self.metrics_port, "data-port": 0, "arena": self.arena, "dram-bytes": dram_bytes,
            "max-block-bytes": max_block_bytes, "ssd-dir": os.path.join(self._tmp, "ssd"), "ssd-bytes": ssd_bytes,
            **(flags or {}),
        }
        argv = [sys.executable, "-m", "kvpool.cli", "--log-level", "WARNING", "serve"]
        argv += [x for k, v in flags.items() for x in (f"--{k}", str(v))]
        argv.append("--write-through" if write_through else "--no-write-through")
        self._log = open(os.path.join(self._tmp, "serve.log"), "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kvpool serve exited with {self.proc.returncode}: {self.log_tail()}")
                try:
                    if cluster_nodes(self.address, timeout=1.0):
                        break
                except ValueError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kvpool serve did not come up within {timeout_s}s: {self.log_tail()}")
                time.sleep(0.1)
        except BaseException:
            self.close()
            raise

    def demotion_queue_bytes(self) -> float:
        """The node's ``kvpool_demotion_queue_bytes`` (blocks on their way to SSD)."""
        from kvpool.metrics import scrape_samples

        return sum(s.value for s in scrape_samples(self.metrics_port) if s.name == "kvpool_demotion_queue_bytes")

    def log_tail(self) -> str:
        with open(os.path.join(self._tmp, "serve.log"), "rb") as f:
            return f.read()[-2000:].decode(errors="replace")

    def close(self) -> None:
        from kvpool.tiers.arena import shm_path

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        try:
            os.unlink(shm_path(self.arena))
        except FileNotFoundError:
            pass
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> LocalPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
