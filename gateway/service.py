"""The gateway's shared state: config, text model, bus, worker registry, admission (`Admission`: the expected
wait of a new request, 429 past ``max_queue_wait``), the running requests.

Why one object: every endpoint and every :class:`~gateway.run.Run` checks the same things (is the model
the served one, is the gateway draining, is anything alive, would the request wait too long) against the
same state; the checks live here, next to that state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.bus_client import GatewayBus
from gateway.errors import OpenAIError
from gateway.jobs import Job
from gateway.router import WorkerInfo, WorkerRegistry
from gateway.textmodel import TextModel, TokenBytes
from gateway.tools import template_takes_tools
from runtime.logs import Throttled
from runtime.metrics import GatewayMetrics
from runtime.settings import GatewayConfig

log = logging.getLogger("tandem.gateway")
_dropped_log = Throttled(log)
_DROP_WHY = {
    "unsigned": "it names no worker",
    "other_worker": "another worker holds the request",
    "other_process": "the worker holding the request is another process",
}

#: admission counts a request's KV blocks for its prompt and this much of its answer (max_tokens is
#: often the whole context: counting all of it would see room for a handful of requests)
TYPICAL_ANSWER_TOKENS = 256
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
    """The service-time averages of one gateway, and the decision for each new request.

    Admission control refuses at once (429, ``Retry-After``) what would wait longer than ``max_queue_wait``.

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
    refused (``n`` choices count ``n`` times). A request that was admitted and still did not start by its
    ``start_by`` time is dropped wherever it waits (pool, worker queue) with a 503 and ``Retry-After``.
    """

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


class Running(Protocol):
    """A request running on the bus (a ``gateway.run.Run``, which holds the gateway): its jobs, and a way to end it."""

    jobs: list[Job]

    def abort(self, error: OpenAIError) -> None:
        """Make whoever reads the request's events get ``error`` next (never awaits)."""


class Gateway:
    """The gateway's shared state and the checks every request goes through."""

    def __init__(self, config: GatewayConfig, text: TextModel, bus: GatewayBus, registry: WorkerRegistry,
                 metrics: GatewayMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.text = text
        self.bus = bus
        self.registry = registry
        self.token_bytes = TokenBytes(text.tokenizer)
        self.inflight = 0
        self.runs: set[Running] = set()  # the requests running now (the drain waits for them)
        self._no_runs = asyncio.Event()
        self._no_runs.set()
        self.draining = False
        self.admission = Admission(config.max_queue_wait)
        self.created = int(time.time())
        self.names = {n.lower() for n in (text.name, text.spec, *config.served_model_names)}
        #: what a request that leaves a sampling field out gets: the model's own, then the flags' overrides
        self.sampling_defaults: dict[str, Any] = {**text.sampling_defaults, **config.sampling_overrides()}
        self.native_tools = template_takes_tools(text.chat_template)

    @property
    def served_name(self) -> str:
        """The name responses carry: the first --served-model-name, else the model's."""
        return self.config.served_model_names[0] if self.config.served_model_names else self.text.name

    def stream_dropped(self, reason: str, request_id: str, worker_id: str, incarnation: str) -> None:
        """A message on a request's stream subject that the client must not see: counted, logged (throttled)."""
        self.metrics.stream_dropped.labels(reason).inc()
        if reason != "duplicate":
            _dropped_log.warning(reason, "dropped a message on request %s's stream that says it is from %s (%s): "
                                 "%s (tandem_gateway_stream_messages_dropped_total)", request_id,
                                 worker_id or "nobody", incarnation or "no process", _DROP_WHY[reason])

    # ---- checks ------------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        """404 unless ``model`` names the served model."""
        if model.lower() not in self.names:
            raise OpenAIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.served_name}`",
                param="model",
                code="model_not_found",
            )

    def check_job_count(self, prompts: int, n: int) -> None:
        """400 when a request asks for more sequences than one request may run."""
        limit = self.config.max_jobs_per_request
        if prompts * n > limit:
            raise OpenAIError(400, f"{prompts} prompt(s) × n={n} is more than {limit} sequences",
                              param="prompt" if n == 1 else "n")

    def check_accepting(self) -> None:
        """503 (with Retry-After) once the gateway drains: another gateway (or this one, restarted) will serve."""
        if self.draining:
            raise OpenAIError(503, "the gateway is shutting down; retry", code="shutting_down", retry_after=1)

    def run_started(self, run: Running) -> None:
        self.runs.add(run)
        self._no_runs.clear()

    def run_ended(self, run: Running) -> None:
        self.runs.discard(run)
        if not self.runs:
            self._no_runs.set()

    async def runs_ended(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every running request to end; whether they all did."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._no_runs.wait(), timeout)
        return not self.runs

    def abort_all(self, message: str) -> int:
        """End every running request with a 503 (the drain time is over); returns how many."""
        runs = list(self.runs)
        for run in runs:
            run.abort(OpenAIError(503, message, code="shutting_down", retry_after=1))
        return len(runs)

    def waiting_in_pool(self) -> int:
        """This gateway's jobs sent to the pool that no worker has taken yet."""
        return sum(1 for run in self.runs for j in run.jobs if not j.done and j.worker_id is None)

    def admit(self, jobs: Sequence[Job]) -> None:
        """429 (with Retry-After) when ``jobs`` would wait longer than ``max_queue_wait`` for a place;
        marks which of them will queue."""
        bs = self.config.block_size
        blocks = max((len(j.prompt_ids) + min(j.sampling.max_tokens, TYPICAL_ANSWER_TOKENS) + bs - 1) // bs
                     for j in jobs)
        est = self.admission.estimate(self.registry.alive(), blocks, self.waiting_in_pool(), count=len(jobs))
        if self.admission.too_long(est):
            raise OpenAIError(
                429,
                f"the expected wait for a worker is {est.wait_s:.0f}s, more than --max-queue-wait "
                f"{self.config.max_queue_wait:g}s ({est.load} requests ahead, room for {est.capacity}); retry later",
                code="overloaded", retry_after=est.retry_after,
            )
        for k, job in enumerate(jobs):
            job.queued = est.load + k >= est.capacity

    def check_ready(self) -> None:
        """503 (with Retry-After) when nothing could serve a request now."""
        self.check_accepting()
        if not self.bus.connected:
            raise OpenAIError(503, "the gateway is not connected to NATS", code="bus_unavailable", retry_after=2)
        if not self.config.queue_when_no_workers and not self.registry.alive():
            raise OpenAIError(
                503,
                f"no decode worker for model {self.text.name} is alive; retry later",
                code="no_workers",
                retry_after=5,
            )

    def timeout_of(self, header: str | None) -> float:
        """The request's deadline in seconds: ``X-Request-Timeout`` if given (capped), else the default."""
        if header is None or header == "":
            return self.config.request_timeout
        try:
            value = float(header)
        except ValueError as e:
            raise OpenAIError(400, f"X-Request-Timeout must be a number of seconds, got {header!r}",
                              param="X-Request-Timeout") from e
        if not value > 0:
            raise OpenAIError(400, "X-Request-Timeout must be positive", param="X-Request-Timeout")
        return min(value, self.config.max_request_timeout)
