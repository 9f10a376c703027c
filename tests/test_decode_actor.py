"""Unit tests of the decode actor's bookkeeping and of its remote prefills (actors/remote_prefill.py):
quarantined blocks, events that end a wait, dropped requests, work that arrives while draining.

A cancel reaches the decode worker and the prefill worker at once; the prefill worker's
"I wrote nothing" answer can be handled before the decode engine holds the blocks. Either order
must free them at once; only a writer that began writing keeps them until the attempt's deadline.
`RemotePrefills` is the decode engine's KV connector here: the tests place prompts and read what
it hands the engine (`finished()`) as the model thread would.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from actors.decode import DecodeActor
from actors.decode_request import Request
from actors.prefill_workers import PrefillWorkers
from actors.remote_prefill import CANCELLED, FALLBACK, LANDED, RemotePrefills
from actors.seen import SeenIds
from bus.generate_messages import GenerateRequest, StreamError
from bus.prefill_messages import PrefillAccepted, PrefillDone, PrefillJob
from bus.replay import SentLog
from bus.stats_messages import WorkerStats
from bus.subjects import Subjects
from bus.wire import ErrorCode, decode, encode
from kv.layout import KVLayout
from kv.transfer import create_engine
from runtime.settings import Settings
from tests.harness.wait import until


class RecordingRunner:
    """Stands in for the model thread: runs each call on no engine, and counts the KV connector's wakes."""

    def __init__(self) -> None:
        self.wakes = 0

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def wake(self) -> None:
        self.wakes += 1

    async def call(self, fn, *args):
        await asyncio.sleep(0)
        return fn(None, *args)


class RecordingNats:
    """Stands in for the NATS client: keeps what is published."""

    max_payload = 1 << 20

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes, reply: str = "", headers: dict | None = None) -> None:
        self.published.append((subject, data))


class QuietTransfer:
    """A transfer engine that sees no landings and needs no polling; it records the write grants it makes."""

    name = "shm"

    def __init__(self) -> None:
        self.reads = 0
        self.grants: dict[str, list[int]] = {}  # live ones
        self.revoked: list[str] = []

    def mechanisms(self) -> dict[str, dict]:
        return {self.name: {}}

    def grant(self, blocks: list[int], deadline: float) -> str:
        token = f"grant-{len(self.grants) + len(self.revoked)}"
        self.grants[token] = list(blocks)
        return token

    def revoke(self, token: str) -> None:  # idempotent, as WriteGrants.revoke
        if self.grants.pop(token, None) is not None:
            self.revoked.append(token)

    def completion_fds(self) -> list[int]:
        return []

    def completed(self) -> list[str]:
        self.reads += 1
        return []

    def needs_polling_for(self, mechanism: str) -> bool:
        return False


def bare_remote(runner=None, transfer=None, **settings) -> RemotePrefills:
    tasks: set = set()

    def spawn(coro):
        task = asyncio.get_running_loop().create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    hub = RemotePrefills(RecordingNats(), Subjects("m"), Settings(**settings), runner or RecordingRunner(),
                         transfer or QuietTransfer(), KVLayout(model="m", dtype="float32", block_size=16,
                                                                num_layers=2, num_kv_heads=1, head_dim=8),
                         "d9", "inc-d9", "m", spawn)
    hub.tasks = tasks
    return hub


def bare_decode_actor() -> DecodeActor:
    actor = object.__new__(DecodeActor)
    actor.tasks = set()
    actor.changed, actor.arrived = asyncio.Event(), asyncio.Event()
    actor.runner = RecordingRunner()
    actor.sent = SentLog()
    return actor


def done_msg(wrote: bool, ok: bool = False) -> SimpleNamespace:
    return SimpleNamespace(data=encode(PrefillDone(request_id="r1", ok=ok, attempt=0, first_token=7 if ok else None,
                                                   error_code=None if ok else "cancelled", wrote=wrote)))


