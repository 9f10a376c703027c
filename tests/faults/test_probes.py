"""Fault probes on separately started processes: copies, floods of bad messages, cancel bursts, a NATS restart.

Real nats-server, real `tandem serve` processes with the real model, driven the way a person with
the `nats` CLI (or a misbehaving client) would: raw JSON on the subjects the workers listen to.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import nats
import pytest

from bench.cluster import MODEL, Client, Worker
from bus.control_messages import Replay
from bus.prefill_messages import KVDestination, PrefillJob
from bus.subjects import Subjects
from bus.wire import encode
from engine.params import SamplingParams
from tests.harness.chat import chat_ids
from tests.harness.cluster import worker_cluster
from tests.harness.wait import read_quiet, read_until, until, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

S = Subjects(MODEL)


def rid() -> str:
    return uuid.uuid4().hex


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """NATS + two decode_only (d1, d2) + two prefill_only (p1, p2) workers, and d3 (drain time 2 s) to stop."""
    with worker_cluster(tmp_path_factory.mktemp("probes"), [
        ("decode_only", "d1", "--num-blocks", "400"),
        ("decode_only", "d2", "--num-blocks", "400"),
        ("prefill_only", "p1", "--num-blocks", "400"),
        ("prefill_only", "p2", "--num-blocks", "400"),
        ("decode_only", "d3", "--num-blocks", "200", "--drain-timeout", "2"),
    ]) as cluster:
        yield cluster


@pytest.fixture
def own_cluster(tmp_path: Path) -> Any:
    """NATS of the test's own (it restarts it), with d1 and d2 to stream on and p1 to prefill remotely."""
    with worker_cluster(tmp_path, [
        ("decode_only", "d1", "--num-blocks", "400"),
        ("decode_only", "d2", "--num-blocks", "400"),
        ("prefill_only", "p1", "--num-blocks", "400"),
    ]) as cluster:
        yield cluster


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def log_lines(worker: Worker, needle: str) -> list[str]:
    return [line for line in Path(worker.log_path).read_text().splitlines() if needle in line]


def wait_for_line(workers: list[Worker], needle: str, timeout: float = 60.0) -> Worker:
    """The first of ``workers`` whose log shows ``needle`` (fails at the deadline)."""
    return wait_until(lambda: next((w for w in workers if log_lines(w, needle)), None), timeout,
                      f"a worker to log {needle!r}", interval=0.1)


async def read_stream(sub: Any, timeout: float = 120.0, dropped: list | None = None) -> list[dict[str, Any]]:
    """A request's stream messages up to its finish or error; with ``dropped``, the 409s that say a copy
    was dropped (they are not part of the stream: a gateway ignores them) go there instead."""
    out = []
    while True:
        d = json.loads((await sub.next_msg(timeout=timeout)).data)
        if dropped is not None and d["kind"] == "stream_error" and d["code"] == "duplicate_request":
            dropped.append(d)
            continue
        out.append(d)
        if d["kind"] != "stream_tokens":
            return out


async def nothing_more(sub: Any, workers: list[Worker], c: Client) -> list[bytes]:
    """Once every worker reported idle, what else arrived on ``sub`` (nothing, if the copy was dropped)."""
    await c.wait_all_free(workers, timeout=60)
    await c.nc.flush()
    return await read_quiet(sub, 0.2, bytes)


def test_a_request_delivered_twice_is_served_once(cluster: Any, smollm: Any) -> None:
    """The same bytes sent to d1 and to d2 (no Nats-Msg-Id), and twice to the pool: served once each, the
    copy answered with one 409 duplicate_request on the stream subject (docs/nats.md)."""
    srv, workers = cluster
    decoders = [workers["d1"], workers["d2"]]

    async def go() -> None:
        async with Client(srv.url) as c:
            for how in ("targeted", "pool"):
                r = rid()
                body = c.request_body(r, chat_ids(smollm, "Say hi."), max_tokens=4)
                sub = await c.nc.subscribe(body["stream_subject"])
                data = json.dumps(body).encode()
                if how == "targeted":
                    await c.nc.publish(S.generate_worker("d1"), data)
                    await c.nc.publish(S.generate_worker("d2"), data)
                else:
                    await c.js.publish(S.generate_pool, data)
                    await c.js.publish(S.generate_pool, data)
                dropped: list[dict[str, Any]] = []
                msgs = await read_stream(sub, dropped=dropped)
                assert msgs[-1]["kind"] == "stream_finish", msgs[-1]
                assert [m["seq"] for m in msgs] == list(range(len(msgs)))
                assert sum(1 for m in msgs if m["kind"] == "stream_tokens" and m["seq"] == 0) == 1
                if how == "targeted":  # the copy reached the other worker, which dropped it
                    await asyncio.to_thread(wait_for_line, decoders, f"GenerateRequest {r} was claimed by another "
                                                                     "worker first")
                extra = [json.loads(m) for m in await nothing_more(sub, decoders, c)]
                # the copy is answered once, with a 409 that names the reused request_id, and not served
                assert [d["code"] for d in dropped + extra] == ["duplicate_request"], dropped + extra
                assert (dropped + extra)[0]["status"] == 409 and r in (dropped + extra)[0]["message"]

    run(go())


