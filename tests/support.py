"""Helpers for tests that run real processes on loopback (importable: pytest puts tests/ on the path)."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(address: str, timeout: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    """Poll the standard gRPC health service at ``address`` until it says SERVING."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process exited with {proc.returncode} before serving on {address}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing serving on {address} after {timeout}s")
            time.sleep(0.05)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05):
    """Poll ``predicate`` until it returns something truthy (returned) or raise TimeoutError."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout}s")
        time.sleep(interval)


def kvpool_process(*args: str, log_path=None) -> subprocess.Popen:
    """Start ``python -m kvpool.cli ARGS`` (the same code as the ``kvpool`` script)."""
    out = open(log_path, "wb") if log_path else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", "kvpool.cli", *args], stdout=out, stderr=subprocess.STDOUT)


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGTERM, then SIGKILL if it does not exit in time; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    return proc.returncode
