"""Where a master's 64-key Lookup spends its CPU, stage by stage, in one process (no sockets, no other load).

    python benchmarks/lookup_path.py [--blocks 4096] [--calls 20000] [--profile]

Builds the master's parts as ``kvpool master`` does (``MasterServer``, nothing bound), registers one node and
indexes ``--blocks`` blocks, then times, best of 3 rounds of ``--calls``: the request's decode, the whole
servicer ``Lookup`` (validation, tenant mapping, the index, the reply, the metrics), and its parts on their own
(the pass that finds and encodes the run in one compiled call, the lookup counters, the latency histogram,
the worker's liveness, the node's ref, the reply's bytes), for reference the index's run alone
(``BlockIndex.leading_run_arrays``, ``KeyTable.find``) and a found run's encoding, gRPC's parse of the
reply, one lookup through the fast-call handler, and per lookup, 32 lookups answered together through it
(one pass; wire decode and encode included). ``master_scale.py`` measures the same
path in a real master under load (where each stage costs more: caches are shared with the clients); this one
is steady enough to compare two versions on a busy machine. ``--profile``: cProfile of the servicer's Lookup
after the table.
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool.config import MasterConfig
from kvpool.keys import opaque_key
from kvpool.master.lookup_reply import encode_runs, lookup_replies, reply
from kvpool.master.server import MasterServer
from kvpool.v1 import common_pb2, master_pb2

LOOKUP_KEYS = 64
TOGETHER = 32  # lookups that reach the call loop in one wake-up (a 32-client run's usual case)


class _Context:
    def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(details)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    server = MasterServer(MasterConfig())
    servicer, ctx = server.servicer, _Context()
    ref = common_pb2.NodeRef(node_id="n1", address="127.0.0.1:7610", host_id="h", arena="a")
    usage = [common_pb2.TierUsage(tier=common_pb2.TIER_DRAM, capacity_bytes=1 << 40)]
    node = servicer.RegisterNode(master_pb2.RegisterNodeRequest(node=ref, tiers=usage, dram_max_block_bytes=1 << 20),
                                 ctx)
    keys = [opaque_key(f"scale-{i}") for i in range(args.blocks)]
    for s in range(0, len(keys), 4096):
        part = keys[s : s + 4096]
        servicer.ReportBlocks(master_pb2.ReportBlocksRequest(
            node_id="n1", incarnation=node.incarnation, tier=common_pb2.TIER_DRAM, added_keys=b"".join(part),
            added_sizes=[4096] * len(part), added_checksums=[1] * len(part)), ctx)
    half = LOOKUP_KEYS // 2
    absent = b"".join(opaque_key(f"absent-{i}") for i in range(half))
    request = master_pb2.LookupRequest(keys=b"".join(keys[:half]) + absent, worker_id="scale-0")
    body = request.SerializeToString()
    answer = servicer.Lookup(request, ctx)
    if len(answer.tiers) != half:
        raise SystemExit(f"lookup found {len(answer.tiers)} of {half} present keys")
    index, table = server.index, server.index._table
    words = np.frombuffer(request.keys, np.uint64).reshape(-1, 4)  # the key's four words, as the index reads them
    run, field = index.leading_run_arrays(request.keys), servicer._node_field(server.membership.refs([0])[0])
    rows = np.array([0], np.int64), np.array([half], np.int64)
    (found,) = index.leading_runs_pass(lookup_replies, [request.keys])[0]
    encoded = answer.SerializeToString()
    stages: list[tuple[str, Callable[[], Any]]] = [
        ("request decode", lambda: master_pb2.LookupRequest.FromString(body)),
        ("servicer Lookup (gRPC's: all of the below, and the reply parsed)", lambda: servicer.Lookup(request, ctx)),
        ("  the pass: probe and reply fields, one compiled call (leading_runs_pass, lookup_replies)",
         lambda: index.leading_runs_pass(lookup_replies, [request.keys])),
        ("  lookup counters (record_lookup)", lambda: server.metrics.record_lookup(
            hbm=0, dram=half, ssd=0, requested=LOOKUP_KEYS, block_tokens=0)),
        ("  latency histogram (observe)", lambda: server.metrics.lookup_seconds.observe(1e-4)),
        ("  worker liveness (worker_seen)", lambda: server.membership.worker_seen("scale-0")),
        ("  node refs (Membership.refs)", lambda: server.membership.refs(found.nodes)),
        ("  the reply's bytes (lookup_reply.reply)", lambda: reply(found, [field])),
        ("the index alone (BlockIndex.leading_run_arrays)", lambda: index.leading_run_arrays(request.keys)),
        ("  KeyTable.find", lambda: table.find(words[:, 0], words[:, 1])),
        ("a found run encoded (lookup_reply.encode_runs)", lambda: encode_runs(*run, *rows)),
        ("gRPC's reply message from those bytes", lambda: master_pb2.LookupResponse.FromString(encoded)),
    ]
    together = _together_requests(server, keys[:half], TOGETHER)
    stages.append(("one lookup on the fast-call wire (WireHandler.answer)",
                   lambda: together[0].answer(*together[1][0])))
    stages.append((f"{TOGETHER} lookups answered together, per lookup (WireHandler.answer_together)",
                   lambda: together[0].answer_together(together[1])))
    print(f"{LOOKUP_KEYS}-key Lookup, {half} present, {args.blocks} blocks indexed; best of 3 x {args.calls} calls")
    print("| stage | us per call |\n|---|---|")
    for name, fn in stages:
        per = TOGETHER if "together" in name else 1
        calls = max(1, args.calls // per)
        us = min(timeit.repeat(fn, number=calls, repeat=3)) / calls / per * 1e6
        print(f"| {name} | {us:.1f} |")
    if args.profile:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.runcall(lambda: [servicer.Lookup(request, ctx) for _ in range(args.calls)])
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)
    return 0


def _together_requests(server: MasterServer, present: list, n: int) -> tuple[Any, list]:
    """A fast-call handler over ``server``'s servicer and ``n`` complete Lookup requests for it (as the call
    loop holds them after one wake-up): each half present, half absent keys."""
    from kvpool.auth import Peer
    from kvpool.wire import MASTER_CALLS, Method, WireHandler, request_frame, unary_routes

    routes = unary_routes(server.servicer, master_pb2.DESCRIPTOR.services_by_name["Master"], MASTER_CALLS,
                          max_body_bytes=64 << 20, max_keys=None)
    handler, peer = WireHandler(routes, max_frame_bytes=64 << 20), Peer(None)
    requests = []
    for i in range(n):
        absent = b"".join(opaque_key(f"absent-{i}-{j}") for j in range(len(present)))
        head, body = request_frame(Method.LOOKUP, master_pb2.LookupRequest(keys=b"".join(present) + absent,
                                                                           worker_id=f"scale-{i}"))
        requests.append((handler.begin(head, peer), body, peer, "127.0.0.1"))
    return handler, requests


if __name__ == "__main__":
    raise SystemExit(main())
