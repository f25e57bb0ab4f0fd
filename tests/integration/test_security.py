"""Security: tokens, roles, tenant isolation, quotas, the arena's mode, TLS and limits (docs/security.md).

Real servers on 127.0.0.1 (in-process MasterServer / PoolNode on free ports,
and one test with `kvpool serve` as a process), real gRPC, real TCP, real
shared memory. Certificates are made at test time with the openssl CLI.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import select
import socket
import ssl
import stat
import subprocess
import sys
from typing import Any

import grpc
import numpy as np
import pytest
from certs import make_ca, make_cert
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import free_port, kvpool_process, stop_process, wait_serving, wait_until

from kvpool import wire
from kvpool.auth import Authority, mask_keys
from kvpool.checksum import block_checksum
from kvpool.client.bulk_client import BulkClient, BulkFailed, BulkUnavailable
from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig, MasterConfig, NodeConfig
from kvpool.keys import BlockKey, KeyNamespace, chain_block_keys, pack_keys
from kvpool.master import MasterServer
from kvpool.metrics import error_counts
from kvpool.node.daemon import PoolNode
from kvpool.rpc import make_channel
from kvpool.tcp import ConnectionPool, recv_exact
from kvpool.tiers.arena import shm_path
from kvpool.v1 import common_pb2, master_pb2, master_pb2_grpc, node_pb2, node_pb2_grpc
from kvpool.vocabulary import NO_TIER, Tier
from kvpool.wire import Method

MIB = 1 << 20
NODE_TOKEN = secrets.token_hex(32)
TOKEN_A = secrets.token_hex(32)
TOKEN_B = secrets.token_hex(32)
WRONG = secrets.token_hex(32)


def write_auth(path, *, quota_a: int | str = 0) -> str:
    path.write_text(json.dumps({
        "secret": secrets.token_hex(32),
        "node_tokens": [NODE_TOKEN],
        "clients": {TOKEN_A: {"tenant": "a", "quota_bytes": quota_a}, TOKEN_B: {"tenant": "b"}},
    }))
    return str(path)


def prompt_keys(n: int, tenant_salt: str = "") -> list[BlockKey]:
    """Keys of the same prompt as every tenant's engine computes them (same model, layout, tokens)."""
    ns = KeyNamespace(model="m", layout="layout-1", tenant=tenant_salt)
    return chain_block_keys(list(range(16 * n)), 16, ns)


