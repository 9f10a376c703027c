"""`tandem up --prefill 2 --decode 2` under faults: SIGKILLed workers and NATS, clients that leave, overload.

Every test drives the real gateway with real HTTP clients and checks what a user sees (each request
completes, or ends with a clear OpenAI error — never a hang, never a cut stream), that the dead part
comes back, and that nothing leaked afterwards (`tandem status --json`: no block used, nothing queued).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bench.cluster import MODEL, TandemUp
from tests.conftest import NEEDS_NATIVE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), NEEDS_NATIVE]

FILLER = "Tandem serves language models with prefill and decode on separate workers over a message bus. "


def long_prompt(i: int, repeats: int = 30) -> str:
    return f"Request {i}. " + FILLER * repeats + "Summarize the text above."


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TandemUp]:
    # the default weights on the row-invariant path: a moved stream is prefilled again in other batch shapes,
    # and greedy decoding must repeat exactly there (on the fast paths near-ties can flip)
    cluster = TandemUp(tmp_path_factory.mktemp("faults"), "--kernels", "invariant", "--prefill", "2", "--decode", "2",
                       "--restart-delay", "0.5",
                       "--drain-timeout", "10", "--stop-timeout", "10",
                       "--worker-args", "--num-blocks 512 --local-prefill-max-tokens 64 --prefill-stall-budget-ms 0",
                       "--gateway-args", "--max-queue-wait 30", env={"TANDEM_LOG_LEVEL": "WARNING"}).start(300)
    try:
        yield cluster
    finally:
        cluster.stop(90)


def status(up: TandemUp) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "tandem.cli", "status", "--json", "--wait", "1.5",
                        "--nats-url", up.info["nats_url"]], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def wait_idle(up: TandemUp, workers: int = 4, timeout: float = 90.0) -> dict[str, Any]:
    """Until every worker answers with no block used, nothing running or queued, and the pools are empty."""
    deadline = time.monotonic() + timeout
    while True:
        st = status(up)
        ws = st["workers"]
        ok = (len(ws) == workers and all(w["used_blocks"] == 0 and w["running"] == 0 and w["queued"] == 0
                                         for w in ws)
              and all(p["pending"] == 0 and p["in_flight"] == 0 for p in st["pools"]))
        if ok:
            return st
        assert time.monotonic() < deadline, json.dumps(st, indent=1)
        time.sleep(1.0)


def wait_restarted(up: TandemUp, name: str, restarts: int, timeout: float = 180.0) -> None:
    """Until ``name`` was restarted ``restarts`` times and reports on the bus again."""
    deadline = time.monotonic() + timeout
    while True:
        if up.child_info(name)["restarts"] >= restarts:
            rows = {w["worker_id"]: w for w in status(up)["workers"]}
            if rows.get(name, {}).get("restarts", 0) >= restarts and rows[name]["stats_error"] is None:
                return
        assert up.child.running, up.output()[-3000:]
        assert time.monotonic() < deadline, up.output()[-3000:]
        time.sleep(0.5)


async def stream_chat(client: httpx.AsyncClient, url: str, content: str, **body: Any) -> dict[str, Any]:
    """One streaming chat: {'status', 'text', 'finish', 'error', 'done', 'max_gap'} (an OpenAI error body for a
    non-200; ``max_gap``: the longest time, in seconds, between two of its SSE events from the first text on)."""
    out: dict[str, Any] = {"status": None, "text": "", "finish": None, "error": None, "done": False, "max_gap": 0.0}
    payload = {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": True,
               "temperature": 0, **body}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=payload) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = json.loads(await r.aread())["error"]
            out["retry_after"] = r.headers.get("retry-after")
            return out
        last: float | None = None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            if last is not None:
                out["max_gap"] = max(out["max_gap"], now - last)
            if last is not None or out["text"]:
                last = now
            if line == "data: [DONE]":
                out["done"] = True
                continue
            d = json.loads(line[6:])
            if "error" in d:
                out["error"] = d["error"]
            elif d["choices"]:
                ch = d["choices"][0]
                out["text"] += ch["delta"].get("content") or ""
                out["finish"] = ch["finish_reason"] or out["finish"]
    return out


def assert_clear(results: list[dict[str, Any]]) -> None:
    """Each result completed, or ended with an OpenAI error (HTTP status, or SSE error event then [DONE])."""
    for r in results:
        if r["status"] == 200:
            assert r["done"], r
            assert r["finish"] in ("stop", "length") or (r["error"] and r["error"]["message"]), r
        else:
            assert r["status"] in (429, 503, 504) and r["error"]["message"], r


def busy_worker(up: TandemUp, role: str) -> str:
    """A worker of ``role`` that reports work right now (waits for one)."""
    deadline = time.monotonic() + 120
    while True:
        for w in httpx.get(f"{up.url}/ready", timeout=10).json()["workers"]:
            if w["role"] == role and w["running"] > 0:
                return w["worker_id"]
        assert time.monotonic() < deadline, "no busy worker"
        time.sleep(0.05)


def test_prefill_workers_killed_mid_prefill(up: TandemUp) -> None:
    """SIGKILL a prefill worker while it computes, twice: every request ends well or clearly, the
    dead worker is back, and no block is left held anywhere."""
    wait_idle(up)

    async def go() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=300) as client:
            tasks = [asyncio.create_task(stream_chat(client, up.url, long_prompt(i, 60), max_tokens=8))
                     for i in range(6)]
            for _ in range(2):
                victim = await asyncio.to_thread(busy_worker, up, "prefill_only")
                before = up.child_info(victim)["restarts"]
                os.kill(up.child_info(victim)["pid"], signal.SIGKILL)
                await asyncio.to_thread(wait_restarted, up, victim, before + 1)
                for i in range(6, 9):  # more work for the restarted one
                    tasks.append(asyncio.create_task(stream_chat(client, up.url, long_prompt(100 + i, 60),
                                                                 max_tokens=8)))
            return await asyncio.gather(*tasks)

    results = asyncio.run(go())
    assert_clear(results)
    assert sum(r["status"] == 200 and r["finish"] in ("stop", "length") for r in results) >= len(results) // 2, results
    assert "killed by SIGKILL while serving; restarting it" in up.output()
    wait_idle(up)


def test_decode_worker_killed_mid_stream_the_stream_moves_and_reads_as_if_it_had_not(up: TandemUp) -> None:
    """SIGKILL the decode worker of a greedy stream: the gateway moves the stream to the other decode
    worker with the tokens so far (--migration-limit 1), and the client reads exactly the text an
    undisturbed stream gives. (Without migration the stream ends with an SSE error event and [DONE]:
    tests/test_gateway_reliability.py.)"""
    wait_idle(up)
    question = "Tell me a long story about a lighthouse."

    async def go() -> tuple[dict[str, Any], dict[str, Any]]:
        async with httpx.AsyncClient(timeout=300) as client:
            reference = await stream_chat(client, up.url, question, max_tokens=160, ignore_eos=True)
            # the reference's worker may still report it running for a heartbeat: the victim must be
            # the worker of the stream below, so wait until no worker reports work first
            await asyncio.to_thread(wait_idle, up)
            task = asyncio.create_task(stream_chat(client, up.url, question, max_tokens=160, ignore_eos=True))
            victim = await asyncio.to_thread(busy_worker, up, "decode_only")
            await asyncio.sleep(1.0)  # some tokens went out
            before = up.child_info(victim)["restarts"]
            os.kill(up.child_info(victim)["pid"], signal.SIGKILL)
            moved = await task
            await asyncio.to_thread(wait_restarted, up, victim, before + 1)
            return reference, moved

    reference, moved = asyncio.run(go())
    assert reference["finish"] == "length" and reference["text"], reference
    assert moved["status"] == 200 and moved["error"] is None and moved["done"], moved
    assert moved["finish"] == "length"
    assert moved["text"] == reference["text"]
    assert "moving the stream to another worker" in up.output()
    wait_idle(up)


def test_clients_that_leave_at_random_points_leak_nothing(up: TandemUp) -> None:
    """200 streaming clients, each gone after a random number of events (some before the first byte)."""
    wait_idle(up)
    rng = random.Random(7)

    async def one(client: httpx.AsyncClient, i: int, leave_after: int) -> str:
        payload = {"model": MODEL, "messages": [{"role": "user", "content": long_prompt(i, rng.choice([1, 10, 30]))}],
                   "stream": True, "max_tokens": 200, "ignore_eos": True}
        async with client.stream("POST", f"{up.url}/v1/chat/completions", json=payload) as r:
            if r.status_code != 200:
                return str(r.status_code)
            seen = 0
            async for _ in r.aiter_lines():
                seen += 1
                if seen >= leave_after:
                    return "left"
            return "completed"

    async def go() -> list[str]:
        sem = asyncio.Semaphore(40)
        async with httpx.AsyncClient(timeout=120) as client:
            async def bounded(i: int) -> str:
                async with sem:
                    try:  # some leave before the first byte, some mid-stream
                        return await asyncio.wait_for(one(client, i, rng.randrange(1, 40)), rng.uniform(0.2, 6.0))
                    except asyncio.TimeoutError:
                        return "left"

            return await asyncio.gather(*(bounded(i) for i in range(200)))

    outcomes = asyncio.run(go())
    assert all(o in ("left", "completed", "429", "503") for o in outcomes), outcomes
    assert outcomes.count("left") > 100
    st = wait_idle(up, timeout=120)  # every block back, nothing queued (prefill pool included)
    assert all(w["used_blocks"] == 0 for w in st["workers"])


def test_overload_is_shed_fast_and_blocks_come_back(up: TandemUp) -> None:
    """More concurrent long requests than the decode workers hold (14 places): each completes, or gets
    429/503 with Retry-After (how many depends on the service time measured so far: the refusal
    itself is tested against fake workers in tests/test_gateway_reliability.py); none waits out the
    client's timeout; afterwards every block is free."""
    wait_idle(up)

    async def go() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=240) as client:
            return await asyncio.gather(*(stream_chat(client, up.url, long_prompt(1000 + i, 60), max_tokens=64,
                                                      ignore_eos=True) for i in range(32)))

    results = asyncio.run(go())
    assert_clear(results)
    refused = [r for r in results if r["status"] in (429, 503)]
    assert all(r["retry_after"] for r in refused), refused
    assert any(r["status"] == 200 and r["finish"] == "length" for r in results)
    wait_idle(up)


