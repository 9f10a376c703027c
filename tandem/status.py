"""``tandem status``: every worker on the bus, found through NATS micro discovery.

Why micro discovery: each worker registers as a NATS micro service (``tandem-prefill-only``,
``tandem-decode-only``, ``tandem-prefill-and-decode``) whose metadata names its model, role,
worker id and metrics URL, with a ``stats`` endpoint answering its current load. One
``$SRV.INFO`` request reaches every live worker of every model, with no registry to keep:
a worker that is gone simply does not answer. Replies are collected for a short window
(``--wait``), then every worker's ``stats`` endpoint is asked in parallel (with a deadline).
The pool backlogs (JetStream pending / in flight) of each model seen are added when the
user may read them.

    tandem status                    # a table
    tandem status --json             # {"nats_url", "namespace", "workers": [...], "pools": [...]}

Exit status: 0 (also when no worker answered: the list is empty), 1 when NATS is unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

SERVICE_PREFIX = "tandem-"
INFO_SUBJECT = "$SRV.INFO"


@dataclass
class WorkerStatus:
    """One worker as ``tandem status`` reports it (service metadata plus its latest stats)."""

    role: str
    model: str
    worker_id: str
    service: str
    service_id: str
    version: str = ""
    incarnation: str = ""
    metrics_url: str = ""
    kv_transfer: str = ""
    layout: str = ""
    device: str = ""
    cpus: str = ""
    threads: int | None = None
    started: float | None = None
    restarts: int = 0
    running: int | None = None
    queued: int | None = None
    max_batch: int | None = None
    free_blocks: int | None = None
    total_blocks: int | None = None
    prefix_hit_rate: float | None = None
    uptime: float | None = None
    stats_subject: str = ""
    stats_error: str | None = None

    @property
    def used_blocks(self) -> int | None:
        """Blocks in use, when the stats answered."""
        if self.total_blocks is None or self.free_blocks is None:
            return None
        return self.total_blocks - self.free_blocks


@dataclass
class PoolStatus:
    """The backlog of one model's work queue (what KEDA scales on)."""

    model: str
    pool: str
    stream: str
    consumer: str
    pending: int | None = None
    in_flight: int | None = None
    error: str | None = None


@dataclass
class Status:
    """Everything ``tandem status`` found."""

    nats_url: str
    namespace: str
    workers: list[WorkerStatus] = field(default_factory=list)
    pools: list[PoolStatus] = field(default_factory=list)
    #: what a local autoscaler (``tandem up --autoscale``) answered, per role; empty without one
    autoscale: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (workers carry ``used_blocks`` too)."""
        workers = [{**asdict(w), "used_blocks": w.used_blocks} for w in self.workers]
        return {"nats_url": self.nats_url, "namespace": self.namespace, "workers": workers,
                "pools": [asdict(p) for p in self.pools], "autoscale": self.autoscale}


def _is_no_responders(msg: Any) -> bool:
    """The server's 503 status reply: nobody subscribes to the subject."""
    hdrs = getattr(msg, "headers", None) or {}
    return not msg.data and hdrs.get("Status") == "503"


async def discover(nc: Any, namespace: str, wait: float) -> list[dict[str, Any]]:
    """Every tandem micro service of ``namespace`` answering ``$SRV.INFO`` within ``wait`` seconds."""
    import nats.errors

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    found: list[dict[str, Any]] = []
    try:
        await nc.publish(INFO_SUBJECT, b"", reply=inbox)
        await nc.flush(timeout=max(1.0, wait))
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                break
            if _is_no_responders(msg):
                break
            try:
                info = json.loads(msg.data)
            except ValueError:
                continue
            if not str(info.get("name", "")).startswith(SERVICE_PREFIX):
                continue
            endpoints = info.get("endpoints") or []
            if not any(str(e.get("subject", "")).startswith(f"{namespace}.svc.") for e in endpoints):
                continue  # another namespace's worker
            found.append(info)
    finally:
        await sub.unsubscribe()
    return found


def _worker_from_info(info: dict[str, Any]) -> WorkerStatus:
    md = info.get("metadata") or {}
    stats_subject = next((e.get("subject", "") for e in info.get("endpoints") or [] if e.get("name") == "stats"), "")
    started: float | None
    try:
        started = float(md["started"]) if md.get("started") else None
    except ValueError:
        started = None
    return WorkerStatus(
        role=md.get("role", info.get("name", "")[len(SERVICE_PREFIX):].replace("-", "_")),
        model=md.get("model", ""),
        worker_id=md.get("worker_id", ""),
        service=info.get("name", ""),
        service_id=info.get("id", ""),
        version=info.get("version", ""),
        incarnation=md.get("incarnation", ""),
        metrics_url=md.get("metrics_url", ""),
        kv_transfer=md.get("kv_transfer", ""),
        layout=md.get("layout", ""),
        device=md.get("device", ""),
        cpus=md.get("cpus", ""),
        threads=int(md["threads"]) if str(md.get("threads", "")).isdigit() else None,
        started=started,
        restarts=int(md["restarts"]) if str(md.get("restarts", "")).isdigit() else 0,
        stats_subject=stats_subject,
    )


