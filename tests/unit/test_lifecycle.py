"""The daemons' wait for shutdown: a set ``stop`` ends it, and the heap built before it is frozen out of the
garbage collector's sight (full collections walk only what came after)."""

from __future__ import annotations

import gc
import threading

from kvpool.lifecycle import wait_for_shutdown


def test_the_heap_a_daemon_built_to_start_is_frozen_and_stop_ends_the_wait():
    built = [[i] for i in range(1000)]  # (start-up's objects)
    stop = threading.Event()
    stop.set()
    gc.unfreeze()  # (whatever an earlier test froze)
    try:
        assert wait_for_shutdown(stop) == 0
        assert gc.get_freeze_count() >= len(built)
        assert all(o is not built for o in gc.get_objects())  # out of the collector's generations
    finally:
        gc.unfreeze()
