"""Lookups answered together (one index pass, kvpool.wire.WireHandler.answer_together) answer exactly what each
answered alone would: same replies, same errors, each caller's tenant applied to its own keys only."""

from __future__ import annotations

import secrets

from kvpool.auth import Authority, Peer, mask_keys
from kvpool.config import MasterConfig
from kvpool.keys import opaque_key
from kvpool.master.server import MasterServer
from kvpool.v1 import common_pb2, master_pb2
from kvpool.wire import MASTER_CALLS, Method, WireHandler, request_frame, unary_routes


class _Ctx:
    def abort(self, code, details):
        raise RuntimeError(details)


def _handler(server: MasterServer, authority: Authority | None) -> WireHandler:
    routes = unary_routes(server.servicer, master_pb2.DESCRIPTOR.services_by_name["Master"], MASTER_CALLS,
                          max_body_bytes=64 << 20, max_keys=server.config.server.max_keys_per_call)
    return WireHandler(routes, max_frame_bytes=64 << 20, authority=authority)


def _store(server: MasterServer, node: str, packed: bytes, tier: common_pb2.Tier) -> None:
    ctx = _Ctx()
    ref = common_pb2.NodeRef(node_id=node, address=f"127.0.0.1:{7600 + len(node)}", host_id="h", arena="a")
    usage = [common_pb2.TierUsage(tier=common_pb2.TIER_DRAM, capacity_bytes=1 << 40)]
    reg = server.servicer.RegisterNode(master_pb2.RegisterNodeRequest(node=ref, tiers=usage,
                                                                      dram_max_block_bytes=1 << 20), ctx)
    n = len(packed) // 32
    server.servicer.ReportBlocks(master_pb2.ReportBlocksRequest(
        node_id=node, incarnation=reg.incarnation, tier=tier, added_keys=packed,
        added_sizes=list(range(1, n + 1)), added_checksums=list(range(100, 100 + n))), ctx)


def _requests(handler: WireHandler, calls: list[tuple[Peer, master_pb2.LookupRequest | bytes]]):
    out = []
    for peer, request in calls:
        head, body = request_frame(Method.LOOKUP, request)
        out.append((handler.begin(head, peer), body, peer, "127.0.0.1"))
    return out


def _answers(handler: WireHandler, requests) -> tuple[list, list]:
    together = handler.answer_together(requests)
    alone = [handler.answer(*r) for r in requests]
    return together, alone


def test_lookups_together_answer_what_each_answers_alone():
    server = MasterServer(MasterConfig())
    keys = [opaque_key(f"together-{i}") for i in range(64)]
    _store(server, "n1", b"".join(keys[:20]), common_pb2.TIER_DRAM)
    _store(server, "n22", b"".join(keys[20:30]), common_pb2.TIER_SSD)
    handler = _handler(server, None)
    peer = Peer(None)
    calls: list[tuple[Peer, master_pb2.LookupRequest | bytes]] = [
        (peer, master_pb2.LookupRequest(keys=b"".join(keys[:40]), worker_id="w1", hbm_prefix_blocks=3,
                                        block_tokens=16)),
        (peer, master_pb2.LookupRequest(keys=b"".join(keys[25:28]))),
        (peer, master_pb2.LookupRequest(keys=b"")),
        (peer, master_pb2.LookupRequest(keys=b"".join(keys[40:]))),  # all absent
        (peer, master_pb2.LookupRequest(keys=b"x" * 33)),  # ragged: INVALID_ARGUMENT
        (peer, master_pb2.LookupRequest(keys=keys[0], worker_id="\x00bad")),  # bad worker id
        (peer, b"\xff\xff not a LookupRequest"),  # undecodable
        (peer, master_pb2.LookupRequest(keys=b"".join(keys[10:22]))),  # runs across both nodes and tiers
    ]
    together, alone = _answers(handler, _requests(handler, calls))
    assert all(a is not None for a in together)
    assert together == alone
    runs = [master_pb2.LookupResponse.FromString(reply[32:]) for reply, _ in together[:4]]
    assert [len(r.tiers) for r in runs] == [30, 3, 0, 0]
    assert [len(r.nodes) for r in runs] == [2, 1, 0, 0]


