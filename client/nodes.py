"""NodeDirectory: what one client knows about each pool node, and its connections to it.

- A stub per node (:class:`~kvpool.calls.FastStub`): Locate, Reserve and
  Commit over fast calls on the node's bulk listener, the rest over gRPC.
- The node's bulk listener address: from its ``NodeRef`` (lookup and
  placement replies carry it) or from the node's ``Info`` once. A listener
  that could not be reached is not tried for ``BULK_RETRY_S``.
- The node's shared-memory arena, mapped when the node is on this host (its
  ``host_id`` equals ours) and shared memory is allowed; remapped when the
  node restarted. Pages are faulted in by a background thread, once.
- Slot hints: where this client last saw each block in an arena. They are
  guesses, checked against the slot's row before every use.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import grpc

from kvpool.calls import NODE_CALLS, FastStub
from kvpool.client.faults import error_kind
from kvpool.client.lookup import NodeAddress
from kvpool.config import ClientConfig
from kvpool.framing import ConnectionPool
from kvpool.keys import BlockKey
from kvpool.rpc import local_host_id, make_channel
from kvpool.tiers.arena import SharedArena
from kvpool.v1 import common_pb2, node_pb2, node_pb2_grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20
BULK_RETRY_S = 5.0  # a node whose bulk listener could not be reached is sent gRPC calls this long
_NODE_SERVICE = node_pb2.DESCRIPTOR.services_by_name["Node"]


class NodeDirectory:
    """Per-node stubs, bulk addresses, arenas and slot hints of one client (thread-safe)."""

    def __init__(self, config: ClientConfig, calls: ConnectionPool):
        self.config = config
        self.host_id = local_host_id()
        self._calls = calls
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, FastStub] = {}
        self._arenas: dict[str, SharedArena | None] = {}
        self._slot_hints: dict[str, dict[BlockKey, int]] = {}  # arena -> key -> slot it was seen in
        self._data_addresses: dict[str, str] = {}  # node gRPC address -> bulk address ("": none)
        self._bulk_down: dict[str, float] = {}  # node gRPC address -> monotonic time to try bulk again
        self._closing = threading.Event()
        self.populating: list[threading.Thread] = []

    # -- stubs ----------------------------------------------------------------------------

    def stub(self, address: str) -> FastStub:
        """The node's stub (made on first use)."""
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                channel = make_channel(address, max_message_bytes=MAX_MESSAGE_BYTES, token=self.config.token,
                                       tls_ca=self.config.tls_ca)
                self._channels[address] = channel
                stub = self._stubs[address] = FastStub(
                    node_pb2_grpc.NodeStub(channel), _NODE_SERVICE, NODE_CALLS, self._calls,
                    lambda: self.data_address(address), on_unreachable=lambda: self.bulk_unreachable(address),
                    max_reply_bytes=MAX_MESSAGE_BYTES,
                )
            return stub

    # -- bulk listeners -------------------------------------------------------------------

    def learn(self, nodes: Sequence[common_pb2.NodeRef]) -> None:
        """Remember the bulk addresses nodes advertise."""
        with self._lock:
            for n in nodes:
                if n.data_address:
                    self._data_addresses[n.address] = n.data_address

    def data_address(self, address: str) -> str | None:
        """Where the node at gRPC ``address`` takes bulk requests; None: use gRPC (none, or down lately)."""
        with self._lock:
            if self._bulk_down.get(address, 0.0) > time.monotonic():
                return None
            known = self._data_addresses.get(address)
        if known is None:
            try:
                info = self.stub(address).Info(node_pb2.InfoRequest(), timeout=self.config.lookup_timeout_s)
            except grpc.RpcError as exc:
                log.debug("no Info from node %s (%s); using gRPC", address, error_kind(exc))
                self.bulk_unreachable(address)
                return None
            known = info.node.data_address
            with self._lock:
                self._data_addresses[address] = known
        return known or None

    def bulk_unreachable(self, address: str) -> None:
        """The node's bulk listener failed to connect: use gRPC for a while, and ask its address again after."""
        with self._lock:
            self._bulk_down[address] = time.monotonic() + BULK_RETRY_S
            self._data_addresses.pop(address, None)  # the node may have restarted elsewhere

    # -- shared memory --------------------------------------------------------------------

    def arena(self, node: NodeAddress) -> SharedArena | None:
        """The node's arena mapped here, or None if it is on another host or cannot be mapped."""
        if not self.config.shared_memory or node.host_id != self.host_id or not node.arena:
            return None
        with self._lock:
            cached = self._arenas.get(node.arena)
            if cached is not None and not cached.is_current():  # the node restarted: map its new segment
                del self._arenas[node.arena]  # not closed: another thread may still be copying through it
                self._slot_hints.pop(node.arena, None)
            if node.arena not in self._arenas:
                try:
                    arena = self._arenas[node.arena] = SharedArena.attach(node.arena)
                except (OSError, ValueError) as exc:
                    log.warning("cannot map arena %s of node %s (%s); using the network", node.arena, node.node_id, exc)
                    self._arenas[node.arena] = None
                else:  # first touches fault pages in: take that cost in the background, once
                    thread = threading.Thread(target=arena.populate, args=(self._closing,), daemon=True,
                                              name=f"kvpool-map-{node.arena}")
                    thread.start()
                    self.populating.append(thread)
            return self._arenas[node.arena]

    def slot_hints(self, arena: SharedArena) -> dict[BlockKey, int]:
        """Where this client last saw blocks in ``arena`` (guesses, checked on use; bounded)."""
        with self._lock:
            hints = self._slot_hints.setdefault(arena.name, {})
            if len(hints) > 2 * arena.num_slots:
                hints.clear()
            return hints

    def forget_slots(self) -> None:
        """Drop every slot hint (benchmarks: measure the Locate path)."""
        with self._lock:
            self._slot_hints.clear()

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Stop faulting pages in, close channels, unmap arenas."""
        self._closing.set()
        for thread in self.populating:
            thread.join(timeout=10)
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._stubs.clear()
            for arena in self._arenas.values():
                if arena is not None:
                    arena.close()
            self._arenas.clear()
