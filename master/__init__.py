"""The Master Service: the global index of which block lives in which tier on which node.

Imported as ``kvpool.master`` (code in the top-level ``master/`` folder); it
never imports torch.
"""

from kvpool.master.server import MasterServer, run_master

__all__ = ["MasterServer", "run_master"]
