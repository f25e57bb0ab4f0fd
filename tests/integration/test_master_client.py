"""The typed master interface (kvpool.master_client): one Info per client, shared by its every use."""

from __future__ import annotations

import json
import secrets

import grpc
import numpy as np
import pytest
from support import wait_until

from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig, MasterConfig, NodeConfig
from kvpool.keys import BlockKey, opaque_key, pack_keys
from kvpool.master.server import MasterServer
from kvpool.master.servicer import MasterServicer
from kvpool.node.daemon import PoolNode
from kvpool.v1 import master_pb2

NODE_TOKEN = secrets.token_hex(32)
CLIENT_TOKEN = secrets.token_hex(32)
BLOCK = 64 << 10


def key(i: int) -> BlockKey:
    return opaque_key(f"master-client-{i}")


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8)


def test_a_client_asks_the_master_info_once_for_its_fast_calls_and_its_tenant_mask(tmp_path, arena_name, monkeypatch):
    infos: list[master_pb2.MasterInfoRequest] = []
    info = MasterServicer.Info

    def counted(servicer, request, context):
        infos.append(request)
        return info(servicer, request, context)

    monkeypatch.setattr(MasterServicer, "Info", counted)  # before the server binds its handlers
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"secret": secrets.token_hex(32), "node_tokens": [NODE_TOKEN],
                                "clients": {CLIENT_TOKEN: {"tenant": "a"}}}))
    master = MasterServer(MasterConfig.of(host="127.0.0.1", port=0, metrics_port=0, call_port=0,
                                       auth_file=str(auth))).start()
    try:
        node = PoolNode(NodeConfig.of(master=master.address, host="127.0.0.1", port=0, metrics_port=0, data_port=0,
                                   arena=arena_name, dram_bytes=16 * BLOCK, max_block_bytes=BLOCK,
                                   ssd_enabled=False, auth_file=str(auth), token=NODE_TOKEN)).start()
        try:
            wait_until(lambda: node.link.registered, timeout=20)
            assert len(infos) == 1  # the node's link asked once, for its fast-call reports
            keys = [key(i) for i in range(4)]
            with PoolClient(ClientConfig(master=master.address, token=CLIENT_TOKEN, strict=True)) as pool:
                # NameBlocks is a fast call (the master's fast-call port comes from Info) ...
                assert pool.put(keys, [block(i) for i in range(4)], engine_hashes=[1, 2, 3, 4]) == [True] * 4
                assert pool.flush()
                over_wire = pool.master.lookup(master_pb2.LookupRequest(keys=pack_keys(keys)), 5.0)
                assert len(over_wire.tiers) == 4
                # ... and same-host reads compare arena rows under the tenant mask (also from Info).
                run = pool.lookup(keys)
                assert len(run) == 4
                outs = [np.empty(BLOCK, dtype=np.uint8) for _ in keys]
                assert pool.get_into(run, outs) == [True] * 4
                assert all(np.array_equal(o, block(i)) for i, o in enumerate(outs))
                assert pool.shared_path.tenant_mask is not None and pool.shared_path.tenant_mask() not in (None, b"")
                assert len(infos) == 2  # the client's one
        finally:
            node.stop()
    finally:
        master.stop()


@pytest.mark.parametrize("wait", [True, False])
def test_a_closed_connection_refuses_calls_as_unavailable_at_once(wait):
    with MasterServer(MasterConfig.of(port=0, metrics_port=0, call_port=0)) as server:
        pool = PoolClient(ClientConfig(master=server.address, lookup_timeout_s=2.0))
        pool.master.close()
        errors: list[grpc.RpcError] = []
        request = master_pb2.ReportHbmRequest(worker_id="w")
        if wait:
            with pytest.raises(grpc.RpcError) as refused:
                pool.master.report_hbm(request, 2.0)
            errors.append(refused.value)
        else:
            pool.master.report_hbm_nowait(request, 2.0, errors.append)
        assert len(errors) == 1 and isinstance(errors[0], grpc.RpcError)
        assert errors[0].code() == grpc.StatusCode.UNAVAILABLE and "closed" in errors[0].details()
        pool.close()
