"""WorkerActor: what every pipeline role shares.

It connects to NATS, shows itself there (`actors.service`: a NATS micro service, its load every second, its
gauges, the KV metadata prefill workers ask for, what it sent again for a receiver that missed it), hears cancels,
runs the model on its own thread (EngineRunner) and drains on SIGTERM: stop pulling, finish what it holds, then exit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import nats.errors
import uvloop
from nats.aio.msg import Msg

from actors.recent import RecentWork
from actors.runner import EngineRunner
from actors.seen import SeenIds
from actors.service import WorkerService
from bus.connection import connect
from bus.control_messages import Cancel
from bus.generate_messages import StreamMessage, StreamTokens
from bus.options import BusConnectError, BusOptions
from bus.publish import publish, publish_kept
from bus.replay import SentLog
from bus.stats_messages import WorkerStats
from bus.streams import claim, claim_key, ensure_streams, fetch_one, pull_subscription
from bus.subjects import Subjects
from bus.wire import MessageError, PayloadTooLarge, decode
from engine.engine import EngineConfig, LLMEngine
from engine.loader import LoadedModel
from engine.model_files import model_name
from engine.sequence import StepOutput
from kv.transfer.auto import create_engine
from kv.transfer.base import new_incarnation
from runtime.borrowing import lent_cores
from runtime.health import WorkerHealth
from runtime.logs import Throttled
from runtime.names import check_subject
from runtime.settings import Settings

log = logging.getLogger(__name__)
#: bad messages can come at the rate of a flood: one log line per kind per minute
bad_messages = Throttled(log)
T = TypeVar("T")


class WorkerActor:
    role = "worker"
    #: whose replay requests this worker answers (``Subjects.replay``): "stream" (decode) or "prefill"
    replay_kind = ""

    def __init__(self, settings: Settings, loaded: LoadedModel, health: WorkerHealth | None = None):
        self.s = settings
        self.health = health or WorkerHealth(settings.role, settings.worker_id, model_loaded=True)
        self.worker_id = settings.worker_id
        self.loaded = loaded
        self.model = model_name(settings.model)
        self.subjects = Subjects(self.model, settings.namespace)
        self.incarnation = new_incarnation()
        cfg = EngineConfig(
            dtype=settings.dtype, device=settings.device, block_size=settings.block_size,
            num_blocks=settings.num_blocks, max_batch=settings.max_batch, max_step_tokens=settings.max_step_tokens,
            enable_prefix_cache=settings.enable_prefix_cache, speculative=settings.speculative,
            kv_dtype=settings.kv_dtype,
        )
        layout = LLMEngine.layout_for(loaded, cfg)
        self.transfer = create_engine(
            settings.kv_transfer, layout, LLMEngine.pool_blocks(layout, settings.num_blocks), settings.device,
            self.worker_id,
            incarnation=self.incarnation, nixl_backend=settings.nixl_backend, tcp_host=settings.kv_tcp_host,
            tcp_advertise_host=settings.advertise_host,
        )
        self.engine = LLMEngine(loaded, cfg, pool=self.transfer.pool)
        self.layout = self.engine.layout
        self.started = time.time()
        self.recent = RecentWork(self.worker_id)  # its `recent` endpoint: transfers into its pool, decisions
        self.draining = False
        self.stop_event = asyncio.Event()
        #: set when room may have opened or work ended (an engine step, an engine call, a request or job
        #: leaving): the pull loop and the drain look again then, instead of every few milliseconds
        self.changed = asyncio.Event()
        self.tasks: set[asyncio.Task] = set()
        self.seen = SeenIds()
        self.cancelled_ids = SeenIds()  # a cancel can overtake its request queued in the pool
        self.sent = SentLog()  # what it published per request or job, for a receiver that missed some
        self.bus_down_since = 0.0  # monotonic: since when its NATS link was (probably) silent, at the last loss
        self.nc = None
        self.subs: list = []  # subscriptions that bring new work (dropped first when draining)
        self.runner: EngineRunner | None = None
        self.error: BaseException | None = None
        self.service = WorkerService(self)  # its micro service, load reports and gauges

    # ---------------------------------------------------------------- lifecycle

    def serve_forever(self) -> None:
        """The model loop on this (main) thread, the bus on an event loop in a second thread (uvloop's: less
        CPU per message, which the model's threads share the cores with)."""
        loop = uvloop.new_event_loop()
        # a pinned decode worker lends its cores to a prefill worker that borrows them (runtime/borrowing.py)
        lent = lent_cores(self.role, self.s.namespace, self.s.cpus)
        self.runner = EngineRunner(self.engine, loop, self._outputs_from_thread, self.changed.set, lent,
                                   self.s.lend_step_ms / 1000)

        def bus() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.run())
            except BusConnectError as e:  # a plain fact for the operator, no traceback
                log.error("%s %s: %s", self.role, self.worker_id, e)
                self.error = e
            except BaseException as e:  # reported by serve(); the model loop must still end
                log.exception("%s %s: bus side failed", self.role, self.worker_id)
                self.error = e
            finally:
                self.runner.stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: loop.call_soon_threadsafe(self.stop_event.set))
        io = threading.Thread(target=bus, name="bus", daemon=True)
        io.start()
        self.runner.run()
        io.join(60)
        loop.close()

    async def run(self) -> None:
        opts = self.bus_opts = BusOptions.from_env(servers=[u.strip() for u in self.s.nats_url.split(",")])
        self.health.phase = "connecting"
        print(f"{self.worker_id}: connecting to NATS at {self.s.nats_url}", file=sys.stderr, flush=True)
        self.nc = await connect(opts, name=f"tandem-{self.role}-{self.worker_id}", on_disconnect=self.on_bus_lost,
                                on_reconnect=self.on_bus_back)
        self.health.nats_connected = lambda: self.nc is not None and self.nc.is_connected
        await ensure_streams(self.nc, self.subjects, replicas=self.s.stream_replicas)
        await self.nc.subscribe(self.subjects.cancel_all, cb=self._on_cancel_msg)
        if self.replay_kind:
            await self.nc.subscribe(self.subjects.replay(self.replay_kind), cb=self.service.answer_replay)
        await self.service.start()  # the KV metadata endpoint answers before any work of ours can ask it
        await self.start()
        self.service.report_load()
        log.info("%s %s ready: model %s, layout %s, transfer %s", self.role, self.worker_id, self.model,
                 self.layout.describe(), self.transfer.name)
        self.health.phase = "ready"
        print(f"tandem {self.role} {self.worker_id} ready", flush=True)
        await self.stop_event.wait()
        await self.drain()

    async def drain(self) -> None:
        """Stop taking work, finish what we hold (within ``drain_timeout``), then leave the bus."""
        timeout = self.s.drain_timeout
        log.info("%s %s draining", self.role, self.worker_id)
        self.draining = True
        self.health.phase = "draining"
        try:  # tell routers at once rather than at the next 1 Hz tick
            await publish(self.nc, self.subjects.stats(self.role, self.worker_id), self.stats())
        except Exception as e:  # draining anyway
            log.warning("could not announce draining: %s", e)
        await self.stop_taking_work()
        await self.hand_back()
        await self.until(lambda: not self.busy(), timeout)
        if self.busy():
            log.warning("%s %s: drain deadline passed with work in flight; handing it back", self.role,
                        self.worker_id)
            await self.hand_back(everything=True)
        for t in list(self.tasks):
            t.cancel()
        try:
            await asyncio.wait_for(self.service.stop(), 2.0)
        except (asyncio.TimeoutError, Exception) as e:  # leaving anyway; the server forgets us on disconnect
            log.warning("micro service stop: %r", e)
        try:  # our work is done; deliver what we published, then leave
            await self.nc.flush(timeout=3)
        except Exception as e:
            log.warning("NATS flush before close failed: %r", e)
        await self.nc.close()
        self.runner.stop()
        self.transfer.close()
        log.info("%s %s stopped", self.role, self.worker_id)

    # ---------------------------------------------------------------- taking work

    def spawn(self, coro) -> asyncio.Task:
        """A background task of this worker: cancelled when it stops, forgotten when it ends, logged if it fails."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_ended)
        return task

    def _task_ended(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s %s: background task failed", self.role, self.worker_id, exc_info=task.exception())

    async def take_work(self, pool: str, targeted_subject: str) -> None:
        """Pull from `pool` when there is capacity; hear messages sent to this worker alone."""
        self.psub = await pull_subscription(self.nc, self.subjects, pool)
        self.subs.append(await self.nc.subscribe(targeted_subject, cb=self._on_targeted))
        self.spawn(self._pull_loop(pool))

    async def stop_taking_work(self) -> None:
        """Leave the targeted subjects, still taking what the server had already sent (so hand_back sees it)."""
        for sub in self.subs:
            try:
                await asyncio.wait_for(sub.drain(), timeout=5.0)
            except Exception as e:  # its callback keeps running; a draining decode worker hands back what comes
                log.warning("draining subscription %s: %r", sub.subject, e)
        self.subs = []

    async def _pull_loop(self, pool: str) -> None:
        while not self.draining:
            if not self.has_capacity():
                await self.until(self.has_capacity, None)
                continue
            try:
                msg = await fetch_one(self.psub, timeout=1.0)
            except Exception as e:  # reconnecting; the consumer is durable, so just try again
                log.warning("%s pool fetch failed: %s", pool, e)
                await asyncio.sleep(0.5)
                continue
            if msg is None:
                continue
            if self.draining:  # fetched as the drain began: back to the pool for another worker
                await msg.nak()
                break
            try:
                await self.accept(msg, from_pool=True)
            except Exception:  # one bad message must not stop this worker's intake
                log.exception("%s: failed to take a message from %s", self.worker_id, pool)

    async def _on_targeted(self, msg: Msg) -> None:
        await self.accept(msg, from_pool=False)

    async def receive(self, msg: Msg, from_pool: bool, type_: type[T], key: Callable[[T], str]) -> T | None:
        """Decode, acknowledge and claim a work message; None if it is bad or a copy served elsewhere.

        A pool message is acked once decoded (this worker owns it now); an undecodable one is
        terminated so JetStream does not redeliver it, and answered where it names a subject to
        answer on. A copy of work this worker, or another, already took is dropped: the claims
        stream's duplicate window (:func:`bus.streams.claim`) grants each key once.
        """
        try:
            item = decode(msg.data, type_)
        except MessageError as e:
            bad_messages.warning(f"bad {msg.subject}", "dropping an undecodable %s on %s: %s", type_.__name__,
                                 msg.subject, e)
            if from_pool:
                await msg.term()
            await self.answer_malformed(msg.data, str(e))
            return None
        if from_pool:
            await msg.ack()
        k = key(item)
        if not self.seen.add(k):
            log.info("%s %s already handled here; ignoring redelivery", type_.__name__, k,
                     extra={"request_id": item.request_id})
            await self.answer_duplicate(item, "this worker")
            return None
        try:
            first = await claim(self.nc, self.subjects, claim_key(type_, k), self.worker_id, item.request_id)
        except Exception as e:  # NATS or JetStream trouble: the role decides
            return item if await self.serve_unclaimed(item, from_pool, e) else None
        if not first:
            log.info("%s %s was claimed by another worker first; dropping this copy", type_.__name__, k,
                     extra={"request_id": item.request_id})
            await self.answer_duplicate(item, "another worker")
            return None
        return item

    async def serve_unclaimed(self, item: Any, from_pool: bool, error: Exception) -> bool:
        """The claims stream could not be reached: whether to serve ``item`` anyway. Yes by default: serving a
        rare copy twice beats serving nothing."""
        bad_messages.warning("claim", "cannot claim %s %s (%r); serving it unclaimed", type(item).__name__,
                             item.request_id, error)
        return True

    async def answer_duplicate(self, item: object, where: str) -> None:
        """A copy of work ``where`` already took was dropped; a role may say so where the sender listens."""

    async def publish_stream(self, subject: str, msg: StreamMessage, keep: bool = True) -> None:
        """Publish on a request's stream subject, signed with this worker's id and process (the gateway shows only
        what comes from the worker holding the request), and ``keep`` it until the request has been over for a
        minute: a gateway that missed it asks again (:meth:`WorkerService.answer_replay`). Answers about a message
        this worker does not serve (a copy, a malformed one) are not kept: they are not the request's stream."""
        msg.worker_id, msg.incarnation = self.worker_id, self.incarnation
        if not keep:
            await publish(self.nc, check_subject(subject, "stream_subject"), msg)
            return
        await publish_kept(self.nc, self.sent, msg.request_id, msg.seq, check_subject(subject, "stream_subject"), msg,
                           end=not isinstance(msg, StreamTokens))

    async def answer_malformed(self, data: bytes, error: str) -> None:
        """A work message that did not decode but names where to answer (JSON ``stream_subject`` /
        ``reply_subject``) gets an error there; the role knows which message to send."""
        try:
            body = json.loads(data)
        except ValueError:
            return
        if isinstance(body, dict):
            try:
                await self.answer_bad_work(body, error)
            except (ValueError, PayloadTooLarge) as e:  # e.g. the subject it names is not a subject
                bad_messages.warning("answer", "cannot answer a malformed message: %s", e)

    def check_runner(self) -> None:
        if self.runner.failure is not None:
            log.error("model thread died (%s); exiting", self.runner.failure)
            self.stop_event.set()

    # ---------------------------------------------------------------- hooks for roles

    async def start(self) -> None:
        raise NotImplementedError

    def has_capacity(self) -> bool:
        """Room for one more unit of work: only then does the worker pull from its pool."""
        raise NotImplementedError

    async def accept(self, msg: Msg, from_pool: bool) -> None:
        raise NotImplementedError

    def busy(self) -> bool:
        raise NotImplementedError

    async def hand_back(self, everything: bool = False) -> None:
        """Draining: give back work that is cheaper to redo elsewhere than to finish here (``everything``:
        the drain time is over, all that is left goes back)."""

    async def answer_bad_work(self, body: dict, error: str) -> None:
        """Answer a work message that did not decode (``body`` is its JSON), where it names a subject."""

    async def on_bus_lost(self) -> None:
        """NATS went away. The work goes on: what is published meanwhile waits in the client's buffer, and
        what the old connection lost is kept here for whoever asks again (:meth:`WorkerService.answer_replay`)."""
        # noticed now; silent since at most the pings' deadline ago
        self.bus_down_since = time.monotonic() - self.bus_opts.silent_after
        held = self.busy()
        log.warning("%s %s lost its NATS connection; %s", self.role, self.worker_id,
                    "its work goes on and is kept for the receivers" if held else "reconnecting")

    async def on_bus_back(self) -> None:
        """NATS is back (perhaps another member): tell routers at once that this worker is alive."""
        try:
            await publish(self.nc, self.subjects.stats(self.role, self.worker_id), self.stats())
        except (nats.errors.Error, OSError) as e:  # the 1 Hz report follows anyway
            log.warning("load report after reconnecting: %r", e)


    def on_outputs(self, outputs: list[StepOutput], step_s: float) -> None:
        """One engine step's outputs (``step_s``: its wall seconds; 0 for outputs a call made)."""
        raise NotImplementedError

    async def on_cancel(self, request_id: str, reason: str) -> None:
        raise NotImplementedError

    def stats(self) -> WorkerStats:
        """This worker's load report (:meth:`WorkerService.load`); roles add their own fields."""
        return self.service.load()

    # ---------------------------------------------------------------- plumbing

    async def until(self, condition: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until ``condition()`` holds, looking again each time :attr:`changed` is set; False when
        ``timeout`` seconds (None: no limit) passed first."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not condition():
            self.changed.clear()
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return False
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                return condition()
        return True

    def _outputs_from_thread(self, outputs: list[StepOutput], step_s: float) -> None:
        self.check_runner()
        self.changed.set()
        if outputs:
            self.on_outputs(outputs, step_s)

    async def _on_cancel_msg(self, msg: Msg) -> None:
        """Remember the cancel and start acting on it, without waiting for the model thread: cancels
        that arrive together all reach it before its next step."""
        try:
            c = decode(msg.data, Cancel)
        except ValueError as e:
            bad_messages.warning("cancel", "ignoring a bad cancel on %s: %s", msg.subject, e)
            return
        self.cancelled_ids.add(c.request_id)
        self.spawn(self.on_cancel(c.request_id, c.reason))
