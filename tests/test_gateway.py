"""gateway/: the OpenAI-compatible API, tested against a fake decode worker on a real nats-server.

No weights are loaded: the gateway loads only the tokenizer and chat template, and the fake
worker (tests/harness/fakes.py: a raw nats-py client speaking the real bus messages) answers with
canned text tokenized by the real tokenizer; words in the prompt ([slow], [hang], [failmid], ...)
select its behaviour, as that module lists.

The real cluster (`tandem up` with real workers) is exercised in tests/test_gateway_cluster.py.
"""


from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import nats
import nats.errors
import openai
import pytest

from bus.control_messages import Cancel
from bus.generate_messages import StreamError, StreamFinish, StreamMessage, StreamTokens
from bus.publish import publish
from bus.server import EmbeddedNats
from bus.stats_messages import WorkerStats
from bus.streams import ensure_streams
from bus.subjects import Subjects
from bus.wire import decode
from engine.model_files import DEFAULT_MODEL
from engine.params import SamplingParams
from gateway.app import create_app
from gateway.router import Route, WorkerRegistry
from gateway.run import Run
from gateway.textmodel import TextModel, TokenBytes, load_text_model
from kv.blocks import prefix_hashes
from runtime.names import ROLE_PREFILL_AND_DECODE
from runtime.settings import GatewayConfig
from tests.harness.fakes import UTF8_REPLY, WORDS, FakeWorker, LoopThread
from tests.harness.gateway import ServerThread, assert_error, chat_body, dropped_counts, make_config
from tests.harness.wait import read_quiet, read_until, until, wait_until

# ============================================================================ fixtures

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def subjects(text_model: TextModel) -> Subjects:
    return Subjects(text_model.name)


@pytest.fixture(scope="module")
def worker(nats_srv: EmbeddedNats, subjects: Subjects, text_model: TextModel,
           loop_thread: LoopThread) -> Iterator[FakeWorker]:
    w = FakeWorker(nats_srv.url, subjects, text_model, "fake-1")
    loop_thread.run(w.start())
    yield w
    loop_thread.run(w.stop())


@pytest.fixture(scope="module")
def gw(nats_srv: EmbeddedNats, worker: FakeWorker, text_model: TextModel) -> Iterator[ServerThread]:
    srv = ServerThread(create_app(make_config(nats_srv.url), text_model)).start()
    wait_until(lambda: httpx.get(f"{srv.url}/ready").status_code == 200, 10, "/ready")
    yield srv
    srv.stop()


@pytest.fixture()
def client(gw: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=30)


def chat_in_background(url: str, content: str, **kw: Any) -> Callable[[], httpx.Response]:
    """POST a greedy chat completion from a thread; the returned function waits for it (45 s) and
    returns its response, which must be a 200 (an httpx error, e.g. the client's 40 s timeout, fails)."""
    result: list[Any] = []

    def call() -> None:
        try:
            result.append(httpx.post(f"{url}/v1/chat/completions", json=chat_body(content, temperature=0, **kw),
                                     timeout=40))
        except httpx.HTTPError as e:
            result.append(e)

    t = threading.Thread(target=call)
    t.start()

    def answer() -> httpx.Response:
        t.join(45)
        assert result and isinstance(result[0], httpx.Response), result
        assert result[0].status_code == 200, result[0].text
        return result[0]

    return answer


def wait_until_routing_sees(url: str, newcomer: str, full: FakeWorker) -> None:
    """Until the gateway at ``url`` has a fresh report of ``newcomer`` and one of ``full`` saying it is full."""
    def sees_both() -> bool:
        live = {w["worker_id"]: w for w in httpx.get(f"{url}/ready").json()["workers"] if w["age_s"] < 2.0}
        return newcomer in live and live.get(full.worker_id, {}).get("running") == full.max_batch

    wait_until(sees_both, 15, f"the gateway to see {newcomer} and a full {full.worker_id}")


def wait_until_only_fake1_routable(url: str, worker: FakeWorker) -> None:
    """The shared gateway hears every test's fake workers: wait until those of earlier tests aged out
    of routing (``alive_after``, 3 s) and fake-1 reports room again, so a request lands on fake-1."""
    def settled() -> bool:
        live = [w for w in httpx.get(f"{url}/ready").json()["workers"] if w["age_s"] < 3.5]
        return [w["worker_id"] for w in live] == [worker.worker_id] and live[0]["running"] < worker.max_batch

    wait_until(settled, 20, "fake-1 alone to be routable at the shared gateway")


