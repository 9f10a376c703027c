"""The gateway's shared state: config, text model, bus, worker registry, admission, the running requests.

Why one object: every endpoint and every :class:`~gateway.run.Run` checks the same things (is the model
the served one, is the gateway draining, is anything alive, would the request wait too long) against the
same state; the checks live here, next to that state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from gateway.admission import Admission
from gateway.bus_client import GatewayBus
from gateway.errors import OpenAIError
from gateway.jobs import Job
from gateway.router import WorkerRegistry
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
