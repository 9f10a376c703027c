"""The real thing: `tandem up` (embedded NATS, one prefill_only and one decode_only worker with the
real model, the gateway) driven by the real `openai` client, sync and async, streaming and not.

One cluster is shared by the module (each process loads the model in ~3 s on two cores);
it runs with TANDEM_API_KEYS set, so every request also exercises authentication. The
Ctrl-C test stops a cluster of its own with SIGINT and checks that every child is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bench.cluster import TandemUp
from bench.speculation import copy_prompts
from tests.harness.cluster import tandem_up
from tests.harness.native import NEEDS_NATIVE
from tests.harness.wait import wait_until

pytestmark = [pytest.mark.timeout(300), NEEDS_NATIVE]

MODEL = "smollm2-135m-instruct"
KEY = "test-key-123"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


#: the default weights on the row-invariant path: a token computes the same in any batch, chunk or cache
#: shape, so outputs that must repeat (a seed) do not depend on how the two workers' steps lined up
UP_ARGS = ("--stop-timeout", "10", "--kernels", "invariant", "--worker-args", "--num-blocks 256")


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TandemUp]:
    with tandem_up(tmp_path_factory.mktemp("up"), *UP_ARGS, env={"TANDEM_API_KEYS": KEY}, start_timeout=240,
                   stop_timeout=60) as cluster:
        yield cluster


@pytest.fixture
def own_up(tmp_path: Path) -> Iterator[TandemUp]:
    """A cluster of the test's own, alike: for a test that stops it."""
    with tandem_up(tmp_path, *UP_ARGS, env={"TANDEM_API_KEYS": KEY}, start_timeout=240, stop_timeout=60) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(up: TandemUp) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.base_url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def greedy_answer(client: openai.OpenAI) -> str:
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=12)
    return r.choices[0].message.content or ""


def workers_idle(up: TandemUp) -> tuple[bool, list[dict[str, Any]]]:
    workers = httpx.get(f"{up.url}/ready", timeout=5).json()["workers"]
    ok = bool(workers) and all(w["running"] == 0 and w["queued"] == 0 and w["free_blocks"] == w["total_blocks"]
                               for w in workers)
    return ok, workers


def wait_idle(up: TandemUp, timeout: float = 30.0) -> None:
    """Until every worker reports no block held and nothing running or queued."""
    wait_until(lambda: workers_idle(up)[0], timeout, lambda: f"every block free: {workers_idle(up)[1]}",
               interval=0.25)


# ============================================================================ the API


def test_printed_url_and_models(up: TandemUp, client: openai.OpenAI) -> None:
    text = up.output()
    assert f"OpenAI API  {up.base_url}" in text and f"curl {up.url}/v1/chat/completions" in text
    assert 'Authorization: Bearer $TANDEM_API_KEY' in text  # keys are on: the printed curl line works
    assert [m.id for m in client.models.list().data] == [MODEL]
    workers = httpx.get(f"{up.url}/ready").json()["workers"]
    assert {w["worker_id"]: w["role"] for w in workers} == {"prefill-1": "prefill_only", "decode-1": "decode_only"}
    for w in workers:  # the ready table names each worker's kernel path, as /ready does
        assert w["kernels"] == "invariant"  # the fixture's --kernels reached every worker
        assert re.search(rf"{w['worker_id']} .*, kernels {w['kernels']}$", text, re.M), text


def test_chat_sync(client: openai.OpenAI, greedy_answer: str) -> None:
    assert "Paris" in greedy_answer
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, temperature=0,
                                                           max_tokens=12)
    r = raw.parse()
    assert r.choices[0].message.content == greedy_answer
    assert r.usage.prompt_tokens > 20 and 0 < r.usage.completion_tokens <= 12
    assert raw.headers["x-tandem-decode-worker"] == "decode-1"


def test_chat_stream_async_with_usage(up: TandemUp, greedy_answer: str) -> None:
    async def go() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=up.base_url, api_key=KEY, max_retries=0, timeout=120) as ac:
            stream = await ac.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=12,
                                                      stream=True, stream_options={"include_usage": True})
            return [c async for c in stream]

    chunks = asyncio.run(asyncio.wait_for(go(), 120))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == greedy_answer
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_chat_stream_sync(client: openai.OpenAI, greedy_answer: str) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=12,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == greedy_answer
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_completions_sync_and_async_stream(up: TandemUp, client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=6)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6

    async def go() -> str:
        async with openai.AsyncOpenAI(base_url=up.base_url, api_key=KEY, max_retries=0, timeout=120) as ac:
            stream = await ac.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                                 max_tokens=6, stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])

    assert asyncio.run(asyncio.wait_for(go(), 120)) == r.choices[0].text


def test_stop_string(client: openai.OpenAI, greedy_answer: str) -> None:
    word = "Paris"
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=12, stop=[word])
    content = r.choices[0].message.content
    assert word not in content and r.choices[0].finish_reason == "stop"
    assert greedy_answer.startswith(content)


