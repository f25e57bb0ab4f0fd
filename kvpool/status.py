"""``kvpool status``: nodes and their health, tier usage, and hit rates per tier, in human units.

Two sources, each shown for what it is:

- the master (``ClusterStatus``, always): live nodes with heartbeat age and
  usage per tier, and block hit rates per tier since the master started;
- Prometheus (``--prometheus URL``, optional): the recorded series of
  ``deploy/prometheus/rules/recording.yml`` that the Grafana dashboard plots
  (hit rate per tier by blocks and by tokens over 5 minutes, tokens saved per
  second, lookup latency), and whether each scrape target is up.

Invariant: every Prometheus number printed is one recorded series read as it
is (:data:`RECORDED`), never recomputed here, so it equals the dashboard's.

``--json`` prints the same numbers as one JSON object instead of the tables
(:func:`status_fields`, :func:`masters_fields`, :func:`rates_fields`; the
tables are rendered from those same fields). Its names are stable and
documented in docs/operations.md: sizes in bytes (``*_bytes``), times in
seconds (``*_s``), ratios 0..1, and ``null`` for what there is none of (no
traffic, no SSD tier, a source not asked or not reachable).
"""

from __future__ import annotations

import json
import math
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from kvpool.metrics import TIER_LABELS
from kvpool.v1 import common_pb2, master_pb2

if TYPE_CHECKING:
    from kvpool.etcd import EtcdAccess

LATE_HEARTBEAT_S = 2.0  # two default heartbeat intervals: still listed, but worth a look

# The recorded series (deploy/prometheus/rules/recording.yml) status reads.
RECORDED = {
    "blocks_by_tier": "cluster_tier:kvpool_hit_blocks:ratio_rate5m",
    "blocks": "cluster:kvpool_hit_blocks:ratio_rate5m",
    "tokens_by_tier": "cluster_tier:kvpool_hit_tokens:ratio_rate5m",
    "tokens": "cluster:kvpool_hit_tokens:ratio_rate5m",
    "tokens_saved": "cluster:kvpool_hit_tokens:rate5m",
    "lookups": "cluster:kvpool_lookups:rate5m",
    "lookup_p50": "job:kvpool_lookup_seconds:p50_rate5m",
    "lookup_p99": "job:kvpool_lookup_seconds:p99_rate5m",
}
_TARGETS = 'up{job=~"kvpool-.*"}'


# -- units -------------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; binary units up to TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_seconds(s: float) -> str:
    """0.00042 -> '0.42 ms', 0.35 -> '350 ms', 4.2 -> '4.2 s'; '-' for NaN."""
    if math.isnan(s):
        return "-"
    if s < 0.01:
        return f"{s * 1000:.2f} ms"
    if s < 1:
        return f"{s * 1000:.0f} ms"
    return f"{s:.1f} s"


def human_rate(per_s: float) -> str:
    """Events per second with k/M suffixes: 1234.5 -> '1.2 k/s', 0.031 -> '0.03 /s'; '-' for NaN."""
    if math.isnan(per_s):
        return "-"
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(per_s) >= scale:
            return f"{per_s / scale:.1f} {suffix}/s"
    return f"{per_s:.2f} /s" if abs(per_s) < 10 else f"{per_s:.1f} /s"


def ratio_percent(r: float | None) -> str:
    """0.667 -> ' 66.7%' (width 6); '     -' when there is no rate (no traffic)."""
    return "     -" if r is None or math.isnan(r) else f"{100.0 * r:5.1f}%"


def _percent(part: int, whole: int) -> str:
    return ratio_percent(part / whole if whole else None)


def _tier_line(by_tier: Mapping[str, float | None], overall: float | None) -> str:
    cells = [f"{tier.upper()} {ratio_percent(by_tier.get(tier))}" for tier in TIER_LABELS]
    return "   ".join(cells) + f"   overall {ratio_percent(overall)}"


# -- the master's view ------------------------------------------------------------------


def node_health(seconds_since_heartbeat: float, late_after_s: float = LATE_HEARTBEAT_S) -> str:
    """'ok' or 'late' (the master drops a node only past its node_timeout_s)."""
    return "ok" if seconds_since_heartbeat < late_after_s else "late"


def _tier_fields(usage: common_pb2.TierUsage | None) -> dict[str, int] | None:
    if usage is None or not usage.capacity_bytes:
        return None
    return {"used_bytes": usage.used_bytes, "capacity_bytes": usage.capacity_bytes, "blocks": usage.blocks}


