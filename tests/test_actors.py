"""The three pipeline roles end to end: real nats-server, real worker processes, the real model."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import nats
import pytest

from bench.cluster import Client, Worker
from bus.prefill_messages import KVMetaReply, KVMetaRequest
from bus.publish import request
from bus.stats_messages import WorkerStats
from bus.subjects import Subjects
from bus.wire import encode
from tests.harness.chat import chat_ids
from tests.harness.cluster import know_prefill_workers, worker_cluster
from tests.harness.wait import read_until, until, wait_until

pytestmark = pytest.mark.timeout(600)

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the moon.",
    "What is 12 times 12?",
]
LONG_CONTEXT = " ".join(f"Fact {i}: the number {i} is followed by {i + 1}." for i in range(60))
#: what one disaggregated request puts on the bus
EVERY_KIND = {"prefill_job", "prefill_accepted", "prefill_done", "stream_tokens", "stream_finish"}


def rid() -> str:
    return uuid.uuid4().hex


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """NATS + 2 prefill + 2 decode (remote prefill forced) + 1 aggregated worker in its own namespace."""
    disagg = ["--local-prefill-max-tokens", "0", "--prefill-stall-budget-ms", "0", "--max-batch", "4", "--prefill-timeout", "90",
              "--num-blocks", "400"]
    with worker_cluster(tmp_path_factory.mktemp("logs"), [
        ("prefill_only", "p1", "--layerwise-transfer", "on"),  # p1 streams layer by layer, p2 sends whole
        ("prefill_only", "p2", "--layerwise-transfer", "off"),
        ("decode_only", "d1", *disagg),
        ("decode_only", "d2", *disagg),
        ("prefill_and_decode", "a1", "--namespace", "agg"),
        # A decode worker whose KV layout differs from its prefill worker's (block size 32 vs 16).
        ("prefill_only", "mp1", "--namespace", "mm", "--num-blocks", "64"),
        ("decode_only", "md1", "--namespace", "mm", "--block-size", "32", "--num-blocks", "64",
         "--local-prefill-max-tokens", "0", "--prefill-stall-budget-ms", "0"),
        # Conditional disaggregation by estimated cost alone (no length floor, a 300 ms stall budget).
        ("prefill_only", "cp1", "--namespace", "cd", "--num-blocks", "128"),
        ("decode_only", "cd1", "--namespace", "cd", "--num-blocks", "128", "--local-prefill-max-tokens", "0",
         "--prefill-stall-budget-ms", "300"),
        # Every prompt to the pool, and no prefill worker of its own: the test that needs it brings them.
        ("decode_only", "wd1", "--namespace", "wd", "--num-blocks", "128", "--local-prefill-max-tokens", "0",
         "--prefill-stall-budget-ms", "0", "--prefill-timeout", "90"),
    ]) as (srv, by_id):
        asyncio.run(know_prefill_workers(srv.url, ("tandem", "d1", 2), ("tandem", "d2", 2), ("mm", "md1", 1),
                                         ("cd", "cd1", 1)))
        yield srv.url, by_id


def run(coro):
    return asyncio.run(coro)


def test_disaggregated_equals_aggregated(cluster, smollm):
    url, _ = cluster
    prompts = [chat_ids(smollm, q) for q in QUESTIONS]

    async def go(namespace):
        async with Client(url, namespace) as c:
            return await asyncio.gather(*[c.generate(rid(), p, max_tokens=16) for p in prompts])

    disagg = run(go("tandem"))
    agg = run(go("agg"))
    for d, a in zip(disagg, agg):
        assert "finish" in d and "finish" in a, (d, a)
        assert d["finish"]["prefill_mode"] == "remote"
        assert a["finish"]["prefill_mode"] == "aggregate"
        assert d["token_ids"] == a["token_ids"]
        assert d["text"] == a["text"]
    assert "Paris" in disagg[0]["text"]


def test_raw_json_request_and_every_message_is_json(cluster, smollm):
    url, _ = cluster

    async def go():
        nc = await nats.connect(url)
        seen = []

        async def record(m):
            seen.append(m)

        spy = await nc.subscribe("tandem.>", cb=record)
        r = rid()
        stream = f"tandem.stream.cli.{r}"
        sub = await nc.subscribe(stream)
        body = {"request_id": r, "prompt": "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
                "stream_subject": stream, "sampling": {"max_tokens": 8, "temperature": 0}}
        ack = await nc.request("tandem.smollm2-135m-instruct.generate", json.dumps(body).encode(), timeout=30)
        assert json.loads(ack.data)["stream"]  # a JetStream PubAck, as the brief says
        stream_msgs = await read_until(sub, lambda got: got and got[-1]["kind"] != "stream_tokens", 60,
                                       "the stream's last message")
        kinds = [d["kind"] for d in stream_msgs]
        # the spy's callbacks may lag behind the stream: wait until they saw every kind expected
        await asyncio.to_thread(wait_until, lambda: EVERY_KIND <= {json.loads(m.data).get("kind") for m in list(seen)},
                                15, "the spy to see every kind of message")
        await spy.unsubscribe()
        await nc.close()
        return kinds, stream_msgs, seen

    kinds, stream_msgs, seen = run(go())
    assert kinds[-1] == "stream_finish" and "stream_tokens" in kinds
    # message 0 is the admission notice: no tokens, the worker's name; then seq counts up by one
    admitted = stream_msgs[0]
    assert admitted["kind"] == "stream_tokens" and admitted["token_ids"] == [] and admitted["worker_id"] in ("d1", "d2")
    assert [d["seq"] for d in stream_msgs] == list(range(len(stream_msgs)))
    # every message names the worker holding the request and its process (the gateway shows no other's)
    assert {(d["worker_id"], d["incarnation"]) for d in stream_msgs} == {(admitted["worker_id"],
                                                                          admitted["incarnation"])}
    assert admitted["incarnation"]
    assert seen
    parsed = [json.loads(m.data) for m in seen]  # raises if any message is not JSON
    assert EVERY_KIND <= {p.get("kind") for p in parsed}
    assert any("stream_subject" in p for p in parsed)  # our hand-written request (no "kind": optional)
    [job] = [p for p in parsed if p.get("kind") == "prefill_job"]
    assert job["dst"]["endpoint"] == f"tandem.kv.meta.{admitted['worker_id']}"  # where its KV metadata is


def test_micro_discovery_lists_workers(cluster):
    url, workers = cluster

    async def go():
        nc = await nats.connect(url)
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish("$SRV.INFO", b"", reply=inbox)
        # every worker answers once: read until all of them did (a busy worker may answer late)
        infos = await read_until(sub, lambda got: set(workers) <= {i.get("metadata", {}).get("worker_id")
                                                                   for i in got}, 15, "every worker's $SRV.INFO")
        ping = await nc.request("$SRV.PING.tandem-prefill-only", b"", timeout=10)
        s = Subjects("smollm2-135m-instruct")  # a decode worker's kv_meta endpoint, as a prefill worker asks it
        metas = {wid: await request(nc, s.kv_meta(wid), KVMetaRequest(worker_id="test"), KVMetaReply, timeout=10)
                 for wid in ("d1", "d2")}
        await nc.close()
        return infos, json.loads(ping.data), metas

    infos, ping, metas = run(go())
    by_worker = {i["metadata"]["worker_id"]: i for i in infos}
    assert set(workers) <= set(by_worker)
    for wid, w in workers.items():
        md = by_worker[wid]["metadata"]
        assert md["role"] == w.role
        assert md["model"] == "smollm2-135m-instruct"
        assert len(md["layout_fingerprint"]) == 16
        assert {e["name"] for e in by_worker[wid]["endpoints"]} == {"info", "stats", "recent", "kv_meta"}
        assert md["host"]  # the page's cluster view and `tandem status` show where each worker runs
    assert ping["name"] == "tandem-prefill-only"
    for wid, meta in metas.items():
        assert (meta.worker_id, meta.incarnation) == (wid, by_worker[wid]["metadata"]["incarnation"]) and meta.meta


def test_prefix_cache_hit_skips_transfer(cluster, smollm):
    url, _ = cluster
    a = chat_ids(smollm, LONG_CONTEXT + " What follows 7?")
    b = chat_ids(smollm, LONG_CONTEXT + " What follows 9?")

    async def go():
        async with Client(url) as c:
            jobs = []

            async def record(m):
                jobs.append(json.loads(m.data))

            js_spy = await c.nc.subscribe("tandem.>", cb=record)
            ra, rb = rid(), rid()
            first = await c.generate(ra, a, worker="d1", max_tokens=4)
            second = await c.generate(rb, b, worker="d1", max_tokens=4)
            await js_spy.unsubscribe()
            jobs = [j for j in jobs if j.get("kind") == "prefill_job"]
            return first, second, [j for j in jobs if j["request_id"] == ra], [j for j in jobs if j["request_id"] == rb]

    first, second, jobs_a, jobs_b = run(go())
    assert first["finish"]["prefill_mode"] == second["finish"]["prefill_mode"] == "remote"
    assert second["finish"]["usage"]["cached_tokens"] > len(a) // 2
    assert len(jobs_a) == len(jobs_b) == 1, (jobs_a, jobs_b)
    job_a, job_b = jobs_a[0], jobs_b[0]
    assert job_a["dst"]["first_token_index"] <= 32  # at most the shared system-prompt blocks
    assert job_b["dst"]["first_token_index"] == second["finish"]["usage"]["cached_tokens"]
    assert len(job_b["dst"]["block_ids"]) < len(job_a["dst"]["block_ids"]) // 3


def test_layout_mismatch_names_both_layouts(cluster):
    url, _ = cluster

    async def go():
        nc = await nats.connect(url)
        r = rid()
        reply = f"tandem.prefill.done.nobody.{r}"
        sub = await nc.subscribe(reply)
        layout = {"model": "smollm2-x", "dtype": "float32", "block_size": 32, "num_layers": 30,
                  "num_kv_heads": 3, "head_dim": 64, "order": "block,layer,kv,slot,head,dim"}
        job = {"kind": "prefill_job", "request_id": r, "prompt_ids": [1, 2, 3], "layout_fingerprint": "0" * 16,
               "layout": layout, "reply_subject": reply, "deadline": time.time() + 30,
               "dst": {"engine": "shm", "worker_id": "nobody", "incarnation": "x", "block_ids": [0]}}
        await nc.publish("tandem.smollm2-135m-instruct.prefill.p1", json.dumps(job).encode())
        accepted = json.loads((await sub.next_msg(timeout=10)).data)
        done = json.loads((await sub.next_msg(timeout=10)).data)
        await nc.close()
        return accepted, done

    accepted, done = run(go())
    assert accepted["kind"] == "prefill_accepted" and accepted["prefill_worker_id"] == "p1"
    assert done["ok"] is False and done["error_code"] == "layout_mismatch"
    assert "block_size=32" in done["error"] and "block_size=16" in done["error"]


def test_decode_worker_weighs_where_to_prefill(cluster, smollm):
    """A prompt whose local prefill fits the stall budget stays local (remote adds a hand-off); one that would
    hold the decode batch longer goes to the idle prefill worker, though both are above the length floor."""
    url, _ = cluster

    async def go(prompt):
        async with Client(url, "cd") as c:
            return await c.generate(rid(), chat_ids(smollm, prompt), max_tokens=2, timeout=120)

    short = run(go("hi"))
    assert short["finish"]["prefill_mode"] == "local", short
    long = run(go(LONG_CONTEXT + " Summarize."))
    assert long["finish"]["prefill_mode"] == "remote", long
    assert long["finish"]["prefill_worker_id"] == "cp1"


def test_layout_mismatch_between_workers_reaches_the_client(cluster, smollm):
    url, _ = cluster

    async def go():
        async with Client(url, "mm") as c:
            return await c.generate(rid(), chat_ids(smollm, QUESTIONS[0]), timeout=30)

    out = run(go())
    err = out["error"]
    assert err["code"] == "layout_mismatch"
    assert "block_size=32" in err["message"] and "block_size=16" in err["message"]


def test_unknown_target_endpoint_is_an_error(cluster, smollm):
    url, _ = cluster

    async def go():
        async with Client(url) as c:
            return await c.generate(rid(), chat_ids(smollm, "hi"), target_endpoint="no-such-worker", timeout=20)

    out = run(go())
    assert out["error"]["code"] == "unknown_target" and out["error"]["status"] == 400
    assert "no-such-worker" in out["error"]["message"]


def test_target_endpoint_routes_to_that_prefill_worker(cluster, smollm):
    """p1 streams the KV layer by layer, p2 sends it whole: same tokens either way."""
    url, _ = cluster
    prompt = chat_ids(smollm, "Name a large animal that lives in the sea.")

    async def go():
        async with Client(url) as c:
            return await asyncio.gather(*[
                c.generate(rid(), prompt, worker=d, target_endpoint=t, max_tokens=8)
                for d, t in [("d1", "p2"), ("d2", "tandem.smollm2-135m-instruct.prefill.p1")]])

    a, b = run(go())
    assert a["finish"]["prefill_worker_id"] == "p2"
    assert b["finish"]["prefill_worker_id"] == "p1"
    assert a["finish"]["prefill_mode"] == b["finish"]["prefill_mode"] == "remote"
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) > 0


def test_bad_request_reports_error(cluster):
    url, _ = cluster

    async def go():
        async with Client(url) as c:
            return (await c.generate(rid(), [1, 2, 999999], timeout=20),
                    await c.generate(rid(), [1, 2, 3], worker="d1", seed=2**63, temperature=1.0, timeout=20))

    vocab, seed = run(go())
    assert vocab["error"]["status"] == 400 and "vocabulary" in vocab["error"]["message"]
    assert seed["error"]["status"] == 400 and "seed" in seed["error"]["message"]


def test_bad_pool_messages_do_not_stop_intake(cluster, smollm):
    """Requests with nowhere to answer are dropped; a bad request id is a 400; the worker pulls on."""
    url, _ = cluster

    async def go():
        async with Client(url, "agg") as c:
            for subject in ("", "has space", "tandem.*.x", "a..b"):
                body = c.request_body(rid(), [1, 2, 3])
                body["stream_subject"] = subject
                await c.js.publish(c.subjects.generate_pool, json.dumps(body).encode())
            body = c.request_body(rid(), [1, 2, 3])
            body["request_id"] = "not.a.token"
            sub = await c.nc.subscribe(body["stream_subject"])
            await c.js.publish(c.subjects.generate_pool, json.dumps(body).encode())
            bad_id = await c.collect(sub, timeout=30)
            return bad_id, await c.generate(rid(), chat_ids(smollm, "Say hello."), max_tokens=4, timeout=60)

    bad_id, after = run(go())
    assert bad_id["error"]["status"] == 400 and "request_id" in bad_id["error"]["message"]
    assert "finish" in after, after


def test_docs_hand_written_request_twice_and_on_the_wrong_subject(cluster):
    """docs/nats.md's JSON works as written; sent again with the same request_id it gets a clear 409 on its
    stream subject (not silence); a generate request published on the prefill pool by mistake is answered.
    (Before the tests that stop workers: the prefill pool needs a live prefill worker.)"""
    url, _ = cluster
    rid = f"req-{uuid.uuid4().hex[:8]}"
    body = json.dumps({"request_id": rid, "stream_subject": f"tandem.stream.me.{rid}",
                       "prompt": "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
                       "sampling": {"max_tokens": 32, "temperature": 0}}).encode()

    async def go():
        nc = await nats.connect(url)
        sub = await nc.subscribe(f"tandem.stream.me.{rid}")
        js = nc.jetstream()
        s = Subjects("smollm2-135m-instruct")
        await js.publish(s.generate_pool, body)
        first = await read_until(sub, lambda got: got and got[-1]["kind"] != "stream_tokens", 120,
                                 "the answer's last message")
        await js.publish(s.generate_pool, body)
        again = json.loads((await sub.next_msg(timeout=60)).data)
        wrong_sub = await nc.subscribe("tandem.stream.me.wrong")
        await js.publish(s.prefill_pool, json.dumps({"request_id": "wrong", "stream_subject": "tandem.stream.me.wrong",
                                                     "prompt": "hi"}).encode())
        wrong = json.loads((await wrong_sub.next_msg(timeout=60)).data)
        await nc.close()
        return first, again, wrong

    first, again, wrong = run(go())
    assert first[-1]["kind"] == "stream_finish" and "Paris" in "".join(m.get("text", "") for m in first)
    assert again["kind"] == "stream_error" and again["code"] == "duplicate_request" and again["status"] == 409
    assert rid in again["message"] and "new request_id" in again["message"]
    assert wrong["kind"] == "stream_error" and wrong["status"] == 400 and "generate" in wrong["message"]


def test_cancel_that_overtakes_its_queued_request(cluster, smollm):
    """A client gone while its request still sat in the pool: the worker that pulls it drops it."""
    url, _ = cluster

    async def go():
        async with Client(url, "agg") as c:
            r = rid()
            await c.nc.publish(c.subjects.cancel(r), json.dumps({"request_id": r, "reason": "client left"}).encode())
            await c.nc.flush()
            sub = await c.start(r, chat_ids(smollm, "Say hello."), max_tokens=4)  # via the pool
            with pytest.raises(nats.errors.TimeoutError):
                await sub.next_msg(timeout=5)  # a run would admit it within milliseconds
            return await c.generate(rid(), chat_ids(smollm, "Say hello."), max_tokens=4)

    after = run(go())
    assert "finish" in after, after  # the worker serves on


def test_cancel_mid_prefill_and_mid_decode_frees_blocks(cluster, smollm):
    url, workers = cluster
    long_prompt = chat_ids(smollm, LONG_CONTEXT * 2 + " Summarize.")
    assert len(long_prompt) > 2000

    async def go():
        async with Client(url) as c:
            # Mid-prefill: cancel as soon as the prefill job is on the bus. p2 sends the KV whole
            # after computing, so the cancel lands before any write and frees the blocks at once
            # (a cancel after writes began keeps them quarantined until the job's deadline).
            jobs = await c.nc.subscribe(c.subjects.prefill_worker("p2"))
            r1 = rid()
            s1 = await c.start(r1, long_prompt, worker="d1", target_endpoint="p2", max_tokens=8)
            await jobs.next_msg(timeout=30)
            await c.nc.publish(c.subjects.cancel(r1), json.dumps({"request_id": r1, "reason": "test"}).encode())
            end1 = await c.collect(s1, timeout=30)
            # Mid-decode: cancel after a few tokens.
            r2 = rid()
            s2 = await c.start(r2, chat_ids(smollm, "Count from 1 to 500."), worker="d2", max_tokens=300,
                               ignore_eos=True)
            for _ in range(3):
                await s2.next_msg(timeout=60)
            await c.nc.publish(c.subjects.cancel(r2), json.dumps({"request_id": r2}).encode())
            end2 = await c.collect(s2, timeout=30)
            # well before the quarantine would let go of them by itself (--prefill-timeout 90 + 5 s)
            await c.wait_all_free(list(workers[w] for w in ("p1", "p2", "d1", "d2")), timeout=60)
            return end1, end2

    end1, end2 = run(go())
    assert end1["finish"]["finish_reason"] == "cancelled"
    assert end2["finish"]["finish_reason"] == "cancelled"


def test_a_prefill_job_withdrawn_from_the_pool_frees_its_blocks_at_once(cluster, smollm, tmp_path):
    """wd1's one prefill worker ("ghost") reports but never pulls, so the job waits in the pool. The cancel
    withdraws it and claims it as a prefill worker would: the blocks are free at once, not at the job's
    deadline (--prefill-timeout 90, + 5 s), and the pool is empty. Then, with the claims stream gone, a real
    prefill worker cannot claim a pool job: it refuses it unwritten, and wd1 prefills the prompt itself."""
    url, workers = cluster
    prompt = chat_ids(smollm, LONG_CONTEXT + " Which fact comes last?")

    async def ghost(c: Client) -> None:
        while True:
            await c.nc.publish(c.subjects.stats("prefill_only", "ghost"),
                               encode(WorkerStats(role="prefill_only", worker_id="ghost", model=c.subjects.model)))
            await asyncio.sleep(0.5)

    async def pool_holds(c: Client) -> int:
        return (await c.js.stream_info(c.subjects.prefill_stream)).state.messages

    async def withdrawn():
        async with Client(url, "wd") as c:
            reporting = asyncio.create_task(ghost(c))
            # wd1 heard it (its reports are read apart from its requests: no order)
            await know_prefill_workers(url, ("wd", "wd1", 1), timeout=30)
            r = rid()
            s = await c.start(r, prompt, worker="wd1", max_tokens=4)
            await until(lambda: pool_holds(c), 30, "the prefill job in the pool")
            t0 = time.monotonic()
            await c.nc.publish(c.subjects.cancel(r), json.dumps({"request_id": r, "reason": "client left"}).encode())
            end = await c.collect(s, timeout=30)
            await c.wait_all_free([workers["wd1"]], timeout=30)
            freed_after = time.monotonic() - t0
            reporting.cancel()
            return end, freed_after, await pool_holds(c)

    end, freed_after, left = run(withdrawn())
    assert end["finish"]["finish_reason"] == "cancelled", end
    assert left == 0
    assert freed_after < 30  # the quarantine alone would hold them 95 s

    wp1 = Worker("prefill_only", "wp1", url, tmp_path, "--namespace", "wd")
    try:
        wp1.wait_ready()

        async def unclaimed():
            async with Client(url, "wd") as c:
                await c.js.delete_stream(c.subjects.claims_stream)
                await c.stats("prefill_only", "wp1")  # wd1 hears it too
                r = rid()
                replies = await c.nc.subscribe(c.subjects.prefill_done("wd1", r))
                out = await c.generate(r, prompt, worker="wd1", max_tokens=4)
                return out, await read_until(replies, bool, 5, "wp1's answer")

        out, answers = run(unclaimed())
    finally:
        wp1.stop()
    assert "finish" in out and out["token_ids"], out
    assert out["finish"]["prefill_worker_id"] is None  # prefilled on wd1
    refused = answers[0]
    assert refused["kind"] == "prefill_done" and not refused["ok"] and not refused["wrote"], refused
    assert "could not claim" in refused["error"]


def test_two_prefill_two_decode_share_load(cluster, smollm):
    url, _ = cluster
    prompts = [chat_ids(smollm, f"{q} Answer in one word. ({i})") for i, q in enumerate(QUESTIONS * 3)]

    async def go():
        async with Client(url) as c:
            return await asyncio.gather(*[c.generate(rid(), p, max_tokens=24, ignore_eos=True) for p in prompts])

    outs = run(go())
    assert all("finish" in o for o in outs)
    assert {o["finish"]["worker_id"] for o in outs} == {"d1", "d2"}
    assert {o["finish"]["prefill_worker_id"] for o in outs} - {None} == {"p1", "p2"}  # None: prefilled locally
