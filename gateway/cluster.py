"""``GET /cluster``: the page's live picture of the split, from the same discovery as ``tandem status --json``.

Why here and not in the page: the gateway already holds a NATS connection and hears every worker's load
reports, so one collection (``bus.discovery.collect``) serves every open page, at most once per
:data:`FRESH_S`. A worker that stopped answering discovery but that this gateway heard before stays in
the list, marked dead, until the registry forgets it; a restarted one answers again and is alive.
Nothing in the answer names a credential or a file: workers, their load, pools, recent transfers and
prefill decisions.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from bus.discovery import Status, collect

if TYPE_CHECKING:
    from gateway.service import Gateway

#: a collection younger than this is served again (every open page asks once a second)
FRESH_S = 0.5
#: discovery replies are gathered this long; endpoints get this long to answer
DISCOVERY_WAIT_S = 0.3
ENDPOINT_TIMEOUT_S = 1.0
#: entries of each recent list in the answer
RECENT_ROWS = 20


class ClusterView:
    """One gateway's cached, single-flight collection of the cluster's state."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self._at = 0.0
        self._last: dict[str, Any] | None = None
        self._running: asyncio.Task[dict[str, Any]] | None = None

    async def get(self) -> dict[str, Any]:
        """The latest picture, collected anew when older than :data:`FRESH_S`."""
        if self._last is not None and time.monotonic() - self._at < FRESH_S:
            return self._last
        if self._running is None or self._running.done():
            self._running = asyncio.create_task(self._collect())
        return await asyncio.shield(self._running)

    async def _collect(self) -> dict[str, Any]:
        gw = self.gw
        status = Status(nats_url="", namespace=gw.bus.subjects.namespace)
        if gw.bus.connected and gw.bus.nc is not None:
            status = await collect(gw.bus.nc, gw.bus.subjects.namespace, wait=DISCOVERY_WAIT_S,
                                   timeout=ENDPOINT_TIMEOUT_S, model=gw.text.name, autoscale=False)
        self._last = self._picture(status)
        self._at = time.monotonic()
        return self._last

    def _picture(self, status: Status) -> dict[str, Any]:
        gw = self.gw
        reg = gw.registry
        now = reg.clock()
        workers = []
        found = set()
        for w in status.workers:
            found.add(w.worker_id)
            workers.append({
                "worker_id": w.worker_id, "role": w.role, "alive": True, "draining": bool(w.draining),
                "host": w.host, "cpus": w.cpus, "device": w.device, "kv_transfer": w.kv_transfer,
                "running": w.running, "queued": w.queued, "used_blocks": w.used_blocks, "free_blocks": w.free_blocks,
                "total_blocks": w.total_blocks, "restarts": w.restarts, "uptime": w.uptime, "silent_s": 0.0,
            })
        for info in reg.workers.values():  # heard before, not answering now
            if info.worker_id in found:
                continue
            silent = now - info.last_seen
            s = info.stats
            workers.append({
                "worker_id": info.worker_id, "role": info.role, "alive": silent < reg.alive_after,
                "draining": s.draining, "host": "", "cpus": "", "device": "", "kv_transfer": "",
                "running": s.running, "queued": s.queued, "used_blocks": s.total_blocks - s.free_blocks,
                "free_blocks": s.free_blocks, "total_blocks": s.total_blocks, "restarts": None, "uptime": s.uptime,
                "silent_s": round(silent, 1),
            })
        workers.sort(key=lambda w: (w["role"], w["worker_id"]))
        return {
            "gateway_id": gw.config.gateway_id,
            "model": gw.served_name,
            "nats_connected": gw.bus.connected,
            "workers": workers,
            "pools": [{"pool": p.pool, "pending": p.pending, "in_flight": p.in_flight, "error": p.error}
                      for p in status.pools],
            "transfers": status.transfers[:RECENT_ROWS],
            "transfers_total": status.transfers_total,
            "decisions": status.decisions[:RECENT_ROWS],
        }
