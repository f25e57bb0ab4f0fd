"""Import boundaries that the module docstrings promise, checked on the source (``ast``, not grep).

The node's transports (:mod:`kvpool.node.servicer`, :mod:`kvpool.node.data_port`) see
only :class:`kvpool.node.core.NodeCore`: they import nothing from
:mod:`kvpool.tiers` and never touch a ``store`` or an ``arena`` attribute.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvpool

ROOT = Path(kvpool.__file__).parent
TRANSPORTS = ["node/servicer.py", "node/data_port.py"]
HIDDEN_PACKAGE = "kvpool.tiers"
HIDDEN_ATTRIBUTES = {"store", "_store", "arena"}


def imported(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The modules (and ``module.name`` for each name from one) an import statement in ``package`` names."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
    module = ".".join([*base, *([node.module] if node.module else [])])
    return [module] + [f"{module}.{alias.name}" for alias in node.names]


def violations(source: str, package: str = "kvpool.node") -> list[str]:
    """Each import from :data:`HIDDEN_PACKAGE` and each use of a :data:`HIDDEN_ATTRIBUTES` attribute, by line."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            hidden = [m for m in imported(node, package) if m == HIDDEN_PACKAGE or m.startswith(HIDDEN_PACKAGE + ".")]
            if hidden:
                found.append((node.lineno, f"imports {hidden[0]}"))
        elif isinstance(node, ast.Attribute) and node.attr in HIDDEN_ATTRIBUTES:
            found.append((node.lineno, f"touches .{node.attr}"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


@pytest.mark.parametrize("module", TRANSPORTS)
def test_a_node_transport_sees_only_the_node_core(module):
    assert violations((ROOT / module).read_text()) == []


def test_the_boundary_check_finds_each_way_past_the_core():
    source = """
import kvpool.tiers.arena
from kvpool.tiers.node_store import NodeStore
from kvpool import tiers
from ..tiers import dram
from .core import NodeCore

def handler(self):
    self.core.store.where([])
    return self.core._store.dram.arena.name
"""
    assert violations(source) == [
        "line 2: imports kvpool.tiers.arena",
        "line 3: imports kvpool.tiers.node_store",
        "line 4: imports kvpool.tiers",
        "line 5: imports kvpool.tiers",
        "line 9: touches .store",
        "line 10: touches ._store",
        "line 10: touches .arena",
    ]
