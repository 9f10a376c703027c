"""Workers that die or stop mid-request, each test on a cluster of its own (real nats-server, real `tandem serve`
processes, the real model): a request still completes with the tokens it would have had, or is handed back, and
no test depends on what another one killed."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from pathlib import Path

import pytest

from bench.cluster import Client
from tests.harness.chat import chat_ids
from tests.harness.cluster import know_prefill_workers, worker_cluster

pytestmark = pytest.mark.timeout(600)

#: a decode worker that sends every prompt to a prefill worker, with room for a retry while a dead worker's
#: blocks sit in quarantine
REMOTE = ("--local-prefill-max-tokens", "0", "--prefill-stall-budget-ms", "0", "--max-batch", "4",
          "--prefill-timeout", "90", "--num-blocks", "400")


def rid() -> str:
    return uuid.uuid4().hex


def test_sigkill_prefill_mid_job_still_completes(tmp_path: Path, smollm):
    """p2 is SIGKILLed while it holds d2's prefill job: the job is retried on p1 (or prefilled on d2) and the
    request completes with the tokens d1 gave for the same prompt through p1."""
    fresh_context = " ".join(f"Item {i} costs {3 * i} coins." for i in range(150))  # no worker has it cached
    prompt = chat_ids(smollm, fresh_context + " What does item 4 cost?")
    specs = [("prefill_only", "p1"), ("prefill_only", "p2"), ("decode_only", "d1", *REMOTE),
             ("decode_only", "d2", *REMOTE)]
    with worker_cluster(tmp_path, specs) as (srv, workers):
        async def go():
            await know_prefill_workers(srv.url, ("tandem", "d1", 2), ("tandem", "d2", 2))
            async with Client(srv.url) as c:
                reference = await c.generate(rid(), prompt, worker="d1", target_endpoint="p1", max_tokens=6)
                jobs = await c.nc.subscribe(c.subjects.prefill_worker("p2"))
                t0 = time.monotonic()
                s = await c.start(rid(), prompt, worker="d2", target_endpoint="p2", max_tokens=6)
                await jobs.next_msg(timeout=30)
                workers["p2"].kill()
                out = await c.collect(s, timeout=150)  # past the request's 120 s deadline: it ends either way
                return reference, out, time.monotonic() - t0

        reference, out, elapsed = asyncio.run(go())
    assert "finish" in out, out
    assert out["token_ids"] == reference["token_ids"]
    assert out["finish"]["prefill_worker_id"] in ("p1", None)  # retried on p1, or prefilled locally
    # the dead worker is noticed (5 s without its load reports) well before the 90 s prefill deadline
    assert elapsed < 45


def test_sigkill_prefill_mid_pool_job_is_noticed_early(tmp_path: Path, smollm):
    """p1, the only prefill worker, takes a pool job, says so, and is SIGKILLed: d1 hears it at once (not at the
    job's 90 s deadline) and the request completes with the aggregated worker's tokens."""
    fresh_context = " ".join(f"Crate {i} holds {7 * i} apples." for i in range(150))  # cached nowhere
    prompt = chat_ids(smollm, fresh_context + " How many apples does crate 5 hold?")
    specs = [("prefill_only", "p1"), ("decode_only", "d1", *REMOTE),
             ("prefill_and_decode", "a1", "--namespace", "agg")]
    with worker_cluster(tmp_path, specs) as (srv, workers):
        async def go():
            await know_prefill_workers(srv.url, ("tandem", "d1", 1))
            async with Client(srv.url, "agg") as agg:
                reference = await agg.generate(rid(), prompt, max_tokens=6)
            async with Client(srv.url) as c:
                r = rid()
                replies = await c.nc.subscribe(c.subjects.prefill_done("d1", r))
                t0 = time.monotonic()
                s = await c.start(r, prompt, worker="d1", max_tokens=6)  # no target: the job goes to the pool
                accepted = json.loads((await replies.next_msg(timeout=30)).data)
                workers["p1"].kill()
                out = await c.collect(s, timeout=150)  # past the request's 120 s deadline: it ends either way
                return reference, accepted, out, time.monotonic() - t0

        reference, accepted, out, elapsed = asyncio.run(go())
    assert accepted["kind"] == "prefill_accepted" and accepted["prefill_worker_id"] == "p1", accepted
    assert "finish" in out, out
    assert out["token_ids"] == reference["token_ids"]
    assert out["finish"]["prefill_worker_id"] != "p1"
    # Without the accepted notice d1 would wait for the job's 90 s deadline (--prefill-timeout).
    assert elapsed < 45


def test_sigterm_hands_back_a_request_before_its_first_token(tmp_path: Path, smollm):
    """SIGTERM to d2 while its request waits for its prefill: draining, d2 gives back what has not streamed a
    token yet (a `handed_back` error, HTTP 503), then exits cleanly."""
    prompt = chat_ids(smollm, " ".join(f"Box {i} weighs {5 * i} grams." for i in range(150)) + " Box 9?")
    with worker_cluster(tmp_path, [("prefill_only", "p1"), ("decode_only", "d2", *REMOTE)]) as (srv, workers):
        async def go():
            await know_prefill_workers(srv.url, ("tandem", "d2", 1))
            async with Client(srv.url) as c:
                s = await c.start(rid(), prompt, worker="d2", max_tokens=6)
                admitted = json.loads((await s.next_msg(timeout=30)).data)
                workers["d2"].proc.send_signal(signal.SIGTERM)
                return admitted, json.loads((await s.next_msg(timeout=30)).data)

        admitted, after = asyncio.run(go())
        assert workers["d2"].proc.wait(60) == 0  # then it leaves cleanly
    assert admitted["kind"] == "stream_tokens" and admitted["token_ids"] == [] and admitted["worker_id"] == "d2"
    assert after["kind"] == "stream_error" and after["code"] == "handed_back" and after["status"] == 503, after
