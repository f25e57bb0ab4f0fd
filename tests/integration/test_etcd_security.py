"""Issue 26: etcd as it is run in production, with TLS (client certificates required) and authentication on.

One real etcd (Debian's etcd-server) for the module: https only, ``--client-cert-auth``, a short
``--auth-token-ttl``, and its own users and roles: ``kvpool-master`` may read and write ``/kvpool/``, and
``kvpool-reader`` (what nodes and clients get) may only read it. Certificates are made at test time with the
openssl CLI; the client certificate's CN names no etcd user, so only a password opens etcd to writes.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from typing import Any

import grpc
import numpy as np
import pytest
from certs import make_ca, make_cert, openssl
from support import EtcdServer, EtcdTls, free_port, kvpool_process, stop_process, wait_serving, wait_until

from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig, MasterConfig
from kvpool.etcd import EtcdAccess, EtcdClient, EtcdRefused, LeaderInfo, leader_key, read_password_file
from kvpool.keys import opaque_key
from kvpool.master import MasterServer
from kvpool.master_client import leader_address
from kvpool.tls import channel_credentials

TTL_S = 2  # the masters' leader lease
TOKEN_TTL_S = 2  # etcd's --auth-token-ttl: a token unused this long is gone
PASSWORDS = {"root": "root-secret-1", "kvpool-master": "master-secret-2", "kvpool-reader": "reader-secret-3"}
START_TIMEOUT_S = 60.0  # a refused start on a loaded 2-core machine: Python, grpc and the etcd round trips


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Certificates (etcd's, a client's from the same CA, one from another CA) and a password file per user."""
    d = tmp_path_factory.mktemp("etcd-certs")
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    make_cert(d, "etcd", "ca", "etcd", "serverAuth", san="IP:127.0.0.1,DNS:localhost")
    make_cert(d, "client", "ca", "kvpool host", "clientAuth")  # a CN that names no etcd user
    make_cert(d, "stranger", "other-ca", "kvpool host", "clientAuth")
    paths = {name: str(d / name) for name in ("ca.pem", "other-ca.pem", "etcd.pem", "etcd.key", "client.pem",
                                              "client.key", "stranger.pem", "stranger.key")}
    for user, password in [*PASSWORDS.items(), ("wrong", "not-the-password")]:
        path = d / f"{user}.password"
        path.write_text(password + "\n")
        path.chmod(0o600)
        paths[user] = str(path)
    return paths


@pytest.fixture(scope="module")
def etcd(tmp_path_factory, files):
    credentials = channel_credentials(files["ca.pem"], files["client.pem"], files["client.key"])
    server = EtcdServer(tmp_path_factory.mktemp("etcd-secure"), credentials=credentials,
                        tls=EtcdTls(files["ca.pem"], files["etcd.pem"], files["etcd.key"]),
                        auth_token_ttl_s=TOKEN_TTL_S)
    try:
        server.enable_auth(PASSWORDS["root"],
                           roles={"kvpool-master": [("READWRITE", b"/kvpool/")],
                                  "kvpool-reader": [("READ", b"/kvpool/")]},
                           users={"kvpool-master": (PASSWORDS["kvpool-master"], ["kvpool-master"]),
                                  "kvpool-reader": (PASSWORDS["kvpool-reader"], ["kvpool-reader"])})
    except BaseException:
        server.stop()
        raise
    yield server
    server.stop()


def settings(files, user: str = "", **over: str) -> dict[str, Any]:
    """The etcd_* settings (config field names) for ``user`` with the module's CA and client certificate."""
    values = {"etcd_ca": files["ca.pem"], "etcd_cert": files["client.pem"], "etcd_key": files["client.key"],
              "etcd_user": user, "etcd_password_file": files[user] if user else ""}
    return {**values, **over}


def flags(values: dict[str, str]) -> list[str]:
    return [arg for k, v in values.items() if v for arg in (f"--{k.replace('_', '-')}", v)]