def blocks(n: int, size: int = MIB, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


@contextlib.contextmanager
def cluster(tmp_path, arena: str, *, master_over: dict | None = None, **node_over):
    """An in-process master and one node registered with it."""
    master = MasterServer(MasterConfig.of(host="127.0.0.1", port=0, metrics_port=0, call_port=0,
                                       **(master_over or {}))).start()
    try:
        values: dict[str, Any] = dict(
            master=master.address, host="127.0.0.1", port=0, metrics_port=0, data_port=0, arena=arena,
            dram_bytes=16 * MIB, max_block_bytes=MIB, ssd_dir=str(tmp_path / "ssd"), ssd_bytes=64 * MIB,
        )
        values.update(node_over)
        node = PoolNode(NodeConfig.of(**values)).start()
        try:
            wait_until(lambda: master.membership.live_nodes() and node.link.registered, timeout=20)
            yield master, node
        finally:
            node.stop()
    finally:
        master.stop()


@pytest.fixture
def auth_file(tmp_path):
    return write_auth(tmp_path / "auth.json")


@pytest.fixture
def secured(tmp_path, arena_name, auth_file):
    with cluster(tmp_path, arena_name, master_over={"auth_file": auth_file}, auth_file=auth_file,
                 token=NODE_TOKEN) as (master, node):
        yield master, node


def client(master: MasterServer, token: str, **over) -> PoolClient:
    values: dict[str, Any] = dict(master=master.address, token=token, lookup_timeout_s=2.0, io_timeout_s=5.0,
                                  shared_memory=False)
    values.update(over)
    return PoolClient(ClientConfig(**values))


def master_stub(master: MasterServer, token: str = "", **over):
    channel = make_channel(master.address, max_message_bytes=64 * MIB, token=token, **over)
    return channel, master_pb2_grpc.MasterStub(channel)


def node_stub(node: PoolNode, token: str = "", **over):
    channel = make_channel(node.address, max_message_bytes=64 * MIB, token=token, **over)
    return channel, node_pb2_grpc.NodeStub(channel)


def errors(registry_owner, kind: str) -> float:
    return error_counts(registry_owner.registry).get(kind, 0)


def fast_frame(method: int, body: bytes) -> bytes:
    return wire.pack(method, len(body)) + body


def auth_frame(token: str) -> bytes:
    return fast_frame(Method.AUTH, common_pb2.AuthRequest(token=token).SerializeToString())


def read_fast_reply(sock: socket.socket) -> tuple[int, bytes]:
    """A reply's status and header section (its payload and trailer, if any, are left to read)."""
    head = wire.parse(recv_exact(sock, wire.FRAME.size))
    assert head is not None, "not a wire reply"
    return head.code, bytes(recv_exact(sock, head.header))


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


LOOKUP = Method.LOOKUP
REPORT_BLOCKS = Method.REPORT_BLOCKS
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED


# -- authentication -----------------------------------------------------------------------------------


def test_no_token_or_a_wrong_token_is_refused_over_grpc_fast_calls_and_bulk(secured):
    master, node = secured
    lookup = master_pb2.LookupRequest(keys=pack_keys(prompt_keys(2)))
    for token in ("", WRONG):
        channel, stub = master_stub(master, token)
        with channel, pytest.raises(grpc.RpcError) as refused:
            stub.Lookup(lookup, timeout=5)
        assert refused.value.code() == UNAUTHENTICATED
        channel, stub = node_stub(node, token)
        with channel, pytest.raises(grpc.RpcError) as refused:
            stub.Get(node_pb2.GetRequest(keys=pack_keys(prompt_keys(1))), timeout=5)
        assert refused.value.code() == UNAUTHENTICATED
    with grpc.insecure_channel(master.address) as channel:  # liveness probes need no token
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert errors(node, "unauthenticated") >= 2 and errors(master, "unauthenticated") >= 2

    # Fast calls: a request before AUTH, or AUTH with an unknown token, is refused and the connection closed.
    port = master.servicer.call_port
    for first in (fast_frame(LOOKUP, lookup.SerializeToString()), auth_frame(WRONG)):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(first)
            status, text = read_fast_reply(sock)
            assert status == UNAUTHENTICATED.value[0] and text.startswith(b"unauthenticated"), text
            assert closed(sock)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:  # the right token: served
        sock.sendall(auth_frame(TOKEN_A))
        assert read_fast_reply(sock) == (0, b"")
        sock.sendall(fast_frame(LOOKUP, lookup.SerializeToString()))
        status, body = read_fast_reply(sock)
        assert status == 0 and master_pb2.LookupResponse.FromString(body).tiers == b""

    # Bulk: the same, on the node's data port (bulk GET and fast calls alike).
    data_port = node.bulk.port
    get = fast_frame(Method.GET, node_pb2.GetRequest(keys=prompt_keys(1)[0]).SerializeToString())
    for first in (get, auth_frame(WRONG),
                  fast_frame(Method.LOCATE, node_pb2.LocateRequest(keys=prompt_keys(1)[0]).SerializeToString())):
        with socket.create_connection(("127.0.0.1", data_port), timeout=5) as sock:
            sock.sendall(first)
            status, text = read_fast_reply(sock)
            assert status == UNAUTHENTICATED.value[0] and text.startswith(b"unauthenticated"), text
            assert closed(sock)
    for token in ("", WRONG):
        c = BulkClient(5.0, token=token)
        try:
            with pytest.raises(BulkFailed) as failed:
                c.get_into(node.data_address, prompt_keys(1), [np.zeros(8, np.uint8)], [0])
            assert failed.value.kind == "unauthenticated"
        finally:
            c.close()


def test_one_auth_serves_fast_calls_and_bulk_get_and_put_on_one_connection(secured):
    """The wire has one AUTH: after it, a connection carries fast calls and bulk transfers alike."""
    master, node = secured
    key, value = prompt_keys(1, "one-auth")[0], blocks(1, size=3000, seed=3)[0]
    checksum = block_checksum(value)
    with socket.create_connection(("127.0.0.1", node.bulk.port), timeout=5) as sock:
        sock.sendall(auth_frame(TOKEN_A))
        assert read_fast_reply(sock) == (0, b"")
        header = node_pb2.BulkPutRequest(keys=key, sizes=[value.size], checksums=[checksum]).SerializeToString()
        sock.sendall(wire.pack(Method.PUT, len(header), value.size) + header + value.tobytes())
        status, body = read_fast_reply(sock)
        assert status == 0 and node_pb2.PutResponse.FromString(body).stored == b"\x01"
        sock.sendall(fast_frame(Method.LOCATE, node_pb2.LocateRequest(keys=key).SerializeToString()))
        status, body = read_fast_reply(sock)
        located = node_pb2.LocateResponse.FromString(body)
        assert status == 0 and list(located.sizes) == [value.size] and list(located.checksums) == [checksum]
        sock.sendall(fast_frame(Method.GET, node_pb2.GetRequest(keys=key).SerializeToString()))
        head = wire.parse(recv_exact(sock, wire.FRAME.size))
        assert head is not None and head.code == 0 and head.payload == value.size
        assert list(node_pb2.BulkGetReply.FromString(bytes(recv_exact(sock, head.header))).checksums) == [checksum]
        assert bytes(recv_exact(sock, head.payload)) == value.tobytes()
        assert node_pb2.BulkGetTrailer.FromString(bytes(recv_exact(sock, head.trailer))).valid == b"\x01"
    # The client side: fast calls and bulk sharing one pool, one AUTH per connection.
    pool = ConnectionPool(5.0, hello=wire.auth_hello(TOKEN_A))
    hellos = []
    real_hello = pool.hello
    pool.hello = lambda sock: (hellos.append(1), real_hello(sock))[1]
    bulk = BulkClient(5.0, pool=pool)
    try:
        from kvpool.calls import FastStub

        channel, stub = node_stub(node, TOKEN_A)
        with channel:
            fast = FastStub(stub, node_pb2.DESCRIPTOR.services_by_name["Node"], wire.NODE_CALLS, pool,
                            lambda: node.data_address)
            other = prompt_keys(1, "one-auth-2")[0]
            assert bulk.put(node.data_address, [other], [value], [checksum]) == [True]
            assert list(fast.Locate(node_pb2.LocateRequest(keys=key + other), timeout=5).sizes) == [value.size] * 2
            out = np.zeros(value.size, np.uint8)
            from kvpool.client.bulk_client import OK as GOT

            assert bulk.get_into(node.data_address, [other], [out], [checksum]) == [GOT]
            assert np.array_equal(out, value)
        assert hellos == [1]
        wait_until(lambda: node.bulk.connections == 1)  # (the raw connection above winds down)
    finally:
        pool.close()


def test_a_client_token_cannot_call_node_only_rpcs_and_a_node_token_no_client_rpcs(secured):
    master, node = secured
    before = len(master.index)
    channel, stub = master_stub(master, TOKEN_A)
    with channel:
        ref = common_pb2.NodeRef(node_id="intruder", address="127.0.0.1:1")
        calls = [
            (stub.RegisterNode, master_pb2.RegisterNodeRequest(node=ref, max_block_bytes=MIB)),
            (stub.Heartbeat, master_pb2.HeartbeatRequest(node_id=node.node_ref.node_id,
                                                         incarnation=node.link.incarnation)),
            (stub.ReportBlocks, master_pb2.ReportBlocksRequest(
                node_id=node.node_ref.node_id, incarnation=node.link.incarnation, tier=common_pb2.TIER_DRAM,
                added_keys=pack_keys(prompt_keys(1)), added_sizes=[10], added_checksums=[1])),
            (stub.UnregisterNode, master_pb2.UnregisterNodeRequest(node_id=node.node_ref.node_id,
                                                                   incarnation=node.link.incarnation)),
        ]
        for call, request in calls:
            with pytest.raises(grpc.RpcError) as denied:
                call(request, timeout=5)
            assert denied.value.code() == PERMISSION_DENIED and "node token" in denied.value.details()
        assert stub.Info(master_pb2.MasterInfoRequest(), timeout=5).call_port  # informational: any role
    channel, stub = master_stub(master, NODE_TOKEN)
    with channel, pytest.raises(grpc.RpcError) as denied:
        stub.Lookup(master_pb2.LookupRequest(keys=pack_keys(prompt_keys(1))), timeout=5)
    assert denied.value.code() == PERMISSION_DENIED
    # The same over fast calls; the connection stays usable after a PERMISSION_DENIED.
    with socket.create_connection(("127.0.0.1", master.servicer.call_port), timeout=5) as sock:
        sock.sendall(auth_frame(TOKEN_B))
        assert read_fast_reply(sock) == (0, b"")
        sock.sendall(fast_frame(REPORT_BLOCKS, calls[2][1].SerializeToString()))
        assert read_fast_reply(sock)[0] == PERMISSION_DENIED.value[0]
        sock.sendall(fast_frame(LOOKUP, master_pb2.LookupRequest(keys=b"").SerializeToString()))
        assert read_fast_reply(sock)[0] == 0
    assert len(master.index) == before
    assert [n.ref.node_id for n in master.membership.live_nodes()] == [node.node_ref.node_id]
    assert errors(master, "permission_denied") >= 6


# -- tenants --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shared_memory", [False, True], ids=["remote-tcp", "same-host-shm"])
def test_two_tenants_with_identical_prompts_never_see_or_change_each_others_blocks(secured, shared_memory):
    master, node = secured
    ks = prompt_keys(4, tenant_salt="a")  # B even uses A's namespace string: the same keys
    va, vb = blocks(4, seed=1), blocks(4, seed=2)
    with client(master, TOKEN_A, shared_memory=shared_memory) as a, \
            client(master, TOKEN_B, shared_memory=shared_memory) as b:
        assert a.store(ks, va) == [True] * 4
        run_a = a.lookup(ks)
        assert len(run_a) == 4
        # B finds nothing of A's: lookup, exists, and reads at the node with A's exact locations.
        assert len(b.lookup(ks)) == 0 and b.exists(ks) == [False] * 4
        outs = [np.zeros(MIB, np.uint8) for _ in ks]
        assert b.get_into(list(run_a), outs) == [False] * 4
        assert all(not o.any() for o in outs)
        channel, stub = node_stub(node, TOKEN_B)
        with channel:
            got = stub.Get(node_pb2.GetRequest(keys=pack_keys(ks)), timeout=5)
            assert got.tiers == bytes([NO_TIER]) * 4 and got.data == b""
            assert stub.Exists(node_pb2.NodeExistsRequest(keys=pack_keys(ks)), timeout=5).tiers == bytes([NO_TIER]) * 4
            # B writes and removes "the same" keys: its own blocks, never A's.
            assert b.store(ks, vb) == [True] * 4
            assert b.flush()  # its Commits answered (a same-host put returns before), so the node holds them
            assert stub.Remove(node_pb2.RemoveRequest(keys=pack_keys(ks[:2])), timeout=5).removed == 2
        assert b.exists(ks) == [False, False, True, True]
        assert a.exists(ks) == [True] * 4
        outs = [np.zeros(MIB, np.uint8) for _ in ks]
        assert a.get_into(list(a.lookup(ks)), outs) == [True] * 4
        assert all(np.array_equal(o, v) for o, v in zip(outs, va))  # A's bytes, unchanged
        outs = [np.zeros(MIB, np.uint8) for _ in ks[2:]]
        assert b.get_into(list(b.lookup(ks[2:])), outs) == [True] * 2
        assert all(np.array_equal(o, v) for o, v in zip(outs, vb[2:]))
        assert len(master.index) == 6  # A's 4 and B's 2, under different stored keys


def test_the_same_host_path_serves_an_authenticated_client_from_the_arena_with_its_mask(secured):
    master, node = secured
    ks, vs = prompt_keys(3), blocks(3, seed=3)
    with client(master, TOKEN_A, shared_memory=True) as a:
        assert a.store(ks, vs) == [True] * 3
        assert a.flush()
        # written into the arena under a lease, committed; what is leased now is the stock for the next put
        assert node.store.dram.leased_slots == a.shared_path.stocked_slots()
        hits = node.store.dram.stats().hits
        for use_index in (True, False):  # rows found by the arena's key index, or by Locate: checked against the
            a.shared_path.use_index = use_index  # masked keys either way
            outs = [np.zeros(MIB, np.uint8) for _ in ks]
            assert a.get_into(list(a.lookup(ks)), outs) == [True] * 3
            assert all(np.array_equal(o, v) for o, v in zip(outs, vs))
            assert node.store.dram.stats().hits == hits  # copied from the arena by the client, not sent by the node
        assert a.shared_path.tenant_mask() == Authority.load(node.config.server.auth_file).mask("a")
        stored = mask_keys(pack_keys(ks), a.shared_path.tenant_mask())
        assert node.store.dram.contains([stored[i * 32 : (i + 1) * 32] for i in range(3)]) == [True] * 3


def test_the_arena_is_created_0600_or_exactly_the_group_mode_asked_for(tmp_path, arena_name, auth_file):
    with cluster(tmp_path, arena_name) as (_, node):
        assert stat.S_IMODE(os.stat(shm_path(arena_name)).st_mode) == 0o600
        assert node.config.tiers.dram.arena_mode == "0600"
    old = os.umask(0o077)  # a strict umask must not take the group's access away
    try:
        node = PoolNode(NodeConfig.of(master=f"127.0.0.1:{free_port()}", port=0, metrics_port=0, data_port=0,
                                   arena=arena_name, dram_bytes=4 * MIB, max_block_bytes=MIB, ssd_enabled=False,
                                   arena_mode="0660"))
        try:
            assert stat.S_IMODE(os.stat(shm_path(arena_name)).st_mode) == 0o660
        finally:
            node.stop()
    finally:
        os.umask(old)
    for mode in ("0666", "0604", "0400", "rw"):
        with pytest.raises(ValueError, match="arena_mode"):
            PoolNode(NodeConfig.of(port=0, metrics_port=0, data_port=0, arena=arena_name, dram_bytes=4 * MIB,
                                max_block_bytes=MIB, ssd_enabled=False, arena_mode=mode))
        assert not os.path.exists(shm_path(arena_name))  # refused before anything was created


# -- quotas ---------------------------------------------------------------------------------------------


def put_via(path: str, master: MasterServer, node: PoolNode, token: str, keys, values) -> list[bool]:
    if path == "grpc":
        channel, stub = node_stub(node, token)
        with channel:
            reply = stub.Put(node_pb2.PutRequest(keys=pack_keys(keys), sizes=[v.size for v in values],
                                                 checksums=[block_checksum(v) for v in values],
                                                 data=b"".join(v.tobytes() for v in values)), timeout=10)
        return [s != 0 for s in reply.stored]
    with client(master, token, shared_memory=path == "shm") as c:
        return c.store(keys, values)


@pytest.mark.parametrize("path", ["grpc", "bulk", "shm"])
def test_a_tenant_over_quota_loses_its_own_oldest_blocks_and_never_another_tenants(tmp_path, arena_name, path):
    auth = write_auth(tmp_path / "auth.json", quota_a="3M")
    with cluster(tmp_path, arena_name, master_over={"auth_file": auth}, auth_file=auth, token=NODE_TOKEN,
                 write_through=True, max_block_bytes=4 * MIB, dram_bytes=64 * MIB) as (master, node):
        ka, kb = prompt_keys(5, "a"), prompt_keys(3, "b")
        va, vb = blocks(5, seed=5), blocks(3, seed=6)
        assert put_via(path, master, node, TOKEN_A, ka[:3], va[:3]) == [True] * 3
        assert put_via(path, master, node, TOKEN_B, kb, vb) == [True] * 3  # b has no quota
        assert node.quota.used("a") == 3 * MIB
        assert put_via(path, master, node, TOKEN_A, ka[3:], va[3:]) == [True, True]
        assert node.quota.used("a") == 3 * MIB
        assert node.link.flush()  # the node reports its evictions in the background: the master has them now
        with client(master, TOKEN_A) as a, client(master, TOKEN_B) as b:
            assert a.exists(ka) == [False, False, True, True, True]  # its two oldest made room
            assert b.exists(kb) == [True] * 3
            outs = [np.zeros(MIB, np.uint8) for _ in kb]
            assert b.get_into(list(b.lookup(kb)), outs) == [True] * 3
            assert all(np.array_equal(o, v) for o, v in zip(outs, vb))
        # A block larger than the whole quota is refused, counted, and evicts nothing.
        refused = errors(node, "quota_exceeded")
        assert put_via(path, master, node, TOKEN_A, prompt_keys(1, "big"), blocks(1, 4 * MIB)) == [False]
        assert errors(node, "quota_exceeded") > refused
        assert node.quota.used("a") == 3 * MIB
        node_config = node.config
    # A restarted node counts what its SSD still holds (write-through: everything).
    restarted = PoolNode(node_config)
    try:
        assert restarted.quota.used("a") == 3 * MIB
    finally:
        restarted.stop()


def test_bulk_put_reservations_count_against_the_quota_while_their_bytes_are_on_the_way(tmp_path, arena_name):
    """A tenant's bulk PUTs that never send their bytes hold at most its quota of slots, and evict no one."""
    auth = write_auth(tmp_path / "auth.json", quota_a="2M")
    with cluster(tmp_path, arena_name, master_over={"auth_file": auth}, auth_file=auth, token=NODE_TOKEN,
                 ssd_enabled=False) as (master, node):  # 16 slots of 1 MiB, the high watermark at 15
        kb, vb = prompt_keys(10, "b"), blocks(10, seed=7)
        with client(master, TOKEN_B) as b:
            assert b.store(kb, vb) == [True] * 10
        refused = errors(node, "quota_exceeded")
        socks: list[socket.socket] = []
        try:
            for conn in range(4):  # four PUTs of 8 blocks each, stalled before their data
                sock = socket.create_connection(("127.0.0.1", node.bulk.port), timeout=5)
                socks.append(sock)
                sock.sendall(auth_frame(TOKEN_A))
                assert read_fast_reply(sock) == (0, b"")
                header = node_pb2.BulkPutRequest(keys=pack_keys(prompt_keys(8, f"stall-{conn}")), sizes=[MIB] * 8,
                                                 checksums=[0] * 8).SerializeToString()
                sock.sendall(wire.pack(Method.PUT, len(header), 8 * MIB) + header)
                # the node has taken this PUT's quota decision once it refused at least 6 of its 8 blocks
                wait_until(lambda n=conn: errors(node, "quota_exceeded") >= refused + 6 * (n + 1), timeout=10)
            assert node.store.dram.leased_slots == 2 and node.quota.reserved("a") == 2 * MIB
            with client(master, TOKEN_B) as b:
                outs = [np.zeros(MIB, np.uint8) for _ in kb]
                assert b.get_into(list(b.lookup(kb)), outs) == [True] * 10
                assert all(np.array_equal(o, v) for o, v in zip(outs, vb))
        finally:
            for sock in socks:
                sock.close()
        # a dropped connection releases its reservation, and the charge with it
        wait_until(lambda: node.store.dram.leased_slots == 0 and node.quota.reserved("a") == 0, timeout=10)


# -- TLS -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA, a server certificate it signed (SAN IP 127.0.0.1, DNS localhost), and an unrelated CA."""
    d = tmp_path_factory.mktemp("certs")
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    make_cert(d, "server", "ca", "kvpool server", "serverAuth", san="IP:127.0.0.1,DNS:localhost")
    return {name: str(d / name) for name in ("ca.pem", "other-ca.pem", "server.pem", "server.key")}


@pytest.fixture
def tls_cluster(tmp_path, arena_name, auth_file, certs):
    with cluster(tmp_path, arena_name,
                 master_over={"auth_file": auth_file, "tls_cert": certs["server.pem"], "tls_key": certs["server.key"]},
                 auth_file=auth_file, token=NODE_TOKEN, tls_cert=certs["server.pem"], tls_key=certs["server.key"],
                 tls_ca=certs["ca.pem"]) as (master, node):
        yield master, node


def test_tls_round_trip_over_grpc_fast_calls_and_bulk(tls_cluster, certs):
    master, node = tls_cluster
    ks, vs = prompt_keys(3), blocks(3, seed=7)
    with client(master, TOKEN_A, tls_ca=certs["ca.pem"], strict=True) as a:
        assert a.store(ks, vs) == [True] * 3  # PlaceBlocks over fast calls, the bytes over bulk: both TLS
        run = a.lookup(ks)
        outs = [np.zeros(MIB, np.uint8) for _ in ks]
        assert a.get_into(list(run), outs) == [True] * 3
        assert all(np.array_equal(o, v) for o, v in zip(outs, vs))
        # Really over the TCP listeners, in TLS: the client's pooled connections to both.
        calls = a._calls._idle.get(f"127.0.0.1:{master.servicer.call_port}", [])
        data = a.bulk_path.bulk._pool._idle.get(node.data_address, [])
        assert calls and data and all(isinstance(sock, ssl.SSLSocket) for sock in calls + data)
        assert error_counts(a.registry).get("bulk_fallback", 0) == 0
    channel, stub = node_stub(node, TOKEN_A, tls_ca=certs["ca.pem"])  # and the gRPC fallback
    with channel:
        got = stub.Get(node_pb2.GetRequest(keys=pack_keys(ks)), timeout=10)
        assert got.data == b"".join(v.tobytes() for v in vs)


def test_cluster_status_for_commands_and_benchmarks_uses_the_client_credentials(tls_cluster, certs):
    """`kvpool demo`, `status` and the benches ask the master one way: with a TLS and auth master they see its
    node when given the client's token and CA, and get a clear ValueError (not a hang, not a traceback) without."""
    from kvpool.bench.replay import cluster_nodes
    from kvpool.status import MasterUnreachable, cluster_status

    master, node = tls_cluster
    nodes = cluster_nodes(master.address, token=TOKEN_A, tls_ca=certs["ca.pem"])
    assert [n for n, _ in nodes] == [node.node_ref.node_id]
    assert len(cluster_status(master.address, token=TOKEN_A, tls_ca=certs["ca.pem"]).nodes) == 1
    with pytest.raises(MasterUnreachable, match=f"cannot ask the master at {master.address}: UNAUTHENTICATED"):
        cluster_status(master.address, tls_ca=certs["ca.pem"], timeout=5)
    with pytest.raises(ValueError, match="cannot ask the master"):
        cluster_nodes(master.address, timeout=2)  # plaintext to a TLS listener


@pytest.mark.parametrize("ca", [None, "other-ca.pem"], ids=["no-ca", "wrong-ca"])
def test_a_client_that_cannot_verify_the_servers_gets_misses_not_exceptions(tls_cluster, certs, ca):
    master, node = tls_cluster
    ks = prompt_keys(2)
    with client(master, TOKEN_A, tls_ca=certs["ca.pem"]) as good:
        assert good.store(ks, blocks(2)) == [True, True]
    with client(master, TOKEN_A, tls_ca=certs[ca] if ca else "", lookup_timeout_s=1.0, io_timeout_s=1.0) as c:
        assert len(c.lookup(ks)) == 0
        assert c.exists(ks) == [False, False]
        assert c.store(prompt_keys(1, "x"), blocks(1)) == [False]
        assert error_counts(c.registry).get("unavailable", 0) >= 3
    other = BulkClient(2.0, token=TOKEN_A)  # plain TCP to a TLS listener: no answer it can read
    try:
        with pytest.raises((BulkFailed, BulkUnavailable)):
            other.get_into(node.data_address, ks[:1], [np.zeros(MIB, np.uint8)], [0])
    finally:
        other.close()


# -- limits ---------------------------------------------------------------------------------------------


def test_limits_are_refused_with_a_clear_status_and_change_nothing(tmp_path, arena_name):
    with cluster(tmp_path, arena_name, master_over={"max_keys_per_call": 4, "max_connections": 2},
                 max_keys_per_call=4, max_message_bytes=4 * MIB, max_connections=2, max_block_bytes=4 * MIB,
                 dram_bytes=32 * MIB) as (master, node):
        five = pack_keys(prompt_keys(5))
        channel, stub = node_stub(node)
        with channel:
            with pytest.raises(grpc.RpcError) as over:
                stub.Exists(node_pb2.NodeExistsRequest(keys=five), timeout=5)
            assert over.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit is 4" in over.value.details()
        channel, mstub = master_stub(master)
        with channel:
            with pytest.raises(grpc.RpcError) as over:
                mstub.PlaceBlocks(master_pb2.PlaceBlocksRequest(keys=five, sizes=[1] * 5), timeout=5)
            assert over.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_keys_per_call" in over.value.details()
        with socket.create_connection(("127.0.0.1", node.bulk.port), timeout=5) as sock:  # keys per bulk request
            sock.sendall(fast_frame(Method.GET, node_pb2.GetRequest(keys=five).SerializeToString()))
            status, text = read_fast_reply(sock)
            assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert b"5 keys in one request; the limit is 4" in text
        vs = blocks(2, size=3 * MIB)
        c = BulkClient(5.0)
        try:  # bytes per bulk PUT
            with pytest.raises(BulkFailed, match="the limit is 4194304"):
                c.put(node.data_address, prompt_keys(2), vs, [block_checksum(v) for v in vs])
            assert c.put(node.data_address, prompt_keys(1), vs[:1], [block_checksum(vs[0])]) == [True]
        finally:
            c.close()
        assert node.store.where(prompt_keys(2)) == [Tier.DRAM, None]
        with socket.create_connection(("127.0.0.1", node.bulk.port), timeout=5) as sock:  # fast-call body size
            sock.sendall(wire.pack(Method.LOCATE, 5 * MIB))
            status, text = read_fast_reply(sock)
            assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"over the limit" in text
        # Connections: with every slot taken by a connection idle between requests, a newcomer is served and the
        # longest-idle connection is closed to make room (refusals, when every connection is busy, are in
        # test_bulk.py and test_listener_limits.py).
        def ask(sock: socket.socket, read: str) -> None:
            if read == "bulk":
                sock.sendall(fast_frame(Method.GET, node_pb2.GetRequest(keys=prompt_keys(1)[0]).SerializeToString()))
                head = wire.parse(recv_exact(sock, wire.FRAME.size))
                assert head is not None and head.code == 0
                recv_exact(sock, head.header + head.payload + head.trailer)  # the reply, its bytes and trailer
            else:
                sock.sendall(fast_frame(LOOKUP, master_pb2.LookupRequest().SerializeToString()))
                assert read_fast_reply(sock)[0] == 0

        for port, listener, read in ((node.bulk.port, node.bulk, "bulk"),
                                     (master.servicer.call_port, master._calls, "calls")):
            held = []
            for _ in range(2):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                ask(s, read)
                held.append(s)
            # both back between requests (a reply is read before its server thread gets there)
            wait_until(lambda listener=listener: listener.connections == listener.waiting_connections() == 2)
            with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
                ask(extra, read)  # served: the longest-idle connection was closed for it
            # Which one waited longest depends on which server thread reached its wait first (either, on a busy
            # machine): exactly one is closed, and the other is still served.
            closed, _, _ = select.select(held, [], [], 30)
            assert len(closed) == 1 and closed[0].recv(1) == b""
            ask(held[1] if closed[0] is held[0] else held[0], read)
            for s in held:
                s.close()


# -- the auth file, and `kvpool serve` with one -------------------------------------------------------------


def test_a_bad_auth_file_is_a_clear_error_before_anything_starts(tmp_path, arena_name):
    cases = {
        "not json": "{",
        "short token": json.dumps({"secret": "00" * 32, "node_tokens": ["short"]}),
        "twice": json.dumps({"secret": "00" * 32, "node_tokens": [NODE_TOKEN],
                             "clients": {NODE_TOKEN: {"tenant": "a"}}}),
        "no secret": json.dumps({"node_tokens": [NODE_TOKEN]}),
        "bad quota": json.dumps({"secret": "00" * 32, "clients": {TOKEN_A: {"tenant": "a", "quota_bytes": "lots"}}}),
        "no tenant": json.dumps({"secret": "00" * 32, "clients": {TOKEN_A: {"quota_bytes": 1}}}),
    }
    for why, text in cases.items():
        path = tmp_path / "auth.json"
        path.write_text(text)
        with pytest.raises(ValueError, match="auth"):
            MasterServer(MasterConfig.of(port=0, metrics_port=0, auth_file=str(path)))
        with pytest.raises(ValueError, match="auth"):
            PoolNode(NodeConfig.of(port=0, metrics_port=0, arena=arena_name, dram_bytes=4 * MIB, max_block_bytes=MIB,
                                ssd_enabled=False, auth_file=str(path)))
        assert not os.path.exists(shm_path(arena_name)), why


def test_kvpool_serve_with_an_auth_file_serves_token_holders_only(tmp_path, auth_file):
    port, node_port = free_port(), free_port()
    arena = f"kvpool-test-{os.getpid()}-serve-auth"
    proc = kvpool_process("serve", "--master-port", str(port), "--master-metrics-port", "0", "--port", str(node_port),
                          "--metrics-port", "0", "--arena", arena, "--dram-bytes", "8M", "--max-block-bytes", "1M",
                          "--ssd-dir", str(tmp_path / "ssd"), "--ssd-bytes", "64M", "--auth-file", auth_file,
                          log_path=tmp_path / "serve.log")
    try:
        wait_serving(f"127.0.0.1:{port}", timeout=60, proc=proc)
        channel = make_channel(f"127.0.0.1:{port}", max_message_bytes=MIB, token=TOKEN_A)
        with channel:
            stub = master_pb2_grpc.MasterStub(channel)
            wait_until(lambda: stub.ClusterStatus(master_pb2.ClusterStatusRequest(), timeout=5).nodes, timeout=20)
        config = ClientConfig(master=f"127.0.0.1:{port}", token=TOKEN_A, lookup_timeout_s=2.0)
        ks, vs = prompt_keys(2), blocks(2)
        with PoolClient(config) as a:
            assert a.store(ks, vs) == [True, True]
        with PoolClient(ClientConfig(master=f"127.0.0.1:{port}", lookup_timeout_s=2.0)) as anonymous:
            assert len(anonymous.lookup(ks)) == 0 and anonymous.store(ks, vs) == [False, False]
            assert error_counts(anonymous.registry).get("unauthenticated", 0) >= 1
        env = {**os.environ, "KVPOOL_CLIENT_TOKEN": TOKEN_A}
        for extra_env, code in ((env, 0), (os.environ, 1)):
            done = subprocess.run([sys.executable, "-m", "kvpool.cli", "status", "--master", f"127.0.0.1:{port}"],
                                  check=False, capture_output=True, text=True, env=extra_env, timeout=60)
            assert done.returncode == code, done.stderr
    finally:
        assert stop_process(proc) == 0
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm_path(arena))


def test_kvpool_serve_shares_the_security_settings_between_its_master_and_node(auth_file, certs):
    from kvpool.config import PoolConfig
    from kvpool.serve import master_config_for, node_config_for

    config = PoolConfig(master=MasterConfig.of(auth_file=auth_file, tls_cert=certs["server.pem"],
                                               tls_key=certs["server.key"]),
                        node=NodeConfig.of(tls_ca=certs["ca.pem"]))
    node = node_config_for(config, 7777)
    assert (node.master, node.server.auth_file, node.token) == ("127.0.0.1:7777", auth_file, NODE_TOKEN)
    assert (node.tls.cert, node.tls.key) == (certs["server.pem"], certs["server.key"])
    master = master_config_for(PoolConfig(node=NodeConfig.of(auth_file=auth_file)))
    assert master.server.auth_file == auth_file
    with pytest.raises(ValueError, match="tls_ca"):  # the node could not verify its own master
        node_config_for(PoolConfig(master=config.master), 7777)