def still_serving(url: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", json=chat_body("ping", temperature=0), timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


# ============================================================================ pure units


def test_registry_prefers_cached_prefix_then_least_loaded() -> None:
    now = [100.0]
    reg = WorkerRegistry("m", clock=lambda: now[0], rng=random.Random(0))

    def stats(wid: str, running: int = 0, free: int = 100, role: str = ROLE_PREFILL_AND_DECODE) -> WorkerStats:
        return WorkerStats(role=role, worker_id=wid, running=running, free_blocks=free, total_blocks=100,
                           max_batch=4)

    assert reg.choose([], 1).worker_id is None  # nothing known: the pool
    reg.observe(stats("a", running=2))
    reg.observe(stats("b", running=0))
    reg.observe(stats("p", role="prefill_only"))
    assert reg.choose([], 1) == Route("b", "least loaded", 0)
    hashes = prefix_hashes(list(range(64)), 16)
    reg.dispatched("a", hashes)  # a now holds the prefix, load 3
    r = reg.choose(hashes, 4)
    assert (r.worker_id, r.reason, r.matched_blocks) == ("a", "prefix affinity", 4)
    # a longer prompt sharing the first two blocks still goes to a
    other = prefix_hashes(list(range(32)) + [7] * 32, 16)
    assert reg.choose(other, 4).worker_id == "a"
    # a full worker is skipped, even with the prefix
    reg.dispatched("a", [])
    assert reg.workers["a"].load == 4
    assert reg.choose(hashes, 4).worker_id == "b"
    # a report resets the gateway's own count
    reg.observe(stats("a", running=1))
    assert reg.choose(hashes, 4).worker_id == "a"
    # no free blocks for the uncached part -> not a candidate
    reg.observe(stats("b", free=0))
    assert reg.choose(prefix_hashes(list(range(500, 564)), 16), 4).worker_id == "a"
    # silence: not alive after alive_after, forgotten after forget_after
    now[0] += 5
    assert reg.alive() == [] and reg.choose(hashes, 4) == Route(None, "no live worker")
    now[0] += 100
    reg.prune()
    assert reg.workers == {}


def test_registry_sends_a_prefix_again_only_where_it_is_cached() -> None:
    """A worker without a prefix cache (``--no-prefix-cache``: ``prefix_cache`` false in its reports) saves
    nothing on a prompt it served before: routing is by load alone there."""
    reg = WorkerRegistry("m", rng=random.Random(0))
    for wid in ("a", "b"):
        reg.observe(WorkerStats(role=ROLE_PREFILL_AND_DECODE, worker_id=wid, free_blocks=100, total_blocks=100,
                                max_batch=8, prefix_cache=False))
    hashes = prefix_hashes(list(range(64)), 16)
    reg.dispatched("a", hashes, 4)
    assert reg.choose(hashes, 4) == Route("b", "least loaded", 0)


def test_registry_pause_does_not_count_the_gateways_own_outage() -> None:
    """While the gateway's link was down it heard nobody: once back, each worker's silence is what it was
    when the link went down, so none is judged lost for the outage, and a worker silent before it stays so."""
    now = [100.0]
    reg = WorkerRegistry("m", clock=lambda: now[0], alive_after=3.0)
    reg.observe(WorkerStats(role=ROLE_PREFILL_AND_DECODE, worker_id="quiet", max_batch=4))
    now[0] = 102.0
    reg.observe(WorkerStats(role=ROLE_PREFILL_AND_DECODE, worker_id="fresh", max_batch=4))
    assert reg.last_heard() == 102.0
    now[0] = 112.0  # ten seconds away
    assert not reg.is_alive("fresh")
    reg.pause(102.0)
    assert reg.is_alive("fresh", within=0.5) and reg.is_alive("quiet") and not reg.is_alive("quiet", within=1.5)
    now[0] = 113.5
    assert not reg.is_alive("quiet") and reg.is_alive("fresh")


def test_registry_restart_forgets_cache() -> None:
    reg = WorkerRegistry("m")
    s = WorkerStats(role=ROLE_PREFILL_AND_DECODE, worker_id="a", incarnation="one", max_batch=4)
    reg.observe(s)
    reg.remember("a", [b"x"])
    reg.observe(WorkerStats(role=ROLE_PREFILL_AND_DECODE, worker_id="a", incarnation="two", max_batch=4))
    assert reg.workers["a"].blocks == {}


def test_routing_weighs_load_against_cached_prefix(text_model: TextModel) -> None:
    """Distinct chats share only the template's system-prompt block: a burst spreads over both decode
    workers (the longest match alone sent all of them to one). A long shared prefix still attracts its
    requests, until the worker holding it is busier by about as many blocks as the prefix saves."""
    bs = 16
    tok, tpl = text_model.tokenizer, text_model.chat_template
    reg = WorkerRegistry("m", rng=random.Random(0))

    def report(wid: str, used: int = 0) -> None:
        reg.observe(WorkerStats(role="decode_only", worker_id=wid, running=0, free_blocks=1000 - used,
                                total_blocks=1000, max_batch=64))

    def route(ids: list[int], rid: str) -> Route:
        hashes = prefix_hashes(ids, bs)
        r = reg.choose(hashes, (len(ids) + bs - 1) // bs)
        reg.dispatched(r.worker_id, hashes, (len(ids) + bs - 1) // bs, rid)
        return r

    def chat(content: str, system: str | None = None) -> list[int]:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
        return tok.encode(tpl.render(msgs))

    report("a")
    report("b")
    route(chat("warm up"), "w0")  # one worker now holds the system-prompt block...
    route(chat("warm up too"), "w1")  # ...the other too (it was the cheaper one)
    report("a")
    report("b")
    burst = [route(chat(f"Question {i}: what is {i} times {i + 3}? Answer briefly."), f"r{i}") for i in range(6)]
    assert all(r.matched_blocks == 1 for r in burst)  # each shares exactly the system-prompt block
    assert sorted(r.worker_id for r in burst).count("a") == 3  # spread evenly, not 6 of 6
    # requests that end free their worker at once: the next burst spreads again
    for i in range(6):
        reg.finished(f"r{i}")
    assert reg.workers["a"].load == reg.workers["b"].load == 0

    # a 30-block shared prefix, cached on one worker: its requests follow it
    system = " ".join(f"rule {i} of the house." for i in range(100))
    first = route(chat("first", system), "p0")
    holder = first.worker_id
    later = [route(chat(f"follow-up {i}", system), f"p{i + 1}") for i in range(5)]
    assert all(r.worker_id == holder and r.reason == "prefix affinity" and r.matched_blocks >= 30 for r in later)
    # ...until the holder holds many more blocks for running requests than the prefix saves
    report(holder, used=400)
    assert route(chat("one more", system), "p9").worker_id != holder
    assert reg.choose([], 1).reason == "least loaded"


def test_text_model_matches_full_loader(text_model: TextModel) -> None:
    ids = text_model.tokenizer.encode(text_model.chat_template.render([{"role": "user", "content": "Hi 12 ü"}]))
    assert text_model.max_position == 8192 and text_model.vocab_size == 49152
    assert text_model.tokenizer.decode(ids, skip_special=False).startswith("<|im_start|>system")
    assert text_model.from_cache or text_model.load_seconds > 0
    again = load_text_model(DEFAULT_MODEL)  # second load: from the JSON cache (no GGUF parsing)
    assert again.from_cache
    assert again.tokenizer.encode("Grüße 123") == text_model.tokenizer.encode("Grüße 123")


def test_token_bytes_are_exact(text_model: TextModel) -> None:
    tb = TokenBytes(text_model.tokenizer)
    ids = text_model.tokenizer.encode(UTF8_REPLY)
    raw = b"".join(bytes(tb(t)[1]) for t in ids)
    assert raw.decode("utf-8") == UTF8_REPLY


def test_validation_error_param_path() -> None:
    from gateway.errors import _loc_param

    assert _loc_param(("body", "messages", 0, "role")) == "messages[0].role"
    assert _loc_param(("body",)) is None


# ============================================================================ endpoints


def test_health_ready_models_openapi(gw: ServerThread, client: openai.OpenAI) -> None:
    assert httpx.get(f"{gw.url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{gw.url}/ready").json()
    assert ready["status"] == "ready" and any(w["worker_id"] == "fake-1" for w in ready["workers"])
    models = client.models.list()
    assert [x.id for x in models.data] == [DEFAULT_MODEL]
    assert client.models.retrieve(DEFAULT_MODEL).id == DEFAULT_MODEL
    spec = httpx.get(f"{gw.url}/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready"} <= set(spec["paths"])
    assert "tandem_gateway_requests" in httpx.get(f"{gw.url}/metrics").text


def test_chat_sync_and_usage(client: openai.OpenAI, worker: FakeWorker, text_model: TextModel) -> None:
    r = client.chat.completions.create(model=DEFAULT_MODEL, temperature=0, max_tokens=50,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == "Paris is the capital of France. It is known for the Eiffel Tower."
    assert r.choices[0].finish_reason == "stop"
    want = text_model.tokenizer.encode(text_model.chat_template.render(
        [{"role": "user", "content": "What is the capital of France?"}]))
    assert r.usage.prompt_tokens == len(want)
    assert r.usage.completion_tokens == len(text_model.tokenizer.encode(r.choices[0].message.content))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # what went on the bus
    how, req = worker.requests[-1]
    assert req.prompt_ids == want and req.sampling.max_tokens == 50 and req.sampling.temperature == 0
    assert req.deadline > time.time() and req.model == DEFAULT_MODEL and how in ("direct", "pool")


def test_chat_content_parts_and_system(client: openai.OpenAI, worker: FakeWorker, text_model: TextModel) -> None:
    client.chat.completions.create(model=DEFAULT_MODEL, temperature=0, max_tokens=3, messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
    ])
    prompt = text_model.tokenizer.decode(worker.requests[-1][1].prompt_ids, skip_special=False)
    assert "Be brief." in prompt and "part one\npart two" in prompt and "SmolLM" not in prompt


def test_max_tokens_length(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=DEFAULT_MODEL, temperature=0, max_completion_tokens=3,
                                       messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_chat_stream_sync_matches_non_stream(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model=DEFAULT_MODEL, messages=msgs, temperature=0)
    chunks = list(client.chat.completions.create(model=DEFAULT_MODEL, messages=msgs, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in chunks)


def test_chat_stream_async_include_usage(gw: ServerThread) -> None:
    asyncio.run(asyncio.wait_for(_async_stream_usage(gw), 30))


async def _async_stream_usage(gw: ServerThread) -> None:
    aclient = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0, timeout=30)
    stream = await aclient.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": "hello"}], temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens > 0
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens
    r = await aclient.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "hello"}],
                                              temperature=0)
    assert r.choices[0].message.content == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    await aclient.close()


def test_stream_raw_sse_ends_with_done(gw: ServerThread) -> None:
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=chat_body("hi", stream=True, temperature=0),
                      timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: ") for ln in lines)


def test_a_wake_up_that_rang_while_nobody_waited_is_not_an_event() -> None:
    """A request's reader waits for its next event on one timer (`Run._get`). The timer may ring while the reader
    writes to its client: the wake-up then waits in the queue ahead of the next message and must read as "look
    again" (None), never as an event (it once failed a stream at 16 concurrent ones as an internal error)."""
    async def go() -> None:
        run = Run(SimpleNamespace(config=SimpleNamespace(deadline_grace=1.0)), SimpleNamespace(jobs=[], timeout=60.0),
                  "client-id")
        assert await run._get(0.01) is None  # nothing came within the wait
        run.queue.put_nowait((0, "first"))
        assert await run._get(5.0) == (0, "first")  # a waiting message at once
        asyncio.get_running_loop().call_later(0.01, run.queue.put_nowait, (0, "second"))
        assert await run._get(0.05) == (0, "second")  # one that came during the wait; the timer stays armed
        await asyncio.sleep(0.1)  # it rings while nobody waits
        run.queue.put_nowait((0, "third"))
        assert await run._get(5.0) is None
        assert await run._get(5.0) == (0, "third")

    asyncio.run(go())


def test_a_quiet_stream_gets_keep_alives_between_its_tokens(nats_srv: EmbeddedNats, worker: FakeWorker,
                                                           text_model: TextModel, gw: ServerThread) -> None:
    """A worker 0.1 s between tokens, a gateway that keeps a stream alive after 0.03 s of silence: comments
    between the tokens (one wake-up timer per request, re-armed only when it must ring sooner), and the same
    text as a gateway that never needed them."""
    body = chat_body("[slow] hello there", stream=True, temperature=0, max_tokens=6)

    def stream(url: str) -> list[str]:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            return [ln for ln in r.iter_lines() if ln]

    def text(lines: list[str]) -> str:
        return "".join(json.loads(ln[6:])["choices"][0]["delta"].get("content") or ""
                       for ln in lines if ln.startswith("data: {") and json.loads(ln[6:])["choices"])

    quick = ServerThread(create_app(make_config(nats_srv.url, sse_keepalive=0.03), text_model)).start()
    try:
        wait_until(lambda: httpx.get(f"{quick.url}/ready").status_code == 200, 10, "/ready")
        lines = stream(quick.url)
    finally:
        quick.stop()
    alive = [ln for ln in lines if ln.startswith(":")]
    assert alive and set(alive) == {": keep-alive"} and lines[-1] == "data: [DONE]"
    assert text(lines) and text(lines) == text(stream(gw.url))


def test_utf8_stream_is_never_split(client: openai.OpenAI) -> None:
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": "[utf8]"}], stream=True) if c.choices]
    assert "".join(pieces) == UTF8_REPLY
    assert not any("\ufffd" in p for p in pieces)


def test_stop_strings(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=DEFAULT_MODEL, temperature=0, stop=["capital"],
                                       messages=[{"role": "user", "content": "x"}])
    assert r.choices[0].message.content == "Paris is the " and r.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model=DEFAULT_MODEL, temperature=0, stop="Eiffel", stream=True,
                                            messages=[{"role": "user", "content": "x"}])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Paris is the capital of France. It is known for the "


