"""WorkerService: a worker as the others see it.

Its NATS micro service (``tandem-<role>``, with ``info``, ``stats`` and ``recent`` endpoints, where `tandem
status` and the routers find it, and ``kv_meta`` on ``tandem.kv.meta.<worker>``, where a prefill worker asks where
this worker's KV goes: per-endpoint request, error and time counts in ``$SRV.STATS``), its load published every ``stats_interval`` on its stats subject, and its
Prometheus gauges, refreshed before each report; and its answers to a receiver that missed some of what it
published and asks for it again (``bus.replay``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Coroutine
from typing import Any, Protocol

import nats.micro
from nats.aio.msg import Msg

from actors.recent import RecentWork
from bus.control_messages import Replay
from bus.prefill_messages import KVMetaReply
from bus.publish import publish
from bus.replay import SentLog
from bus.stats_messages import WorkerStats
from bus.subjects import Subjects
from bus.wire import MessageError, PayloadTooLarge, check_payload, decode, encode
from engine import native
from engine.engine import LLMEngine
from kv.layout import KVLayout
from kv.transfer.base import TransferEngine
from runtime import metrics
from runtime.logs import Throttled
from runtime.placement import available_cpus, format_cpus
from runtime.settings import Settings

log = logging.getLogger(__name__)
#: bad replay requests can come at the rate of a flood: one log line per minute
bad_replays = Throttled(log)
VERSION = "0.1.0"


class Worker(Protocol):
    """What a WorkerService reads of its worker (`actors.base.WorkerActor`)."""

    nc: Any
    s: Settings
    role: str
    model: str
    worker_id: str
    incarnation: str
    subjects: Subjects
    engine: LLMEngine
    layout: KVLayout
    transfer: TransferEngine
    recent: RecentWork
    started: float
    draining: bool
    sent: SentLog

    def stats(self) -> WorkerStats: ...

    def spawn(self, coro: Coroutine) -> asyncio.Task: ...


class WorkerService:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        s = worker.s
        self.metrics_url = f"http://{s.advertise_host}:{s.metrics_port}/metrics" if s.metrics_port else ""
        self.micro: nats.micro.Service | None = None
        self._preemptions_seen = self._drafted_seen = self._accepted_seen = 0

    def metadata(self) -> dict[str, str]:
        w = self.worker
        return {
            "model": w.model, "role": w.role, "worker_id": w.worker_id, "host": socket.gethostname(),
            "incarnation": w.incarnation, "layout_fingerprint": w.layout.fingerprint(),
            "layout": w.layout.describe(), "metrics_url": self.metrics_url,
            "kv_transfer": w.transfer.name, "started": str(w.started), "restarts": str(w.s.restarts),
            "device": w.s.device, "cpus": format_cpus(available_cpus()), "threads": str(w.s.threads),
            "kernels": native.kernel_path(),
        }

    async def start(self) -> None:
        """Register the micro service and its endpoints (before the worker takes work that may ask them)."""
        w = self.worker
        self.micro = await nats.micro.add_service(
            w.nc, name=f"tandem-{w.role.replace('_', '-')}", version=VERSION,
            description=f"tandem {w.role} worker for {w.model}", metadata=self.metadata(),
        )

        async def info(req: nats.micro.Request) -> None:
            await req.respond(json.dumps({**self.metadata(), "layout_dict": w.layout.to_dict()}).encode())

        async def stats(req: nats.micro.Request) -> None:
            await req.respond(encode(w.stats()))

        async def recent(req: nats.micro.Request) -> None:
            await req.respond(w.recent.to_json(w.transfer.paths()))

        async def kv_meta(req: nats.micro.Request) -> None:
            """Where a prefill worker writes this worker's KV: its transfer engine's metadata."""
            data = encode(KVMetaReply(worker_id=w.worker_id, incarnation=w.incarnation, engine=w.transfer.name,
                                      meta=w.transfer.metadata()))
            try:
                check_payload(data, w.nc.max_payload, req.subject)
            except PayloadTooLarge as e:  # the asking worker gets this, not a timeout
                log.error("cannot send my KV transfer metadata: %s", e)
                await req.respond_error("413", f"worker {w.worker_id}'s KV transfer metadata: {e}")
                return
            await req.respond(data)

        for name, handler in (("info", info), ("stats", stats), ("recent", recent)):
            await self.micro.add_endpoint(name=name, subject=w.subjects.service(w.worker_id, name), handler=handler)
        await self.micro.add_endpoint(name="kv_meta", subject=w.subjects.kv_meta(w.worker_id), handler=kv_meta)

    def load(self) -> WorkerStats:
        """What every role reports of itself (its engine's load, its process, its settings); roles add their own."""
        w = self.worker
        e = w.engine
        return WorkerStats(
            role=w.role, worker_id=w.worker_id, model=w.model, running=e.num_running,
            queued=e.num_waiting, free_blocks=e.token_blocks(e.blocks.num_free),
            total_blocks=e.token_blocks(e.blocks.num_blocks),
            prefix_hit_rate=e.blocks.hit_rate(), uptime=time.time() - w.started,
            incarnation=w.incarnation, max_batch=w.s.max_batch, draining=w.draining,
            prefix_cache=w.s.enable_prefix_cache, kernels=native.kernel_path(),
        )

    async def answer_replay(self, msg: Msg) -> None:
        """A receiver missed messages of a key this worker may have sent: publish them again, as they were."""
        w = self.worker
        try:
            ask = decode(msg.data, Replay)
        except MessageError as e:
            bad_replays.warning("replay", "ignoring a bad replay request on %s: %s", msg.subject, e)
            return
        kept = w.sent.since(ask.key, ask.from_seq)
        if kept is None:
            return  # not ours, or over long ago
        messages, whole = kept
        if not whole:
            log.warning("%s asks for %s from message %d, older than what is kept here", ask.requester or "someone",
                        ask.key, ask.from_seq)
        for subject, data, hdrs in messages:
            await w.nc.publish(subject, data, headers=hdrs)
        metrics.REPLAYED.labels(w.role).inc(len(messages))
        log.info("published %d message(s) of %s again from %d for %s", len(messages), ask.key, ask.from_seq,
                 ask.requester or "someone")

    def report_load(self) -> None:
        """Publish the worker's load every ``stats_interval`` from now: routers send it work once they hear it."""
        self.worker.spawn(self._report())

    async def stop(self) -> None:
        if self.micro is not None:
            await self.micro.stop()

    async def _report(self) -> None:
        w = self.worker
        subject = w.subjects.stats(w.role, w.worker_id)
        while True:
            self.update_gauges()
            try:
                await publish(w.nc, subject, w.stats())
            except Exception as e:  # the bus is reconnecting; the next tick tries again
                log.warning("stats publish failed: %s", e)
            await asyncio.sleep(w.s.stats_interval)

    def update_gauges(self) -> None:
        e, role = self.worker.engine, self.worker.role
        metrics.RUNNING.labels(role).set(e.num_running)
        metrics.WAITING.labels(role).set(e.num_waiting)
        quarantined, groups = len(e.blocks.quarantined), e.layout.num_groups  # in blocks of every layer
        metrics.KV_BLOCKS.labels(role, "free").set(e.blocks.num_free / groups)
        metrics.KV_BLOCKS.labels(role, "quarantined").set(quarantined / groups)
        metrics.KV_BLOCKS.labels(role, "used").set((e.blocks.num_blocks - e.blocks.num_free - quarantined) / groups)
        metrics.PREFIX_HIT_RATE.labels(role).set(e.blocks.hit_rate())
        preempted = e.scheduler.preemptions
        metrics.PREEMPTIONS.inc(preempted - self._preemptions_seen)
        self._preemptions_seen = preempted
        if e.drafter is not None:
            metrics.SPEC_DRAFT_TOKENS.inc(e.drafter.drafted - self._drafted_seen)
            metrics.SPEC_ACCEPTED_TOKENS.inc(e.drafter.accepted - self._accepted_seen)
            self._drafted_seen, self._accepted_seen = e.drafter.drafted, e.drafter.accepted