async def settle(hub: RemotePrefills) -> None:
    for _ in range(5):
        await asyncio.sleep(0)
    if hub.tasks:
        await asyncio.wait_for(asyncio.gather(*list(hub.tasks)), timeout=5)


def cancel_timers(hub: RemotePrefills) -> None:
    for t in list(hub.tasks):
        t.cancel()


def released(hub: RemotePrefills) -> list[str]:
    """The quarantine tags the engine may free now (what its next step would take)."""
    return hub.finished()[1]


def test_answer_before_quarantine_frees_blocks_at_once():
    async def go():
        hub = bare_remote()
        await hub.on_reply(done_msg(wrote=False))
        hub.quarantine.hold("r1:0", deadline=time.time() + 90)
        return hub, released(hub)

    hub, free = asyncio.run(go())
    assert free == ["r1:0"] and hub.quarantine.held == set() and hub.runner.wakes == 1


def test_answer_after_quarantine_frees_blocks():
    async def go():
        hub = bare_remote()
        hub.quarantine.hold("r1:0", deadline=time.time() + 90)
        assert released(hub) == []
        await hub.on_reply(done_msg(wrote=False))
        free = released(hub)
        cancel_timers(hub)  # the deadline timer has nothing left to free
        return hub, free

    hub, free = asyncio.run(go())
    assert free == ["r1:0"] and hub.quarantine.held == set()


def test_writer_that_began_writing_keeps_blocks_until_deadline():
    async def go():
        hub = bare_remote()
        await hub.on_reply(done_msg(wrote=True))
        hub.quarantine.hold("r1:0", deadline=time.time() + 90)
        for _ in range(5):
            await asyncio.sleep(0)
        held = (released(hub), set(hub.quarantine.held))
        cancel_timers(hub)
        return held

    free, quarantined = asyncio.run(go())
    assert free == [] and quarantined == {"r1:0"}


def test_a_quarantine_past_its_deadline_is_freed(monkeypatch):
    monkeypatch.setattr("actors.quarantine.QUARANTINE_GRACE_S", 0.05)

    async def go():
        hub = bare_remote()
        await hub.on_reply(done_msg(wrote=True))
        hub.quarantine.hold("r1:0", deadline=time.time() - 10)
        assert released(hub) == []  # not before its grace
        await until(lambda: "r1:0" not in hub.quarantine.held, 30, "the quarantine's release")
        return released(hub)

    assert asyncio.run(go()) == ["r1:0"]


def remote_hub(**settings) -> RemotePrefills:
    hub = bare_remote(RecordingRunner(), **settings)
    hub.workers.heard(WorkerStats(role="prefill_only", worker_id="p1"))
    return hub


def request(rid: str = "r1") -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=[1, 2, 3], stream_subject=f"s.{rid}")


async def place(hub: RemotePrefills, blocks: list[int], rid: str = "r1") -> None:
    """The engine placed the prompt in ``blocks`` (from the model thread)."""
    hub.after_allocation(SimpleNamespace(request_id=rid, num_cached=0), blocks)
    await asyncio.sleep(0)


async def job_sent(hub: RemotePrefills, worker: str = "p1", jobs: int = 1) -> PrefillJob:
    while sum(subject.endswith(f".prefill.{worker}") for subject, _ in hub.nc.published) < jobs:
        await asyncio.sleep(0)
    return decode(hub.nc.published[-1][1], PrefillJob)


def placement_ended(hub: RemotePrefills, rid: str = "r1") -> str:
    """What the engine asks when the placement ends without its K/V (from the model thread)."""
    return hub.placement_ended(SimpleNamespace(request_id=rid))