def test_n2_and_seed_reproducible(client: openai.OpenAI, worker: FakeWorker) -> None:
    kw: dict[str, Any] = dict(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "words"}],
                              temperature=1.0, seed=7, n=2)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert texts[0] != texts[1]  # seeds 7 and 8
    assert sorted(r.sampling.seed for _, r in worker.requests[-2:]) == [7, 8]
    assert a.usage.completion_tokens == sum(
        len(worker.text.tokenizer.encode(t)) for t in texts)
    # streamed n=2: both indexes appear and both finish
    chunks = list(client.chat.completions.create(**kw, stream=True))
    got = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for ch in c.choices:
            got[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1} and [got[0], got[1]] == texts


def test_completions(client: openai.OpenAI, text_model: TextModel, worker: FakeWorker) -> None:
    r = client.completions.create(model=DEFAULT_MODEL, prompt="The capital of France is", temperature=0,
                                  max_tokens=200)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text.startswith("Paris") and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(text_model.tokenizer.encode("The capital of France is"))
    assert worker.requests[-1][1].prompt_ids == text_model.tokenizer.encode("The capital of France is")
    # default max_tokens is 16, as OpenAI's
    r = client.completions.create(model=DEFAULT_MODEL, prompt="x", temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16
    # several prompts, token ids, echo
    r = client.completions.create(model=DEFAULT_MODEL, prompt=["a", "b"], temperature=0, max_tokens=2, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    r = client.completions.create(model=DEFAULT_MODEL, prompt=[1, 2, 3], temperature=0, max_tokens=2)
    assert worker.requests[-1][1].prompt_ids == [1, 2, 3]
    r = client.completions.create(model=DEFAULT_MODEL, prompt="Echo me", temperature=0, max_tokens=2, echo=True)
    assert r.choices[0].text.startswith("Echo mePar")
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=DEFAULT_MODEL, prompt="hi", temperature=0, max_tokens=200, stream=True))
    assert text == "Paris is the capital of France. It is known for the Eiffel Tower."


def test_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=DEFAULT_MODEL, temperature=0, max_tokens=4, logprobs=True,
                                       top_logprobs=2, messages=[{"role": "user", "content": "x"}])
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert content[0].logprob == pytest.approx(-0.25) and len(content[0].top_logprobs) == 2
    assert content[0].top_logprobs[0].token == content[0].token
    assert bytes(content[0].bytes).decode() == content[0].token
    chunks = list(client.chat.completions.create(model=DEFAULT_MODEL, temperature=0, max_tokens=4, logprobs=True,
                                                 stream=True, messages=[{"role": "user", "content": "x"}]))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    rc = client.completions.create(model=DEFAULT_MODEL, prompt="x", temperature=0, max_tokens=3, logprobs=1)
    lp = rc.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3 and lp.text_offset[0] == 0
    assert lp.top_logprobs is not None and all(len(d) == 1 for d in lp.top_logprobs)
    assert client.chat.completions.create(model=DEFAULT_MODEL, temperature=0, max_tokens=2, messages=[
        {"role": "user", "content": "x"}]).choices[0].logprobs is None


def test_target_endpoint_body_and_header(client: openai.OpenAI, gw: ServerThread, worker: FakeWorker) -> None:
    r = client.chat.completions.create(model=DEFAULT_MODEL, temperature=0, max_tokens=2,
                                       messages=[{"role": "user", "content": "x"}],
                                       extra_body={"target_endpoint": "prefill-1"})
    assert r.choices[0].message.content and worker.requests[-1][1].target_endpoint == "prefill-1"
    r = client.chat.completions.create(model=DEFAULT_MODEL, temperature=0, max_tokens=2,
                                       messages=[{"role": "user", "content": "x"}],
                                       extra_headers={"X-Target-Endpoint": "prefill-1"})
    assert worker.requests[-1][1].target_endpoint == "prefill-1"
    resp = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body("x", target_endpoint="nope"), timeout=30)
    assert_error(resp, 400, code="unknown_target")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "x"}],
                                       stream=True, extra_headers={"X-Target-Endpoint": "nope"})


def test_routing_affinity_over_two_workers(nats_srv: EmbeddedNats, subjects: Subjects, text_model: TextModel,
                                            loop_thread: LoopThread, gw: ServerThread,
                                            worker: FakeWorker) -> None:
    w2 = FakeWorker(nats_srv.url, subjects, text_model, "fake-2")
    loop_thread.run(w2.start())
    try:
        wait_until(lambda: len(httpx.get(f"{gw.url}/ready").json()["workers"]) >= 2, 15, "two workers")
        long_prompt = "Tell me about " + " ".join(WORDS * 5)
        body = chat_body(long_prompt, temperature=0, max_tokens=2)
        before = (len(worker.requests), len(w2.requests))
        for _ in range(4):
            assert httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30).status_code == 200
        new = worker.requests[before[0]:] + w2.requests[before[1]:]
        served_by = {id(r) for _, r in new}
        assert len(served_by) == 4
        # all four landed on one worker (prefix affinity), each as a direct request
        assert (len(worker.requests) - before[0], len(w2.requests) - before[1]) in ((4, 0), (0, 4))
        assert all(how == "direct" for how, _ in new)
    finally:
        loop_thread.run(w2.stop())
        # fake-2 looks alive for alive_after more seconds; the next tests expect fake-1 alone
        wait_until_only_fake1_routable(gw.url, worker)


# ============================================================================ errors


def test_invalid_fields_are_400(gw: ServerThread) -> None:
    url = f"{gw.url}/v1/chat/completions"
    assert_error(httpx.post(url, json=chat_body("x", temperature=5)), 400, param="temperature")
    assert_error(httpx.post(url, json=chat_body("x", top_p=0)), 400, param="top_p")
    assert_error(httpx.post(url, json=chat_body("x", n=0)), 400, param="n")
    assert_error(httpx.post(url, json=chat_body("x", max_tokens=0)), 400, param="max_tokens")
    assert_error(httpx.post(url, json=chat_body("x", top_logprobs=3)), 400, param="top_logprobs")
    assert_error(httpx.post(url, json=chat_body("x", stop=["a"] * 17)), 400, param="stop")
    assert_error(httpx.post(url, json=chat_body("x", stream_options={"include_usage": True})), 400,
                 param="stream_options")
    assert_error(httpx.post(url, json={"model": DEFAULT_MODEL}), 400, param="messages",
                 code="missing_required_parameter")
    assert_error(httpx.post(url, json={"model": DEFAULT_MODEL, "messages": [{"role": "wizard", "content": "x"}]}),
                 400, param="messages[0].role")
    assert_error(httpx.post(url, json={"model": DEFAULT_MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}),
        400, param="messages[0].content[0].type")
    assert_error(httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400,
                 code="invalid_json")
    assert_error(httpx.post(f"{gw.url}/v1/completions", json={"model": DEFAULT_MODEL, "prompt": [99999999]}),
                 400, param="prompt")
    assert_error(httpx.post(f"{gw.url}/v1/completions", json={"model": DEFAULT_MODEL, "prompt": ""}),
                 400, param="prompt")
    assert_error(httpx.post(url, json=chat_body("x"), headers={"X-Request-Timeout": "soon"}), 400)
    assert_error(httpx.get(f"{gw.url}/v1/nothing-here"), 404)
    still_serving(gw.url)


