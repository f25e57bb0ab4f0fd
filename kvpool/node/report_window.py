"""How long a node's master link lets inventory changes gather before it reports them.

A report per burst of puts costs the master one call; a hundred busy nodes at
a fixed 2 ms window would send the master up to ~500 calls a second each.
:class:`ReportWindow` widens the window while the link is busy and narrows
it when quiet, so calls per second *fall* as the put rate rises (each call
carries more keys) while a quiet node still reports within the base window.

Invariants:

- ``base_s <= current <= cap_s`` at all times.
- **Busy widens**: after a send during which more changes arrived (reports
  in flight while puts go on), or that took longer than the window (the
  master answers slowly), the window doubles, up to ``cap_s``.
- **Quiet narrows**: a link that waited for its next change longer than the
  window halves it (not below ``base_s``); one that waited ``cap_s`` or more
  (nothing to report for that long: no backlog at all) is back at ``base_s``,
  so a quiet node's next change is reported within ``base_s``.
- Not thread-safe: the link's report thread alone uses it.
"""

from __future__ import annotations

BASE_S = 0.002  # a quiet node reports a change this soon
CAP_S = 0.1  # a busy node reports at least this often


class ReportWindow:
    """The link's coalescing window; see the module docstring."""

    def __init__(self, base_s: float = BASE_S, cap_s: float = CAP_S) -> None:
        if not 0 < base_s <= cap_s:
            raise ValueError(f"ReportWindow: need 0 < base_s <= cap_s (got {base_s}, {cap_s})")
        self.base_s = base_s
        self.cap_s = cap_s
        self.current = base_s

    def woke(self, waited_s: float) -> float:
        """A change woke the link after it waited ``waited_s`` for one; returns how long to let more gather."""
        if waited_s >= self.cap_s:
            self.current = self.base_s
        elif waited_s > self.current:
            self.current = max(self.base_s, self.current / 2)
        return self.current

    def sent(self, took_s: float, more_came: bool) -> None:
        """A report went: it took ``took_s``; ``more_came``: changes arrived meanwhile."""
        if more_came or took_s > self.current:
            self.current = min(self.cap_s, self.current * 2)