def test_a_remote_prefill_lands_on_its_reply_and_its_landing_event():
    """The PrefillDone and the transfer engine's notice end the wait (no poll of the engine: it needs none); the
    engine hears of it once the actor settles it."""
    async def go():
        hub = remote_hub()
        rp = hub.prefill(request(), [1, 2, 3], "p1")
        running = asyncio.get_running_loop().create_task(rp.run())
        await place(hub, [10, 11])
        job = await job_sent(hub)
        await hub.on_reply(SimpleNamespace(data=encode(PrefillAccepted(request_id="r1", prefill_worker_id="p1",
                                                                       transfer="shm"))))
        await hub.on_reply(done_msg(wrote=True, ok=True))
        hub.landings.collect(["r1:0"])
        outcome = await asyncio.wait_for(running, timeout=30)
        before = hub.finished()
        hub.settle(rp, outcome)
        return outcome, job, hub, rp, before

    outcome, job, hub, rp, before = asyncio.run(go())
    assert outcome.kind == LANDED and outcome.done.first_token == 7
    assert job.dst.block_ids == [10, 11] and job.reply_subject == "tandem.prefill.done.d9.r1"
    # the job carried a write grant for exactly its blocks, revoked once the KV landed
    assert job.dst.grant == "grant-0" and hub.transfer.revoked == ["grant-0"] and hub.transfer.grants == {}
    assert before == ([], [])
    [result], free = hub.finished()
    assert (result.request_id, result.outcome, result.first_token, free) == ("r1", "landed", 7, [])
    assert rp.begun and hub.attempts == {} and hub.by_request == {} and hub.landings.polled == set()
    assert hub.landings._poller is None and hub.transfer.reads == 0


def test_a_failed_attempt_that_wrote_holds_its_blocks_and_the_prompt_is_placed_again_for_another_worker():
    async def go():
        hub = remote_hub()
        hub.workers.heard(WorkerStats(role="prefill_only", worker_id="p2"))
        rp = hub.prefill(request(), [1, 2, 3], "p1")
        running = asyncio.get_running_loop().create_task(rp.run())
        await place(hub, [10, 11])
        await job_sent(hub)
        await hub.on_reply(done_msg(wrote=True))  # failed after writing: a late byte may still come
        await until(lambda: hub.runner.wakes, 30, "the retry's result (the model thread woken for it)")
        [retry], _ = hub.finished()
        hold = placement_ended(hub)
        await place(hub, [12, 13])
        second = await job_sent(hub, "p2")
        await hub.on_reply(SimpleNamespace(data=encode(PrefillDone(request_id="r1", ok=False, attempt=1,
                                                                   error_code="internal", wrote=False))))
        outcome = await asyncio.wait_for(running, timeout=30)
        hub.settle(rp, outcome)
        [local], _ = hub.finished()
        quarantined = set(hub.quarantine.held)
        cancel_timers(hub)
        return retry, hold, second, outcome, local, quarantined, placement_ended(hub)

    retry, hold, second, outcome, local, quarantined, last_hold = asyncio.run(go())
    assert retry.outcome == "retry" and hold == "r1:0" and quarantined == {"r1:0"}
    assert (second.attempt, second.dst.block_ids) == (1, [12, 13])
    assert outcome.kind == FALLBACK and local.outcome == "local"
    assert last_hold == ""  # the second attempt wrote nothing: its blocks are free at once


def test_abandon_wakes_a_waiting_remote_prefill_and_quarantines_its_blocks():
    """A cancel ends the wait at once (not at the 10-minute deadline) and holds the blocks the job named."""
    async def go():
        hub = remote_hub(prefill_timeout=600.0)
        rp = hub.prefill(request(), [1, 2, 3], "p1")
        running = asyncio.get_running_loop().create_task(rp.run())
        await place(hub, [10, 11])
        await job_sent(hub)
        rp.abandon()
        outcome = await asyncio.wait_for(running, timeout=30)
        hold = placement_ended(hub)  # the actor's abort, on the model thread
        await asyncio.sleep(0)
        held = (set(hub.quarantine.held), released(hub))
        cancel_timers(hub)
        return outcome, hold, held, hub.transfer

    outcome, hold, (quarantined, free), transfer = asyncio.run(go())
    assert outcome.kind == CANCELLED
    assert hold == "r1:0" and quarantined == {"r1:0"} and free == []
    assert transfer.revoked == ["grant-0"]  # a late write over TCP is refused; other engines: the quarantine


