"""``kvpool status``: a readable table of nodes, tier usage and capacity, and hit rates."""

from __future__ import annotations

import sys

import grpc

from kvpool.v1 import master_pb2, master_pb2_grpc

_TIER_NAMES = {0: "HBM", 1: "DRAM", 2: "SSD"}


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:5.1f}%" if whole else "    -"


def render_status(master: str, status: master_pb2.ClusterStatusResponse) -> str:
    """The table ``kvpool status`` prints for one ClusterStatus reply."""
    lines = [
        f"kvpool master {master}: {len(status.nodes)} node(s), {status.indexed_blocks} blocks indexed, "
        f"{status.workers} worker(s) holding {status.hbm_blocks} blocks in HBM",
        "",
    ]
    header = f"{'NODE':<24} {'ADDRESS':<22} {'HEARTBEAT':>10}  {'DRAM used / capacity':<32} {'SSD used / capacity':<32}"
    lines.append(header)
    for node in status.nodes:
        tiers = {t.tier: t for t in node.tiers}
        cells = []
        for tier in (1, 2):
            t = tiers.get(tier)
            if t is None or not t.capacity_bytes:
                cells.append("-")
            else:
                cells.append(f"{human_bytes(t.used_bytes)} / {human_bytes(t.capacity_bytes)} "
                             f"({_percent(t.used_bytes, t.capacity_bytes).strip()}, {t.blocks} blk)")
        lines.append(f"{node.node.node_id:<24} {node.node.address:<22} {node.seconds_since_heartbeat:>8.1f}s  "
                     f"{cells[0]:<32} {cells[1]:<32}")
    if not status.nodes:
        lines.append("(no nodes registered)")
    asked = status.requested_blocks
    hits = status.hit_blocks_hbm + status.hit_blocks_dram + status.hit_blocks_ssd
    lines += [
        "",
        f"hit rate since the master started ({status.lookups} lookups, {asked} blocks asked for):",
        f"  HBM {_percent(status.hit_blocks_hbm, asked)}   DRAM {_percent(status.hit_blocks_dram, asked)}   "
        f"SSD {_percent(status.hit_blocks_ssd, asked)}   overall {_percent(hits, asked)}",
    ]
    return "\n".join(lines)


def run_status(master: str, timeout: float = 3.0) -> int:
    """Print the status table; 1 with a message if the master cannot be reached."""
    try:
        with grpc.insecure_channel(master) as channel:
            reply = master_pb2_grpc.MasterStub(channel).ClusterStatus(master_pb2.ClusterStatusRequest(), timeout=timeout)
    except grpc.RpcError as exc:
        print(f"kvpool status: cannot reach the master at {master}: {exc.code().name}", file=sys.stderr)
        return 1
    print(render_status(master, reply))
    return 0
