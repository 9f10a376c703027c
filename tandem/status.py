"""``tandem status``: every worker on the bus, found through NATS micro discovery (``bus/discovery.py``,
which the gateway's ``/cluster`` and so the page use too).

    tandem status                    # a table
    tandem status --json             # {"nats_url", "namespace", "workers", "pools", "transfers", "decisions", ...}

Exit status: 0 (also when no worker answered: the list is empty), 1 when NATS is unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from bus.discovery import Status, WorkerStatus, collect

# ---------------------------------------------------------------------------------------- text


def format_duration(seconds: float | None) -> str:
    """``42s``, ``3m05s``, ``2h03m``, ``4d02h``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def _load(w: WorkerStatus) -> str:
    if w.running is None:
        return "-"
    cap = f"/{w.max_batch}" if w.max_batch else ""
    sees = f" ({w.prefill_workers} prefill)" if w.prefill_workers is not None else ""
    return f"{w.running}{cap} +{w.queued or 0}{sees}"


def _blocks(w: WorkerStatus) -> str:
    if w.total_blocks is None or w.used_blocks is None:
        return "-"
    pct = 100.0 * w.used_blocks / w.total_blocks if w.total_blocks else 0.0
    return f"{w.used_blocks}/{w.total_blocks} ({pct:.0f}%)"


def _placement(w: WorkerStatus) -> str:
    if not (w.cpus or w.device):
        return "-"
    parts = [w.device] if w.device and w.device != "cpu" else []
    if w.cpus:
        parts.append(f"cores {w.cpus}" + (f" ×{w.threads}" if w.threads else ""))
    if w.kernels:
        parts.append(w.kernels)
    return " ".join(parts)


def format_table(status: Status) -> str:
    """The human-readable report."""
    n = len(status.workers)
    lines = [f"NATS {status.nats_url}, namespace {status.namespace}: {n} worker{'s' if n != 1 else ''}"]
    if status.workers:
        header = ("ROLE", "MODEL", "WORKER", "HOST", "LOAD", "BLOCKS USED", "HIT", "UPTIME", "RESTARTS", "KV",
                  "PLACEMENT", "METRICS")
        rows = [header]
        for w in status.workers:
            hit = f"{100.0 * w.prefix_hit_rate:.0f}%" if w.prefix_hit_rate is not None else "-"
            metrics = w.metrics_url or "-"
            if w.stats_error:
                metrics += f"  (stats: {w.stats_error})"
            rows.append((w.role, w.model, w.worker_id, w.host or "-", _load(w), _blocks(w), hit, format_duration(w.uptime),
                         str(w.restarts), w.kv_transfer or "-", _placement(w), metrics))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
        for r in rows:
            lines.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(r[:-1])) + "  " + r[-1])
        lines.append("LOAD: running/max batch +queued; BLOCKS USED: KV blocks in use/total; "
                     "RESTARTS: by its supervisor (tandem up); PLACEMENT: device, cores ×torch threads, "
                     "kernel path")
    else:
        lines.append("no tandem worker answered (is one running, on this NATS and namespace?)")
    for path in status.paths:
        lines.append(f"KV path {path['from']} -> {path['to']}: {path['engine']}")
    for a in status.autoscale:
        lines.append(f"autoscale {a['model']} {a['role']}: {a['actual']} running, desired {a['desired']} "
                     f"(range {a['min']}..{a['max']}), demand {a['demand']} (lag {a['lag']}), "
                     f"{a['draining']} draining; last: {a['last_action'] or 'none'} ({a['scaler']})")
    for p in status.pools:
        if p.error:
            lines.append(f"pool {p.model} {p.pool}: unavailable ({p.error})")
        else:
            lines.append(f"pool {p.model} {p.pool}: {p.pending} pending, {p.in_flight} in flight "
                         f"(stream {p.stream}, consumer {p.consumer})")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- CLI


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``tandem status`` flags to ``p``."""
    p.add_argument("--nats-url", default=None, help="NATS URL(s), comma-separated (default TANDEM_NATS_URL)")
    p.add_argument("--namespace", default=None, help="subject namespace (default TANDEM_NAMESPACE or tandem)")
    p.add_argument("--model", default=None, help="only workers (and pools) of this model")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--wait", type=float, default=0.5, help="seconds to collect discovery replies (default 0.5)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to reach NATS (default 5)")
    p.add_argument("--no-pools", dest="pools", action="store_false", help="skip the JetStream pool backlogs")
    p.set_defaults(func=main)
    return p


async def _run(args: argparse.Namespace) -> int:
    from tandem.local_run import CliConnectError, connect_for_cli

    namespace = args.namespace or os.environ.get("TANDEM_NAMESPACE") or "tandem"
    try:
        nc, _ = await connect_for_cli(args.nats_url, args.timeout, "tandem-status")
    except CliConnectError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    try:
        status = await collect(nc, namespace, wait=args.wait, timeout=min(2.0, args.timeout),
                               model=args.model, pools=args.pools)
    finally:
        await nc.close()
    if args.json:
        print(json.dumps(status.to_json(), indent=2))
    else:
        print(format_table(status))
    return 0


def main(args: argparse.Namespace) -> int:
    """Run ``tandem status`` with parsed flags."""
    try:
        return asyncio.run(_run(args))
    except KeyboardInterrupt:
        return 130
