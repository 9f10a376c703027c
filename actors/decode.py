"""DecodeActor: the `decode_only` and `prefill_and_decode` roles.

It pulls generate requests only when it has a batch slot and free blocks, decides where the
prompt is prefilled (locally, or by a prefill worker that writes the KV into blocks reserved
here), then streams tokens to the gateway's stream subject, one message per engine step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from actors.base import SeenIds, WorkerActor, bad_messages
from bus.demand import DEFERRED_REASONS
from bus.messages import (
    Cancel,
    ErrorCode,
    GenerateRequest,
    KVDestination,
    MessageError,
    PrefillAccepted,
    PrefillDone,
    PrefillJob,
    StreamError,
    StreamFinish,
    StreamTokens,
    Timings,
    Usage,
    WorkerStats,
    decode,
)
from bus.publish import js_publish, publish
from bus.subjects import check_subject, check_token
from engine.engine import LLMEngine, StepOutput
from engine.sampling import TokenLogprob
from engine.sequence import SeqStatus
from kv.blocks import prefix_hashes
from runtime import metrics

log = logging.getLogger(__name__)

PREFILL_ALIVE_S = 3.0  # a prefill worker whose stats are older than this is not offered new work
PREFILL_DEAD_S = 5.0  # ... and one silent this long is presumed dead with our job
QUARANTINE_GRACE_S = 5.0


class RequestFailed(Exception):
    def __init__(self, code: str, message: str, status: int):
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


@dataclass
class Request:
    req: GenerateRequest
    prompt_ids: list[int]
    accepted: float = field(default_factory=time.time)
    seq: int = 0  # next stream sequence number
    mode: str = "local"
    prefill_reason: str = ""
    prefill_worker: str | None = None
    first_token_at: float | None = None
    transfer_s: float = 0.0
    prefill_s: float = 0.0
    in_engine: bool = False
    attempt: int = 0
    job_sent: bool = False  # this attempt's PrefillJob went out: a writer may know its blocks
    attempt_deadline: float = 0.0
    cancelled: bool = False
    done: bool = False
    begun: bool = False  # computing started once (a prefill worker took a job, or the engine placed it)

    @property
    def attempt_tag(self) -> str:
        """``<request>:<attempt>``: the current prefill attempt's key (and its KV write's notify tag)."""
        return f"{self.req.request_id}:{self.attempt}"


class DecodeActor(WorkerActor):
    def __init__(self, settings, loaded, health=None):
        super().__init__(settings, loaded, health)
        self.role = settings.role
        self.requests: dict[str, Request] = {}
        self.prefill_waits: dict[str, asyncio.Future] = {}  # by "<request>:<attempt>"
        self.prefill_takers: dict[str, str] = {}  # "<request>:<attempt>" → the prefill worker that took it
        self.quarantined: dict[str, list[int]] = {}  # blocks a prefill attempt may still write
        self.attempts_over = SeenIds()  # attempts whose writer said it writes no more
        self.prefill_workers: dict[str, tuple[WorkerStats, float]] = {}
        self.landed = SeenIds()  # notify tags of KV writes that have fully arrived
        self.decisions: Counter = Counter()
        self.outbox: asyncio.Queue = asyncio.Queue()

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self.role == "decode_only":
            await self.nc.subscribe(self.subjects.prefill_done_of_worker(self.worker_id), cb=self._on_prefill_done)
            await self.nc.subscribe(f"{self.s.namespace}.stats.prefill_only.*", cb=self._on_prefill_stats)
            await self._discover_prefill()
            self.spawn(self._landing_poller())
        self.spawn(self._emitter())
        self.spawn(self._deadline_watch())
        await self.take_work("generate", self.subjects.generate_worker(self.worker_id))

    def busy(self) -> bool:
        return bool(self.requests) or not self.outbox.empty()

    def stats(self) -> WorkerStats:
        st = super().stats()
        st.running = len(self.requests)
        st.deferred_prefills = sum(1 for r in self.requests.values()
                                   if r.first_token_at is None and r.prefill_reason in DEFERRED_REASONS)
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
        await publish(self.nc, req.stream_subject,
                      StreamTokens(request_id=req.request_id, seq=0, token_ids=[], worker_id=self.worker_id,
                                   incarnation=self.incarnation))
        self.count_decision(mode, reason)
        log.info("request %s: %s prefill (%s), %d prompt tokens", req.request_id, mode, reason, len(r.prompt_ids), extra={"request_id": req.request_id})
        if mode == "remote":
            self.spawn(self._remote_prefill_or_fail(r, target))
        else:  # not awaited: the next message waits for no model step, and counts as held at once (bus/demand.py)
            self.spawn(self._start_local(r))

    async def answer_duplicate(self, item: GenerateRequest, where: str) -> None:
        """Say so on its stream subject: a person who sent the same JSON twice learns to change request_id
        (a gateway, whose ids are unique, ignores this code)."""
        try:
            subject = check_subject(item.stream_subject, "stream_subject")
        except ValueError:
            return
        await publish(self.nc, subject, StreamError(
            request_id=item.request_id, seq=0, code=ErrorCode.DUPLICATE_REQUEST, status=409,
            message=f"request_id {item.request_id!r} was already taken by {where}; this copy is dropped "
                    "(send each request with a new request_id)"))

    async def answer_bad_work(self, body: dict, error: str) -> None:
        """A generate request that did not decode gets a 400 on the stream subject it names."""
        subject = body.get("stream_subject")
        if not isinstance(subject, str):
            return
        rid = body.get("request_id")
        await publish(self.nc, check_subject(subject, "stream_subject"), StreamError(
            request_id=rid if isinstance(rid, str) else "", seq=0, code=ErrorCode.BAD_REQUEST, status=400,
            message=f"malformed generate request: {error}"))

    def count_decision(self, mode: str, reason: str) -> None:
        self.decisions[(mode, reason)] += 1
        metrics.PREFILL_DECISIONS.labels(mode, reason).inc()

    def _validate(self, r: Request) -> None:
        req = r.req
        if not r.prompt_ids and req.prompt:
            r.prompt_ids = self.engine.tokenizer.encode(req.prompt)
        if req.deadline and time.time() > req.deadline:
            raise RequestFailed(ErrorCode.DEADLINE_EXCEEDED, "request deadline passed before it was admitted", 504)
        try:
            self.engine.check_request(r.prompt_ids, req.sampling)
        except ValueError as e:
            raise RequestFailed(ErrorCode.BAD_REQUEST, str(e.args[0]), 400) from e

    def alive_prefill_workers(self) -> dict[str, WorkerStats]:
        """Prefill workers that reported lately and take jobs (a draining one gets none)."""
        now = time.monotonic()
        return {w: st for w, (st, seen) in self.prefill_workers.items()
                if now - seen < PREFILL_ALIVE_S and not st.draining}

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
        uncached = len(r.prompt_ids) - cached
        if uncached <= self.s.local_prefill_max_tokens:
            return "local", "short_prompt", None
        if all(st.queued + st.running >= 2 for st in alive.values()) and self.engine.num_running == 0:
            return "local", "prefill_backlog", None
        return "remote", "long_prompt", None

    async def _start_local(self, r: Request) -> None:
        if r.cancelled:  # dropped while a remote attempt was winding down: nothing may run for it
            return
        r.in_engine = True
        try:
            await self.runner.call(lambda e: e.add_request(r.req.request_id, r.prompt_ids,
                                                           r.req.sampling,
                                                           resume_ids=list(r.req.resume_ids),
                                                           shown_chars=r.req.shown_chars))
        except ValueError as e:
            r.in_engine = False
            await self._fail(r, ErrorCode.BAD_REQUEST, str(e.args[0]), 400)

    # ---------------------------------------------------------------- remote prefill

    async def _remote_prefill_or_fail(self, r: Request, target: str | None) -> None:
        """Run the remote prefill; an unexpected error fails the request instead of leaving it to hang."""
        rid = r.req.request_id
        try:
            await self._remote_prefill(r, target)
        except Exception as e:
            log.exception("request %s: remote prefill crashed", rid, extra={"request_id": rid})
            if await self._drop(rid) is not None:
                await self._fail(r, ErrorCode.INTERNAL, f"remote prefill failed: {type(e).__name__}: {e}", 500)

    async def _remote_prefill(self, r: Request, target: str | None) -> None:
        rid = r.req.request_id
        params = r.req.sampling
        tried: list[str] = []
        t0 = time.time()
        for attempt in range(2):
            if r.cancelled:
                return
            r.attempt, r.job_sent = attempt, False
            reserved = await self.runner.call(lambda e: e.reserve_remote(rid, r.prompt_ids, params))
            if reserved is None:
                self.count_decision("local", "no_blocks_for_remote")
                break
            seq, fresh = reserved
            if r.cancelled:  # the cancel's abandon_remote ran after this reservation
                return
            first_index = seq.num_cached
            t_attempt = time.time()
            try:
                done = await self._run_prefill_job(r, fresh, first_index, target)
            except RequestFailed as f:
                await self.runner.call(lambda e: e.abandon_remote(rid, quarantine=False))
                await self._fail(r, f.code, f.message, f.status)
                return
            finally:
                taker = self.prefill_takers.pop(r.attempt_tag, None)
            if r.cancelled:
                return
            if done is not None and done.ok:
                metrics.REMOTE_PREFILL_WAIT.observe(time.time() - t_attempt)
                r.prefill_worker = done.prefill_worker_id
                r.transfer_s = done.timings.get("transfer", 0.0)
                r.prefill_s = time.time() - t0
                info = None
                if done.first_logprob is not None:
                    info = TokenLogprob(done.first_token, done.first_logprob, list(done.first_top_logprobs or []))
                r.in_engine = True
                await self.runner.call(self._first_token_on_model_thread, rid, done.first_token, info)
                return
            # Failed or timed out: after a timeout, or a failure once writing began, the prefill
            # side may still write into these blocks.
            timed_out = done is None
            blocks = await self.runner.call(LLMEngine.abandon_remote, rid, timed_out or done.wrote)
            self._quarantine(r.attempt_tag, blocks, r.attempt_deadline)
            why = "timed out" if timed_out else f"failed: {done.error}"
            log.warning("request %s: remote prefill attempt %d %s", rid, attempt, why, extra={"request_id": rid})
            self.count_decision("remote_failed", "timeout" if timed_out else done.error_code or "error")
            worker = done.prefill_worker_id if done is not None else taker or target
            if worker:
                tried.append(worker)
            others = [w for w in self.alive_prefill_workers() if w not in tried and w != target]
            target = others[0] if others else None
            if target is None and not self.alive_prefill_workers():
                break
        if r.cancelled:
            return
        if self.s.remote_prefill_fallback == "error":
            await self._fail(r, ErrorCode.WORKER_LOST, "remote prefill failed twice", 503)
            return
        self.count_decision("local", "remote_fallback")
        log.info("request %s: falling back to local prefill", rid, extra={"request_id": rid})
        r.mode = "local"
        await self._start_local(r)

    def _first_token_on_model_thread(self, engine: LLMEngine, rid: str, token: int, info: TokenLogprob | None) -> None:
        """Handed out by the model thread itself, so it cannot fall behind the next step's token."""
        self.runner.hand_out([engine.complete_remote(rid, token, info)])

    async def _run_prefill_job(self, r: Request, fresh: list[int], first_index: int,
                               target: str | None) -> PrefillDone | None:
        """Publish the job and wait for its PrefillDone and for the KV to land. None on timeout."""
        rid = r.req.request_id
        deadline = time.time() + self.s.prefill_timeout
        if r.req.deadline:
            deadline = min(deadline, r.req.deadline)
        tag = r.attempt_tag
        r.attempt_deadline = deadline
        job = PrefillJob(
            request_id=rid, prompt_ids=r.prompt_ids, sampling=r.req.sampling,
            layout_fingerprint=self.layout.fingerprint(), layout=self.layout.to_dict(),
            dst=KVDestination(engine=self.transfer.name, worker_id=self.worker_id, incarnation=self.incarnation,
                              block_ids=fresh, first_token_index=first_index,
                              endpoint=self.subjects.kv_meta(self.worker_id)),
            reply_subject=self.subjects.prefill_done(self.worker_id, rid), deadline=deadline,
            decode_worker_id=self.worker_id, attempt=r.attempt, model=self.model,
        )
        fut = asyncio.get_running_loop().create_future()
        self.prefill_waits[tag] = fut
        try:
            r.job_sent = True
            if target:
                await publish(self.nc, self.subjects.prefill_worker(target), job)
            else:
                await js_publish(self.nc, self.subjects.prefill_pool, job, msg_id=tag)
            done = await self._wait_done(fut, deadline, target, tag)
        finally:
            self.prefill_waits.pop(tag, None)
        if done is None:
            return None
        if not done.ok:
            if done.error_code == ErrorCode.LAYOUT_MISMATCH:
                raise RequestFailed(done.error_code, done.error or "KV layout mismatch", 500)
            return done
        # The writer saw its transfer complete; wait until the bytes are visible here too.
        while tag not in self.landed:
            if time.time() > deadline or r.cancelled:
                return None
            await asyncio.sleep(0.002)
        self.landed.discard(tag)
        return done

    async def _wait_done(self, fut: asyncio.Future, deadline: float, target: str | None,
                         tag: str) -> PrefillDone | None:
        """The PrefillDone, or None at the deadline or once the worker doing job ``tag`` stops reporting.

        That worker is the target, or for a pool job the one whose PrefillAccepted came
        back; a pool job nobody took is given up when no prefill worker is alive.
        """
        while True:
            left = deadline - time.time()
            if left <= 0:
                return None
            try:
                return await asyncio.wait_for(asyncio.shield(fut), timeout=min(left, 0.5))
            except asyncio.TimeoutError:
                pass
            worker = target or self.prefill_takers.get(tag)
            if worker is None and not self.alive_prefill_workers():
                log.warning("no prefill worker is alive to take pool job %s; giving up on it", tag)
                return None
            if worker in self.prefill_workers:
                _, seen = self.prefill_workers[worker]
                if time.monotonic() - seen > PREFILL_DEAD_S:
                    log.warning("prefill worker %s stopped reporting; giving up on its job", worker)
                    return None

    def _quarantine(self, tag: str, blocks: list[int], deadline: float) -> None:
        """Hold blocks until attempt `tag` answers (it has stopped writing) or its deadline passes.

        The answer may already be here: a cancel and the writer's PrefillDone race.
        """
        if not blocks:
            return
        self.quarantined.setdefault(tag, []).extend(blocks)
        over = tag in self.attempts_over
        delay = 0.0 if over else max(0.0, deadline - time.time()) + QUARANTINE_GRACE_S
        self.spawn(self._release_after(tag, delay))

    async def _release_after(self, tag: str, delay: float) -> None:
        await asyncio.sleep(delay)
        await self._release_quarantine(tag)

    async def _release_quarantine(self, tag: str) -> None:
        blocks = self.quarantined.pop(tag, None)
        if blocks:
            await self.runner.call(lambda e: e.release_quarantine(blocks))

    async def _landing_poller(self) -> None:
        """Collect completion notices; NIXL without a progress thread needs this polling."""
        while True:
            waiting = any(r.mode == "remote" and not r.in_engine for r in self.requests.values())
            try:
                for tag in await asyncio.to_thread(self.transfer.completed):
                    self.landed.add(tag)
            except Exception:  # this loop must outlive one bad read, or no remote prefill lands again
                log.exception("reading KV transfer completions failed")
                await asyncio.sleep(0.5)
            await asyncio.sleep(0.001 if waiting else 0.02)

    async def _on_prefill_done(self, msg: Msg) -> None:
        try:
            done = decode(msg.data, PrefillAccepted | PrefillDone)
        except MessageError as e:
            bad_messages.warning("prefill reply", "bad prefill reply on %s: %s", msg.subject, e)
            return
        tag = f"{done.request_id}:{done.attempt}"
        if isinstance(done, PrefillAccepted):
            if tag in self.prefill_waits:
                self.prefill_takers[tag] = done.prefill_worker_id
                r = self.requests.get(done.request_id)
                if r is not None:
                    r.begun = True
            return
        fut = self.prefill_waits.get(tag)
        if fut is not None and not fut.done():
            fut.set_result(done)
        if done.ok or not done.wrote:  # that attempt writes no more
            self.attempts_over.add(tag)
            await self._release_quarantine(tag)

    async def _discover_prefill(self, wait: float = 0.3) -> None:
        """Ask NATS micro discovery for live prefill workers, so we need not wait for their stats."""
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        await self.nc.publish("$SRV.INFO.tandem-prefill-only", b"", reply=inbox)
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            try:
                reply = await sub.next_msg(timeout=left)
            except Exception:  # nats TimeoutError: discovery window over
                break
            if not reply.data:  # "no responders" status: nobody registered yet
                break
            md = json.loads(reply.data).get("metadata", {})
            if md.get("model") == self.model and md.get("worker_id"):
                st = WorkerStats(role="prefill_only", worker_id=md["worker_id"], model=self.model)
                self.prefill_workers.setdefault(md["worker_id"], (st, time.monotonic()))
        await sub.unsubscribe()
        log.info("discovered prefill workers: %s", ", ".join(self.prefill_workers) or "none")

    async def _on_prefill_stats(self, msg: Msg) -> None:
        try:
            st = decode(msg.data, WorkerStats)
        except MessageError:
            return
        self.prefill_workers[st.worker_id] = (st, time.monotonic())

    # ---------------------------------------------------------------- streaming out

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        self.outbox.put_nowait(outputs)

    async def _emitter(self) -> None:
        """One task publishes everything, so a request's messages leave in order."""
        while True:
            outputs = await self.outbox.get()
            for out in outputs:
                r = self.requests.get(out.request_id)
                if r is None or r.cancelled:
                    continue
                try:
                    await self._emit(r, out)
                except Exception as e:  # one bad publish must not stop the others' streams
                    log.error("stream publish for %s failed: %s", out.request_id, e, extra={"request_id": out.request_id})

    async def _emit(self, r: Request, out: StepOutput) -> None:
        rid = r.req.request_id
        now = time.time()
        if out.token_ids or out.text:
            if r.first_token_at is None:
                r.first_token_at = now
                metrics.WORKER_TTFT.observe(now - r.accepted)
            metrics.WORKER_GENERATED_TOKENS.labels(self.role).inc(len(out.token_ids))
            msg = StreamTokens(request_id=rid, seq=r.seq, token_ids=out.token_ids, text=out.text)
            if r.req.sampling.logprobs:
                msg.logprobs = [lp.logprob for lp in out.logprobs]
                msg.top_logprobs = [lp.top for lp in out.logprobs]
            r.seq += 1
            await publish(self.nc, r.req.stream_subject, msg)
        if out.finish_reason is not None:
            first = r.first_token_at or now
            fin = StreamFinish(
                request_id=rid, seq=r.seq, finish_reason=out.finish_reason,
                usage=Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                            cached_tokens=out.cached_tokens),
                timings=Timings(queue=max(0.0, r.accepted - r.req.created), prefill=r.prefill_s or first - r.accepted,
                                transfer=r.transfer_s, decode=now - first),
                prefill_mode=r.mode if self.role == "decode_only" else "aggregate",
                prefill_worker_id=r.prefill_worker, decode_worker_id=self.worker_id,
            )
            r.seq += 1
            self.requests.pop(rid, None)
            await publish(self.nc, r.req.stream_subject, fin)

    async def _fail(self, r: Request, code: str, message: str, status: int) -> None:
        self.requests.pop(r.req.request_id, None)
        log.warning("request %s failed (%s): %s", r.req.request_id, code, message, extra={"request_id": r.req.request_id})
        await publish(self.nc, r.req.stream_subject,
                      StreamError(request_id=r.req.request_id, seq=r.seq, code=code, message=message, status=status))

    # ---------------------------------------------------------------- cancel

    async def on_cancel(self, request_id: str, reason: str) -> None:
        r = await self._drop(request_id)
        if r is None:
            return
        log.info("request %s cancelled (%s)", request_id, reason or "no reason given", extra={"request_id": request_id})
        await publish(self.nc, r.req.stream_subject,
                      StreamFinish(request_id=request_id, seq=r.seq, finish_reason="cancelled",
                                   decode_worker_id=self.worker_id))

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
        r.cancelled = True
        if r.in_engine:
            await self.runner.call(lambda e: e.abort(request_id))
        elif r.mode == "remote":
            tag, deadline = r.attempt_tag, r.attempt_deadline or time.time() + self.s.prefill_timeout
            blocks = await self.runner.call(LLMEngine.abandon_remote, request_id, r.job_sent)
            self._quarantine(tag, blocks, deadline)
        return r

    async def _deadline_watch(self) -> None:
        """A request past its deadline stops here and its client gets a 504, not a late answer; one that
        has not begun by its ``start_by`` (the gateway's admission bound) is dropped with a 503.

        All of them are dropped together, so their aborts reach the model thread before its next step.
        """
        while True:
            await asyncio.sleep(0.25)
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
        if not r.begun and r.first_token_at is None and not (r.mode == "remote" and not r.in_engine):
            seq = self.engine.seqs.get(r.req.request_id)  # read from this thread: one dict lookup, two fields
            r.begun = seq is not None and (seq.status is not SeqStatus.WAITING or seq.num_computed > 0)
        return r.begun or r.first_token_at is not None

    async def _expire(self, rid: str, code: str, message: str, status: int) -> None:
        """Stop ``rid`` here, tell its prefill worker (if a job went out) and its gateway."""
        r = await self._drop(rid)
        if r is None:
            return
        if r.mode == "remote" and r.job_sent and not r.in_engine:
            await publish(self.nc, self.subjects.cancel(rid), Cancel(request_id=rid, reason=code))
        await self._fail(r, code, message, status)

    async def on_bus_lost(self) -> None:
        """NATS is gone: tokens published from now on may be lost, and a gateway that lost NATS too has
        failed its requests already. Stop them all now (no compute for nobody); each gets a
        ``bus_unavailable`` error, delivered when NATS is back, for a gateway still waiting."""
        held = list(self.requests)
        if held:
            log.warning("lost NATS: stopping the %d request(s) held here", len(held))
            results = await asyncio.gather(*(self._expire(rid, ErrorCode.BUS_UNAVAILABLE,
                                                          f"worker {self.worker_id} lost its NATS connection; retry",
                                                          503) for rid in held), return_exceptions=True)
            for e in results:
                if isinstance(e, Exception):  # its error message could not be queued; it is stopped anyway
                    log.warning("while stopping a request after losing NATS: %r", e)
