"""LookupMetrics: counts kept as integers and exported at scrape time as Prometheus counters would export them."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.metrics import LookupMetrics


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_per_tenant_counts_are_exported_with_the_names_labels_and_help_of_counters():
    registry = CollectorRegistry()
    metrics = LookupMetrics(registry, by_tenant=True, tenants=["", "a"])
    metrics.record({"hbm": 1, "dram": 2, "ssd": 0}, requested=8, block_tokens=16, tenant="a")
    metrics.record({"hbm": 0, "dram": 0, "ssd": 3}, requested=4, block_tokens=0, lookups=2, tenant="a")
    got = samples(registry)
    a, none = (("tenant", "a"),), (("tenant", ""),)
    assert got[("kvpool_lookups_total", a)] == 3 and got[("kvpool_lookups_total", none)] == 0
    assert got[("kvpool_lookup_blocks_total", a)] == 12 and got[("kvpool_lookup_tokens_total", a)] == 128
    assert got[("kvpool_hit_blocks_total", (("tenant", "a"), ("tier", "dram")))] == 2
    assert got[("kvpool_hit_blocks_total", (("tenant", "a"), ("tier", "ssd")))] == 3
    assert got[("kvpool_hit_tokens_total", (("tenant", "a"), ("tier", "hbm")))] == 16
    assert got[("kvpool_miss_blocks_total", a)] == 8 - 3 + 4 - 3
    # The same families a prometheus_client Counter makes: _total and _created per label set, nothing else.
    reference = CollectorRegistry()
    Counter("kvpool_lookups_total", "Prefix lookups (one per request)", ["tenant"], registry=reference).labels("a")
    def lookups(r: CollectorRegistry) -> list[tuple[str, str, str, list[str]]]:
        families = text_string_to_metric_families(generate_latest(r).decode())
        return [(f.name, f.type, f.documentation, sorted(s.name for s in f.samples if s.labels == {"tenant": "a"}))
                for f in families if f.name.startswith("kvpool_lookups")]

    assert lookups(registry) == lookups(reference)
    assert {n for f in lookups(registry) for n in f[3]} == {"kvpool_lookups_total", "kvpool_lookups_created"}


def test_a_negative_count_is_refused_and_changes_nothing():
    registry = CollectorRegistry()
    metrics = LookupMetrics(registry)
    metrics.record({"dram": 2}, requested=4, block_tokens=1)
    before = samples(registry)
    with pytest.raises(ValueError):
        metrics.record({"dram": 5}, requested=4, block_tokens=1)  # more hits than blocks asked for
    with pytest.raises(ValueError):
        metrics.record({"dram": 1}, requested=4, block_tokens=-1)
    with pytest.raises(KeyError):
        metrics.record({"tape": 1}, requested=4, block_tokens=1)
    assert samples(registry) == before
