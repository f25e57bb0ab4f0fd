"""A writer killed halfway through a put: nothing half-written becomes visible, and its DRAM slots come back.

The writer is a child process that stops in the middle of a put and is
killed with SIGKILL there:

- ``lease``: a same-host writer: ``Reserve`` (over gRPC), half of each
  block's bytes copied into the leased arena slots, no ``Commit``. The node's
  lease reaper must free the slots once the lease lapses (``lease_timeout_s``).
- ``bulk``: a remote writer: a bulk TCP ``PUT`` whose header, keys, sizes
  and checksums arrived but only half of the data. The node receives straight
  into reserved slots; the dead peer's connection closing must release them.

The node has 4 DRAM slots and no SSD, and the writer asks for all 4: while
they are held nothing else fits, so "the space came back" is checked by
storing 4 blocks afterwards (Mooncake users saw such keys stuck forever).
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from fault.faultkit import (
    KIB,
    Child,
    content,
    keys_of,
    master_exists,
    master_flags,
    node_holds,
    node_metric,
    start_master,
    start_node,
)
from support import wait_until

from kvpool.client.pool import PoolClient
from kvpool.keys import pack_keys
from kvpool.tiers.arena import SharedArena
from kvpool.v1 import node_pb2, node_pb2_grpc

BLOCK = 64 * KIB
SLOTS = 4
LEASE_TIMEOUT_S = 1.0

LEASE_WRITER = r"""
import json, sys, time
import grpc
from kvpool.checksum import block_checksum
from kvpool.keys import pack_keys
from kvpool.tiers.arena import SharedArena
from kvpool.v1 import node_pb2, node_pb2_grpc
from fault.faultkit import content, keys_of

address, tag, n, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
keys = keys_of(tag, n)
stub = node_pb2_grpc.NodeStub(grpc.insecure_channel(address))
reply = stub.Reserve(node_pb2.ReserveRequest(keys=pack_keys(keys), sizes=[size] * n), timeout=10)
arena = SharedArena.attach(reply.arena)
for key, slot, gen in zip(keys, reply.slots, reply.slot_gens):
    if gen:
        arena.block(slot, size // 2)[:] = content(key, size)[: size // 2]  # half of each block...
print(json.dumps({"arena": reply.arena, "lease": reply.lease, "slots": list(reply.slots),
                  "gens": list(reply.slot_gens), "checksums": [block_checksum(content(k, size)) for k in keys]}),
      flush=True)
time.sleep(600)  # ...and no Commit: killed here
"""

BULK_WRITER = r"""
import json, socket, sys, time
from kvpool.checksum import block_checksum
from kvpool.v1 import node_pb2
from kvpool.wire import Method, request_frame
from fault.faultkit import content, keys_of

host, port, tag, n, size = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
keys = keys_of(tag, n)
blocks = [content(k, size) for k in keys]
sock = socket.create_connection((host, port))
header = node_pb2.BulkPutRequest(keys=b"".join(keys), sizes=[size] * n, checksums=[block_checksum(b) for b in blocks])
sock.sendall(b"".join(request_frame(Method.PUT, header, n * size)))
data = b"".join(b.tobytes() for b in blocks)
sock.sendall(data[: len(data) // 2])  # half of the payload...
print(json.dumps({"sent": len(data) // 2, "of": len(data)}), flush=True)
time.sleep(600)  # ...and killed here
"""


def data_address(address: str) -> tuple[str, int]:
    """The node's bulk listener, from its Info."""
    with grpc.insecure_channel(address) as channel:
        info = node_pb2_grpc.NodeStub(channel).Info(node_pb2.InfoRequest(), timeout=5)
    host, _, port = info.node.data_address.rpartition(":")
    return host, int(port)


def leased(procs) -> float:
    return node_metric(procs, "n0", "kvpool_leased_slots")


@pytest.mark.parametrize("path", ["lease", "bulk"])
def test_a_writer_killed_mid_put_leaves_nothing_visible_and_its_slots_come_back(procs, client_config, path):
    procs.node_flags.update({"dram-bytes": str(SLOTS * BLOCK), "max-block-bytes": "64K", "ssd": "false",
                             "high-watermark": "1.0", "low-watermark": "1.0",
                             "lease-timeout-s": str(LEASE_TIMEOUT_S)})
    start_master(procs, **master_flags())
    start_node(procs, "n0")
    procs.wait_nodes(1)
    address = procs.node_address("n0")
    keys = keys_of(f"killed-{path}", SLOTS)
    if path == "lease":
        writer = Child(LEASE_WRITER, address, f"killed-{path}", str(SLOTS), str(BLOCK))
    else:
        host, port = data_address(address)
        writer = Child(BULK_WRITER, host, str(port), f"killed-{path}", str(SLOTS), str(BLOCK))
    try:
        said = writer.report()
        wait_until(lambda: leased(procs) == SLOTS, timeout=10)  # the node holds every slot for the writer
        if path == "lease":
            assert all(g % 2 == 1 for g in said["gens"])
            arena = SharedArena.attach(said["arena"])
            try:  # odd gens: no reader, in any process, can take a leased slot for a block
                assert all(arena.ref(s) is None for s in said["slots"])
            finally:
                arena.close()
        assert node_holds(address, keys) == [False] * SLOTS
        assert master_exists(procs, keys) == [False] * SLOTS
    finally:
        writer.kill()
    killed = time.monotonic()

    wait_until(lambda: leased(procs) == 0, timeout=LEASE_TIMEOUT_S + 5)
    reclaimed_s = time.monotonic() - killed
    assert node_holds(address, keys) == [False] * SLOTS  # the half-written blocks never became visible
    assert master_exists(procs, keys) == [False] * SLOTS
    if path == "lease":  # a Commit after the lease lapsed stores nothing, even with the right checksums
        with grpc.insecure_channel(address) as channel:
            late = node_pb2_grpc.NodeStub(channel).Commit(
                node_pb2.CommitRequest(lease=said["lease"], keys=pack_keys(keys), slots=said["slots"],
                                       checksums=said["checksums"]), timeout=5)
        assert list(late.stored) == [0] * SLOTS
        assert node_holds(address, keys) == [False] * SLOTS

    with PoolClient(client_config(strict=True, shared_memory=path == "lease")) as pool:
        values = [content(k, BLOCK) for k in keys]
        assert pool.store(keys, values) == [True] * SLOTS  # all 4 slots are free again; the keys are not stuck
        run = pool.lookup(keys)
        outs = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert pool.get_into(run, outs) == [True] * SLOTS
        assert all(np.array_equal(o, v) for o, v in zip(outs, values))
    print(f"\nFIGURES killed-writer ({path}): {SLOTS} leased slots back {reclaimed_s:.2f}s after the SIGKILL "
          f"(lease timeout {LEASE_TIMEOUT_S}s)")
