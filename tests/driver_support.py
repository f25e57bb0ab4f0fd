"""Running an engine driver (a script in an engine's venv, e.g. ``vllm_driver.py``) as a child process.

A driver reports on stdout in lines ``KVPOOL-TEST {json}``; a report ``{"paused": name}`` waits for a line
``go`` on its stdin (the test does something meanwhile: kills the pool, corrupts a block). Everything else it
prints is its log.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

MARK = "KVPOOL-TEST "


def run_driver(python: str, driver: Path, spec: Path, env: Mapping[str, str], log_path: Path, *,
               on_report: Callable[[dict[str, Any]], None], on_pause: Callable[[str], None] | None = None,
               timeout: float = 400) -> str:
    """Run ``python driver spec``; each report but a pause goes to ``on_report``; a pause runs ``on_pause(name)``
    and is answered. Killed after ``timeout`` s. Its log is written to ``log_path`` and returned; asserts it
    exited 0 with no traceback through kvpool's own source (:func:`kvpool_frames`)."""
    proc = subprocess.Popen([python, str(driver), str(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(env))
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    lines = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        for line in proc.stdout:
            lines.append(line)
            if not line.startswith(MARK):
                continue
            report = json.loads(line[len(MARK):])
            if "paused" in report:
                if on_pause is not None:
                    on_pause(report["paused"])
                proc.stdin.write("go\n")
                proc.stdin.flush()
            else:
                on_report(report)
        code = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = "".join(lines)
    log_path.write_text(log)
    assert code == 0, f"driver exited {code}:\n{log[-4000:]}"
    frames = kvpool_frames(log, kvpool_dirs(python))
    assert not frames, f"a traceback through kvpool ({frames[0]}):\n{log[-4000:]}"
    return log


@functools.cache
def kvpool_dirs(python: str) -> tuple[str, ...]:
    """The folders of kvpool's own source as ``python`` imports it: kvpool, kvpool.master, kvpool.client.

    Asked of that Python as a driver runs (find_spec: nothing of them runs), so a traceback check names
    kvpool's files, never the checkout's folder: cloned as ``kvpool``, vLLM's own frames are under
    ``kvpool/build/vllm-venv/``.
    """
    code = ("import importlib.util, os\n"
            "for name in ('kvpool', 'kvpool.master', 'kvpool.client'):\n"
            "    print(os.path.dirname(importlib.util.find_spec(name).origin))")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                          cwd=Path(__file__).resolve().parent)  # a driver's first sys.path entry: its folder
    return tuple(done.stdout.splitlines())


def kvpool_frames(log: str, dirs: tuple[str, ...]) -> list[str]:
    """The traceback frames in ``log`` that are in one of kvpool's source folders ``dirs``."""
    return [path for path in re.findall(r'File "([^"]+)", line', log)
            if any(path.startswith(folder + os.sep) for folder in dirs)]
