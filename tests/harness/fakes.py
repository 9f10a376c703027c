"""Fake decode workers for the gateway's tests: raw nats-py clients speaking the real bus messages, without weights.

A fake answers with canned text tokenized by the real tokenizer. Behaviours are selected by words in the prompt:

    [error400]   StreamError 400 at once          [busy]     StreamError 503 (overloaded)
    [queuefull]  StreamError 429                  [hang]     never answers
    [slow]       one token every 0.1 s, 300 max   [failmid]  3 tokens, then StreamError 500
    [utf8]       a reply with multi-byte characters, split mid-character by the tokenizer
    [badmsg]     a stream message from a newer schema version (unreadable here)
    [flood]      8 KiB of text per message, 16 MiB in all, then waits to be cancelled
    [gap]        message 3 is kept but not published (NATS lost it); a replay request brings it
    [hole]       message 3 is never made: a gap nobody can fill

A request with ``resume_ids`` (a migrated stream) continues the canned reply after those tokens.

A worker made with ``admit=True`` first sends the admission notice real decode workers send
(message 0: no tokens, its worker id and incarnation).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
from typing import Any

import nats
import nats.errors
from nats.aio.msg import Msg

from bus.control_messages import Cancel, Replay
from bus.generate_messages import GenerateRequest, StreamError, StreamFinish, StreamTokens, Usage
from bus.publish import publish, publish_kept
from bus.replay import SentLog
from bus.stats_messages import WorkerStats
from bus.streams import ensure_streams, fetch_one, pull_subscription
from bus.subjects import Subjects
from bus.wire import ErrorCode, decode, encode, headers
from gateway.textmodel import TextModel
from runtime.names import ROLE_PREFILL_AND_DECODE

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
         "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango"]
UTF8_REPLY = "Grüße aus Köln 🙂 — 日本語のテキスト 🎉 done."


class LoopThread:
    """An asyncio loop in a daemon thread; ``run(coro)`` waits for a result with a deadline."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fake-workers", daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 20.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class FakeWorker:
    """A decode worker that answers with canned text (see the module docstring): the gateway's behaviour under
    every answer a worker can give, in milliseconds and without loading the model."""

    def __init__(self, url: str, subjects: Subjects, text: TextModel, worker_id: str,
                 role: str = ROLE_PREFILL_AND_DECODE, pull_pool: bool = True, max_batch: int = 8,
                 admit: bool = False) -> None:
        self.url = url
        self.subjects = subjects
        self.text = text
        self.worker_id = worker_id
        self.role = role
        self.pull_pool = pull_pool
        self.max_batch = max_batch
        self.admit = admit
        self.requests: list[tuple[str, GenerateRequest]] = []  # (how it arrived: "pool"|"direct", request)
        self.cancels: list[str] = []
        self.active: set[str] = set()
        self.report = True  # publish stats
        self.mute = False  # take requests but never answer
        self.hands_back = False  # answer every request as a draining worker does: handed back
        self.listen_direct = True  # subscribe to its own generate subject
        self.fake_running: int | None = None  # report this many running instead of the truth
        self.incarnation = "inc-1"  # its process; a new value reads as a restart under the same id
        self.dead = False  # stops mid-stream without a word (and without reports, with report=False)
        self.nc: Any = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._cancelled: set[str] = set()
        self.sent = SentLog()  # as a real decode worker keeps its streams for replay requests
        self.replays: list[Replay] = []
        self.tokens_out: dict[str, int] = {}  # request id -> tokens it has streamed

    async def start(self) -> None:
        self.nc = await nats.connect(self.url, name=f"fake-{self.worker_id}", max_reconnect_attempts=-1,
                                     reconnect_time_wait=0.1)
        await ensure_streams(self.nc, self.subjects)
        if self.listen_direct:
            await self.nc.subscribe(self.subjects.generate_worker(self.worker_id), cb=self._direct)
        await self.nc.subscribe(self.subjects.cancel_all, cb=self._cancel)
        await self.nc.subscribe(self.subjects.replay("stream"), cb=self._replay)
        self._tasks.append(asyncio.create_task(self._stats_loop()))
        if self.pull_pool:
            psub = await pull_subscription(self.nc, self.subjects, "generate")
            self._tasks.append(asyncio.create_task(self._pull_loop(psub)))
        await self.nc.flush()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, nats.errors.Error):
                await t
        await self.nc.close()

    def publish_stats_now(self) -> None:
        asyncio.get_running_loop().create_task(self._publish_stats())

    async def _publish_stats(self) -> None:
        stats = WorkerStats(
            role=self.role, worker_id=self.worker_id, model=self.subjects.model,
            running=len(self.active) if self.fake_running is None else self.fake_running,
            queued=0, free_blocks=1000, total_blocks=1024, max_batch=self.max_batch, incarnation=self.incarnation,
        )
        await publish(self.nc, self.subjects.stats(self.role, self.worker_id), stats)

    async def _stats_loop(self) -> None:
        while True:
            if self.report:
                await self._publish_stats()
            await asyncio.sleep(0.2)

    async def _pull_loop(self, psub: Any) -> None:
        while True:
            if len(self.active) >= self.max_batch:
                await asyncio.sleep(0.05)
                continue
            msg = await fetch_one(psub, timeout=0.5)
            if msg is None:
                continue
            await msg.ack()
            self._take(msg, "pool")

    async def _direct(self, msg: Msg) -> None:
        self._take(msg, "direct")

    async def _cancel(self, msg: Msg) -> None:
        c = decode(msg.data, Cancel)
        self.cancels.append(c.request_id)
        self._cancelled.add(c.request_id)

    async def _replay(self, msg: Msg) -> None:
        ask = decode(msg.data, Replay)
        self.replays.append(ask)
        kept = self.sent.since(ask.key, ask.from_seq)
        for subject, data, hdrs in kept[0] if kept else []:
            await self.nc.publish(subject, data, headers=hdrs)

    def _take(self, msg: Msg, how: str) -> None:
        req = decode(msg.data, GenerateRequest)
        self.requests.append((how, req))
        seq = 0
        if self.admit:
            seq = 1
            asyncio.get_running_loop().create_task(self._send(req.stream_subject, StreamTokens(
                request_id=req.request_id, seq=0, token_ids=[])))
        if self.mute:
            return
        if self.hands_back:
            asyncio.get_running_loop().create_task(self._send(req.stream_subject, StreamError(
                request_id=req.request_id, seq=seq, code=ErrorCode.HANDED_BACK, status=503,
                message=f"worker {self.worker_id} is draining; the request was handed back")))
            return
        self.active.add(req.request_id)
        task = asyncio.get_running_loop().create_task(self._serve(req, seq))
        task.add_done_callback(lambda _t, rid=req.request_id: self.active.discard(rid))

    # ---- generation ----------------------------------------------------------------------
    def _reply(self, req: GenerateRequest, prompt: str) -> str:
        if "[utf8]" in prompt:
            return UTF8_REPLY
        if "[slow]" in prompt:
            return " ".join(WORDS * 20)
        s = req.sampling
        if s.temperature == 0:
            return "Paris is the capital of France. It is known for the Eiffel Tower."
        rng = random.Random(s.seed) if s.seed is not None else random.Random()
        return " ".join(rng.choice(WORDS) for _ in range(12)) + "."

    async def _send(self, subject: str, msg: Any, lost: bool = False) -> None:
        """Publish (and keep) a stream message; ``lost``: keep it only, as if NATS had dropped it."""
        msg.worker_id, msg.incarnation = self.worker_id, self.incarnation
        if lost:
            self.sent.record(msg.request_id, subject, msg.seq, encode(msg), headers(msg.request_id))
            return
        await publish_kept(self.nc, self.sent, msg.request_id, msg.seq, subject, msg,
                           end=not isinstance(msg, StreamTokens))

    async def _serve(self, req: GenerateRequest, seq: int) -> None:
        tok = self.text.tokenizer
        prompt = tok.decode(list(req.prompt_ids), skip_special=False)
        rid, subj = req.request_id, req.stream_subject
        if "[badmsg]" in prompt:
            await self.nc.publish(subj, json.dumps({"kind": "stream_tokens", "v": 99, "request_id": rid, "seq": seq,
                                                    "token_ids": [1], "worker_id": self.worker_id,
                                                    "incarnation": self.incarnation}).encode())
            return
        if req.target_endpoint is not None and req.target_endpoint not in ("prefill-1",):
            await self._send(subj, StreamError(request_id=rid, code=ErrorCode.UNKNOWN_TARGET, status=400,
                                               message=f"unknown target_endpoint {req.target_endpoint!r}"))
            return
        for word, status, code in (("[error400]", 400, ErrorCode.BAD_REQUEST),
                                   ("[busy]", 503, ErrorCode.OVERLOADED),
                                   ("[queuefull]", 429, ErrorCode.OVERLOADED)):
            if word in prompt:
                await self._send(subj, StreamError(request_id=rid, code=code, status=status,
                                                   message=f"fake worker says {word}"))
                return
        if "[hang]" in prompt:
            while rid not in self._cancelled:
                await asyncio.sleep(0.05)
            return
        if "[flood]" in prompt:
            chunk = "flood " * 1365
            while rid not in self._cancelled and seq < 2000:  # 16 MiB: more than the sockets buffer
                await self._send(subj, StreamTokens(request_id=rid, seq=seq, token_ids=[7], text=chunk))
                seq += 1
                await asyncio.sleep(0.001 if seq % 20 == 0 else 0)
            while rid not in self._cancelled:
                await asyncio.sleep(0.05)
            return
        s = req.sampling
        ids = tok.encode(self._reply(req, prompt))
        delay = 0.1 if "[slow]" in prompt else 0.0
        # a migrated stream goes on where the dead worker stopped (its reply is deterministic)
        emitted = req.shown_chars
        out: list[int] = list(req.resume_ids)
        finish = "stop"
        for i, tid in enumerate(ids):
            if i < len(out):
                continue
            if self.dead:  # killed: not a word more, not even a finish
                return
            if rid in self._cancelled:
                await self._send(subj, StreamFinish(request_id=rid, seq=seq, finish_reason="cancelled"))
                return
            if "[failmid]" in prompt and i == 3:
                await self._send(subj, StreamError(request_id=rid, seq=seq, code=ErrorCode.INTERNAL, status=500,
                                                   message="fake worker failed mid-stream"))
                return
            out.append(tid)
            text = tok.decode(out)
            stopped = False
            hits = [text.find(st) for st in s.stop if st in text]
            if hits:
                text, stopped = text[: min(hits)], True
            end = len(text)
            if not stopped:
                while end > emitted and text[end - 1] == "\ufffd":
                    end -= 1
                for st in s.stop:
                    for k in range(min(len(st) - 1, end - emitted), 0, -1):
                        if text[end - k: end] == st[:k]:
                            end -= k
                            break
            delta = text[emitted:end] if end > emitted else ""
            emitted = max(emitted, end)
            lps = tops = None
            if s.logprobs:
                lps = [-0.25 - 0.01 * i]
                tops = [[(tid, lps[0]), (min(tid + 1, 49151), -3.0)][: s.top_logprobs]]
            hole = "[hole]" in prompt and seq == 3
            if not hole:
                await self._send(subj, StreamTokens(request_id=rid, seq=seq, token_ids=[tid], text=delta,
                                                    logprobs=lps, top_logprobs=tops),
                                 lost="[gap]" in prompt and seq == 3)
                self.tokens_out[rid] = self.tokens_out.get(rid, 0) + 1
            seq += 1
            if stopped:
                break
            if len(out) >= s.max_tokens:
                finish = "length"
                break
            if delay:
                await asyncio.sleep(delay)
        else:
            tail = tok.decode(out)[emitted:]
            if tail:
                await self._send(subj, StreamTokens(request_id=rid, seq=seq, token_ids=[], text=tail))
                seq += 1
        usage = Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=len(out), cached_tokens=0)
        await self._send(subj, StreamFinish(request_id=rid, seq=seq, finish_reason=finish, usage=usage,
                                            prefill_mode="aggregate"))
