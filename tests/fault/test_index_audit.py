"""The master's index equals what the nodes hold, after any mix of put / remove / evict / demote / promote.

Regression: a ``Remove`` of a block waiting in the background demotion queue
cancelled its SSD write but never told the master, which had already been
told the block was on SSD: the index then answered "present" for it forever
and no writer stored that key again.
"""

from __future__ import annotations

import random

import grpc
import numpy as np
from fault.faultkit import KIB, content, keys_of, master_exists, node_tiers, start_master, start_node, wait_demoted
from support import wait_until

from kvpool.client.pool import PoolClient
from kvpool.keys import BlockKey, pack_keys
from kvpool.v1 import master_pb2, master_pb2_grpc, node_pb2, node_pb2_grpc
from kvpool.vocabulary import NO_TIER, Tier

BLOCK = 64 * KIB
NODE = {"dram-bytes": str(16 * BLOCK), "max-block-bytes": str(BLOCK), "ssd-bytes": str(64 << 20)}


def remove(address: str, keys: list[BlockKey]) -> None:
    with grpc.insecure_channel(address) as channel:
        node_pb2_grpc.NodeStub(channel).Remove(node_pb2.RemoveRequest(keys=pack_keys(keys)), timeout=5)


def master_tiers(master: str, keys: list[BlockKey]) -> list[int]:
    """The best tier the master's index names for each key (one Lookup per key: a Lookup answers a leading run)."""
    out = []
    with grpc.insecure_channel(master) as channel:
        stub = master_pb2_grpc.MasterStub(channel)
        for key in keys:
            reply = stub.Lookup(master_pb2.LookupRequest(keys=key, worker_id="audit"), timeout=5)
            out.append(reply.tiers[0] if reply.tiers else NO_TIER)
    return out


def disagreements(procs, keys: list[BlockKey]) -> list[tuple[int, int, int]]:
    """(key index, node's tier, master's tier) wherever the two differ."""
    held = node_tiers(procs.node_address("n1"), keys)
    indexed = master_tiers(procs.master, keys)
    return [(i, h, m) for i, (h, m) in enumerate(zip(held, indexed)) if h != m]


def test_a_remove_of_a_block_queued_for_demotion_leaves_the_index(procs, client_config):
    start_master(procs)
    start_node(procs, "n1", **NODE)
    procs.wait_nodes(1)
    keys = keys_of("audit-queued", 24)
    with PoolClient(client_config()) as pool:
        assert all(pool.store(keys, [content(k, BLOCK) for k in keys]))  # 24 blocks, 16 slots: the first evicted
    evicted = [k for k, t in zip(keys, node_tiers(procs.node_address("n1"), keys)) if t == Tier.SSD]
    assert evicted, "test: nothing was evicted"
    remove(procs.node_address("n1"), evicted)  # within the demotion queue's 1 s delay: cancelled, not written
    wait_demoted(procs, "n1")
    assert not any(t != NO_TIER for t in node_tiers(procs.node_address("n1"), evicted))
    try:
        wait_until(lambda: not any(master_exists(procs, evicted)), timeout=10)
    except TimeoutError:
        raise AssertionError("the master still indexes removed blocks that were waiting for demotion") from None
    with PoolClient(client_config()) as pool:  # and a writer can store them again
        assert all(pool.store(evicted, [content(k, BLOCK) for k in evicted]))
    assert all(t != NO_TIER for t in node_tiers(procs.node_address("n1"), evicted))


def test_the_index_equals_the_node_after_a_random_mix(procs, client_config):
    start_master(procs)
    start_node(procs, "n1", **NODE)
    procs.wait_nodes(1)
    rng = random.Random(11)
    keys = keys_of("audit-mix", 96)
    data = {k: content(k, BLOCK) for k in keys}
    wrong = 0
    with PoolClient(client_config()) as pool:
        for _ in range(120):
            op = rng.random()
            batch = rng.sample(keys, rng.randint(1, 6))
            if op < 0.5:  # put: fills DRAM, evicts (demotes) its LRU blocks
                pool.store(batch, [data[k] for k in batch])
            elif op < 0.65:  # remove: blocks in DRAM, queued for SSD, in flight or on SSD
                remove(procs.node_address("n1"), batch)
            else:  # read: DRAM hits refresh LRU, SSD hits are promoted (and evict others)
                run = pool.lookup(batch[:1])
                if len(run):
                    locs = list(run)
                    outs = [np.empty(loc.size, dtype=np.uint8) for loc in locs]
                    for loc, out, ok in zip(locs, outs, pool.get_into(locs, outs)):
                        wrong += bool(ok) and not np.array_equal(out, data[loc.key])
    assert wrong == 0
    wait_demoted(procs, "n1")
    try:
        wait_until(lambda: not disagreements(procs, keys), timeout=15)
    except TimeoutError:
        raise AssertionError(f"(key, node tier, master tier) disagree: {disagreements(procs, keys)}") from None
