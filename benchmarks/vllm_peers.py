"""The peer side of ``benchmarks/vllm_ttft.py``: Mooncake Store behind vLLM's in-tree ``MooncakeStoreConnector``.

Mooncake is the peer's package, never a kvpool dependency: :func:`ensure_mooncake`
installs ``mooncake-transfer-engine-non-cuda`` (:data:`MOONCAKE_PACKAGE`) into
the vLLM Python's environment on first use (saying so on stderr), after the
Debian libraries its binaries link (``libibverbs1 librdmacm1 libnuma1``), and
then checks that vLLM, kvpool's client and kvpool's protobuf/grpcio pins
still import there (the package brings only ``msgpack`` besides itself).

:class:`MooncakeStore` runs the store the way a deployment that outlives its
vLLM processes does (the recipe in ``shared/reference/peers.md``, "Mooncake
Store inside vLLM"): a ``mooncake_master`` (metadata, allocation, HTTP
metadata server) and a separate ``mooncake_client`` process that owns the
memory segment, so a vLLM process can fill it, exit, and a fresh one read it.
vLLM processes run in ``standalone-store`` mode (``global_segment_size`` 0)
with ``MOONCAKE_CONFIG_PATH`` pointing at the JSON this class writes, and one
``MOONCAKE_REQUESTER_LOCAL_HOSTNAME`` port each (:meth:`MooncakeStore.vllm_env`).
Everything listens on 127.0.0.1 (Mooncake's transfer engine also takes ports
of its own choosing in 12300-17000).
"""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MOONCAKE_PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
DEBIAN_LIBS = {"ibverbs": "libibverbs1", "rdmacm": "librdmacm1", "numa": "libnuma1"}
# What kvpool needs to import in the same environment (pyproject.toml's pins); checked after an install.
_PINS_CHECK = """
import grpc, google.protobuf, vllm, kvpool.client.kvclient
from packaging.version import Version as V
pb, g = V(google.protobuf.__version__), V(grpc.__version__)
assert V("7.35.1") <= pb < V("8"), f"protobuf {pb} is outside kvpool's >=7.35.1,<8"
assert g >= V("1.85.1"), f"grpcio {g} is below kvpool's >=1.85.1"
print(f"vllm {vllm.__version__}, protobuf {pb}, grpcio {g}")
"""


def _bin(python: str, name: str) -> Path:
    return Path(python).parent / name


def mooncake_installed(python: str) -> bool:
    """Whether ``python``'s environment has Mooncake's store binding and its two programs."""
    if not (_bin(python, "mooncake_master").exists() and _bin(python, "mooncake_client").exists()):
        return False
    done = subprocess.run([python, "-c", "import mooncake.store"], capture_output=True)
    return done.returncode == 0


