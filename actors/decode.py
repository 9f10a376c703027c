"""DecodeActor: the `decode_only` and `prefill_and_decode` roles.

It pulls generate requests only when it has a batch slot and free blocks, decides where the
prompt is prefilled (locally, or by a prefill worker that writes the KV into blocks reserved
here), then streams tokens to the gateway's stream subject, one message per engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.aio.msg import Msg

from actors.base import WorkerActor, bad_messages
from actors.decode_request import Request, RequestFailed
from actors.prefill_choice import PrefillCosts, choose, count_decision
from actors.remote_prefill import CANCELLED, FAILED, LANDED, RemotePrefills
from bus.control_messages import Cancel
from bus.demand import DEFERRED_REASONS
from bus.generate_messages import GenerateRequest, StreamError, StreamFinish, StreamTokens, Timings, Usage
from bus.publish import publish
from bus.stats_messages import WorkerStats
from bus.wire import ErrorCode
from engine.sequence import SeqStatus, StepOutput
from kv.blocks import prefix_hashes
from runtime import metrics
from runtime.names import check_subject, check_token

log = logging.getLogger(__name__)


class DecodeActor(WorkerActor):
    replay_kind = "stream"

    def __init__(self, settings, loaded, health=None):
        super().__init__(settings, loaded, health)
        self.role = settings.role
        self.requests: dict[str, Request] = {}
        self.arrived = asyncio.Event()  # a request came: its deadline may be the nearest (_deadline_watch)
        self.remote: RemotePrefills | None = None  # decode_only: prefill workers compute the prompts
        self.costs = PrefillCosts()  # what prefills cost here and remotely, for the local/remote choice
        self.outbox: asyncio.Queue = asyncio.Queue()

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self.role == "decode_only":
            self.remote = RemotePrefills(self.nc, self.subjects, self.s, self.runner, self.transfer, self.layout,
                                         self.worker_id, self.incarnation, self.model, self.spawn)
            self.engine.connector = self.remote  # set before any request: the engine's steps run on another thread
            await self.remote.start()
        self.spawn(self._emitter())
        self.spawn(self._deadline_watch())
        await self.take_work("generate", self.subjects.generate_worker(self.worker_id))

    async def on_bus_back(self) -> None:
        await super().on_bus_back()
        if self.remote is not None:  # an answer may have been lost while this worker failed over
            await self.remote.after_reconnect(self.bus_down_since)

    def busy(self) -> bool:
        return bool(self.requests) or not self.outbox.empty()

    def stats(self) -> WorkerStats:
        st = super().stats()
        st.running = len(self.requests)
        st.deferred_prefills = sum(1 for r in self.requests.values()
                                   if r.first_token_at is None and r.prefill_reason in DEFERRED_REASONS)
        st.prefill_workers = len(self.alive_prefill_workers())
        return st

    def has_capacity(self) -> bool:
        e = self.engine
        return len(self.requests) < self.s.max_batch and e.blocks.num_free > 0 and e.num_waiting == 0

    # ---------------------------------------------------------------- admission

    async def accept(self, msg: Msg, from_pool: bool) -> None:
        req = await self.receive(msg, from_pool, GenerateRequest, lambda r: r.request_id)
        if req is None:
            return
        try:
            check_subject(req.stream_subject, "stream_subject")
        except ValueError as e:  # nowhere to answer: say so here and drop it
            bad_messages.warning("stream_subject", "dropping request %r: %s", req.request_id, e)
            return
        if req.request_id in self.cancelled_ids:  # its client left while it sat in the pool
            log.info("request %s was cancelled before it got here; dropping it", req.request_id,
                     extra={"request_id": req.request_id})
            return
        r = Request(req, list(req.prompt_ids))
        if self.draining:  # a targeted request that was on its way when the drain began
            await self._hand_back_one(r)
            return
        self.requests[req.request_id] = r
        self.arrived.set()
        try:
            try:
                check_token(req.request_id, "request_id")
            except ValueError as e:
                raise RequestFailed(ErrorCode.BAD_REQUEST, str(e), 400) from e
            self._validate(r)
            mode, reason, target = self._choose_prefill(r)
        except RequestFailed as f:
            await self._fail(r, f.code, f.message, f.status)
            return
        r.mode, r.prefill_reason = mode, reason
        r.seq = 1
        await self.publish_stream(req.stream_subject, StreamTokens(request_id=req.request_id, seq=0, token_ids=[]))
        count_decision(mode, reason)
        self.recent.decision(req.request_id, mode, reason, len(r.prompt_ids))
        log.info("request %s: %s prefill (%s), %d prompt tokens", req.request_id, mode, reason, len(r.prompt_ids), extra={"request_id": req.request_id})
        if mode == "remote":
            r.remote = self.remote.prefill(req, r.prompt_ids, target)
        # not awaited: the next message waits for no model step, and counts as held at once (bus/demand.py)
        self.spawn(self._start(r))

    async def answer_duplicate(self, item: GenerateRequest, where: str) -> None:
        """Say so on its stream subject: a person who sent the same JSON twice learns to change request_id
        (a gateway, whose ids are unique, ignores this code)."""
        try:
            subject = check_subject(item.stream_subject, "stream_subject")
        except ValueError:
            return
        await self.publish_stream(subject, StreamError(
            request_id=item.request_id, seq=0, code=ErrorCode.DUPLICATE_REQUEST, status=409,
            message=f"request_id {item.request_id!r} was already taken by {where}; this copy is dropped "
                    "(send each request with a new request_id)"), keep=False)

    async def answer_bad_work(self, body: dict, error: str) -> None:
        """A generate request that did not decode gets a 400 on the stream subject it names."""
        subject = body.get("stream_subject")
        if not isinstance(subject, str):
            return
        rid = body.get("request_id")
        await self.publish_stream(subject, StreamError(
            request_id=rid if isinstance(rid, str) else "", seq=0, code=ErrorCode.BAD_REQUEST, status=400,
            message=f"malformed generate request: {error}"), keep=False)

    def _validate(self, r: Request) -> None:
        """The prompt's tokens and the deadline; the rest of the request is checked where it enters the engine
        (`add_request`, on the model thread), which answers a bad one with a 400."""
        req = r.req
        if not r.prompt_ids and req.prompt:
            r.prompt_ids = self.engine.tokenizer.encode_prompt(req.prompt)
        if req.deadline and time.time() > req.deadline:
            raise RequestFailed(ErrorCode.DEADLINE_EXCEEDED, "request deadline passed before it was admitted", 504)

    def alive_prefill_workers(self) -> dict[str, WorkerStats]:
        return self.remote.workers.alive() if self.remote is not None else {}

    def _resolve_target(self, target: str) -> str:
        alive = self.alive_prefill_workers()
        prefix = self.subjects.prefill_pool + "."
        wid = target[len(prefix):] if target.startswith(prefix) else target
        if wid not in alive:
            known = ", ".join(sorted(alive)) or "none"
            raise RequestFailed(ErrorCode.UNKNOWN_TARGET,
                                f"target_endpoint {target!r} is not a live prefill worker (alive: {known})", 400)
        return wid

    def _choose_prefill(self, r: Request) -> tuple[str, str, str | None]:
        """(local|remote, reason, target worker or None for the pool)."""
        target = r.req.target_endpoint
        if r.req.resume_ids:  # a migrated stream: its sampling state (draw index, penalties) lives here
            return "local", "migrated", None
        if self.role != "decode_only":
            if target:
                raise RequestFailed(ErrorCode.UNKNOWN_TARGET,
                                    f"target_endpoint {target!r}: this cluster has no prefill workers "
                                    f"(worker {self.worker_id} prefills locally)", 400)
            return "local", "aggregated", None
        if target:
            return "remote", "target_endpoint", self._resolve_target(target)
        alive = self.alive_prefill_workers()
        if not alive:
            return "local", "no_prefill_worker", None
        cached = self.engine.blocks.peek_prefix(prefix_hashes(r.prompt_ids, self.s.block_size)) * self.s.block_size
        r.uncached = len(r.prompt_ids) - cached
        # jobs a new one waits for: the queued ones and all but one running (a worker runs one job while
        # the previous one's KV is in flight); the 1 Hz reports lag, so a job that just ended counts for nothing
        jobs_ahead = min(st.queued + max(0, st.running - 1) for st in alive.values())
        decoding = sum(1 for q in self.requests.values() if q.first_token_at is not None)
        mode, reason = choose(r.uncached, self.s.local_prefill_max_tokens, self.costs.estimate(r.uncached, jobs_ahead),
                              self.s.prefill_stall_budget_ms / 1000, decoding)
        return mode, reason, None

    async def _start(self, r: Request) -> None:
        """Into the engine: computed here, or (``r.remote``) placed there for a prefill worker to fill."""
        if r.cancelled:  # dropped before it got here: nothing may run for it
            return
        remote = r.remote is not None
        r.in_engine = True
        r.local_started = None if remote else time.time()
        try:
            await self.runner.call(lambda e: e.add_request(r.req.request_id, r.prompt_ids,
                                                           r.req.sampling,
                                                           resume_ids=list(r.req.resume_ids),
                                                           shown_chars=r.req.shown_chars, remote=remote))
        except ValueError as e:
            r.in_engine = False
            if r.remote is not None:
                r.remote.abandon()  # no job went out
                r.remote = None
            await self._fail(r, ErrorCode.BAD_REQUEST, str(e.args[0]), 400)
            return
        if remote:
            await self._prefill_remotely(r)

    # ---------------------------------------------------------------- remote prefill

    async def _prefill_remotely(self, r: Request) -> None:
        """Have a prefill worker compute the prompt, then tell the engine: join the batch, prefill it here, or drop
        it (and fail the request)."""
        rid, rp = r.req.request_id, r.remote
        t0 = time.time()
        try:
            outcome = await rp.run()
        except Exception as e:  # an unexpected error fails the request instead of leaving it to hang
            log.exception("request %s: remote prefill crashed", rid, extra={"request_id": rid})
            if await self._drop(rid) is not None:
                await self._fail(r, ErrorCode.INTERNAL, f"remote prefill failed: {type(e).__name__}: {e}", 500)
            return
        if r.cancelled or outcome.kind == CANCELLED:
            return
        r.remote = None
        fallback = self.s.remote_prefill_fallback != "error"
        self.remote.settle(rp, outcome, fallback)  # the engine applies it at its next step
        if outcome.kind == FAILED:
            await self._fail(r, outcome.code, outcome.message, outcome.status)
            return
        if outcome.kind == LANDED:
            done = outcome.done
            r.prefill_worker = done.prefill_worker_id
            r.transfer_s = done.timings.get("transfer", 0.0)
            r.prefill_step_s = done.timings.get("step", 0.0)
            r.prefill_s = time.time() - t0
            r.kv_bytes, r.kv_transfer = rp.kv_bytes, done.transfer or rp.mechanism
            self.recent.transfer(rid, r.prefill_worker, r.kv_transfer, r.kv_bytes,
                                 done.timings.get("write", r.transfer_s))
            self.costs.saw_remote(r.uncached, done.timings, r.prefill_s)
            return
        if not fallback:
            await self._fail(r, ErrorCode.WORKER_LOST, "remote prefill failed twice", 503)
            return
        count_decision("local", "remote_fallback")
        self.recent.decision(rid, "local", "remote_fallback", len(r.prompt_ids))
        log.info("request %s: falling back to local prefill", rid, extra={"request_id": rid})
        r.mode, r.prefill_reason = "local", "remote_fallback"
        r.local_started = time.time()

    # ---------------------------------------------------------------- streaming out

    def on_outputs(self, outputs: list[StepOutput], step_s: float) -> None:
        self.outbox.put_nowait((outputs, step_s))

    async def _emitter(self) -> None:
        """One task publishes everything, so a request's messages leave in order."""
        while True:
            outputs, step_s = await self.outbox.get()
            for out in outputs:
                r = self.requests.get(out.request_id)
                if r is None or r.cancelled:
                    continue
                try:
                    await self._emit(r, out, step_s)
                except Exception as e:  # one bad publish must not stop the others' streams (kept: asked for again)
                    bad_messages.warning("stream publish", "stream publish for %s failed: %s", out.request_id, e)
            self.changed.set()  # requests may have finished, and the outbox may be empty now

    async def _emit(self, r: Request, out: StepOutput, step_s: float) -> None:
        rid = r.req.request_id
        now = time.time()
        if out.token_ids or out.text:
            if r.first_token_at is None:
                r.first_token_at = now
                r.prefill_step_s = r.prefill_step_s or step_s
                if r.local_started is not None and not r.req.resume_ids:
                    self.costs.saw_local(r.uncached, now - r.local_started)
                metrics.WORKER_TTFT.observe(now - r.accepted)
            metrics.WORKER_GENERATED_TOKENS.labels(self.role).inc(len(out.token_ids))
            msg = StreamTokens(request_id=rid, seq=r.seq, token_ids=out.token_ids, text=out.text)
            if r.req.sampling.logprobs:
                msg.logprobs = [lp.logprob for lp in out.logprobs]
                msg.top_logprobs = [lp.top for lp in out.logprobs]
            r.seq += 1
            await self.publish_stream(r.req.stream_subject, msg)
        if out.finish_reason is not None:
            first = r.first_token_at or now
            fin = StreamFinish(
                request_id=rid, seq=r.seq, finish_reason=out.finish_reason,
                usage=Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                            cached_tokens=out.cached_tokens),
                timings=Timings(queue=max(0.0, r.accepted - r.req.created), prefill=r.prefill_s or first - r.accepted,
                                transfer=r.transfer_s, decode=now - first, prefill_step=r.prefill_step_s),
                prefill_mode=r.mode if self.role == "decode_only" else "aggregate",
                prefill_worker_id=r.prefill_worker, prefill_reason=r.prefill_reason,
                kv_bytes=r.kv_bytes, kv_transfer=r.kv_transfer,
            )
            r.seq += 1
            self.requests.pop(rid, None)
            await self.publish_stream(r.req.stream_subject, fin)

    async def _fail(self, r: Request, code: str, message: str, status: int) -> None:
        self.requests.pop(r.req.request_id, None)
        self.changed.set()
        log.warning("request %s failed (%s): %s", r.req.request_id, code, message, extra={"request_id": r.req.request_id})
        await self.publish_stream(r.req.stream_subject,
                                  StreamError(request_id=r.req.request_id, seq=r.seq, code=code, message=message,
                                              status=status))

    # ---------------------------------------------------------------- cancel

    async def on_cancel(self, request_id: str, reason: str) -> None:
        r = await self._drop(request_id)
        if r is None:
            return
        log.info("request %s cancelled (%s)", request_id, reason or "no reason given", extra={"request_id": request_id})
        metrics.WORKER_CANCELLED.labels(self.role).inc()
        await self.publish_stream(r.req.stream_subject,
                                  StreamFinish(request_id=request_id, seq=r.seq, finish_reason="cancelled"))

    async def hand_back(self, everything: bool = False) -> None:
        """Requests that have not streamed a token go back to their gateway, which re-sends them; at the end
        of the drain time (``everything``) the streaming ones too, which it moves to another worker."""
        for rid in [rid for rid, r in self.requests.items() if everything or r.first_token_at is None]:
            r = await self._drop(rid)
            if r is not None:
                await self._hand_back_one(r)

    async def _hand_back_one(self, r: Request) -> None:
        log.info("request %s handed back (draining)", r.req.request_id, extra={"request_id": r.req.request_id})
        await self._fail(r, ErrorCode.HANDED_BACK, f"worker {self.worker_id} is draining; the request was handed back",
                         503)

    async def _drop(self, request_id: str) -> Request | None:
        """Stop a request wherever it is: in the engine, or waiting for a remote prefill."""
        r = self.requests.pop(request_id, None)
        if r is None:
            return None
        self.changed.set()
        r.cancelled = True
        if r.remote is not None:
            r.remote.abandon()  # first: the engine's abort then holds blocks a writer may still touch
        if r.in_engine:
            await self.runner.call(lambda e: e.abort(request_id))
        return r

    async def _deadline_watch(self) -> None:
        """A request past its deadline stops here and its client gets a 504, not a late answer; one that
        has not begun by its ``start_by`` (the gateway's admission bound) is dropped with a 503.

        All of them are dropped together, so their aborts reach the model thread before its next step.
        """
        while True:
            self.arrived.clear()
            now = time.time()
            due = [t for r in self.requests.values() for t in (r.req.deadline, r.req.start_by) if t and t >= now]
            with contextlib.suppress(asyncio.TimeoutError):  # the next deadline, or a request that may come sooner
                await asyncio.wait_for(self.arrived.wait(), min(due) - now if due else None)
            now = time.time()
            late = [(rid, ErrorCode.DEADLINE_EXCEEDED, "request deadline passed", 504)
                    for rid, r in self.requests.items() if r.req.deadline and now > r.req.deadline]
            late += [(rid, ErrorCode.QUEUE_TIMEOUT, f"the request did not start within its queue time on worker "
                      f"{self.worker_id}; retry", 503)
                     for rid, r in self.requests.items()
                     if r.req.start_by and now > r.req.start_by and not self._begun(r)
                     and not (r.req.deadline and now > r.req.deadline)]
            if late:
                await asyncio.gather(*(self._expire(*item) for item in late))

    def _begun(self, r: Request) -> bool:
        """Whether ``r`` has begun computing (ever): a token, a prefill worker took a job of it, or the
        engine placed it. A request that began is never dropped for its ``start_by``."""
        if r.remote is not None:
            r.begun = r.begun or r.remote.begun
        elif not r.begun and r.first_token_at is None:
            seq = self.engine.seqs.get(r.req.request_id)  # read from this thread: one dict lookup, two fields
            r.begun = seq is not None and (seq.status is not SeqStatus.WAITING or seq.num_computed > 0)
        return r.begun or r.first_token_at is not None

    async def _expire(self, rid: str, code: str, message: str, status: int) -> None:
        """Stop ``rid`` here, tell its prefill worker (if a job went out) and its gateway."""
        r = await self._drop(rid)
        if r is None:
            return
        if r.remote is not None and r.remote.job_sent:
            await publish(self.nc, self.subjects.cancel(rid), Cancel(request_id=rid, reason=code))
        await self._fail(r, code, message, status)
