"""`tandem up --prefill 2 --decode 2` under faults: SIGKILLed workers and NATS, clients that leave, overload.

Every test drives the real gateway with real HTTP clients and checks what a user sees (each request
completes, or ends with a clear OpenAI error — never a hang, never a cut stream), that the dead part
comes back, and that nothing leaked afterwards (`tandem status --json`: no block used, nothing queued).
The tests share one cluster and each waits until what it killed is back; the NATS kill runs on a cluster
of its own, and so does the moved stream (on the row-invariant kernel path), so the tests run in any order.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.cluster import MODEL, TandemUp
from tests.harness.chat import assert_clear, long_prompt, stream_chat
from tests.harness.cluster import busy_worker, status_json, tandem_up, wait_restarted
from tests.harness.native import NEEDS_NATIVE
from tests.harness.wait import until, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), NEEDS_NATIVE]

UP_ARGS = ("--prefill", "2", "--decode", "2", "--restart-delay", "0.5", "--drain-timeout", "10", "--stop-timeout", "10",
           "--worker-args", "--num-blocks 512 --local-prefill-max-tokens 64 --prefill-stall-budget-ms 0",
           "--gateway-args", "--max-queue-wait 30")
#: the default weights on the row-invariant path: a moved stream is prefilled again in other batch shapes, and
#: greedy decoding must repeat exactly there (on the fast paths near-ties can flip; it prefills at 0.4-0.75x)
INVARIANT = ("--kernels", "invariant")
UP_ENV = {"TANDEM_LOG_LEVEL": "WARNING"}


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TandemUp]:
    """The cluster the tests share: each kills a part that `tandem up` restarts, and waits until it is back."""
    with tandem_up(tmp_path_factory.mktemp("faults"), *UP_ARGS, env=UP_ENV) as cluster:
        yield cluster


@pytest.fixture
def own_up(tmp_path: Path) -> Iterator[TandemUp]:
    """A cluster of the test's own, alike: for a fault that may leave it changed for whichever test comes next."""
    with tandem_up(tmp_path, *UP_ARGS, env=UP_ENV) as cluster:
        yield cluster


@pytest.fixture
def invariant_up(tmp_path: Path) -> Iterator[TandemUp]:
    """A cluster of the test's own on the row-invariant kernel path (``INVARIANT``)."""
    with tandem_up(tmp_path, *INVARIANT, *UP_ARGS, env=UP_ENV) as cluster:
        yield cluster


def wait_idle(up: TandemUp, workers: int = 4, timeout: float = 90.0) -> dict[str, Any]:
    """Until every worker answers with no block used, nothing running or queued, and the pools are empty."""
    seen: list[dict[str, Any]] = []

    def idle() -> dict[str, Any] | None:
        st = status_json(up, "--wait", "1.5")
        seen[:] = [st]
        ws = st["workers"]
        ok = (len(ws) == workers and all(w["used_blocks"] == 0 and w["running"] == 0 and w["queued"] == 0
                                         for w in ws)
              and all(p["pending"] == 0 and p["in_flight"] == 0 for p in st["pools"]))
        return st if ok else None

    return wait_until(idle, timeout, lambda: f"every worker idle:\n{json.dumps(seen[-1], indent=1)}", interval=1.0)


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


def test_decode_worker_killed_mid_stream_the_stream_moves_and_reads_as_if_it_had_not(invariant_up: TandemUp) -> None:
    """SIGKILL the decode worker of a greedy stream: the gateway moves the stream to the other decode
    worker with the tokens so far (--migration-limit 1), and the client reads exactly the text an
    undisturbed stream gives. (Without migration the stream ends with an SSE error event and [DONE]:
    tests/test_gateway_reliability.py.)"""
    up = invariant_up
    wait_idle(up)
    question = "Tell me a long story about a lighthouse."

    async def go() -> tuple[dict[str, Any], dict[str, Any]]:
        async with httpx.AsyncClient(timeout=300) as client:
            # long enough to outlast the kill below even with drafts accepted (160 tokens ended within 1.6 s)
            reference = await stream_chat(client, up.url, question, max_tokens=800, ignore_eos=True)
            # the reference's worker may still report it running for a heartbeat: the victim must be
            # the worker of the stream below, so wait until no worker reports work first
            await asyncio.to_thread(wait_idle, up)
            seen: dict[str, Any] = {}
            task = asyncio.create_task(stream_chat(client, up.url, question, into=seen, max_tokens=800,
                                                   ignore_eos=True))
            victim = await asyncio.to_thread(busy_worker, up, "decode_only")
            await until(lambda: len(seen.get("text", "")) >= 40, 60, "some text out")
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

    def answered_by_a_new_gateway() -> bool:  # the same URL answers again, from a new process
        assert up.child.running, up.output()[-3000:]
        r = httpx.post(f"{up.url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]})
        return r.status_code == 200 and up.child_info("gateway")["pid"] != old

    wait_until(answered_by_a_new_gateway, 120, lambda: f"the gateway back on its port:\n{up.output()[-3000:]}",
               interval=0.5, ignore=(httpx.HTTPError,))
    assert up.child_info("gateway")["restarts"] == 1
    assert f"gateway (pid {old}) killed by SIGKILL while serving; restarting it" in up.output()


def test_nats_killed_and_restarted_under_load(own_up: TandemUp) -> None:
    """SIGKILL the embedded NATS: tandem up starts it again on the same port and store, every process
    reconnects, the streams in flight go on whole (the workers kept what the gateway missed), and new
    requests succeed soon after the restart."""
    up = own_up  # the NATS restart is checked on a cluster no other test shares
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

            async def served() -> bool:  # new requests: served as soon as the gateway is back on NATS
                r = await stream_chat(client, up.url, "What is the capital of France?", max_tokens=4)
                assert r["status"] == 503 or r["error"] or r["finish"], r
                return r["status"] == 200 and bool(r["finish"])

            await until(served, 60, "a new request to be served", 0.25)
            back_after = time.monotonic() - restarted
            return await asyncio.gather(*tasks), back_after

    in_flight, back_after = asyncio.run(go())
    assert_clear(in_flight)
    assert all(r["status"] == 200 and r["finish"] == "length" for r in in_flight), in_flight
    assert back_after < 10, back_after
    assert up.info["nats_pid"] != 0 and up.child.running
    wait_idle(up)