def etcd_client(etcd: EtcdServer, files, user: str = "", **over: str) -> EtcdClient:
    from types import SimpleNamespace

    access = EtcdAccess.from_config(SimpleNamespace(**settings(files, user, **over)), "test")
    return EtcdClient([etcd.endpoint], timeout_s=2.0, access=access)


def new_cluster() -> str:
    return f"s-{uuid.uuid4().hex[:10]}"


def masters_in_process(etcd: EtcdServer, files, cluster: str, n: int = 2) -> list[MasterServer]:
    config = MasterConfig.of(port=0, metrics_port=0, call_port=0, etcd=etcd.url, cluster=cluster, leader_ttl_s=TTL_S,
                          **settings(files, "kvpool-master"))
    return [MasterServer(config).start() for _ in range(n)]


def the_leader(masters: list[MasterServer]) -> MasterServer | None:
    leading = [m for m in masters if m.election is not None and m.election.leading()]
    return leading[0] if len(leading) == 1 else None


def start_node(etcd: EtcdServer, files, cluster: str, tmp_path, user: str = "kvpool-reader"):
    arena = f"kvpool-test-etcd-{uuid.uuid4().hex[:8]}"
    port = free_port()
    proc = kvpool_process(
        "node", "--master", f"etcd://{etcd.endpoint}/{cluster}", "--port", str(port), "--metrics-port", "0",
        "--data-port", "0", "--node-id", "n1", "--arena", arena, "--dram-bytes", "16M", "--max-block-bytes", "64K",
        "--no-ssd", *flags(settings(files, user)), log_path=tmp_path / f"node-{arena}.log")
    return proc, arena, f"127.0.0.1:{port}"


def stop_node(proc: subprocess.Popen, arena: str) -> None:
    stop_process(proc)
    try:
        os.unlink(f"/dev/shm/{arena}")
    except FileNotFoundError:
        pass


def reader_pool(etcd: EtcdServer, files, cluster: str, user: str = "kvpool-reader") -> PoolClient:
    return PoolClient(ClientConfig(master=f"etcd://{etcd.endpoint}/{cluster}", shared_memory=False,
                                   lookup_timeout_s=1.0, io_timeout_s=2.0, **settings(files, user)))


def fill(pool: PoolClient, tag: str, n: int = 8) -> list:
    keys = [opaque_key(f"{tag}-{i}") for i in range(n)]
    wait_until(lambda: pool.cluster.refresh() and len(pool.cluster.nodes()) == 1, timeout=30)
    assert pool.store(keys, [np.full(4096, i + 1, np.uint8) for i in range(n)]) == [True] * n
    wait_until(pool.flush, timeout=30)  # False while the node's link is still sending its first report
    assert len(pool.lookup(keys)) == n
    return keys


def miss_seconds(pool: PoolClient, keys: list, quiet_s: float, limit_s: float = 60.0) -> float:
    """Look ``keys`` up every 50 ms until every lookup for ``quiet_s`` (after the last miss, if any) hit: the time
    from the first miss to the last hit-less sample (0.0: none missed). Fails after ``limit_s``."""
    first = last = None
    start = time.monotonic()
    while time.monotonic() - (start if last is None else last) < quiet_s:
        now = time.monotonic()
        assert now - start < limit_s, f"lookups still missed {limit_s} s on"
        if len(pool.lookup(keys)) != len(keys):  # a miss, never an exception
            first = now if first is None else first
            last = now
        time.sleep(0.05)
    return 0.0 if first is None or last is None else last - first + 0.05


# -- the whole pool through a secured etcd -------------------------------------------------------------------------


