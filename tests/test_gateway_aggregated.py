"""`tandem up --aggregated --decode 2`: two prefill_and_decode workers behind the gateway.

Checks what only several real workers show: the gateway's prefix-affinity routing sends a
prompt that shares a long prefix with an earlier one to the worker that holds it, whose
prefix cache then serves those tokens (usage.prompt_tokens_details.cached_tokens).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from bench.cluster import TandemUp

pytestmark = pytest.mark.timeout(300)

MODEL = "smollm2-135m-instruct"
CONTEXT = " ".join(f"Fact {i}: the number {i} is followed by {i + 1}." for i in range(40))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TandemUp]:
    up = TandemUp(tmp_path_factory.mktemp("agg"), "--aggregated", "--decode", "2", "--stop-timeout", "10",
                  "--worker-args", "--num-blocks 256").start(240)
    try:
        yield up
    finally:
        up.stop(60)


def test_two_aggregated_workers(cluster: TandemUp) -> None:
    workers = httpx.get(f"{cluster.url}/ready").json()["workers"]
    assert sorted((w["worker_id"], w["role"]) for w in workers) == [
        ("worker-1", "prefill_and_decode"), ("worker-2", "prefill_and_decode")]


def test_prefix_affinity_hits_the_cache(cluster: TandemUp) -> None:
    client = openai.OpenAI(base_url=cluster.info["base_url"], api_key="x", max_retries=0, timeout=120)
    served = []
    cached = []
    for q in ("What follows 7?", "What follows 9?", "What follows 11?"):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, temperature=0, max_tokens=4, messages=[{"role": "user", "content": f"{CONTEXT} {q}"}])
        r = raw.parse()
        served.append(raw.headers["x-tandem-decode-worker"])
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        assert raw.headers["x-tandem-prefill"] == "aggregate"
    assert len(set(served)) == 1, served  # the same worker every time
    assert cached[0] == 0 and cached[1] > 400 and cached[2] > 400, cached


def test_target_endpoint_is_refused_without_prefill_workers(cluster: TandemUp) -> None:
    client = openai.OpenAI(base_url=cluster.info["base_url"], api_key="x", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError, match="no prefill workers"):
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}],
                                       extra_body={"target_endpoint": "prefill-1"})


def test_zz_a_killed_worker_is_restarted_and_the_cluster_keeps_serving(cluster: TandemUp) -> None:
    """SIGKILL a worker: `tandem up` says so, restarts it (new pid, restart 1), and the other one serves meanwhile."""
    victim = cluster.child_info("worker-2")
    os.kill(victim["pid"], signal.SIGKILL)
    client = openai.OpenAI(base_url=cluster.info["base_url"], api_key="x", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    assert r.choices[0].message.content
    cluster.child.wait_for(f"worker-2 (pid {victim['pid']}) killed by SIGKILL while serving; restarting it in 1s "
                           "(restart 1)", 60)
    cluster.child.wait_for("worker-2 restarted (pid", 60)
    deadline = time.monotonic() + 120
    while cluster.child_info("worker-2")["restarts"] != 1:
        assert time.monotonic() < deadline, cluster.output()[-3000:]
        time.sleep(0.2)
    again = cluster.child_info("worker-2")
    assert again["pid"] != victim["pid"]
    deadline = time.monotonic() + 120
    while True:  # the restarted worker reports again, as a new incarnation, and says it was restarted
        status = subprocess.run([sys.executable, "-m", "tandem.cli", "status", "--json", "--wait", "2",
                                 "--nats-url", cluster.info["nats_url"]], capture_output=True, text=True, timeout=60)
        rows = {w["worker_id"]: w for w in json.loads(status.stdout)["workers"]}
        if rows.get("worker-2", {}).get("restarts") == 1:
            break
        assert time.monotonic() < deadline, status.stdout
        time.sleep(1)
    assert rows["worker-1"]["restarts"] == 0
    assert cluster.child.running  # it kept going