def test_openai_client_raises_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=DEFAULT_MODEL, temperature=9,
                                       messages=[{"role": "user", "content": "x"}])
    assert ei.value.status_code == 400 and ei.value.body["param"] == "temperature"


def test_unknown_model_404(gw: ServerThread, client: openai.OpenAI) -> None:
    err = assert_error(httpx.post(f"{gw.url}/v1/chat/completions", json={**chat_body("x"), "model": "gpt-9"}),
                       404, param="model", code="model_not_found")
    assert "gpt-9" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    still_serving(gw.url)


def test_context_length_400(gw: ServerThread) -> None:
    url = f"{gw.url}/v1/chat/completions"
    err = assert_error(httpx.post(url, json=chat_body("x", max_tokens=8190)), 400, param="max_tokens",
                       code="context_length_exceeded")
    assert "8192" in err["message"]
    long_text = "hello " * 9000
    assert_error(httpx.post(url, json=chat_body(long_text), timeout=30), 400, param="messages",
                 code="context_length_exceeded")
    assert_error(httpx.post(f"{gw.url}/v1/completions", json={"model": DEFAULT_MODEL, "prompt": long_text},
                            timeout=30), 400, code="context_length_exceeded")
    still_serving(gw.url)


def test_worker_errors_pass_through(gw: ServerThread, client: openai.OpenAI) -> None:
    url = f"{gw.url}/v1/chat/completions"
    assert_error(httpx.post(url, json=chat_body("[error400]")), 400, code="bad_request")
    r = httpx.post(url, json=chat_body("[busy]"))
    assert_error(r, 503, code="overloaded")
    assert int(r.headers["retry-after"]) >= 1
    r = httpx.post(url, json=chat_body("[queuefull]", stream=True))
    assert_error(r, 429)
    assert int(r.headers["retry-after"]) >= 1
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "[queuefull]"}])
    still_serving(gw.url)


def test_deadline_504_and_cancel(gw: ServerThread, worker: FakeWorker) -> None:
    wall_before = time.time()
    t0 = time.monotonic()
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body("[hang]"), headers={"X-Request-Timeout": "1"},
                   timeout=30)
    elapsed = time.monotonic() - t0
    wall_after = time.time()
    assert_error(r, 504, code="deadline_exceeded")
    # not before the 1 s deadline; and well before the client's own 30 s timeout (a hang)
    assert 1.0 <= elapsed < 15
    rid = worker.requests[-1][1].request_id
    # the deadline on the bus is "when the gateway took the request + 1 s", and it took it in between
    assert wall_before + 1 <= worker.requests[-1][1].deadline <= wall_after + 1
    wait_until(lambda: rid in worker.cancels, 15, "the cancel of the timed-out request")
    wait_until(lambda: rid not in worker.active, 15, "the fake worker to drop it")
    still_serving(gw.url)


def stream_errors(url: str, code: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "tandem_gateway_stream_errors_total" and s.labels.get("code") == code)


def test_error_after_stream_started_is_sse_event(gw: ServerThread, client: openai.OpenAI) -> None:
    before = stream_errors(gw.url, "internal")
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=chat_body("[failmid]", stream=True,
                                                                             temperature=0), timeout=30) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][len("data: "):])["error"]
    assert err["code"] == "internal" and "mid-stream" in err["message"] and err["type"] == "server_error"
    assert sum('"content":"' in ln for ln in lines) >= 2  # tokens came before the error
    with pytest.raises(openai.APIError, match="mid-stream"):
        for _ in client.chat.completions.create(model=DEFAULT_MODEL, stream=True, temperature=0,
                                                messages=[{"role": "user", "content": "[failmid]"}]):
            pass
    assert stream_errors(gw.url, "internal") == before + 2  # counted, though both answers were 200
    still_serving(gw.url)


def test_client_disconnect_mid_stream_cancels(gw: ServerThread, worker: FakeWorker) -> None:
    n_before = len(worker.requests)
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=chat_body("[slow]", stream=True),
                      timeout=30) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen >= 4:
                break
    rid = worker.requests[n_before][1].request_id
    wait_until(lambda: rid in worker.cancels, 15, "the cancel after the client left")
    wait_until(lambda: not worker.active, 15, "the fake worker to free everything")
    still_serving(gw.url)


def test_client_disconnect_non_stream_cancels(gw: ServerThread, worker: FakeWorker) -> None:
    asyncio.run(asyncio.wait_for(_disconnect_non_stream(gw, worker), 60))


async def _disconnect_non_stream(gw: ServerThread, worker: FakeWorker) -> None:
    n_before = len(worker.requests)
    async with httpx.AsyncClient(timeout=30) as ac:
        task = asyncio.create_task(ac.post(f"{gw.url}/v1/chat/completions", json=chat_body("[slow]")))
        await asyncio.to_thread(wait_until, lambda: len(worker.requests) > n_before, 15,
                                "the request to reach the worker", 0.02)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    rid = worker.requests[n_before][1].request_id
    await asyncio.to_thread(wait_until, lambda: rid in worker.cancels and not worker.active, 15,
                            "the cancel after the client left", 0.02)


def test_worker_lost_before_tokens_is_resent(nats_srv: EmbeddedNats, subjects: Subjects, text_model: TextModel,
                                            loop_thread: LoopThread, worker: FakeWorker) -> None:
    # a direct-only worker that takes requests, never answers, then stops reporting. The fake
    # workers report every 0.2 s: the windows leave room for a loaded machine's scheduling gaps.
    srv = ServerThread(create_app(make_config(nats_srv.url, alive_after=2.0, worker_lost_after=3.0),
                                  text_model)).start()
    ghost = FakeWorker(nats_srv.url, subjects, text_model, "ghost", pull_pool=False)
    ghost.mute = True
    loop_thread.run(ghost.start())
    try:
        worker.report = False  # make the ghost the only live worker for routing
        # the others silent for longer than alive_after (2 s): out of routing
        wait_until(lambda: [w["worker_id"] for w in httpx.get(f"{srv.url}/ready").json()["workers"]
                            if w["age_s"] < 2.0] == ["ghost"], 15, "only the ghost reporting")
        n_before = len(worker.requests)
        answer = chat_in_background(srv.url, "resend me")
        wait_until(lambda: len(ghost.requests) == 1, 15, "the request to reach the ghost")
        ghost.report = False
        worker.report = True
        answer()
        assert len(worker.requests) == n_before + 1
        assert ghost.requests[0][1].request_id in worker.cancels
    finally:
        worker.report = True
        loop_thread.run(ghost.stop())
        srv.stop()


def test_no_worker_503_with_retry_after(nats_srv: EmbeddedNats, text_model: TextModel) -> None:
    srv = ServerThread(create_app(make_config(nats_srv.url, namespace="empty"), text_model)).start()
    try:
        ready = httpx.get(f"{srv.url}/ready")
        assert ready.status_code == 503 and "no decode-capable worker" in ready.json()["reason"]
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat_body("x"))
        assert_error(r, 503, code="no_workers")
        assert int(r.headers["retry-after"]) >= 1
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat_body("x", stream=True))
        assert_error(r, 503, code="no_workers")
        assert httpx.get(f"{srv.url}/health").status_code == 200
    finally:
        srv.stop()


def test_gateway_inflight_limit_429(nats_srv: EmbeddedNats, worker: FakeWorker, text_model: TextModel) -> None:
    srv = ServerThread(create_app(make_config(nats_srv.url, max_inflight=2), text_model)).start()
    try:
        wait_until(lambda: httpx.get(f"{srv.url}/ready").status_code == 200, 15, "ready")
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat_body("x", n=3))
        assert_error(r, 429, code="too_many_requests")
        assert r.headers["retry-after"] == "1"
        still_serving(srv.url)
    finally:
        srv.stop()


