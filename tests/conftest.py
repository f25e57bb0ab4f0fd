"""Shared fixtures: unique shared-memory names that are always cleaned up."""

from __future__ import annotations

import os
import uuid

import pytest

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

