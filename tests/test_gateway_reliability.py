"""The gateway under stress: a SIGTERM drain, admission control, and workers that die quietly.

The drain runs a real `tandem gateway` process (signals are the point); the rest run the app in
this process against the fake decode workers of tests/harness/fakes.py on a real nats-server.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import nats
import pytest

from bus.server import EmbeddedNats
from bus.subjects import Subjects
from gateway.app import create_app
from gateway.textmodel import TextModel
from runtime.processes import ChildProcess
from tandem.up.ports import free_port
from tests.harness.fakes import FakeWorker, LoopThread
from tests.harness.gateway import ServerThread, assert_error, chat_body, make_config
from tests.harness.wait import wait_until

pytestmark = pytest.mark.timeout(180)


def fake_worker(url: str, ns: str, text: TextModel, worker_id: str, loop_thread: LoopThread,
                **attrs: Any) -> FakeWorker:
    """A started fake worker of namespace ``ns`` with ``attrs`` set before it starts."""
    w = FakeWorker(url, Subjects(text.name, ns), text, worker_id)
    for name, value in attrs.items():
        setattr(w, name, value)
    loop_thread.run(w.start())
    return w


def stream_in_background(url: str, content: str, **body: Any) -> Callable[[], tuple[int, list[str]]]:
    """POST a streaming chat from a thread; the returned function waits for (status, non-empty lines)."""
    out: list[Any] = []

    def call() -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60,
                              json=chat_body(content, stream=True, temperature=0, **body)) as r:
                out.append((r.status_code, [ln for ln in r.iter_lines() if ln]))
        except httpx.HTTPError as e:
            out.append(e)

    t = threading.Thread(target=call)
    t.start()

    def result() -> tuple[int, list[str]]:
        t.join(60)
        assert out and isinstance(out[0], tuple), out
        return out[0]

    return result


def post_in_background(url: str, content: str) -> Callable[[], httpx.Response]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(httpx.post(f"{url}/v1/chat/completions", timeout=60,
                                                              json=chat_body(content, temperature=0))))
    t.start()

    def result() -> httpx.Response:
        t.join(60)
        assert out, "no answer"
        return out[0]

    return result


# ============================================================================ drain


@pytest.fixture()
def gateway_process(nats_srv: EmbeddedNats) -> Iterator[tuple[ChildProcess, str]]:
    port = free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "gateway", "--nats-url", nats_srv.url, "--namespace", "drain",
           "--port", str(port), "--drain-timeout", "8"]
    child = ChildProcess("gateway", cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                         ready_marker="tandem gateway ready")
    child.start()
    try:
        child.wait_ready(120)
        yield child, f"http://127.0.0.1:{port}"
    finally:
        child.stop(20)


def test_sigterm_lets_streams_finish_then_ends_the_rest_with_errors(
        gateway_process: tuple[ChildProcess, str], nats_srv: EmbeddedNats, text_model: TextModel,
        loop_thread: LoopThread) -> None:
    """SIGTERM: new requests get 503 + Retry-After at once, /ready turns 503, a short stream still ends
    normally; after --drain-timeout a long stream gets an SSE error event and [DONE], a long
    non-streaming request a 503 JSON error; the process exits 0 with no traceback."""
    child, url = gateway_process
    worker = fake_worker(nats_srv.url, "drain", text_model, "drainer", loop_thread)
    try:
        wait_until(lambda: httpx.get(f"{url}/ready").status_code == 200, 30, "/ready")
        short = stream_in_background(url, "[slow] short", max_tokens=10)
        long = stream_in_background(url, "[slow] long")
        blocking = post_in_background(url, "[slow] blocking")
        wait_until(lambda: len(worker.active) == 3, 30, "three requests running")
        child.signal(signal.SIGTERM)
        child.wait_for("tandem gateway: draining (3 requests running; up to 8s)", 30)
        refused = httpx.post(f"{url}/v1/chat/completions", json=chat_body("late"), timeout=30)
        assert_error(refused, 503, code="shutting_down")
        assert refused.headers["Retry-After"] == "1"
        ready = httpx.get(f"{url}/ready", timeout=30)
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        status, lines = short()
        assert status == 200 and lines[-1] == "data: [DONE]", lines
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
        status, lines = long()
        assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
        err = json.loads(lines[-2][6:])["error"]
        assert err["code"] == "shutting_down" and "drain time of 8s passed" in err["message"]
        assert sum('"content":"' in ln for ln in lines) > 10  # it streamed for the whole drain
        assert_error(blocking(), 503, code="shutting_down")
        assert child.wait(30) == 0
        assert "Traceback" not in child.last_lines(200), child.last_lines(200)
        wait_until(lambda: not worker.active, 15, "the fake worker to be told to stop")
    finally:
        loop_thread.run(worker.stop())


# ============================================================================ admission


def test_a_request_that_would_wait_too_long_is_refused_at_once(nats_srv: EmbeddedNats, text_model: TextModel,
                                                                loop_thread: LoopThread) -> None:
    ns = "admit"
    worker = fake_worker(nats_srv.url, ns, text_model, "crowded", loop_thread, max_batch=4)
    worker.fake_running = 40  # ten times what it can run: a long queue
    srv = ServerThread(create_app(make_config(nats_srv.url, namespace=ns, max_queue_wait=5.0), text_model)).start()
    try:
        wait_until(lambda: httpx.get(f"{srv.url}/ready").status_code == 200, 15, "ready")
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat_body("hello"), timeout=30)
        err = assert_error(r, 429, code="overloaded")
        assert "more than --max-queue-wait 5s" in err["message"] and "room for 4" in err["message"]
        assert int(r.headers["Retry-After"]) >= 1
        assert worker.requests == []  # refused before anything went on the bus
        worker.fake_running = 0
        wait_until(lambda: httpx.get(f"{srv.url}/ready").json()["workers"][0]["running"] == 0, 15, "a fresh report")
        t0 = time.time()
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat_body("hello"), timeout=30)
        assert r.status_code == 200, r.text
        start_by = worker.requests[-1][1].start_by
        assert t0 + 5.0 <= start_by <= time.time() + 5.0  # the worker is told when to give up on it
    finally:
        srv.stop()
        loop_thread.run(worker.stop())


def test_a_pool_request_nobody_starts_in_time_is_a_fast_503(nats_srv: EmbeddedNats, text_model: TextModel,
                                                           loop_thread: LoopThread) -> None:
    """Every worker full: the request goes to the pool; nobody pulls it by its start_by, so the client
    hears 503 queue_timeout with Retry-After, long before its own deadline."""
    ns = "startby"
    worker = fake_worker(nats_srv.url, ns, text_model, "full", loop_thread, pull_pool=False, fake_running=8)
    srv = ServerThread(create_app(make_config(nats_srv.url, namespace=ns, max_queue_wait=1.0), text_model)).start()
    try:
        wait_until(lambda: httpx.get(f"{srv.url}/ready").status_code == 200, 15, "ready")
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat_body("anyone?"),
                       headers={"X-Request-Timeout": "120"}, timeout=60)
        assert_error(r, 503, code="queue_timeout")
        assert "Retry-After" in r.headers
    finally:
        srv.stop()
        loop_thread.run(worker.stop())


# ============================================================================ liveness


def test_a_dead_worker_is_noticed_while_another_client_listens_to_everything(
        nats_srv: EmbeddedNats, text_model: TextModel, loop_thread: LoopThread) -> None:
    """With a subscriber to `<ns>.>` (as `tandem tail` is), NATS never answers "no responders" for a
    dead worker's subject. The gateway notices from the worker's silence instead (alive_after) and
    re-sends the request; it does not wait for worker_lost_after (here far beyond the deadline)."""
    ns = "spied"
    # died: nothing of its own hears its subject any more
    zombie = fake_worker(nats_srv.url, ns, text_model, "zombie", loop_thread, pull_pool=False, listen_direct=False)
    # busier: the router picks the zombie first
    healthy = fake_worker(nats_srv.url, ns, text_model, "healthy", loop_thread, pull_pool=False, fake_running=3)
    seen: list[str] = []

    async def spy() -> Any:
        nc = await nats.connect(nats_srv.url)

        async def record(msg: Any) -> None:
            seen.append(msg.subject)
            if msg.subject == f"{ns}.{Subjects(text_model.name).model_token}.generate.zombie":
                zombie.report = False  # it stops reporting once it "died" with the request

        await nc.subscribe(f"{ns}.>", cb=record)
        return nc

    spy_nc = loop_thread.run(spy())
    srv = ServerThread(create_app(make_config(nats_srv.url, namespace=ns, alive_after=2.0, worker_lost_after=1000.0),
                                  text_model)).start()
    try:
        wait_until(lambda: len(httpx.get(f"{srv.url}/ready").json()["workers"]) == 2, 15, "both workers")
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat_body("hello", temperature=0),
                       headers={"X-Request-Timeout": "30"}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-tandem-decode-worker"] == "healthy"
        assert any(s.endswith(".generate.zombie") for s in seen)  # it did go to the zombie first
    finally:
        srv.stop()
        loop_thread.run(spy_nc.close())
        for w in (zombie, healthy):
            loop_thread.run(w.stop())


# ============================================================================ migration


def sse_text(lines: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """The streamed text and the parsed events of an SSE body."""
    events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    return text, events


@pytest.mark.parametrize("limit", [1, 0])
def test_a_stream_moves_off_a_worker_that_dies_mid_stream(nats_srv: EmbeddedNats, text_model: TextModel,
                                                         loop_thread: LoopThread, limit: int) -> None:
    """The decode worker of a stream dies after some tokens: with --migration-limit 1 the gateway
    re-sends it to another worker with the tokens so far and the client's stream goes on with no
    duplicate and no missing token; with 0 the stream ends with an SSE error event and [DONE]."""
    ns = f"migrate{limit}"
    dying = fake_worker(nats_srv.url, ns, text_model, "dying", loop_thread, pull_pool=False, admit=True)
    heir = fake_worker(nats_srv.url, ns, text_model, "heir", loop_thread, pull_pool=False, admit=True,
                       fake_running=3)  # busier: the stream starts on the one that dies
    srv = ServerThread(create_app(make_config(nats_srv.url, namespace=ns, alive_after=2.0, worker_lost_after=2.0,
                                              migration_limit=limit), text_model)).start()
    try:
        wait_until(lambda: len(httpx.get(f"{srv.url}/ready").json()["workers"]) == 2, 15, "both workers")
        result = stream_in_background(srv.url, "[slow] tell me everything", max_tokens=40)
        wait_until(lambda: len(dying.requests) == 1, 15, "the stream to start")
        rid = dying.requests[0][1].request_id
        wait_until(lambda: dying.tokens_out.get(rid, 0) >= 10, 15, "ten tokens out")
        dying.dead, dying.report = True, False
        status, lines = result()
        assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
        text, events = sse_text(lines)
        if limit == 0:
            assert events[-1]["error"]["code"] == "worker_lost", events[-1]
            assert heir.requests == []
            return
        [(_, moved)] = heir.requests
        first = dying.requests[0][1]
        assert moved.request_id == first.request_id + "-m1" and list(moved.prompt_ids) == list(first.prompt_ids)
        assert 0 < len(moved.resume_ids) < 40 and moved.shown_chars > 0
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        unmoved = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60,  # only the heir is alive now
                             json=chat_body("[slow] tell me everything", max_tokens=40, temperature=0))
        assert unmoved.status_code == 200, unmoved.text
        assert text == unmoved.json()["choices"][0]["message"]["content"]  # nothing lost, nothing twice
    finally:
        srv.stop()
        for w in (dying, heir):
            loop_thread.run(w.stop())


# ============================================================================ a silent link


class SilentLink:
    """A TCP relay to NATS that can go silent: ``cut()`` makes it stop passing bytes both ways while every
    connection stays open, as a pulled cable or a dead host looks to a client (no FIN, no RST)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.silent = False
        self.server: Any = None
        self.port = 0

    async def start(self) -> SilentLink:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                if not self.silent:  # silent: swallowed (the client gives this connection up anyway)
                    dst.write(data)
                    await dst.drain()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

    def cut(self) -> None:
        self.silent = True

    async def stop(self) -> None:
        self.server.close()


