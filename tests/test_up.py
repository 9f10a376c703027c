"""runtime/processes.py (children), runtime/supervisor.py (supervision) and tandem/up/ (ports, giving up on a
child that cannot start).

The full cluster (`tandem up` serving real requests) is tested in tests/test_gateway_cluster.py; a
worker restarted after SIGKILL in tests/test_gateway_aggregated.py; the fault suite in tests/faults/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

import tandem.up.plan
import tandem.up.ports
from runtime.processes import ChildError, ChildProcess, describe_exit, stop_all
from runtime.supervisor import GiveUp, RestartPolicy, Supervisor
from tandem.up import UpError
from tandem.up.cluster import Cluster, Member
from tandem.up.ports import DEFAULT_METRICS_BASE, free_ports, metrics_ports, port_free
from tests.harness.wait import wait_until

pytestmark = pytest.mark.timeout(120)


def test_describe_exit() -> None:
    assert describe_exit(None) == "still running"
    assert describe_exit(0) == "exit code 0"
    assert describe_exit(2) == "exit code 2"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A port something listens on, for as long as the block runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_free_ports_are_distinct_free_and_avoid_the_taken() -> None:
    with held_port() as busy:
        assert not port_free(busy)
        ports = free_ports(3, {busy})
        assert busy not in ports and len(set(ports)) == 3 and all(port_free(p) for p in ports)


def test_gateway_port_default_moves_aside_an_explicit_one_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    with held_port() as busy:
        monkeypatch.setattr(tandem.up.ports, "DEFAULT_PORT", busy)
        warnings: list[str] = []
        port = tandem.up.ports.gateway_port(argparse.Namespace(port=None, host="127.0.0.1"), warnings.append)
        assert port != busy and port_free(port)
        assert warnings == [f"tandem up: port {busy} is busy; the gateway takes port {port} instead"]
        with pytest.raises(UpError, match=f"port {busy} is busy; pass --port 0"):
            tandem.up.ports.gateway_port(argparse.Namespace(port=busy, host="127.0.0.1"), warnings.append)
    assert tandem.up.ports.gateway_port(argparse.Namespace(port=None, host="127.0.0.1"), warnings.append) == busy


def test_metrics_ports_default_moves_aside_an_explicit_one_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    with held_port() as busy:
        monkeypatch.setattr(tandem.up.ports, "DEFAULT_METRICS_BASE", busy)
        warnings: list[str] = []
        ports = metrics_ports(None, 1, {8000}, "127.0.0.1", warnings.append)
        assert ports[0] != busy and port_free(ports[0])
        assert warnings == [f"tandem up: metrics port {busy} is busy; the workers take {ports[0]} instead"]
        with pytest.raises(UpError, match=f"metrics port {busy} .* is busy; pass --metrics-port-base 0"):
            metrics_ports(busy, 1, set(), "127.0.0.1", warnings.append)
        assert len(set(metrics_ports(0, 3, {busy}, "127.0.0.1", warnings.append)) - {busy}) == 3
    warnings.clear()
    assert metrics_ports(None, 1, set(), "127.0.0.1", warnings.append) == [busy] and not warnings


def test_a_worker_whose_metrics_port_was_taken_serves_on_another_and_says_where() -> None:
    """The race `tandem up` cannot see: a port free when planned and taken when the worker binds it. With
    --metrics-port-fallback the worker takes a free port, says so in a line, and tandem up's member follows."""
    import httpx

    from runtime.health import WorkerHealth, metrics_at_line, serve_worker_http

    with held_port() as busy:
        with pytest.raises(OSError):
            serve_worker_http(busy, "127.0.0.1", WorkerHealth())
        server = serve_worker_http(busy, "127.0.0.1", WorkerHealth(), any_port_if_busy=True)
        try:
            got = server.server_address[1]
            assert got != busy and "# TYPE" in httpx.get(f"http://127.0.0.1:{got}/metrics", timeout=10).text
        finally:
            server.shutdown()
            server.server_close()
    member = Member(ChildProcess("decode-1", ["true"]), "decode_only", busy)
    member.child.on_line("tandem decode_only decode-1 ready")
    assert member.metrics_port == busy
    member.child.on_line(metrics_at_line("decode-1", busy, got))
    assert member.metrics_port == got
    member.child.on_line(metrics_at_line("decode-1", busy, busy))  # restarted, and its own port was free again
    assert member.metrics_port == busy


