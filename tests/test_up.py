"""tandem/up.py: child-process supervision helpers, and `tandem up` reporting a child that dies.

The full cluster (`tandem up` serving real requests) is tested in tests/test_gateway_cluster.py.
"""

from __future__ import annotations

import argparse
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

import tandem.up
from tandem.up import Child, UpError, describe_exit, pick_ports, port_free, stop_children

pytestmark = pytest.mark.timeout(120)


def test_describe_exit() -> None:
    assert describe_exit(None) == "still running"
    assert describe_exit(0) == "exit code 0"
    assert describe_exit(2) == "exit code 2"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"


def test_pick_ports_skips_busy_and_taken() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        assert not port_free(busy)
        ports = pick_ports(busy, 2, {busy + 1})
        assert busy not in ports and busy + 1 not in ports and len(set(ports)) == 2
        assert all(p > busy for p in ports)
    anyp = pick_ports(0, 3, set())
    assert len(set(anyp)) == 3


def test_gateway_port_default_moves_aside_an_explicit_one_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        monkeypatch.setattr(tandem.up, "DEFAULT_PORT", busy)
        warnings: list[str] = []
        port = tandem.up._gateway_port(argparse.Namespace(port=None, host="127.0.0.1"), warnings.append)
        assert port != busy and port_free(port)
        assert warnings == [f"tandem up: port {busy} is busy; the gateway takes port {port} instead"]
        with pytest.raises(UpError, match=f"port {busy} is busy; pass --port 0"):
            tandem.up._gateway_port(argparse.Namespace(port=busy, host="127.0.0.1"), warnings.append)
    assert tandem.up._gateway_port(argparse.Namespace(port=None, host="127.0.0.1"), warnings.append) == busy


def test_stop_children_terminates_then_kills() -> None:
    polite = Child("polite", [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"], "x")
    stubborn = Child("stubborn", [sys.executable, "-c",
                                  "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                  "print('up', flush=True); time.sleep(60)"], "x")
    for c in (polite, stubborn):
        c.start()
    deadline = time.monotonic() + 20
    while not (polite.tail and stubborn.tail):
        assert time.monotonic() < deadline, "children never started"
        time.sleep(0.02)
    said: list[str] = []
    t0 = time.monotonic()
    stop_children([polite, stubborn], timeout=1.0, log=said.append)
    assert time.monotonic() - t0 < 15  # SIGKILL after the 1 s timeout, not the children's 60 s sleep
    assert polite.poll() == -signal.SIGTERM and stubborn.poll() == -signal.SIGKILL
    assert said == [f"stubborn (pid {stubborn.pid}) did not stop within 1s of SIGTERM; killing it"]
    assert polite.last_lines() == "up"


def test_up_reports_the_child_that_died(tmp_path) -> None:
    """A worker that cannot start (bad model) stops the whole cluster; up names it and its error."""
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "up", "--model", str(tmp_path / "missing.gguf"), "--port", "0",
         "--nats-port", "0", "--metrics-port-base", "0", "--quiet", "--stop-timeout", "5",
         "--ready-file", str(tmp_path / "ready.json")],
        capture_output=True, text=True, timeout=90,
    )
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "exit code 2; stopping everything" in p.stderr
    assert "neither a known alias" in p.stderr  # the child's own last words are shown
    assert not (tmp_path / "ready.json").exists()
    assert time.monotonic() - t0 < 60


def test_ctrl_c_while_waiting_for_nats_stops_at_once() -> None:
    """`tandem up` joining a NATS that is not there heeds Ctrl-C at once, and starts no worker."""
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "up", "--nats-url", "nats://127.0.0.1:1",
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)  # its first line: signal handlers are set
        assert ready, "tandem up said nothing within 60 s"
        first = proc.stdout.readline()
        assert "joining NATS at nats://127.0.0.1:1" in first, first
        time.sleep(1)
        assert proc.poll() is None  # still trying to reach NATS (its deadline is 15 s)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=30)
        out = first + rest
        assert time.monotonic() - t0 < 5, (out, err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, (out, err)
    assert "SIGINT during start-up" in out
    assert "tandem serve" not in err and "ready" not in out