def test_full_generate_queue_429(nats_srv: EmbeddedNats, text_model: TextModel, loop_thread: LoopThread) -> None:
    """JetStream refuses a publish to a full pool (max_msgs, discard new): the client gets 429, not a hang."""
    from bus.streams import WorkQueueConfig

    ns = "fullq"
    subjects = Subjects(text_model.name, ns)

    async def small_queue() -> int:
        nc = await nats.connect(nats_srv.url)
        try:
            await ensure_streams(nc, subjects, generate=WorkQueueConfig(max_msgs=1))
            return (await nc.jetstream().stream_info(subjects.generate_stream)).state.messages
        finally:
            await nc.close()

    async def queued() -> int:
        nc = await nats.connect(nats_srv.url)
        try:
            return (await nc.jetstream().stream_info(subjects.generate_stream)).state.messages
        finally:
            await nc.close()

    assert loop_thread.run(small_queue()) == 0
    srv = ServerThread(create_app(make_config(nats_srv.url, namespace=ns, queue_when_no_workers=True,
                                              ensure_streams=False), text_model)).start()
    try:
        result: list[httpx.Response] = []
        t = threading.Thread(target=lambda: result.append(httpx.post(
            f"{srv.url}/v1/chat/completions", json=chat_body("first"), headers={"X-Request-Timeout": "3"},
            timeout=30)))
        t.start()
        wait_until(lambda: loop_thread.run(queued()) == 1, 15, "the first request to fill the queue")
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat_body("second"), timeout=30)
        assert_error(r, 429, code="queue_full")
        assert int(r.headers["retry-after"]) >= 1
        t.join(30)
        assert result and result[0].status_code == 504  # nobody pulled the first one before its deadline
    finally:
        srv.stop()


def test_api_keys_401(nats_srv: EmbeddedNats, worker: FakeWorker, text_model: TextModel,
                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_API_KEYS", "k1, k2")
    monkeypatch.setenv("TANDEM_NATS_URL", nats_srv.url)
    cfg = GatewayConfig.from_env(model=DEFAULT_MODEL, deadline_grace=0.5)
    assert cfg.api_keys == ("k1", "k2")
    srv = ServerThread(create_app(cfg, text_model)).start()
    try:
        wait_until(lambda: httpx.get(f"{srv.url}/ready").status_code == 200, 15, "ready")
        url = f"{srv.url}/v1/chat/completions"
        assert_error(httpx.post(url, json=chat_body("x")), 401, code="invalid_api_key")
        assert_error(httpx.post(url, json=chat_body("x"), headers={"Authorization": "Bearer nope"}), 401,
                     code="invalid_api_key")
        assert_error(httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer nope"}), 401)
        assert_error(httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}), 401,
                     code="invalid_api_key")  # the key is checked before the body is read
        bad = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "x"}])
        good = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="k2", max_retries=0)
        assert good.chat.completions.create(model=DEFAULT_MODEL, temperature=0,
                                            messages=[{"role": "user", "content": "x"}]).choices[0].message.content
        assert httpx.get(f"{srv.url}/health").status_code == 200  # probes need no key
    finally:
        srv.stop()


def test_a_lost_stream_message_is_asked_for_again(gw: ServerThread, worker: FakeWorker) -> None:
    """Message 3 never reached the gateway (NATS dropped it in a failover): the next one shows the gap, the
    gateway asks the workers to publish the stream again from 3, and the client gets the whole text."""
    whole = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body("x", temperature=0)).json()
    for stream in (False, True):
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body("[gap]", temperature=0, stream=stream))
        assert r.status_code == 200, r.text
        if stream:
            text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                           for line in r.text.splitlines() if line.startswith("data: {") and '"choices":[{' in line)
        else:
            text = r.json()["choices"][0]["message"]["content"]
        assert text == whole["choices"][0]["message"]["content"]
    asked = [a for a in worker.replays if a.from_seq == 3]
    assert len(asked) >= 2 and all(a.requester for a in asked), worker.replays
    assert 'tandem_gateway_replays_requested_total{reason="gap"} ' in httpx.get(f"{gw.url}/metrics").text


def test_a_gap_nobody_fills_is_an_error_not_a_hole(gw: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.run

    monkeypatch.setattr(gateway.run, "GAP_WAIT_S", 1.0)
    assert_error(httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body("[hole]", temperature=0)), 502,
                 code="stream_gap")
    still_serving(gw.url)


def test_route_headers(gw: ServerThread) -> None:
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body("x", temperature=0, max_tokens=2, n=2))
    assert r.headers["x-tandem-decode-worker"] == "fake-1,fake-1"
    assert r.headers["x-tandem-prefill"] == "aggregate,aggregate"
    assert r.headers["x-request-id"] == r.json()["id"]


def test_disconnect_before_first_token_cancels(gw: ServerThread, worker: FakeWorker) -> None:
    """A streamed request whose worker has not answered yet: leaving still cancels it at once."""
    n_before = len(worker.requests)

    async def go() -> None:
        async with httpx.AsyncClient(timeout=30) as ac:
            task = asyncio.create_task(ac.post(f"{gw.url}/v1/chat/completions", json=chat_body("[hang]", stream=True)))
            await until(lambda: len(worker.requests) > n_before, 10, "the request to reach the worker", 0.02)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    t0 = time.monotonic()
    asyncio.run(asyncio.wait_for(go(), 10))
    rid = worker.requests[n_before][1].request_id
    wait_until(lambda: rid in worker.cancels, 15, "the cancel")
    # not after the stream-start wait (gateway.app.STREAM_START_WAIT, 20 s after the request came)
    assert time.monotonic() - t0 < 15


def test_nats_restart_mid_stream_loses_no_token(text_model: TextModel, loop_thread: LoopThread) -> None:
    """Tokens published while the gateway and the worker were away from NATS (a restart of the only
    server) are asked for again once both are back: the stream completes with the text of an uncut run."""
    with EmbeddedNats() as srv:
        subj = Subjects(text_model.name)
        w = FakeWorker(srv.url, subj, text_model, "fake-r")
        loop_thread.run(w.start())
        gws = ServerThread(create_app(make_config(srv.url), text_model)).start()
        try:
            wait_until(lambda: httpx.get(f"{gws.url}/ready").status_code == 200, 15, "ready")

            restarted: list[float] = []

            def streamed(restart: bool) -> list[str]:
                lines: list[str] = []
                with httpx.stream("POST", f"{gws.url}/v1/chat/completions",
                                  json=chat_body("[slow]", stream=True, max_tokens=30), timeout=30) as r:
                    assert r.status_code == 200
                    for line in r.iter_lines():
                        if line:
                            lines.append(line)
                        if restart and len(lines) == 3:
                            srv.restart()
                            restarted.append(time.monotonic())
                assert lines[-1] == "data: [DONE]" and '"error"' not in "".join(lines), lines[-3:]
                return [json.loads(x[6:])["choices"][0]["delta"].get("content") or "" for x in lines
                        if x.startswith("data: {") and '"choices":[{' in x]

            uncut = streamed(restart=False)
            assert "".join(streamed(restart=True)) == "".join(uncut)
            restarted_at = restarted[0]
            # once back, it asked for what it may have missed (the worker answers if it is back by then; what
            # it published while away waited in its client's buffer, and later gaps are asked for again)
            assert 'tandem_gateway_replays_requested_total{reason="reconnect"}' in httpx.get(f"{gws.url}/metrics").text
            # once reconnected, the gateway serves again. Load reports from before the restart keep
            # /ready at 200 for the 3 s liveness window: wait for one the gateway got after the restart.
            # It proves both are back: the gateway's subscriptions, and the worker's (nats-py sends
            # its subscriptions before anything it publishes on a new connection).
            def report_since_restart() -> bool:
                asked = time.monotonic()
                r = httpx.get(f"{gws.url}/ready")
                ages = {w["worker_id"]: w["age_s"] for w in r.json().get("workers", [])}
                # age_s is rounded to 10 ms; "asked" is before the gateway measured the age
                return r.status_code == 200 and "fake-r" in ages and ages["fake-r"] + 0.01 < asked - restarted_at

            wait_until(report_since_restart, 15, "a load report sent after the restart")
            still_serving(gws.url)
        finally:
            gws.stop()
            loop_thread.run(w.stop())