def status_fields(master: str, status: master_pb2.ClusterStatusResponse) -> dict[str, Any]:
    """What ``kvpool status`` shows of one ClusterStatus reply, by the names ``--json`` prints."""
    nodes = []
    for node in status.nodes:
        tiers = {t.tier: t for t in node.tiers}
        age = node.seconds_since_heartbeat
        nodes.append({"node_id": node.node.node_id, "address": node.node.address, "health": node_health(age),
                      "seconds_since_heartbeat": age, "incarnation": node.incarnation,
                      "dram": _tier_fields(tiers.get(common_pb2.TIER_DRAM)),
                      "ssd": _tier_fields(tiers.get(common_pb2.TIER_SSD))})
    asked = status.requested_blocks
    hits = {"hbm": status.hit_blocks_hbm, "dram": status.hit_blocks_dram, "ssd": status.hit_blocks_ssd}
    ratios: dict[str, float | None] = {tier: n / asked if asked else None for tier, n in hits.items()}
    ratios["overall"] = sum(hits.values()) / asked if asked else None
    return {
        "master": master,
        "nodes": nodes,
        "indexed_blocks": status.indexed_blocks,
        "workers": status.workers,
        "hbm_blocks": status.hbm_blocks,
        "lookups": status.lookups,
        "requested_blocks": asked,
        "hit_blocks": hits,
        "hit_ratio": ratios,
        "refused_blocks": status.blocks_too_large,
        "largest_refused_bytes": status.largest_refused_bytes,
        "largest_block_bytes": status.largest_block_bytes,
    }


def render_status(master: str, status: master_pb2.ClusterStatusResponse) -> str:
    """The table ``kvpool status`` prints for one ClusterStatus reply."""
    f = status_fields(master, status)
    lines = [
        (f"kvpool master {master}: {len(f['nodes'])} node(s), {f['indexed_blocks']} blocks indexed, "
         f"{f['workers']} worker(s) holding {f['hbm_blocks']} blocks in HBM"),
        "",
        f"{'NODE':<24} {'ADDRESS':<22} {'HEALTH':<6} {'HEARTBEAT':>11}  "
        f"{'DRAM used / capacity':<40} SSD used / capacity",
    ]
    for node in f["nodes"]:
        cells = []
        for t in (node["dram"], node["ssd"]):
            cells.append("-" if t is None else
                         f"{human_bytes(t['used_bytes'])} / {human_bytes(t['capacity_bytes'])} "
                         f"({_percent(t['used_bytes'], t['capacity_bytes']).strip()}, {t['blocks']} blk)")
        lines.append(f"{node['node_id']:<24} {node['address']:<22} {node['health']:<6} "
                     f"{human_seconds(node['seconds_since_heartbeat']) + ' ago':>11}  {cells[0]:<40} {cells[1]}")
    if not f["nodes"]:
        lines.append("(no nodes registered)")
    ratios = f["hit_ratio"]
    lines += [
        "",
        f"hit rate since the master started ({f['lookups']} lookups, {f['requested_blocks']} blocks asked for):",
        "  " + _tier_line({t: r for t, r in ratios.items() if t != "overall"}, ratios["overall"]),
    ]
    if f["refused_blocks"]:
        lines += [
            "",
            (f"REFUSED {f['refused_blocks']} blocks of up to {human_bytes(f['largest_refused_bytes'])}: no node "
             f"takes blocks larger than {human_bytes(f['largest_block_bytes'])}; set the nodes' --max-block-bytes to "
             "at least your block size (or give them an SSD tier)"),
        ]
    return "\n".join(lines)


# -- Prometheus: the dashboard's numbers --------------------------------------------------


def query_prometheus(url: str, expr: str, timeout: float = 3.0) -> list[tuple[dict[str, str], float]]:
    """Evaluate ``expr`` at Prometheus ``url`` now: ``(labels, value)`` per series.

    Raises OSError when Prometheus cannot be reached, ValueError when it refuses the query.
    """
    query = urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/query?{query}", timeout=timeout) as reply:
            body = json.load(reply)
    except urllib.error.HTTPError as exc:  # 400/422: a bad query, with Prometheus' reason in the body
        body = json.loads(exc.read() or b"{}")
    if body.get("status") != "success":
        raise ValueError(f"Prometheus refused {expr!r}: {body.get('error', body)}")
    data = body["data"]
    if data["resultType"] != "vector":
        raise ValueError(f"{expr!r} gives a {data['resultType']}, not an instant vector")
    return [(dict(s["metric"]), float(s["value"][1])) for s in data["result"]]


