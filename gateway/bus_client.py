"""The gateway's side of the bus: publish generate requests, hear their streams, cancel them.

Why one subscription: every request's tokens arrive on ``tandem.stream.<gateway>.<request>``;
the gateway subscribes once to ``tandem.stream.<gateway>.*`` at start and dispatches each
message by its request id to the queue of the HTTP request that owns it, so there is no
per-request subscribe round trip and no window where a fast worker's first token is lost.
Load reports (``tandem.stats.>``) feed the :class:`~gateway.router.WorkerRegistry`.

Its own link: when every worker falls silent at once, the gateway suspects its connection before the
workers. It asks its member for a ping round trip; none within a second and it fails over to another
member (``bus.connection.force_reconnect``) at once instead of waiting out its pings. While the link is
down or suspect, no worker is judged lost (:attr:`GatewayBus.trusted`); once back, the silence is not
counted against them (``WorkerRegistry.pause``) and every open request asks its worker for what it
missed (``BUS_BACK``). Only after ``bus_lost_after`` seconds away do open requests fail (``BUS_LOST``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import APIError, NoStreamResponseError

from bus.connection import connect, force_reconnect, member_answers
from bus.control_messages import Cancel, Replay
from bus.generate_messages import GenerateRequest, StreamMessage, StreamTokens, sender_of
from bus.options import BusOptions
from bus.publish import js_publish, publish
from bus.stats_messages import WorkerStats
from bus.streams import ensure_streams
from bus.subjects import Subjects, model_token
from bus.wire import MessageError, PayloadTooLarge, decode
from gateway.errors import OpenAIError
from gateway.router import WorkerRegistry

log = logging.getLogger("tandem.gateway.bus")

#: put into every open request's queue when the gateway has been away from NATS for ``bus_lost_after``
BUS_LOST = object()
#: put into every open request's queue when NATS is back: what was published meanwhile is to be asked for
BUS_BACK = object()
#: every worker silent this long: the gateway checks its own link before it judges them
LINK_SUSPECT_S = 2.0
#: ... with a ping round trip that must come back within this
LINK_PING_S = 1.0
#: a suspect link (down, or its round trip inconclusive) is looked at again after this
LINK_RECHECK_S = 0.5


#: a request sent while the gateway fails over to another member waits this long for the connection
FAILOVER_WAIT_S = 5.0
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
        self, subjects: Subjects, gateway_id: str, registry: WorkerRegistry, opts: BusOptions,
        bus_lost_after: float = 20.0,
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
        self._ended: OrderedDict[str, None] = OrderedDict()  # requests whose worker finished them, lately
        self.bus_lost_after = bus_lost_after
        self._lost_timer: asyncio.TimerHandle | None = None
        self._down_since: float | None = None  # registry clock: when the link went down (or fell silent)
        self._verified_at = float("-inf")  # registry clock: the last round trip that proved it while all were silent
        self._epoch = 0  # connections so far: a ping sent on an earlier one proves nothing about this one
        self._watch: asyncio.Task[None] | None = None
        self._up: asyncio.Event | None = None  # set while connected (made on the running loop, in start)

    # ---- life cycle --------------------------------------------------------------------
    async def start(self, ensure: bool = True, replicas: int = 1) -> None:
        """Connect (deadline: ``opts.connect_timeout``), ensure the pool streams (``replicas``), subscribe."""
        self.nc = await connect(self.opts, name=f"gateway-{self.gateway_id}", on_disconnect=self._on_disconnect,
                                on_reconnect=self._on_reconnect)
        if ensure:
            await ensure_streams(self.nc, self.subjects, replicas=replicas)
        await self.nc.subscribe(self.subjects.streams_of_gateway(self.gateway_id), cb=self._on_stream)
        await self.nc.subscribe(self.subjects.stats_all, cb=self._on_stats)
        await self.nc.subscribe(f"{self._inbox}*", cb=self._on_inbox)
        await self.nc.flush(timeout=5)
        self._up = asyncio.Event()
        self._up.set()
        self._watch = asyncio.get_running_loop().create_task(self._watch_link())

    async def close(self) -> None:
        """Cancel what is in flight, then drain the connection (bounded)."""
        if self._watch is not None:
            self._watch.cancel()
        if self._lost_timer is not None:
            self._lost_timer.cancel()
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

    @property
    def trusted(self) -> bool:
        """Whether silence on this link says something about the workers: connected, and either someone
        reported lately or a round trip to the member proved the link lately (while everybody is silent)."""
        if not self.connected:
            return False
        left = self._trusted_for()
        return left is None or left > 0

    # ---- its own link ------------------------------------------------------------------
    async def _watch_link(self) -> None:
        """When every worker has been silent for ``LINK_SUSPECT_S``, ask the member for a round trip; none within
        ``LINK_PING_S`` on the same connection means the link is dead: fail over now. It sleeps until that
        silence would begin (each report moves it on), not on a tick."""
        while True:
            await asyncio.sleep(self._until_suspect())
            try:
                await self._check_link()
            except Exception:  # the watch must outlive one bad check, or no silent worker is judged again
                log.exception("checking the gateway's own NATS link failed")

    def _trusted_for(self) -> float | None:
        """Seconds until silence turns this link suspect (the last report or round trip, plus ``LINK_SUSPECT_S``;
        0 or less: it is); None while no worker ever reported."""
        last = self.registry.last_heard()
        if last is None:
            return None
        return max(last, self._verified_at) + LINK_SUSPECT_S - self.registry.clock()

    def _until_suspect(self) -> float:
        """How long the watch sleeps: until the link turns suspect, ``LINK_RECHECK_S`` once it is."""
        left = self._trusted_for()
        if left is None:  # nobody to judge yet: the first report starts the clock
            return LINK_SUSPECT_S
        return left if left > 0 else LINK_RECHECK_S

    async def _check_link(self) -> None:
        nc = self.nc
        if nc is None or not nc.is_connected or self.registry.last_heard() is None or self.trusted:
            return
        epoch = self._epoch
        if await member_answers(nc, LINK_PING_S):
            self._verified_at = self.registry.clock()
            log.info("no worker reported for %.1fs, but NATS answers: judging the workers", self._silent_s())
            return
        if epoch != self._epoch or self.trusted:  # it reconnected meanwhile, or someone reported
            return
        # silent since the last report, but not longer than this check took to notice (nobody is revived)
        self._down_since = max(self.registry.last_heard() or 0.0,
                               self.registry.clock() - LINK_SUSPECT_S - LINK_PING_S - 0.5)
        await force_reconnect(nc, f"no worker reported for {self._silent_s():.1f}s and the member did not "
                                  f"answer within {LINK_PING_S:g}s")

    def _silent_s(self) -> float:
        last = self.registry.last_heard()
        return 0.0 if last is None else self.registry.clock() - last

    # ---- incoming ----------------------------------------------------------------------
    async def _on_disconnect(self) -> None:
        """Core NATS drops what is published while we are away; the workers keep it, and every open request
        asks for it once we are back. Only a gateway away for ``bus_lost_after`` fails them."""
        if self._up is not None:
            self._up.clear()
        if self._down_since is None:  # the link went silent at most a ping timeout ago (or the last report)
            now, last = self.registry.clock(), self.registry.last_heard()
            self._down_since = max(now - self.opts.silent_after, last if last is not None else now)
        if self._lost_timer is None:
            self._lost_timer = asyncio.get_running_loop().call_later(self.bus_lost_after, self._bus_lost)

    def _bus_lost(self) -> None:
        self._lost_timer = None
        if self.connected:
            return
        log.warning("away from NATS for %.0fs: ending the %d open request(s)", self.bus_lost_after, len(self._routes))
        for queue, tag in list(self._routes.values()):
            queue.put_nowait((tag, BUS_LOST))

    async def _on_reconnect(self) -> None:
        """Back: the time away is not the workers' silence, and every open request asks for what it missed."""
        self._epoch += 1
        if self._up is not None:
            self._up.set()
        if self._lost_timer is not None:
            self._lost_timer.cancel()
            self._lost_timer = None
        if self._down_since is not None:
            self.registry.pause(self._down_since)
            self._down_since = None
        for queue, tag in list(self._routes.values()):
            queue.put_nowait((tag, BUS_BACK))

    async def ask_replay(self, request_id: str, from_seq: int) -> None:
        """Ask the decode workers to publish request ``request_id``'s stream again from message ``from_seq``."""
        nc = self.nc
        if nc is None or not nc.is_connected:
            return  # asked again once back (BUS_BACK)
        try:
            await publish(nc, self.subjects.replay("stream"),
                          Replay(key=request_id, from_seq=from_seq, requester=self.gateway_id))
        except (nats.errors.Error, OSError) as e:
            log.info("cannot ask for request %s's stream again: %r", request_id, e)

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
        if not isinstance(body, StreamTokens) or not rid or rid in self._ended:
            return  # a finish or an error, or a copy of tokens of a request that ended: that worker stopped
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

    def close_request(self, request_id: str, ended: bool = False) -> None:
        """Stop routing ``request_id`` (later messages are dropped); ``ended``: its worker finished it, so
        copies of its messages published again later (a replay) are no reason to cancel it."""
        self._routes.pop(request_id, None)
        if ended:
            self._ended[request_id] = None
            while len(self._ended) > 10_000:
                self._ended.popitem(last=False)

    async def wait_connected(self, timeout: float) -> bool:
        """Until NATS is connected (True), at most ``timeout`` seconds: a failover takes one to three."""
        if self._up is not None and not self.connected:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._up.wait(), timeout)
        return self.connected

    async def submit(self, req: GenerateRequest, worker_id: str | None) -> None:
        """Publish ``req`` to one worker (core) or to the pool (JetStream, de-duplicated by id); while NATS
        fails over to another member, wait for it (up to ``FAILOVER_WAIT_S``).

        Raises :class:`OpenAIError`: 429 when the pool is full, 503 when NATS or JetStream is
        unavailable, 400 when the request is over the server's max_payload.
        """
        nc = self.nc
        if nc is not None and not nc.is_connected and not nc.is_closed:
            await self.wait_connected(FAILOVER_WAIT_S)
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
        self.spawn(self.cancel(request_id, reason))

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a publish in the background (the gateway's close waits a little for these)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _remember_cancel(self, request_id: str) -> None:
        self._cancelled_at[request_id] = time.monotonic()
        self._cancelled_at.move_to_end(request_id)
        while len(self._cancelled_at) > 10_000:
            self._cancelled_at.popitem(last=False)