def test_only_worker_lost_is_503_not_a_hang(nats_srv: EmbeddedNats, text_model: TextModel,
                                           loop_thread: LoopThread) -> None:
    ns = "lonely"
    ghost = FakeWorker(nats_srv.url, Subjects(text_model.name, ns), text_model, "ghost", pull_pool=False)
    ghost.mute = True
    loop_thread.run(ghost.start())
    srv = ServerThread(create_app(make_config(nats_srv.url, namespace=ns, alive_after=2.0, worker_lost_after=3.0,
                                              worker_wait=2.0), text_model)).start()
    try:
        wait_until(lambda: httpx.get(f"{srv.url}/ready").status_code == 200, 15, "ready")
        result: list[httpx.Response] = []
        t = threading.Thread(target=lambda: result.append(httpx.post(
            f"{srv.url}/v1/chat/completions", json=chat_body("anyone?"), timeout=30)))
        t0 = time.monotonic()
        t.start()
        wait_until(lambda: len(ghost.requests) == 1, 15, "the request to reach the ghost")
        ghost.report = False
        t.join(15)
        assert result, "no answer"
        r = assert_error(result[0], 503, code="no_workers")
        assert "Retry-After" in result[0].headers and r["type"] == "service_unavailable_error"
        # noticed after worker_lost_after (3 s) of silence and worker_wait (2 s) for another, not left to hang
        # until the 30 s client timeout
        assert time.monotonic() - t0 < 12
        wait_until(lambda: ghost.requests[0][1].request_id in ghost.cancels, 15, "the cancel")
    finally:
        srv.stop()
        loop_thread.run(ghost.stop())


def test_worker_not_listening_is_skipped_at_once(nats_srv: EmbeddedNats, text_model: TextModel,
                                                 loop_thread: LoopThread) -> None:
    """A worker that still reports but no longer listens (draining): NATS says "no responders" and
    the gateway re-sends the request without waiting for the worker to be declared lost."""
    ns = "phantom"
    subj = Subjects(text_model.name, ns)
    phantom = FakeWorker(nats_srv.url, subj, text_model, "phantom", pull_pool=False)
    phantom.listen_direct = False
    busy = FakeWorker(nats_srv.url, subj, text_model, "busy")  # pulls the pool, but reports itself full
    busy.fake_running = busy.max_batch
    for w in (phantom, busy):
        loop_thread.run(w.start())
    srv = ServerThread(create_app(make_config(nats_srv.url, namespace=ns, worker_lost_after=30), text_model)).start()
    try:
        wait_until(lambda: len(httpx.get(f"{srv.url}/ready").json()["workers"]) == 2, 15, "both workers")
        t0 = time.monotonic()
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat_body("hello", temperature=0), timeout=60)
        assert r.status_code == 200, r.text
        assert time.monotonic() - t0 < 10  # not after the phantom is declared lost (worker_lost_after=30)
        assert [how for how, _ in busy.requests] == ["pool"] and phantom.requests == []
        assert r.headers["x-tandem-decode-worker"] == "busy"
    finally:
        srv.stop()
        for w in (phantom, busy):
            loop_thread.run(w.stop())


def test_pool_job_worker_lost_after_admission_is_resent(nats_srv: EmbeddedNats, text_model: TextModel,
                                                        loop_thread: LoopThread) -> None:
    """A full worker pulls the job from the pool, admits it (message 0) and dies: the job is re-sent."""
    ns = "poolwatch"
    subjects = Subjects(text_model.name, ns)
    ghost = FakeWorker(nats_srv.url, subjects, text_model, "ghost", pull_pool=True, admit=True)
    ghost.mute = True
    ghost.fake_running = ghost.max_batch  # reports full: the gateway sends to the pool
    loop_thread.run(ghost.start())
    healthy = FakeWorker(nats_srv.url, subjects, text_model, "healthy", pull_pool=False)
    srv = ServerThread(create_app(make_config(nats_srv.url, namespace=ns, alive_after=2.0, worker_lost_after=3.0),
                                  text_model)).start()
    try:
        wait_until(lambda: httpx.get(f"{srv.url}/ready").status_code == 200, 15, "ready")
        answer = chat_in_background(srv.url, "pool me")
        wait_until(lambda: len(ghost.requests) == 1, 15, "the ghost to pull the request")
        assert ghost.requests[0][0] == "pool"
        ghost.report = False
        loop_thread.run(healthy.start())
        # Without the admission notice the gateway would not know whom to watch: it would wait
        # for the request's 600 s deadline and the client would time out after 40 s.
        answer()
        assert [how for how, _ in healthy.requests] == ["direct"]
        assert ghost.requests[0][1].request_id in healthy.cancels
    finally:
        srv.stop()
        loop_thread.run(ghost.stop())
        if healthy.nc is not None:
            loop_thread.run(healthy.stop())


def test_unreadable_worker_message_is_502_not_a_hang(gw: ServerThread) -> None:
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body("[badmsg]"), timeout=30)
    err = assert_error(r, 502, code="bad_worker_message")
    assert "newer" in err["message"]
    still_serving(gw.url)


def test_only_the_worker_holding_a_request_is_heard(gw: ServerThread, nats_srv: EmbeddedNats,
                                                    loop_thread: LoopThread, worker: FakeWorker) -> None:
    """Messages on a request's stream subject from anyone but the worker holding it (another worker id, the
    same id from another process, no id at all, an unreadable body naming nobody) are dropped and counted,
    even with the very sequence number the gateway expects next: the answer is the undisturbed one."""
    prompt = "[slow] tell me"
    undisturbed = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body(prompt, temperature=0, max_tokens=30),
                             timeout=60)
    assert undisturbed.status_code == 200, undisturbed.text
    before = dropped_counts(gw.url)
    forged: list[str] = []

    async def rogue() -> None:
        nc = await nats.connect(nats_srv.url)
        try:
            sub = await nc.subscribe("tandem.stream.>")
            while True:  # the real stream's first tokens: its subject and the next sequence number
                msg = await sub.next_msg(timeout=30)
                real = decode(msg.data, StreamMessage)
                if isinstance(real, StreamTokens) and real.token_ids:
                    break
            nxt, rid = real.seq + 1, real.request_id
            for label, fake in (
                ("other_worker", StreamTokens(request_id=rid, seq=nxt, token_ids=[42], text=" INJECTED",
                                              worker_id="fake-2", incarnation=worker.incarnation)),
                ("other_process", StreamTokens(request_id=rid, seq=nxt, token_ids=[42], text=" INJECTED",
                                               worker_id=worker.worker_id, incarnation="a-forged-process")),
                ("unsigned", StreamError(request_id=rid, seq=nxt, message="INJECTED failure", status=500)),
                ("unsigned", StreamFinish(request_id=rid, seq=nxt, finish_reason="stop", text=" INJECTED")),
            ):
                await publish(nc, msg.subject, fake)
                forged.append(label)
            await nc.publish(msg.subject, b'{"kind": "stream_tokens", "v": 99, "seq": 1}')  # unreadable, nobody's
            forged.append("unsigned")
            await nc.flush()
        finally:
            await nc.close()

    answer = chat_in_background(gw.url, prompt, max_tokens=30)
    loop_thread.run(rogue(), timeout=40)
    r = answer()
    assert r.json()["choices"][0]["message"]["content"] == undisturbed.json()["choices"][0]["message"]["content"]
    assert "INJECTED" not in r.text
    after = dropped_counts(gw.url)
    for reason in ("other_worker", "other_process", "unsigned"):
        assert after.get(reason, 0) - before.get(reason, 0) == forged.count(reason), (reason, before, after)
    still_serving(gw.url)


def test_null_means_default(gw: ServerThread) -> None:
    body = chat_body("x", temperature=0, n=None, stream=None, logprobs=None, top_logprobs=None, seed=None,
                     stop=None, max_tokens=None, stream_options=None, ignore_eos=None, user=None)
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice.get("logprobs") is None
    r = httpx.post(f"{gw.url}/v1/completions", timeout=30, json={
        "model": DEFAULT_MODEL, "prompt": "x", "echo": None, "n": None, "max_tokens": None, "logprobs": None})
    assert r.status_code == 200, r.text
    assert_error(httpx.post(f"{gw.url}/v1/chat/completions", json={"model": DEFAULT_MODEL, "messages": None}),
                 400, param="messages")  # a required field stays required


