"""One HTTP request's life at the gateway: validate, tokenize, fan out, collect or stream back.

Why here and not in the endpoints: chat and text completions differ only in how the prompt
is built and how a choice is printed; routing, the per-request queue, deadlines, worker loss,
cancellation and usage are the same. :class:`Run` owns the bus side of one HTTP request
(one :class:`Job` per prompt × ``n``); the endpoints in :mod:`gateway.app` turn its events
into OpenAI JSON or server-sent events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from bus.messages import ErrorCode, GenerateRequest, StreamError, StreamFinish, StreamTokens, Usage
from bus.messages import SamplingParams as BusSampling
from bus.streams import DEFAULT_GENERATE
from engine.chat_template import ChatTemplateError
from engine.sampling import SamplingParams
from gateway.admission import Admission
from gateway.bus_client import BUS_LOST, GatewayBus, NoResponders, Unreadable
from gateway.errors import OpenAIError
from gateway.protocol import ChatCompletionRequest, CompletionRequest, as_stop_list
from gateway.router import WorkerRegistry
from gateway.textmodel import TextModel, TokenBytes
from kv.blocks import prefix_hashes
from runtime.settings import GatewayConfig

log = logging.getLogger("tandem.gateway")

Kind = Literal["chat", "completion"]


#: JetStream drops a generate request nobody pulled for this long
POOL_MAX_AGE_S = DEFAULT_GENERATE.max_age
#: worker errors that mean "the request is fine, this worker is not": re-sent elsewhere before any token
_GIVEN_BACK = {
    ErrorCode.HANDED_BACK: "is draining and handed the request back",
    ErrorCode.BUS_UNAVAILABLE: "lost its NATS connection",
}
#: admission counts a request's KV blocks for its prompt and this much of its answer (max_tokens is
#: often the whole context: counting all of it would see room for a handful of requests)
TYPICAL_ANSWER_TOKENS = 256
#: a pool request not taken this long after its ``start_by`` fails here (the worker that pulls it drops it)
START_GRACE_S = 2.0


@dataclass
class Job:
    """One generated sequence: a prompt and one of its ``n`` choices."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    hashes: list[bytes]
    sampling: BusSampling
    request_id: str = ""
    worker_id: str | None = None
    worker_incarnation: str = ""  # the process of ``worker_id`` holding the job, when known
    route_reason: str = ""
    retried: bool = False
    migrations: int = 0  # times it moved to another decode worker mid-stream
    queued: bool = False  # when dispatched, every place was taken: it had to wait (admission's measurements)
    next_seq: int = 0
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    decode_worker: str = ""
    prefill: str = ""  # "remote:<prefill worker>", "local" or "aggregate"
    done: bool = False
    started: float = field(default_factory=time.monotonic)
    start_by: float = 0.0  # epoch seconds: not begun by then, it is dropped where it waits
    first_token_s: float | None = None
    last_token_at: float | None = None
    token_gaps: list[float] = field(default_factory=list)  # seconds between token messages

    @property
    def text(self) -> str:
        """The completion so far."""
        return "".join(self.text_parts)


@dataclass
class Prepared:
    """A validated request: token ids per prompt, one job per choice, output options."""

    kind: Kind
    model: str
    prompts: list[list[int]]
    prompt_texts: list[str]
    jobs: list[Job]
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    echo: bool
    target_endpoint: str | None
    timeout: float


