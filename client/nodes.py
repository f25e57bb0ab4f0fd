"""NodeDirectory: what one client knows about each pool node, and its connections to it.

- A stub per node (:class:`~kvpool.calls.FastStub`): Locate, Reserve and
  Commit over fast calls on the node's bulk listener, the rest over gRPC.
- The node's bulk listener address: from its ``NodeRef`` (lookup and
  placement replies carry it) or from the node's ``Info`` once. A listener
  that could not be reached is not tried for ``_BULK_RETRY_S``.
- The node's limits: the most keys one call to it may carry, from its
  ``Info`` once (operators may lower ``max_keys_per_call``); every data path
  splits a node's batch into calls of at most that many keys.
- The node's shared-memory arena, mapped when the node is on this host (its
  ``host_id`` equals ours) and shared memory is allowed; remapped when the
  node restarted (``/dev/shm/<arena>`` is another file). A mapping that
  failed (e.g. it raced a node's restart and found a segment still being
  made) is tried again after a back-off that doubles from
  ``_MAP_RETRY_MIN_S`` to ``_MAP_RETRY_MAX_S``, and at once when the segment
  is another file; until then the network paths serve. Pages are not
  faulted in ahead: the node populated the segment, so a first read of a
  slot costs a minor fault per page (~0.07 ms a MiB here), while mapping a
  multi-GiB arena up front cost seconds of CPU beside the engine.
- Where a block is in an arena is the arena's own key index (the node
  publishes it; :meth:`kvpool.tiers.arena.SharedArena.index_find`): this
  client keeps no per-key state.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from kvpool.calls import FastStub
from kvpool.client.faults import error_kind
from kvpool.config import ClientConfig
from kvpool.rpc import local_host_id, make_channel
from kvpool.tcp import ConnectionPool
from kvpool.tiers.arena import SharedArena, shm_path
from kvpool.v1 import common_pb2, node_pb2, node_pb2_grpc
from kvpool.vocabulary import NodeRef
from kvpool.wire import NODE_CALLS

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20
_UNSTATED_MAX_KEYS = 65536  # keys per call to a node whose Info does not say (its limit before Info carried it)
_BULK_RETRY_S = 5.0  # a node whose bulk listener could not be reached is sent gRPC calls this long
_MAP_RETRY_MIN_S = 0.1  # first wait before mapping an arena again after a failed attempt
_RECHECK_S = 0.1  # a mapped arena is checked against /dev/shm (a restarted node's new segment) this often
_MAP_RETRY_MAX_S = 5.0  # the longest such wait
_NODE_SERVICE = node_pb2.DESCRIPTOR.services_by_name["Node"]


class NodeDirectory:
    """Per-node stubs, bulk addresses and arenas of one client (thread-safe)."""

    def __init__(self, config: ClientConfig, calls: ConnectionPool):
        self.config = config
        self.host_id = local_host_id()
        self._calls = calls
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, FastStub] = {}
        self._arenas: dict[str, SharedArena] = {}
        self._unmapped: dict[str, _FailedMap] = {}  # arena name -> the last failed attempt to map it
        self._checked: dict[str, float] = {}  # arena name -> until when the mapping counts as current
        self._data_addresses: dict[str, str] = {}  # node gRPC address -> bulk address ("": none)
        self._max_keys: dict[str, int] = {}  # node gRPC address -> most keys per call, as its Info said
        self._bulk_down: dict[str, float] = {}  # node gRPC address -> monotonic time to try bulk again
        self._closing = threading.Event()

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

    def data_address(self, address: str, timeout: float | None = None) -> str | None:
        """Where the node at gRPC ``address`` takes bulk requests; None: use gRPC (none, or down lately).

        Not known yet: asked of the node's ``Info`` within ``lookup_timeout_s`` (and ``timeout``)."""
        with self._lock:
            if self._bulk_down.get(address, 0.0) > time.monotonic():
                return None
            known = self._data_addresses.get(address)
        if known is None:
            info = self._info(address, timeout)
            if info is None:
                self.bulk_unreachable(address)
                return None
            known = info.node.data_address
        return known or None

    def max_keys(self, address: str, timeout: float | None = None) -> int:
        """The most keys one call to the node at gRPC ``address`` may carry (>= 1).

        Asked of the node's ``Info`` once (within ``lookup_timeout_s`` and ``timeout``); while it cannot be
        asked, _UNSTATED_MAX_KEYS (a call over the node's limit then fails, and its blocks are misses)."""
        with self._lock:
            known = self._max_keys.get(address)
        if known is None:
            info = self._info(address, timeout)
            known = self._max_keys.get(address, _UNSTATED_MAX_KEYS) if info is not None else _UNSTATED_MAX_KEYS
        return known

    def _info(self, address: str, timeout: float | None) -> node_pb2.InfoResponse | None:
        """The node's ``Info`` (remembering its bulk address and key limit), or None if it did not answer."""
        wait = self.config.lookup_timeout_s if timeout is None else min(timeout, self.config.lookup_timeout_s)
        try:
            info = self.stub(address).Info(node_pb2.InfoRequest(), timeout=wait)
        except grpc.RpcError as exc:
            log.debug("no Info from node %s (%s); using gRPC", address, error_kind(exc))
            return None
        with self._lock:
            self._data_addresses[address] = info.node.data_address
            self._max_keys[address] = info.max_keys_per_call or _UNSTATED_MAX_KEYS
        return info

    def bulk_unreachable(self, address: str) -> None:
        """The node's bulk listener failed to connect: use gRPC for a while, and ask its address again after."""
        with self._lock:
            self._bulk_down[address] = time.monotonic() + _BULK_RETRY_S
            self._data_addresses.pop(address, None)  # the node may have restarted elsewhere
            self._max_keys.pop(address, None)  # and with other limits

    # -- shared memory --------------------------------------------------------------------

    def arena(self, node: NodeRef, *, recheck: bool = False) -> SharedArena | None:
        """The node's arena mapped here, or None if it is on another host or cannot be mapped now.

        A mapping is checked against ``/dev/shm`` at most every _RECHECK_S (a
        restarted node's new segment under the same name), or now with
        ``recheck`` (writers: a slot of the old segment is not the new node's).
        """
        if not self.config.shared_memory or node.host_id != self.host_id or not node.arena:
            return None
        with self._lock:
            cached = self._arenas.get(node.arena)
            if cached is not None:
                now = time.monotonic()
                if not recheck and now < self._checked.get(node.arena, 0.0):
                    return cached
                if cached.is_current():
                    self._checked[node.arena] = now + _RECHECK_S
                    return cached
                del self._arenas[node.arena]  # the node restarted; not closed: another thread may still copy
            failed = self._unmapped.get(node.arena)
            if failed is not None and not failed.due():
                return None
            try:
                arena = SharedArena.attach(node.arena)
            except (OSError, ValueError) as exc:
                self._unmapped[node.arena] = _FailedMap.after(failed, node.arena)
                level = logging.WARNING if failed is None else logging.DEBUG  # once per failing streak
                log.log(level, "cannot map arena %s of node %s (%s); using the network, trying again later",
                        node.arena, node.node_id, exc)
                return None
            self._unmapped.pop(node.arena, None)
            self._arenas[node.arena] = arena
            return arena

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Close channels, unmap arenas."""
        self._closing.set()
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._stubs.clear()
            for arena in self._arenas.values():
                arena.close()
            self._arenas.clear()


@dataclass(frozen=True, slots=True)
class _FailedMap:
    """A failed attempt to map an arena: when to try again, and which file it was (None: there was none)."""

    retry_at: float
    backoff_s: float
    name: str
    file_id: tuple[int, int] | None

    @classmethod
    def after(cls, previous: _FailedMap | None, name: str) -> _FailedMap:
        """The record of a new failure: the back-off doubles from the previous one (bounded)."""
        backoff = _MAP_RETRY_MIN_S if previous is None else min(previous.backoff_s * 2, _MAP_RETRY_MAX_S)
        return cls(time.monotonic() + backoff, backoff, name, arena_file_id(name))

    def due(self) -> bool:
        """Try again now? After the back-off, or at once if the segment is another file (a new incarnation)."""
        return time.monotonic() >= self.retry_at or arena_file_id(self.name) != self.file_id


def arena_file_id(name: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of ``/dev/shm/<name>``, or None if there is no such file."""
    try:
        st = os.stat(shm_path(name))
    except OSError:
        return None
    return st.st_dev, st.st_ino