def test_unsupported_openai_features_are_400(gw: ServerThread) -> None:
    url = f"{gw.url}/v1/chat/completions"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for extra, param in (({"logit_bias": {"42": 5}}, "logit_bias"),
                         ({"functions": [tool["function"]]}, "functions")):
        assert_error(httpx.post(url, json=chat_body("x", **extra)), 400, param=param, code="unsupported_parameter")
    # tools and response_format are implemented; what makes no sense is still refused
    assert_error(httpx.post(url, json=chat_body("x", tool_choice="required")), 400, param="tool_choice")
    assert_error(httpx.post(url, json=chat_body("x", tools=[tool], tool_choice={"type": "function",
                                                                                "function": {"name": "g"}})),
                 400, param="tool_choice")
    assert_error(httpx.post(url, json=chat_body("x", response_format={"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}})),
                 400, param="response_format.json_schema.schema")
    assert_error(httpx.post(f"{gw.url}/v1/completions", json={"model": DEFAULT_MODEL, "prompt": "x",
                                                                "logit_bias": {"1": -100}}),
                 400, param="logit_bias", code="unsupported_parameter")
    # what they mean when left at their defaults is fine
    ok = httpx.post(url, timeout=30, json=chat_body("x", temperature=0, tools=[], tool_choice="none",
                                                    response_format={"type": "text"}, logit_bias={}))
    assert ok.status_code == 200, ok.text


def test_more_invalid_inputs_are_400(gw: ServerThread) -> None:
    url = f"{gw.url}/v1/chat/completions"
    for field, value in (("n", "2"), ("stream", "true"), ("max_tokens", True), ("temperature", "0.5"),
                         ("logprobs", 1)):  # no guessing at what a wrongly typed value meant
        assert_error(httpx.post(url, json=chat_body("x", **{field: value})), 400, param=field)
    assert_error(httpx.post(f"{gw.url}/v1/completions", json={"model": DEFAULT_MODEL, "prompt": [True, False]}),
                 400, param="prompt")
    for content in ([], [{"text": "no type"}]):
        assert_error(httpx.post(url, json={"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": content}]}),
                     400)
    assert_error(httpx.post(url, json=chat_body("x", seed=2**64)), 400, param="seed")
    assert_error(httpx.post(url, json=chat_body("x", seed=2**63 - 1, n=2)), 400, param="seed")
    assert_error(httpx.post(url, json={"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": 5}]}),
                 400, param="messages[0].content")
    assert_error(httpx.post(f"{gw.url}/v1/completions", json={"model": DEFAULT_MODEL, "prompt": ["x"] * 65}),
                 400, param="prompt")
    for body in (b"[1, 2]", b'"hello"', b""):
        assert_error(httpx.post(url, content=body, headers={"content-type": "application/json"}), 400)
    assert_error(httpx.post(url, json=[chat_body("x")]), 400, code="invalid_request_body")
    big = b"{" + b" " * (16 * 1024 * 1024) + b"}"
    assert_error(httpx.post(url, content=big, headers={"content-type": "application/json"}, timeout=30), 413,
                 code="request_too_large")
    # a client making up paths does not make up metric series
    for path in ("/v1/made-up-1", "/v1/made-up-2"):
        assert httpx.get(f"{gw.url}{path}").status_code == 404
    metrics = httpx.get(f"{gw.url}/metrics").text
    assert "made-up" not in metrics and 'endpoint="other"' in metrics
    still_serving(gw.url)


def test_bus_request_ids_are_named_after_the_client_id(gw: ServerThread, worker: FakeWorker) -> None:
    """`tandem tail --request <X-Request-Id>` finds every choice of a client's request."""
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body("name me", temperature=0, n=2), timeout=30)
    assert r.status_code == 200, r.text
    client_id = r.headers["X-Request-Id"]
    assert r.json()["id"] == client_id
    ids = sorted(req.request_id for _, req in worker.requests[-2:])
    assert ids == [f"{client_id}-0", f"{client_id}-1"]


def test_sampling_fields_reach_the_worker(gw: ServerThread, worker: FakeWorker) -> None:
    body = chat_body("fields", temperature=0.7, top_p=0.9, top_k=5, seed=11, frequency_penalty=0.5,
                     presence_penalty=-0.25, stop=["\n\n", "END"], max_completion_tokens=7, logprobs=True,
                     top_logprobs=2, stop_token_ids=[3], user="someone")
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    s = worker.requests[-1][1].sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.7, 0.9, 5, 11)
    assert (s.frequency_penalty, s.presence_penalty) == (0.5, -0.25)
    assert (s.stop, s.stop_token_ids, s.max_tokens) == (["\n\n", "END"], [3], 7)
    assert s.logprobs and s.top_logprobs == 2


def test_handed_back_request_is_resent(nats_srv: EmbeddedNats, subjects: Subjects, text_model: TextModel,
                                       loop_thread: LoopThread, worker: FakeWorker) -> None:
    """A draining worker gives back a request before its first token: the client never sees it."""
    srv = ServerThread(create_app(make_config(nats_srv.url, alive_after=2.0, worker_lost_after=3.0),
                                  text_model)).start()
    drainer = FakeWorker(nats_srv.url, subjects, text_model, "drainer", pull_pool=False, admit=True)
    drainer.hands_back = True
    loop_thread.run(drainer.start())
    try:
        worker.fake_running = worker.max_batch  # reports full: the router picks the drainer first
        wait_until_routing_sees(srv.url, "drainer", worker)
        n_before = len(worker.requests)
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat_body("hand me back", temperature=0), timeout=30)
        assert r.status_code == 200, r.text
        assert len(drainer.requests) == 1
        # re-sent without the drainer: fake-1 is full, so through the pool, which fake-1 pulls
        assert [(how, req.request_id[-5:]) for how, req in worker.requests[n_before:]] == [("pool", "-0-r1")]
    finally:
        worker.fake_running = None
        loop_thread.run(drainer.stop())
        srv.stop()


def test_registry_routes_nothing_new_to_a_draining_worker() -> None:
    reg = WorkerRegistry("m", rng=random.Random(0))
    idle_but_draining = WorkerStats(role=ROLE_PREFILL_AND_DECODE, worker_id="d", running=0, max_batch=4,
                                    total_blocks=100, free_blocks=100, draining=True)
    busy = WorkerStats(role=ROLE_PREFILL_AND_DECODE, worker_id="b", running=3, max_batch=4,
                       total_blocks=100, free_blocks=100)
    reg.observe(idle_but_draining)
    reg.observe(busy)
    assert reg.choose([], 1).worker_id == "b"  # less loaded, but leaving
    assert [w.worker_id for w in reg.alive()] == ["b"]
    assert reg.is_alive("d")  # its running requests are still watched, not given up
    reg.observe(WorkerStats(role=ROLE_PREFILL_AND_DECODE, worker_id="b", running=4, max_batch=4,
                            total_blocks=100, free_blocks=100))
    assert reg.choose([], 1) == Route(None, "every worker is full")


def test_tokens_nobody_waits_for_are_cancelled(gw: ServerThread, nats_srv: EmbeddedNats, subjects: Subjects,
                                               loop_thread: LoopThread, worker: FakeWorker) -> None:
    """A worker that missed a cancel (it joined later, or was cut off) is told again by the gateway."""
    wait_until_only_fake1_routable(gw.url, worker)
    gateway_id = httpx.get(f"{gw.url}/ready").json()["gateway_id"]

    async def go() -> list[str]:
        nc = await nats.connect(nats_srv.url)
        try:
            cancels = await nc.subscribe(subjects.cancel_all)
            await nc.flush()
            for rid, msg in (("orphan-1", StreamTokens(request_id="orphan-1", seq=3, token_ids=[5], text="x")),
                             ("orphan-1", StreamTokens(request_id="orphan-1", seq=4, token_ids=[6], text="y")),
                             ("ended-1", StreamFinish(request_id="ended-1", seq=9, finish_reason="stop"))):
                await publish(nc, subjects.stream(gateway_id, rid), msg)
            def rid(data: bytes) -> str:
                return decode(data, Cancel).request_id

            seen = await read_until(cancels, lambda got: "orphan-1" in got, 10, "the orphan's cancel", rid)
            return seen + await read_quiet(cancels, 1.5, rid)  # then until 1.5 s pass without one
        finally:
            await nc.close()

    seen = loop_thread.run(go(), timeout=30)
    # once for both token messages; a finished request is left alone (other tests' cancels may pass by)
    assert seen.count("orphan-1") == 1, seen
    assert "ended-1" not in seen, seen
    still_serving(gw.url)


