"""Emulated machines on this one, for tests and benchmarks that must cross a network.

Each host is a network namespace with its own hostname (a UTS namespace) and its own ``/dev/shm``
(a mount namespace with a tmpfs), so tandem's workers on two hosts see two machines: different
host ids, no shared memory between them, KV over TCP or NIXL (UCX over TCP) only. The hosts share
one switch, ``bench/wire.c``: a user-space learning switch over TAP devices that can hold every
frame for a fixed time, to add round-trip time, and lose a share of them (this machine's kernel has no
``tc netem``). Per
host, a link can be cut and healed (its interface down and up) and rate-limited (``tc tbf``).

Addresses come from a private ``/24`` in ``10.0.0.0/8`` that no route on this machine uses; the
harness owns it and nothing else. Everything it starts it stops, also on failure: use it as a
context manager. It needs root (network namespaces, TAP devices) and a C compiler.

    with Hosts(["a", "b", "c"], log_dir) as hosts:
        srv = hosts.spawn("a", "nats-a", [..."nats-server"...], env)
        hosts.cut("a"); hosts.heal("a")
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from runtime.processes import ChildProcess

WIRE_SOURCE = Path(__file__).resolve().parent / "wire.c"
#: the hosts' MTU: large frames keep the switch's per-frame copy cheap for bulk transfers
MTU = 65000


class HostsUnavailable(RuntimeError):
    """Emulated hosts cannot be made here (not root, no namespaces, no TAP device, no compiler)."""


def _run(*cmd: str) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise HostsUnavailable(f"{' '.join(cmd)}: {res.stderr.strip() or res.stdout.strip()}")
    return res.stdout


def why_unavailable() -> str | None:
    """Why :class:`Hosts` cannot work on this machine, or None."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces and TAP devices)"
    for tool in ("ip", "unshare", "nsenter", "tc"):
        if shutil.which(tool) is None:
            return f"emulated hosts need {tool} (Debian: iproute2 / util-linux)"
    if not Path("/dev/net/tun").exists():
        return "emulated hosts need /dev/net/tun (TAP devices)"
    if shutil.which(os.environ.get("CC", "cc")) is None:
        return "emulated hosts need a C compiler for bench/wire.c"
    probe = f"tndprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
    except HostsUnavailable as e:
        return f"cannot make a network namespace: {e}"
    _run("ip", "netns", "del", probe)
    return None


def wire_binary(cache: Path) -> Path:
    """``bench/wire.c`` compiled once per source (into ``cache``)."""
    digest = hashlib.sha256(WIRE_SOURCE.read_bytes()).hexdigest()[:12]
    out = cache / f"wire-{digest}"
    if not out.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        _run(os.environ.get("CC", "cc"), "-O2", "-o", str(tmp), str(WIRE_SOURCE))
        os.replace(tmp, out)
    return out