def test_abandon_before_the_prompt_is_placed_ends_the_remote_prefill():
    async def go():
        hub = remote_hub()
        rp = hub.prefill(request(), [1, 2, 3], "p1")
        running = asyncio.get_running_loop().create_task(rp.run())
        await asyncio.sleep(0)
        rp.abandon()
        outcome = await asyncio.wait_for(running, timeout=30)
        await place(hub, [10, 11])  # placed as the abort came: nothing goes out for it
        return outcome, hub, placement_ended(hub)

    outcome, hub, hold = asyncio.run(go())
    assert outcome.kind == CANCELLED and hold == "" and hub.nc.published == [] and hub.by_request == {}


@pytest.mark.parametrize("accepted, pool", [("tcp", "shm"), ("", "tcp")])
def test_abandoning_a_tcp_attempt_frees_its_blocks_at_once(accepted: str, pool: str):
    """Over TCP a write lands only with the attempt's grant: once it is revoked no late byte can come, so the
    blocks go back at once instead of waiting out the quarantine (shm and NIXL writes need no grant). TCP is
    known from the taker's answer, or from this pool, when TCP is all that reaches it."""
    async def go():
        hub = remote_hub(prefill_timeout=600.0)
        hub.transfer.name = pool
        rp = hub.prefill(request(), [1, 2, 3], "p1")
        running = asyncio.get_running_loop().create_task(rp.run())
        await place(hub, [10, 11])
        await job_sent(hub)
        await hub.on_reply(SimpleNamespace(data=encode(PrefillAccepted(request_id="r1", prefill_worker_id="p1",
                                                                       transfer=accepted))))
        rp.abandon()
        await asyncio.wait_for(running, timeout=30)
        hold = placement_ended(hub)
        for _ in range(5):
            await asyncio.sleep(0)
        held = (set(hub.quarantine.held), released(hub))
        cancel_timers(hub)
        return hold, held, hub.transfer

    hold, (quarantined, free), transfer = asyncio.run(go())
    assert hold == "r1:0" and quarantined == set() and free == ["r1:0"]
    assert transfer.revoked == ["grant-0"]


def test_abandon_while_waiting_for_the_landing_wakes_that_wait_too():
    async def go():
        hub = remote_hub(prefill_timeout=600.0)
        rp = hub.prefill(request(), [1, 2, 3], "p1")
        running = asyncio.get_running_loop().create_task(rp.run())
        await place(hub, [10, 11])
        await job_sent(hub)
        await hub.on_reply(done_msg(wrote=True, ok=True))  # answered, but the bytes have not landed
        for _ in range(5):
            await asyncio.sleep(0)
        assert "r1:0" in hub.landings.waiters
        rp.abandon()
        outcome = await asyncio.wait_for(running, timeout=30)
        hold = placement_ended(hub)
        await asyncio.sleep(0)
        return outcome, hold, set(hub.quarantine.held), released(hub)

    outcome, hold, quarantined, free = asyncio.run(go())
    assert outcome.kind == CANCELLED
    # held, and let go at once: the attempt said it writes no more (ok)
    assert hold == "r1:0" and quarantined == set() and free == ["r1:0"]


def test_a_landing_wakes_its_wait_through_the_transfer_engines_descriptor():
    """A real shared-memory engine pair: the write's notice wakes the waiting request, nothing polls."""
    layout = KVLayout(model="m", dtype="float32", block_size=4, num_layers=2, num_kv_heads=1, head_dim=8)
    ours = create_engine("shm", layout, 8, "cpu", "d9")
    writer = create_engine("shm", layout, 8, "cpu", "p9")
    reads: list[int] = []
    completed = ours.completed

    def counted() -> list[str]:
        reads.append(1)
        return completed()

    ours.completed = counted

    async def go() -> tuple[bool, bool]:
        hub = bare_remote(transfer=ours)
        watching = asyncio.get_running_loop().create_task(hub.landings.watch())
        await asyncio.sleep(0)
        hub.landings.expect("r1:0", "shm")
        waiting = asyncio.get_running_loop().create_task(hub.landings.wait("r1:0", timeout=30))
        await asyncio.sleep(0)
        before = len(reads)
        writer.add_peer(ours.metadata())
        writer.write("d9", [0, 1], [2, 3], notify="r1:0").wait(30)
        landed = await waiting
        watching.cancel()
        return landed, len(reads) - before

    try:
        landed, reads_after = asyncio.run(go())
    finally:
        writer.close()
        ours.close()
    assert landed
    assert reads_after == 1  # read once, when its descriptor turned readable


