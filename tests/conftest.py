"""Shared fixtures: unique shared-memory names that are always cleaned up, and a default pool of processes."""

from __future__ import annotations

import os
import uuid

import pytest
from support import PoolProcesses

from kvpool.tiers.arena import shm_path


@pytest.fixture
def arena_name():
    """A fresh arena name; whatever a test leaves in /dev/shm under it is removed."""
    name = f"kvpool-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    try:
        os.unlink(shm_path(name))
    except FileNotFoundError:
        pass


@pytest.fixture
def procs(tmp_path):
    """A :class:`support.PoolProcesses` with default flags (a test needing others defines its own); every process
    it started is stopped, and each must have exited cleanly (killed on purpose counts as clean)."""
    p = PoolProcesses(tmp_path)
    try:
        yield p
    finally:
        p.close()
    p.assert_stopped_cleanly()