async def _fill_stats(nc: Any, w: WorkerStatus, timeout: float) -> None:
    """Ask one worker's ``stats`` endpoint; on failure keep the worker, with the reason."""
    import nats.errors

    from bus.messages import MessageError, WorkerStats, decode

    if not w.stats_subject:
        w.stats_error = "no stats endpoint"
        return
    try:
        reply = await nc.request(w.stats_subject, b"", timeout=timeout)
        st = decode(reply.data, WorkerStats)
    except (nats.errors.Error, asyncio.TimeoutError) as e:
        w.stats_error = f"{type(e).__name__}: {e}".rstrip(": ")
        return
    except MessageError as e:
        w.stats_error = str(e)
        return
    w.running, w.queued, w.max_batch = st.running, st.queued, st.max_batch
    w.free_blocks, w.total_blocks = st.free_blocks, st.total_blocks
    w.prefix_hit_rate, w.uptime = st.prefix_hit_rate, st.uptime
    if not w.incarnation:
        w.incarnation = st.incarnation


async def _pools(nc: Any, models: list[str], namespace: str, timeout: float) -> list[PoolStatus]:
    """Backlog of the generate and prefill pools of each model (None + error where unreadable)."""
    import nats.errors
    from nats.js.errors import APIError

    from bus.streams import pool_backlog, pool_names
    from bus.subjects import Subjects

    out: list[PoolStatus] = []
    for model in models:
        subjects = Subjects(model, namespace)
        for pool in ("generate", "prefill"):
            stream, consumer, _ = pool_names(subjects, pool)
            ps = PoolStatus(model=model, pool=pool, stream=stream, consumer=consumer)
            try:
                ps.pending, ps.in_flight = await pool_backlog(nc, subjects, pool, timeout=timeout)
            except (APIError, nats.errors.Error, asyncio.TimeoutError) as e:
                ps.error = getattr(e, "description", None) or f"{type(e).__name__}: {e}".rstrip(": ")
            out.append(ps)
    return out


async def _autoscale(nc: Any, namespace: str, timeout: float) -> list[dict[str, Any]]:
    """The local autoscaler's roles (desired, actual, demand), or [] when none answers."""
    import msgspec
    import nats.errors

    from bus.messages import AutoscaleState, MessageError, decode
    from bus.subjects import Subjects

    try:
        reply = await nc.request(Subjects("x", namespace).autoscale_state, b"", timeout=timeout)
        state = decode(reply.data, AutoscaleState)
    except (nats.errors.Error, asyncio.TimeoutError, MessageError):  # no scaler here (or not one we read)
        return []
    return [{"scaler": state.scaler, "model": state.model, **msgspec.structs.asdict(r)} for r in state.roles]


async def collect(nc: Any, namespace: str = "tandem", wait: float = 0.5, timeout: float = 2.0,
                  model: str | None = None, pools: bool = True) -> Status:
    """Discover the workers, fetch their stats and the pool backlogs (every wait bounded)."""
    from bus.connection import redact_url

    url = nc.connected_url.geturl() if nc.connected_url is not None else "?"
    status = Status(nats_url=redact_url(url), namespace=namespace)
    infos = await discover(nc, namespace, wait)
    workers = [_worker_from_info(i) for i in infos]
    if model:
        from bus.subjects import model_token

        workers = [w for w in workers if w.model and model_token(w.model) == model_token(model)]
    await asyncio.gather(*(_fill_stats(nc, w, timeout) for w in workers))
    workers.sort(key=lambda w: (w.model, w.role, w.worker_id))
    status.workers = workers
    status.autoscale = await _autoscale(nc, namespace, timeout)
    if pools:
        models = sorted({w.model for w in workers if w.model} | ({model} if model else set()))
        status.pools = await _pools(nc, models, namespace, timeout)
    return status


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
    return f"{w.running}{cap} +{w.queued or 0}"


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
    return " ".join(parts)


def format_table(status: Status) -> str:
    """The human-readable report."""
    n = len(status.workers)
    lines = [f"NATS {status.nats_url}, namespace {status.namespace}: {n} worker{'s' if n != 1 else ''}"]
    if status.workers:
        header = ("ROLE", "MODEL", "WORKER", "LOAD", "BLOCKS USED", "HIT", "UPTIME", "RESTARTS", "KV", "PLACEMENT",
                  "METRICS")
        rows = [header]
        for w in status.workers:
            hit = f"{100.0 * w.prefix_hit_rate:.0f}%" if w.prefix_hit_rate is not None else "-"
            metrics = w.metrics_url or "-"
            if w.stats_error:
                metrics += f"  (stats: {w.stats_error})"
            rows.append((w.role, w.model, w.worker_id, _load(w), _blocks(w), hit, format_duration(w.uptime),
                         str(w.restarts), w.kv_transfer or "-", _placement(w), metrics))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
        for r in rows:
            lines.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(r[:-1])) + "  " + r[-1])
        lines.append("LOAD: running/max batch +queued; BLOCKS USED: KV blocks in use/total; "
                     "RESTARTS: by its supervisor (tandem up); PLACEMENT: device, cores ×torch threads")
    else:
        lines.append("no tandem worker answered (is one running, on this NATS and namespace?)")
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
