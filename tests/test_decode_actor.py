"""Unit tests of the decode actor's bookkeeping: quarantined blocks, dropped requests, work that arrives while draining.

A cancel reaches the decode worker and the prefill worker at once; the prefill worker's
"I wrote nothing" answer can be handled before the decode worker has finished quarantining
the blocks. Either order must free them at once; only a writer that began writing keeps
them until the attempt's deadline.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from actors.base import SeenIds
from actors.decode import DecodeActor, Request
from bus.messages import ErrorCode, GenerateRequest, PrefillDone, StreamError, WorkerStats, decode, encode


class RecordingRunner:
    """Stands in for the model thread: runs each call on a stub engine that records releases."""

    def __init__(self) -> None:
        self.released: list[int] = []
        self.engine = SimpleNamespace(release_quarantine=self.released.extend)

    async def call(self, fn, *args):
        await asyncio.sleep(0)
        return fn(self.engine, *args)


def bare_decode_actor() -> DecodeActor:
    actor = object.__new__(DecodeActor)
    actor.quarantined, actor.prefill_waits, actor.prefill_takers = {}, {}, {}
    actor.attempts_over = SeenIds()
    actor.tasks = set()
    actor.runner = RecordingRunner()
    return actor


def done_msg(wrote: bool) -> SimpleNamespace:
    return SimpleNamespace(data=encode(PrefillDone(request_id="r1", ok=False, attempt=0, error_code="cancelled",
                                                   wrote=wrote)))


async def settle(actor: DecodeActor) -> None:
    for _ in range(5):
        await asyncio.sleep(0)
    if actor.tasks:
        await asyncio.wait_for(asyncio.gather(*list(actor.tasks)), timeout=5)


def test_answer_before_quarantine_frees_blocks_at_once():
    async def go():
        actor = bare_decode_actor()
        await actor._on_prefill_done(done_msg(wrote=False))
        actor._quarantine("r1:0", [4, 5, 6], deadline=time.time() + 90)
        await settle(actor)
        return actor

    actor = asyncio.run(go())
    assert actor.runner.released == [4, 5, 6]
    assert actor.quarantined == {}


def test_answer_after_quarantine_frees_blocks():
    async def go():
        actor = bare_decode_actor()
        actor._quarantine("r1:0", [7, 8], deadline=time.time() + 90)
        await actor._on_prefill_done(done_msg(wrote=False))
        assert actor.runner.released == [7, 8]
        for t in list(actor.tasks):  # the deadline timer has nothing left to free
            t.cancel()
        return actor

    actor = asyncio.run(go())
    assert actor.quarantined == {}


def test_writer_that_began_writing_keeps_blocks_until_deadline():
    async def go():
        actor = bare_decode_actor()
        await actor._on_prefill_done(done_msg(wrote=True))
        actor._quarantine("r1:0", [9], deadline=time.time() + 90)
        for _ in range(5):
            await asyncio.sleep(0)
        held = (list(actor.runner.released), dict(actor.quarantined))
        for t in list(actor.tasks):
            t.cancel()
        return held

    released, quarantined = asyncio.run(go())
    assert released == []
    assert quarantined == {"r1:0": [9]}


def test_two_quarantines_under_one_tag_are_both_freed():
    async def go():
        actor = bare_decode_actor()
        actor._quarantine("r1:0", [1, 2], deadline=time.time() + 90)
        actor._quarantine("r1:0", [3], deadline=time.time() + 90)
        await actor._on_prefill_done(done_msg(wrote=False))
        for t in list(actor.tasks):
            t.cancel()
        return actor

    actor = asyncio.run(go())
    assert sorted(actor.runner.released) == [1, 2, 3]


def test_a_dropped_request_never_starts_a_local_prefill():
    """A remote attempt that ends after its request was dropped must not fall back to running it."""
    async def go():
        actor = bare_decode_actor()
        calls: list = []

        async def call(fn, *args):
            calls.append(fn)

        actor.runner.call = call
        r = Request(GenerateRequest(request_id="r1", prompt_ids=[1, 2, 3], stream_subject="s.r1"), [1, 2, 3])
        r.cancelled = True
        await actor._start_local(r)
        return calls, r

    calls, r = asyncio.run(go())
    assert calls == [] and not r.in_engine


class RecordingNats:
    """Stands in for the NATS client: keeps what is published."""

    max_payload = 1 << 20

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes, reply: str = "", headers: dict | None = None) -> None:
        self.published.append((subject, data))


def test_a_request_that_arrives_while_draining_is_handed_back():
    """A targeted request on its way when the drain began goes back to its gateway, which re-sends it."""
    async def go():
        actor = bare_decode_actor()
        actor.draining, actor.requests, actor.worker_id = True, {}, "d9"
        actor.seen, actor.cancelled_ids, actor.nc = SeenIds(), SeenIds(), RecordingNats()
        req = GenerateRequest(request_id="late-1", prompt_ids=[1, 2, 3], stream_subject="tandem.stream.gw.late-1")
        await actor.accept(SimpleNamespace(data=encode(req)), from_pool=False)
        return actor

    actor = asyncio.run(go())
    assert actor.requests == {}
    [(subject, data)] = actor.nc.published
    err = decode(data, StreamError)
    assert subject == "tandem.stream.gw.late-1"
    assert (err.request_id, err.code, err.status) == ("late-1", ErrorCode.HANDED_BACK, 503)


def test_draining_prefill_workers_get_no_jobs():
    actor = bare_decode_actor()
    now = time.monotonic()
    actor.prefill_workers = {
        "p-leaving": (WorkerStats(role="prefill_only", worker_id="p-leaving", draining=True), now),
        "p-staying": (WorkerStats(role="prefill_only", worker_id="p-staying"), now),
        "p-silent": (WorkerStats(role="prefill_only", worker_id="p-silent"), now - 60),
    }
    assert list(actor.alive_prefill_workers()) == ["p-staying"]
