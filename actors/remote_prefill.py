"""Remote prefill, the decode side: a prefill worker computes a prompt into blocks the engine placed here.

`RemotePrefills` is the decode engine's KV connector (engine/kv_connector.py): the engine places a remote
request's prompt when it has the blocks and hands them to `after_allocation`; `RemotePrefill.run()` then sends the
`PrefillJob`, waits for its `PrefillDone` and for the transfer engine to report that the bytes landed, has the
engine place the prompt again for one retry on another prefill worker, and returns an `Outcome`: landed (with the
first token), failed (an error for the client) or fall back (prefill it here). The decode actor tells the engine
the outcome (`settle`), which applies it at its next step (`finished`). Every wait is woken by an event — the
placement, the reply on NATS, the transfer engine's completion descriptor, `abandon()` — never by a sleep loop;
only a transfer engine that sees landings by polling alone (NIXL without a progress thread) is polled, and only
while a write through it is expected.

`RemotePrefills` is also what one decode worker's remote prefills share: the reply subscription, the live prefill
workers (`actors.prefill_workers`), the landings (`actors.landings`), and the quarantine of blocks a writer may
still touch (`actors.quarantine`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.js.errors import APIError, NoStreamResponseError

from actors.base import bad_messages
from actors.landings import Landings
from actors.prefill_choice import count_decision
from actors.prefill_workers import PrefillWorkers
from actors.quarantine import Quarantine, withdraw_job
from actors.runner import EngineRunner, StepInbox
from bus.control_messages import Replay
from bus.generate_messages import GenerateRequest
from bus.prefill_messages import KVDestination, PrefillAccepted, PrefillDone, PrefillJob
from bus.publish import js_publish, publish
from bus.stats_messages import WorkerStats
from bus.subjects import Subjects
from bus.wire import ErrorCode, MessageError, decode
from engine.kv_connector import DROP, LANDED, LOCAL, RETRY, KVConnector, RemoteResult
from engine.sampling import TokenLogprob
from engine.sequence import Sequence
from kv.layout import KVLayout
from kv.transfer.base import TransferEngine
from runtime import metrics
from runtime.settings import Settings

log = logging.getLogger(__name__)

LIVENESS_CHECK_S = 0.5  # how often a wait for a PrefillDone looks at its prefill worker's reports
#: a PrefillDone this late is asked for again, then after twice as long, ... (a NATS failover may have lost it;
#: the prefill worker keeps it)
LATE_ANSWER_S = 2.0

FAILED, FALLBACK, CANCELLED = "failed", "fallback", "cancelled"  # and LANDED, as the engine's


@dataclass
class Outcome:
    """How a remote prefill ended: ``landed`` (``done`` holds the first token), ``failed`` (``code``,
    ``message``, ``status`` for the client), ``fallback`` (prefill it locally) or ``cancelled``
    (the request was dropped; `abandon()` has dealt with the blocks). ``hold``: the tag the placement's
    fresh blocks stay quarantined under ('' none)."""

    kind: str
    done: PrefillDone | None = None
    code: str = ""
    message: str = ""
    status: int = 0
    hold: str = ""


class RemotePrefills(KVConnector):
    """One decode worker's remote prefills: what they share, `prefill()` to start one, and the decode engine's
    KV connector (its methods below `after_allocation` run on the model thread)."""

    def __init__(self, nc: Any, subjects: Subjects, settings: Settings, runner: EngineRunner,
                 transfer: TransferEngine, layout: KVLayout, worker_id: str, incarnation: str, model: str,
                 spawn: Callable[[Coroutine], asyncio.Task]) -> None:
        self.nc, self.subjects, self.s, self.runner = nc, subjects, settings, runner
        self.transfer, self.layout, self.worker_id, self.incarnation, self.model = (
            transfer, layout, worker_id, incarnation, model)
        self.spawn = spawn
        self.workers = PrefillWorkers(model)
        self.landings = Landings(transfer, spawn)
        self.attempts: dict[str, RemotePrefill] = {}  # by "<request>:<attempt>": attempts waiting for a reply
        self.by_request: dict[str, RemotePrefill] = {}  # remote prefills not yet settled
        self.quarantine = Quarantine(transfer, runner, spawn)
        self._results = StepInbox(runner)  # RemoteResults for the engine's next step

    async def start(self) -> None:
        await self.nc.subscribe(self.subjects.prefill_done_of_worker(self.worker_id), cb=self.on_reply)
        await self.nc.subscribe(self.subjects.stats_of_role("prefill_only"), cb=self._on_stats)
        await self.workers.discover(self.nc)
        self.spawn(self.landings.watch())

    def prefill(self, req: GenerateRequest, prompt_ids: list[int], target: str | None) -> RemotePrefill:
        rp = self.by_request[req.request_id] = RemotePrefill(self, req, prompt_ids, target)
        return rp

    # ---------------------------------------------------------------- the engine's KV connector

    def after_allocation(self, seq: Sequence, blocks: list[int]) -> None:
        self.runner.loop.call_soon_threadsafe(self._placed, seq.request_id, seq.num_cached, blocks)

    def placement_ended(self, seq: Sequence) -> str:
        return self.quarantine.placement_ended(seq.request_id)

    def finished(self) -> tuple[list[RemoteResult], list[str]]:
        return self._results.take(), self.quarantine.released()

    # ---------------------------------------------------------------- the same, on the event loop

    def _placed(self, rid: str, first_index: int, blocks: list[int]) -> None:
        rp = self.by_request.get(rid)
        if rp is not None:
            rp.placed(first_index, blocks)

    def end_placement(self, rid: str, outcome: str, hold: str = "", deadline: float = 0.0, mechanism: str = "",
                      first_token: int = 0, info: TokenLogprob | None = None) -> None:
        """Tell the engine how request ``rid``'s placement ended (`engine.kv_connector`'s outcomes), holding its
        fresh blocks under attempt tag ``hold`` (a writer may still touch them) until its writer answers or
        ``deadline`` passes."""
        self.quarantine.when_ended(rid, hold, deadline, mechanism)
        if outcome != RETRY:
            self.by_request.pop(rid, None)
        self._results.post(RemoteResult(rid, outcome, first_token, info))

    def settle(self, rp: RemotePrefill, outcome: Outcome, fallback: bool = True) -> None:
        """Apply a finished `RemotePrefill.run()` in the engine: join the batch, prefill here (``fallback``), or
        drop the request (its owner fails it)."""
        if outcome.kind == LANDED:
            lp = None
            if outcome.done.first_logprob is not None:
                lp = TokenLogprob(outcome.done.first_token, outcome.done.first_logprob,
                                  list(outcome.done.first_top_logprobs or []))
            self.end_placement(rp.rid, LANDED, first_token=outcome.done.first_token, info=lp)
        else:
            self.end_placement(rp.rid, LOCAL if outcome.kind == FALLBACK and fallback else DROP, outcome.hold,
                               rp.deadline, rp.mechanism)

    async def _on_stats(self, msg: Msg) -> None:
        try:
            self.workers.heard(decode(msg.data, WorkerStats))
        except MessageError as e:
            bad_messages.warning("prefill stats", "bad prefill load report on %s: %s", msg.subject, e)

    async def on_reply(self, msg: Msg) -> None:
        """A prefill worker's PrefillAccepted or PrefillDone, for the attempt it names."""
        try:
            reply = decode(msg.data, PrefillAccepted | PrefillDone)
        except MessageError as e:
            bad_messages.warning("prefill reply", "bad prefill reply on %s: %s", msg.subject, e)
            return
        tag = f"{reply.request_id}:{reply.attempt}"
        attempt = self.attempts.get(tag)
        if isinstance(reply, PrefillAccepted):
            if attempt is not None:
                attempt.accepted(reply)
            return
        if attempt is not None:
            attempt.answered(reply)
        if reply.ok or not reply.wrote:  # that attempt writes no more
            self.quarantine.over(tag)

    async def ask_again(self, tag: str, from_seq: int = 0) -> None:
        """Ask the prefill workers to publish their answers to attempt ``tag`` again (from ``from_seq``: 0 the
        acceptance, 1 the PrefillDone): one may have been lost while a NATS client failed over."""
        try:
            await publish(self.nc, self.subjects.replay("prefill"),
                          Replay(key=tag, from_seq=from_seq, requester=self.worker_id))
        except (nats.errors.Error, OSError) as e:  # the bus is away: the next check asks again
            log.info("cannot ask again for the answer to %s: %r", tag, e)

    async def after_reconnect(self, down_since: float) -> None:
        """This worker's own NATS link was down from ``down_since``: that time is not the prefill workers'
        silence, and every attempt waiting for an answer asks for it again (it may have been lost)."""
        latest = max((seen for _, seen in self.workers.reports.values()), default=down_since)
        self.workers.pause(max(down_since, latest))
        for tag, attempt in list(self.attempts.items()):
            await self.ask_again(tag, 1 if attempt.taker else 0)

    async def withdraw(self, seq: int, tag: str) -> None:
        """Take a prefill job nobody took out of the pool (`actors.quarantine.withdraw_job`); a won claim frees its
        quarantined blocks at once instead of at the job's deadline."""
        if await withdraw_job(self.nc, self.subjects, seq, tag, f"{self.worker_id}-withdrew"):
            self.quarantine.over(tag)


