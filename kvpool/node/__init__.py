"""The pool node: the daemon that owns one host's DRAM arena and SSD store.

- :mod:`kvpool.node.daemon`: :class:`~kvpool.node.daemon.PoolNode` builds the
  tiers, the gRPC server, the link to the master and the metrics, and owns
  their lifecycle (``start`` / ``stop(grace)``); ``run_node`` is the process
  entry point.
- :mod:`kvpool.node.core`: :class:`~kvpool.node.core.NodeCore`, what both
  transports do with the node's :class:`~kvpool.tiers.node_store.NodeStore`
  (keys, sizes, quota, leases, reads), and all they see of it.
- :mod:`kvpool.node.servicer`: the Node gRPC service (Put, Get, Exists,
  Remove, Locate, Reserve, Commit, FlushReports, Info) over the core:
  validates, translates, delegates.
- :mod:`kvpool.node.data_port`: the wire listener (bulk GET and PUT between the
  arena and the socket, and the fast calls) over the same core.
- :mod:`kvpool.node.master_link`: registration, heartbeats and inventory
  reports to the master, surviving master restarts and outages.
- :mod:`kvpool.node.shard_links`: with an ``etcd://`` master, one such link
  per index shard (:mod:`kvpool.shards`), each reporting its shard's keys to
  its shard's leader.

Invariant: a key is reported to the master only after its bytes and checksum
are committed in a tier (the stores' ``on_change`` fires after commit). A put
(gRPC Put, Commit, the wire's PUT) replies once its blocks are stored and
never waits for the master: the link reports in the background, and
``FlushReports`` is the barrier for a writer that needs its keys indexed.
Remove replies only after the master has the removal.
"""