def test_masters_a_node_and_a_client_with_tls_and_auth_hit_and_follow_a_killed_leader(etcd, files, tmp_path):
    cluster = new_cluster()
    target = f"etcd://{etcd.endpoint}/{cluster}"
    procs, ports = {}, {}
    for name in ("m1", "m2"):
        ports[name] = free_port()
        procs[name] = kvpool_process(
            "master", "--port", str(ports[name]), "--metrics-port", "0", "--call-port", str(free_port()),
            "--etcd", etcd.url, "--cluster", cluster, "--leader-ttl-s", str(TTL_S),
            *flags(settings(files, "kvpool-master")), log_path=tmp_path / f"{name}.log")
    node, arena, _ = start_node(etcd, files, cluster, tmp_path)
    reader = etcd_client(etcd, files, "kvpool-reader")
    pool = None
    try:
        def leading() -> str | None:
            address = leader_address(reader, cluster)
            return next((n for n, p in ports.items() if address == f"127.0.0.1:{p}"), None)

        first = wait_until(leading, timeout=30)
        pool = reader_pool(etcd, files, cluster)
        keys = fill(pool, f"tls-{cluster}")
        follower = pool.master.etcd
        assert follower is not None and follower.authentications == 1
        # kvpool status reads etcd with the client section's settings, here from KVPOOL_CLIENT_* variables.
        env = {**os.environ, **{f"KVPOOL_CLIENT_{k.upper()}": v for k, v in settings(files, "kvpool-reader").items()}}
        status = subprocess.run([sys.executable, "-m", "kvpool.cli", "status", "--master", target],
                                capture_output=True, text=True, timeout=60, env=env)
        assert f"leader 127.0.0.1:{ports[first]}" in status.stdout, status.stdout + status.stderr
        # The client has not read etcd since it found the leader: its token expires unused.
        time.sleep(TOKEN_TTL_S + 1)

        os.kill(procs[first].pid, signal.SIGKILL)
        killed = time.monotonic()
        hit_again = None
        while time.monotonic() - killed < 40:
            if len(pool.lookup(keys)) == len(keys):  # during the failover a miss, never an error
                hit_again = time.monotonic() - killed
                break
            time.sleep(0.05)
        assert hit_again is not None, "lookups never hit again after the leader was killed"
        second = leading()
        assert second is not None and second != first
        assert node.poll() is None and pool.master.changes >= 1  # the same node process followed
        # the client read the new leader after etcd had dropped its token: it authenticated again
        assert follower.authentications >= 2
        outs = [np.zeros(4096, np.uint8) for _ in keys]
        assert pool.get_into(pool.lookup(keys), outs) == [True] * len(keys)
        assert all(np.array_equal(o, np.full(4096, i + 1, np.uint8)) for i, o in enumerate(outs))
        print(f"TLS + auth: lookups hit again {hit_again:.2f} s after kill -9 of the leader (TTL {TTL_S} s)")
    finally:
        if pool is not None:
            pool.close()
        reader.close()
        stop_node(node, arena)
        for proc in procs.values():
            stop_process(proc)


# -- the rogue leader key --------------------------------------------------------------------------------------------


def rogue_leader(writer: EtcdClient, cluster: str, lease_s: int) -> bool:
    """Point ``cluster``'s leader key at an address nobody serves, under a lease of the writer's (the attack of
    issue 26: masters stand by, clients dial nowhere, until the lease lapses). True if etcd let it happen."""
    try:
        lease, _ = writer.grant(lease_s)
        writer.put(leader_key(cluster), LeaderInfo.new("127.0.0.1:1").encode(), lease=lease)
    except EtcdRefused as exc:
        assert exc.code() == grpc.StatusCode.PERMISSION_DENIED, exc.details()
        return False
    return True