def test_a_prefill_job_delivered_twice_is_answered_once(cluster: Any) -> None:
    srv, workers = cluster

    async def go() -> None:
        async with Client(srv.url) as c:
            r = rid()
            reply = S.prefill_done("d9", r)
            sub = await c.nc.subscribe(reply)
            job = PrefillJob(request_id=r, prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=1),
                             layout_fingerprint="not-this-layout", reply_subject=reply, deadline=time.time() + 60,
                             dst=KVDestination(engine="tcp", worker_id="d9", incarnation="i", block_ids=[1],
                                               first_token_index=0), decode_worker_id="d9", model=MODEL)
            data = encode(job)
            await c.nc.publish(S.prefill_worker("p1"), data)
            await c.nc.publish(S.prefill_worker("p2"), data)
            answers = await read_until(sub, lambda got: any(a["kind"] == "prefill_done" for a in got), 60,
                                       "the job's prefill_done")
            await asyncio.to_thread(wait_for_line, [workers["p1"], workers["p2"]],
                                    f"PrefillJob {r}:0 was claimed by another worker first")
            await c.nc.flush()
            answers += await read_quiet(sub, 0.5)
            kinds = [a["kind"] for a in answers]
            assert kinds == ["prefill_accepted", "prefill_done"], kinds
            assert answers[-1]["error_code"] == "layout_mismatch"

    run(go())


def test_malformed_messages_are_answered_logged_once_and_harmless(cluster: Any, smollm: Any) -> None:
    """On every subject a worker listens to: broken JSON, the wrong schema, and near-max_payload junk,
    fifty times each. Where a message names a stream or reply subject it gets an error there; each
    kind is logged once; every worker keeps serving."""
    srv, workers = cluster

    async def go() -> None:
        async with Client(srv.url) as c:
            nc = c.nc
            r = rid()
            stream = S.stream("probe", r)
            errors = await nc.subscribe(stream)
            reply = S.prefill_done("d9", r)
            replies = await nc.subscribe(reply)
            wrong_generate = json.dumps({"kind": "generate_request", "request_id": r, "stream_subject": stream,
                                         "prompt_ids": "not a list"}).encode()
            wrong_job = json.dumps({"kind": "prefill_job", "request_id": r, "reply_subject": reply,
                                    "attempt": 0}).encode()
            junk = b"{not json"
            big = json.dumps({"kind": "generate_request", "padding": "x" * (nc.max_payload - 4096)}).encode()
            targets = [S.generate_worker("d1"), S.prefill_worker("p1"), S.prefill_done("d1", r), S.cancel(r),
                       S.stats("prefill_only", "p9"), S.kv_meta("d1")]
            await nc.publish(S.generate_worker("d1"), wrong_generate)
            await nc.publish(S.prefill_worker("p1"), wrong_job)
            await c.js.publish(S.generate_pool, wrong_generate)
            for _ in range(50):
                for subject in targets:
                    await nc.publish(subject, junk)
                    await nc.publish(subject, big)
                await c.js.publish(S.generate_pool, junk)
                await c.js.publish(S.prefill_pool, junk)
            await nc.flush()
            for _ in range(2):  # the targeted one and the pool one
                err = json.loads((await errors.next_msg(timeout=60)).data)
                assert err["kind"] == "stream_error" and err["status"] == 400 and err["request_id"] == r
                assert "malformed generate request" in err["message"]
            done = json.loads((await replies.next_msg(timeout=60)).data)
            assert done["kind"] == "prefill_done" and not done["ok"] and done["error_code"] == "bad_request"
            # every worker still serves: a disaggregated request through p1 or p2, and one on d2
            for target in ("d1", "d2"):
                out = await c.generate(rid(), chat_ids(smollm, "What is 2+2? " * 20), worker=target,
                                       max_tokens=4)
                assert "finish" in out, out

    run(go())
    for name, w in workers.items():
        for what in ("undecodable GenerateRequest on tandem.smollm2-135m-instruct.generate.d1",
                     "undecodable PrefillJob on tandem.smollm2-135m-instruct.prefill.p1",
                     "ignoring a bad cancel", "bad prefill reply"):
            assert len(log_lines(w, what)) <= 1, (name, what, log_lines(w, what)[:3])
    assert log_lines(workers["d1"], "undecodable GenerateRequest on tandem.smollm2-135m-instruct.generate.d1")
    assert log_lines(workers["p1"], "undecodable PrefillJob on tandem.smollm2-135m-instruct.prefill.p1")


