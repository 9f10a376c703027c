"""The gateway's side of the bus: publish generate requests, hear their streams, cancel them.

Why one subscription: every request's tokens arrive on ``tandem.stream.<gateway>.<request>``;
the gateway subscribes once to ``tandem.stream.<gateway>.*`` at start and dispatches each
message by its request id to the queue of the HTTP request that owns it, so there is no
per-request subscribe round trip and no window where a fast worker's first token is lost.
Load reports (``tandem.stats.>``) feed the :class:`~gateway.router.WorkerRegistry`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import APIError, NoStreamResponseError

from bus.connection import BusOptions, connect
from bus.messages import (
    Cancel,
    GenerateRequest,
    MessageError,
    PayloadTooLarge,
    StreamMessage,
    StreamTokens,
    WorkerStats,
    decode,
    sender_of,
)
from bus.publish import js_publish, publish
from bus.streams import ensure_streams
from bus.subjects import Subjects, model_token
from gateway.errors import OpenAIError
from gateway.router import WorkerRegistry

log = logging.getLogger("tandem.gateway.bus")

#: put into every open request's queue when the NATS connection drops: messages may be lost
BUS_LOST = object()


#: a message for a request nobody here waits for cancels it again after this many seconds
ORPHAN_RECANCEL_S = 5.0


class NoResponders:
    """NATS said nobody subscribes to the worker subject request ``request_id`` was sent to (it left or drains)."""

    def __init__(self, request_id: str, subject: str) -> None:
        self.request_id, self.subject = request_id, subject


class Unreadable:
    """A message on request ``request_id``'s stream that does not parse (e.g. from a newer tandem), with the
    sender it names, if any (only the worker holding the request may fail it this way)."""

    def __init__(self, request_id: str, error: str, worker_id: str = "", incarnation: str = "") -> None:
        self.request_id, self.error, self.worker_id, self.incarnation = request_id, error, worker_id, incarnation

# JetStream API error code for a stream at its max_msgs/max_bytes with discard=new.
_JS_STREAM_FULL = (10077, 10047)


class GatewayBus:
    """NATS connection of one gateway: its id, its stream subscription, the worker registry."""

    def __init__(
        self, subjects: Subjects, gateway_id: str, registry: WorkerRegistry, opts: BusOptions
    ) -> None:
        self.subjects = subjects
        self.gateway_id = gateway_id
        self.registry = registry
        self.opts = opts
        self.nc: Client | None = None
        self._routes: dict[str, tuple[asyncio.Queue[tuple[int, Any]], int]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._prefix = f"{subjects.namespace}.stream.{gateway_id}."
        # targeted requests carry a reply subject here, so NATS reports "no responders" at once
        self._inbox = f"{opts.inbox_prefix}.{gateway_id}."
        self.dropped = 0
        self._cancelled_at: OrderedDict[str, float] = OrderedDict()  # request id → when we last cancelled it

    # ---- life cycle --------------------------------------------------------------------
    async def start(self, ensure: bool = True, replicas: int = 1) -> None:
        """Connect (deadline: ``opts.connect_timeout``), ensure the pool streams (``replicas``), subscribe."""
        self.nc = await connect(self.opts, name=f"gateway-{self.gateway_id}", on_disconnect=self._on_disconnect)
        if ensure:
            await ensure_streams(self.nc, self.subjects, replicas=replicas)
        await self.nc.subscribe(self.subjects.streams_of_gateway(self.gateway_id), cb=self._on_stream)
        await self.nc.subscribe(self.subjects.stats_all, cb=self._on_stats)
        await self.nc.subscribe(f"{self._inbox}*", cb=self._on_inbox)
        await self.nc.flush(timeout=5)

    async def close(self) -> None:
        """Cancel what is in flight, then drain the connection (bounded)."""
        for rid in list(self._routes):
            self.cancel_soon(rid, "gateway shutting down")
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=2.0)
        if self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError, OSError):
                await asyncio.wait_for(self.nc.drain(), 5.0)
            if not self.nc.is_closed:
                with contextlib.suppress(nats.errors.Error, OSError):
                    await self.nc.close()

    @property
    def connected(self) -> bool:
        """Whether NATS is connected right now (False while reconnecting)."""
        return self.nc is not None and self.nc.is_connected

    # ---- incoming ----------------------------------------------------------------------
    async def _on_disconnect(self) -> None:
        """Core NATS does not replay what was published while we were away: every open stream
        may have lost tokens, so each open request is failed (and cancelled) rather than
        silently returning a hole in its text or waiting for its deadline."""
        for queue, tag in list(self._routes.values()):
            queue.put_nowait((tag, BUS_LOST))

    async def _on_stream(self, msg: Msg) -> None:
        rid = msg.subject[len(self._prefix):] if msg.subject.startswith(self._prefix) else ""
        route = self._routes.get(rid)
        if route is None:
            self.dropped += 1
            log.debug("no open request %r for a message on %s (finished or cancelled)", rid, msg.subject)
            self._cancel_orphan(rid, msg.data)
            return
        queue, tag = route
        try:
            body = decode(msg.data, StreamMessage)
        except MessageError as e:  # waiting on would hang the request or show a gap later
            log.warning("bad message on %s: %s", msg.subject, e)
            sender = sender_of(msg.data)
            queue.put_nowait((tag, Unreadable(rid, str(e), sender.worker_id, sender.incarnation)))
            return
        queue.put_nowait((tag, body))

    def _cancel_orphan(self, rid: str, data: bytes) -> None:
        """Tokens for a request nobody here waits for: a worker runs it for nobody, so cancel it (again).

        It happens when a cancel missed that worker: it joined the cluster after the cancel, or
        was cut off from NATS when its request was re-sent elsewhere.
        """
        try:
            body = decode(data, StreamMessage)
        except MessageError:
            return
        if not isinstance(body, StreamTokens) or not rid:
            return  # a finish or an error: that worker stopped by itself
        last = self._cancelled_at.get(rid)
        if last is not None and time.monotonic() - last < ORPHAN_RECANCEL_S:
            return
        log.info("tokens of request %s, which nobody here waits for, from %s; cancelling it", rid,
                 body.worker_id or "its worker", extra={"request_id": rid})
        self.cancel_soon(rid, "nobody waits for this request at its gateway")

    async def _on_inbox(self, msg: Msg) -> None:
        status = (msg.headers or {}).get("Status")
        if status != "503":
            return  # a worker may answer a targeted request some day; nothing to do with it
        rid = msg.subject[len(self._inbox):]
        route = self._routes.get(rid)
        if route is not None:
            queue, tag = route
            queue.put_nowait((tag, NoResponders(rid, (msg.headers or {}).get("Nats-Subject", ""))))

    async def _on_stats(self, msg: Msg) -> None:
        try:
            stats = decode(msg.data, WorkerStats)
        except MessageError as e:
            log.debug("ignoring non-stats message on %s: %s", msg.subject, e)
            return
        same = not stats.model or model_token(stats.model) == self.subjects.model_token
        self.registry.observe(stats, same)

    # ---- requests ----------------------------------------------------------------------
    def open(self, request_id: str, queue: asyncio.Queue[tuple[int, Any]], tag: int) -> str:
        """Route messages of ``request_id`` into ``queue`` as ``(tag, message)``; returns its stream subject."""
        self._routes[request_id] = (queue, tag)
        return self.subjects.stream(self.gateway_id, request_id)

    def close_request(self, request_id: str) -> None:
        """Stop routing ``request_id`` (later messages are dropped)."""
        self._routes.pop(request_id, None)

    async def submit(self, req: GenerateRequest, worker_id: str | None) -> None:
        """Publish ``req`` to one worker (core) or to the pool (JetStream, de-duplicated by id).

        Raises :class:`OpenAIError`: 429 when the pool is full, 503 when NATS or JetStream is
        unavailable, 400 when the request is over the server's max_payload.
        """
        nc = self.nc
        if nc is None or not nc.is_connected:
            raise OpenAIError(503, "the gateway is not connected to NATS", code="bus_unavailable")
        try:
            if worker_id is not None:
                await publish(nc, self.subjects.generate_worker(worker_id), req,
                              reply=self._inbox + req.request_id)
            else:
                await js_publish(nc, self.subjects.generate_pool, req, msg_id=req.request_id, timeout=5.0)
        except PayloadTooLarge as e:
            raise OpenAIError(400, f"the request is too large for the bus: {e}", param="prompt",
                              code="payload_too_large") from e
        except APIError as e:
            if e.err_code in _JS_STREAM_FULL or "maximum" in str(e.description or "").lower():
                raise OpenAIError(429, "the generate queue is full; retry later", code="queue_full") from e
            raise OpenAIError(503, f"JetStream refused the request: {e.description}", code="bus_unavailable") from e
        except (NoStreamResponseError, nats.errors.NoRespondersError) as e:
            raise OpenAIError(
                503, f"no JetStream stream captures {self.subjects.generate_pool}", code="bus_unavailable"
            ) from e
        except (nats.errors.TimeoutError, asyncio.TimeoutError) as e:
            raise OpenAIError(503, "JetStream did not acknowledge the request in time", code="bus_unavailable") from e
        except (nats.errors.ConnectionClosedError, nats.errors.OutboundBufferLimitError) as e:
            raise OpenAIError(503, f"NATS is unavailable: {e!r}", code="bus_unavailable") from e

    async def cancel(self, request_id: str, reason: str) -> None:
        """Tell every worker holding ``request_id`` to stop and free its blocks."""
        self.close_request(request_id)
        self._remember_cancel(request_id)
        nc = self.nc
        if nc is None or nc.is_closed:
            return
        try:
            await publish(nc, self.subjects.cancel(request_id), Cancel(request_id=request_id, reason=reason))
        except (nats.errors.Error, OSError) as e:
            log.warning("cannot publish cancel of %s: %r", request_id, e)

    def cancel_soon(self, request_id: str, reason: str) -> None:
        """:meth:`cancel` from code that must not await (a cancelled task's cleanup)."""
        self.close_request(request_id)
        self._remember_cancel(request_id)
        task = asyncio.get_running_loop().create_task(self.cancel(request_id, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _remember_cancel(self, request_id: str) -> None:
        self._cancelled_at[request_id] = time.monotonic()
        self._cancelled_at.move_to_end(request_id)
        while len(self._cancelled_at) > 10_000:
            self._cancelled_at.popitem(last=False)