@dataclass(frozen=True)
class DashboardRates:
    """The recorded series the dashboard plots, read at one moment (ratios 0..1, seconds, per second)."""

    blocks_by_tier: dict[str, float] = field(default_factory=dict)
    blocks: float | None = None
    tokens_by_tier: dict[str, float] = field(default_factory=dict)
    tokens: float | None = None
    tokens_saved_per_s: float | None = None
    lookups_per_s: float | None = None
    lookup_p50_s: dict[str, float] = field(default_factory=dict)  # by job
    lookup_p99_s: dict[str, float] = field(default_factory=dict)
    targets: list[tuple[str, str, bool]] = field(default_factory=list)  # (job, instance, up)


def fetch_dashboard_rates(url: str, timeout: float = 3.0) -> DashboardRates:
    """Read :data:`RECORDED` and the kvpool scrape targets from Prometheus at ``url``."""

    def series(name: str) -> list[tuple[dict[str, str], float]]:
        return query_prometheus(url, RECORDED[name], timeout)

    def scalar(name: str) -> float | None:
        found = series(name)
        return found[0][1] if found else None

    def by_label(name: str, label: str) -> dict[str, float]:
        return {labels.get(label, ""): value for labels, value in series(name)}

    targets = sorted((lab.get("job", ""), lab.get("instance", ""), value == 1)
                     for lab, value in query_prometheus(url, _TARGETS, timeout))
    return DashboardRates(
        blocks_by_tier=by_label("blocks_by_tier", "tier"),
        blocks=scalar("blocks"),
        tokens_by_tier=by_label("tokens_by_tier", "tier"),
        tokens=scalar("tokens"),
        tokens_saved_per_s=scalar("tokens_saved"),
        lookups_per_s=scalar("lookups"),
        lookup_p50_s=by_label("lookup_p50", "job"),
        lookup_p99_s=by_label("lookup_p99", "job"),
        targets=targets,
    )


def _number(value: float | None) -> float | None:
    """JSON has no NaN: a rate Prometheus could not compute (no traffic) is null."""
    return None if value is None or math.isnan(value) else value


def rates_fields(url: str, rates: DashboardRates) -> dict[str, Any]:
    """The Prometheus part of ``kvpool status``, by the names ``--json`` prints."""
    def by_tier(ratios: dict[str, float], overall: float | None) -> dict[str, float | None]:
        return {**{tier: _number(ratios.get(tier)) for tier in TIER_LABELS}, "overall": _number(overall)}

    return {
        "url": url,
        "hit_ratio_by_blocks": by_tier(rates.blocks_by_tier, rates.blocks),
        "hit_ratio_by_tokens": by_tier(rates.tokens_by_tier, rates.tokens),
        "tokens_saved_per_s": _number(rates.tokens_saved_per_s),
        "lookups_per_s": _number(rates.lookups_per_s),
        "lookup_p50_s": {job: _number(v) for job, v in sorted(rates.lookup_p50_s.items())},
        "lookup_p99_s": {job: _number(v) for job, v in sorted(rates.lookup_p99_s.items())},
        "targets": [{"job": job, "instance": instance, "up": up} for job, instance, up in rates.targets],
    }


def render_dashboard_rates(url: str, rates: DashboardRates) -> str:
    """The Prometheus part of ``kvpool status``."""
    nan = float("nan")
    saved = rates.tokens_saved_per_s if rates.tokens_saved_per_s is not None else nan
    lookups = rates.lookups_per_s if rates.lookups_per_s is not None else nan
    lines = [
        f"last 5 minutes, from Prometheus at {url} (the dashboard's numbers):",
        "  by blocks:  " + _tier_line(rates.blocks_by_tier, rates.blocks),
        "  by tokens:  " + _tier_line(rates.tokens_by_tier, rates.tokens),
        f"  tokens saved: {human_rate(saved)}   lookups: {human_rate(lookups)}",
    ]
    for job in sorted(rates.lookup_p99_s):
        lines.append(f"  lookup latency ({job}): p50 {human_seconds(rates.lookup_p50_s.get(job, nan))}"
                     f"   p99 {human_seconds(rates.lookup_p99_s[job])}")
    jobs = sorted({job for job, _, _ in rates.targets})
    if not jobs:
        lines.append('  scrape targets: none with job="kvpool-*" (see deploy/prometheus/prometheus.yml)')
    for job in jobs:
        mine = [(instance, up) for j, instance, up in rates.targets if j == job]
        down = [instance for instance, up in mine if not up]
        line = f"  {job}: {len(mine) - len(down)}/{len(mine)} target(s) up"
        lines.append(line + (f"; DOWN: {', '.join(down)}" if down else ""))
    return "\n".join(lines)