def free_subnet() -> ipaddress.IPv4Network:
    """A ``10.x.y.0/24`` that no address or route of this machine overlaps."""
    used = [ipaddress.ip_network(word, strict=False)
            for line in _run("ip", "-4", "-o", "route", "show", "table", "all").splitlines()
            for word in line.split()[:1] if word[0].isdigit()]
    used += [ipaddress.ip_interface(w).network for line in _run("ip", "-4", "-o", "addr").splitlines()
             for w in line.split() if "/" in w and w[0].isdigit()]
    rng = random.Random()
    for _ in range(1000):
        net = ipaddress.ip_network(f"10.{rng.randrange(64, 250)}.{rng.randrange(0, 256)}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise HostsUnavailable("no free 10.x.y.0/24 on this machine")


class Hosts:
    """Named emulated hosts on one switch; ``delay_ms`` is added to every frame (RTT + 2 × delay) and
    ``loss_pct`` of the frames are lost."""

    def __init__(self, names: Sequence[str], log_dir: Path, delay_ms: float = 0.0, loss_pct: float = 0.0,
                 cache: Path | None = None) -> None:
        """``names``: the hosts (up to 15). This machine itself joins the switch too, at the subnet's ``.254``
        (:attr:`here`), so a test reaches every host directly."""
        if len(names) > 15 or len(set(names)) != len(names):
            raise ValueError("up to 15 hosts with distinct names")
        self.names = list(names)
        self.log_dir = log_dir
        self.delay_ms = delay_ms
        if not 0.0 <= loss_pct < 100.0:
            raise ValueError(f"loss_pct must be in [0, 100), got {loss_pct}")
        self.loss_pct = loss_pct
        self.cache = cache or Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem")) / "wire"
        self.tag = f"t{os.getpid() % 100000:05d}"  # device and namespace names: at most 15 characters
        self.subnet: ipaddress.IPv4Network | None = None
        self.wire: ChildProcess | None = None
        self.holders: dict[str, ChildProcess] = {}
        self.holder_pid: dict[str, int] = {}
        self.children: dict[str, list[ChildProcess]] = {n: [] for n in self.names}
        self._made: list[str] = []

    # ---- names ---------------------------------------------------------------------------
    def netns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def device(self, host: str) -> str:
        """The host's network interface (its name inside the host: ``UCX_NET_DEVICES``)."""
        return f"{self.tag}{host}"[:15]

    def ip(self, host: str) -> str:
        assert self.subnet is not None, "not started"
        return str(self.subnet.network_address + 1 + self.names.index(host))

    def hostname(self, host: str) -> str:
        return f"host-{host}"

    @property
    def here(self) -> str:
        """This machine's own address on the switch."""
        assert self.subnet is not None, "not started"
        return str(self.subnet.network_address + 254)

    @property
    def here_device(self) -> str:
        return f"{self.tag}0"

    # ---- life cycle ----------------------------------------------------------------------
    def start(self) -> Hosts:
        why = why_unavailable()
        if why:
            raise HostsUnavailable(why)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        binary = wire_binary(self.cache)
        self.subnet = free_subnet()
        try:
            self.wire = ChildProcess("wire", [str(binary), "-l", str(round(self.loss_pct * 10_000)),
                                              str(int(self.delay_ms * 1000)), self.here_device,
                                              *(self.device(h) for h in self.names)],
                                     log_path=self.log_dir / "wire.log", ready_marker="ready")
            self.wire.start().wait_ready(10)
            _run("ip", "link", "set", self.here_device, "mtu", str(MTU), "up")
            _run("ip", "addr", "add", f"{self.here}/{self.subnet.prefixlen}", "dev", self.here_device)
            for host in self.names:
                self._make_host(host)
        except BaseException:
            self.close()
            raise
        return self

    def _make_host(self, host: str) -> None:
        ns, dev = self.netns(host), self.device(host)
        _run("ip", "netns", "add", ns)
        self._made.append(ns)
        _run("ip", "link", "set", dev, "netns", ns)
        _run("ip", "-n", ns, "link", "set", dev, "mtu", str(MTU), "up")
        _run("ip", "-n", ns, "addr", "add", f"{self.ip(host)}/{self.subnet.prefixlen}", "dev", dev)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        # the host's own hostname and /dev/shm live in a process that holds those namespaces open
        script = (f"hostname {self.hostname(host)} && mount -t tmpfs -o size=4g,mode=1777 shm /dev/shm "
                  "&& echo holder $$ && exec sleep infinity")
        holder = ChildProcess(f"host-{host}", ["ip", "netns", "exec", ns, "unshare", "--uts", "--mount",
                                               "--propagation", "private", "--fork", "sh", "-c", script],
                              log_path=self.log_dir / f"host-{host}.log", ready_marker="holder ")
        holder.start().wait_ready(10)
        pid = next(int(line.split()[1]) for line in holder.tail if line.startswith("holder "))
        self.holders[host], self.holder_pid[host] = holder, pid

    def close(self) -> None:
        """Stop everything this harness started and remove its namespaces (idempotent)."""
        for host in self.names:
            for child in self.children.get(host, []):
                child.kill()
            self.children[host] = []
        for holder in self.holders.values():
            holder.kill()
        self.holders.clear()
        for ns in self._made:
            with contextlib.suppress(HostsUnavailable):
                _run("ip", "netns", "del", ns)
        self._made.clear()
        if self.wire is not None:
            self.wire.terminate()
            self.wire.wait(5)
            self.wire.kill()
            self.wire = None

    def __enter__(self) -> Hosts:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ---- processes -----------------------------------------------------------------------
    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``host`` (its network, hostname and /dev/shm)."""
        return ["nsenter", "-t", str(self.holder_pid[host]), "-u", "-m", "-n", "--", *argv]

    def spawn(self, host: str, name: str, argv: Sequence[str], env: dict[str, str] | None = None,
              ready_marker: str | None = None) -> ChildProcess:
        """Start ``argv`` on ``host`` (a :class:`ChildProcess` logging to ``<log_dir>/<name>.log``)."""
        child = ChildProcess(name, self.command(host, argv), env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                             log_path=self.log_dir / f"{name}.log", ready_marker=ready_marker, tail_lines=2000)
        child.start()
        self.children[host].append(child)
        return child

    def tandem(self, host: str, name: str, *args: str, env: dict[str, str] | None = None,
               ready_marker: str | None = None) -> ChildProcess:
        """``tandem ARGS`` on ``host``."""
        return self.spawn(host, name, [sys.executable, "-m", "tandem.cli", *args], env, ready_marker)

    def kill_host(self, host: str) -> None:
        """The machine dies: SIGKILL every process started on it (its network stays, silent)."""
        for child in self.children[host]:
            if child.running:
                child.signal(signal.SIGKILL)
        for child in self.children[host]:
            child.wait(10)

    def shell(self, host: str, command: str, cwd: Path, env: dict[str, str] | None = None,
              timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run a shell command line on ``host`` to its end (the hosts' addresses in ``$A``, ``$B``, ...)."""
        # entering the host's mount namespace resets the working directory: change to it in there
        return subprocess.run(self.command(host, ["sh", "-c", f"cd {shlex.quote(str(cwd))} && {command}"]),
                              capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.addresses(), **(env or {})})

    def addresses(self) -> dict[str, str]:
        """``{"A": "10.x.y.1", ...}``: each host's address under its upper-cased name, as a walk-through uses."""
        return {h.upper(): self.ip(h) for h in self.names}

    # ---- the network ---------------------------------------------------------------------
    def cut(self, host: str) -> None:
        """Unplug ``host``: its interface goes down (its processes live on, unreachable)."""
        _run("ip", "-n", self.netns(host), "link", "set", self.device(host), "down")

    def heal(self, host: str) -> None:
        """Plug it back in."""
        _run("ip", "-n", self.netns(host), "link", "set", self.device(host), "up")

    def limit(self, host: str, rate: str | None) -> None:
        """Cap ``host``'s sending rate (``tc tbf``, e.g. ``"1gbit"``); None removes the cap."""
        ns, dev = self.netns(host), self.device(host)
        with contextlib.suppress(HostsUnavailable):
            _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root")
        if rate:
            _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb",
                 "latency", "50ms")

    def wait_reachable(self, host: str, port: int, timeout: float = 30.0) -> None:
        """Until something on ``host`` accepts TCP connections on ``port`` (from the host itself)."""
        deadline = time.monotonic() + timeout
        probe = f"import socket; socket.create_connection(('{self.ip(host)}', {port}), timeout=1).close()"
        while subprocess.run(self.command(host, [sys.executable, "-c", probe]), capture_output=True).returncode:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {self.ip(host)}:{port} after {timeout:g}s")
            time.sleep(0.2)


