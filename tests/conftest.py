"""Shared fixtures (unique shared-memory names that are always cleaned up, a default pool of processes), the tier
markers, and ``--shuffle`` (run the tests in a seeded random order, to show none depends on another's running first).

Tiers: a test's folder under ``tests/`` names its marker (:data:`TIERS`): ``unit`` (no servers, no engine venvs:
``python -m pytest tests/unit`` or ``-m unit``, under a minute), ``integration`` (real master and node processes,
real gRPC, LMDB and shared memory; the fault-injection suite in ``tests/fault`` too), ``engines`` (the engine
adapters on a real pool, in the real engines where installed) and ``ops`` (deployment files, Prometheus, the CLI and
operator benchmarks).
"""

from __future__ import annotations

import os
import random
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
from support import TESTS, EtcdServer, PoolProcesses

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


TIERS = {"unit": "unit", "integration": "integration", "fault": "integration", "engines": "engines", "ops": "ops"}


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    """A real etcd (the Debian ``etcd`` binary) for one test module, on free ports, stopped after it."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shuffle", type=int, default=None, metavar="SEED",
                     help="run modules, and the tests within each, in a random order from SEED (each module's tests "
                          "stay together, so module fixtures start once)")


def tier(path: Path) -> str | None:
    """The tier marker of a test file: its first folder under tests/ (None: a file at tests/ itself)."""
    parts = path.resolve().relative_to(TESTS).parts
    return TIERS.get(parts[0]) if len(parts) > 1 else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        marker = tier(item.path)
        if marker is not None:
            item.add_marker(marker)
    seed = config.getoption("--shuffle")
    if seed is not None:
        rng = random.Random(seed)
        modules: dict[Path, list[pytest.Item]] = defaultdict(list)
        for item in items:
            modules[item.path].append(item)
        order = list(modules.values())
        rng.shuffle(order)
        for tests in order:
            rng.shuffle(tests)
        items[:] = [item for tests in order for item in tests]


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = config.getoption("--shuffle")
    return None if seed is None else f"test order: shuffled, --shuffle {seed}"