class MasterUnreachable(ValueError):
    """The master could not be asked; ``code`` is gRPC's status code name."""

    def __init__(self, master: str, code: str, details: str):
        super().__init__(f"cannot ask the master at {master}: {code} ({details})")
        self.code = code


@dataclass(frozen=True)
class Masters:
    """What etcd says of an HA cluster's masters (``etcd://`` targets): the leader, the standbys, etcd's health."""

    cluster: str
    leader: str | None  # the leading master's gRPC address; None: no leader now
    standbys: list[str]
    etcd: list[tuple[str, str]]  # (endpoint, "etcd 3.4.23, raft term 2" or what went wrong); shard 0's only
    shard: int = 0  # the index shard whose master group this is (kvpool.shards)
    shards: int = 1  # the cluster's shard count (its shard map)


def ask_etcd(target: str, timeout: float = 3.0, etcd_access: EtcdAccess | None = None,
             shard: int = 0) -> Masters | None:
    """The masters of index shard ``shard`` of an ``etcd://`` target, as etcd names them (asked as
    ``etcd_access``: TLS, user), with the cluster's shard count and (shard 0) etcd's health; None for a plain
    ``host:port``. ValueError if etcd refuses ``etcd_access``."""
    from kvpool.etcd import EtcdClient, EtcdRefused, EtcdTarget, LeaderInfo, members_prefix
    from kvpool.master_client import leader_address
    from kvpool.shards import read_shard_map

    parsed = EtcdTarget.parse(target)
    if parsed is None:
        return None
    etcd = EtcdClient(parsed.endpoints, timeout_s=timeout, access=etcd_access)
    try:
        health = []
        for i, endpoint in enumerate(parsed.endpoints if shard == 0 else ()):
            try:
                st = etcd.status(i)
                health.append((endpoint, f"etcd {st.version}, raft term {st.raftTerm}"
                               + (f", alarms: {', '.join(st.errors)}" if st.errors else "")))
            except grpc.RpcError as exc:
                health.append((endpoint, f"UNREACHABLE ({exc.code().name})"))
        count = 1
        try:
            leader = leader_address(etcd, parsed.cluster, shard=shard)
            members = [info.address for _, kv in etcd.get_prefix(members_prefix(parsed.cluster, shard))
                       if (info := LeaderInfo.decode(kv.value)) is not None]
            count = read_shard_map(etcd, parsed.cluster).count
        except EtcdRefused as exc:
            raise ValueError(f"etcd refused to name the masters of {target}: {exc.details()}") from None
        except grpc.RpcError:
            leader, members = None, []
        return Masters(parsed.cluster, leader, sorted(m for m in members if m != leader), health, shard, count)
    finally:
        etcd.close()


def masters_fields(masters: Masters) -> dict[str, Any]:
    """What etcd says of an HA cluster's masters, by the names ``--json`` prints."""
    return {"cluster": masters.cluster, "leader": masters.leader, "standbys": masters.standbys,
            "etcd": [{"endpoint": endpoint, "reachable": not health.startswith("UNREACHABLE"), "detail": health}
                     for endpoint, health in masters.etcd]}


def render_masters(masters: Masters) -> str:
    shard = f" shard {masters.shard} of {masters.shards}" if masters.shards > 1 else ""
    lines = [f"masters of cluster {masters.cluster}{shard}: leader "
             f"{masters.leader or 'NONE (no leader elected now)'}; standbys: {', '.join(masters.standbys) or 'none'}"]
    lines += [f"  etcd {endpoint}: {health}" for endpoint, health in masters.etcd]
    return "\n".join(lines)


