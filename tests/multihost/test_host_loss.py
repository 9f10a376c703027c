"""Losing a machine under load, on four emulated machines (bench/hosts.py).

A: NATS member + prefill worker; B: member + decode worker; C: member + decode worker; D: the gateway.
The work queues keep three replicas. Each test owns its machines and kills (or cuts off) one of them
while streams run: every request completes (a prefill re-sent or done locally, a stream moved to the
other decode worker, the gateway on another member); none hangs; the survivors hold no block afterwards.
The times a client waits (leader election, the gateway's reconnect) are measured and printed.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from bench.hosts import Deployment, Hosts
from tests.harness.chat import assert_clear, long_prompt, stream_chat
from tests.harness.native import NEEDS_NATIVE
from tests.harness.site import DECODE_ARGS, MACHINE_ENV, Site
from tests.harness.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), NEEDS_NATIVE]

STREAMS = 6


def member(hosts: Hosts, host: str) -> dict[str, str]:
    return {"TANDEM_NATS_URL": f"nats://{hosts.ip(host)}:4222"}


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    with Hosts(["a", "b", "c", "d"], tmp_path / "logs") as hosts:
        dep = Deployment(hosts, tmp_path, ["a", "b", "c"], env=MACHINE_ENV)
        for m in ("a", "b", "c"):
            dep.nats(m)
        # each worker speaks to its own machine's member, the gateway to C's (a client learns the other members
        # from the one it reaches, and fails over to them)
        dep.serve("a", "prefill-a", "prefill_only", env=member(hosts, "a"))
        dep.serve("b", "decode-b", "decode_only", *DECODE_ARGS, env=member(hosts, "b"))
        dep.serve("c", "decode-c", "decode_only", *DECODE_ARGS, env=member(hosts, "c"))
        dep.gateway("d", env=member(hosts, "c"))
        s = Site(hosts, dep)
        s.heard({"prefill-a", "decode-b", "decode-c"})
        yield s


async def under_load(site: Site, fault: Any, max_tokens: int = 48) -> list[dict[str, Any]]:
    """``STREAMS`` greedy streaming chats through the gateway; ``fault()`` once they are under way."""
    async with httpx.AsyncClient(timeout=200) as client:
        tasks = [asyncio.create_task(stream_chat(client, site.url, long_prompt(i, 12), max_tokens=max_tokens,
                                                 ignore_eos=True)) for i in range(STREAMS)]
        await asyncio.sleep(1.0)
        await asyncio.to_thread(fault)
        return await asyncio.wait_for(asyncio.gather(*tasks), 180)


def test_losing_the_prefill_machine(site: Site) -> None:
    results = asyncio.run(under_load(site, lambda: site.hosts.kill_host("a")))
    assert_clear(results)
    assert all(r["status"] == 200 and r["finish"] == "length" for r in results), results  # prefilled locally
    site.idle({"decode-b", "decode-c"})


def test_losing_a_decode_machine(site: Site) -> None:
    def kill_b() -> None:
        site.wait_until("decode-b streaming", lambda c: any(w["worker_id"] == "decode-b" and w["running"]
                                                           for w in c["workers"]), 60)
        site.hosts.kill_host("b")

    results = asyncio.run(under_load(site, kill_b, max_tokens=96))
    assert_clear(results)
    assert all(r["status"] == 200 and r["finish"] == "length" for r in results), results  # moved to decode-c
    site.idle({"decode-c"})


def test_losing_the_machine_that_leads_the_work_queue(site: Site) -> None:
    leader = site.leader()
    host = leader.removeprefix("host-")
    # the gateway speaks to that member first, so losing it also costs the gateway its connection
    for child in site.hosts.children["d"]:
        child.terminate()
        child.wait(30)
    site.dep.gateway("d", env=member(site.hosts, host))
    site.heard({"prefill-a", "decode-b", "decode-c"})
    elected: list[float] = []
    unelected: list[AssertionError] = []

    def watch_election(t0: float) -> None:
        """Ask the survivors for the queue's leader every 0.2 s from the kill on; note when a new one answers."""
        def new_leader() -> bool:
            new = site.leader(dead=host)
            return bool(new) and new.startswith("host-") and new != leader

        try:
            wait_until(new_leader, 60, "a new leader for the work queue", 0.2,
                       ignore=(nats.errors.Error, asyncio.TimeoutError, AttributeError, OSError))
        except AssertionError as e:
            unelected.append(e)
            return
        elected.append(time.monotonic() - t0)

    watcher: list[threading.Thread] = []

    def kill_leader() -> None:
        site.lead_from(leader)  # it may have moved since: the kill must take the leader
        site.hosts.kill_host(host)
        watcher.append(threading.Thread(target=watch_election, args=(time.monotonic(),), daemon=True))
        watcher[0].start()

    results = asyncio.run(under_load(site, kill_leader))
    assert_clear(results)
    # the gateway fails over and asks for what it missed; the dead machine's streams move to the other decode worker
    assert all(r["status"] == 200 and r["finish"] == "length" for r in results), results
    watcher[0].join(70)
    assert elected, unelected
    elected_s = elected[0]
    gateway = next(c for c in site.hosts.children["d"] if c.running)
    back = wait_until(lambda: re.search(r"reconnected to \S+ after ([\d.]+)s", gateway.last_lines(400)), 30,
                      lambda: f"the gateway to reconnect:\n{gateway.last_lines(400)[-3000:]}", interval=0.2)
    reconnect_s = float(back.group(1))
    survivors = {"prefill-a", "decode-b", "decode-c"} - {f"prefill-{host}", f"decode-{host}"}
    served = asyncio.run(under_load(site, lambda: None, max_tokens=8))
    assert all(r["status"] == 200 for r in served), served
    site.idle(survivors - {"prefill-a"})
    print(f"\nleader {leader} lost: new leader within {elected_s:.1f}s of the kill, gateway reconnected after "
          f"{reconnect_s:.1f}s; {sum(r['status'] == 200 for r in results)}/{len(results)} streams completed")
    assert reconnect_s < 10.0 and elected_s < 30.0


def test_a_machine_cut_off_and_back_serves_nothing_twice(site: Site) -> None:
    """A's link goes down for 10 s while its prefill worker holds jobs: the decode workers give up on it and
    prefill locally; when A is back, what it computed meanwhile lands nowhere and its blocks are freed."""
    def cut_a() -> None:
        site.wait_until("prefill-a busy", lambda c: any(w["worker_id"] == "prefill-a" and w["running"]
                                                       for w in c["workers"]), 60)
        site.hosts.cut("a")

    results = asyncio.run(under_load(site, cut_a))
    assert_clear(results)
    assert all(r["status"] == 200 and r["finish"] == "length" for r in results), results
    texts = [r["text"] for r in results]
    site.hosts.heal("a")
    site.wait_until("prefill-a back", lambda c: any(w["worker_id"] == "prefill-a" and w["alive"]
                                                    for w in c["workers"]), 60)
    site.idle({"prefill-a", "decode-b", "decode-c"})  # its blocks and the decode side's quarantine are free
    again = asyncio.run(under_load(site, lambda: None))
    assert [r["text"] for r in again] == texts  # one answer each, the same as an uncut run
