"""Unit tests of the decode worker's bookkeeping for remote prefills: quarantined blocks and dropped requests.

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
from bus.messages import GenerateRequest, PrefillDone, encode


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