def test_n2_seed_reproducible(client: openai.OpenAI) -> None:
    """The same seed samples the same, whichever way the steps of the two choices line up (the
    row-invariant path, see the fixture). The path is pinned to one prefill worker all the same: the decode
    worker's prefill choice learns costs as it goes."""
    kw: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": "Say a random animal."}],
                              temperature=1.0, max_tokens=6, n=2, seed=1234,
                              extra_body={"target_endpoint": "prefill-1"})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    c = client.chat.completions.create(**kw)
    assert [x.index for x in a.choices] == [0, 1]
    # the first computed the prompt whole, the others hit the prefix cache: the same all the same
    assert [x.message.content for x in a.choices] == [x.message.content for x in b.choices]
    assert [x.message.content for x in b.choices] == [x.message.content for x in c.choices]
    assert all(x.message.content for x in a.choices + b.choices)


def test_a_seeded_answer_is_the_same_prefilled_remotely_or_after_a_cache_hit(up: TandemUp,
                                                                            client: openai.OpenAI) -> None:
    """The same chat with seed 7 at temperature 1.0, twice: the prefill worker computes the first prompt, the
    second hits the decode worker's prefix cache and computes the rest there. One answer, bit for bit (the
    workers run the row-invariant kernel path, as /ready says)."""
    workers = httpx.get(f"{up.url}/ready", timeout=5).json()["workers"]
    assert workers and {w["kernels"] for w in workers} == {"invariant"}
    kw: dict[str, Any] = dict(model=MODEL, temperature=1.0, max_tokens=24, seed=7, logprobs=True, messages=[
        {"role": "user", "content": "Write one sentence about a lighthouse keeper and her cat."}])
    first = client.chat.completions.with_raw_response.create(**kw, extra_body={"target_endpoint": "prefill-1"})
    again = client.chat.completions.with_raw_response.create(**kw)
    assert first.headers["x-tandem-prefill"] == "remote:prefill-1" and again.headers["x-tandem-prefill"] == "local"
    a, b = first.parse(), again.parse()
    assert b.usage.prompt_tokens_details.cached_tokens > 0
    assert b.choices[0].message.content == a.choices[0].message.content
    assert [t.logprob for t in b.choices[0].logprobs.content] == [t.logprob for t in a.choices[0].logprobs.content]


def test_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=4, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the most likely
    assert "".join(t.token for t in content) == r.choices[0].message.content


def test_target_endpoint(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=2, extra_body={"target_endpoint": "prefill-1"})
    assert raw.parse().choices[0].message.content
    assert raw.headers["x-tandem-prefill"] == "remote:prefill-1"
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=2, extra_headers={"X-Target-Endpoint": "prefill-1"})
    assert raw.headers["x-tandem-prefill"] == "remote:prefill-1"
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2,
                                       extra_body={"target_endpoint": "nobody"})
    assert ei.value.body["code"] == "unknown_target" and "nobody" in ei.value.body["message"]


def test_multibyte_stream_never_splits_a_character(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Reply with three emoji and the word café in Japanese: 日本語."}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=24)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=msgs, temperature=0, max_tokens=24, stream=True) if c.choices]
    assert "".join(pieces) == full.choices[0].message.content
    assert not any("\ufffd" in p for p in pieces)


def test_concurrent_requests(up: TandemUp) -> None:
    async def go() -> list[str]:
        async with openai.AsyncOpenAI(base_url=up.base_url, api_key=KEY, max_retries=0, timeout=120) as ac:
            rs = await asyncio.gather(*[
                ac.chat.completions.create(model=MODEL, temperature=0, max_tokens=8,
                                           messages=[{"role": "user", "content": f"Count to {i}."}])
                for i in range(8)])
            return [r.choices[0].message.content or "" for r in rs]

    texts = asyncio.run(asyncio.wait_for(go(), 120))
    assert len(texts) == 8 and all(texts)


# ============================================================================ errors

LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
        "max_tokens": 2000, "ignore_eos": True}  # would run for minutes: only a cancel frees it soon



def _err(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_errors_then_still_serving(up: TandemUp, client: openai.OpenAI) -> None:
    url = f"{up.url}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 2}
    assert _err(httpx.post(url, json=body), 401)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=up.base_url, api_key="wrong", max_retries=0).models.list()
    assert _err(httpx.post(url, json={**body, "temperature": -1}, headers=auth), 400)["param"] == "temperature"
    assert _err(httpx.post(url, json={**body, "model": "nope"}, headers=auth), 404)["code"] == "model_not_found"
    err = _err(httpx.post(url, json={**body, "max_tokens": 9000}, headers=auth), 400)
    assert err["code"] == "context_length_exceeded"
    # a deadline that cannot be met: 504, and the worker frees the request's blocks
    r = httpx.post(url, json=LONG, headers={**auth, "X-Request-Timeout": "1"}, timeout=30)
    assert _err(r, 504)["code"] == "deadline_exceeded"
    wait_idle(up, timeout=10)  # the gateway's cancel freed it (by itself it would run for minutes)
    assert client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                          max_tokens=2).choices[0].message.content


