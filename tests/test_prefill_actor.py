"""Unit tests of the prefill actor's scheduling: the answer does not wait for the model thread, and the
cap of running jobs holds for targeted jobs too (a retry after another prefill worker died), and the shortest
waiting job takes a free place first."""

from __future__ import annotations

import asyncio
import collections
from types import SimpleNamespace
from typing import Any

import msgspec

import actors.prefill
from actors.prefill import MAX_CONCURRENT_JOBS, PrefillActor
from actors.seen import SeenIds
from bus.prefill_messages import KVDestination, PrefillDone, PrefillJob
from bus.replay import SentLog
from engine.params import SamplingParams
from tests.harness.wait import until


def job(n: int = 1) -> PrefillJob:
    return PrefillJob(request_id=f"r{n}", prompt_ids=list(range(20)), sampling=SamplingParams(max_tokens=4),
                      layout_fingerprint="fp", layout={"block_size": 16}, reply_subject=f"tandem.prefill.done.d1.r{n}",
                      dst=KVDestination(engine="tcp", worker_id="d1", incarnation="i", block_ids=[5, 6],
                                        first_token_index=0), decode_worker_id="d1", model="m")


class SlowStepRunner:
    """The model thread: admits at once (and computes the prompt), but letting a job go waits for
    its current step, which the test ends when it wants."""

    def __init__(self, actor: PrefillActor) -> None:
        self.actor = actor
        self.step_over = asyncio.Event()
        self.let_go: list[str] = []

    async def call(self, fn: Any, *args: Any) -> Any:
        if fn == self.actor._admit:
            j, _, stream = args
            key = f"{j.request_id}:{j.attempt}"
            for layer in range(self.actor.layout.num_layers):  # the step's layers, each followed by its hook
                stream.on_layer(layer)
            out = SimpleNamespace(request_id=key, finish_reason="length", token_ids=[42], logprobs=[],
                                  cached_tokens=0, compute_s=0.02)
            asyncio.get_running_loop().call_soon(self.actor.on_outputs, [out], 0.02)
            return None
        await self.step_over.wait()
        self.let_go.append(args[0])
        return None


def bare_prefill_actor() -> PrefillActor:
    actor = object.__new__(PrefillActor)
    actor.worker_id = "p1"
    actor.jobs, actor.first_tokens, actor.backlog = {}, {}, collections.deque()
    actor.cancelled_ids, actor.seen = SeenIds(), SeenIds()
    actor.sent = SentLog()
    actor.tasks = set()
    actor.changed = asyncio.Event()
    actor.draining = False
    actor.layout = SimpleNamespace(fingerprint=lambda: "fp", block_bytes=64, num_layers=2, block_size=16,
                                   group_of=((0, 0), (0, 1)))
    actor.s = SimpleNamespace(layerwise_transfer="off", prefill_timeout=60.0)
    actor.peer_incarnations = {}
    actor.writes = []

    async def landed() -> None:
        return None

    def write(*args: Any, **kw: Any) -> SimpleNamespace:
        actor.writes.append((args, kw))
        return SimpleNamespace(wait_async=landed, cancel=lambda: None)

    actor.transfer = SimpleNamespace(mechanism=lambda peer: "tcp", name="tcp", write=write)
    actor.engine = SimpleNamespace(prompt_blocks=lambda key, first_block: [[0, 1]])
    actor.nc = None
    actor.runner = SlowStepRunner(actor)

    async def ensure_peer(*args: Any) -> None:
        return None

    actor.ensure_peer = ensure_peer
    return actor


def test_prefill_done_leaves_before_the_model_thread_lets_the_job_go(monkeypatch: Any) -> None:
    sent: list[tuple[str, Any, list[str]]] = []

    async def go() -> PrefillActor:
        actor = bare_prefill_actor()

        async def publish_kept(nc: Any, log: Any, key: str, seq: int, subject: str, msg: Any, end: bool = False) -> None:
            assert (key, seq, end) == ("r1:0", int(isinstance(msg, PrefillDone)), isinstance(msg, PrefillDone))
            sent.append((subject, msg, list(actor.runner.let_go)))

        monkeypatch.setattr(actors.prefill, "publish_kept", publish_kept)
        actor.jobs["r1:0"] = job()
        task = asyncio.create_task(actor._run_job(job()))

        def answered() -> bool:
            assert not task.done(), task
            return any(isinstance(m, PrefillDone) for _, m, _ in sent)

        await until(answered, 10, "the PrefillDone", 0.01)
        assert not actor.jobs  # its place is free for the next job already
        actor.runner.step_over.set()  # the model thread's step ends: now it lets the job go
        await asyncio.wait_for(task, 5)
        return actor

    actor = asyncio.run(go())
    done = [(subject, m, let_go) for subject, m, let_go in sent if isinstance(m, PrefillDone)]
    assert len(done) == 1
    subject, msg, let_go_then = done[0]
    assert subject == "tandem.prefill.done.d1.r1" and msg.ok and msg.first_token == 42
    assert msg.timings["step"] == 0.02  # the step that computed the prompt, for the decode worker's timings
    assert let_go_then == []  # published while the step still ran
    assert actor.runner.let_go == ["r1:0"]  # and its blocks were let go afterwards
    # one write of every layer, started from the model thread after the last layer, carrying the notify
    [(args, kw)] = actor.writes
    assert args == ("d1", [0, 1], [5, 6]) and kw["notify"] == "r1:0" and kw["layers"] is None


def test_targeted_jobs_over_the_cap_wait_in_the_backlog_and_the_shortest_starts_first(monkeypatch: Any) -> None:
    async def go() -> None:
        actor = bare_prefill_actor()
        finish: dict[str, asyncio.Event] = {}
        cap = MAX_CONCURRENT_JOBS
        # the first `cap` take the places; of the two that wait, the later one has the shorter prompt
        lengths = [20] * cap + [300, 10]
        jobs = iter([msgspec.structs.replace(job(n + 1), prompt_ids=list(range(k))) for n, k in enumerate(lengths)])

        async def receive(msg: Any, from_pool: bool, type_: Any, key: Any) -> PrefillJob:
            return next(jobs)

        async def run_job(j: PrefillJob) -> None:  # what _run_job does with the place: hold it, give it back
            finish[j.request_id] = asyncio.Event()
            await finish[j.request_id].wait()
            actor.jobs.pop(f"{j.request_id}:{j.attempt}")
            actor._start_next()

        monkeypatch.setattr(actor, "receive", receive)
        monkeypatch.setattr(actor, "_run_job", run_job)
        for _ in lengths:  # targeted jobs at once, as re-sends after a dead worker arrive
            await actor.accept(SimpleNamespace(), from_pool=False)
        await asyncio.sleep(0)
        first = [f"r{n}:0" for n in range(1, cap + 1)]
        assert sorted(actor.jobs) == sorted(first) and len(actor.jobs) == cap
        long_id, short_id = f"r{cap + 1}", f"r{cap + 2}"
        assert [j.request_id for j in actor.backlog] == [long_id, short_id]
        assert not actor.has_capacity()
        finish["r1"].set()
        for _ in range(3):
            await asyncio.sleep(0)
        assert f"{short_id}:0" in actor.jobs and "r1:0" not in actor.jobs  # the shorter one went first
        assert [j.request_id for j in actor.backlog] == [long_id]
        for t in list(actor.tasks):
            t.cancel()

    asyncio.run(go())
