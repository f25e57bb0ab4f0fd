"""LocalIndex against fake arenas: answered here only when the answer is whole, as the master would answer it."""

from __future__ import annotations

import pytest
from client_fakes import FakeArena, FakeNodes, key

from kvpool.auth import mask_keys
from kvpool.client.cluster import NodeView
from kvpool.client.local_index import LocalIndex
from kvpool.placement import Candidate
from kvpool.tiers.arena import InventoryState
from kvpool.v1 import common_pb2
from kvpool.vocabulary import NO_TIER, NodeRef, Tier

HERE = "this-host"
FILE = (7, 7)


class Cluster:
    """The cluster view LocalIndex reads: fixed nodes; counts invalidations."""

    def __init__(self, *refs: NodeRef, arena_file: tuple[int, int] | None = FILE):
        self.views = [NodeView(r, common_pb2.NodeRef(node_id=r.node_id), Candidate(r.node_id, 1, 0, 1), arena_file)
                      for r in refs]
        self.invalidated = 0

    def nodes(self) -> list[NodeView]:
        return self.views

    def invalidate(self) -> None:
        self.invalidated += 1


def ref(name: str, host: str = HERE) -> NodeRef:
    return NodeRef(name, f"{name}.invalid:1", host, f"arena-{name}")


def arena(**held: tuple[Tier, int, int]) -> FakeArena:
    """An arena holding key(int(name[1:])) for each ``k<i>=(tier, size, checksum)``."""
    return FakeArena({key(int(k[1:])): v for k, v in held.items()}, file_id=FILE)


def index(cluster: Cluster, arenas: dict[str, FakeArena], mask=None, enabled: bool = True) -> LocalIndex:
    return LocalIndex(cluster, FakeNodes(arenas=arenas, host_id=HERE), mask, enabled=enabled)  # type: ignore[arg-type]


def test_one_node_answers_the_leading_run_and_exists_per_key():
    a = ref("a")
    local = index(Cluster(a), {"a": arena(k0=(Tier.DRAM, 10, 100), k1=(Tier.SSD, 20, 200), k3=(Tier.DRAM, 5, 5))})
    keys = [key(i) for i in range(4)]
    run = local.lookup(keys)
    assert run is not None and local.answers()
    assert list(run.keys) == keys[:2] and run.tiers == bytes([Tier.DRAM, Tier.SSD])
    assert list(run.nodes) == [a] and run.sizes.tolist() == [10, 20] and run.checksums.tolist() == [100, 200]
    assert local.exists(keys) == [True, True, False, True]


def test_of_several_nodes_the_fastest_tier_wins_then_the_first_node_in_the_view():
    a, b = ref("a"), ref("b")
    local = index(Cluster(a, b), {"a": arena(k0=(Tier.SSD, 1, 1), k1=(Tier.DRAM, 2, 2)),
                                  "b": arena(k0=(Tier.DRAM, 3, 3), k1=(Tier.DRAM, 4, 4), k2=(Tier.SSD, 5, 5))})
    held = local.holdings([key(0), key(1), key(2), key(3)])
    assert held is not None and held.nodes == [a, b]
    assert held.tiers.tolist() == [Tier.DRAM, Tier.DRAM, Tier.SSD, NO_TIER]
    assert held.node_indexes[:3].tolist() == [1, 0, 1] and held.sizes[:3].tolist() == [3, 2, 5]


@pytest.mark.parametrize("why", ["disabled", "no-nodes", "other-host", "unmapped", "incomplete"])
def test_an_answer_that_could_be_incomplete_is_left_to_the_master(why):
    a = ref("a", host="elsewhere" if why == "other-host" else HERE)
    arenas = {} if why == "unmapped" else {"a": arena(k0=(Tier.DRAM, 1, 1))}
    if why == "incomplete":
        arenas["a"].state = InventoryState.INCOMPLETE
    local = index(Cluster() if why == "no-nodes" else Cluster(a), arenas, enabled=why != "disabled")
    assert local.lookup([key(0)]) is None and local.exists([key(0)]) is None and not local.answers()


def test_an_arena_that_is_not_the_segment_the_view_saw_invalidates_the_view():
    cluster = Cluster(ref("a"), arena_file=(9, 9))  # the node restarted since the view was taken
    local = index(cluster, {"a": arena(k0=(Tier.DRAM, 1, 1))})
    assert local.lookup([key(0)]) is None and cluster.invalidated == 1


def test_with_a_token_the_arenas_are_read_under_the_tenants_stored_keys():
    mask = bytes(range(32))
    stored = {mask_keys(key(0), mask): (Tier.DRAM, 8, 80)}
    local = index(Cluster(ref("a")), {"a": FakeArena(stored, file_id=FILE)}, mask=lambda: mask)
    assert local.exists([key(0), key(1)]) == [True, False]
    unknown = index(Cluster(ref("a")), {"a": FakeArena(stored, file_id=FILE)}, mask=lambda: None)
    assert unknown.lookup([key(0)]) is None  # the mask is not known yet: the master answers
