"""Prometheus metrics: one class per component, each on its own registry.

Naming follows Prometheus conventions: ``kvpool_`` prefix, ``_total`` for
counters, ``_bytes`` / ``_seconds`` units, a ``tier`` label with values
``hbm`` / ``dram`` / ``ssd``. Hit rate per tier is
``rate(kvpool_hit_blocks_total{tier=T}) / rate(kvpool_lookup_blocks_total)``
(or the ``_tokens_`` pair).

Gauges of tier usage are read from the stores at scrape time
(:class:`TierCollector`), so they never drift from the stores themselves.

Sources: a node exports its own tiers as ``kvpool_tier_*``; the master its
view of every node's tiers (from heartbeats) as ``kvpool_cluster_tier_*``, so
a tier query never mixes the two. Lookup/hit counters and latency histograms
are exported by each side for its own view (master: cluster-wide lookups, per
``tenant``; a client: its own; node and client: get and put) and told apart by
``job`` (``deploy/prometheus``: ``kvpool-master``, ``kvpool-node``,
``kvpool-client``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from kvpool.vocabulary import TierStats


def scrape_samples(port: int, host: str = "127.0.0.1", timeout: float = 5.0) -> list[Sample]:
    """Every sample a process's ``/metrics`` endpoint exports now; OSError if it does not answer."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as reply:
        text = reply.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TIER_LABELS = ("hbm", "dram", "ssd")
NODE_TIER_PREFIX = "kvpool_tier"  # a node's own tiers, with movement counters
CLUSTER_TIER_PREFIX = "kvpool_cluster_tier"  # the master's view of each node's tiers: usage gauges only


# The lookup counters: (name, help, one per tier). Each is exported as a Prometheus counter would export it
# (``<name>_total`` and ``<name>_created``).
_LOOKUP_COUNTERS = (
    ("kvpool_lookups", "Prefix lookups (one per request)", False),
    ("kvpool_lookup_blocks", "Full blocks asked for in lookups (HBM part included)", False),
    ("kvpool_lookup_tokens", "Tokens in the full blocks asked for", False),
    ("kvpool_hit_blocks", "Blocks of the leading hit run, by serving tier", True),
    ("kvpool_hit_tokens", "Tokens of the leading hit run, by tier", True),
    ("kvpool_miss_blocks", "Blocks after the leading hit run", False),
)
_TIER_INDEX = {tier: i for i, tier in enumerate(TIER_LABELS)}  # (LookupMetrics.add takes hits in this order)
# A tally's slots: lookups, blocks, tokens, hit blocks per tier, hit tokens per tier, misses.
_HIT_BLOCKS, _HIT_TOKENS, _MISSES = 3, 3 + len(TIER_LABELS), 3 + 2 * len(TIER_LABELS)


class LookupMetrics(Collector):
    """Lookup and hit accounting, shared by the master (cluster-wide) and the client (its own traffic).

    ``by_tenant`` (the master): every counter has a ``tenant`` label, the caller's tenant ("" with auth off),
    so one tenant's numbers are visible as its own; its values come from the auth file only (bounded).
    ``tenants``: the label values exported (as zeros) from the start.

    Counts are plain integers under one lock, read into counter families at scrape time (a lookup is on the
    master's hot path: one lock, not one per counter); the exposition is what ``prometheus_client.Counter``
    gives (``_total`` and ``_created`` samples, the same names, help and labels). A negative count is a
    ValueError and changes nothing.
    """

    def __init__(self, registry: CollectorRegistry, *, by_tenant: bool = False, tenants: Iterable[str] = ("",)):
        self._by_tenant = by_tenant
        self._lock = threading.Lock()
        self._tallies: dict[str, tuple[list[int], float]] = {}  # tenant -> (counts, created)
        for name in tenants if by_tenant else ("",):  # export zeros from the start: rates need both ends
            self._of(name)
        registry.register(self)

    def _of(self, tenant: str) -> list[int]:
        """The counts of one tenant ("" and unlabelled without ``by_tenant``), made once (caller: any thread)."""
        tally = self._tallies.get(tenant)
        if tally is None:
            tally = self._tallies.setdefault(tenant, ([0] * (_MISSES + 1), time.time()))
        return tally[0]

    def record(self, hits_by_tier: dict[str, int], requested: int, block_tokens: int, lookups: int = 1,
               tenant: str = "") -> None:
        """Count ``lookups`` lookups of ``requested`` blocks in all, whose leading runs were served as
        ``hits_by_tier`` (``tenant``: whose, with ``by_tenant``)."""
        hits = [0] * len(TIER_LABELS)
        for tier, n in hits_by_tier.items():
            hits[_TIER_INDEX[tier]] += n  # KeyError: no such tier
        self.add(tenant, lookups, requested, block_tokens, *hits)

    def add(self, tenant: str, lookups: int, requested: int, block_tokens: int, hbm: int, dram: int,
            ssd: int) -> None:
        """:meth:`record` with the hits by tier given in :data:`TIER_LABELS`' order (the master's hot path:
        no dict)."""
        if min(lookups, requested, block_tokens, hbm, dram, ssd, requested - hbm - dram - ssd) < 0:
            raise ValueError(f"lookup counts must not be negative: lookups {lookups}, requested {requested}, "
                             f"block_tokens {block_tokens}, hits hbm {hbm} dram {dram} ssd {ssd}")
        with self._lock:
            c = self._of(tenant if self._by_tenant else "")
            c[0] += lookups
            c[1] += requested
            c[2] += requested * block_tokens
            c[_HIT_BLOCKS] += hbm
            c[_HIT_BLOCKS + 1] += dram
            c[_HIT_BLOCKS + 2] += ssd
            c[_HIT_TOKENS] += hbm * block_tokens
            c[_HIT_TOKENS + 1] += dram * block_tokens
            c[_HIT_TOKENS + 2] += ssd * block_tokens
            c[_MISSES] += requested - hbm - dram - ssd

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            tallies = [(tenant, list(counts), created) for tenant, (counts, created) in self._tallies.items()]
        slot = 0
        for name, text, per_tier in _LOOKUP_COUNTERS:
            labels = (["tenant"] if self._by_tenant else []) + (["tier"] if per_tier else [])
            family = CounterMetricFamily(name, text, labels=labels)
            for tenant, counts, created in tallies:
                label = [tenant] if self._by_tenant else []
                if per_tier:
                    for i, tier in enumerate(TIER_LABELS):
                        family.add_metric([*label, tier], counts[slot + i], created=created)
                else:
                    family.add_metric(label, counts[slot], created=created)
            slot += len(TIER_LABELS) if per_tier else 1
            yield family


