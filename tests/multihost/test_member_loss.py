"""Losing one NATS member loses no stream, on four emulated machines (bench/hosts.py).

A: NATS member + prefill worker; B: member + decode worker; C: member + decode worker; D: the gateway.
The work queues keep three replicas, the KV moves by NIXL (UCX over TCP). Each worker lists its own
machine's member first, the gateway C's (so losing C also costs the gateway its connection). Under a load of greedy streaming chats, each case
kills one member (then starts it again) or cuts one machine's link for 10 s (then heals it), and every
stream must end with the text of an uncut run: a client whose member died or went silent is on another
member within seconds, what NATS dropped meanwhile is published again (bus/replay.py), a stream whose
decode worker is cut off moves to the other one. Each case prints the time until something noticed the
fault, until the survivors had recovered, and the longest gap a client saw between two chunks;
docs/operations.md ("Losing a NATS member") quotes them.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.hosts import Deployment, Hosts
from tests.harness.chat import assert_clear, long_prompt, stream_chat
from tests.harness.native import NEEDS_NATIVE
from tests.harness.site import DECODE_ARGS, MACHINE_ENV, Site

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), NEEDS_NATIVE]

STREAMS = 6
MAX_TOKENS = 128
CUT_S = 10.0
MEMBERS = ("a", "b", "c")
#: log lines that say a process noticed the fault, and that it recovered from it
NOTICED = re.compile(r"disconnected from|stopped reporting|did not answer a ping|lost its NATS connection")
RECOVERED = re.compile(r"reconnected to|moving the stream|falling back to local prefill|re-sending the request")
STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})")


def urls_from(hosts: Hosts, first: str) -> dict[str, str]:
    """Every member's URL, ``first``'s first (a client prefers the member on its own machine)."""
    order = [first, *(m for m in MEMBERS if m != first)]
    return {"TANDEM_NATS_URL": ",".join(f"nats://{hosts.ip(m)}:4222" for m in order)}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    tmp = tmp_path_factory.mktemp("member-loss")
    with Hosts(["a", "b", "c", "d"], tmp / "logs") as hosts:
        # no prefix cache: each case's load (the same prompts as the uncut run's) is prefilled again, remotely
        dep = Deployment(hosts, tmp, list(MEMBERS), env={**MACHINE_ENV, "TANDEM_ENABLE_PREFIX_CACHE": "0"})
        for m in MEMBERS:
            dep.nats(m)
        # NIXL writes carry no grant: blocks of a prefill given up on stay quarantined until its deadline, which
        # a shorter prefill timeout brings nearer (the cases wait for every block to be free again)
        decode_args = (*DECODE_ARGS, "--prefill-timeout", "15")
        for host, worker, role, args in (("a", "prefill-a", "prefill_only", ()), ("b", "decode-b", "decode_only", decode_args),
                                         ("c", "decode-c", "decode_only", decode_args)):
            # the KV moves by NIXL (UCX over TCP), which a NATS failover must not disturb
            dep.serve(host, worker, role, *args, "--kv-transfer", "auto",
                      env={**urls_from(hosts, host), "UCX_NET_DEVICES": hosts.device(host), "UCX_TLS": "tcp"})
        dep.gateway("d", env=urls_from(hosts, "c"))
        s = Site(hosts, dep)
        s.heard({"prefill-a", "decode-b", "decode-c"})
        yield s


async def load(site: Site, fault: Callable[[], None]) -> list[dict[str, Any]]:
    """``STREAMS`` greedy streaming chats through the gateway; ``fault()`` once both decode workers stream."""
    async with httpx.AsyncClient(timeout=300) as client:
        tasks = [asyncio.create_task(stream_chat(client, site.url, long_prompt(i, 12), max_tokens=MAX_TOKENS,
                                                 ignore_eos=True)) for i in range(STREAMS)]
        await asyncio.to_thread(fault)
        return await asyncio.wait_for(asyncio.gather(*tasks), 240)


@pytest.fixture(scope="module")
def uncut(site: Site) -> list[str]:
    """The texts of the load without a fault (greedy, on the row-invariant path: the same wherever it runs)."""
    results = asyncio.run(load(site, lambda: None))
    assert all(r["status"] == 200 and r["finish"] == "length" for r in results), results
    return [r["text"] for r in results]


def under_way(site: Site, host: str) -> None:
    """Until the work the fault on ``host`` hits is under way: prefill jobs on A; else streams on both decode
    workers, a second into their tokens (so that the fault falls mid-stream, not before the first token)."""
    busy = ("prefill-a",) if host == "a" else ("decode-b", "decode-c")
    site.wait_until(f"{', '.join(busy)} busy", lambda c: all(
        any(w["worker_id"] == b and w["running"] for w in c["workers"]) for b in busy), 90)
    if host != "a":
        time.sleep(1.0)


def child(site: Site, host: str, name: str) -> Any:
    return next(c for c in reversed(site.hosts.children[host]) if c.name == name)


def stamped(site: Site, name: str, since: float) -> list[tuple[float, str]]:
    """``(wall time, line)`` of process ``name``'s log lines from ``since`` on."""
    out = []
    for line in (site.hosts.log_dir / f"{name}.log").read_text(errors="replace").splitlines():
        m = STAMP.search(line)
        if m:
            t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
            if t >= since - 0.001:
                out.append((t, line))
    return out


