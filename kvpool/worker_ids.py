"""Worker ids: what a worker may be called, and the *scoped id* the master keys it by (docs/security.md, Tenants).

A worker id names one inference worker (one client) in the master's routing state: its HBM keys
(:class:`~kvpool.master.index.HbmIndex`), its liveness (:class:`~kvpool.master.membership.Membership`), its
line in a ``Score`` reply and, with KV events on, its HBM topic.

Invariants:

- A worker id has 1 to :data:`MAX_WORKER_ID_CHARS` characters and no control character (C0, DEL or C1: no
  NUL, no newline), wherever it enters (``Lookup``, ``ReportHbm``, ``ReportLookups``, ``Score``, the client's config).
  :func:`worker_id_problem` is the one rule.
- Inside the master a worker is its scoped id: ``tenant + "\\x00" + worker_id`` for a client of a tenant
  (auth on), the worker id unchanged with auth off (tenant ""). A worker id holds no NUL, and a tenant name
  is never empty, so :func:`split_scoped_id` recovers both from any scoped id, and two tenants' workers of
  the same name are two workers: no call of one tenant reads or changes another's workers.
"""

from __future__ import annotations

import re

__all__ = ["MAX_WORKER_ID_CHARS", "check_worker_id", "scoped_id", "split_scoped_id", "worker_id_problem"]

MAX_WORKER_ID_CHARS = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_SCOPE = "\x00"


def worker_id_problem(worker_id: str) -> str | None:
    """What is wrong with ``worker_id`` as a worker's name (None: nothing)."""
    if not worker_id or len(worker_id) > MAX_WORKER_ID_CHARS:
        return f"a worker id must have 1 to {MAX_WORKER_ID_CHARS} characters, not {len(worker_id)}"
    control = _CONTROL.search(worker_id)
    if control is not None:
        return f"a worker id must not hold control characters ({control.group()!r} at {control.start()})"
    return None


def check_worker_id(worker_id: str, where: str) -> str:
    """``worker_id`` if it is a valid worker id, else ValueError naming ``where`` it came from."""
    problem = worker_id_problem(worker_id)
    if problem is not None:
        raise ValueError(f"{where}: {problem}")
    return worker_id


def scoped_id(tenant: str, worker_id: str) -> str:
    """The master's key of worker ``worker_id`` of ``tenant`` ("" with auth off: the worker id itself)."""
    return f"{tenant}{_SCOPE}{worker_id}" if tenant else worker_id


def split_scoped_id(scoped: str) -> tuple[str, str]:
    """(tenant, worker id) of a scoped id: the inverse of :func:`scoped_id`."""
    tenant, sep, worker_id = scoped.partition(_SCOPE)
    return (tenant, worker_id) if sep else ("", scoped)
