"""Fixtures of the fault-injection suite: real processes on 127.0.0.1, always stopped at the end.

Helpers live in ``faultkit.py`` (``from fault.faultkit import ...``: ``tests/`` is on the
path and this folder, without an ``__init__.py``, is a namespace package).
"""

from __future__ import annotations

import pytest

from kvpool.config import ClientConfig


@pytest.fixture
def client_config(procs):
    """A client config for ``procs`` with short deadlines (faults must become misses quickly)."""
    def make(**over) -> ClientConfig:
        values = {"master": procs.master, "lookup_timeout_s": 0.5, "io_timeout_s": 1.0}
        values.update(over)
        return ClientConfig(**values)

    return make