@dataclass
class Event:
    """Something that happened to one job: new tokens, or its end."""

    kind: Literal["tokens", "finish"]
    job: Job
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class Gateway:
    """The gateway's shared state: config, text model, bus, worker registry, counters."""

    def __init__(self, config: GatewayConfig, text: TextModel, bus: GatewayBus, registry: WorkerRegistry) -> None:
        self.config = config
        self.text = text
        self.bus = bus
        self.registry = registry
        self.token_bytes = TokenBytes(text.tokenizer)
        self.inflight = 0
        self.runs: set[Run] = set()  # the requests running now (the drain waits for them)
        self.draining = False
        self.admission = Admission(config.max_queue_wait)
        self.created = int(time.time())
        self.names = {n.lower() for n in (text.name, text.spec, *config.served_model_names)}

    # ---- checks ------------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        """404 unless ``model`` names the served model."""
        if model.lower() not in self.names:
            raise OpenAIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.text.name}`",
                param="model",
                code="model_not_found",
            )

    @staticmethod
    def check_supported(body: ChatCompletionRequest | CompletionRequest) -> None:
        """400 for an OpenAI feature this server does not implement, rather than silently ignoring it."""
        checks = (
            ("tools", bool(body.tools), "tools (function calling) are"),
            ("functions", bool(body.functions), "functions (function calling) are"),
            ("tool_choice", body.tool_choice not in (None, "none", "auto"),
             "tool_choice other than 'none' or 'auto' is"),
            ("function_call", body.function_call not in (None, "none", "auto"),
             "function_call other than 'none' or 'auto' is"),
            ("logit_bias", bool(body.logit_bias), "logit_bias is"),
            ("response_format", (body.response_format or {}).get("type", "text") != "text",
             "response_format other than {'type': 'text'} is"),
        )
        for param, used, what in checks:
            if used:
                raise OpenAIError(400, f"{what} not supported by this server", param=param,
                                  code="unsupported_parameter")

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

    # ---- tokenization ------------------------------------------------------------------
    async def _maybe_in_thread(self, size: int, fn: Any, *args: Any) -> Any:
        if size > self.config.tokenize_in_thread_chars:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    def _chat_ids(self, messages: list[dict[str, str]]) -> tuple[list[int], str]:
        try:
            text = self.text.chat_template.render(messages)
        except ChatTemplateError as e:
            raise OpenAIError(400, str(e), param="messages", code="invalid_messages") from e
        return self.text.tokenizer.encode(text), text

    # ---- preparation -------------------------------------------------------------------
    async def prepare_chat(self, body: ChatCompletionRequest, target: str | None, timeout: float) -> Prepared:
        """Validate a chat request, render the template, tokenize, build its jobs."""
        self.check_model(body.model)
        self.check_supported(body)
        messages = []
        size = 0
        for i, m in enumerate(body.messages):
            if m.content is None:
                if m.role != "assistant":
                    raise OpenAIError(400, f"messages[{i}].content is required", param=f"messages[{i}].content")
                content = ""
            elif isinstance(m.content, str):
                content = m.content
            else:
                if not m.content:
                    raise OpenAIError(400, f"messages[{i}].content is an empty list", param=f"messages[{i}].content")
                parts = []
                for j, part in enumerate(m.content):
                    if part.type != "text" or part.text is None:
                        raise OpenAIError(
                            400,
                            f"messages[{i}].content[{j}]: only text parts are supported (got {part.type!r})",
                            param=f"messages[{i}].content[{j}].type",
                            code="unsupported_content",
                        )
                    parts.append(part.text)
                content = "\n".join(parts)
            size += len(content)
            role = "system" if m.role == "developer" else m.role
            messages.append({"role": role, "content": content})
        ids, text = await self._maybe_in_thread(size, self._chat_ids, messages)
        max_tokens = body.max_completion_tokens or body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        top = body.top_logprobs or 0
        if top and not body.logprobs:
            raise OpenAIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        return self._prepare(
            "chat", body, [ids], [text], max_tokens, param, "messages", bool(body.logprobs), top,
            echo=False, target=target, timeout=timeout,
        )

    async def prepare_completion(self, body: CompletionRequest, target: str | None, timeout: float) -> Prepared:
        """Validate a text completion request, tokenize its prompt(s), build its jobs."""
        self.check_model(body.model)
        self.check_supported(body)
        if body.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix", code="unsupported_parameter")
        if body.best_of is not None and body.best_of != body.n:
            raise OpenAIError(400, "best_of other than n is not supported", param="best_of",
                              code="unsupported_parameter")
        raw = body.prompt
        prompts: list[list[int]] = []
        texts: list[str] = []
        tok = self.text.tokenizer
        if isinstance(raw, str):
            raw = [raw]
        if not raw:
            raise OpenAIError(400, "prompt is empty", param="prompt")
        if all(isinstance(p, int) for p in raw):
            raw = [raw]  # type: ignore[list-item]
        self.check_job_count(len(raw), body.n)  # before tokenizing what would be refused anyway
        texts_in = [p for p in raw if isinstance(p, str)]
        encoded = iter(await self._maybe_in_thread(sum(map(len, texts_in)), lambda: [tok.encode(p) for p in texts_in]))
        for p in raw:
            if isinstance(p, str):
                ids = next(encoded)
                prompts.append(ids)
                texts.append(p)
            else:
                ids = list(p)  # type: ignore[arg-type]
                bad = [t for t in ids if not 0 <= t < self.text.vocab_size]
                if bad:
                    raise OpenAIError(400, f"token id {bad[0]} is outside the vocabulary", param="prompt")
                prompts.append(ids)
                texts.append(tok.decode(ids, skip_special=False) if body.echo else "")
        lp = body.logprobs
        return self._prepare(
            "completion", body, prompts, texts, body.max_tokens, "max_tokens", "prompt", lp is not None, lp or 0,
            echo=body.echo, target=target, timeout=timeout,
        )

    def _prepare(
        self,
        kind: Kind,
        body: ChatCompletionRequest | CompletionRequest,
        prompts: list[list[int]],
        texts: list[str],
        max_tokens: int | None,
        max_tokens_param: str,
        prompt_param: str,
        logprobs: bool,
        top_logprobs: int,
        *,
        echo: bool,
        target: str | None,
        timeout: float,
    ) -> Prepared:
        n = body.n
        self.check_job_count(len(prompts), n)
        if body.seed is not None and not -(2**63) <= body.seed <= 2**63 - n:
            raise OpenAIError(400, f"seed must fit in a signed 64-bit integer (choice i uses seed + i, n={n})",
                              param="seed", code="invalid_value")
        limit = self.text.max_position
        jobs: list[Job] = []
        for pi, ids in enumerate(prompts):
            if not ids:
                raise OpenAIError(400, "prompt is empty", param=prompt_param)
            want = max_tokens if max_tokens is not None else limit - len(ids)
            if len(ids) >= limit or want < 1 or len(ids) + want > limit:
                what = f" + {max_tokens_param} ({want})" if max_tokens is not None else ""
                raise OpenAIError(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{len(ids) + max(want, 0)} tokens: prompt ({len(ids)} tokens){what}.",
                    param=max_tokens_param if max_tokens is not None and len(ids) < limit else prompt_param,
                    code="context_length_exceeded",
                )
            params = SamplingParams(
                max_tokens=want,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=body.top_k or 0,
                seed=body.seed,
                stop=as_stop_list(body.stop),
                stop_token_ids=list(body.stop_token_ids or []),
                frequency_penalty=body.frequency_penalty or 0.0,
                presence_penalty=body.presence_penalty or 0.0,
                logprobs=logprobs,
                top_logprobs=top_logprobs,
                ignore_eos=body.ignore_eos,
            )
            try:
                params.validate()
            except ValueError as e:
                message, param = (e.args + (None,))[:2]
                raise OpenAIError(400, str(message), param=param, code="invalid_value") from e
            hashes = prefix_hashes(ids, self.config.block_size)
            for i in range(n):
                seed = None if body.seed is None else body.seed + i
                sampling = BusSampling(
                    max_tokens=params.max_tokens,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    top_k=params.top_k,
                    seed=seed,
                    stop=params.stop,
                    stop_token_ids=params.stop_token_ids,
                    frequency_penalty=params.frequency_penalty,
                    presence_penalty=params.presence_penalty,
                    logprobs=params.logprobs,
                    top_logprobs=params.top_logprobs,
                    ignore_eos=params.ignore_eos,
                )
                jobs.append(Job(len(jobs), pi, ids, hashes, sampling))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream_options is not None and not body.stream:
            raise OpenAIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        return Prepared(
            kind, body.model, prompts, texts, jobs, body.stream, include_usage, logprobs, top_logprobs,
            echo, target, timeout,
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

    # ---- logprobs ----------------------------------------------------------------------
    def chat_logprobs(self, ids: Sequence[int], lps: Sequence[float], tops: Sequence[Sequence[tuple[int, float]]],
                      ) -> dict[str, Any]:
        """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
        content = []
        for k, (tid, lp) in enumerate(zip(ids, lps)):
            text, raw = self.token_bytes(tid)
            top = []
            for t, tl in (tops[k] if k < len(tops) else []):
                ttext, traw = self.token_bytes(t)
                top.append({"token": ttext, "logprob": tl, "bytes": traw})
            content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": top})
        return {"content": content}

    def completion_logprobs(
        self, ids: Sequence[int], lps: Sequence[float], tops: Sequence[Sequence[tuple[int, float]]],
        offset: int, with_top: bool,
    ) -> dict[str, Any]:
        """Legacy ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset."""
        tokens, offsets, top_out = [], [], []
        pos = offset
        for k, tid in enumerate(ids):
            text, _ = self.token_bytes(tid)
            tokens.append(text)
            offsets.append(pos)
            pos += len(text)
            if with_top:
                top_out.append({self.token_bytes(t)[0]: tl for t, tl in (tops[k] if k < len(tops) else [])})
        return {
            "tokens": tokens,
            "token_logprobs": list(lps[: len(ids)]),
            "top_logprobs": top_out if with_top else None,
            "text_offset": offsets,
        }


class Run:
    """The bus side of one HTTP request: dispatch its jobs, turn their streams into events."""

    def __init__(self, gw: Gateway, prep: Prepared, client_id: str) -> None:
        self.gw = gw
        self.prep = prep
        self.client_id = client_id  # the id the client sees (X-Request-Id); jobs are named after it
        self.jobs = prep.jobs
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.deadline = time.time() + prep.timeout
        self.accepted_at = time.monotonic()  # TTFT counts from here, across re-sends
        self._give_up_at = time.monotonic() + prep.timeout + gw.config.deadline_grace
        self._counted = 0
        self._next_check = time.monotonic() + 1.0
        self.closed = False
        self._deadline_timer: asyncio.TimerHandle | None = None

    # ---- dispatch ----------------------------------------------------------------------
    async def start(self) -> None:
        """Check capacity and publish every job (raises OpenAIError: 429/503/400)."""
        gw = self.gw
        gw.check_ready()
        need = len(self.jobs)
        if gw.inflight + need > gw.config.max_inflight:
            raise OpenAIError(
                429, f"too many requests in flight at this gateway ({gw.inflight}); retry later",
                code="too_many_requests",
            )
        if gw.registry.alive():
            gw.admit(self.jobs)
        gw.inflight += need
        self._counted = need
        gw.runs.add(self)
        # next_event enforces the deadline, but only while someone asks for events: a streaming
        # client that stops reading must not hold the jobs and the capacity past it
        self._deadline_timer = asyncio.get_running_loop().call_later(
            self._give_up_at - time.monotonic() + 1.0, self.close, "deadline passed")
        for job in self.jobs:
            await self._dispatch(job)

    async def _dispatch(self, job: Job, exclude: frozenset[str] = frozenset()) -> None:
        gw = self.gw
        if self.closed:  # the deadline timer closed this run while it was sending
            raise self._deadline_passed()
        reg = gw.registry
        # "<client id>-<choice>", "-r1" for a re-send, "-m<k>" for a migration: `tandem tail --request
        # <client id>` finds them all
        job.request_id = (f"{self.client_id}-{job.index}" + ("-r1" if job.retried else "")
                          + (f"-m{job.migrations}" if job.migrations else ""))
        bs = gw.config.block_size
        blocks = (len(job.prompt_ids) + bs - 1) // bs
        route = reg.choose(job.hashes, blocks, exclude)
        live = [w for w in reg.alive() if w.worker_id not in exclude]
        if route.worker_id is None and not live and not gw.config.queue_when_no_workers:
            raise OpenAIError(503, f"no decode worker for model {gw.text.name} is alive; retry later",
                              code="no_workers", retry_after=5)
        subject = gw.bus.open(job.request_id, self.queue, job.index)
        job.next_seq = 0
        req = GenerateRequest(
            request_id=job.request_id,
            prompt_ids=job.prompt_ids,
            sampling=job.sampling,
            stream_subject=subject,
            gateway_id=gw.config.gateway_id,
            deadline=self.deadline,
            start_by=time.time() + gw.config.max_queue_wait if gw.config.max_queue_wait else 0.0,
            target_endpoint=self.prep.target_endpoint,
            model=gw.text.name,
            resume_ids=list(job.token_ids) if job.migrations else [],
            shown_chars=len(job.text) if job.migrations else 0,
        )
        try:
            await gw.bus.submit(req, route.worker_id)
        except BaseException:
            gw.bus.close_request(job.request_id)
            raise
        job.worker_id = route.worker_id
        job.worker_incarnation = reg.incarnation(route.worker_id) if route.worker_id else ""
        job.route_reason = route.reason
        job.started = time.monotonic()
        job.start_by = req.start_by
        reg.dispatched(route.worker_id, job.hashes, blocks, job.request_id)
        log.info("request %s -> %s (%s, %d cached blocks)", job.request_id,
                 route.worker_id or "pool", route.reason, route.matched_blocks, extra={"request_id": job.request_id})

    # ---- events ------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        """Every job ended."""
        return all(j.done for j in self.jobs)

    async def next_event(self, idle: float | None = None) -> Event | None:
        """The next event of any job; None after ``idle`` seconds without one.

        Raises OpenAIError: the worker's error, 504 past the deadline, 503 when the worker
        holding a job stopped reporting after it sent tokens.
        """
        idle_until = None if idle is None else time.monotonic() + idle
        while True:
            now = time.monotonic()
            if now >= self._give_up_at:
                raise self._deadline_passed()
            if now >= self._next_check:  # also while other jobs of this request keep streaming
                self._next_check = now + 1.0
                await self._check_workers()
            wait = min(1.0, self._give_up_at - now)
            if idle_until is not None:
                if now >= idle_until:
                    return None
                wait = min(wait, idle_until - now)
            try:
                idx, msg = await asyncio.wait_for(self.queue.get(), wait)
            except asyncio.TimeoutError:
                continue
            if isinstance(msg, OpenAIError):  # abort(): this run ends here
                raise msg
            job = self.jobs[idx]
            if job.done:
                continue
            if isinstance(msg, NoResponders):
                if job.worker_id is not None and msg.request_id == job.request_id:
                    await self._lost(job, job.worker_id, "is not listening (stopped or draining)")
                continue
            if (isinstance(msg, StreamError) and msg.code in _GIVEN_BACK
                    and msg.request_id == job.request_id):
                await self._lost(job, job.worker_id or "?", _GIVEN_BACK[msg.code])
                continue
            event = self._apply(job, msg)
            if event is not None:
                return event

    def _apply(self, job: Job, msg: Any) -> Event | None:
        gw = self.gw
        if isinstance(msg, StreamTokens):
            if msg.request_id != job.request_id:
                return None  # a late message of a job that was re-dispatched
            if msg.seq < job.next_seq:
                return None  # duplicate
            if msg.seq > job.next_seq:
                raise OpenAIError(
                    502, f"lost part of the token stream (expected message {job.next_seq}, got {msg.seq})",
                    code="stream_gap",
                )
            job.next_seq = msg.seq + 1
            if msg.worker_id and job.worker_id is None:  # a pool job's worker, watched from now on
                job.worker_id = msg.worker_id
            if msg.incarnation and msg.worker_id == job.worker_id:
                job.worker_incarnation = msg.incarnation
            if not msg.token_ids and not msg.text:  # the worker's admission notice
                return None
            if msg.token_ids:
                now = time.monotonic()
                if job.first_token_s is None:
                    job.first_token_s = now - self.accepted_at
                    gw.admission.started(now - job.started, job.queued)
                elif job.last_token_at is not None:
                    job.token_gaps.append(now - job.last_token_at)
                job.last_token_at = now
            job.token_ids.extend(msg.token_ids)
            if msg.text:
                job.text_parts.append(msg.text)
            lps = tops = None
            if msg.logprobs is not None:
                lps = list(msg.logprobs)
                job.logprobs.extend(lps)
                tops = [[(int(t), float(lp)) for t, lp in row] for row in (msg.top_logprobs or [[] for _ in lps])]
                job.top_logprobs.extend(tops)
            return Event("tokens", job, msg.text, list(msg.token_ids), lps, tops)
        if isinstance(msg, StreamFinish):
            if msg.request_id != job.request_id:
                return None
            if msg.seq > job.next_seq and msg.finish_reason != "cancelled":
                raise OpenAIError(
                    502, f"lost the end of the token stream (expected message {job.next_seq}, got {msg.seq})",
                    code="stream_gap",
                )
            job.done = True
            gw.bus.close_request(job.request_id)
            gw.registry.finished(job.request_id)
            if job.last_token_at is not None and job.first_token_s is not None:
                gw.admission.finished(job.last_token_at - (self.accepted_at + job.first_token_s))
            if msg.finish_reason == "cancelled":
                raise OpenAIError(503, "the request was cancelled by the worker", code="cancelled", retry_after=1)
            job.finish_reason = msg.finish_reason if msg.finish_reason in ("stop", "length") else "stop"
            job.usage = msg.usage
            job.decode_worker = msg.decode_worker_id
            job.prefill = msg.prefill_mode or ""
            if msg.prefill_worker_id:
                job.prefill += f":{msg.prefill_worker_id}"
            if msg.text:
                job.text_parts.append(msg.text)
            if msg.decode_worker_id and job.worker_id is None:
                gw.registry.remember(msg.decode_worker_id, job.hashes)
            return Event("finish", job, msg.text, [])
        if isinstance(msg, StreamError):
            if msg.request_id != job.request_id:
                return None
            job.done = True
            gw.bus.close_request(job.request_id)
            gw.registry.finished(job.request_id)
            raise OpenAIError(msg.status, msg.message, code=msg.code)
        if isinstance(msg, Unreadable):
            if msg.request_id != job.request_id:
                return None
            raise OpenAIError(502, f"a worker sent a message this gateway cannot read: {msg.error}",
                              code="bad_worker_message")
        if msg is BUS_LOST:
            raise OpenAIError(503, "the gateway lost its NATS connection while the request ran; retry",
                              code="bus_unavailable", retry_after=2)
        return None

    def _deadline_passed(self) -> OpenAIError:
        return OpenAIError(504, f"the request's deadline of {self.prep.timeout:g}s passed", code="deadline_exceeded")

    async def _check_workers(self) -> None:
        """Jobs whose worker went silent or restarted are handled by :meth:`_lost`; a job the
        pool dropped unread (JetStream ``max_age``) fails."""
        reg = self.gw.registry
        for job in self.jobs:
            if job.done:
                continue
            if job.worker_id is None:
                waited = time.monotonic() - job.started
                if waited > POOL_MAX_AGE_S + 5.0 or (job.start_by and time.time() > job.start_by + START_GRACE_S):
                    raise OpenAIError(503, f"no worker took the request from the queue in {waited:.0f}s; retry later",
                                      code="queue_timeout", retry_after=5)
                continue
            # a worker that never said it took the job is given up on as soon as it looks dead
            # (not only when NATS says nobody listens: another subscriber, e.g. `tandem tail`, hides that)
            silent = self.gw.config.alive_after if job.next_seq == 0 else self.gw.config.worker_lost_after
            if not reg.is_alive(job.worker_id, within=silent):
                await self._lost(job, job.worker_id, "stopped reporting")
            elif job.worker_incarnation and reg.incarnation(job.worker_id) not in ("", job.worker_incarnation):
                await self._lost(job, job.worker_id, "restarted")

    async def _lost(self, job: Job, worker: str, why: str) -> None:
        """The worker holding ``job`` is gone: before any token, re-send the job once elsewhere; after
        tokens, move it to another worker with the tokens so far (up to ``migration_limit`` times); else fail."""
        started = bool(job.token_ids or job.text_parts)
        if not started and not job.retried:
            log.warning("request %s: worker %s %s; re-sending the request", job.request_id, worker, why)
            self.gw.bus.cancel_soon(job.request_id, f"worker {worker} {why}")
            self.gw.registry.finished(job.request_id)
            job.retried = True
            await self._dispatch(job, exclude=frozenset({worker}))
            return
        if started and job.migrations < self.gw.config.migration_limit:
            log.warning("request %s: worker %s %s after %d tokens; moving the stream to another worker",
                        job.request_id, worker, why, len(job.token_ids))
            self.gw.bus.cancel_soon(job.request_id, f"worker {worker} {why}")
            job.migrations += 1
            await self._dispatch(job, exclude=frozenset({worker}))
            return
        raise OpenAIError(503, f"decode worker {worker} {why}", code="worker_lost", retry_after=1)

    async def collect(self) -> None:
        """Wait until every job ended (raises the first error)."""
        while not self.finished:
            await self.next_event()

    def abort(self, error: OpenAIError) -> None:
        """Make whoever reads this run's events get ``error`` next (never awaits)."""
        self.queue.put_nowait((-1, error))

    def close(self, reason: str) -> None:
        """Cancel every job still running (never awaits: safe in a cancelled task) and release capacity."""
        if self.closed:
            return
        self.closed = True
        self.gw.runs.discard(self)
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        for job in self.jobs:
            if job.request_id and not job.done:
                self.gw.bus.cancel_soon(job.request_id, reason)
            elif job.request_id:
                self.gw.bus.close_request(job.request_id)
            if job.request_id:
                self.gw.registry.finished(job.request_id)
        self.gw.inflight -= self._counted
        self._counted = 0

    # ---- usage -------------------------------------------------------------------------
    def usage(self) -> dict[str, Any]:
        """OpenAI ``usage``: prompts counted once each, completions summed over choices."""
        prompt = sum(len(p) for p in self.prep.prompts)
        completion = 0
        cached: dict[int, int] = {}
        for j in self.jobs:
            completion += j.usage.completion_tokens if j.usage and j.usage.completion_tokens else len(j.token_ids)
            if j.usage:
                cached[j.prompt_index] = max(cached.get(j.prompt_index, 0), j.usage.cached_tokens)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
        }
