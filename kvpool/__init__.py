"""kvpool: a standalone tiered (HBM / DRAM / SSD) KV-cache pool for LLM inference.

The service side (this package, :mod:`kvpool.master`) needs no torch; only
:mod:`kvpool.client` does.
"""

__version__ = "0.1.0"