@pytest.mark.timeout(300)
def test_up_with_the_default_metrics_port_taken_and_a_default_max_tokens(tmp_path) -> None:
    """A second `tandem up` on a host where the default metrics port is taken (here by a socket of the test)
    starts, says which port its worker took instead, and serves Prometheus text there; a chat request without
    max_tokens stops at --default-max-tokens with finish_reason "length" (the README's haiku ran 8,154 tokens)."""
    import httpx
    import openai

    held = socket.socket()
    try:
        held.bind(("127.0.0.1", DEFAULT_METRICS_BASE))
        held.listen()
    except OSError:
        pass  # busy already: just as good
    ready = tmp_path / "ready.json"
    up = ChildProcess("up", [sys.executable, "-m", "tandem.cli", "up", "--aggregated", "--port", "0", "--nats-port",
                             "0", "--default-max-tokens", "5", "--worker-args", "--num-blocks 64", "--quiet",
                             "--stop-timeout", "5", "--ready-file", str(ready)],
                      env={**os.environ, "OMP_NUM_THREADS": "1"}, log_path=tmp_path / "up.log", tail_lines=400)
    try:
        up.start()
        up.wait_for("A child that dies is restarted", 240)  # the banner's last line; the ready file comes next
        def ready_file() -> bool:
            assert up.running, up.last_lines(40)
            return ready.exists()

        wait_until(ready_file, 30, lambda: f"the ready file; last lines:\n{up.last_lines(40)}", interval=0.1)
        info = json.loads(ready.read_text())
        port = next(c["metrics_port"] for c in info["children"] if c["name"] == "worker-1")
        out = up.last_lines(400)
        assert port != DEFAULT_METRICS_BASE and port_free(DEFAULT_METRICS_BASE) is False
        assert f"tandem up: metrics port {DEFAULT_METRICS_BASE} is busy; the workers take {port} instead" in out, out
        assert re.search(rf"worker-1 +prefill_and_decode +pid \d+ +metrics :{port} ", out), out
        assert "defaults    max_tokens 5, temperature 0.2, top_p 0.9" in out, out
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert "# TYPE tandem_worker_running_sequences gauge" in r.text
        card = httpx.get(f"{info['url']}/v1/models", timeout=10).json()["data"][0]
        assert card["default_max_tokens"] == 5
        client = openai.OpenAI(base_url=info["base_url"], api_key="x", max_retries=0, timeout=120)
        answer = client.chat.completions.create(model=info["model"], temperature=0, messages=[
            {"role": "user", "content": "Write a haiku about the sea."}])
        assert (answer.choices[0].finish_reason, answer.usage.completion_tokens) == ("length", 5)
        answer = client.chat.completions.create(model=info["model"], temperature=0, max_tokens=7, messages=[
            {"role": "user", "content": "Write a haiku about the sea."}])  # a request's own max_tokens wins
        assert answer.usage.completion_tokens == 7
    finally:
        held.close()
        up.signal(signal.SIGINT)
        if up.wait(60) is None:
            up.kill()
    assert up.poll() == 0, up.last_lines(40)