def test_a_burst_of_cancels_stops_every_request_within_a_step_or_two(cluster: Any, smollm: Any) -> None:
    """Twelve requests streaming on d1, twelve cancels at once: all stop after about the same number of
    further tokens (applied one per step, the last would run eleven steps longer than the first)."""
    srv, workers = cluster

    async def go() -> list[int]:
        async with Client(srv.url) as c:
            rids = [rid() for _ in range(12)]
            subs = [await c.start(r, chat_ids(smollm, f"Count to a thousand, {i}."), worker="d1", max_tokens=2000,
                                  ignore_eos=True) for i, r in enumerate(rids)]
            last = [0] * len(rids)
            pending = [asyncio.ensure_future(s.next_msg(timeout=120)) for s in subs]

            async def until(pred: Any) -> None:
                while not pred():
                    done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED, timeout=120)
                    assert done, "no stream moved for 120 s"
                    for i, fut in enumerate(pending):
                        if fut in done:
                            d = json.loads(fut.result().data)
                            last[i] = d["seq"] if d["kind"] == "stream_tokens" else -d["seq"]
                            pending[i] = (asyncio.ensure_future(subs[i].next_msg(timeout=120))
                                          if d["kind"] == "stream_tokens" else asyncio.ensure_future(asyncio.sleep(1e9)))

            await until(lambda: all(s >= 3 for s in last))
            at_burst = list(last)
            for r in rids:
                await c.nc.publish(S.cancel(r), json.dumps({"kind": "cancel", "request_id": r,
                                                            "reason": "burst"}).encode())
            await until(lambda: all(s < 0 for s in last))
            for fut in pending:
                fut.cancel()
            await c.wait_all_free([workers["d1"]], timeout=60)
            return [-end - start for end, start in zip(last, at_burst)]

    more = run(go())
    assert max(more) - min(more) <= 3, more


def test_a_drain_that_runs_out_of_time_hands_the_streams_back(cluster: Any, smollm: Any) -> None:
    """SIGTERM to a decode worker with a long stream: after its drain time it hands the stream back
    (503 handed_back, which a gateway moves to another worker) instead of leaving it cut; it exits 0."""
    srv, workers = cluster
    d3 = workers.pop("d3")  # gone after this test

    async def go() -> list[dict[str, Any]]:
        async with Client(srv.url) as c:
            sub = await c.start(rid(), chat_ids(smollm, "Tell a very long story."), worker="d3", max_tokens=3000,
                                ignore_eos=True)
            first = [json.loads((await sub.next_msg(timeout=120)).data) for _ in range(3)]
            d3.child.terminate()
            return first + await read_stream(sub)

    msgs = run(go())
    assert d3.child.wait(60) == 0
    assert [m["seq"] for m in msgs] == list(range(len(msgs)))
    tokens = [m for m in msgs if m["kind"] == "stream_tokens" and m["token_ids"]]
    assert len(tokens) > 3 and msgs[-1]["kind"] == "stream_error", msgs[-1]
    assert msgs[-1]["code"] == "handed_back" and msgs[-1]["status"] == 503


def test_nats_restart_under_a_stream_loses_no_token_and_everyone_comes_back(own_cluster: Any, smollm: Any) -> None:
    """NATS restarted (same port and store) under a stream: the decode worker goes on generating, keeping what
    it sends; the client, back, asks for the rest (``Replay``) and reads the whole stream, every message once,
    to its end; afterwards every worker is back and a disaggregated request succeeds."""
    srv, workers = own_cluster

    async def stream_through_a_restart() -> tuple[list[dict[str, Any]], bool]:
        async with Client(srv.url) as c:
            r = rid()
            sub = await c.start(r, chat_ids(smollm, "Tell a very long story."), worker="d1", max_tokens=200,
                                ignore_eos=True)
            msgs = [json.loads((await sub.next_msg(timeout=120)).data) for _ in range(4)]
            await srv.arestart()
            await until(lambda: c.nc.is_connected, 30, "the client to reconnect")
            give_up, asked, missed = time.monotonic() + 120, 0.0, False
            while msgs[-1]["kind"] == "stream_tokens":  # as a gateway does: ask (again) while behind
                assert time.monotonic() < give_up, msgs[-1]
                if time.monotonic() - asked > 1.0:
                    asked = time.monotonic()
                    await c.nc.publish(c.subjects.replay("stream"),
                                       encode(Replay(key=r, from_seq=msgs[-1]["seq"] + 1, requester="test")))
                try:
                    d = json.loads((await sub.next_msg(timeout=1.0)).data)
                except nats.errors.TimeoutError:
                    continue
                if d["seq"] == msgs[-1]["seq"] + 1:  # the next one; later ones come again after the ask
                    msgs.append(d)
                elif d["seq"] > msgs[-1]["seq"] + 1:
                    missed = True
            return msgs, missed

    msgs, missed = run(stream_through_a_restart())
    assert [m["seq"] for m in msgs] == list(range(len(msgs)))  # no gap: what the restart lost came again
    assert msgs[-1]["kind"] == "stream_finish" and msgs[-1]["finish_reason"] == "length", msgs[-1]
    assert sum(len(m.get("token_ids") or []) for m in msgs) == 200
    if missed:  # what the restart lost came again from the worker's kept messages (a restart may lose nothing)
        wait_for_line([workers["d1"]], "published")

    async def after() -> None:
        async with Client(srv.url) as c:
            await c.wait_all_free(list(workers.values()), timeout=60)  # all reconnected, reporting, idle
            out = await c.generate(rid(), chat_ids(smollm, "What is the capital of France? " * 5), worker="d2",
                                   max_tokens=4)
            assert "finish" in out, out

    run(after())
