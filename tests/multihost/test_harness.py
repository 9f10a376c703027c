"""The emulated machines themselves (bench/hosts.py): each a machine of its own, on a network that can be
slowed, made lossy, cut and healed, and nothing of them left behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.hosts import Hosts
from tests.harness.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: a UDP echo server on the receiving host: answers every datagram, counts them, prints "listening"
ECHO = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 9999))
print("listening", flush=True)
while True:
    data, peer = s.recvfrom(2048)
    s.sendto(data, peer)
"""

#: sends N datagrams one at a time, each waiting up to 0.2 s for its echo; prints answered and median RTT (ms)
PROBE = """
import socket, statistics, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(0.2)
rtts = []
for i in range(int(sys.argv[2])):
    t0 = time.perf_counter()
    s.sendto(str(i).encode(), (sys.argv[1], 9999))
    try:
        while s.recv(2048) != str(i).encode():
            pass
        rtts.append((time.perf_counter() - t0) * 1000)
    except TimeoutError:
        pass
print(len(rtts), statistics.median(rtts) if rtts else -1)
"""


def probe(hosts: Hosts, src: str, dst: str, n: int) -> tuple[int, float]:
    """(echoes answered, median RTT in ms) of ``n`` datagrams from ``src`` to ``dst``'s echo server."""
    res = subprocess.run(hosts.command(src, [sys.executable, "-c", PROBE, hosts.ip(dst), str(n)]),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    answered, rtt = res.stdout.split()
    return int(answered), float(rtt)


def echo_on(hosts: Hosts, host: str) -> None:
    hosts.spawn(host, f"echo-{host}", [sys.executable, "-c", ECHO, hosts.ip(host)],
                ready_marker="listening").wait_ready(30)


def run_on(hosts: Hosts, host: str, command: str) -> str:
    res = subprocess.run(hosts.command(host, ["sh", "-c", command]), capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_hosts_are_machines_of_their_own_and_leave_nothing(tmp_path: Path) -> None:
    with Hosts(["a", "b"], tmp_path / "logs") as hosts:
        namespaces = {hosts.netns("a"), hosts.netns("b")}
        assert namespaces <= set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
        assert run_on(hosts, "a", "hostname") == "host-a" and run_on(hosts, "b", "hostname") == "host-b"
        run_on(hosts, "a", "echo a > /dev/shm/tandem-harness-probe")
        assert run_on(hosts, "a", "cat /dev/shm/tandem-harness-probe") == "a"
        assert not Path("/dev/shm/tandem-harness-probe").exists()  # not this machine's /dev/shm
        assert run_on(hosts, "b", "ls /dev/shm") == ""  # nor the other host's
        ip_a = run_on(hosts, "a", "ip -4 -o addr show")
        assert hosts.ip("a") in ip_a and hosts.ip("b") not in ip_a
        wire = hosts.wire
        sleeper = hosts.spawn("b", "sleeper", ["sleep", "600"])
    assert not sleeper.running and wire is not None and not wire.running
    assert not namespaces & set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


def test_a_link_gains_its_delay_and_can_be_cut_and_healed(tmp_path: Path) -> None:
    with Hosts(["a", "b"], tmp_path / "fast") as hosts:
        echo_on(hosts, "b")
        answered, base_rtt = probe(hosts, "a", "b", 50)
        assert answered == 50
    with Hosts(["a", "b"], tmp_path / "slow", delay_ms=1.5) as hosts:
        echo_on(hosts, "b")
        answered, rtt = probe(hosts, "a", "b", 50)
        assert answered == 50
        assert rtt >= 3.0 > base_rtt, (base_rtt, rtt)  # a round trip crosses the switch twice
        print(f"\nUDP round trip a -> b: {base_rtt:.3f} ms, with 1.5 ms delay per crossing {rtt:.3f} ms")
        hosts.cut("b")
        assert probe(hosts, "a", "b", 5)[0] == 0
        hosts.heal("b")
        wait_until(lambda: probe(hosts, "a", "b", 3)[0] >= 3, 10, "b reachable again after heal", interval=0)


def test_a_lossy_switch_loses_about_its_share(tmp_path: Path) -> None:
    with Hosts(["a", "b"], tmp_path / "logs", loss_pct=20.0) as hosts:
        echo_on(hosts, "b")
        n = 400
        answered, _ = probe(hosts, "a", "b", n)
        # each echo crosses the switch twice: about 0.8 * 0.8 = 64 % come back
        assert 0.45 * n < answered < 0.85 * n, answered
        wire = hosts.wire
    assert wire is not None and "lost" in wire.last_lines(5)


def test_a_loss_share_out_of_range_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="loss_pct"):
        Hosts(["a"], tmp_path, loss_pct=100.0)