def _apt_install(packages: list[str]) -> None:
    if shutil.which("apt-get") is None:
        raise RuntimeError(f"Mooncake's binaries need {' '.join(packages)} (Debian/Ubuntu names) and there is no "
                           "apt-get here; install them by hand and run this again")
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    if sudo and shutil.which("sudo") is None:
        raise RuntimeError(f"Mooncake's binaries need {' '.join(packages)}: run as root, or install them by hand")
    print(f"vllm_ttft: installing {' '.join(packages)} (shared libraries Mooncake's binaries link)",
          file=sys.stderr, flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run([*sudo, "apt-get", "update", "-qq"], check=True, stdout=subprocess.DEVNULL, env=env)
    subprocess.run([*sudo, "apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages], check=True,
                   stdout=subprocess.DEVNULL, env=env)


def ensure_mooncake(python: str, *, install: bool = True) -> str:
    """Make sure ``python`` (the vLLM Python) has Mooncake (see the module docstring); the versions line.

    RuntimeError when it is missing and ``install`` is false, or the install breaks kvpool's pins there.
    """
    missing = [pkg for lib, pkg in DEBIAN_LIBS.items() if ctypes.util.find_library(lib) is None]
    if missing:
        if not install:
            raise RuntimeError(f"Mooncake needs {' '.join(missing)}; run without --no-install to install them")
        _apt_install(missing)
    if not mooncake_installed(python):
        if not install:
            raise RuntimeError(f"Mooncake is not installed in {python}'s environment; run without --no-install "
                               f"(installs {MOONCAKE_PACKAGE} there) or with --no-mooncake")
        print(f"vllm_ttft: installing {MOONCAKE_PACKAGE} into {Path(python).parent.parent} (the peer's package, "
              "for the Mooncake rows only; not a kvpool dependency)", file=sys.stderr, flush=True)
        subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", MOONCAKE_PACKAGE],
                       check=True)
        if not mooncake_installed(python):
            raise RuntimeError(f"{MOONCAKE_PACKAGE} installed, but mooncake.store does not import in {python}")
    done = subprocess.run([python, "-c", _PINS_CHECK], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"with Mooncake installed, {python} no longer imports what kvpool needs: "
                           f"{done.stderr.strip().splitlines()[-1:]}")
    return done.stdout.strip()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {_tail(log)}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} is not listening on {port} after {timeout:.0f} s: {_tail(log)}")
        time.sleep(0.1)


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return "(no log)"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class MooncakeStore:
    """``mooncake_master`` and a ``mooncake_client`` store process on 127.0.0.1 (see the module docstring)."""

    def __init__(self, python: str, *, segment_bytes: int = 2 << 30, local_buffer_bytes: int = 256 << 20,
                 timeout_s: float = 60.0):
        self.python = python
        self.dir = Path(tempfile.mkdtemp(prefix="kvpool-bench-mooncake-"))
        self.rpc_port, self.http_port, self.metrics_port, self.client_port = (_free_port() for _ in range(4))
        self.metadata = f"http://127.0.0.1:{self.http_port}/metadata"
        self.master_address = f"127.0.0.1:{self.rpc_port}"
        self.config_path = self.dir / "mooncake.json"
        self.config_path.write_text(json.dumps({
            "metadata_server": self.metadata, "master_server_address": self.master_address, "protocol": "tcp",
            "device_name": "", "mode": "standalone-store", "global_segment_size": 0,
            "local_buffer_size": local_buffer_bytes,
        }))
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[Any] = []
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
        try:
            master = self._start("master", [
                str(_bin(python, "mooncake_master")), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                f"--metrics_port={self.metrics_port}", "--metrics_host=127.0.0.1",
                "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}", "--default_kv_lease_ttl=5000"], env)
            _wait_port(self.rpc_port, master, "mooncake_master", self.dir / "master.log", timeout_s)
            _wait_port(self.http_port, master, "mooncake_master", self.dir / "master.log", timeout_s)
            client = self._start("client", [
                str(_bin(python, "mooncake_client")), "--host=127.0.0.1", f"--port={self.client_port}",
                f"--global_segment_size={segment_bytes}", f"--master_server_address={self.master_address}",
                f"--metadata_server={self.metadata}", "--protocol=tcp"], env)
            _wait_port(self.client_port, client, "mooncake_client", self.dir / "client.log", timeout_s)
        except BaseException:
            self.close()
            raise

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(self.dir / f"{name}.log", "wb")
        self._logs.append(log)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.dir)
        self._procs.append(proc)
        return proc

    def vllm_env(self) -> dict[str, str]:
        """What a vLLM process using this store adds to its environment (its own requester port each call)."""
        return {"MOONCAKE_CONFIG_PATH": str(self.config_path),
                "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": f"127.0.0.1:{_free_port()}",
                "VLLM_HOST_IP": "127.0.0.1", "MC_TCP_BIND_ADDRESS": "127.0.0.1"}

    def alive(self) -> bool:
        """Both processes still run (the store held what vLLM wrote all along)."""
        return all(p.poll() is None for p in self._procs)

    def log_tail(self) -> str:
        return "\n".join(f"{name}: {_tail(self.dir / f'{name}.log', 1000)}" for name in ("master", "client"))

    def close(self) -> None:
        for proc in reversed(self._procs):
            _stop(proc)
        for log in self._logs:
            log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