class RemotePrefill:
    """One request's remote prefill: up to two attempts, then an `Outcome`."""

    def __init__(self, hub: RemotePrefills, req: GenerateRequest, prompt_ids: list[int], target: str | None) -> None:
        self.hub, self.req, self.prompt_ids, self.target = hub, req, prompt_ids, target
        self.rid = req.request_id
        self.attempt = 0
        self.job_sent = False  # this attempt's PrefillJob went out: a writer may know its blocks
        self.deadline = 0.0  # this attempt's
        self.taker: str | None = None  # the prefill worker that accepted this attempt
        self.mechanism = ""  # how its KV comes (the taker's PrefillAccepted says)
        self.grant = ""  # this attempt's write grant (revoked when it ends)
        self.kv_bytes = 0  # what this attempt's blocks hold
        self.begun = False  # a prefill worker took a job of this request (ever)
        self.cancelled = False
        self._answer: asyncio.Future | None = None  # this attempt's PrefillDone (None: given up)
        # the engine's placement of the prompt for this attempt: (first token index, fresh blocks), None: given up
        self._placement: asyncio.Future = asyncio.get_running_loop().create_future()

    @property
    def tag(self) -> str:
        """``<request>:<attempt>``: the current attempt's key (and its KV write's notify tag)."""
        return f"{self.rid}:{self.attempt}"

    async def run(self) -> Outcome:
        """Up to two attempts, each in blocks the engine placed for it; a failed first one has the engine place the
        prompt again (its blocks held while its writer may still come) for a second on another prefill worker."""
        hub, rid, target = self.hub, self.rid, self.target
        tried: list[str] = []
        for attempt in range(2):
            self.attempt, self.job_sent, self.taker = attempt, False, None
            placed = await self._placement
            if placed is None or self.cancelled:
                return Outcome(CANCELLED)
            first_index, fresh = placed
            t_attempt = time.time()
            done = await self._attempt(fresh, first_index, target)
            if self.cancelled:
                return Outcome(CANCELLED)
            if done is not None and done.ok:
                metrics.REMOTE_PREFILL_WAIT.observe(time.time() - t_attempt)
                return Outcome(LANDED, done=done)
            if done is not None and done.error_code == ErrorCode.LAYOUT_MISMATCH:
                return Outcome(FAILED, done=done, code=done.error_code, message=done.error or "KV layout mismatch",
                               status=500)
            # Failed or timed out: after a timeout, or a failure once writing began, the prefill
            # side may still write into these blocks.
            timed_out = done is None
            held = (timed_out and self.job_sent) or (done is not None and done.wrote)  # a writer may still come
            hold = self.tag if held else ""
            why = "timed out" if timed_out else f"failed: {done.error}"
            log.warning("request %s: remote prefill attempt %d %s", rid, attempt, why, extra={"request_id": rid})
            count_decision("remote_failed", "timeout" if timed_out else done.error_code or "error")
            worker = done.prefill_worker_id if done is not None else self.taker or target
            if worker:
                tried.append(worker)
            others = [w for w in hub.workers.alive() if w not in tried and w != target]
            target = others[0] if others else None
            if attempt == 1 or (target is None and not hub.workers.alive()):
                return Outcome(FALLBACK, hold=hold)
            self._placement = asyncio.get_running_loop().create_future()  # before the engine can place it again
            hub.end_placement(rid, RETRY, hold, self.deadline, self.mechanism)
        raise AssertionError("unreachable: the second attempt returns")

    def placed(self, first_index: int, blocks: list[int]) -> None:
        """The engine placed the prompt (its tokens from ``first_index`` on go into ``blocks``)."""
        if not self._placement.done():
            self._placement.set_result((first_index, blocks))

    async def _attempt(self, fresh: list[int], first_index: int, target: str | None) -> PrefillDone | None:
        """Publish the job and wait for its PrefillDone and for the KV to land. None on timeout or abandon."""
        hub, rid, tag = self.hub, self.rid, self.tag
        deadline = time.time() + hub.s.prefill_timeout
        if self.req.deadline:
            deadline = min(deadline, self.req.deadline)
        self.deadline = deadline
        self.kv_bytes = len(fresh) * hub.layout.block_bytes
        self.grant = grant = hub.transfer.grant(fresh, deadline)  # revoked when it ends: a late write is refused
        job = PrefillJob(
            request_id=rid, prompt_ids=self.prompt_ids, sampling=self.req.sampling,
            layout_fingerprint=hub.layout.fingerprint(), layout=hub.layout.to_dict(),
            dst=KVDestination(engine=hub.transfer.name, worker_id=hub.worker_id, incarnation=hub.incarnation,
                              block_ids=fresh, first_token_index=first_index,
                              endpoint=hub.subjects.kv_meta(hub.worker_id), grant=grant),
            reply_subject=hub.subjects.prefill_done(hub.worker_id, rid), deadline=deadline,
            decode_worker_id=hub.worker_id, attempt=self.attempt, model=hub.model,
        )
        self._answer = asyncio.get_running_loop().create_future()
        hub.attempts[tag] = self
        hub.landings.expect(tag)
        queued = 0  # the job's place in the prefill pool
        try:
            self.job_sent = True
            try:
                if target:
                    await publish(hub.nc, hub.subjects.prefill_worker(target), job)
                else:
                    queued = (await js_publish(hub.nc, hub.subjects.prefill_pool, job, msg_id=tag)).seq
            except (NoStreamResponseError, nats.errors.NoRespondersError) as e:  # no stream leader (an election)
                log.warning("request %s: the prefill pool took no job (%r); trying elsewhere", rid, e,
                            extra={"request_id": rid})
                self.job_sent = False  # it was not stored: nobody will write into these blocks
                return None
            except (nats.errors.TimeoutError, asyncio.TimeoutError, APIError) as e:  # stored or not: unknown
                log.warning("request %s: the prefill pool did not acknowledge the job (%r)", rid, e,
                            extra={"request_id": rid})
                return None
            done = await self._wait_answer(target)
            if done is None and queued and self.taker is None:  # nobody took it: no one should, later
                hub.spawn(hub.withdraw(queued, tag))
            if done is None or not done.ok:
                return done
            # The writer saw its transfer complete; wait until the bytes are visible here too.
            if not await hub.landings.wait(tag, deadline - time.time()):
                return None
            return done
        finally:
            hub.transfer.revoke(grant)
            hub.attempts.pop(tag, None)
            hub.landings.settled(tag)

    async def _wait_answer(self, target: str | None) -> PrefillDone | None:
        """The PrefillDone; None at the deadline, on `abandon()`, or once the worker doing the job stops
        reporting.

        That worker is the target, or for a pool job the one whose PrefillAccepted came back; a
        pool job nobody took is given up when no prefill worker is alive.
        """
        workers, landings = self.hub.workers, self.hub.landings
        asked, ask_every = time.monotonic(), LATE_ANSWER_S
        while True:
            left = self.deadline - time.time()
            if left <= 0:
                return None
            try:
                return await asyncio.wait_for(asyncio.shield(self._answer), timeout=min(left, LIVENESS_CHECK_S))
            except asyncio.TimeoutError:
                pass
            # no answer yet: late (or the KV is here and its answer is not), ask for it again
            now = time.monotonic()
            if now - asked >= ask_every or (self.tag in landings.landed and now - asked >= LIVENESS_CHECK_S):
                asked, ask_every = now, ask_every * 2
                await self.hub.ask_again(self.tag, 1 if self.taker else 0)
            if not self.hub.nc.is_connected:  # our own link is down: their silence says nothing about them
                continue
            worker = target or self.taker
            if worker is None and not workers.alive():
                log.warning("no prefill worker is alive to take pool job %s; giving up on it", self.tag)
                return None
            if worker is not None and workers.silent(worker):
                log.warning("prefill worker %s stopped reporting; giving up on its job", worker)
                return None

    def accepted(self, reply: PrefillAccepted) -> None:
        self.taker = reply.prefill_worker_id
        self.mechanism = reply.transfer
        self.begun = True
        self.hub.landings.expect(self.tag, reply.transfer)

    def answered(self, done: PrefillDone) -> None:
        if self._answer is not None and not self._answer.done():
            self._answer.set_result(done)

    def abandon(self) -> None:
        """The request is dropped (cancel, deadline, drain, lost bus): stop waiting, and — once a job went out —
        have the engine hold its blocks (when it aborts the request) until that attempt answers or its deadline
        passes."""
        self.cancelled = True
        hub, tag = self.hub, self.tag
        if self._answer is not None and not self._answer.done():
            self._answer.set_result(None)
        if not self._placement.done():
            self._placement.set_result(None)
        hub.landings.settled(tag)
        hub.transfer.revoke(self.grant)
        hub.by_request.pop(self.rid, None)
        if self.job_sent:  # the owner aborts the request in the engine next
            hub.quarantine.when_ended(self.rid, tag, self.deadline or time.time() + hub.s.prefill_timeout, self.mechanism)
