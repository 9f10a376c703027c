"""Who is on the bus: every worker found through NATS micro discovery, with its load and recent work.

Why micro discovery: each worker registers as a NATS micro service (``tandem-prefill-only``,
``tandem-decode-only``, ``tandem-prefill-and-decode``) whose metadata names its model, role,
worker id, host and metrics URL, with a ``stats`` endpoint answering its current load and a
``recent`` endpoint its latest KV transfers and prefill decisions. One ``$SRV.INFO`` request
reaches every live worker of every model, with no registry to keep: a worker that is gone simply
does not answer. Replies are collected for a short window (``wait``), then every worker's
endpoints are asked in parallel (with a deadline). The pool backlogs (JetStream pending / in
flight) of each model seen are added when the user may read them.

``tandem status`` prints what :func:`collect` finds; the gateway's ``/cluster`` (the page's cluster
view) serves the same, so the two cannot disagree.
"""

from __future__ import annotations

import asyncio
import json
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
    host: str = ""
    kv_transfer: str = ""
    layout: str = ""
    device: str = ""
    cpus: str = ""
    threads: int | None = None
    kernels: str = ""  # engine.native.kernel_path() of the worker
    started: float | None = None
    restarts: int = 0
    running: int | None = None
    queued: int | None = None
    max_batch: int | None = None
    free_blocks: int | None = None
    total_blocks: int | None = None
    prefix_hit_rate: float | None = None
    uptime: float | None = None
    draining: bool | None = None
    prefill_workers: int | None = None  # decode_only: the prefill workers it counts alive
    stats_subject: str = ""
    stats_error: str | None = None
    recent_subject: str = ""

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
    #: the workers' latest KV transfers and prefill decisions (``recent=True``), newest first
    transfers: list[dict[str, Any]] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    #: transfers the workers counted since they started
    transfers_total: int = 0
    #: KV paths in use: {"from", "to", "engine"} (the writer's choice of mechanism for each peer)
    paths: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (workers carry ``used_blocks`` too)."""
        workers = [{**asdict(w), "used_blocks": w.used_blocks} for w in self.workers]
        return {"nats_url": self.nats_url, "namespace": self.namespace, "workers": workers,
                "pools": [asdict(p) for p in self.pools], "autoscale": self.autoscale,
                "transfers": self.transfers, "decisions": self.decisions, "transfers_total": self.transfers_total,
                "paths": self.paths}


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
    subjects = {e.get("name"): e.get("subject", "") for e in info.get("endpoints") or []}
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
        host=md.get("host", ""),
        kv_transfer=md.get("kv_transfer", ""),
        layout=md.get("layout", ""),
        device=md.get("device", ""),
        cpus=md.get("cpus", ""),
        threads=int(md["threads"]) if str(md.get("threads", "")).isdigit() else None,
        kernels=md.get("kernels", ""),
        started=started,
        restarts=int(md["restarts"]) if str(md.get("restarts", "")).isdigit() else 0,
        stats_subject=subjects.get("stats", ""),
        recent_subject=subjects.get("recent", ""),
    )


async def _fill_stats(nc: Any, w: WorkerStatus, timeout: float) -> None:
    """Ask one worker's ``stats`` endpoint; on failure keep the worker, with the reason."""
    import nats.errors

    from bus.stats_messages import WorkerStats
    from bus.wire import MessageError, decode

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
    w.prefix_hit_rate, w.uptime, w.draining = st.prefix_hit_rate, st.uptime, st.draining
    if st.role == "decode_only":
        w.prefill_workers = st.prefill_workers
    if not w.incarnation:
        w.incarnation = st.incarnation


async def _recent(nc: Any, w: WorkerStatus, timeout: float) -> dict[str, Any]:
    """A worker's ``recent`` endpoint: ``{"transfers": [...], "decisions": [...], "transfers_total": n}``
    (empty when it has none or does not answer in time)."""
    import nats.errors

    if not w.recent_subject:
        return {}
    try:
        reply = await nc.request(w.recent_subject, b"", timeout=timeout)
        recent = json.loads(reply.data)
    except (nats.errors.Error, asyncio.TimeoutError, ValueError):
        return {}
    return recent if isinstance(recent, dict) else {}


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

    from bus.stats_messages import AutoscaleState
    from bus.subjects import Subjects
    from bus.wire import MessageError, decode

    try:
        reply = await nc.request(Subjects("x", namespace).autoscale_state, b"", timeout=timeout)
        state = decode(reply.data, AutoscaleState)
    except (nats.errors.Error, asyncio.TimeoutError, MessageError):  # no scaler here (or not one we read)
        return []
    return [{"scaler": state.scaler, "model": state.model, **msgspec.structs.asdict(r)} for r in state.roles]


async def collect(nc: Any, namespace: str = "tandem", wait: float = 0.5, timeout: float = 2.0,
                  model: str | None = None, pools: bool = True, autoscale: bool = True,
                  recent: bool = True) -> Status:
    """Discover the workers, fetch their stats (and recent work) and the pool backlogs (every wait bounded)."""
    from bus.options import redact_url

    url = nc.connected_url.geturl() if nc.connected_url is not None else "?"
    status = Status(nats_url=redact_url(url), namespace=namespace)
    infos = await discover(nc, namespace, wait)
    workers = [_worker_from_info(i) for i in infos]
    if model:
        from bus.subjects import model_token

        workers = [w for w in workers if w.model and model_token(w.model) == model_token(model)]
    # every worker's endpoints at once: a worker that does not answer costs one timeout, not one per endpoint
    answers = await asyncio.gather(*(_fill_stats(nc, w, timeout) for w in workers),
                                   *(_recent(nc, w, timeout) for w in workers if recent))
    workers.sort(key=lambda w: (w.model, w.role, w.worker_id))
    status.workers = workers
    if recent:
        for found in answers[len(workers):]:
            status.transfers += found.get("transfers") or []
            status.decisions += found.get("decisions") or []
            status.transfers_total += int(found.get("transfers_total") or 0)
            status.paths += found.get("paths") or []
        status.transfers.sort(key=lambda r: r.get("at", 0.0), reverse=True)
        status.decisions.sort(key=lambda r: r.get("at", 0.0), reverse=True)
    if autoscale:
        status.autoscale = await _autoscale(nc, namespace, timeout)
    if pools:
        models = sorted({w.model for w in workers if w.model} | ({model} if model else set()))
        status.pools = await _pools(nc, models, namespace, timeout)
    return status