class ErrorMetrics:
    """Errors by kind (``timeout``, ``unavailable``, ``checksum``, ``invalid_argument``, ...)."""

    def __init__(self, registry: CollectorRegistry, help_text: str = "Errors by kind"):
        self.errors = Counter("kvpool_errors", help_text, ["kind"], registry=registry)

    def count(self, kind: str, n: int = 1) -> None:
        self.errors.labels(kind).inc(n)


def error_counts(registry: CollectorRegistry) -> dict[str, int]:
    """``kvpool_errors_total`` of one registry, by kind (non-zero kinds only)."""
    out: dict[str, int] = {}
    for family in registry.collect():
        for s in family.samples:
            if s.name == "kvpool_errors_total" and s.value:
                kind = s.labels.get("kind", "?")
                out[kind] = out.get(kind, 0) + int(s.value)
    return out


def latency_histogram(registry: CollectorRegistry, op: str, help_text: str) -> Histogram:
    """``kvpool_<op>_seconds``: the latency of one call (lookup, get, put)."""
    return Histogram(f"kvpool_{op}_seconds", help_text, buckets=LATENCY_BUCKETS, registry=registry)


class TierCollector(Collector):
    """Exports usage gauges and movement counters of tier stores, read at scrape time.

    ``source`` returns ``(labels, stats)`` pairs, where labels carry e.g. the node id.
    Names are ``<prefix>_capacity_bytes`` etc.; ``gauges_only`` leaves out the
    movement counters (for a view that knows usage but not movement).
    """

    def __init__(
        self,
        source: Callable[[], Iterable[tuple[dict[str, str], TierStats]]],
        label_names: tuple[str, ...] = ("node",),
        *,
        prefix: str = NODE_TIER_PREFIX,
        gauges_only: bool = False,
    ):
        self._source = source
        self._label_names = label_names
        self._prefix = prefix
        self._gauges_only = gauges_only

    def collect(self) -> Iterator[Metric]:
        names = [*self._label_names, "tier"]
        p = self._prefix
        families = {
            "capacity": GaugeMetricFamily(f"{p}_capacity_bytes", "Capacity of a tier", labels=names),
            "used": GaugeMetricFamily(f"{p}_used_bytes", "Bytes held in a tier", labels=names),
            "blocks": GaugeMetricFamily(f"{p}_blocks", "Blocks held in a tier", labels=names),
        }
        counters = {} if self._gauges_only else {
            "bytes_in": ("bytes_in", "Bytes written into a tier"),
            "bytes_out": ("bytes_out", "Bytes read out of a tier"),
            "evictions": ("evictions", "Blocks evicted from a tier (DRAM: demotions to SSD)"),
            "corrupt": ("corrupt_blocks", "Blocks that failed their checksum and were dropped"),
            "hits": ("hits", "Reads a tier served"),
            "misses": ("misses", "Reads a tier could not serve"),
        }
        counter_families = {k: CounterMetricFamily(f"{p}_{n}", h, labels=names) for k, (n, h) in counters.items()}
        for labels, stats in self._source():
            values = [labels.get(n, "") for n in self._label_names] + [stats.tier.label]
            families["capacity"].add_metric(values, stats.capacity_bytes)
            families["used"].add_metric(values, stats.used_bytes)
            families["blocks"].add_metric(values, stats.blocks)
            for key, family in counter_families.items():
                family.add_metric(values, getattr(stats, key))
        yield from families.values()
        yield from counter_families.values()


class MetricsServer:
    """An HTTP ``/metrics`` endpoint for one registry, on 127.0.0.1 unless told otherwise.

    A port that cannot be bound is a ValueError naming ``name``'s endpoint and the address (a refused start).
    """

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "127.0.0.1", *, name: str = "the"):
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise ValueError(f"{name} metrics endpoint cannot listen on {host}:{port}: {exc.strerror}") from exc
        self.port = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

