"""The vLLM general plugin that registers kvpool's store backend with vllm-ascend (see docs/engines/vllm-ascend.md).

``pyproject.toml`` names :func:`register_backend` under ``vllm.general_plugins``;
vLLM runs it in every process it starts. It adds ``"kvpool"`` to vllm-ascend's
module-level ``backend_map`` (``ascend_store/backend/__init__.py``), the only
place its AscendStore connector looks backends up, so
``kv_connector_extra_config: {"backend": "kvpool"}`` needs no fork of vllm-ascend.

Invariants:
- Cheap and silent where vllm-ascend is absent: this module imports only the
  standard library, and looks for vllm-ascend with ``find_spec`` (no import).
- Idempotent; an entry of that name pointing elsewhere is left alone (one warning).
- Never raises: a vllm-ascend without that map is skipped (a debug line).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

log = logging.getLogger(__name__)

BACKEND_NAME = "kvpool"
BACKEND_MAP_MODULE = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend"
ENTRY = {"name": "KVPoolStoreBackend", "path": "kvpool.engines.vllm_ascend"}


def register_backend() -> None:
    """Add ``"kvpool"`` to vllm-ascend's ``backend_map``; nothing where vllm-ascend is absent (module docstring)."""
    try:
        if importlib.util.find_spec("vllm_ascend") is None:
            return
        module = importlib.import_module(BACKEND_MAP_MODULE)
    except Exception as exc:  # noqa: BLE001 - a vllm-ascend without this connector: nothing to register into
        log.debug("kvpool: no vllm-ascend AscendStore backend map to register into (%s)", exc)
        return
    backend_map = getattr(module, "backend_map", None)
    if not isinstance(backend_map, dict):
        log.debug("kvpool: %s has no backend_map dict", BACKEND_MAP_MODULE)
        return
    current = backend_map.setdefault(BACKEND_NAME, dict(ENTRY))
    if current != ENTRY:
        log.warning("kvpool: vllm-ascend's backend_map already maps %r to %s; left as it is", BACKEND_NAME, current)