def member_of(site: Site, name: str, first: str, before: float) -> str:
    """The member process ``name`` was connected to at ``before``: where it last reconnected, else ``first``."""
    ips = {site.hosts.ip(m): m for m in MEMBERS}
    last = first
    for t, line in stamped(site, name, 0.0):
        m = re.search(r"reconnected to nats://([\d.]+):", line)
        if m and t < before:
            last = ips[m.group(1)]
    return last.upper()


@dataclass
class Figures:
    case: str
    gateway_on: str
    detect_s: float
    recover_s: float
    max_gap_s: float

    def __str__(self) -> str:
        return (f"{self.case} (gateway on {self.gateway_on}'s member): noticed after {self.detect_s:.1f}s, recovered "
                f"after {self.recover_s:.1f}s, longest gap a client saw {self.max_gap_s:.1f}s")


def figures(site: Site, case: str, t0: float, until: float, watch: list[str],
            results: list[dict[str, Any]]) -> Figures:
    """When the ``watch`` processes first noticed the fault at ``t0`` (wall clock), when the last of them had
    recovered (before ``until``), and the longest gap between two chunks of any stream."""
    gateway_on = member_of(site, "gateway-d", "c", t0)
    lines = [(t, line) for name in watch for t, line in stamped(site, name, t0) if t < until]
    noticed = [t for t, line in lines if NOTICED.search(line)]
    recovered = [t for t, line in lines if RECOVERED.search(line)]
    assert noticed and recovered, f"{case}: nothing in the logs of {watch} since the fault:\n" + "\n".join(
        line for _, line in lines[-40:])
    return Figures(case, gateway_on, min(noticed) - t0, max(recovered) - t0, max(r["max_gap"] for r in results))


def whole(site: Site, uncut: list[str], results: list[dict[str, Any]]) -> None:
    assert_clear(results)
    assert all(r["status"] == 200 and r["finish"] == "length" for r in results), results
    assert [r["text"] for r in results] == uncut  # no gap, no duplicate, nothing re-decided


def back_to_normal(site: Site) -> None:
    site.streams_settled()
    site.heard({"prefill-a", "decode-b", "decode-c"}, timeout=120)
    site.idle({"prefill-a", "decode-b", "decode-c"})


REPORT: list[Figures] = []


@pytest.mark.parametrize("member", MEMBERS)
def test_a_member_killed_under_load(site: Site, uncut: list[str], member: str) -> None:
    """SIGKILL to one member under load (A's while its prefill worker has jobs, the others' while both decode
    workers stream); its clients fail over, nothing is lost."""
    on_it = {"a": ["prefill-a"], "b": ["decode-b"], "c": ["gateway-d", "decode-c"]}[member]
    if member == "c":  # the gateway lists C first, but an earlier case may have moved it: put it back
        for old in [c for c in site.hosts.children["d"] if c.running]:
            old.terminate()
            old.wait(30)
        site.dep.gateway("d", env=urls_from(site.hosts, "c"))
        site.heard({"prefill-a", "decode-b", "decode-c"})
    t0: list[float] = []

    def kill() -> None:
        under_way(site, member)
        t0.append(time.time())
        child(site, member, f"nats-{member}").kill()

    results = asyncio.run(load(site, kill))
    done = time.time()
    whole(site, uncut, results)
    if member == "a":  # KV writes of prefill-a's jobs went on through NIXL while its NATS client failed over
        transfers = [t for t in site.cluster()["transfers"] if t["at"] >= t0[0] and t["from"] == "prefill-a"]
        assert transfers and all(t["engine"] == "nixl" for t in transfers), transfers
        assert len({t["request_id"] for t in transfers}) == len(transfers), transfers  # no job done twice
    REPORT.append(fig := figures(site, f"member {member.upper()} killed", t0[0], done, on_it, results))
    print(f"\n{fig}")
    assert fig.recover_s < 5.0, fig  # the client is on another member within seconds
    site.dep.nats(member)
    back_to_normal(site)


@pytest.mark.parametrize("host", ["a", "b", "c", "d"])
def test_a_machine_cut_off_for_ten_seconds(site: Site, uncut: list[str], host: str) -> None:
    """One machine's link down for 10 s under load, then back: every stream ends with the uncut text (on the
    other decode worker when its own was cut off, through another member when the gateway's was)."""
    watch = {"a": ["decode-b", "decode-c"], "b": ["gateway-d"], "c": ["gateway-d"], "d": ["gateway-d"]}[host]
    t0: list[float] = []

    def cut() -> None:
        under_way(site, host)
        t0.append(time.time())
        site.hosts.cut(host)
        time.sleep(CUT_S)
        site.hosts.heal(host)

    results = asyncio.run(load(site, cut))
    done = time.time()
    whole(site, uncut, results)
    REPORT.append(fig := figures(site, f"machine {host.upper()} cut off for {CUT_S:g}s", t0[0], done, watch,
                                 results))
    print(f"\n{fig}")
    back_to_normal(site)


def test_report(site: Site) -> None:
    """The figures of the cases above, as docs/operations.md shows them."""
    print("\n| fault | the gateway's member | noticed | recovered | longest gap a client saw |\n|---|---|---:|---:|---:|")
    for f in REPORT:
        print(f"| {f.case} | {f.gateway_on} | {f.detect_s:.1f} s | {f.recover_s:.1f} s | {f.max_gap_s:.1f} s |")
    Path(site.hosts.log_dir / "figures.md").write_text("\n".join(str(f) for f in REPORT) + "\n")
