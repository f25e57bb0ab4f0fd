"""Type-check the whole tree with mypy: ``python tests/typecheck.py`` (exit code: mypy's).

kvpool is one distribution from three folders (``master/`` is imported as
``kvpool.master``, ``client/`` as ``kvpool.client``; see docs/architecture.md),
a mapping mypy cannot follow, neither from the sources nor through the
editable install's import hook. So this script lays the package out as it is
installed, as a tree of symbolic links under ``build/typecheck/``, checks it
together with ``tests/`` and ``benchmarks/``, and reports every error under
the path of the file in this repository. Settings: ``[tool.mypy]`` in
pyproject.toml.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"
# where each part of the package lives in the repository, and where it goes in the tree
PARTS = {"kvpool": ROOT / "kvpool", "kvpool/master": ROOT / "master", "kvpool/client": ROOT / "client"}


def link_tree() -> None:
    """``build/typecheck/kvpool``: the package as installed, every file a link to its source."""
    shutil.rmtree(TREE, ignore_errors=True)
    for target, source in PARTS.items():
        for path in source.rglob("*.py*"):  # .py and .pyi
            if "__pycache__" in path.parts:
                continue
            link = TREE / target / path.relative_to(source)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(path)


def repo_path(line: str) -> str:
    """An error line with its tree path replaced by the file's path in the repository."""
    prefix = f"{TREE.relative_to(ROOT)}{os.sep}"
    if not line.startswith(prefix):
        return line
    rest = line[len(prefix):]
    for target in sorted(PARTS, key=len, reverse=True):
        if rest.startswith(target + "/"):
            source = PARTS[target].relative_to(ROOT)
            return f"{source}/{rest[len(target) + 1:]}"
    return rest


def main() -> int:
    os.chdir(ROOT)
    link_tree()
    out, err, code = api.run([str((TREE / "kvpool").relative_to(ROOT)), "tests", "benchmarks"])
    for line in out.splitlines():
        print(repo_path(line))
    if err:
        print(err, file=sys.stderr, end="")
    return code


if __name__ == "__main__":
    sys.exit(main())
