"""The pool node: the daemon that owns one host's DRAM arena and SSD store.

- :mod:`kvpool.node.daemon`: :class:`~kvpool.node.daemon.PoolNode` builds the
  tiers, the gRPC server, the link to the master and the metrics, and owns
  their lifecycle (``start`` / ``stop(grace)``); ``run_node`` is the process
  entry point.
- :mod:`kvpool.node.servicer`: the Node gRPC service (Put, Get, Exists,
  Remove, Locate, Info) over a :class:`~kvpool.tiers.node_store.NodeStore`:
  validates, translates, delegates.
- :mod:`kvpool.node.master_link`: registration, heartbeats and inventory
  reports to the master, surviving master restarts and outages.

Invariant across the three: a key is reported to the master only after its
bytes and checksum are committed in a tier (the stores' ``on_change`` fires
after commit), and Put replies only after its new keys were reported.
"""
