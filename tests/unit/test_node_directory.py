"""NodeDirectory with a fake node stub and real shared-memory segments: bulk addresses learned or asked once,
unreachable listeners skipped for a while, arenas mapped only here and remapped when the node restarted."""

from __future__ import annotations

import grpc
import pytest
from client_fakes import FakeNodeStub

from kvpool.client import nodes as nodes_module
from kvpool.client.nodes import NodeDirectory
from kvpool.config import ClientConfig
from kvpool.rpc import local_host_id
from kvpool.tcp import ConnectionPool
from kvpool.tiers.arena import SharedArena
from kvpool.v1 import common_pb2
from kvpool.vocabulary import NodeRef

ADDRESS = "n1.invalid:1"


class Directory(NodeDirectory):
    """A NodeDirectory whose node stubs are one fake (what ``stub`` makes is the only network part)."""

    def __init__(self, fake: FakeNodeStub, **config: object):
        super().__init__(ClientConfig(**config), ConnectionPool(1.0))  # type: ignore[arg-type]
        self.fake = fake

    def stub(self, address: str) -> FakeNodeStub:  # type: ignore[override]
        return self.fake


@pytest.fixture
def directory():
    d = Directory(FakeNodeStub(data_address="n1.invalid:2"))
    yield d
    d.close()


def test_an_advertised_bulk_address_is_used_without_asking_the_node(directory):
    directory.learn([common_pb2.NodeRef(node_id="n1", address=ADDRESS, data_address="n1.invalid:9"),
                     common_pb2.NodeRef(node_id="n2", address="n2.invalid:1")])
    assert directory.data_address(ADDRESS) == "n1.invalid:9"
    assert directory.fake.calls == []


def test_an_unknown_bulk_address_is_asked_of_the_nodes_info_once(directory):
    assert directory.data_address(ADDRESS, timeout=0.2) == "n1.invalid:2"
    assert directory.data_address(ADDRESS) == "n1.invalid:2"
    assert directory.fake.methods() == ["Info"]
    (_, _, timeout), = directory.fake.calls
    assert 0 < timeout <= 0.2  # within the caller's time (and lookup_timeout_s)


def test_a_node_without_a_bulk_listener_is_asked_once_and_served_by_grpc():
    d = Directory(FakeNodeStub(data_address=""))
    assert d.data_address(ADDRESS) is None and d.data_address(ADDRESS) is None
    assert d.fake.methods() == ["Info"]
    d.close()


def test_an_unreachable_listener_is_skipped_for_a_while_then_its_address_is_asked_again(directory, monkeypatch):
    directory.learn([common_pb2.NodeRef(node_id="n1", address=ADDRESS, data_address="n1.invalid:9")])
    directory.bulk_unreachable(ADDRESS)
    assert directory.data_address(ADDRESS) is None and directory.fake.calls == []
    monkeypatch.setattr(nodes_module, "_BULK_RETRY_S", 0.0)
    directory.bulk_unreachable(ADDRESS)  # down until now: due again at once, and the learned address forgotten
    assert directory.data_address(ADDRESS) == "n1.invalid:2" and directory.fake.methods() == ["Info"]


def test_a_failed_info_is_a_listener_down_not_an_error(directory):
    directory.fake.fail = grpc.StatusCode.UNAVAILABLE
    assert directory.data_address(ADDRESS) is None
    assert directory.data_address(ADDRESS) is None
    assert directory.fake.methods() == ["Info"]  # not asked again while the listener counts as down


def here(arena: str, host: str | None = None) -> NodeRef:
    return NodeRef("n1", ADDRESS, local_host_id() if host is None else host, arena)


def test_an_arena_is_mapped_once_and_only_for_a_node_on_this_host(directory, arena_name):
    owner = SharedArena.create(arena_name, 1 << 16, 4)
    try:
        mapped = directory.arena(here(arena_name))
        assert mapped is not None and mapped.is_current()
        assert directory.arena(here(arena_name)) is mapped
        assert directory.arena(here(arena_name, host="elsewhere")) is None
        assert directory.arena(here("")) is None
        no_shm = Directory(FakeNodeStub(), shared_memory=False)
        assert no_shm.arena(here(arena_name)) is None
        no_shm.close()
    finally:
        directory.close()
        owner.close()


def test_a_restarted_nodes_new_segment_is_mapped_in_place_of_the_old(directory, arena_name):
    first = SharedArena.create(arena_name, 1 << 16, 4)
    old = directory.arena(here(arena_name))
    first.close()  # the node stops: its segment goes
    second = SharedArena.create(arena_name, 1 << 16, 4)  # and a new one under the same name
    try:
        new = directory.arena(here(arena_name), recheck=True)
        assert old is not None and new is not None and new is not old
        assert new.is_current() and not old.is_current()
    finally:
        directory.close()
        second.close()


def test_a_segment_that_could_not_be_mapped_is_mapped_as_soon_as_it_is_there(directory, arena_name):
    assert directory.arena(here(arena_name)) is None  # no segment yet: a failed map, retried after a back-off
    owner = SharedArena.create(arena_name, 1 << 16, 4)
    try:
        mapped = directory.arena(here(arena_name))  # another file than when it failed: tried at once
        assert mapped is not None and mapped.is_current()
    finally:
        directory.close()
        owner.close()
