"""Helpers for tests that run real processes on loopback (importable: pytest puts tests/ on the path)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

TESTS = Path(__file__).resolve().parent  # tests/: support modules, engine drivers and scripts (tests sit below it)
REPO = TESTS.parent  # the checkout
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, and not handed out before by this process.

    Linux often hands out ports in steps of 2, which is exactly the distance of
    kvpool's derived defaults (fast calls and bulk at port + 2): tests pass
    every port explicitly, from here.
    """
    while True:
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


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


def print_logs(folder, tail_lines: int = 40) -> None:
    """Print the last lines of every ``*.log`` under ``folder`` (a failing test's processes: pytest shows it)."""
    for path in sorted(Path(folder).rglob("*.log")):
        lines = path.read_text(errors="replace").splitlines()
        print(f"--- {path.name} (last {min(tail_lines, len(lines))} of {len(lines)} lines)")
        print("\n".join(lines[-tail_lines:]))


def kvpool_process(*args: str, log_path=None, cwd=None) -> subprocess.Popen:
    """Start ``python -m kvpool.cli ARGS`` (the same code as the ``kvpool`` script)."""
    out = open(log_path, "wb") if log_path else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", "kvpool.cli", *args], stdout=out, stderr=subprocess.STDOUT, cwd=cwd)


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


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics on 127.0.0.1:``port``, parsed into {(sample name, sorted labels): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    """One sample's value (0.0 if absent): ``metric(s, "kvpool_hit_blocks_total", tier="dram")``."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


class PoolProcesses:
    """Real kvpool processes on loopback for one test: `kvpool serve`, or `kvpool master` + nodes.

    Ports are picked free; each node gets its own arena name and SSD directory
    under ``tmp``. ``close()`` stops everything and removes the arenas.
    """

    def __init__(self, tmp, **node_flags: str):
        import uuid

        self.tmp = tmp
        self.tag = uuid.uuid4().hex[:8]
        self.node_flags = {"dram-bytes": "8M", "max-block-bytes": "1M", "ssd-bytes": "64M", **node_flags}
        self.procs: list[subprocess.Popen] = []
        self.master_port = free_port()
        self.master_metrics_port = free_port()
        self.master_call_port = free_port()
        self.nodes: dict[str, dict] = {}

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.master_port}"

    def cli_flags(self, flags: dict[str, object]) -> list[str]:
        """``{"port": 5, "write-through": "true", "ssd": "false"}`` -> ``--port 5 --write-through --no-ssd``."""
        args: list[str] = []
        for k, v in flags.items():
            text = str(v).lower()
            if text in ("true", "false"):  # on/off settings are --x / --no-x switches
                args.append(f"--{k}" if text == "true" else f"--no-{k}")
            else:
                args += [f"--{k}", str(v)]
        return args

    def node_settings(self, name: str) -> dict[str, object]:
        """The flags node ``name`` starts with (its ports, chosen once, its arena and SSD folder, then node_flags)."""
        node = self.nodes.setdefault(name, {"port": free_port(), "metrics": free_port(), "data": free_port()})
        return {
            "port": node["port"], "metrics-port": node["metrics"], "data-port": node["data"], "node-id": name,
            "arena": f"kvpool-test-{self.tag}-{name}", "ssd-dir": str(self.tmp / f"ssd-{name}"), **self.node_flags,
        }

    def serve(self, **master_flags: str) -> subprocess.Popen:
        """`kvpool serve` with one node named n0."""
        flags = {**self.node_settings("n0"), "master-port": self.master_port,
                 "master-metrics-port": self.master_metrics_port, "master-call-port": self.master_call_port,
                 **master_flags}
        proc = kvpool_process("serve", *self.cli_flags(flags), log_path=self.tmp / f"serve-{len(self.procs)}.log")
        self.procs.append(proc)
        wait_serving(self.master, proc=proc)
        wait_serving(self.node_address("n0"), proc=proc)
        self.wait_nodes(1)
        return proc

    def start_master(self, **flags: str) -> subprocess.Popen:
        values: dict[str, object] = {"port": self.master_port, "metrics-port": self.master_metrics_port,
                                     "call-port": self.master_call_port, **flags}
        proc = kvpool_process("master", *self.cli_flags(values), log_path=self.tmp / f"master-{len(self.procs)}.log")
        self.procs.append(proc)
        wait_serving(self.master, proc=proc)
        return proc

    def start_node(self, name: str, **flags: str) -> subprocess.Popen:
        values = {**self.node_settings(name), "master": self.master, **flags}
        proc = kvpool_process("node", *self.cli_flags(values), log_path=self.tmp / f"node-{name}-{len(self.procs)}.log")
        self.procs.append(proc)
        wait_serving(self.node_address(name), proc=proc)
        return proc

    def node_address(self, name: str) -> str:
        return f"127.0.0.1:{self.nodes[name]['port']}"

    def node_metrics_port(self, name: str) -> int:
        return self.nodes[name]["metrics"]

    def status(self):
        from kvpool.v1 import master_pb2, master_pb2_grpc

        with grpc.insecure_channel(self.master) as channel:
            return master_pb2_grpc.MasterStub(channel).ClusterStatus(master_pb2.ClusterStatusRequest(), timeout=5)

    def wait_nodes(self, n: int, timeout: float = 20.0) -> None:
        wait_until(lambda: len(self.status().nodes) == n, timeout)

    def close(self) -> None:
        import os

        from kvpool.tiers.arena import shm_path

        codes = [stop_process(p) for p in self.procs]
        for name in self.nodes:
            try:
                os.unlink(shm_path(f"kvpool-test-{self.tag}-{name}"))
            except FileNotFoundError:
                pass
        self.exit_codes = codes

    def assert_stopped_cleanly(self) -> None:
        """After :meth:`close`: every process exited 0 on SIGTERM (or was killed on purpose, -9)."""
        assert all(code in (0, -signal.SIGKILL) for code in self.exit_codes), self.exit_codes


@dataclass(frozen=True)
class EtcdTls:
    """TLS for a test etcd: its certificate and key, and the CA it trusts for client certificates (with
    ``client_cert_auth``, etcd's ``--client-cert-auth``: a client must present one)."""

    ca: str
    cert: str
    key: str
    client_cert_auth: bool = True

class EtcdServer:
    """A real single-member etcd (Debian's etcd-server; tests/run.sh installs it) on free loopback ports.

    With ``tls`` it serves https only; ``credentials`` (gRPC channel credentials: the CA, and a client
    certificate) are how this fixture itself reaches it. :meth:`enable_auth` turns etcd's authentication on
    through its own Auth API (users, roles, permissions, as ``etcdctl user/role/auth`` would);
    ``auth_token_ttl_s`` is etcd's ``--auth-token-ttl`` (an unused simple token expires after it), ``auth_token``
    its ``--auth-token`` (e.g. ``jwt,pub-key=...``; default: simple tokens).
    ``pause``/``resume`` (SIGSTOP/SIGCONT) make it unresponsive without losing its state; ``stop`` ends it.
    Fails loudly when no ``etcd`` binary is installed: never a silent skip.
    """

    def __init__(self, data_dir, host: str = "127.0.0.1", *, tls: EtcdTls | None = None,
                 credentials: grpc.ChannelCredentials | None = None, auth_token_ttl_s: int = 0,
                 auth_token: str = ""):
        import shutil

        binary = shutil.which("etcd")
        assert binary is not None, "etcd not found: apt-get install etcd-server (tests/run.sh does)"
        self.client_port, self.peer_port = free_port(), free_port()
        self.endpoint = f"{host}:{self.client_port}"
        self.url = f"{'https' if tls else 'http'}://{self.endpoint}"
        self.credentials = credentials
        self.root_password = ""  # set by enable_auth
        peer = f"http://127.0.0.1:{self.peer_port}"
        flags = []
        if tls is not None:
            flags += ["--cert-file", tls.cert, "--key-file", tls.key, "--trusted-ca-file", tls.ca]
            flags += ["--client-cert-auth"] if tls.client_cert_auth else []
        if auth_token_ttl_s:
            flags += ["--auth-token-ttl", str(auth_token_ttl_s)]
        if auth_token:
            flags += ["--auth-token", auth_token]
        self.log = open(data_dir / "etcd.log", "wb")
        self.proc = subprocess.Popen(
            [binary, "--name", "kvpool-test", "--data-dir", str(data_dir / "etcd"),
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"kvpool-test={peer}", *flags],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_ready()

    def channel(self) -> grpc.Channel:
        """A channel to this etcd with the fixture's own credentials."""
        if self.credentials is None:
            return grpc.insecure_channel(self.endpoint)
        return grpc.secure_channel(self.endpoint, self.credentials)

    def wait_ready(self, timeout: float = 30.0) -> None:
        from kvpool.v1 import etcd_pb2, etcd_pb2_grpc

        with self.channel() as channel:
            stub = etcd_pb2_grpc.MaintenanceStub(channel)

            def answers() -> bool:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"etcd exited with {self.proc.returncode}")
                try:
                    return bool(stub.Status(etcd_pb2.StatusRequest(), timeout=1.0).version)
                except grpc.RpcError:
                    return False

            wait_until(answers, timeout, interval=0.1)

    def admin(self, method: str, request):
        """One call of etcd's Auth service (``"UserAdd"``, ...): as root once :meth:`enable_auth` ran."""
        from kvpool.v1 import etcd_pb2, etcd_pb2_grpc

        channel = self.channel()
        try:
            stub = etcd_pb2_grpc.AuthStub(channel)
            metadata = None
            if self.root_password:
                reply = stub.Authenticate(etcd_pb2.AuthenticateRequest(name="root", password=self.root_password),
                                          timeout=10)
                metadata = (("token", reply.token),)
            return getattr(stub, method)(request, timeout=10, metadata=metadata)
        finally:
            channel.close()

    def enable_auth(self, root_password: str, roles: dict[str, list[tuple[str, bytes]]],
                    users: dict[str, tuple[str, list[str]]]) -> None:
        """Users (name: (password, roles)) and roles (name: [(READ, WRITE or READWRITE, key prefix)]), then
        authentication on: from then on only users (and certificates whose CN names one) get in."""
        from kvpool.etcd import prefix_end
        from kvpool.v1 import etcd_pb2 as pb  # the Auth messages are new with issue 26

        self.admin("UserAdd", pb.AuthUserAddRequest(name="root", password=root_password))
        self.admin("RoleAdd", pb.AuthRoleAddRequest(name="root"))
        self.admin("UserGrantRole", pb.AuthUserGrantRoleRequest(user="root", role="root"))
        for role, perms in roles.items():
            self.admin("RoleAdd", pb.AuthRoleAddRequest(name=role))
            for kind, prefix in perms:
                perm = pb.Permission(permType=kind, key=prefix, range_end=prefix_end(prefix))
                self.admin("RoleGrantPermission", pb.AuthRoleGrantPermissionRequest(name=role, perm=perm))
        for user, (password, granted) in users.items():
            self.admin("UserAdd", pb.AuthUserAddRequest(name=user, password=password))
            for role in granted:
                self.admin("UserGrantRole", pb.AuthUserGrantRoleRequest(user=user, role=role))
        self.admin("AuthEnable", pb.AuthEnableRequest())
        self.root_password = root_password

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        stop_process(self.proc)
        self.log.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time ``pid`` has used (fields 14 and 15 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    """A process's resident set (VmRSS), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


START_TIMEOUT_S = 60.0  # a start on a busy 2-core machine can be slow


def run_cli(procs: PoolProcesses, command: str, flags: dict, *, serving: str | None = None) -> tuple[int, str]:
    """Run ``kvpool COMMAND FLAGS`` (spelled as ``procs`` spells flags) until it exits; (exit code, stderr).

    If ``serving`` is given and something answers SERVING there while this
    process is still up, it started instead of refusing: stopped, and the test fails.
    """
    err_path = procs.tmp / f"{command}-{time.monotonic_ns()}.err"
    args = procs.cli_flags(flags)
    with open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kvpool.cli", command, *args],
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while proc.poll() is None:
            if serving is not None:
                with contextlib.suppress(RuntimeError, TimeoutError):
                    wait_serving(serving, timeout=0.5, proc=proc)
                    pytest.fail(f"kvpool {command} started instead of refusing: {err_path.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"kvpool {command} neither refused nor exited within {START_TIMEOUT_S}s")
            time.sleep(0.05)
    finally:
        stop_process(proc)
    return proc.returncode, err_path.read_text(errors="replace")


def assert_refused(code: int, stderr: str, command: str, *words: str) -> str:
    """Exit code 2, no traceback, and the last stderr line is the one refusal naming ``words``."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, f"exit code {code}:\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, stderr[-3000:]
    refusals = [line for line in lines if line.startswith(f"kvpool {command}: ")]
    assert len(refusals) == 1 and lines[-1] == refusals[0], stderr[-3000:]
    for word in words:
        assert word in refusals[0], refusals[0]
    return refusals[0]


def replayed_events(replay_endpoint: str) -> list[list]:
    """Every batch a master's KV event publisher has kept, by replay from sequence 0 (each batch's events, in
    order), as a subscriber recovering from the start asks for them."""
    import msgspec
    import zmq

    from kvpool.events import KVEventBatch

    decode = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay_endpoint)
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        out: list[list] = []
        while True:
            assert dealer.poll(10_000), f"no replay from {replay_endpoint}"
            _, _, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return out
            out.append(decode.decode(payload).events)
    finally:
        ctx.destroy(linger=0)
