"""The client's view of the cluster: which nodes are live, what they take, where new blocks go.

A put must not ask the master where each block goes (a round trip on the
request's path), so the client keeps the master's list of live nodes
(``ClusterStatus``: each node's reference, DRAM usage and largest blocks)
and places new blocks itself with the master's own function
(:func:`kvpool.placement.place`, deterministic: every client and the master
choose alike from the same view).

Invariants:
- The view is at most ``refresh_s`` old when the client is busy: a call that
  finds it older starts one background refresh and goes on with the view it
  has (a refresh never sits on a request's path, except the very first, which
  has nothing to go on).
- No view (the master could not be asked yet, or it answered with no node):
  :meth:`ClusterView.place` returns None and the caller asks the master
  (``PlaceBlocks``), as before there was a view.
- A stale view can only send a block to a node that is gone or full: the
  put fails or is refused there, a counted miss; nothing wrong is stored. A
  put that failed that way invalidates the view: the next one asks first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from kvpool.client.nodes import arena_file_id
from kvpool.keys import BlockKey
from kvpool.placement import Candidate, place
from kvpool.rpc import local_host_id
from kvpool.v1 import common_pb2, master_pb2
from kvpool.vocabulary import NodeRef

__all__ = ["ClusterView", "NodeView", "Placement"]

log = logging.getLogger(__name__)

REFRESH_S = 1.0  # the view is refreshed (in the background) once it is older than this


@dataclass(frozen=True, slots=True)
class NodeView:
    """One live node as the view knows it."""

    ref: NodeRef
    proto: common_pb2.NodeRef
    candidate: Candidate
    arena_file: tuple[int, int] | None = None  # (st_dev, st_ino) of its arena here when the view was taken


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a batch of new blocks goes: per key an index into ``nodes``, or ``TOO_LARGE`` (-1)."""

    node_indexes: list[int]
    nodes: list[NodeRef]


class ClusterView:
    """The live nodes, from the master's ``ClusterStatus``, refreshed off the request path (module docstring)."""

    def __init__(self, ask: Callable[[], master_pb2.ClusterStatusResponse], *, refresh_s: float = REFRESH_S,
                 on_nodes: Callable[[Sequence[common_pb2.NodeRef]], None] | None = None):
        self._ask = ask
        self._refresh_s = refresh_s
        self._on_nodes = on_nodes
        self._lock = threading.Lock()
        self._nodes: list[NodeView] = []
        self._taken_at = -float("inf")  # time.monotonic() of the last answer
        self._refreshing = False

    def nodes(self) -> list[NodeView]:
        """The live nodes as last heard (refreshed first if there is no view yet or it was found wrong; in the
        background if it is only old)."""
        with self._lock:
            nodes, age = self._nodes, time.monotonic() - self._taken_at
            start = age > self._refresh_s and not self._refreshing
            if start:
                self._refreshing = True
        if start:
            if nodes and age < float("inf"):
                threading.Thread(target=self.refresh, name="kvpool-cluster-view", daemon=True).start()
            else:
                self.refresh()
                with self._lock:
                    nodes = self._nodes
        return nodes

    def invalidate(self) -> None:
        """The view sent a put to a node that could not take it (gone, moved): the next use asks the master first."""
        with self._lock:
            self._taken_at = -float("inf")

    def refresh(self) -> bool:
        """Ask the master now; True if it answered (the view is replaced), False if not (the old one stays)."""
        try:
            reply = self._ask()
        except grpc.RpcError as exc:
            log.debug("cluster view: ClusterStatus failed (%s); keeping the view we have", exc)
            with self._lock:
                self._refreshing = False
            return False
        views = [_node_view(n) for n in reply.nodes]
        if self._on_nodes is not None:
            self._on_nodes([v.proto for v in views])
        with self._lock:
            self._nodes, self._taken_at, self._refreshing = views, time.monotonic(), False
        return True

    def place(self, keys: Sequence[BlockKey], sizes: Sequence[int]) -> Placement | None:
        """Per key the node its block goes to (the master's rule), or None if there is no view to place from."""
        nodes = self.nodes()
        if not nodes:
            return None
        chosen = place(keys, sizes, [n.candidate for n in nodes])
        return Placement(chosen, [n.ref for n in nodes])



def _node_view(status: master_pb2.NodeStatus) -> NodeView:
    n = status.node
    dram = next((t for t in status.tiers if t.tier == common_pb2.TIER_DRAM), None)
    capacity = dram.capacity_bytes if dram is not None else 0
    used = dram.used_bytes if dram is not None else 0
    candidate = Candidate(n.node_id, int(capacity), int(used), int(status.dram_max_block_bytes),
                          int(status.max_block_bytes))
    arena_file = arena_file_id(n.arena) if n.arena and n.host_id == local_host_id() else None
    return NodeView(NodeRef(n.node_id, n.address, n.host_id, n.arena), n, candidate, arena_file)