def test_client_disconnect_mid_stream_frees_blocks(up: TandemUp) -> None:
    wait_idle(up)
    with httpx.stream("POST", f"{up.url}/v1/chat/completions", json={**LONG, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        assert r.status_code == 200
        deadline = time.monotonic() + 30
        for _ in r.iter_lines():
            # leave once the workers' 1 Hz stats show the request holding blocks
            if not workers_idle(up)[0]:
                break
            assert time.monotonic() < deadline, "the workers never reported the request"
    wait_idle(up, timeout=10)


def test_client_disconnect_non_stream_frees_blocks(up: TandemUp) -> None:
    async def go() -> None:
        async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as ac:
            task = asyncio.create_task(ac.post(f"{up.url}/v1/chat/completions", json=LONG))
            await asyncio.to_thread(wait_until, lambda: not workers_idle(up)[0], 20, "the request to start", 0.1)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    wait_idle(up)
    asyncio.run(asyncio.wait_for(go(), 60))
    wait_idle(up, timeout=10)


# ============================================================================ metrics and shutdown


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(url, timeout=10)
    assert r.status_code == 200, url
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def _total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in samples.items()
               if n == name and all(dict(lab).get(k) == want for k, want in labels.items()))


def test_short_prompt_is_prefilled_locally(up: TandemUp, client: openai.OpenAI) -> None:
    """Conditional disaggregation: a prompt under --local-prefill-max-tokens never leaves the decode worker."""
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert raw.parse().choices[0].text is not None
    assert raw.headers["x-tandem-prefill"] == "local"
    decode = next(c for c in up.info["children"] if c.get("role") == "decode_only")
    samples = _scrape(f"http://127.0.0.1:{decode['metrics_port']}/metrics")
    assert _total(samples, "tandem_decode_prefill_decisions_total", mode="local", reason="short_prompt") > 0


def test_metrics_move_after_a_disaggregated_request(up: TandemUp, client: openai.OpenAI) -> None:
    long_question = " ".join(f"Line {i} says {i * 7}." for i in range(40)) + " What does line 3 say?"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_question}],
                                       max_tokens=8, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in r if c.choices)
    again = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": long_question}], max_tokens=2)
    assert again.parse().usage.prompt_tokens_details.cached_tokens > 0  # the decode worker's prefix cache
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": copy_prompts()[0]}],
                                   max_tokens=24, temperature=0)  # the decode worker drafts from the prompt

    def check() -> None:
        gw = _scrape(f"{up.url}/metrics")
        assert _total(gw, "tandem_gateway_time_to_first_token_seconds_count") > 0
        assert _total(gw, "tandem_gateway_inter_token_latency_seconds_count") > 0
        assert _total(gw, "tandem_gateway_generated_tokens_total") > 0
        workers = {c["role"]: _scrape(f"http://127.0.0.1:{c['metrics_port']}/metrics")
                   for c in up.info["children"] if c.get("metrics_port")}
        prefill, decode = workers["prefill_only"], workers["decode_only"]
        assert _total(prefill, "tandem_kv_transfer_bytes_total") > 0
        assert _total(prefill, "tandem_kv_transfer_duration_seconds_count") > 0
        assert _total(prefill, "tandem_prefill_jobs_total", outcome="ok") > 0
        assert _total(decode, "tandem_decode_prefill_decisions_total", mode="remote") > 0
        assert _total(decode, "tandem_decode_remote_prefill_wait_seconds_count") > 0
        assert _total(decode, "tandem_worker_generated_tokens_total") > 0
        assert _total(decode, "tandem_kv_blocks", role="decode_only") == 256  # used + free + quarantined
        assert _total(decode, "tandem_kv_blocks", role="decode_only", state="free") > 0
        assert _total(decode, "tandem_prefix_cache_hit_rate") > 0  # moved by the repeated prompt
        assert _total(decode, "tandem_spec_accepted_tokens_total") > 0
        assert _total(decode, "tandem_spec_draft_tokens_total") >= _total(decode, "tandem_spec_accepted_tokens_total")

    def checked() -> bool:
        check()
        return True

    # worker gauges refresh at 1 Hz: check again until they show the request (the last failure, after 15 s)
    wait_until(checked, 15, "the metrics to show the requests", interval=0.25, ignore=(AssertionError,))


def test_ctrl_c_stops_every_child(own_up: TandemUp) -> None:
    up = own_up  # stopped here: no other test may need it after
    pids = [c["pid"] for c in up.info["children"]]
    t0 = time.monotonic()
    up.interrupt()
    assert up.child.wait(60) == 0, up.output()[-4000:]
    took = time.monotonic() - t0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert "SIGINT; stopping" in up.output()
    assert not up.ready_file.exists()
    # an idle cluster drains at once: each child exits on SIGTERM without using its drain time.
    # child.wait(60) above catches a hang.
    assert took < 50, f"stopping took {took:.1f}s:\n{up.output()[-4000:]}"
