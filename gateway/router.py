"""Which decode worker gets a request: the one that would do the least work for it, else the pool.

Why at the gateway: it already holds the prompt's token ids, so it can name the prompt's
full blocks with the same chained hashes the workers' prefix caches use
(``kv.blocks.prefix_hashes``) and tell which worker most likely still has them.

The cost of a worker is Dynamo's KV-router cost: the prompt blocks it would have to prefill
(those not cached there) plus ``load_weight`` × the KV blocks it would then hold for running
requests (its decode load). So a long cached prefix attracts its requests until that worker
is busier by about as many blocks as the prefix saves, while chats that share only the chat
template's system prompt (one block) spread by load — the longest match alone sent a burst of
them all to one worker. Load comes from the workers' 1 Hz ``WorkerStats`` (blocks in use,
running, queued); requests this gateway sent or saw end since a worker's last report adjust
it, so a burst does not all land on one worker. Ties go to the longer cached prefix, then to
fewer requests, then by chance. When no worker has room (or nothing is known) the request
goes to the JetStream pool, which workers pull only when they have a batch slot and blocks free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from bus.stats_messages import WorkerStats
from runtime.names import ROLE_DECODE_ONLY, ROLE_PREFILL_AND_DECODE, ROLE_PREFILL_ONLY

log = logging.getLogger("tandem.gateway")

DECODE_ROLES = (ROLE_PREFILL_AND_DECODE, ROLE_DECODE_ONLY)
MAX_IN_FLIGHT = 65536


@dataclass
class WorkerInfo:
    """What the gateway knows of one worker."""

    worker_id: str
    role: str
    stats: WorkerStats
    last_seen: float
    #: requests this gateway sent it since its last stats report, and requests of this gateway that ended there
    sent_since_report: int = 0
    done_since_report: int = 0
    #: KV blocks of the requests sent since the report, less those of requests that ended since
    blocks_since_report: int = 0
    #: block hashes of prompts it served, most recent last (bounded LRU)
    blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    @property
    def load(self) -> int:
        """Running + queued as last reported, plus what was sent since, less what ended since."""
        return max(0, self.stats.running + self.stats.queued + self.sent_since_report - self.done_since_report)

    @property
    def active_blocks(self) -> int:
        """KV blocks held for running requests: as last reported, adjusted by what was sent and ended since."""
        s = self.stats
        return max(0, s.total_blocks - s.free_blocks + self.blocks_since_report)

    def has_room(self, blocks_needed: int) -> bool:
        """A batch slot and (roughly) the blocks for the uncached part of the prompt."""
        s = self.stats
        if s.max_batch and self.load >= s.max_batch:
            return False
        return not (s.total_blocks and s.free_blocks < blocks_needed)

    def matched_blocks(self, hashes: list[bytes]) -> int:
        """How many leading blocks of the prompt it probably has cached (none, for a worker without a prefix
        cache: routing it the same prompt again saves nothing)."""
        if not self.stats.prefix_cache:
            return 0
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
        load_weight: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.model_token = model_token
        self._waiters: list[asyncio.Future[None]] = []  # wait_for: woken by the next report
        self.alive_after = alive_after
        self.forget_after = forget_after
        self.max_hashes = max_hashes_per_worker
        self.load_weight = load_weight
        self.clock = clock
        self.rng = rng or random.Random()
        self.workers: dict[str, WorkerInfo] = {}
        #: requests this gateway routed and that have not ended: request id -> (worker id, blocks counted)
        self.in_flight: OrderedDict[str, tuple[str, int]] = OrderedDict()

    # ---- stats -------------------------------------------------------------------------
    def observe(self, stats: WorkerStats, same_model: bool = True) -> None:
        """Record a worker's report (reports for another model are ignored)."""
        if not same_model:
            return
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()
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
        info.sent_since_report = info.done_since_report = info.blocks_since_report = 0

    async def wait_for(self, condition: Callable[[], bool], timeout: float) -> bool:
        """Until ``condition()`` holds, checked after each report (False after ``timeout`` seconds)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not condition():
            left = deadline - loop.time()
            if left <= 0:
                return False
            fut = loop.create_future()
            self._waiters.append(fut)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(fut, left)
        return True

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

    def last_heard(self) -> float | None:
        """When the latest report of any worker came (None before the first): the gateway's own link is
        suspect when everybody falls silent at once."""
        return max((i.last_seen for i in self.workers.values()), default=None)

    def pause(self, since: float) -> None:
        """This gateway heard nothing from ``since`` to now through no fault of the workers (its own link was
        down): each worker's silence is counted as if that time had not passed, so none is judged lost for
        it, and those alive when the link went down stay routable until they report again."""
        gap = self.clock() - since
        if gap <= 0:
            return
        for info in self.workers.values():
            info.last_seen = min(self.clock(), info.last_seen + gap)

    def prefill_workers(self) -> list[WorkerInfo]:
        """Live prefill-only workers (for ``/ready`` details and ``target_endpoint`` checks)."""
        return self.alive((ROLE_PREFILL_ONLY,))

    # ---- routing -----------------------------------------------------------------------
    def choose(self, hashes: list[bytes], prompt_blocks: int, exclude: frozenset[str] = frozenset()) -> Route:
        """Pick a worker for a prompt of ``prompt_blocks`` blocks whose full blocks hash to ``hashes``.

        Among the live workers with room, the lowest cost wins: uncached prompt blocks +
        ``load_weight`` × (its active blocks + those new ones). Ties: the longer cached prefix,
        then fewer requests, then chance. With no worker having room, the pool. Workers in
        ``exclude`` (e.g. one that just went silent) are skipped.
        """
        live = [w for w in self.alive() if w.worker_id not in exclude]
        if not live:
            return Route(None, "no live worker")
        scored = []
        for w in live:
            matched = w.matched_blocks(hashes)
            new = max(0, prompt_blocks - matched)
            if w.has_room(new + 1):
                scored.append(((new + self.load_weight * (w.active_blocks + new), -matched, w.load), matched, w))
        if not scored:
            return Route(None, "every worker is full")
        best = min(key for key, _, _ in scored)
        matched, pick = self.rng.choice([(m, w) for key, m, w in scored if key == best])
        reason = "prefix affinity" if matched and matched == max(m for _, m, _ in scored) else "least loaded"
        return Route(pick.worker_id, reason, matched)

    def dispatched(self, worker_id: str | None, hashes: list[bytes], prompt_blocks: int = 0,
                   request_id: str = "") -> None:
        """A request (with these block hashes) went to ``worker_id``: count its load, remember its blocks.

        Its blocks not cached there (and one for its output) count as that worker's load until the
        next report, or until :meth:`finished` names ``request_id``.
        """
        if worker_id is None:
            return
        info = self.workers.get(worker_id)
        if info is None:
            return
        blocks = max(0, prompt_blocks - info.matched_blocks(hashes)) + 1
        info.sent_since_report += 1
        info.blocks_since_report += blocks
        if request_id:
            self.in_flight[request_id] = (worker_id, blocks)
            while len(self.in_flight) > MAX_IN_FLIGHT:  # bounded, should an end ever go unreported
                self.in_flight.popitem(last=False)
        self.remember(worker_id, hashes)

    def finished(self, request_id: str) -> None:
        """The request ``request_id`` ended (or was re-sent elsewhere): its worker's load drops at once."""
        wid, blocks = self.in_flight.pop(request_id, ("", 0))
        info = self.workers.get(wid)
        if info is not None:
            info.done_since_report += 1
            info.blocks_since_report -= blocks

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

    async def exclude_after_loss(self, lost: str, dead: str, wait: float, request_id: str) -> frozenset[str]:
        """Whom a job of the lost worker (``lost``, its process ``dead``) may not go to: that worker, unless it
        came back as a new process and no other worker is alive.

        When no other worker is alive, wait for one (up to ``wait`` seconds: ``--worker-wait``, within the
        request's deadline): a supervisor (``tandem up``, Kubernetes) restarts a dead worker in seconds, and the
        stream goes on there.
        """

        def other_alive() -> bool:
            return any(w.worker_id != lost for w in self.alive())

        def restarted() -> bool:
            return bool(dead) and any(w.worker_id == lost and w.stats.incarnation not in ("", dead)
                                      for w in self.alive())

        if not (other_alive() or restarted()) and wait > 0:
            log.warning("request %s: no other decode worker is alive; waiting up to %.0fs for one", request_id,
                        wait, extra={"request_id": request_id})
            await self.wait_for(lambda: other_alive() or restarted(), wait)
        return frozenset() if restarted() and not other_alive() else frozenset({lost})

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
                "kernels": s.kernels,
            })
        return out
