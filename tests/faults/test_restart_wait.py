"""One decode worker, SIGKILLed mid-stream: the stream waits for `tandem up` to restart it and goes on there.

Before, the gateway failed such a stream with `no_workers` the moment it noticed the worker was gone (5 s),
although the restarted worker was ready about 3 s later. Now a request whose worker died waits, when no
other decode worker is alive, for one to come back (`--worker-wait`, default 15 s), the same worker id as a
new process included, and moves there with the tokens so far.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import httpx
import pytest

from bench.cluster import TandemUp
from tests.harness.chat import stream_chat
from tests.harness.cluster import busy_worker, tandem_up, wait_restarted
from tests.harness.native import NEEDS_NATIVE
from tests.harness.wait import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), NEEDS_NATIVE]

PROMPT = "Write a long story about a lighthouse keeper and the sea."


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TandemUp]:
    # the row-invariant path: the moved stream is prefilled again in another shape and must read as the uncut one
    with tandem_up(tmp_path_factory.mktemp("restart"), "--kernels", "invariant", "--decode", "1",
                   # restarted later than the gateway gives a silent worker up (5 s): the stream must wait
                   "--restart-delay", "7", "--stop-timeout", "10",
                   "--worker-args", "--num-blocks 512 --local-prefill-max-tokens 64") as cluster:
        yield cluster


def test_a_stream_waits_for_its_only_decode_worker_to_come_back(up: TandemUp) -> None:
    async def go() -> tuple[dict, dict]:
        async with httpx.AsyncClient(timeout=300) as client:
            uncut = await stream_chat(client, up.url, PROMPT, max_tokens=96, ignore_eos=True)
            seen: dict = {}
            task = asyncio.create_task(stream_chat(client, up.url, PROMPT, into=seen, max_tokens=96,
                                                   ignore_eos=True))
            victim = await asyncio.to_thread(busy_worker, up, "decode_only")
            assert victim == "decode-1"
            await until(lambda: len(seen.get("text", "")) >= 40, 60, "some text out")
            os.kill(up.child_info("decode-1")["pid"], signal.SIGKILL)
            return uncut, await task

    uncut, moved = asyncio.run(go())
    assert uncut["status"] == 200 and uncut["finish"] == "length"
    assert moved["status"] == 200 and moved["error"] is None, moved
    assert moved["finish"] == "length" and moved["text"] == uncut["text"]
    wait_restarted(up, "decode-1", 1)
    assert "waiting up to" in up.output()  # the gateway said why the stream paused