def test_a_landing_noticed_before_its_reply_is_kept_for_the_wait():
    async def go():
        hub = remote_hub()
        hub.landings.collect(["r1:0"])
        return await hub.landings.wait("r1:0", timeout=30), await hub.landings.wait("r1:0", timeout=0)

    assert asyncio.run(go()) == (True, False)


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
        await actor._start(r)
        return calls, r

    calls, r = asyncio.run(go())
    assert calls == [] and not r.in_engine


def test_a_request_that_arrives_while_draining_is_handed_back():
    """A targeted request on its way when the drain began goes back to its gateway, which re-sends it."""
    async def go():
        actor = bare_decode_actor()
        actor.draining, actor.requests, actor.worker_id, actor.incarnation = True, {}, "d9", "inc-d9"
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
    assert (err.worker_id, err.incarnation) == ("d9", "inc-d9")  # signed: the gateway takes it from its holder


def test_draining_prefill_workers_get_no_jobs():
    workers = PrefillWorkers("m")
    now = time.monotonic()
    workers.reports = {
        "p-leaving": (WorkerStats(role="prefill_only", worker_id="p-leaving", draining=True), now),
        "p-staying": (WorkerStats(role="prefill_only", worker_id="p-staying"), now),
        "p-silent": (WorkerStats(role="prefill_only", worker_id="p-silent"), now - 60),
    }
    assert list(workers.alive()) == ["p-staying"]
    assert workers.silent("p-silent") and not workers.silent("p-staying") and not workers.silent("p-unknown")


def test_the_deadline_watch_sleeps_until_the_nearest_deadline_and_a_newcomer_can_bring_it_forward():
    """No tick: the watch sleeps until the nearest deadline or start_by, and a request that comes with an
    earlier one wakes it; a request that began is never woken for again by its start_by."""
    async def go() -> list[tuple[str, str]]:
        actor = bare_decode_actor()
        actor.worker_id, actor.requests = "d1", {}
        expired: list[tuple[str, str]] = []

        async def expire(rid: str, code: str, message: str, status: int) -> None:
            expired.append((rid, code))
            actor.requests.pop(rid, None)

        actor._expire = expire
        actor._begun = lambda r: r.req.request_id == "begun"
        now = time.time()

        def request(rid: str, **times: float) -> Request:
            return Request(GenerateRequest(request_id=rid, prompt_ids=[1], stream_subject=f"s.{rid}", **times), [1])

        actor.requests["far"] = request("far", deadline=now + 60)
        actor.requests["begun"] = request("begun", start_by=now - 1, deadline=now + 60)  # must not spin the watch
        watch = asyncio.create_task(actor._deadline_watch())
        await asyncio.sleep(0.1)
        assert expired == []
        actor.requests["near"] = request("near", deadline=time.time() + 0.3)
        actor.arrived.set()
        t0 = time.monotonic()
        await until(lambda: expired, 10, "the near deadline to expire", 0.02)
        waited = time.monotonic() - t0
        actor.requests["queued"] = request("queued", start_by=time.time() + 0.2)
        actor.arrived.set()
        await until(lambda: len(expired) == 2, 10, "the queued request's start-by to pass", 0.02)
        watch.cancel()
        assert waited < 5.0, waited  # the newcomer's deadline, not the far one's
        return expired

    assert asyncio.run(go()) == [("near", ErrorCode.DEADLINE_EXCEEDED), ("queued", ErrorCode.QUEUE_TIMEOUT)]