def test_a_rogue_leader_key_is_refused_to_anyone_but_the_masters_and_clients_keep_hitting(etcd, files, tmp_path):
    cluster = new_cluster()
    masters = masters_in_process(etcd, files, cluster)
    node, arena, _ = start_node(etcd, files, cluster, tmp_path)
    pool = None
    writers = {"a valid client certificate and no user": etcd_client(etcd, files),
               "the nodes' and clients' user (read-only role)": etcd_client(etcd, files, "kvpool-reader")}
    root = etcd_client(etcd, files, "root")
    try:
        leader = wait_until(lambda: the_leader(masters), timeout=30)
        pool = reader_pool(etcd, files, cluster)
        keys = fill(pool, f"rogue-{cluster}")
        for who, writer in writers.items():
            assert not rogue_leader(writer, cluster, lease_s=5), f"etcd took a leader key from {who}"
        # Nothing changed: the same master leads (it renews several times in this window) and no lookup misses.
        missed = miss_seconds(pool, keys, quiet_s=2 * TTL_S)
        assert missed == 0.0 and the_leader(masters) is leader
        assert LeaderInfo.decode(root.get(leader_key(cluster)).value) == leader.election.me
        # The same attack by a user allowed to write (what anyone who reached etcd was before): the test sees it.
        assert rogue_leader(root, cluster, lease_s=3)
        missed = miss_seconds(pool, keys, quiet_s=3.0)  # until it recovered by itself: the lease lapsed
        assert missed > 0, "the rogue key cost no misses: this test could not see the attack"
        print(f"rogue leader key: refused to {len(writers)} writers, 0.00 s of misses; written by root with a 3 s "
              f"lease: {missed:.2f} s of misses")
    finally:
        if pool is not None:
            pool.close()
        for client in (*writers.values(), root):
            client.close()
        stop_node(node, arena)
        for m in masters:
            m.stop()


# -- refusals --------------------------------------------------------------------------------------------------------


def run_refused(command: str, args: list[str], tmp_path, serving: str) -> tuple[int, str]:
    """Run ``kvpool COMMAND ARGS`` until it exits; fail if it serves ``serving`` meanwhile."""
    err_path = tmp_path / f"{command}-{uuid.uuid4().hex[:6]}.err"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kvpool.cli", command, *args], stdout=subprocess.DEVNULL,
                                stderr=err)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while proc.poll() is None:
            try:
                wait_serving(serving, timeout=0.5, proc=proc)
            except (RuntimeError, TimeoutError):
                pass
            else:
                pytest.fail(f"kvpool {command} started instead of refusing: {err_path.read_text()[-2000:]}")
            assert time.monotonic() < deadline, f"kvpool {command} neither refused nor exited in {START_TIMEOUT_S} s"
    finally:
        stop_process(proc)
    return proc.returncode, err_path.read_text(errors="replace")


