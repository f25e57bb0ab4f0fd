"""The engine venv scripts (tests/sglang_env.sh) as a new user runs them: from inside a virtualenv.

Regressions: from an activated virtualenv, sglang_env.sh made its venv with ``venv --system-site-packages``,
which sees the *base* interpreter's packages, not the caller's, so the SGLang tests ended in a bare
``ModuleNotFoundError: No module named 'grpc'`` (or ran another checkout's kvpool); and since its stamp was
written before its check, every rerun failed the same way. Each test runs a copy of the script in its own
folder (the script works in the folder above its own: ``build/`` here is the test's), so the checkout's
build/ is never touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO

ROOT = REPO
INSTALL_TIMEOUT_S = 600  # sglang 0.5.23 and its pins without dependencies: ~30 s here, more on a cold pip cache
pytestmark = pytest.mark.timeout(3 * INSTALL_TIMEOUT_S)


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         capture_output=True, text=True, check=True, timeout=60)
    return Path(out.stdout.strip())


def _caller_venv(path: Path, *, with_kvpool: bool) -> Path:
    """A fresh virtualenv (no system site packages, as ``python3 -m venv`` makes it); ``with_kvpool``: it sees
    the packages this test runs with (torch, grpcio, this kvpool), through its *own* site directory only."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    if with_kvpool:
        import site

        mine = [d for d in site.getsitepackages() if os.path.isdir(d)]
        (_site_packages(python) / "the-tests-packages.pth").write_text(
            f"import site; list(map(site.addsitedir, {mine!r}))\n")
    return python


def _run_script(tree: Path, python: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(tree / "tests" / "sglang_env.sh")], capture_output=True, text=True,
                          timeout=INSTALL_TIMEOUT_S, env={**os.environ, "PYTHON": str(python)})


def _own_lines(stderr: str) -> list[str]:
    """The script's own lines (pip's warnings about unreachable indexes are the machine's, not the script's)."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("WARNING: ")]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A folder holding a copy of tests/sglang_env.sh: its build/ is this test's."""
    (tmp_path / "tree" / "tests").mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "sglang_env.sh", tmp_path / "tree" / "tests" / "sglang_env.sh")
    return tmp_path / "tree"


def test_a_virtualenv_without_kvpools_packages_is_one_line_naming_the_fix_and_makes_nothing(tree, tmp_path):
    caller = _caller_venv(tmp_path / "bare", with_kvpool=False)
    done = _run_script(tree, caller)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = _own_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert f"{caller} cannot import grpc" in lines[0], lines[0]
    assert f"{caller} -m pip install torch==2.13.0 -e '.[client,test]'" in lines[0], lines[0]
    assert "Traceback" not in done.stderr
    assert not (tree / "build").exists()  # refused before anything was made: no venv, no stamp


def test_from_a_virtualenv_the_venv_sees_its_packages_and_a_failed_check_leaves_no_stamp(tree, tmp_path):
    import kvpool

    caller = _caller_venv(tmp_path / "user-venv", with_kvpool=True)
    venv_python = tree / "build" / "sglang-venv" / "bin" / "python"
    stamp = tree / "build" / "sglang-venv" / ".kvpool-sglang-env"

    def kvpool_seen() -> str:
        out = subprocess.run([str(venv_python), "-c", "import grpc, torch, kvpool; print(kvpool.__file__)"],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)  # not the checkout
        return out.stdout.strip() or out.stderr.strip().splitlines()[-1]

    done = _run_script(tree, caller)
    assert done.returncode == 0, done.stderr[-3000:]
    assert stamp.exists()
    assert kvpool_seen() == kvpool.__file__  # the caller's kvpool (this checkout's), not the base interpreter's

    # A venv that no longer sees the caller's packages: the check fails in one line and removes the stamp ...
    next(venv_python.parent.parent.glob("lib/python3*/site-packages/kvpool-caller-site.pth")).unlink()
    done = _run_script(tree, caller)
    assert done.returncode == 1, done.stderr[-3000:]
    lines = _own_lines(done.stderr)
    assert len(lines) == 1 and "cannot import grpc" in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert not stamp.exists()
    # ... so the next run makes the venv anew, and it works
    done = _run_script(tree, caller)
    assert done.returncode == 0, done.stderr[-3000:]
    assert stamp.exists() and kvpool_seen() == kvpool.__file__
