"""The connector's ``kv_connector_extra_config``, parsed strictly (no vllm import: tested without vLLM).

- ``kvpool_config_path``: a kvpool JSON config (a string; absent: ``KVPOOL_CLIENT_*`` variables and defaults).
- ``kvpool_strict``: on/off (:func:`kvpool.engines.options.flag`: true/false, 1/0, yes/no, on/off; default off).
- ``kvpool_handoff_timeout_ms``: prefill/decode disaggregation's bound on each side's wait (an integer, 1 ms to
  10 min; default 2000): a producer's wait for the pool to confirm a finished request's blocks, a consumer's
  wait for the blocks a producer announced (:mod:`kvpool.engines.vllm.scheduler`).
- ``kvpool_load_mode``: how the worker loads a request's blocks (:data:`LOAD_MODES`; default
  :data:`DEFAULT_LOAD_MODE`): ``"async"``, in the background while the batch runs (the request waits in vLLM's
  ``WAITING_FOR_REMOTE_KVS``); ``"sync"``, every block before the step's forward; ``"layerwise"``, started before
  the forward and waited for layer by layer (saves gathered layer by layer too).

Other ``kvpool_*`` fields are refused by name (a typo must not pass silently); fields without the prefix belong
to vLLM or other connectors and are left alone. Every problem is one ValueError naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpool.config import ClientConfig, load_config
from kvpool.engines import options

EXTRA = "kv_connector_extra_config"
EXTRA_FIELDS = ("kvpool_config_path", "kvpool_strict", "kvpool_load_mode", "kvpool_handoff_timeout_ms")
HANDOFF_TIMEOUT_MS = 2000
LOAD_MODES = ("async", "sync", "layerwise")
DEFAULT_LOAD_MODE = "async"


def strict_mode(extra: Mapping[str, Any]) -> bool:
    """``kvpool_strict``: whether a config that cannot be used stops vLLM (default False)."""
    return options.flag(extra.get("kvpool_strict", False), f"{EXTRA}.kvpool_strict")


def handoff_timeout_s(extra: Mapping[str, Any]) -> float:
    """``kvpool_handoff_timeout_ms`` in seconds: how long either side of a prefill/decode hand-off waits."""
    field = f"{EXTRA}.kvpool_handoff_timeout_ms"
    return options.integer(extra.get("kvpool_handoff_timeout_ms", HANDOFF_TIMEOUT_MS), field, low=1,
                           high=600_000) / 1000


def client_config(extra: Mapping[str, Any]) -> ClientConfig:
    """The kvpool client config the extra config names; ValueError saying what is wrong with it."""
    unknown = sorted(k for k in extra if k.startswith("kvpool_") and k not in EXTRA_FIELDS)
    if unknown:
        raise ValueError(f"unknown {EXTRA} field(s) {', '.join(unknown)}; known: {', '.join(EXTRA_FIELDS)}")
    path = options.path(extra.get("kvpool_config_path", ""), f"{EXTRA}.kvpool_config_path")
    return load_config(path or None).client


def load_mode(extra: Mapping[str, Any]) -> str:
    """``kvpool_load_mode``: one of :data:`LOAD_MODES` (default :data:`DEFAULT_LOAD_MODE`)."""
    return options.choice(extra.get("kvpool_load_mode", DEFAULT_LOAD_MODE), f"{EXTRA}.kvpool_load_mode", LOAD_MODES)
