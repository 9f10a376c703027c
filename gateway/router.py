"""Which decode worker gets a request: prefix-cache affinity first, then least load, else the pool.

Why at the gateway: it already holds the prompt's token ids, so it can name the prompt's
full blocks with the same chained hashes the workers' prefix caches use
(``kv.blocks.prefix_hashes``) and send a request to the worker that most likely still has
them. Load comes from the workers' 1 Hz ``WorkerStats``; requests this gateway sent since a
worker's last report count too, so a burst does not all land on one worker. When no worker
has room (or nothing is known) the request goes to the JetStream pool, which workers pull
only when they have a batch slot and blocks free.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from bus.messages import WorkerStats
from bus.subjects import ROLE_DECODE_ONLY, ROLE_PREFILL_AND_DECODE, ROLE_PREFILL_ONLY

DECODE_ROLES = (ROLE_PREFILL_AND_DECODE, ROLE_DECODE_ONLY)


@dataclass
class WorkerInfo:
    """What the gateway knows of one worker."""

    worker_id: str
    role: str
    stats: WorkerStats
    last_seen: float
    #: requests this gateway sent it since its last stats report
    sent_since_report: int = 0
    #: block hashes of prompts it served, most recent last (bounded LRU)
    blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    @property
    def load(self) -> int:
        """Running + queued as last reported, plus what was sent since."""
        return self.stats.running + self.stats.queued + self.sent_since_report

    def has_room(self, blocks_needed: int) -> bool:
        """A batch slot and (roughly) the blocks for the uncached part of the prompt."""
        s = self.stats
        if s.max_batch and self.load >= s.max_batch:
            return False
        return not (s.total_blocks and s.free_blocks < blocks_needed)

    def matched_blocks(self, hashes: list[bytes]) -> int:
        """How many leading blocks of the prompt it probably has cached."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n


@dataclass(frozen=True)
class Route:
    """A routing decision: a worker id, or None for the pool; why (for logs and tests)."""

    worker_id: str | None
    reason: str
    matched_blocks: int = 0


class WorkerRegistry:
    """Live workers of one model, fed by ``tandem.stats.>``; picks a decode worker per request."""

    def __init__(
        self,
        model_token: str,
        *,
        alive_after: float = 3.0,
        forget_after: float = 60.0,
        max_hashes_per_worker: int = 16384,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.model_token = model_token
        self.alive_after = alive_after
        self.forget_after = forget_after
        self.max_hashes = max_hashes_per_worker
        self.clock = clock
        self.rng = rng or random.Random()
        self.workers: dict[str, WorkerInfo] = {}

    # ---- stats -------------------------------------------------------------------------
    def observe(self, stats: WorkerStats, same_model: bool = True) -> None:
        """Record a worker's report (reports for another model are ignored)."""
        if not same_model:
            return
        now = self.clock()
        info = self.workers.get(stats.worker_id)
        if info is None or info.role != stats.role or (
            stats.incarnation and info.stats.incarnation and stats.incarnation != info.stats.incarnation
        ):
            # new worker, or the same id restarted: its cache is empty
            self.workers[stats.worker_id] = WorkerInfo(stats.worker_id, stats.role, stats, now)
            return
        info.stats = stats
        info.last_seen = now
        info.sent_since_report = 0

    def prune(self) -> None:
        """Forget workers silent for ``forget_after`` seconds."""
        cutoff = self.clock() - self.forget_after
        for wid in [w for w, i in self.workers.items() if i.last_seen < cutoff]:
            del self.workers[wid]

    def alive(self, roles: tuple[str, ...] = DECODE_ROLES) -> list[WorkerInfo]:
        """Workers of ``roles`` heard from within ``alive_after`` seconds and taking work (not draining)."""
        cutoff = self.clock() - self.alive_after
        return [i for i in self.workers.values()
                if i.role in roles and i.last_seen >= cutoff and not i.stats.draining]

    def is_alive(self, worker_id: str, within: float | None = None) -> bool:
        """Whether ``worker_id`` reported within ``within`` (default ``alive_after``) seconds (draining or not)."""
        info = self.workers.get(worker_id)
        window = self.alive_after if within is None else within
        return info is not None and info.last_seen >= self.clock() - window

    def prefill_workers(self) -> list[WorkerInfo]:
        """Live prefill-only workers (for ``/ready`` details and ``target_endpoint`` checks)."""
        return self.alive((ROLE_PREFILL_ONLY,))

    # ---- routing -----------------------------------------------------------------------
    def choose(self, hashes: list[bytes], prompt_blocks: int, exclude: frozenset[str] = frozenset()) -> Route:
        """Pick a worker for a prompt whose full blocks hash to ``hashes``.

        The live worker with room holding the longest cached prefix wins (least load breaks
        ties); with no cached prefix anywhere, the least loaded worker with room; with none
        having room, the pool. Workers in ``exclude`` (e.g. one that just went silent) are skipped.
        """
        live = [w for w in self.alive() if w.worker_id not in exclude]
        if not live:
            return Route(None, "no live worker")
        scored = []
        for w in live:
            matched = w.matched_blocks(hashes)
            if w.has_room(max(0, prompt_blocks - matched) + 1):
                scored.append((matched, w))
        if not scored:
            return Route(None, "every worker is full")
        best_match = max(m for m, _ in scored)
        pool = [w for m, w in scored if m == best_match]
        least = min(w.load for w in pool)
        pick = self.rng.choice([w for w in pool if w.load == least])
        reason = "prefix affinity" if best_match else "least loaded"
        return Route(pick.worker_id, reason, best_match)

    def dispatched(self, worker_id: str | None, hashes: list[bytes]) -> None:
        """A request (with these block hashes) went to ``worker_id``: count it, remember its blocks."""
        if worker_id is None:
            return
        info = self.workers.get(worker_id)
        if info is None:
            return
        info.sent_since_report += 1
        self.remember(worker_id, hashes)

    def remember(self, worker_id: str, hashes: list[bytes]) -> None:
        """``worker_id`` now holds these prompt blocks in its prefix cache (LRU-bounded)."""
        info = self.workers.get(worker_id)
        if info is None:
            return
        for h in hashes:
            info.blocks[h] = None
            info.blocks.move_to_end(h)
        while len(info.blocks) > self.max_hashes:
            info.blocks.popitem(last=False)

    def incarnation(self, worker_id: str) -> str:
        """The process id ``worker_id`` last reported ("" if unknown): it changes when the worker restarts."""
        info = self.workers.get(worker_id)
        return info.stats.incarnation if info is not None else ""

    def summary(self) -> list[dict[str, object]]:
        """Live workers as plain dicts (``/ready``)."""
        now = self.clock()
        out = []
        for i in sorted(self.workers.values(), key=lambda i: i.worker_id):
            s = i.stats
            out.append({
                "worker_id": i.worker_id,
                "role": i.role,
                "age_s": round(now - i.last_seen, 2),
                "running": s.running,
                "queued": s.queued,
                "free_blocks": s.free_blocks,
                "total_blocks": s.total_blocks,
                "max_batch": s.max_batch,
                "draining": s.draining,
            })
        return out