def cluster_status(master: str, *, token: str = "", tls_ca: str = "", timeout: float = 5.0,
                   etcd_access: EtcdAccess | None = None, shard: int = 0) -> master_pb2.ClusterStatusResponse:
    """The master's ``ClusterStatus``, asked over gRPC (:class:`~kvpool.master_client.MasterConnection`) with the
    caller's credentials (``token`` and ``tls_ca`` as in a client config, so a master with an auth file or TLS
    answers too). ``master`` may be ``etcd://HOST:PORT/CLUSTER``: the leader etcd names (asked as
    ``etcd_access``) is asked: the leader of index shard ``shard``.

    The one way every command and benchmark asks it. :class:`MasterUnreachable` (a ValueError) when the
    master cannot be asked; a ValueError if etcd refuses ``etcd_access``.
    """
    from kvpool.master_client import MasterConnection

    connection = MasterConnection(master, pool=None, timeout_s=timeout, max_message_bytes=64 << 20, token=token,
                                  tls_ca=tls_ca, etcd_access=etcd_access, refuse_start=True, shard=shard)
    try:
        return connection.cluster_status(master_pb2.ClusterStatusRequest(), timeout)
    except grpc.RpcError as exc:
        raise MasterUnreachable(connection.address or master, exc.code().name, str(exc.details())) from None
    finally:
        connection.close()


def run_status(master: str, timeout: float = 3.0, prometheus: str | None = None, *, token: str = "",
               tls_ca: str = "", etcd_access: EtcdAccess | None = None, as_json: bool = False) -> int:
    """Print the status: the tables, or (``as_json``) one JSON object, ``null`` for each part that could not be
    read and ``errors`` saying why. 1 if a source could not be read (a message on stderr for each) or etcd is not
    whole.

    ``token`` / ``tls_ca``: the client config's, for a master with an auth file or TLS; ``etcd_access``: its
    ``etcd_*`` settings, for an etcd with TLS or authentication.
    """
    report: dict[str, Any] = {"master": master, "masters": None, "cluster": None, "prometheus": None, "errors": []}
    tables: list[str] = []

    def failed(message: str) -> None:
        print(f"kvpool status: {message}", file=sys.stderr)
        report["errors"].append(message)

    def done() -> int:
        if as_json:
            print(json.dumps(report, indent=2, allow_nan=False))
        elif tables:
            print("\n\n".join(tables))
        return 1 if report["errors"] else 0

    try:
        masters = ask_etcd(master, timeout, etcd_access)
    except ValueError as exc:  # a malformed etcd:// target, or etcd refused the client's etcd settings
        failed(str(exc))
        return done()
    if masters is not None:
        report["masters"] = masters_fields(masters)
        tables.append(render_masters(masters))
        unreachable = [endpoint for endpoint, health in masters.etcd if health.startswith("UNREACHABLE")]
        if unreachable or masters.leader is None:  # shown in the table; said in errors for --json
            report["errors"].append(f"etcd: {'unreachable ' + ', '.join(unreachable) if unreachable else 'no leader'}")
    if masters is not None and masters.shards > 1:
        shard_reports = []
        for shard in range(masters.shards):
            try:
                group = masters if shard == 0 else ask_etcd(master, timeout, etcd_access, shard)
            except ValueError as exc:
                failed(str(exc))
                return done()
            assert group is not None, "kvpool status: an etcd:// target named no masters"
            if shard:
                tables.append(render_masters(group))
                if group.leader is None:
                    report["errors"].append(f"etcd: no leader of shard {shard}")
            entry: dict[str, Any] = {"shard": shard, "masters": masters_fields(group), "cluster": None}
            label = f"{master} shard {shard}"
            try:
                status = cluster_status(master, token=token, tls_ca=tls_ca, timeout=timeout, etcd_access=etcd_access,
                                        shard=shard)
            except MasterUnreachable as exc:
                failed(f"cannot reach the master of shard {shard} at {master}: {exc.code}")
            else:
                entry["cluster"] = status_fields(label, status)
                tables.append(render_status(label, status))
            shard_reports.append(entry)
        report["shards"] = shard_reports
        report["cluster"] = shard_reports[0]["cluster"]
    else:
        try:
            status = cluster_status(master, token=token, tls_ca=tls_ca, timeout=timeout, etcd_access=etcd_access)
        except MasterUnreachable as exc:
            failed(f"cannot reach the master at {master}: {exc.code}")
        else:
            report["cluster"] = status_fields(master, status)
            tables.append(render_status(master, status))
    if prometheus:
        try:
            rates = fetch_dashboard_rates(prometheus, timeout)
        except (OSError, ValueError) as exc:
            failed(f"cannot read Prometheus at {prometheus}: {exc}")
        else:
            report["prometheus"] = rates_fields(prometheus, rates)
            tables.append(render_dashboard_rates(prometheus, rates))
    return done()
