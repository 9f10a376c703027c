"""The running request: its jobs on the bus, their streams turned into events, until each ends.

Why apart from the endpoints: chat and text completions differ only in how the prompt is built
(``gateway.prepare``) and how a choice is printed (``gateway.responses``); routing, the per-request
queue, deadlines, worker loss and migration and cancellation are the same. :class:`Run` owns
the bus side of one HTTP request, one :class:`Job` per prompt × ``n``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from bus.generate_messages import GenerateRequest, StreamError, StreamFinish, StreamTokens
from bus.streams import DEFAULT_GENERATE
from bus.wire import ErrorCode
from gateway.bus_client import BUS_BACK, BUS_LOST, FAILOVER_WAIT_S, NoResponders, Unreadable
from gateway.errors import OpenAIError
from gateway.jobs import ASK_AGAIN_MAX_S, ASK_AGAIN_S, Event, Job, Prepared

if TYPE_CHECKING:
    from gateway.service import Gateway

log = logging.getLogger("tandem.gateway")

#: JetStream drops a generate request nobody pulled for this long
POOL_MAX_AGE_S = DEFAULT_GENERATE.max_age
#: worker errors that mean "the request is fine, this worker is not": re-sent elsewhere before any token
_GIVEN_BACK = {
    ErrorCode.HANDED_BACK: "is draining and handed the request back",
}
#: a pool request not taken this long after its ``start_by`` fails here (the worker that pulls it drops it)
START_GRACE_S = 2.0
#: what workers publish on a request's stream subject
_FROM_WORKERS = (StreamTokens, StreamFinish, StreamError, Unreadable)
#: a gap in a stream's sequence numbers is asked for at once and again each second; one not filled for this
#: long (its worker keeps reporting but does not have the messages any more) fails the request
GAP_WAIT_S = 10.0
#: what a Run's wake-up timer puts in its queue: the reader looks at its deadlines and workers again
_WAKE = object()


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
        self._wake: asyncio.TimerHandle | None = None

    # ---- dispatch ----------------------------------------------------------------------
    async def start(self) -> None:
        """Check capacity and publish every job (raises OpenAIError: 429/503/400)."""
        gw = self.gw
        if not gw.bus.connected:  # failing over to another member: a second or three
            await gw.bus.wait_connected(FAILOVER_WAIT_S)
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
        gw.run_started(self)
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
        job.pooled = route.worker_id is None
        job.worker_incarnation = reg.incarnation(route.worker_id) if route.worker_id else ""
        job.route_reason = route.reason
        job.started = job.heard_at = time.monotonic()
        # a pool job no worker named itself for yet is most likely just queued: ask for it seldom
        job.ask_every, job.gap_since = ASK_AGAIN_S if route.worker_id else ASK_AGAIN_MAX_S, None
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
            item = await self._get(wait)
            if item is None:
                continue
            idx, msg = item
            if isinstance(msg, OpenAIError):  # abort(): this run ends here
                raise msg
            job = self.jobs[idx]
            if job.done:
                continue
            if msg is BUS_BACK:  # what was published while the gateway failed over is asked for again
                if job.gap_since is not None:  # the time away does not count against the gap
                    job.gap_since = time.monotonic()
                self._ask_again(job, "reconnect")
                continue
            if isinstance(msg, NoResponders):
                if job.worker_id is not None and msg.request_id == job.request_id:
                    await self._lost(job, job.worker_id, "is not listening (stopped or draining)")
                continue
            if isinstance(msg, StreamError) and msg.code == ErrorCode.DUPLICATE_REQUEST:
                continue  # a copy of this job was dropped by a worker: the job itself runs on
            if isinstance(msg, _FROM_WORKERS) and msg.request_id == job.request_id:
                why = job.holder_mismatch(msg.worker_id, msg.incarnation)
                if why:
                    self.gw.stream_dropped(why, job.request_id, msg.worker_id, msg.incarnation)
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
                gw.stream_dropped("duplicate", job.request_id, msg.worker_id, msg.incarnation)
                return None
            if msg.seq > job.next_seq:  # NATS lost the ones between (a failover): ask for them, show nothing yet
                self._gap(job, msg.seq)
                return None
            self._heard(job)
            job.next_seq = msg.seq + 1
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
                self._gap(job, msg.seq)
                return None
            job.done = True
            gw.bus.close_request(job.request_id, ended=True)
            gw.registry.finished(job.request_id)
            if job.last_token_at is not None and job.first_token_s is not None:
                gw.admission.finished(job.last_token_at - (self.accepted_at + job.first_token_s))
            if msg.finish_reason == "cancelled":
                raise OpenAIError(503, "the request was cancelled by the worker", code="cancelled", retry_after=1)
            job.finish_reason = msg.finish_reason if msg.finish_reason in ("stop", "length") else "stop"
            job.usage = msg.usage
            job.decode_worker = msg.worker_id
            job.prefill = msg.prefill_mode or ""
            if msg.prefill_worker_id:
                job.prefill += f":{msg.prefill_worker_id}"
            job.prefill_reason, job.kv_bytes, job.kv_transfer = msg.prefill_reason, msg.kv_bytes, msg.kv_transfer
            if msg.text:
                job.text_parts.append(msg.text)
            if job.pooled:  # the router learns where its prompt is cached now
                gw.registry.remember(msg.worker_id, job.hashes)
            return Event("finish", job, msg.text, [])
        if isinstance(msg, StreamError):
            if msg.request_id != job.request_id:
                return None
            job.done = True
            gw.bus.close_request(job.request_id, ended=True)
            gw.registry.finished(job.request_id)
            raise OpenAIError(msg.status, msg.message, code=msg.code)
        if isinstance(msg, Unreadable):
            if msg.request_id != job.request_id:
                return None
            raise OpenAIError(502, f"a worker sent a message this gateway cannot read: {msg.error}",
                              code="bad_worker_message")
        if msg is BUS_LOST:
            raise OpenAIError(503, f"the gateway was away from NATS for {gw.config.bus_lost_after:g}s while the "
                              "request ran; retry", code="bus_unavailable", retry_after=2)
        return None

    # ---- what NATS lost ----------------------------------------------------------------
    def _heard(self, job: Job) -> None:
        job.heard_at = time.monotonic()
        job.ask_every, job.gap_since = ASK_AGAIN_S, None

    def _gap(self, job: Job, seq: int | None = None) -> None:
        """Message ``seq`` came while ``job.next_seq`` is due (None: a check of a gap already open): ask for the
        missing ones (once a second), and fail after ``GAP_WAIT_S`` of asking over a working link."""
        now = time.monotonic()
        if job.gap_since is None:
            if seq is None:
                return
            job.gap_since = now
            log.warning("request %s: message %d came while %d is due; asking its worker for the missing ones",
                        job.request_id, seq, job.next_seq, extra={"request_id": job.request_id})
        elif now - job.gap_since > GAP_WAIT_S and self.gw.bus.trusted:
            raise OpenAIError(502, f"lost part of the token stream: message {job.next_seq} did not come again "
                              f"within {GAP_WAIT_S:g}s of asking", code="stream_gap")
        if now - job.asked_at >= 1.0:
            self._ask_again(job, "gap")

    def _ask_again(self, job: Job, reason: str) -> None:
        """Ask the decode workers to publish ``job``'s stream again from its next expected message."""
        job.asked_at = time.monotonic()
        self.gw.metrics.replays.labels(reason).inc()
        self.gw.bus.spawn(self.gw.bus.ask_replay(job.request_id, job.next_seq))

    def _deadline_passed(self) -> OpenAIError:
        return OpenAIError(504, f"the request's deadline of {self.prep.timeout:g}s passed", code="deadline_exceeded")

    async def _check_workers(self) -> None:
        """Once a second: a stream with a gap or silent for a while asks for its messages again; jobs whose
        worker went silent (over a link the gateway trusts) or restarted are handled by :meth:`_lost`; a job
        the pool dropped unread (JetStream ``max_age``) fails."""
        reg, bus = self.gw.registry, self.gw.bus
        now = time.monotonic()
        for job in self.jobs:
            if job.done:
                continue
            if job.gap_since is not None:
                self._gap(job)
            elif now - max(job.heard_at, job.asked_at) >= job.ask_every:
                job.ask_every = min(ASK_AGAIN_MAX_S, job.ask_every * 2)
                self._ask_again(job, "silence")
            if not bus.trusted:  # silence on our own link says nothing about the workers
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
            await self._dispatch(job, exclude=await self._another_worker(job, worker))
            return
        if started and job.migrations < self.gw.config.migration_limit:
            log.warning("request %s: worker %s %s after %d tokens; moving the stream to another worker",
                        job.request_id, worker, why, len(job.token_ids))
            self.gw.bus.cancel_soon(job.request_id, f"worker {worker} {why}")
            job.migrations += 1
            await self._dispatch(job, exclude=await self._another_worker(job, worker))
            return
        raise OpenAIError(503, f"decode worker {worker} {why}", code="worker_lost", retry_after=1)

    async def _another_worker(self, job: Job, lost: str) -> frozenset[str]:
        """Whom ``job`` may not go to (`WorkerRegistry.exclude_after_loss`), waiting within its deadline."""
        wait = min(self.gw.config.worker_wait, max(0.0, self._give_up_at - time.monotonic()))
        return await self.gw.registry.exclude_after_loss(lost, job.worker_incarnation, wait, job.request_id)

    async def _get(self, wait: float) -> tuple[int, Any] | None:
        """The queue's next item, or None after about ``wait`` seconds. One timer wakes the reader, re-armed
        only when it must ring sooner: ``wait_for`` made a task and a timer for every token streamed."""
        try:
            item = self.queue.get_nowait()
        except asyncio.QueueEmpty:
            loop = asyncio.get_running_loop()
            if self._wake is None or self._wake.when() > loop.time() + wait:
                if self._wake is not None:
                    self._wake.cancel()
                self._wake = loop.call_later(wait, self._ring)
            item = await self.queue.get()
        return None if item[1] is _WAKE else item  # it may have rung while the reader was busy elsewhere

    def _ring(self) -> None:
        self._wake = None
        self.queue.put_nowait((-2, _WAKE))

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
        self.gw.run_ended(self)
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        if self._wake is not None:
            self._wake.cancel()
        for job in self.jobs:
            if job.request_id and not job.done:
                self.gw.bus.cancel_soon(job.request_id, reason)
            elif job.request_id:
                self.gw.bus.close_request(job.request_id)
            if job.request_id:
                self.gw.registry.finished(job.request_id)
        self.gw.inflight -= self._counted
        self._counted = 0