#: lines of a walk-through that start a server (they keep running; the next waits for their ready line)
SERVER_READY = {" nats --cluster ": "nats-server ready at", " serve ": " ready", " gateway --": "tandem gateway ready"}


def walkthrough(doc: str, marker: str) -> list[tuple[str, str]]:
    """The ``(host, command line)`` steps of the console block after ``<!-- marker -->`` in ``doc``: its lines
    ``X$ command`` run ``command`` on host ``x``; comment lines are for the reader."""
    block = doc.split(f"<!-- {marker} -->", 1)[1].split("```console", 1)[1].split("```", 1)[0]
    steps = []
    for line in block.strip().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        host, sep, command = line.partition("$ ")
        if not sep or not host.isalpha():
            raise ValueError(f"walk-through line is not 'HOST$ command': {line!r}")
        steps.append((host.lower(), command))
    return steps


def run_walkthrough(hosts: Hosts, steps: list[tuple[str, str]], cwd: Path, env: dict[str, str] | None = None,
                    ready_timeout: float = 300.0) -> dict[int, subprocess.CompletedProcess[str]]:
    """Run each step on its host, in order: a server in the background (until its ready line), anything
    else to its end; returns the finished steps' results by index (a failing one raises)."""
    done: dict[int, subprocess.CompletedProcess[str]] = {}
    for i, (host, command) in enumerate(steps):
        ready = next((mark for key, mark in SERVER_READY.items() if key in f" {command} "), None)
        if ready is not None:
            child = hosts.spawn(host, f"step{i}-{host}", ["sh", "-c", f"cd {shlex.quote(str(cwd))} && exec {command}"],
                                env={**hosts.addresses(), **(env or {})}, ready_marker=ready)
            child.wait_ready(ready_timeout)
            continue
        res = hosts.shell(host, command, cwd, env)
        if res.returncode != 0:
            raise RuntimeError(f"step {i} on {host} failed ({res.returncode}): {command}\n{res.stdout}\n{res.stderr}")
        done[i] = res
    return done


