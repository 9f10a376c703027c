"""PrefillActor: the `prefill_only` role.

It pulls prefill jobs when it has room, checks the KV layout fingerprint, computes the prompt
(its own prefix cache helps), writes the KV into the blocks the decode worker reserved, and
answers with the first token and timings. The writes start from the engine's KV connector
(`JobStreams`, engine/kv_connector.py's sending side), layer by layer while the prompt computes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time

import msgspec
from nats.aio.msg import Msg

from actors.base import WorkerActor, bad_messages
from actors.runner import EngineRunner, StepInbox
from bus.generate_messages import StreamError
from bus.prefill_messages import KVMetaReply, KVMetaRequest, PrefillAccepted, PrefillDone, PrefillJob
from bus.publish import publish, publish_kept, request
from bus.wire import ErrorCode
from engine.kv_connector import KVConnector, RemoteResult
from engine.sequence import Sequence, StepOutput
from kv.layout import KVLayout, LayoutMismatch
from kv.transfer.handles import TransferError
from runtime import metrics
from runtime.metrics import observe_transfer
from runtime.names import check_subject

log = logging.getLogger(__name__)
# jobs in this worker's engine at once: its scheduler runs the shortest first, so a short job that waited
# here for a place would miss steps; more would only take jobs from the pool that other workers could run
MAX_CONCURRENT_JOBS = 4


class PrefillActor(WorkerActor):
    role = "prefill_only"
    replay_kind = "prefill"

    def __init__(self, settings, loaded, health=None):
        super().__init__(settings, loaded, health)
        # keyed by "<request>:<attempt>", the id the job has in our engine too: a retry of a
        # request can reach this worker while its first attempt is still winding down here
        self.jobs: dict[str, PrefillJob] = {}
        self.first_tokens: dict[str, asyncio.Future] = {}
        # targeted jobs (a retry after another prefill worker died, a client's target_endpoint) that
        # came while both places were taken: they wait here, so the cap holds for them too
        self.backlog: collections.deque[PrefillJob] = collections.deque()
        self.peer_incarnations: dict[str, str] = {}  # decode workers whose pool metadata this transfer holds
        self.streams: JobStreams | None = None  # the engine's KV connector, once the model thread runs

    async def start(self) -> None:
        self.streams = self.engine.connector = JobStreams(self.runner)  # before any job: the steps run on another thread
        await self.take_work("prefill", self.subjects.prefill_worker(self.worker_id))

    async def ensure_peer(self, worker_id: str, incarnation: str, endpoint: str | None = None,
                          timeout: float = 5.0) -> None:
        """Fetch a decode worker's transfer metadata from ``endpoint`` (default: its kv_meta subject) unless it
        is held for this incarnation: its pool is where this job's KV goes."""
        if self.peer_incarnations.get(worker_id) == incarnation:
            return
        subject = check_subject(endpoint, "KV endpoint") if endpoint else self.subjects.kv_meta(worker_id)
        reply = await request(self.nc, subject, KVMetaRequest(worker_id=self.worker_id), KVMetaReply, timeout=timeout)
        if reply.incarnation != incarnation:
            raise RuntimeError(f"worker {worker_id} restarted (incarnation {reply.incarnation}, job names {incarnation})")
        await asyncio.to_thread(self.transfer.add_peer, reply.meta)
        self.peer_incarnations[worker_id] = incarnation

    def has_capacity(self) -> bool:
        return len(self.jobs) < MAX_CONCURRENT_JOBS and not self.backlog

    def busy(self) -> bool:
        return bool(self.jobs) or bool(self.backlog)

    def stats(self):
        st = super().stats()
        st.running = len(self.jobs)
        st.queued = len(self.backlog)
        return st

    async def accept(self, msg: Msg, from_pool: bool) -> None:
        job = await self.receive(msg, from_pool, PrefillJob, job_key)
        if job is None:
            return
        if self.draining:  # a targeted job on its way when the drain began: the decode worker retries elsewhere
            await self._refuse(job, ErrorCode.HANDED_BACK, f"prefill worker {self.worker_id} is draining")
            return
        self.backlog.append(job)
        self._start_next()

    def _start_next(self) -> None:
        """Start waiting jobs while there is a place (at most MAX_CONCURRENT_JOBS run), the shortest prompt
        first, as the engine orders its prefills (a short job is not held behind a long one)."""
        while self.backlog and len(self.jobs) < MAX_CONCURRENT_JOBS:
            job = min(self.backlog, key=lambda j: len(j.prompt_ids))
            self.backlog.remove(job)
            self.jobs[job_key(job)] = job
            self.spawn(self._run_job(job))

    async def hand_back(self, everything: bool = False) -> None:
        """Draining: jobs still waiting for a place go back to their decode workers, which retry elsewhere
        (running jobs finish, or end with the process)."""
        while self.backlog:
            job = self.backlog.popleft()
            await self._refuse(job, ErrorCode.HANDED_BACK, f"prefill worker {self.worker_id} is draining")

    async def serve_unclaimed(self, job: PrefillJob, from_pool: bool, error: Exception) -> bool:
        """Never a pool job: its decode worker may have withdrawn it and freed its blocks (its claim of the same
        key won, and this worker could not ask). Refused unwritten: the decode worker tries another prefill
        worker or prefills the prompt itself. A job sent to this worker by name is served, as by any role."""
        if not from_pool:
            return await super().serve_unclaimed(job, from_pool, error)
        await self._refuse(job, ErrorCode.INTERNAL, f"prefill worker {self.worker_id} could not claim the job: {error!r}")
        return False

    async def _answer(self, job: PrefillJob, msg: PrefillAccepted | PrefillDone) -> None:
        """Tell the decode worker (accepted: seq 0, done: seq 1, the last), keeping the answer for a minute
        for a decode worker that missed it and asks again (``bus.replay``)."""
        done = isinstance(msg, PrefillDone)
        await publish_kept(self.nc, self.sent, job_key(job), int(done), job.reply_subject, msg, end=done)

    async def _refuse(self, job: PrefillJob, code: str, message: str) -> None:
        await self._answer(job, PrefillDone(
            request_id=job.request_id, ok=False, prefill_worker_id=self.worker_id, attempt=job.attempt,
            layout_fingerprint=self.layout.fingerprint(), error=message, error_code=code, wrote=False))

    async def answer_bad_work(self, body: dict, error: str) -> None:
        """A prefill job that did not decode gets a failed PrefillDone on the reply subject it names; a
        generate request sent here by mistake gets a StreamError on its stream subject."""
        subject = body.get("reply_subject")
        if not isinstance(subject, str):
            stream = body.get("stream_subject")
            if isinstance(stream, str):
                rid = body.get("request_id")
                await self.publish_stream(stream, StreamError(
                    request_id=rid if isinstance(rid, str) else "", seq=0, code=ErrorCode.BAD_REQUEST, status=400,
                    message=f"{self.subjects.prefill_pool} takes prefill jobs (this looks like a generate request: "
                            f"publish it on {self.subjects.generate_pool}): {error}"), keep=False)
            return
        rid, attempt = body.get("request_id"), body.get("attempt")
        await publish(self.nc, check_subject(subject, "reply_subject"), PrefillDone(
            request_id=rid if isinstance(rid, str) else "", ok=False, prefill_worker_id=self.worker_id,
            attempt=attempt if isinstance(attempt, int) and attempt >= 0 else 0,
            error=f"malformed prefill job: {error}", error_code=ErrorCode.BAD_REQUEST, wrote=False))

    async def _run_job(self, job: PrefillJob) -> None:
        rid, key = job.request_id, job_key(job)
        t_start = time.time()
        timings = {"queue": max(0.0, t_start - job.created)}
        metrics.PREFILL_QUEUE_WAIT.observe(timings["queue"])
        done = PrefillDone(request_id=rid, ok=False, prefill_worker_id=self.worker_id, attempt=job.attempt,
                           layout_fingerprint=self.layout.fingerprint())
        held = False
        stream: LayerStream | None = None
        try:
            await self._answer(job, PrefillAccepted(request_id=rid, attempt=job.attempt,
                                                    prefill_worker_id=self.worker_id, transfer=self._mechanism_to(job)))
            self._check_cancel(rid)
            if job.deadline and time.time() > job.deadline:
                raise _JobError(ErrorCode.DEADLINE_EXCEEDED, "prefill job deadline passed before it started")
            if job.layout_fingerprint != self.layout.fingerprint():
                theirs = KVLayout.from_dict(job.layout) if job.layout else None
                msg = str(LayoutMismatch(self.layout, theirs)) if theirs else (
                    f"KV layout mismatch: ours is {self.layout.describe()}, job's fingerprint is {job.layout_fingerprint}")
                raise _JobError(ErrorCode.LAYOUT_MISMATCH, msg)
            await self.ensure_peer(job.dst.worker_id, job.dst.incarnation, job.dst.endpoint)
            self._check_cancel(rid)
            # one token: the first, sampled (and grammar-masked) exactly as the decode worker would
            params = msgspec.structs.replace(job.sampling, max_tokens=1, ignore_eos=True, stop=[], stop_token_ids=[])
            fut = asyncio.get_running_loop().create_future()
            self.first_tokens[key] = fut
            deadline_mono = time.monotonic() + max(0.0, (job.deadline or time.time() + 60) - time.time())
            stream = LayerStream(self, job, deadline_mono, self._layerwise(job.dst.worker_id))
            await self.runner.call(self._admit, job, params, stream)
            held = True
            remaining = (job.deadline - time.time()) if job.deadline else self.s.prefill_timeout
            out, timings["step"] = await asyncio.wait_for(fut, timeout=max(0.0, remaining))
            t_computed = time.time()
            # the engine steps it was in; the rest of the time it waited behind shorter prompts (engine/scheduler.py)
            wall = t_computed - t_start
            timings["compute"] = min(out.compute_s, wall) if out.compute_s else wall
            timings["queue"] += wall - timings["compute"]
            self._check_cancel(rid)
            await stream.finish()
            timings["transfer"] = time.time() - t_computed
            timings["write"] = stream.seconds
            nbytes = len(job.dst.block_ids) * self.layout.block_bytes
            done.transfer = self.transfer.mechanism(job.dst.worker_id)
            observe_transfer(done.transfer, nbytes, stream.seconds)
            lp = out.logprobs[0] if out.logprobs else None
            done.ok = True
            done.first_token = out.token_ids[0]
            done.first_logprob = lp.logprob if lp else None
            done.first_top_logprobs = lp.top if lp else None
            done.cached_tokens = out.cached_tokens
            metrics.PREFILL_COMPUTE.observe(timings["compute"])
            metrics.PREFILL_TOKENS.labels("cached").inc(out.cached_tokens)
            metrics.PREFILL_TOKENS.labels("computed").inc(len(job.prompt_ids) - out.cached_tokens)
            log.info("prefill %s: %d tokens (%d cached) in %.3fs, transfer %.3fs", rid, len(job.prompt_ids),
                     out.cached_tokens, timings["compute"], timings["transfer"], extra={"request_id": rid})
        except _JobError as e:
            done.error, done.error_code = e.message, e.code
        except TransferError as e:
            done.error, done.error_code = str(e), ErrorCode.TRANSFER_FAILED
            metrics.TRANSFER_FAILURES.labels(self.transfer.mechanism(job.dst.worker_id)).inc()
        except asyncio.TimeoutError:
            done.error, done.error_code = "prefill job deadline passed", ErrorCode.DEADLINE_EXCEEDED
        except Exception as e:  # reported to the decode worker, which retries or falls back
            log.exception("prefill job %s failed", rid, extra={"request_id": rid})
            done.error, done.error_code = f"{type(e).__name__}: {e}", ErrorCode.INTERNAL
        finally:
            self.first_tokens.pop(key, None)
            if stream is not None and not done.ok:
                stream.cancel()  # from this thread, at once: no write starts after this
        # The answer leaves now, not after the model thread's current step: its blocks are let go below.
        done.wrote = bool(stream and stream.handles)
        metrics.PREFILL_JOBS.labels("ok" if done.ok else done.error_code or "error").inc()
        if not done.ok:
            bad_messages.warning(f"prefill failed {done.error_code}", "prefill %s failed (%s): %s", rid,
                                 done.error_code, done.error)
        done.timings = timings
        try:
            await self._answer(job, done)
        finally:
            self.jobs.pop(key, None)
            self._start_next()
            self.changed.set()
            if held:
                await self.runner.call(self._let_go, key)

    def _mechanism_to(self, job: PrefillJob) -> str:
        """The mechanism that will carry this job's KV, if this worker knows the decode worker already."""
        known = self.peer_incarnations.get(job.dst.worker_id) == job.dst.incarnation
        return self.transfer.mechanism(job.dst.worker_id) if known else ""

    def _layerwise(self, peer: str) -> bool:
        mode = self.s.layerwise_transfer
        return mode == "on" or (mode == "auto" and self.transfer.mechanism(peer) != "shm")

    def _block_pairs(self, job: PrefillJob) -> tuple[list[list[int]], list[list[int]]]:
        """Per KV group, our blocks holding the job's prompt and the destination's blocks they go to."""
        local = self.engine.prompt_blocks(job_key(job), job.dst.first_token_index // self.layout.block_size)
        need = sum(len(g) for g in local)
        if need != len(job.dst.block_ids):
            raise _JobError(ErrorCode.BAD_REQUEST, f"destination has {len(job.dst.block_ids)} blocks, the prompt "
                                                   f"needs {need} from token {job.dst.first_token_index}")
        remote, at = [], 0
        for group in local:
            remote.append(list(job.dst.block_ids[at:at + len(group)]))
            at += len(group)
        return local, remote

    def _admit(self, engine, job: PrefillJob, params, stream: LayerStream) -> None:
        """On the model thread: queue the prompt, its K/V shipped by `stream` and its blocks kept for the transfer.
        A layer-wise transfer wants the prompt in one step (all of its compute overlaps the writes); otherwise it
        is chunked like any prompt, so a short job that arrives meanwhile is not held behind a long one
        (engine/scheduler.py)."""
        self.streams.streams[job_key(job)] = stream
        engine.add_request(job_key(job), job.prompt_ids, params, whole_prefill=stream.layerwise)

    def _let_go(self, engine, key: str) -> None:
        """On the model thread: ship nothing more of the job, stop it if it still computes, free its blocks."""
        self.streams.release(key)
        engine.abort(key)

    def _check_cancel(self, rid: str) -> None:
        if rid in self.cancelled_ids:
            raise _JobError(ErrorCode.CANCELLED, "request was cancelled")

    def on_outputs(self, outputs: list[StepOutput], step_s: float) -> None:
        for out in outputs:
            fut = self.first_tokens.get(out.request_id)
            if fut is not None and not fut.done() and out.finish_reason is not None:
                fut.set_result((out, step_s))

    async def on_cancel(self, request_id: str, reason: str) -> None:
        """Stop the request's jobs here; one that arrives later is refused by _check_cancel (cancelled_ids)."""
        for key in [k for k, job in self.jobs.items() if job.request_id == request_id]:
            fut = self.first_tokens.get(key)
            if fut is not None and not fut.done():
                fut.set_exception(_JobError(ErrorCode.CANCELLED, "request was cancelled"))


class JobStreams(KVConnector):
    """The prefill engine's KV connector: the `LayerStream` of each job ships the K/V of the step that completes
    its prompt, layer by layer (`save_layer`, on the model thread), and the job's sequence is kept with its blocks
    until its transfer is over (`release`)."""

    saves_layers = True

    def __init__(self, runner: EngineRunner) -> None:
        self.streams: dict[str, LayerStream] = {}  # by job key, the job's id in the engine
        self._released = StepInbox(runner)  # jobs whose transfer is over

    def save_layer(self, layer: int, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if (stream := self.streams.get(seq.request_id)) is not None:
                stream.on_layer(layer)

    def request_finished(self, seq: Sequence) -> bool:
        return seq.request_id in self.streams

    def finished(self) -> tuple[list[RemoteResult], list[str]]:
        return [], self._released.take()

    def release(self, key: str) -> None:
        """Job ``key`` ships nothing more: the engine may free its blocks at its next step, for which it is woken."""
        if self.streams.pop(key, None) is not None:
            self._released.post(key)


def job_key(job: PrefillJob) -> str:
    """``<request>:<attempt>``: the job's id here, in our engine, and its KV write's notify tag."""
    return f"{job.request_id}:{job.attempt}"


class LayerStream:
    """Ships the job's KV from the model thread while the step that completes the prompt runs.

    Layer-wise, each layer's slices go out as soon as the model has written them (then a
    notify-only write once all have landed); whole, one write of every layer starts right after
    the last layer, carrying the notify tag itself, while the model still samples the first
    token. ``on_layer`` runs on the model thread; ``cancel`` may come from the event loop at any
    time: the lock makes "no write starts after it" hold.
    """

    def __init__(self, actor: PrefillActor, job: PrefillJob, deadline: float, layerwise: bool):
        self.actor, self.job, self.deadline, self.layerwise = actor, job, deadline, layerwise
        self.last_layer = actor.layout.num_layers - 1
        self.handles: list = []
        self.error: Exception | None = None
        self.pairs: tuple[list[list[int]], list[list[int]]] | None = None  # per group: (ours, theirs)
        self.started = 0.0
        self.seconds = 0.0
        self.cancelled = False
        self._lock = threading.Lock()

    def on_layer(self, layer: int) -> None:
        if not self.layerwise and layer != self.last_layer:
            return
        with self._lock:
            if self.error is not None or self.cancelled:
                return
            try:
                if self.pairs is None:
                    self.started = time.time()
                    self.pairs = self.actor._block_pairs(self.job)
                local, remote = self.pairs
                if self.layerwise:  # this layer's slice of its group's blocks
                    group, index = self.actor.layout.group_of[layer]
                    self.handles.append(self._write(local[group], remote[group], "", (index, index + 1)))
                else:
                    self.handles.append(self._write([b for g in local for b in g], [b for g in remote for b in g],
                                                    job_key(self.job), None))
            except Exception as e:  # reported by finish(); the model thread must keep running
                self.error = e

    def _write(self, local: list[int], remote: list[int], notify: str, layers: tuple[int, int] | None):
        return self.actor.transfer.write(self.job.dst.worker_id, local, remote, notify=notify, layers=layers,
                                         deadline=self.deadline, incarnation=self.job.dst.incarnation,
                                         grant=self.job.dst.grant)

    async def finish(self) -> None:
        """Wait for every write (woken by the engine, the loop never blocks), then, layer-wise, send the
        notify; on the first failure cancel the rest (so none lands later) and raise it."""
        try:
            if self.error is not None:
                raise self.error
            if not self.handles:
                raise _JobError(ErrorCode.INTERNAL, "the prompt's last step wrote no KV")
            for h in self.handles:
                await h.wait_async()
            if self.layerwise:
                with self._lock:
                    if self.cancelled:
                        raise _JobError(ErrorCode.CANCELLED, "request was cancelled")
                    bell = self._write([], [], job_key(self.job), None)
                await bell.wait_async()
        except Exception:
            self.cancel()
            raise
        self.seconds = time.time() - self.started if self.started else 0.0

    def cancel(self) -> None:
        """Stop every write still in flight and start none: the job failed, none of its bytes may land later."""
        with self._lock:
            self.cancelled = True
            handles = list(self.handles)
        for h in handles:
            h.cancel()


class _JobError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message
