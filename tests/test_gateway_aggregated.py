"""`tandem up --aggregated --decode 2`: two prefill_and_decode workers behind the gateway.

Checks what only several real workers show: the gateway's prefix-affinity routing sends a
prompt that shares a long prefix with an earlier one to the worker that holds it, whose
prefix cache then serves those tokens (usage.prompt_tokens_details.cached_tokens).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bench.cluster import TandemUp
from tests.harness.cluster import status_json, tandem_up
from tests.harness.wait import wait_until

pytestmark = pytest.mark.timeout(300)

MODEL = "smollm2-135m-instruct"
CONTEXT = " ".join(f"Fact {i}: the number {i} is followed by {i + 1}." for i in range(40))
UP_ARGS = ("--aggregated", "--decode", "2", "--stop-timeout", "10", "--worker-args", "--num-blocks 256")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TandemUp]:
    """The cluster the tests that leave it as they found it share."""
    with tandem_up(tmp_path_factory.mktemp("agg"), *UP_ARGS, start_timeout=240, stop_timeout=60) as up:
        yield up


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[TandemUp]:
    """A cluster of the test's own, alike: for a test that kills one of its workers."""
    with tandem_up(tmp_path, *UP_ARGS, start_timeout=240, stop_timeout=60) as up:
        yield up


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


def test_a_killed_worker_is_restarted_and_the_cluster_keeps_serving(own_cluster: TandemUp) -> None:
    """SIGKILL a worker: `tandem up` says so, restarts it (new pid, restart 1), and the other one serves meanwhile."""
    cluster = own_cluster
    victim = cluster.child_info("worker-2")
    os.kill(victim["pid"], signal.SIGKILL)
    client = openai.OpenAI(base_url=cluster.info["base_url"], api_key="x", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    assert r.choices[0].message.content
    cluster.child.wait_for(f"worker-2 (pid {victim['pid']}) killed by SIGKILL while serving; restarting it in 1s "
                           "(restart 1)", 60)
    cluster.child.wait_for("worker-2 restarted (pid", 60)
    wait_until(lambda: cluster.child_info("worker-2")["restarts"] == 1, 120,
               lambda: f"worker-2's first restart:\n{cluster.output()[-3000:]}", interval=0.2)
    again = cluster.child_info("worker-2")
    assert again["pid"] != victim["pid"]

    def reported_restarted() -> dict[str, dict[str, Any]] | None:
        rows = {w["worker_id"]: w for w in status_json(cluster, "--wait", "2")["workers"]}
        return rows if rows.get("worker-2", {}).get("restarts") == 1 else None

    # the restarted worker reports again, as a new incarnation, and says it was restarted
    rows = wait_until(reported_restarted, 120, "worker-2 to report its restart on the bus", interval=1.0)
    assert rows["worker-1"]["restarts"] == 0
    assert cluster.child.running  # it kept going