class Deployment:
    """tandem on emulated hosts, started with the commands of docs/operations.md's three machines: NATS members
    with ``tandem nats --cluster``, workers and gateways logged in with ``--nats-user`` from one env file."""

    def __init__(self, hosts: Hosts, folder: Path, members: Sequence[str], env: dict[str, str] | None = None) -> None:
        from bus.nats_command import make_passwords

        self.hosts, self.folder, self.members = hosts, folder, list(members)
        self.env = dict(env or {})
        self.urls = ",".join(f"nats://{hosts.ip(m)}:4222" for m in self.members)
        self.env_file = folder / "tandem.env"
        self.env_file.write_text(make_passwords() + f"TANDEM_NATS_URL={self.urls}\nTANDEM_STREAM_REPLICAS="
                                 f"{min(3, len(self.members))}\n")

    def tandem(self, host: str, name: str, user: str | None, *args: str, ready: str,
               env: dict[str, str] | None = None, timeout: float = 300.0) -> ChildProcess:
        login = ["--nats-user", user] if user else []
        child = self.hosts.tandem(host, name, "--env-file", str(self.env_file), *login, *args,
                                  env={**self.env, **(env or {})}, ready_marker=ready)
        child.wait_ready(timeout)
        return child

    def nats(self, host: str) -> ChildProcess:
        routes = ",".join(f"nats-route://{self.hosts.ip(m)}:6222" for m in self.members)
        return self.tandem(host, f"nats-{host}", None, "nats", "--cluster", routes, "--store-dir",
                           str(self.folder / f"nats-{host}"), ready="nats-server ready at")

    def serve(self, host: str, worker_id: str, role: str, *args: str, env: dict[str, str] | None = None) -> ChildProcess:
        user = {"prefill_only": "prefill", "decode_only": "decode", "prefill_and_decode": "aggregate"}[role]
        return self.tandem(host, worker_id, user, "serve", "--pipeline-role", role, "--worker-id", worker_id,
                           "--kv-transfer", "tcp", "--kv-tcp-host", "0.0.0.0", "--advertise-host", self.hosts.ip(host),
                           "--metrics-port", "9100", *args, ready=f" {worker_id} ready", env=env)

    def gateway(self, host: str, *args: str, env: dict[str, str] | None = None) -> ChildProcess:
        return self.tandem(host, f"gateway-{host}", "gateway", "gateway", "--host", "0.0.0.0", "--port", "8000",
                           *args, ready="tandem gateway ready", env=env)

    def login(self, user: str) -> dict[str, str]:
        """The variables a process of this deployment needs to log in as ``user``."""
        from bus.options import user_login
        from runtime.settings import read_env_file

        return {**user_login(user, read_env_file(self.env_file)), "TANDEM_NATS_URL": self.urls}
