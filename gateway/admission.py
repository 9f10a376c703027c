"""Admission control: refuse at once (429, ``Retry-After``) what would wait longer than ``max_queue_wait``.

Why at the gateway: a request that cannot start soon is better answered now, while the client can
go elsewhere or back off, than after it waited out the client's own timeout while holding KV blocks
and a place in every queue. The estimate is deliberately simple:

* capacity ``C``: how many requests of this size the live decode workers can hold at once
  (per worker the smaller of its batch slots and its KV blocks over the blocks this request needs:
  its prompt and a typical answer);
* load ``L``: what those workers report running and queued, plus what was sent since their
  last report, plus this gateway's requests still waiting in the pool;
* service time ``S``: how long a request holds its place — an average over finished requests of
  their time to first token when they did not queue plus their decode time; before anything was
  measured it is taken to be ``max_queue_wait`` itself (so a cold cluster admits two waves).

A new request starts at once while ``L < C``; otherwise it waits for ``L + 1 - C`` places to free,
one every ``S / C`` seconds. An expected wait ``(L + 1 - C) * S / C`` above ``max_queue_wait`` is
refused (``n`` choices count ``n`` times). A request that was admitted and still did not start by its ``start_by`` time is dropped
wherever it waits (pool, worker queue) with a 503 and ``Retry-After``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.router import WorkerInfo

#: weight of a new sample in the moving averages
EWMA_ALPHA = 0.2


@dataclass
class Estimate:
    """One admission decision's inputs and outcome (for the 429's message and for tests)."""

    capacity: int
    load: int
    service_s: float
    wait_s: float

    @property
    def retry_after(self) -> int:
        """Seconds after which one place has probably freed up (at least 1, at most 60)."""
        one_place = self.service_s / max(self.capacity, 1)
        return max(1, min(60, math.ceil(one_place)))


class Admission:
    """The service-time averages of one gateway, and the decision for each new request."""

    def __init__(self, max_queue_wait: float) -> None:
        self.max_queue_wait = max_queue_wait
        self.ttft_s: float | None = None  # time to first token of requests that did not queue
        self.decode_s: float | None = None  # first token to finish

    # ---- measurements ------------------------------------------------------------------
    def started(self, ttft_s: float, queued: bool) -> None:
        """A request produced its first token ``ttft_s`` after dispatch; ``queued``: it had to wait for a place."""
        if not queued:
            self.ttft_s = _ewma(self.ttft_s, ttft_s)

    def finished(self, decode_s: float) -> None:
        """A request finished ``decode_s`` after its first token."""
        self.decode_s = _ewma(self.decode_s, decode_s)

    @property
    def service_s(self) -> float:
        """How long one request holds its place (``max_queue_wait`` until something was measured)."""
        if self.decode_s is None:
            return self.max_queue_wait
        return self.decode_s + (self.ttft_s or 0.0)

    # ---- the decision ------------------------------------------------------------------
    def estimate(self, workers: Iterable[WorkerInfo], blocks_needed: int, waiting_in_pool: int,
                 count: int = 1) -> Estimate:
        """The expected wait of ``count`` new requests, each needing ``blocks_needed`` KV blocks."""
        capacity = load = 0
        for w in workers:
            s = w.stats
            slots = s.max_batch or 1
            fit = s.total_blocks // max(blocks_needed, 1) if s.total_blocks else slots
            capacity += max(1, min(slots, fit))
            load += s.running + w.sent_since_report  # a decode worker counts its queued requests as running
        load += waiting_in_pool
        over = load + count - capacity
        wait = 0.0 if over <= 0 or capacity == 0 else over * self.service_s / capacity
        return Estimate(capacity, load, self.service_s, wait)

    def too_long(self, est: Estimate) -> bool:
        """Whether ``est`` is a wait to refuse (never with ``max_queue_wait`` 0: admission control off)."""
        return self.max_queue_wait > 0 and est.wait_s > self.max_queue_wait


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - EWMA_ALPHA) * old + EWMA_ALPHA * sample