def refusal(code: int, stderr: str, command: str) -> str:
    """Exit code 2, no traceback, and one ``kvpool COMMAND:`` line, the last: returned."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, f"exit code {code}:\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, stderr[-3000:]
    mine = [line for line in lines if line.startswith(f"kvpool {command}: ")]
    assert len(mine) == 1 and lines[-1] == mine[0], stderr[-3000:]
    return mine[0]


MASTER_REFUSALS = {  # case: (settings over the master's own, words the one line must say)
    "wrong password": ({"etcd_password_file": "wrong"}, ["refused user 'kvpool-master'", "wrong password"]),
    "unknown user": ({"etcd_user": "nobody"}, ["refused user 'nobody'", "wrong password or no such user"]),
    "no client certificate": ({"etcd_cert": "", "etcd_key": ""}, ["refused the TLS connection", "etcd_cert"]),
    "wrong CA": ({"etcd_ca": "other-ca.pem"}, ["refused the TLS connection", "etcd_ca"]),
    "a certificate etcd refuses": ({"etcd_cert": "stranger.pem", "etcd_key": "stranger.key"},
                                   ["refused the TLS connection"]),
    "a read-only role": ({"etcd_user": "kvpool-reader", "etcd_password_file": "kvpool-reader"},
                         ["denied user 'kvpool-reader'", "permission denied", "readwrite on the prefix /kvpool/"]),
}


@pytest.mark.parametrize("case", sorted(MASTER_REFUSALS))
def test_a_master_etcd_refuses_does_not_start_and_says_why_in_one_line(etcd, files, tmp_path, case):
    over, words = MASTER_REFUSALS[case]
    values = settings(files, "kvpool-master", **{k: files[v] if v and k != "etcd_user" else v for k, v in over.items()})
    port = free_port()
    code, stderr = run_refused("master", ["--port", str(port), "--metrics-port", "0", "--call-port", "0",
                                          "--etcd", etcd.url, "--cluster", new_cluster(), *flags(values)],
                               tmp_path, serving=f"127.0.0.1:{port}")
    line = refusal(code, stderr, "master")
    assert line.startswith("kvpool master: etcd refused this master: "), line
    for word in words:
        assert word in line, line


def test_a_node_etcd_refuses_does_not_start_and_leaves_no_arena(etcd, files, tmp_path):
    port, arena = free_port(), f"kvpool-test-etcd-{uuid.uuid4().hex[:8]}"
    values = settings(files, "kvpool-reader", etcd_password_file=files["wrong"])
    code, stderr = run_refused("node", ["--master", f"etcd://{etcd.endpoint}/{new_cluster()}", "--port", str(port),
                                        "--metrics-port", "0", "--data-port", "0", "--arena", arena,
                                        "--dram-bytes", "4M", "--no-ssd", *flags(values)],
                               tmp_path, serving=f"127.0.0.1:{port}")
    line = refusal(code, stderr, "node")
    assert "etcd refused to name the master" in line and "refused user 'kvpool-reader'" in line, line
    assert not os.path.exists(f"/dev/shm/{arena}")


def test_a_client_etcd_refuses_misses_and_says_why_once(etcd, files, caplog):
    cluster = new_cluster()
    masters = masters_in_process(etcd, files, cluster, n=1)
    try:
        wait_until(lambda: the_leader(masters), timeout=30)
        caplog.set_level(logging.WARNING, logger="kvpool.master_client")
        bad = PoolClient(ClientConfig(master=f"etcd://{etcd.endpoint}/{cluster}", shared_memory=False,
                                      lookup_timeout_s=1.0, **settings(files, "kvpool-reader",
                                                                       etcd_password_file=files["wrong"])))
        try:
            keys = [opaque_key(f"refused-{i}") for i in range(4)]
            deadline = time.monotonic() + 1.5  # several follows (at most one per 0.25 s): still one warning
            while time.monotonic() < deadline:
                assert len(bad.lookup(keys)) == 0  # a miss, never an exception
                time.sleep(0.05)
            # (the shard count is unknown too: a ShardedMaster of shard 0 alone, which knows no leader)
            shard_0 = getattr(bad.master, "masters", [bad.master])[0]
            assert shard_0.address is None
        finally:
            bad.close()
        warnings = [r.getMessage() for r in caplog.records if "cannot follow the master" in r.getMessage()]
        assert len(warnings) == 1 and "refused user 'kvpool-reader'" in warnings[0], warnings
    finally:
        for m in masters:
            m.stop()


# -- tokens ----------------------------------------------------------------------------------------------------------


def test_an_expired_token_is_renewed_and_the_call_succeeds(etcd, files):
    client = etcd_client(etcd, files, "kvpool-reader")
    try:
        key = leader_key(new_cluster())
        assert client.get(key) is None and client.authentications == 1
        time.sleep(TOKEN_TTL_S + 1)  # unused past etcd's --auth-token-ttl: the token is gone
        assert client.get(key) is None and client.authentications == 2
    finally:
        client.close()


def test_jwt_tokens_from_an_older_auth_revision_are_renewed_and_no_user_is_refused_clearly(tmp_path):
    """etcd's JWT tokens carry the auth revision they were issued at: any change to users or roles makes etcd
    refuse them (AUTH_OLD_REVISION). Plain HTTP here: auth does not need TLS (but sends the password in clear)."""
    from kvpool.v1 import etcd_pb2 as pb

    openssl("genrsa", "-out", "jwt.key", "2048", cwd=tmp_path)
    openssl("rsa", "-in", "jwt.key", "-pubout", "-out", "jwt.pub", cwd=tmp_path)
    server = EtcdServer(tmp_path, auth_token=f"jwt,pub-key={tmp_path / 'jwt.pub'},priv-key={tmp_path / 'jwt.key'},"
                                             "sign-method=RS256,ttl=60s")
    try:
        server.enable_auth(PASSWORDS["root"], roles={"kvpool-reader": [("READ", b"/kvpool/")]},
                           users={"kvpool-reader": (PASSWORDS["kvpool-reader"], ["kvpool-reader"])})
        password = tmp_path / "reader.password"
        password.write_text(PASSWORDS["kvpool-reader"])
        password.chmod(0o600)
        client = EtcdClient([server.endpoint], access=EtcdAccess(user="kvpool-reader",
                                                                 password=read_password_file(str(password), "x")))
        nobody = EtcdClient([server.endpoint])
        try:
            key = leader_key(new_cluster())
            assert client.get(key) is None and client.authentications == 1
            server.admin("UserAdd", pb.AuthUserAddRequest(name="someone", password="x" * 12))
            assert client.get(key) is None and client.authentications == 2  # renewed, and the call went through
            with pytest.raises(EtcdRefused, match="has authentication on and kvpool gave no user"):
                nobody.get(key)
        finally:
            client.close()
            nobody.close()
    finally:
        server.stop()


# -- settings --------------------------------------------------------------------------------------------------------


def test_etcd_settings_are_checked_together_and_their_files_at_start(tmp_path, files):
    with pytest.raises(ValueError, match="https:// endpoints need etcd_ca"):
        MasterConfig.of(etcd="https://127.0.0.1:2379")
    with pytest.raises(ValueError, match="http:// endpoints, but etcd_ca is set"):
        MasterConfig.of(etcd="http://127.0.0.1:2379", etcd_ca=files["ca.pem"])
    with pytest.raises(ValueError, match="etcd_cert and etcd_key: set both"):
        ClientConfig(etcd_ca=files["ca.pem"], etcd_cert=files["client.pem"])
    with pytest.raises(ValueError, match="a client certificate needs TLS"):
        ClientConfig(etcd_cert=files["client.pem"], etcd_key=files["client.key"])
    with pytest.raises(ValueError, match="etcd_user and etcd_password_file: set both"):
        ClientConfig(etcd_user="kvpool")
    with pytest.raises(ValueError, match="one scheme for all"):
        MasterConfig.of(etcd="http://a:2379,https://b:2379", etcd_ca=files["ca.pem"])
    base = ClientConfig(**settings(files, "kvpool-reader"))
    assert EtcdAccess.from_config(base, "client").password == PASSWORDS["kvpool-reader"]

    def refused(**over: str) -> str:
        with pytest.raises(ValueError) as caught:
            EtcdAccess.from_config(replace(base, **over), "client")
        return str(caught.value)

    assert "client.etcd_password_file: cannot read" in refused(etcd_password_file=str(tmp_path / "none"))
    shared = tmp_path / "shared.password"
    shared.write_text("secret\n")
    shared.chmod(0o644)
    assert "open to other users (mode 0644)" in refused(etcd_password_file=str(shared))
    for text in ["", "\n", "two\nlines\n"]:
        bad = tmp_path / f"bad-{len(text)}"
        bad.write_text(text)
        bad.chmod(0o600)
        assert "on one line" in refused(etcd_password_file=str(bad))
    assert "client.etcd_ca: cannot read TLS CA certificate" in refused(etcd_ca=str(tmp_path / "none.pem"))
    assert "client.etcd_cert / etcd_key" in refused(etcd_cert=files["ca.pem"])
    crlf = tmp_path / "crlf.password"
    crlf.write_bytes(b"secret\r\n")
    crlf.chmod(0o640)  # the group may read it (a service's own group)
    assert read_password_file(str(crlf), "x") == "secret"
    # Every etcd setting is a flag and a KVPOOL_* variable on master, node and client alike.
    from kvpool.config import load_config

    env = {f"KVPOOL_{s}_ETCD_USER": "u" for s in ("MASTER", "NODE", "CLIENT")}
    env |= {f"KVPOOL_{s}_ETCD_PASSWORD_FILE": "/p" for s in ("MASTER", "NODE", "CLIENT")}
    loaded = load_config(None, env=env)
    assert loaded.master.etcd_user == loaded.node.etcd_user == loaded.client.etcd_user == "u"
