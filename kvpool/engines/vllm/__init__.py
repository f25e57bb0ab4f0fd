"""kvpool inside vLLM: ``kv_connector_module_path: "kvpool.engines.vllm"``, ``kv_connector: "KVPoolConnector"``.

The connector (:mod:`.connector`) needs vllm; its planning and data movement
(:mod:`.keys`, :mod:`.scheduler`, :mod:`.worker`) do not import it, so they are
importable (and tested) without vLLM. ``KVPoolConnector`` is imported on first
access, which is how vLLM's connector factory reaches it.

kvpool behind vLLM's own CPU offloading tier instead: :mod:`.offload_tier`
(``"module_path": "kvpool.engines.vllm.offload_tier"``, ``"type": "KVPoolSecondaryTier"`` in the
OffloadingConnector's ``secondary_tiers``); its vLLM-free part is :mod:`.offload_jobs`.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "KVPoolConnector":
        from kvpool.engines.vllm.connector import KVPoolConnector

        return KVPoolConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
