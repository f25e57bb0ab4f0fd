"""Blocks larger than a DRAM slot: on SSD if a node has one, else refused out loud (never a silent no-op).

Regressions: README's own example stores 7 MiB blocks while a default node's
slot is 2 MiB; ``put`` answered True, ``flush`` True, and nothing was stored,
with no log line. PlaceBlocks refused the whole batch (INVALID_ARGUMENT) if
one block was larger than every slot, although SSD would have held it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
from support import REPO, metric, scrape

from kvpool.client.pool import PoolClient
from kvpool.config import ClientConfig
from kvpool.keys import opaque_key
from kvpool.metrics import error_counts

MIB = 1 << 20
README = REPO / "README.md"


def test_readme_example_runs_on_a_default_kvpool_serve(procs, tmp_path):
    procs.node_flags.pop("max-block-bytes")  # the default serves any layout: no flag
    procs.node_flags.update({"dram-bytes": "64M", "ssd-bytes": "256M"})
    procs.serve()
    example = re.search(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert example, "README.md has no python example"
    code = example[1].replace("127.0.0.1:7600", procs.master)
    assert code != example[1], "the example no longer dials the default master address"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loaded 7 of 7 blocks from the pool" in out.stdout, out.stdout + out.stderr[-3000:]


def test_readme_says_what_its_python_example_needs_before_it():
    """Regression: the example imports torch, and README said so only under the tests (the client extra)."""
    before = README.read_text().split("```python\n", 1)[0]
    said = before.rsplit("\n\n## ", 1)[-1]  # the section the example is in, up to the example
    assert 'pip install torch==2.13.0 -e ".[client]"' in said, said


def test_a_block_no_node_takes_is_refused_counted_and_shown_by_status(procs, tmp_path):
    config = tmp_path / "dram-only.json"
    config.write_text(json.dumps({"node": {"tiers": {"ssd": {"enabled": False}}}}))
    procs.node_flags.update({"max-block-bytes": "1M", "dram-bytes": "8M", "config": str(config)})
    procs.serve()
    small = [opaque_key(f"fits-{i}") for i in range(3)]
    big = [opaque_key(f"too-large-{i}") for i in range(2)]
    values = {k: np.full(MIB // 2, i, dtype=np.uint8) for i, k in enumerate(small)}
    values.update({k: np.full(2 * MIB, 9, dtype=np.uint8) for k in big})
    keys = [small[0], big[0], small[1], big[1], small[2]]
    with PoolClient(ClientConfig(master=procs.master)) as pool:
        stored = pool.store(keys, [values[k] for k in keys])
        assert stored == [True, False, True, False, True]  # the rest of the batch is placed as usual
        assert pool.exists(keys) == stored
        assert pool.store(big, [values[k] for k in big]) == [False, False]
        assert error_counts(pool.registry).get("block_too_large") == 4
    assert metric(scrape(procs.master_metrics_port), "kvpool_errors_total", kind="block_too_large") == 4
    status = subprocess.run([sys.executable, "-m", "kvpool.cli", "status", "--master", procs.master],
                            capture_output=True, text=True, timeout=30, check=True).stdout
    assert "REFUSED 4 blocks of up to 2.0 MiB" in status and "no node takes blocks larger than 1.0 MiB" in status, \
        status
    log = (tmp_path / "serve-0.log").read_text()
    assert log.count("refused blocks of up to") == 1, log  # said once, with the setting to change
    assert "--max-block-bytes" in log