def test_worker_restarted_under_the_same_id_is_noticed(nats_srv: EmbeddedNats, subjects: Subjects,
                                                       text_model: TextModel, loop_thread: LoopThread,
                                                       worker: FakeWorker) -> None:
    """A pod restarts within the liveness window and reports again under its name: its request is re-sent."""
    srv = ServerThread(create_app(make_config(nats_srv.url, alive_after=2.0), text_model)).start()
    phoenix = FakeWorker(nats_srv.url, subjects, text_model, "phoenix", pull_pool=False, admit=True)
    phoenix.mute = True
    loop_thread.run(phoenix.start())
    try:
        worker.fake_running = worker.max_batch  # reports full: the router picks phoenix
        wait_until_routing_sees(srv.url, "phoenix", worker)
        n_before = len(worker.requests)
        answer = chat_in_background(srv.url, "rise again")
        wait_until(lambda: len(phoenix.requests) == 1, 15, "phoenix to take the request")
        phoenix.incarnation = "inc-2"  # the new process reports at once, well within worker_lost_after (10 s)
        answer()
        assert [(how, req.request_id[-5:]) for how, req in worker.requests[n_before:]] == [("pool", "-0-r1")]
        assert phoenix.requests[0][1].request_id in phoenix.cancels
    finally:
        worker.fake_running = None
        loop_thread.run(phoenix.stop())
        srv.stop()


def test_stalled_stream_reader_is_cancelled_at_the_deadline(gw: ServerThread, worker: FakeWorker) -> None:
    """A client that stops reading a stream (its socket stays open) does not hold the request past its deadline."""
    wait_until_only_fake1_routable(gw.url, worker)
    body = json.dumps(chat_body("[flood]", stream=True)).encode()
    n_before = len(worker.requests)
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"X-Request-Timeout: 3\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert s.recv(12).startswith(b"HTTP/1.1 200")  # then never read again
        wait_until(lambda: len(worker.requests) > n_before, 10, "the request to reach the worker")
        rid = worker.requests[n_before][1].request_id
        wait_until(lambda: rid in worker.cancels, 30, "the cancel at the deadline, with the reader stalled")
    still_serving(gw.url)


def test_pool_job_nobody_pulls_fails_when_the_queue_drops_it(nats_srv: EmbeddedNats, text_model: TextModel,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """JetStream drops a queued request after its max_age; the client hears so then, not at its deadline."""
    import gateway.run

    monkeypatch.setattr(gateway.run, "POOL_MAX_AGE_S", 0.5)
    srv = ServerThread(create_app(make_config(nats_srv.url, namespace="nopull", queue_when_no_workers=True),
                                  text_model)).start()
    try:
        t0 = time.monotonic()
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat_body("anyone?"), timeout=60)
        assert_error(r, 503, code="queue_timeout")
        assert time.monotonic() - t0 < 30  # the request's deadline is 600 s
        assert "Retry-After" in r.headers
    finally:
        srv.stop()


def test_sampling_defaults_fill_what_a_request_leaves_out(nats_srv: EmbeddedNats, worker: FakeWorker,
                                                          text_model: TextModel) -> None:
    """The model's defaults (the default model's card: temperature 0.2, top_p 0.9) apply to fields a request
    leaves out, the --default-* flags override them, and a field the request sets wins over both."""
    def sent(url: str, **kw: Any) -> SamplingParams:
        before = len(worker.requests)
        r = httpx.post(f"{url}/v1/chat/completions", json=chat_body("x", max_tokens=3, **kw), timeout=30)
        assert r.status_code == 200, r.text
        return worker.requests[before][1].sampling

    assert text_model.sampling_defaults == {"temperature": 0.2, "top_p": 0.9}
    plain = ServerThread(create_app(make_config(nats_srv.url), text_model)).start()
    tuned = ServerThread(create_app(make_config(nats_srv.url, default_temperature=0.0, default_top_k=5,
                                                default_repetition_penalty=1.1), text_model)).start()
    try:
        for srv in (plain, tuned):
            wait_until(lambda s=srv: httpx.get(f"{s.url}/ready").status_code == 200, 10, "/ready")
        got = sent(plain.url)
        assert (got.temperature, got.top_p, got.top_k, got.repetition_penalty) == (0.2, 0.9, 0, 1.0)
        got = sent(tuned.url)
        assert (got.temperature, got.top_p, got.top_k, got.repetition_penalty) == (0.0, 0.9, 5, 1.1)
        got = sent(tuned.url, temperature=1.3, top_p=0.5, top_k=0, repetition_penalty=1.0)
        assert (got.temperature, got.top_p, got.top_k, got.repetition_penalty) == (1.3, 0.5, 0, 1.0)
        card = httpx.get(f"{tuned.url}/v1/models").json()["data"][0]
        assert card["sampling_defaults"] == {"temperature": 0.0, "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.1}
        assert_error(httpx.post(f"{plain.url}/v1/chat/completions", json=chat_body("x", repetition_penalty=3.0)),
                     400, param="repetition_penalty", code="invalid_value")
    finally:
        plain.stop()
        tuned.stop()


def test_default_max_tokens_and_the_models_own_repetition_penalty(nats_srv: EmbeddedNats, worker: FakeWorker,
                                                                  text_model: TextModel) -> None:
    """A request without max_tokens (nor max_completion_tokens) gets --default-max-tokens (2048 unless set), cut
    to what the context leaves; 0 lifts the cap. A model that declares a repetition_penalty (its
    generation_config.json, a GGUF's general.sampling.penalty_repeat) has it applied to requests that leave it
    out, shown in /v1/models beside the cap."""
    import dataclasses

    def sent(url: str, content: str = "x", **kw: Any) -> SamplingParams:
        before = len(worker.requests)
        r = httpx.post(f"{url}/v1/chat/completions", json=chat_body(content, **kw), timeout=30)
        assert r.status_code == 200, r.text
        return worker.requests[before][1].sampling

    def prompt_tokens(content: str) -> int:
        return httpx.post(f"{plain.url}/tokenize", json={"messages": [{"role": "user", "content": content}]},
                          timeout=30).json()["count"]

    declaring = dataclasses.replace(text_model, sampling_defaults={**text_model.sampling_defaults,
                                                                   "repetition_penalty": 1.15})
    plain = ServerThread(create_app(make_config(nats_srv.url), text_model)).start()
    capped = ServerThread(create_app(make_config(nats_srv.url, default_max_tokens=6), declaring)).start()
    open_ended = ServerThread(create_app(make_config(nats_srv.url, default_max_tokens=0), text_model)).start()
    try:
        for srv in (plain, capped, open_ended):
            wait_until(lambda s=srv: httpx.get(f"{s.url}/ready").status_code == 200, 10, "/ready")
        assert sent(plain.url).max_tokens == 2048 and sent(capped.url).max_tokens == 6
        assert sent(capped.url, max_tokens=9).max_tokens == 9 and sent(capped.url, max_completion_tokens=4).max_tokens == 4
        assert sent(open_ended.url).max_tokens == 8192 - prompt_tokens("x")
        long_prompt = "hello " * 7000  # leaves fewer than 2048 tokens of the context: the cap is cut to those
        assert sent(plain.url, long_prompt).max_tokens == 8192 - prompt_tokens(long_prompt) < 2048
        got = sent(capped.url)
        assert (got.temperature, got.top_p, got.repetition_penalty) == (0.2, 0.9, 1.15)
        assert sent(capped.url, repetition_penalty=1.0).repetition_penalty == 1.0  # the request's own wins
        assert sent(plain.url).repetition_penalty == 1.0  # the default model declares none
        cards = [httpx.get(f"{s.url}/v1/models").json()["data"][0] for s in (plain, capped, open_ended)]
        assert [c["default_max_tokens"] for c in cards] == [2048, 6, None]
        assert cards[1]["sampling_defaults"] == {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.15}
        with pytest.raises(ValueError, match="--default-max-tokens must not be negative"):
            make_config(nats_srv.url, default_max_tokens=-1)
    finally:
        for srv in (plain, capped, open_ended):
            srv.stop()


def test_a_reused_client_request_id_never_shares_jobs(gw: ServerThread, worker: FakeWorker) -> None:
    """Two requests with one X-Request-Id are two requests (the workers' duplicate check is by job id); the
    header comes back as sent, and `tandem tail --request <id>` still finds their jobs by prefix."""
    before = len(worker.requests)
    for _ in range(2):
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body("x", max_tokens=2),
                       headers={"X-Request-Id": "retry-7"}, timeout=30)
        assert r.status_code == 200 and r.headers["x-request-id"] == "retry-7"
    ids = [req.request_id for _, req in worker.requests[before:]]
    assert len(set(ids)) == 2 and all(i.startswith("retry-7-") for i in ids)


def test_the_gateway_imports_no_torch() -> None:
    """The gateway needs the tokenizer and template only; torch (seconds of import, GBs with CUDA) stays out."""
    import subprocess
    import sys

    code = "import sys, gateway.server, gateway.app; from gateway.server import main; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
