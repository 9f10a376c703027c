"""Real workers under deploy/nats/nats.conf: each role's credentials are enough for the real code.

A prefill_only, a decode_only (remote prefill forced) and a prefill_and_decode worker run as
`tandem serve` processes with the users `prefill`, `decode` and `aggregate`; a client with the
`gateway` user sends requests; `tandem status` runs as `ops`. Nothing may hit a permission
violation, and the disaggregated request must really be prefilled remotely.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator

import nats
import pytest

from bench.cluster import MODEL, Client, tandem_cmd
from bus import nats_config as natsconf
from bus.server import EmbeddedNats
from bus.subjects import Subjects
from bus.wire import REQUEST_ID_HEADER
from tests.harness.chat import chat_prompt_ids
from tests.harness.cluster import Proc, run_cli
from tests.harness.deploy import login_env, password_env, render
from tests.harness.wait import read_until

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def secured() -> Iterator[tuple[str, dict[str, Proc]]]:
    """NATS with the deploy config and three workers logged in as their roles' users."""
    mp = pytest.MonkeyPatch()
    for k, v in password_env().items():
        mp.setenv(k, v)
    workers: dict[str, Proc] = {}
    try:
        with EmbeddedNats(config=render.SINGLE_OUT, extra_args=["-m", "-1"]) as srv:

            def start(worker_id: str, role: str, user: str, *extra: str) -> Proc:
                env = {**login_env(user), "UCX_NET_DEVICES": "lo"}
                p = Proc(tandem_cmd("--log-level", "INFO", "serve", "--pipeline-role", role, "--worker-id",
                                    worker_id, "--nats-url", srv.url, "--num-blocks", "64", *extra), env=env)
                workers[worker_id] = p
                return p

            try:
                start("p1", "prefill_only", "prefill").wait_for("ready", timeout=180)
                start("d1", "decode_only", "decode", "--local-prefill-max-tokens", "0", "--prefill-stall-budget-ms", "0")
                start("a1", "prefill_and_decode", "aggregate")
                for w in ("d1", "a1"):
                    workers[w].wait_for("ready", timeout=180)
                yield srv.url, workers
            finally:
                for p in workers.values():
                    p.stop()
    finally:
        mp.undo()


async def generate(url: str, worker: str, rid: str) -> dict:
    """As the gateway user: send a request to one worker and read its stream to the end."""
    s = Subjects(MODEL)
    nc = await nats.connect(url, user="gateway", password="pw-gateway", connect_timeout=5,
                            inbox_prefix=natsconf.inbox_of("gateway"))
    try:
        sub = await nc.subscribe(s.stream("gw1", rid))
        body = {"kind": "generate_request", "request_id": rid, "stream_subject": s.stream("gw1", rid),
                "prompt_ids": chat_prompt_ids("What is the capital of France?"), "deadline": time.time() + 120,
                "sampling": {"max_tokens": 8, "temperature": 0.0}}
        await nc.publish(s.generate_worker(worker), json.dumps(body).encode(), headers={REQUEST_ID_HEADER: rid})
        got = await read_until(sub, lambda got: got and got[-1]["kind"] != "stream_tokens", 120, "the answer's end")
        return {**got[-1], "text": "".join(d["text"] for d in got[:-1])}
    finally:
        await nc.close()


async def hear_p1_reports(url: str) -> None:
    """Until two of p1's load reports went by (as the gateway user, who may read them).

    d1 subscribes to them (tandem.stats.prefill_only.*) before it says "ready", so it heard
    every report we hear; the second one leaves it time to have handled the first.
    """
    async with Client(url.replace("nats://", "nats://gateway:pw-gateway@")) as c:
        for _ in range(2):
            await c.stats("prefill_only", "p1", timeout=30)


def test_roles_work_with_their_own_credentials(secured: tuple[str, dict[str, Proc]]) -> None:
    url, workers = secured
    asyncio.run(hear_p1_reports(url))  # d1 knows p1 is alive
    disagg = asyncio.run(generate(url, "d1", uuid.uuid4().hex))
    assert disagg["kind"] == "stream_finish", disagg
    assert disagg["prefill_mode"] == "remote" and disagg["prefill_worker_id"] == "p1"
    assert "Paris" in disagg["text"]
    agg = asyncio.run(generate(url, "a1", uuid.uuid4().hex))
    assert agg["kind"] == "stream_finish" and agg["prefill_mode"] == "aggregate" and agg["text"] == disagg["text"]

    res = run_cli("status", "--json", "--wait", "3", "--nats-url", url.replace("nats://", "nats://ops:pw-ops@"),
                  env={"TANDEM_NATS_INBOX_PREFIX": natsconf.inbox_of("ops")})
    assert res.returncode == 0, res.stderr
    status = json.loads(res.stdout)
    assert {(w["worker_id"], w["role"]) for w in status["workers"]} == {
        ("p1", "prefill_only"), ("d1", "decode_only"), ("a1", "prefill_and_decode")}
    assert all(w["stats_error"] is None for w in status["workers"])
    assert all(p["error"] is None for p in status["pools"])

    for wid, p in workers.items():
        log = "\n".join(p.out + p.err).lower()
        assert "permissions violation" not in log and "authorization violation" not in log, f"{wid}:\n{p.text()}"
