"""PrefillWorkers: the model's prefill workers as a decode worker sees them, from their load reports and NATS
micro discovery: which are alive to take a job, and which fell silent long enough to be presumed dead."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from bus.stats_messages import WorkerStats

log = logging.getLogger(__name__)

PREFILL_ALIVE_S = 3.0  # a prefill worker whose stats are older than this is not offered new work
PREFILL_DEAD_S = 5.0  # ... and one silent this long is presumed dead with our job


class PrefillWorkers:
    """The model's prefill workers as their load reports (and NATS micro discovery) show them."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.reports: dict[str, tuple[WorkerStats, float]] = {}  # worker → (last report, when heard)

    def heard(self, st: WorkerStats) -> None:
        self.reports[st.worker_id] = (st, time.monotonic())

    def alive(self) -> dict[str, WorkerStats]:
        """Prefill workers that reported lately and take jobs (a draining one gets none)."""
        now = time.monotonic()
        return {w: st for w, (st, seen) in self.reports.items() if now - seen < PREFILL_ALIVE_S and not st.draining}

    def pause(self, since: float) -> None:
        """This worker heard nothing from ``since`` (monotonic) to now through no fault of theirs (its own NATS
        link was down): count the prefill workers' silence as if that time had not passed."""
        now = time.monotonic()
        gap = now - since
        if gap > 0:
            self.reports = {w: (st, min(now, seen + gap)) for w, (st, seen) in self.reports.items()}

    def silent(self, worker: str) -> bool:
        """Whether ``worker`` (known here) stopped reporting long enough to be presumed dead."""
        heard = self.reports.get(worker)
        return heard is not None and time.monotonic() - heard[1] > PREFILL_DEAD_S

    async def discover(self, nc: Any, wait: float = 0.3) -> None:
        """Ask NATS micro discovery for live prefill workers, so we need not wait for their stats."""
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish("$SRV.INFO.tandem-prefill-only", b"", reply=inbox)
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            try:
                reply = await sub.next_msg(timeout=left)
            except Exception:  # nats TimeoutError: discovery window over
                break
            if not reply.data:  # "no responders" status: nobody registered yet
                break
            md = json.loads(reply.data).get("metadata", {})
            if md.get("model") == self.model and md.get("worker_id"):
                st = WorkerStats(role="prefill_only", worker_id=md["worker_id"], model=self.model)
                self.reports.setdefault(md["worker_id"], (st, time.monotonic()))
        await sub.unsubscribe()
        log.info("discovered prefill workers: %s", ", ".join(self.reports) or "none")
