"""The FastAPI application: OpenAI-compatible endpoints over the tandem bus.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``
(and ``/v1/models/{id}``), ``GET /health`` (the process is up), ``GET /ready`` (NATS is
connected and a decode-capable worker of the model reported within ``alive_after``
seconds), ``GET /metrics`` (Prometheus), ``/openapi.json``.

A streamed response starts only after every choice produced its first message (or
``stream_start_wait`` passed), so errors a worker finds at once (unknown
``target_endpoint``, no capacity) still arrive as an HTTP status; later ones arrive as an
SSE error event, followed by ``data: [DONE]``. A client that goes away cancels its
requests on the bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bus.connection import BusOptions
from bus.subjects import Subjects
from gateway.bus_client import GatewayBus
from gateway.errors import OpenAIError, install_handlers
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.router import WorkerRegistry
from gateway.service import Event, Gateway, Prepared, Run
from gateway.textmodel import TextModel, load_text_model
from runtime.metrics import GatewayMetrics
from runtime.settings import GatewayConfig

log = logging.getLogger("tandem.gateway")

T = TypeVar("T")

#: how long a streamed response waits for every choice's first message before sending headers
STREAM_START_WAIT = 20.0
_ROUTES = frozenset({"/v1/models", "/v1/chat/completions", "/v1/completions"})


class _FrontDoor:
    """Pure ASGI middleware every /v1 request passes: API key, body size, then request metrics.

    Why here and not in a route dependency: FastAPI parses the body before dependencies run,
    so a client without a key would learn about its JSON before hearing 401. Pure ASGI also
    leaves streaming and disconnect detection alone.
    """

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, max_body_bytes: int, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.api_keys = [k.encode() for k in api_keys]

    def _refuse(self, headers: dict[bytes, bytes]) -> OpenAIError | None:
        if self.api_keys:
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            token = token.strip()
            if scheme.lower() != "bearer" or not token:
                return OpenAIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
            if not any(secrets.compare_digest(token.encode("latin-1"), k) for k in self.api_keys):
                return OpenAIError(401, "incorrect API key provided", code="invalid_api_key")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return OpenAIError(413, f"the request body is over {self.max_body_bytes} bytes", code="request_too_large")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        status = [500]

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        t0 = time.perf_counter()
        try:
            refused = self._refuse(dict(scope.get("headers") or []))
            if refused is not None:
                await refused.response()(scope, receive, send_status)
                return
            await self.app(scope, receive, send_status)
        finally:
            if path.startswith("/v1/models/"):
                endpoint = "/v1/models/{id}"
            else:  # one label per route, not per path a client made up
                endpoint = path if path in _ROUTES else "other"
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
            self.metrics.e2e.labels(endpoint).observe(time.perf_counter() - t0)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def create_app(config: GatewayConfig, text: TextModel | None = None) -> FastAPI:
    """Build the app; its lifespan loads the text model (unless given) and connects to NATS."""
    metrics = GatewayMetrics()
    state: dict[str, Gateway] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tm = text or await asyncio.to_thread(load_text_model, config.model)
        subjects = Subjects(tm.name, config.namespace)
        registry = WorkerRegistry(subjects.model_token, alive_after=config.alive_after,
                                  load_weight=config.route_load_weight)
        opts = BusOptions.from_env(servers=config.nats_url, connect_timeout=config.connect_timeout)
        bus = GatewayBus(subjects, config.gateway_id, registry, opts)
        await bus.start(ensure=config.ensure_streams)
        gw = Gateway(config, tm, bus, registry)
        state["gw"] = gw
        app.state.gateway = gw
        pruner = asyncio.create_task(_prune(registry))
        log.info("gateway %s serving %s (subjects %s.*)", config.gateway_id, tm.name, subjects.generate_pool)
        try:
            yield
        finally:
            pruner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pruner
            await bus.close()

    async def _prune(registry: WorkerRegistry) -> None:
        while True:
            await asyncio.sleep(5.0)
            registry.prune()

    app = FastAPI(
        title="tandem gateway",
        description="OpenAI-compatible API over prefill/decode workers on NATS",
        version="0.1.0",
        lifespan=lifespan,
    )
    install_handlers(app)

    def gateway() -> Gateway:
        gw = state.get("gw")
        if gw is None:
            raise OpenAIError(503, "the gateway is starting", code="starting", retry_after=1)
        return gw

    app.add_middleware(_FrontDoor, metrics=metrics, max_body_bytes=config.max_body_bytes, api_keys=config.api_keys)

    # ---- plain endpoints ---------------------------------------------------------------
    @app.get("/health", summary="the process is up")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", summary="a decode-capable worker of the model is alive")
    async def ready() -> JSONResponse:
        gw = state.get("gw")
        if gw is None:
            return JSONResponse({"status": "starting"}, status_code=503, headers={"Retry-After": "1"})
        live = gw.registry.alive()
        metrics.live_workers.set(len(live))
        body = {
            "status": "draining" if gw.draining else "ready" if live and gw.bus.connected else "not_ready",
            "model": gw.text.name,
            "gateway_id": config.gateway_id,
            "nats_connected": gw.bus.connected,
            "workers": gw.registry.summary(),
        }
        if gw.draining:
            body["reason"] = "the gateway is shutting down"
        elif not gw.bus.connected:
            body["reason"] = "not connected to NATS"
        elif not live:
            body["reason"] = f"no decode-capable worker of {gw.text.name} reported in the last {config.alive_after:g}s"
        ok = body["status"] == "ready"
        return JSONResponse(body, status_code=200 if ok else 503, headers={} if ok else {"Retry-After": "1"})

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def metrics_endpoint() -> Response:
        gw = state.get("gw")
        if gw is not None:
            metrics.in_flight.set(gw.inflight)
            metrics.live_workers.set(len(gw.registry.alive()))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def _model_card(gw: Gateway) -> dict[str, Any]:
        return {
            "id": gw.text.name,
            "object": "model",
            "created": gw.created,
            "owned_by": "tandem",
            "max_model_len": gw.text.max_position,
        }

    @app.get("/v1/models", summary="the served model")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(gateway())]}

    @app.get("/v1/models/{model_id:path}", summary="one model")
    async def model(model_id: str) -> dict[str, Any]:
        gw = gateway()
        gw.check_model(model_id)
        return _model_card(gw)

    # ---- completions -------------------------------------------------------------------
    @app.post("/v1/chat/completions", summary="chat completion")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        gw = gateway()
        gw.check_accepting()
        prep = await gw.prepare_chat(body, _target(body.target_endpoint, request), gw.timeout_of(
            request.headers.get("x-request-timeout")))
        return await _serve(gw, prep, request, f"chatcmpl-{uuid.uuid4().hex}")

    @app.post("/v1/completions", summary="text completion")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        gw = gateway()
        gw.check_accepting()
        prep = await gw.prepare_completion(body, _target(body.target_endpoint, request), gw.timeout_of(
            request.headers.get("x-request-timeout")))
        return await _serve(gw, prep, request, f"cmpl-{uuid.uuid4().hex}")

    def _target(body_value: str | None, request: Request) -> str | None:
        return body_value or request.headers.get("x-target-endpoint") or None

    async def _serve(gw: Gateway, prep: Prepared, request: Request, rid: str) -> Response:
        run = Run(gw, prep, rid)
        try:
            await run.start()
        except BaseException:
            run.close("dispatch failed")
            raise
        headers = {"X-Request-Id": rid}
        if prep.stream:
            return await _stream(gw, run, request, rid, headers)
        try:
            await _unless_disconnected(run.collect(), run, request)
        except BaseException:
            run.close("failed")
            raise
        run.close("done")
        _observe(run)
        body = _chat_body(gw, run, rid) if prep.kind == "chat" else _completion_body(gw, run, rid)
        # where each choice ran (debugging, tests): decode worker and how its prompt was prefilled
        headers["X-Tandem-Decode-Worker"] = ",".join(j.decode_worker for j in run.jobs)
        headers["X-Tandem-Prefill"] = ",".join(j.prefill for j in run.jobs)
        return JSONResponse(body, headers=headers)

    def _observe(run: Run) -> None:
        for j in run.jobs:
            if j.first_token_s is not None:
                metrics.ttft.observe(j.first_token_s)
            for gap in j.token_gaps:
                metrics.itl.observe(gap)
            if len(j.token_ids) > 1 and j.token_gaps:
                metrics.tpot.observe(sum(j.token_gaps) / (len(j.token_ids) - 1))
            metrics.generated_tokens.inc(len(j.token_ids))
        metrics.prompt_tokens.inc(sum(len(p) for p in run.prep.prompts))

    async def _unless_disconnected(work: Awaitable[T], run: Run, request: Request) -> T:
        """Await ``work``; a client that disconnects meanwhile cancels it (499, nobody reads it)."""
        task = asyncio.ensure_future(work)
        watch = asyncio.create_task(_disconnected(request))
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()
        if task in done:
            return task.result()  # or re-raises the run's error
        with contextlib.suppress(asyncio.CancelledError, OpenAIError):
            await task
        log.info("client went away; cancelling %s", [j.request_id for j in run.jobs])
        raise OpenAIError(499, "client closed the request", code="client_closed")

    # ---- streaming ---------------------------------------------------------------------
    async def _stream(gw: Gateway, run: Run, request: Request, rid: str, headers: dict[str, str]) -> Response:
        prep = run.prep
        buffered: list[Event] = []

        async def first_events() -> None:
            """Hold the headers until every choice said something (errors stay HTTP statuses)."""
            started = time.monotonic()
            seen: set[int] = set()
            while len(seen) < len(run.jobs) and not run.finished:
                left = STREAM_START_WAIT - (time.monotonic() - started)
                if left <= 0:
                    return
                ev = await run.next_event(idle=left)
                if ev is None:
                    return
                buffered.append(ev)
                seen.add(ev.job.index)

        try:
            await _unless_disconnected(first_events(), run, request)
        except BaseException:
            run.close("failed before streaming")
            raise
        created = int(time.time())
        chat = prep.kind == "chat"

        def chunk(choices: list[dict[str, Any]], usage: Any = None, with_usage: bool = True) -> str:
            obj: dict[str, Any] = {
                "id": rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": prep.model,
                "choices": choices,
            }
            if prep.include_usage and with_usage:
                obj["usage"] = usage
            return _sse(obj)

        def render(ev: Event) -> str | None:
            j = ev.job
            if ev.kind == "tokens":
                if not ev.text and not (prep.logprobs and ev.logprobs):
                    return None
                lp = None
                if prep.logprobs and ev.logprobs is not None:
                    if chat:
                        lp = gw.chat_logprobs(ev.token_ids, ev.logprobs, ev.top_logprobs or [])
                    else:
                        offset = len(prep.prompt_texts[j.prompt_index]) if prep.echo else 0
                        lp = gw.completion_logprobs(ev.token_ids, ev.logprobs, ev.top_logprobs or [],
                                                    offset + len(j.text) - len(ev.text), prep.top_logprobs > 0)
                if chat:
                    return chunk([{"index": j.index, "delta": {"content": ev.text}, "logprobs": lp,
                                   "finish_reason": None}])
                return chunk([{"index": j.index, "text": ev.text, "logprobs": lp, "finish_reason": None}])
            if chat:
                delta = {"content": ev.text} if ev.text else {}
                return chunk([{"index": j.index, "delta": delta, "logprobs": None, "finish_reason": j.finish_reason}])
            return chunk([{"index": j.index, "text": ev.text, "logprobs": None, "finish_reason": j.finish_reason}])

        async def body() -> AsyncIterator[str]:
            try:
                for j in run.jobs:
                    if chat:
                        yield chunk([{"index": j.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                    elif prep.echo:
                        yield chunk([{"index": j.index, "text": prep.prompt_texts[j.prompt_index],
                                      "logprobs": None, "finish_reason": None}])
                for ev in buffered:
                    out = render(ev)
                    if out:
                        yield out
                while not run.finished:
                    try:
                        ev = await run.next_event(idle=gw.config.sse_keepalive)
                    except Exception as e:  # the client sees an error event, never a cut-off stream
                        err = e if isinstance(e, OpenAIError) else OpenAIError(
                            500, f"internal error ({type(e).__name__}); see the gateway log", code="internal_error")
                        if err is not e:
                            log.exception("stream %s crashed after it started", rid)
                        log.info("stream %s failed after it started: %s %s", rid, err.status, err.message)
                        metrics.stream_errors.labels(err.code or str(err.status)).inc()
                        yield err.sse()
                        yield "data: [DONE]\n\n"
                        return
                    if ev is None:
                        yield ": keep-alive\n\n"
                        continue
                    out = render(ev)
                    if out:
                        yield out
                if prep.include_usage:
                    yield chunk([], usage=run.usage())
                _observe(run)
                yield "data: [DONE]\n\n"
            finally:
                # normal end, error, or the client went away (this task is cancelled): never awaits
                run.close("client disconnected" if not run.finished else "done")

        return StreamingResponse(
            body(),
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return app


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body has been read, so receive() waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _chat_body(gw: Gateway, run: Run, rid: str) -> dict[str, Any]:
    prep = run.prep
    choices = []
    for j in run.jobs:
        lp = None
        if prep.logprobs:
            lp = gw.chat_logprobs(j.token_ids[: len(j.logprobs)], j.logprobs, j.top_logprobs)
        choices.append({
            "index": j.index,
            "message": {"role": "assistant", "content": j.text, "refusal": None},
            "logprobs": lp,
            "finish_reason": j.finish_reason,
        })
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": prep.model,
        "choices": choices,
        "usage": run.usage(),
        "system_fingerprint": None,
    }


def _completion_body(gw: Gateway, run: Run, rid: str) -> dict[str, Any]:
    prep = run.prep
    choices = []
    for j in run.jobs:
        prefix = prep.prompt_texts[j.prompt_index] if prep.echo else ""
        lp = None
        if prep.logprobs:
            lp = gw.completion_logprobs(j.token_ids[: len(j.logprobs)], j.logprobs, j.top_logprobs,
                                        len(prefix), prep.top_logprobs > 0)
        choices.append({"index": j.index, "text": prefix + j.text, "logprobs": lp, "finish_reason": j.finish_reason})
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": prep.model,
        "choices": choices,
        "usage": run.usage(),
        "system_fingerprint": None,
    }