def test_stop_all_terminates_then_kills() -> None:
    polite = ChildProcess("polite", [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                          ready_marker="up")
    stubborn = ChildProcess("stubborn", [sys.executable, "-c",
                                         "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                         "print('up', flush=True); time.sleep(60)"], ready_marker="up")
    for c in (polite, stubborn):
        c.start()
    for c in (polite, stubborn):
        c.wait_ready(20)
    said: list[str] = []
    t0 = time.monotonic()
    stop_all([polite, stubborn], timeout=1.0, log=said.append)
    assert time.monotonic() - t0 < 15  # SIGKILL after the 1 s timeout, not the children's 60 s sleep
    assert polite.poll() == -signal.SIGTERM and stubborn.poll() == -signal.SIGKILL
    assert said == [f"stubborn (pid {stubborn.pid}) did not stop within 1s of SIGTERM; killing it"]
    assert polite.last_lines() == "up"


def test_up_reports_the_child_that_died(tmp_path) -> None:
    """A worker that cannot start (a setting it refuses) stops the whole cluster; up names it and its error.
    (A bad model never gets this far: tandem up checks it once before starting anything, tests/test_startup.py.)"""
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "up", "--worker-args", "--num-blocks 0", "--port", "0",
         "--nats-port", "0", "--metrics-port-base", "0", "--quiet", "--stop-timeout", "5",
         "--ready-file", str(tmp_path / "ready.json")],
        capture_output=True, text=True, timeout=90,
    )
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "exit code 2 during start-up: it refused its configuration, so restarting cannot help; " \
           "stopping everything" in p.stderr, p.stderr
    assert "--num-blocks must be at least 1" in p.stderr  # the child's own last words are shown
    assert "restarting it in" not in p.stderr
    assert not (tmp_path / "ready.json").exists()
    assert time.monotonic() - t0 < 60


def test_ctrl_c_while_waiting_for_nats_stops_at_once() -> None:
    """`tandem up` joining a NATS that is not there heeds Ctrl-C at once, and starts no worker."""
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "up", "--nats-url", "nats://127.0.0.1:1",
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "tandem up said nothing within 60 s"
        first = ""
        while "joining NATS" not in first:  # the model's line, then this one: signal handlers are set
            line = proc.stdout.readline()  # (not select again: the next line may sit in the reader's buffer)
            assert line, first
            first += line
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


def test_child_wait_ready_says_why_it_died(tmp_path) -> None:
    log = tmp_path / "c.log"
    c = ChildProcess("crasher", [sys.executable, "-c", "import sys; print('loading'); sys.exit(3)"], log_path=log,
                     ready_marker="ready")
    c.start()
    with pytest.raises(ChildError, match=r"crasher exited before its ready line: crasher \(pid \d+\) exit code 3"):
        c.wait_ready(20)
    assert c.last_lines() == "loading" and log.read_text() == "loading\n"
    c.start()  # a child can be started again (what a supervisor does)
    assert c.wait(20) == 3


class FakeUnit:
    """A unit whose life the test scripts: ``exit(code)`` ends it, ``start()`` begins a new run."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pid: int | None = 100
        self.code: int | None = None
        self.is_ready = False
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        self.pid = 100 + self.starts
        self.code, self.is_ready = None, False

    def poll(self) -> int | None:
        return self.code

    def last_lines(self, n: int = 20) -> str:
        return f"last words of {self.name}"


def test_supervisor_restarts_with_backoff_and_gives_up_on_start_up_deaths() -> None:
    now = [0.0]
    said: list[str] = []
    sup = Supervisor(RestartPolicy(delay=1.0, max_delay=4.0, max_start_failures=3, stable_after=30.0),
                     said.append, clock=lambda: now[0])
    worker = FakeUnit("w")
    sup.add(worker)
    worker.is_ready = True
    sup.check()  # ready from here
    for k, delay in enumerate([1, 2, 4, 4], start=1):  # doubling, capped
        worker.code = -signal.SIGKILL
        now[0] += 1
        sup.check()
        assert said[-1] == f"w (pid {worker.pid}) killed by SIGKILL while serving; restarting it in {delay}s " \
                           f"(restart {k})"
        now[0] += delay - 0.01
        sup.check()
        assert worker.starts == k - 1  # not before its time
        now[0] += 0.02
        sup.check()
        assert worker.starts == k and said[-1] == f"w restarted (pid {worker.pid}, restart {k})"
        worker.is_ready = True
        sup.check()
    now[0] += 31  # it served 30 s: its backoff starts over
    sup.check()
    worker.code = 1
    sup.check()
    assert said[-1].endswith("restarting it in 1s (restart 5)") and sup.restarts("w") == 4
    # dying during start-up: three times in a row is the end
    for _ in range(2):
        now[0] += 60
        sup.check()
        worker.code = 1
        sup.check()
        assert "exit code 1 during start-up; restarting it" in said[-1]
    now[0] += 60
    sup.check()
    worker.code = 1
    with pytest.raises(GiveUp, match=r"w \(pid \d+\) exit code 1 during start-up, 3 times in a row") as e:
        sup.check()
    assert e.value.output == "last words of w"


def test_supervisor_says_when_it_is_due_and_counts_a_stable_run_it_never_checked() -> None:
    """``tandem up`` sleeps until ``next_due`` or an event, so no check may come between a worker's ready
    line and its death long after: it still ran stable, and its backoff starts over."""
    now = [0.0]
    said: list[str] = []
    sup = Supervisor(RestartPolicy(delay=1.0, max_delay=8.0, stable_after=30.0), said.append, clock=lambda: now[0])
    worker = FakeUnit("w")
    sup.add(worker)
    assert sup.next_due() is None
    worker.is_ready = True
    sup.check()
    worker.code = 1
    now[0] += 1
    sup.check()
    assert sup.next_due() == 2.0 and said[-1].endswith("restarting it in 1s (restart 1)")
    now[0] = 2.0
    sup.check()
    worker.is_ready = True
    sup.check()  # ready at 2.0; no other check until it dies at 100
    worker.code = 1
    now[0] = 100.0
    sup.check()
    assert said[-1].endswith("restarting it in 1s (restart 2)")  # not 2s: the failure count started over
    assert sup.next_due() == 101.0


def test_the_up_loop_wakes_on_a_child_exit_a_ready_line_and_a_signal() -> None:
    cluster = Cluster(sys.stdout, sys.stderr, drain_timeout=1.0, stop_timeout=1.0)
    previous = signal.signal(signal.SIGCHLD, cluster.on_child_exit)
    try:
        t0 = time.monotonic()
        assert not cluster.wakeup.wait(0.05)  # nothing happened: it sleeps the whole time
        assert time.monotonic() - t0 >= 0.05
        child = ChildProcess("c", [sys.executable, "-c", "import time; print('c up', flush=True); time.sleep(0.5)"],
                             ready_marker="c up")
        member = cluster.add(child, "prefill_only")
        assert member.wake is not None and cluster.members == [member]
        child.start()
        assert cluster.wakeup.wait(10.0) and child.is_ready  # the ready line
        t0 = time.monotonic()
        assert cluster.wakeup.wait(10.0)  # its exit (SIGCHLD), not the 10 s
        assert time.monotonic() - t0 < 5.0
        child.wait(5.0)
        assert child.poll() == 0
        cluster.on_signal(signal.SIGTERM, None)
        assert cluster.wakeup.wait(10.0) and cluster.stop_reason == "SIGTERM"
    finally:
        signal.signal(signal.SIGCHLD, previous)
        cluster.stop()
        cluster.wakeup.close()
    cluster.wakeup.poke()  # a reader thread's late line after the run ended is harmless


def test_supervisor_rules_for_clean_exits_bad_config_and_never() -> None:
    said: list[str] = []
    sup = Supervisor(RestartPolicy(), said.append)
    worker, gateway = FakeUnit("w"), FakeUnit("gateway")
    sup.add(worker)
    sup.add(gateway, essential=True)
    worker.is_ready = gateway.is_ready = True
    sup.check()
    worker.code = 0  # drained after someone else's SIGTERM: left stopped, the rest serves on
    sup.check()
    assert said == ["w (pid 100) exit code 0 while serving: it exited by itself; not restarting it"]
    sup.check()
    gateway.code = 0
    with pytest.raises(GiveUp, match="gateway .* nothing serves without it"):
        sup.check()
    bad = FakeUnit("b")
    sup = Supervisor(RestartPolicy(), said.append)
    sup.add(bad)
    bad.code = 2
    with pytest.raises(GiveUp, match="refused its configuration"):
        sup.check()
    never = FakeUnit("n")
    sup = Supervisor(RestartPolicy(mode="never"), said.append)
    sup.add(never)
    never.is_ready = True
    sup.check()
    never.code = -signal.SIGKILL
    with pytest.raises(GiveUp, match=r"n \(pid 100\) killed by SIGKILL while serving \(--restart never\)"):
        sup.check()
    with pytest.raises(ValueError, match="--restart must be on-failure or never"):
        RestartPolicy(mode="always")


def test_plan_binds_worker_metrics_to_the_gateway_host_and_passes_names_and_defaults() -> None:
    from tandem.cli import build_parser

    args = build_parser().parse_args(["up", "--host", "127.0.0.2", "--port", "0", "--served-model-name", "chat",
                                      "--served-model-name", "other", "--default-temperature", "0"])
    plan = tandem.up.plan.make_plan(args, True, lambda line: None)
    assert plan.serve_args[plan.serve_args.index("--metrics-host") + 1] == "127.0.0.2"
    gw = plan.gateway_args
    assert [gw[i + 1] for i, w in enumerate(gw) if w == "--served-model-name"] == ["chat", "other"]
    assert gw[gw.index("--default-temperature") + 1] == "0.0" and plan.served_name == "chat"


def test_a_run_gives_each_process_its_own_credential_and_the_tools_find_it(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tandem/local_run.py: a 0700 folder of 0600 seeds and the server config; run.json tells `tandem status`
    which URL and debug credential belong to a live run; a dead run's folder is cleared by the next."""
    import json
    import os

    from bus.subjects import Subjects
    from tandem import local_run

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    stale = tmp_path / "run" / "999999999"  # no such process
    stale.mkdir(parents=True)
    run = local_run.LocalRun.create(Subjects("m"), [("prefill-1", "prefill_only"), ("decode-1", "decode_only")],
                                    "gw-1")
    assert not stale.exists()
    assert run.folder == tmp_path / "run" / str(os.getpid())
    assert oct(run.folder.stat().st_mode & 0o777) == oct(0o700)
    assert sorted(p.name for p in run.folder.iterdir()) == ["debug.nk", "decode-1.nk", "gw-1.nk", "nats.conf",
                                                           "prefill-1.nk", "up.nk"]
    assert all(p.stat().st_mode & 0o077 == 0 for p in run.folder.iterdir())
    assert run.env("decode-1") == {"TANDEM_NATS_NKEY_SEED": str(run.folder / "decode-1.nk"),
                                   "TANDEM_NATS_INBOX_PREFIX": "_INBOX_decode-1"}
    conf = run.config.read_text()
    assert conf.count("nkey: ") == 5 and '"tandem.m.generate.decode-1"' in conf and "CREATE" not in conf
    assert local_run.debug_login(None) is None  # not announced yet
    run.announce("nats://127.0.0.1:4999", "tandem")
    login = local_run.debug_login("nats://localhost:4999")
    assert login == {"servers": "nats://127.0.0.1:4999", "nkey_seed": str(run.debug.seed_file),
                     "inbox_prefix": "_INBOX_debug"}
    assert local_run.debug_login(None) == login and local_run.debug_login("nats://127.0.0.1:4998") is None
    assert json.loads((run.folder / "run.json").read_text())["pid"] == os.getpid()
    assert run.watch_command("nats://127.0.0.1:4999", "tandem") == \
        f"nats sub 'tandem.>' -s nats://127.0.0.1:4999 --nkey {run.debug.seed_file}"
    with pytest.raises(ValueError, match="must differ"):
        local_run.LocalRun.create(Subjects("m"), [("debug", "decode_only")], "gw-1")
    run.remove()
    assert not run.folder.exists() and local_run.debug_login(None) is None


def test_gateway_id_comes_from_gateway_args_when_given() -> None:
    assert tandem.up.plan.flag_value(["--max-queue-wait", "3", "--gateway-id", "gw-a"], "--gateway-id") == "gw-a"
    assert tandem.up.plan.flag_value(["--gateway-id=gw-b"], "--gateway-id") == "gw-b"
    assert tandem.up.plan.flag_value(["--max-queue-wait", "3"], "--gateway-id") is None