def test_each_tenant_finds_only_its_own_keys_among_lookups_answered_together():
    tokens = {"a": secrets.token_hex(16), "b": secrets.token_hex(16)}
    authority = Authority(secrets.token_bytes(32), [], {tokens["a"]: ("a", 0), tokens["b"]: ("b", 0)})
    server = MasterServer(MasterConfig())
    keys = [opaque_key(f"tenant-{i}") for i in range(16)]
    packed = b"".join(keys)
    _store(server, "n1", mask_keys(packed, authority.mask("a")), common_pb2.TIER_DRAM)  # a's blocks only
    handler = _handler(server, authority)
    peers = {}
    for tenant, token in tokens.items():
        peers[tenant] = Peer(authority)
        assert peers[tenant].login(token)
    anonymous = Peer(authority)  # never logged in: its frame is not a lookup yet (answered alone: refused)
    calls = [(peers["a"], master_pb2.LookupRequest(keys=packed)),
             (peers["b"], master_pb2.LookupRequest(keys=packed)),
             (peers["a"], master_pb2.LookupRequest(keys=packed[:64])),
             (anonymous, master_pb2.LookupRequest(keys=packed))]
    requests = _requests(handler, calls)
    together, alone = _answers(handler, requests)
    assert together[:3] == alone[:3] and together[3] is None and alone[3][1] is False
    found = [len(master_pb2.LookupResponse.FromString(together[i][0][32:]).tiers) for i in (0, 1, 2)]
    assert found == [16, 0, 2]


def test_other_methods_and_single_lookups_are_left_to_answer_alone():
    server = MasterServer(MasterConfig())
    handler = _handler(server, None)
    peer = Peer(None)
    lookup = _requests(handler, [(peer, master_pb2.LookupRequest(keys=opaque_key("x")))])
    head, body = request_frame(Method.EXISTS, master_pb2.ExistsRequest(keys=opaque_key("x")))
    exists = (handler.begin(head, peer), body, peer, "127.0.0.1")
    assert handler.answer_together(lookup + [exists]) == [None, None]


def test_one_pass_takes_at_most_max_together_bytes_of_requests(monkeypatch):
    """However many requests arrive together, one index pass holds at most MAX_TOGETHER_BYTES of them (the
    memory a pass costs stays that of a few requests); every reply is still what it would be alone."""
    from kvpool import wire

    forty = len(master_pb2.LookupRequest(keys=bytes(40 * 32)).SerializeToString())
    monkeypatch.setattr(wire, "MAX_TOGETHER_BYTES", 3 * forty)  # three 40-key lookups a pass
    server = MasterServer(MasterConfig())
    keys = [opaque_key(f"parts-{i}") for i in range(40)]
    _store(server, "n1", b"".join(keys), common_pb2.TIER_DRAM)
    handler = _handler(server, None)
    passes: list[int] = []
    steps = server.servicer.together["Lookup"]
    run = steps.run
    monkeypatch.setattr(steps, "run", lambda begun: passes.append(len(begun)) or run(begun))
    peer = Peer(None)
    requests = _requests(handler, [(peer, master_pb2.LookupRequest(keys=b"".join(keys[:n]))) for n in
                                   [40] * 7 + [1]])
    together, alone = _answers(handler, requests)
    # (the last: one 40-key lookup and the 1-key one; then each of the eight alone, a pass of one)
    assert passes == [3, 3, 2] + [1] * 8
    assert together == alone
    assert wire._parts([5, 6, 7], [10, 99, 1], 20) == [[5], [6], [7]]


def test_a_node_dropped_while_a_lookup_looked_ends_its_run_at_its_first_block(monkeypatch):
    """The index still lists a dropped node's blocks until its drop is through; a lookup that meets one ends its
    run there and never names the node, alone or together with others."""
    server = MasterServer(MasterConfig())
    keys = [opaque_key(f"dropped-{i}") for i in range(12)]
    _store(server, "n1", b"".join(keys[:4] + keys[6:]), common_pb2.TIER_DRAM)
    _store(server, "n22", b"".join(keys[4:6]), common_pb2.TIER_SSD)
    membership = server.membership
    (gone,) = [info.number for info in membership.live_nodes() if info.ref.node_id == "n22"]
    refs = membership.refs
    monkeypatch.setattr(membership, "refs", lambda numbers: {n: r for n, r in refs(numbers).items() if n != gone})
    handler = _handler(server, None)
    peer = Peer(None)
    calls = [(peer, master_pb2.LookupRequest(keys=b"".join(keys))),
             (peer, master_pb2.LookupRequest(keys=b"".join(keys[6:])))]
    together, alone = _answers(handler, _requests(handler, calls))
    assert together == alone
    runs = [master_pb2.LookupResponse.FromString(reply[32:]) for reply, _ in together]
    assert [len(r.tiers) for r in runs] == [4, 6]  # the first ends at keys[4], on the dropped node
    assert [[n.node_id for n in r.nodes] for r in runs] == [["n1"], ["n1"]]
    assert list(runs[0].sizes) == [1, 2, 3, 4] and runs[0].ssd_blocks == 0 and runs[0].dram_blocks == 4
    assert runs[0] == server.servicer.Lookup(calls[0][1], _Ctx())  # gRPC's answer too