def test_a_gateway_whose_link_falls_silent_suspects_itself_not_the_worker(
        nats_srv: EmbeddedNats, text_model: TextModel, loop_thread: LoopThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway reaches NATS through a link that goes silent mid-stream (the worker's own link is fine).
    Every worker falls silent at once, so the gateway checks its own link first: a ping that does not come
    back within 1 s, and it fails over to the next server URL; the time away is not counted against the
    worker, which is never judged lost (no re-send, no migration), and the tokens published while the
    gateway was away are asked for again: the client gets the text of an uncut run."""
    ns = "silent"
    worker = fake_worker(nats_srv.url, ns, text_model, "steady", loop_thread, admit=True)
    link = loop_thread.run(SilentLink(nats_srv.port).start())
    # pings every 5 s find the silent link only after 10-15 s; the worker would be judged lost after 3 s of
    # silence, and with nowhere to go the stream would fail, were it not for the gateway suspecting its link
    monkeypatch.setenv("TANDEM_NATS_PING_INTERVAL", "5")
    cfg = make_config(f"nats://127.0.0.1:{link.port},{nats_srv.url}", namespace=ns, alive_after=2.0,
                      worker_lost_after=3.0, worker_wait=0.0)
    srv = ServerThread(create_app(cfg, text_model)).start()
    try:
        wait_until(lambda: httpx.get(f"{srv.url}/ready").status_code == 200, 15, "ready")
        uncut = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60,
                           json=chat_body("[slow] a story", max_tokens=50, temperature=0)).json()
        result = stream_in_background(srv.url, "[slow] a story", max_tokens=50)
        wait_until(lambda: len(worker.requests) == 2, 15, "the stream to start")
        rid = worker.requests[1][1].request_id
        wait_until(lambda: worker.tokens_out.get(rid, 0) >= 10, 15, "ten tokens out")
        cut_at = time.monotonic()
        link.cut()
        status, lines = result()
        took = time.monotonic() - cut_at
        assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
        text, events = sse_text(lines)
        assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
        assert text == uncut["choices"][0]["message"]["content"]
        assert len(worker.requests) == 2, [r.request_id for _, r in worker.requests]  # never re-sent or moved
        assert any(a.from_seq > 0 for a in worker.replays), worker.replays  # asked for what it missed
        assert took < 15, took
        metrics = httpx.get(f"{srv.url}/metrics").text
        assert 'tandem_gateway_replays_requested_total{reason="reconnect"} 1.0' in metrics
    finally:
        srv.stop()
        loop_thread.run(link.stop())
        loop_thread.run(worker.stop())