def test_a_killed_gateway_is_restarted_on_its_port(up: TandemUp) -> None:
    wait_idle(up)
    old = up.child_info("gateway")["pid"]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:  # the same URL answers again, from a new process
        try:
            r = httpx.post(f"{up.url}/v1/chat/completions", timeout=60, json={
                "model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]})
            if r.status_code == 200 and up.child_info("gateway")["pid"] != old:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline and up.child.running, up.output()[-3000:]
        time.sleep(0.5)
    assert up.child_info("gateway")["restarts"] == 1
    assert f"gateway (pid {old}) killed by SIGKILL while serving; restarting it" in up.output()


def test_zz_nats_killed_and_restarted_under_load(up: TandemUp) -> None:
    """SIGKILL the embedded NATS: tandem up starts it again on the same port and store, every process
    reconnects, the streams in flight go on whole (the workers kept what the gateway missed), and new
    requests succeed soon after the restart."""
    wait_idle(up)

    async def go() -> tuple[list[dict[str, Any]], float]:
        async with httpx.AsyncClient(timeout=300) as client:
            tasks = [asyncio.create_task(stream_chat(client, up.url, long_prompt(2000 + i, 5), max_tokens=200,
                                                     ignore_eos=True)) for i in range(3)]
            await asyncio.to_thread(busy_worker, up, "decode_only")
            nats_pid = up.info["nats_pid"]
            os.kill(nats_pid, signal.SIGKILL)
            await asyncio.to_thread(up.child.wait_for, "nats restarted (pid", 60)
            restarted = time.monotonic()
            while True:  # new requests: served as soon as the gateway is back on NATS
                r = await stream_chat(client, up.url, "What is the capital of France?", max_tokens=4)
                if r["status"] == 200 and r["finish"]:
                    back_after = time.monotonic() - restarted
                    break
                assert r["status"] == 503 or r["error"], r
                assert time.monotonic() - restarted < 60, r
                await asyncio.sleep(0.25)
            return await asyncio.gather(*tasks), back_after

    in_flight, back_after = asyncio.run(go())
    assert_clear(in_flight)
    assert all(r["status"] == 200 and r["finish"] == "length" for r in in_flight), in_flight
    assert back_after < 10, back_after
    assert up.info["nats_pid"] != 0 and up.child.running
    wait_idle(up)
