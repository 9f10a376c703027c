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
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(300)

MODEL = "smollm2-135m-instruct"
CONTEXT = " ".join(f"Fact {i}: the number {i} is followed by {i + 1}." for i in range(40))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("agg")
    ready = tmp / "ready.json"
    log = tmp / "up.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "up", "--aggregated", "--decode", "2", "--port", "0",
             "--nats-port", "0", "--metrics-port-base", "0", "--ready-file", str(ready), "--stop-timeout", "10",
             "--worker-args", "--num-blocks 256"],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    deadline = time.monotonic() + 240
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"tandem up did not become ready (exit {proc.poll()}):\n{log.read_text()[-4000:]}")
        time.sleep(0.2)
    info = json.loads(ready.read_text())
    info["_proc"], info["_log"] = proc, log
    try:
        yield info
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)


def test_two_aggregated_workers(cluster: dict[str, Any]) -> None:
    workers = httpx.get(f"{cluster['url']}/ready").json()["workers"]
    assert sorted((w["worker_id"], w["role"]) for w in workers) == [
        ("worker-1", "prefill_and_decode"), ("worker-2", "prefill_and_decode")]


def test_prefix_affinity_hits_the_cache(cluster: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=cluster["base_url"], api_key="x", max_retries=0, timeout=120)
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


def test_target_endpoint_is_refused_without_prefill_workers(cluster: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=cluster["base_url"], api_key="x", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError, match="no prefill workers"):
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}],
                                       extra_body={"target_endpoint": "prefill-1"})


def test_zz_a_dead_worker_stops_the_cluster(cluster: dict[str, Any]) -> None:
    """Any child dying stops everything, and `tandem up` says which one and how it died."""
    proc, log = cluster["_proc"], cluster["_log"]
    victim = next(c for c in cluster["children"] if c["name"] == "worker-2")
    os.kill(victim["pid"], signal.SIGKILL)
    assert proc.wait(60) == 1
    text = log.read_text()
    assert f"worker-2 (pid {victim['pid']}) killed by SIGKILL; stopping everything" in text
    for c in cluster["children"]:
        with pytest.raises(ProcessLookupError):
            os.kill(c["pid"], 0)
