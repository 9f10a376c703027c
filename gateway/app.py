"""The FastAPI application: the routes of the OpenAI-compatible API over the tandem bus.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (and
``/v1/models/{id}``), ``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes), ``GET /health``
(the process is up), ``GET /ready`` (NATS is connected and a decode-capable worker of the model
reported within ``alive_after`` seconds), ``GET /metrics`` (Prometheus), ``/openapi.json``; the page
``GET /`` with its files under ``/static/`` (``gateway/web/``) and its cluster view's ``GET /cluster``
(``gateway/cluster.py``).

Each route is short: the body is validated and turned into jobs by ``gateway.prepare``, run on the
bus by ``gateway.run``, and printed by ``gateway.responses``. A streamed response starts only after
every choice produced its first message (or ``STREAM_START_WAIT`` passed), so errors a worker finds
at once (unknown ``target_endpoint``, no capacity) still arrive as an HTTP status; later ones arrive
as an SSE error event, followed by ``data: [DONE]``. A client that goes away cancels its requests on
the bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import nats.errors
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from nats.js.errors import APIError as NatsAPIError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from bus.demand import demands
from bus.options import BusOptions
from bus.subjects import Subjects
from gateway.bus_client import GatewayBus
from gateway.cluster import ClusterView
from gateway.errors import OpenAIError, install_handlers
from gateway.front_door import FrontDoor
from gateway.jobs import Event, Prepared
from gateway.prepare import chat_messages, prepare_chat, prepare_completion, render_chat, tool_set
from gateway.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from gateway.responses import DONE, StreamFormatter, chat_body, completion_body, sse
from gateway.router import WorkerRegistry
from gateway.run import Run
from gateway.service import Gateway
from gateway.textmodel import TextModel, load_text_model
from runtime.metrics import GatewayMetrics
from runtime.settings import GatewayConfig

log = logging.getLogger("tandem.gateway")

T = TypeVar("T")
#: the page's files (shipped in the package)
WEB = Path(__file__).resolve().parent / "web"

#: how long a streamed response waits for every choice's first message before sending headers
STREAM_START_WAIT = 20.0
#: a client's X-Request-Id names the jobs when it is a plain token (it becomes part of NATS subjects)
_JOB_SAFE = re.compile(r"^[A-Za-z0-9_-]{1,96}$")


def create_app(config: GatewayConfig, text: TextModel | None = None) -> FastAPI:
    """Build the app; its lifespan loads the text model (unless given) and connects to NATS."""
    metrics = GatewayMetrics()
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tm = text or await asyncio.to_thread(load_text_model, config.model)
        subjects = Subjects(tm.name, config.namespace)
        registry = WorkerRegistry(subjects.model_token, alive_after=config.alive_after,
                                  load_weight=config.route_load_weight)
        opts = BusOptions.from_env(servers=config.nats_url, connect_timeout=config.connect_timeout)
        bus = GatewayBus(subjects, config.gateway_id, registry, opts, bus_lost_after=config.bus_lost_after)
        await bus.start(ensure=config.ensure_streams, replicas=config.stream_replicas)
        gw = Gateway(config, tm, bus, registry, metrics)
        state["gw"] = gw
        state["cluster"] = ClusterView(gw)
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

    app = FastAPI(
        title="tandem gateway",
        description="OpenAI-compatible API over prefill/decode workers on NATS",
        version="0.1.0",
        lifespan=lifespan,
    )
    install_handlers(app)
    app.add_middleware(FrontDoor, metrics=metrics, max_body_bytes=config.max_body_bytes, api_keys=config.api_keys)

    def gateway() -> Gateway:
        gw = state.get("gw")
        if gw is None:
            raise OpenAIError(503, "the gateway is starting", code="starting", retry_after=1)
        return gw

    # ---- the page --------------------------------------------------------------------
    app.mount("/static", StaticFiles(directory=WEB), name="static")

    @app.get("/", summary="the page: chat, and a live view of the cluster", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(WEB / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/cluster", summary="every worker, the queues, recent KV transfers and prefill decisions")
    async def cluster() -> dict[str, Any]:
        gateway()
        return await state["cluster"].get()

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
            await _export_demand(gw, metrics)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def _model_card(gw: Gateway) -> dict[str, Any]:
        return {
            "id": gw.served_name,
            "object": "model",
            "created": gw.created,
            "owned_by": "tandem",
            "max_model_len": gw.text.max_position,
            # max_tokens of a request that gives none (cut to what the context leaves); None: up to the context
            "default_max_tokens": gw.config.default_max_tokens or None,
            "sampling_defaults": gw.sampling_defaults,
        }

    @app.get("/v1/models", summary="the served model")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(gateway())]}

    @app.get("/v1/models/{model_id:path}", summary="one model")
    async def model(model_id: str) -> dict[str, Any]:
        gw = gateway()
        gw.check_model(model_id)
        return _model_card(gw)

    # ---- tokenizer ---------------------------------------------------------------------
    @app.post("/tokenize", summary="token ids of a prompt or of chat messages (vLLM's shape)")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        gw = gateway()
        if body.model is not None:
            gw.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "send either prompt or messages", param="prompt", code="invalid_value")
        if body.messages is not None:
            chat = ChatCompletionRequest(model=gw.text.name, messages=body.messages, tools=body.tools)
            prompt = render_chat(gw, chat_messages(chat), tool_set(chat), body.add_generation_prompt)
        else:
            prompt = body.prompt
        ids = await asyncio.to_thread(gw.text.tokenizer.encode_prompt, prompt)
        strs = [gw.token_bytes(t)[0] for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": gw.text.max_position, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", summary="the text of token ids (vLLM's shape)")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        gw = gateway()
        if body.model is not None:
            gw.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < gw.text.vocab_size]
        if bad:
            raise OpenAIError(400, f"token id {bad[0]} is outside the vocabulary", param="tokens", code="invalid_value")
        return {"prompt": gw.text.tokenizer.decode(body.tokens, skip_special=False)}

    # ---- completions -------------------------------------------------------------------
    @app.post("/v1/chat/completions", summary="chat completion")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        gw = gateway()
        gw.check_accepting()
        prep = await prepare_chat(gw, body, _target(body.target_endpoint, request),
                                  gw.timeout_of(request.headers.get("x-request-timeout")))
        return await _serve(gw, prep, request, f"chatcmpl-{uuid.uuid4().hex}")

    @app.post("/v1/completions", summary="text completion")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        gw = gateway()
        gw.check_accepting()
        prep = await prepare_completion(gw, body, _target(body.target_endpoint, request),
                                        gw.timeout_of(request.headers.get("x-request-timeout")))
        return await _serve(gw, prep, request, f"cmpl-{uuid.uuid4().hex}")

    def _target(body_value: str | None, request: Request) -> str | None:
        return body_value or request.headers.get("x-target-endpoint") or None

    def _client_id(request: Request, rid: str) -> tuple[str, str]:
        """(the X-Request-Id answered, the prefix of the jobs' ids): the client's id when it sent one
        (its jobs get a short random part too, so two requests reusing an id never share a job id)."""
        given = request.headers.get("x-request-id", "").strip()
        if not given:
            return rid, rid
        if _JOB_SAFE.match(given):
            return given, f"{given}-{uuid.uuid4().hex[:6]}"
        log.info("X-Request-Id %r cannot name bus subjects; its jobs are named %s", given, rid)
        return given, rid

    async def _serve(gw: Gateway, prep: Prepared, request: Request, rid: str) -> Response:
        header_id, jobs_id = _client_id(request, rid)
        run = Run(gw, prep, jobs_id)
        try:
            await run.start()
        except BaseException:
            run.close("dispatch failed")
            raise
        headers = {"X-Request-Id": header_id}
        if prep.stream:
            return await _stream(gw, run, request, rid, headers)
        try:
            await _unless_disconnected(run.collect(), run, request)
        except BaseException:
            run.close("failed")
            raise
        run.close("done")
        _observe(run)
        body = chat_body(gw.token_bytes, run, rid) if prep.kind == "chat" else completion_body(gw.token_bytes, run, rid)
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
        out = StreamFormatter(gw.token_bytes, run, rid)

        async def body() -> AsyncIterator[str]:
            try:
                for line in out.opening():
                    yield line
                for ev in buffered:
                    for line in out.render(ev):
                        yield line
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
                        yield sse(err.body())
                        yield DONE
                        return
                    if ev is None:
                        yield ": keep-alive\n\n"
                        continue
                    for line in out.render(ev):
                        yield line
                _observe(run)
                for line in out.closing():
                    yield line
            finally:
                # normal end, error, or the client went away (this task is cancelled): never awaits
                run.close("client disconnected" if not run.finished else "done")

        return StreamingResponse(
            body(),
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return app


async def _export_demand(gw: Gateway, metrics: GatewayMetrics) -> None:
    """``tandem_demand{role}`` from the pools' lag and the live workers' reports (bus/demand.py)."""
    reports = [i.stats for i in gw.registry.workers.values() if gw.registry.is_alive(i.worker_id)]
    try:
        if not gw.bus.connected:
            raise nats.errors.ConnectionClosedError
        now = await demands(gw.bus.nc, gw.bus.subjects, reports, timeout=1.0)
    except (nats.errors.Error, NatsAPIError, asyncio.TimeoutError) as e:  # stale values are removed, not kept
        log.warning("demand: the pools' lag is unreadable (%r)", e)
        metrics.demand.clear()
        metrics.demand_lag.clear()
        return
    for role, d in now.items():
        metrics.demand.labels(role).set(d.total)
        metrics.demand_lag.labels(role).set(d.lag)


async def _prune(registry: WorkerRegistry) -> None:
    while True:
        await asyncio.sleep(5.0)
        registry.prune()


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body has been read, so receive() waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
