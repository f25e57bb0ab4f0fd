"""``kvpool serve``: a whole pool on one machine, the master and one node in one process.

The same classes run separately as ``kvpool master`` and ``kvpool node``; this
only wires the node to the master it just started. Security settings given
to one of the two serve both: the auth file (the node then presents one of
its node tokens) and the TLS certificate and key; with TLS the node needs
``tls_ca`` to verify its master.

Ports follow the port they belong to unless set: each metrics port is its
``port + 1``, the master's fast calls and the node's bulk listener ``port + 2``;
so ``kvpool serve --master-port 7700 --port 7710`` runs beside a default
``kvpool serve`` (7600-7602, 7610-7612). Two listeners of this process on one
port are refused (:func:`check_ports`) before anything starts.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from kvpool.auth import load_authority
from kvpool.config import MasterConfig, NodeConfig, PoolConfig
from kvpool.lifecycle import wait_for_shutdown
from kvpool.status import human_bytes
from kvpool.tiers.arena import SLOT_DTYPE, SharedArena, shm_path

log = logging.getLogger(__name__)


_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def _dial_host(listen_host: str) -> str:
    """Where a local process reaches a server listening on ``listen_host``."""
    return "127.0.0.1" if listen_host in _WILDCARD_HOSTS else listen_host


def check_ports(master: MasterConfig, node: NodeConfig) -> None:
    """ValueError if the master and the node would bind one fixed port (explicit or port + 1) on one address.

    Derived ports with a fallback (call_port, data_port at -1) are left out: the
    master's is moved by :func:`master_config_for`, the node's falls back itself.
    Run before anything starts, so a clash changes nothing.
    """
    ms, ns = master.server, node.server
    if ms.host != ns.host and ms.host not in _WILDCARD_HOSTS and ns.host not in _WILDCARD_HOSTS:
        return
    fixed = [("master.server.port", ms.port), ("master.server.metrics_port", ms.metrics_port),
             ("master.call_port", master.call_port),
             ("node.server.port", ns.port), ("node.server.metrics_port", ns.metrics_port),
             ("node.data_port", node.data_port)]
    seen: dict[int, str] = {}
    for name, port in fixed:
        if port <= 0:
            continue
        if port in seen:
            raise ValueError(f"{name} and {seen[port]} are both port {port}: move one of them "
                             "(metrics ports follow their port: port + 1)")
        seen[port] = name


def node_config_for(config: PoolConfig, master_port: int) -> NodeConfig:
    """The node's config: dialing the master just started, with the security settings both share."""
    master, node = config.master, config.node
    auth_file = node.server.auth_file or master.server.auth_file
    token = node.token
    if auth_file and not token:
        authority = load_authority(auth_file)  # not None: auth_file is set
        token = (authority.node_token() if authority is not None else None) or ""
        if not token:
            raise ValueError(f"auth file {auth_file} has no node_tokens for the node")
    tls = node.tls if node.tls.cert else master.tls
    if master.tls.cert and not node.tls_ca:
        raise ValueError("with TLS, set tls_ca (the CA that signed the master's certificate)")
    return dataclasses.replace(node, master=f"{_dial_host(master.server.host)}:{master_port}",
                               server=dataclasses.replace(node.server, auth_file=auth_file), token=token, tls=tls)


def master_config_for(config: PoolConfig) -> MasterConfig:
    """The master's config, with the auth file and TLS files the node was given if it has none."""
    master, node = config.master, config.node
    tls = master.tls if master.tls.cert else node.tls
    call_port = master.call_port
    ns = node.server
    taken = {ns.port, ns.metrics_port, node.data_port, ns.port + 2 if node.data_port < 0 else 0} - {0, -1}
    if call_port < 0 and master.server.port and master.server.port + 2 in taken:  # the default would take a node's
        call_port = 0
    server = dataclasses.replace(master.server, auth_file=master.server.auth_file or node.server.auth_file)
    return dataclasses.replace(master, server=server, tls=tls, call_port=call_port)


def dram_summary(arena: SharedArena) -> str:
    """The DRAM the blocks get, and what else the arena's file in /dev/shm holds (it is larger by that much)."""
    total = os.path.getsize(shm_path(arena.name))
    rows = arena.num_slots * (SLOT_DTYPE.itemsize + 8)  # a slot table row and an LRU stamp per slot
    tables = total - arena.data_bytes - rows  # the header, the key index and the inventory (and page padding)
    return (f"DRAM {human_bytes(arena.data_bytes)} for blocks in /dev/shm/{arena.name}, a file of "
            f"{human_bytes(total)} with its slot table and LRU stamps ({human_bytes(rows)}, {arena.num_slots} slots) "
            f"and its key index and inventory ({human_bytes(tables)})")


def run_serve(config: PoolConfig) -> None:
    """Start the master, then a node registered with it; run until SIGINT/SIGTERM; stop both."""
    from kvpool.malloc import limit_arenas
    from kvpool.master.server import MasterServer, log_events
    from kvpool.node.daemon import PoolNode

    limit_arenas()  # before any thread: otherwise the node's RSS ratchets up per thread (kvpool/malloc.py)

    config = dataclasses.replace(config, master=master_config_for(config))
    check_ports(config.master, config.node)
    with MasterServer(config.master) as master:
        if master.events is not None:
            log_events(master.events.publisher)
        node_config = node_config_for(config, master.port)
        node = PoolNode(node_config)
        try:
            node.start()
            ssd = node.store.ssd
            log.info(
                "kvpool serve: master %s, node %s; %s; SSD %s; metrics master %s node %s",
                master.address, node.address, dram_summary(node.store.dram.arena),
                f"{ssd.capacity_bytes >> 20} MiB at {ssd.path}" if ssd is not None else "off",
                f":{master.metrics_port}" if master.metrics_port else "off",
                f":{node.metrics_port}" if node.metrics_port else "off",
            )
            wait_for_shutdown()
            log.info("kvpool serve: stopping")
        finally:
            node.stop()
