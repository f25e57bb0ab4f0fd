"""``kvpool serve``: a whole pool on one machine, the master and one node in one process.

The same classes run separately as ``kvpool master`` and ``kvpool node``; this
only wires the node to the master it just started.
"""

from __future__ import annotations

import dataclasses
import logging

from kvpool.config import PoolConfig
from kvpool.lifecycle import wait_for_shutdown

log = logging.getLogger(__name__)


def _dial_host(listen_host: str) -> str:
    """Where a local process reaches a server listening on ``listen_host``."""
    return "127.0.0.1" if listen_host in ("", "0.0.0.0", "::", "[::]") else listen_host


def run_serve(config: PoolConfig) -> None:
    """Start the master, then a node registered with it; run until SIGINT/SIGTERM; stop both."""
    from kvpool.master.server import MasterServer
    from kvpool.node.daemon import PoolNode

    with MasterServer(config.master) as master:
        node_config = dataclasses.replace(config.node, master=f"{_dial_host(config.master.host)}:{master.port}")
        node = PoolNode(node_config)
        try:
            node.start()
            dram = node.store.dram.stats().capacity_bytes
            ssd = node.store.ssd
            log.info(
                "kvpool serve: master %s, node %s; DRAM %d MiB (/dev/shm/%s), SSD %s; metrics master %s node %s",
                master.address, node.address, dram >> 20, node.node_ref.arena,
                f"{ssd.capacity_bytes >> 20} MiB at {ssd.path}" if ssd is not None else "off",
                f":{master.metrics_port}" if master.metrics_port else "off",
                f":{node.metrics_port}" if node.metrics_port else "off",
            )
            wait_for_shutdown()
            log.info("kvpool serve: stopping")
        finally:
            node.stop()
