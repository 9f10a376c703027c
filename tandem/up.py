"""``tandem up``: a whole local cluster in one command.

It starts the embedded ``nats-server -js`` (unless ``--nats-url`` names one), creates the
work-queue streams, starts the workers (by default one ``prefill_only`` and one
``decode_only``; ``--aggregated`` runs ``prefill_and_decode`` workers instead) and the
gateway, each a ``tandem`` child process with its own metrics port, waits until the
gateway's ``/ready`` lists every worker (with a deadline), prints the URL and a curl line,
and then watches: Ctrl-C / SIGTERM, or any child dying (named, with its exit status and
last log lines), stops every child by PID — SIGTERM, then SIGKILL after a deadline.

Children are started in their own sessions (a terminal's Ctrl-C reaches only ``tandem up``,
which stops them in order: gateway, decode, prefill, NATS) and, on Linux, with a parent-death
signal, so killing ``tandem up`` itself leaves no orphans.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from runtime.placement import WorkerPlacement, available_cpus, format_cpus, plan_layout

DEFAULT_PORT = 8000
DEFAULT_NATS_PORT = 4222
DEFAULT_METRICS_BASE = 9400


class UpError(RuntimeError):
    """The cluster could not be started (the message says which part and why)."""


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``tandem up`` flags to ``p`` and make it run :func:`main`."""
    p.add_argument("--model", default=None, help="alias, .gguf file or HF directory (default: the built-in model)")
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None,
                   help=f"gateway HTTP port (default {DEFAULT_PORT}, or any free one when that is busy; 0 = any free)")
    p.add_argument("--prefill", type=int, default=None, help="prefill_only workers (default 1; none with --aggregated)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--aggregated", action="store_true",
                   help="run --decode prefill_and_decode workers and no prefill workers")
    p.add_argument("--nats-url", default=None, help="join this NATS instead of starting an embedded one")
    p.add_argument("--nats-port", type=int, default=DEFAULT_NATS_PORT,
                   help="embedded NATS client port (default 4222; a free one if busy; 0 = any)")
    p.add_argument("--namespace", default=None, help="subject namespace (TANDEM_NAMESPACE, default tandem)")
    p.add_argument("--metrics-port-base", type=int, default=DEFAULT_METRICS_BASE,
                   help="workers get the first free metrics ports from here (default 9400; 0 = any free)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quantization", default=None, choices=["none", "fp16", "int8", "int4", "auto"],
                   help="how workers hold the weights (TANDEM_QUANTIZATION; default auto: the GGUF's own)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] for the workers")
    p.add_argument("--prefill-cpus", default=None,
                   help="cores for the prefill workers, e.g. 0 or 0-3, split among them (default: see --no-pin)")
    p.add_argument("--decode-cpus", default=None,
                   help="cores for the decode (or --aggregated) workers, split among them")
    p.add_argument("--prefill-devices", default=None, help="GPUs for the prefill workers, e.g. cuda:0 (split)")
    p.add_argument("--decode-devices", default=None, help="GPUs for the decode workers, e.g. cuda:1 (split)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not give workers their own cores (default on a CPU host: prefill and decode "
                        "workers on disjoint cores when there are enough, one torch thread per core)")
    p.add_argument("--worker-args", default="", help="extra flags for every `tandem serve`, e.g. '--max-batch 8'")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for /ready (default 300)")
    p.add_argument("--stop-timeout", type=float, default=15.0,
                   help="seconds a child gets after SIGTERM before SIGKILL (default 15)")
    p.add_argument("--ready-file", default=None,
                   help="write the cluster's URLs and PIDs here as JSON once ready (for scripts)")
    p.add_argument("--quiet", action="store_true", help="do not echo the children's output")
    p.set_defaults(func=main)
    return p


# ---- children ----------------------------------------------------------------------------


_LIBC: ctypes.CDLL | None = None


def _load_libc() -> None:
    """Load libc in the parent, so the forked child only makes one system call (no dlopen after fork)."""
    global _LIBC
    if _LIBC is None and sys.platform.startswith("linux"):
        try:
            _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
        except OSError:
            _LIBC = None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the kernel SIGTERMs this child when ``tandem up`` dies, so none is orphaned."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def describe_exit(code: int | None) -> str:
    """``exit code 1`` / ``killed by SIGKILL`` / ``still running``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class Child:
    """One child process, its output (echoed with a name prefix and kept as a tail)."""

    name: str
    cmd: list[str]
    role: str
    metrics_port: int | None = None
    env: dict[str, str] | None = None
    echo: TextIO | None = None
    proc: subprocess.Popen[bytes] | None = None
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=200))
    reader: threading.Thread | None = None

    def start(self) -> None:
        """Spawn it in its own session, with output piped to a reader thread."""
        _load_libc()
        preexec = _die_with_parent if _LIBC is not None else None
        try:
            self.proc = subprocess.Popen(
                self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                env=self.env, start_new_session=True, preexec_fn=preexec,
            )
        except OSError as e:
            raise UpError(f"cannot start {self.name} ({shlex.join(self.cmd)}): {e}") from e
        self.reader = threading.Thread(target=self._read, name=f"log-{self.name}", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            self.tail.append(line)
            if self.echo is not None:
                with contextlib.suppress(OSError, ValueError):
                    print(f"[{self.name}] {line}", file=self.echo, flush=True)

    @property
    def pid(self) -> int | None:
        """Its process id once started."""
        return self.proc.pid if self.proc is not None else None

    def poll(self) -> int | None:
        """Its exit status, or None while it runs."""
        return self.proc.poll() if self.proc is not None else None

    def last_lines(self, n: int = 20) -> str:
        """The last lines it wrote (for 'why did it die')."""
        if self.reader is not None:
            self.reader.join(timeout=1.0)
        return "\n".join(list(self.tail)[-n:])

    def terminate(self) -> None:
        """SIGTERM by PID (no-op when it already exited)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL by PID and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)


def stop_children(children: Sequence[Child], timeout: float, force: Callable[[], bool] = lambda: False,
                  log: Callable[[str], None] = print) -> None:
    """SIGTERM all of ``children``, wait up to ``timeout`` (or until ``force()``), SIGKILL the rest."""
    alive = [c for c in children if c.poll() is None]
    for c in alive:
        c.terminate()
    deadline = time.monotonic() + timeout
    while any(c.poll() is None for c in alive) and time.monotonic() < deadline and not force():
        time.sleep(0.05)
    for c in alive:
        if c.poll() is None:
            log(f"{c.name} (pid {c.pid}) did not stop within {timeout:g}s of SIGTERM; killing it")
            c.kill()


# ---- ports -------------------------------------------------------------------------------


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``port`` can be bound on ``host`` now."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free (tiny race until the child binds it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def pick_ports(base: int, count: int, taken: set[int]) -> list[int]:
    """``count`` free ports: the first free ones from ``base`` up, or any free ones when ``base`` is 0."""
    out: list[int] = []
    port = base
    while len(out) < count:
        if base == 0:
            p = free_port()
            if p not in taken and p not in out:
                out.append(p)
            continue
        if port > 65535:
            raise UpError(f"no free metrics ports from {base} up")
        if port not in taken and port_free(port):
            out.append(port)
        port += 1
    return out


# ---- the cluster -------------------------------------------------------------------------


@dataclass
class Plan:
    """What ``tandem up`` starts."""

    model: str
    model_name: str
    namespace: str
    host: str
    port: int
    workers: list[tuple[str, str, int]]  # (worker id, role, metrics port)
    serve_args: list[str]
    gateway_args: list[str]
    placements: dict[str, WorkerPlacement] = field(default_factory=dict)  # worker id -> cores/device
    placement_note: str = ""


def _tandem(*args: str) -> list[str]:
    return [sys.executable, "-m", "tandem.cli", *args]


async def _ensure_streams(nats_url: str, model_name: str, namespace: str, timeout: float) -> None:
    from bus.connection import BusOptions, connect
    from bus.streams import ensure_streams
    from bus.subjects import Subjects

    nc = await connect(BusOptions.from_env(servers=nats_url, connect_timeout=timeout), name="tandem-up")
    try:
        await ensure_streams(nc, Subjects(model_name, namespace), timeout=timeout)
    finally:
        await nc.close()


def _ready(url: str, expected: set[str], client: Any) -> tuple[bool, str]:
    """(every expected worker reported and /ready is 200, what is still missing)."""
    import httpx

    try:
        r = client.get(f"{url}/ready", timeout=2.0)
    except httpx.HTTPError as e:
        return False, f"gateway not answering yet ({type(e).__name__})"
    try:
        body = r.json()
    except ValueError:
        return False, f"/ready answered {r.status_code} without JSON"
    seen = {w.get("worker_id") for w in body.get("workers", []) if w.get("age_s", 99) < 5}
    missing = sorted(expected - seen)
    if r.status_code == 200 and not missing:
        return True, ""
    return False, f"waiting for {', '.join(missing) or 'a decode worker'}"


class Cluster:
    """The running children of one ``tandem up`` and the rules for stopping them."""

    def __init__(self, out: TextIO, err: TextIO, stop_timeout: float) -> None:
        self.out = out
        self.err = err
        self.stop_timeout = stop_timeout
        self.children: list[Child] = []
        self.nats: Any = None
        self.stop_reason: str | None = None
        self.force = False

    def say(self, line: str) -> None:
        """A line for the person at the terminal."""
        print(line, file=self.out, flush=True)

    def warn(self, line: str) -> None:
        """A line on stderr."""
        print(line, file=self.err, flush=True)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """First Ctrl-C/SIGTERM: stop in order; a second one: stop waiting and kill."""
        name = signal.Signals(signum).name
        if self.stop_reason is None:
            self.stop_reason = name
        else:
            self.force = True

    def something_died(self) -> bool:
        """Whether a child or the embedded nats-server has exited; says which, why, and its last lines."""
        dead = next((c for c in self.children if c.poll() is not None), None)
        if dead is not None:
            self.warn(f"tandem up: {dead.name} (pid {dead.pid}) {describe_exit(dead.poll())}; stopping everything. "
                      f"Its last output:")
            for line in dead.last_lines().splitlines() or ["(no output)"]:
                self.warn(f"  | {line}")
            return True
        if self.nats is not None and not self.nats.running:
            self.warn(f"tandem up: the embedded nats-server died; last log lines:\n{self.nats.log_tail(20)}")
            return True
        return False

    def stop(self) -> None:
        """Gateway first (no new requests), then decode, then prefill workers, then NATS."""
        order = [
            [c for c in self.children if c.role == "gateway"],
            [c for c in self.children if c.role in ("decode_only", "prefill_and_decode")],
            [c for c in self.children if c.role == "prefill_only"],
        ]
        for group in order:
            if group:
                stop_children(group, self.stop_timeout, lambda: self.force, self.warn)
        if self.nats is not None:
            self.nats.stop()
            self.nats = None


def _check_port(flag: str, port: int | None, count: int = 1) -> None:
    if port is not None and not (0 <= port and port + count - 1 <= 65535):
        raise UpError(f"{flag} must be 0 (any free port) to 65535, got {port}")


def _gateway_port(args: argparse.Namespace, warn: Callable[[str], None]) -> int:
    """The port asked for; the default one only while it is free (else any free port, with a warning)."""
    bind = args.host if args.host not in ("0.0.0.0", "::") else "127.0.0.1"
    if args.port == 0:
        return free_port(bind)
    port = DEFAULT_PORT if args.port is None else args.port
    if port_free(port, args.host):
        return port
    if args.port is not None:
        raise UpError(f"port {port} is busy; pass --port 0 for any free port, or stop what listens there")
    free = free_port(bind)
    warn(f"tandem up: port {port} is busy; the gateway takes port {free} instead")
    return free


def _plan(args: argparse.Namespace, own_nats: bool, warn: Callable[[str], None]) -> Plan:
    from engine.loader import DEFAULT_MODEL, model_name
    from runtime.settings import Settings

    s = Settings.from_env()
    model = args.model or s.model or DEFAULT_MODEL
    namespace = args.namespace or s.namespace
    if args.decode < 1:
        raise UpError("--decode must be at least 1")
    if args.aggregated and args.prefill:
        raise UpError("--aggregated runs no prefill_only workers; drop --prefill (or --aggregated)")
    prefill = 0 if args.aggregated else (1 if args.prefill is None else args.prefill)
    if prefill < 0:
        raise UpError("--prefill must not be negative")
    _check_port("--port", args.port)
    _check_port("--nats-port", args.nats_port)
    _check_port("--metrics-port-base", args.metrics_port_base, args.decode + prefill)
    if args.ready_file:
        folder = Path(args.ready_file).resolve().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise UpError(f"--ready-file {args.ready_file}: {folder} is not a writable folder")
    suffix = "" if own_nats else f"-{uuid.uuid4().hex[:4]}"  # sharing a NATS: ids must not clash
    specs: list[tuple[str, str]] = []
    if args.aggregated:
        specs += [(f"worker-{i + 1}{suffix}", "prefill_and_decode") for i in range(args.decode)]
    else:
        specs += [(f"prefill-{i + 1}{suffix}", "prefill_only") for i in range(prefill)]
        specs += [(f"decode-{i + 1}{suffix}", "decode_only") for i in range(args.decode)]
    if args.device and (args.prefill_devices or args.decode_devices):
        raise UpError("--device applies to every worker; drop it or --prefill-devices/--decode-devices")
    layout = plan_layout(prefill, args.decode, prefill_cpus=args.prefill_cpus, decode_cpus=args.decode_cpus,
                         prefill_devices=args.prefill_devices, decode_devices=args.decode_devices,
                         gpu=bool(args.device and args.device.startswith("cuda")), pin=args.pin)
    placements = dict(zip([wid for wid, _ in specs], layout.prefill + layout.decode))
    port = _gateway_port(args, warn)
    ports = pick_ports(args.metrics_port_base, len(specs), {port})
    serve_args = ["--model", model, "--namespace", namespace]
    if args.dtype:
        serve_args += ["--dtype", args.dtype]
    if args.quantization:
        serve_args += ["--quantization", args.quantization]
    if args.device:
        serve_args += ["--device", args.device]
    serve_args += shlex.split(args.worker_args)
    return Plan(
        model=model,
        model_name=model_name(model),
        namespace=namespace,
        host=args.host,
        port=port,
        workers=[(wid, role, p) for (wid, role), p in zip(specs, ports)],
        serve_args=serve_args,
        gateway_args=["--model", model, "--namespace", namespace, "--host", args.host, "--port", str(port)],
        placements=placements,
        placement_note=layout.note,
    )


def run_up(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Start the cluster, wait for /ready, supervise; returns 0 after Ctrl-C, 1 when something died."""
    import httpx

    from bus.connection import BusConnectError
    from bus.server import EmbeddedNats, NatsServerError
    from bus.streams import StreamConfigError

    cluster = Cluster(out, err, args.stop_timeout)
    previous = {s: signal.signal(s, cluster.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    echo = None if args.quiet else err
    log_level = getattr(args, "log_level", None) or "WARNING"
    logging_args = ("--log-level", log_level, "--log-format", getattr(args, "log_format", None) or "text")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("UCX_NET_DEVICES", "lo")  # every process is on this machine
    try:
        own_nats = not args.nats_url
        plan = _plan(args, own_nats, cluster.warn)
        # 1. NATS
        if own_nats:
            nport = args.nats_port
            if nport and not port_free(nport):
                cluster.warn(f"tandem up: port {nport} is busy; the embedded NATS takes a free port instead")
                nport = 0
            cluster.nats = EmbeddedNats(port=nport, die_with_parent=True)
            cluster.nats.start()
            nats_url = cluster.nats.url
        else:
            nats_url = args.nats_url
            cluster.say(f"tandem up: joining NATS at {nats_url}")
        if not asyncio.run(_unless_stopped(cluster, _ensure_streams(nats_url, plan.model_name, plan.namespace, 15.0),
                                           30.0)):
            cluster.say(f"tandem up: {cluster.stop_reason} during start-up; stopping")
            return 0
        # 2. workers, 3. gateway
        for wid, role, mport in plan.workers:
            cluster.children.append(Child(
                wid,
                _tandem(*logging_args, "serve", "--pipeline-role", role, "--worker-id", wid,
                        "--nats-url", nats_url, "--metrics-port", str(mport),
                        *plan.placements[wid].serve_args(), *plan.serve_args),
                role, mport, env, echo,
            ))
        cluster.children.append(Child(
            "gateway",
            _tandem(*logging_args, "gateway", "--nats-url", nats_url, *plan.gateway_args),
            "gateway", None, env, echo,
        ))
        for c in cluster.children:
            c.start()
        host = "127.0.0.1" if plan.host in ("0.0.0.0", "::", "") else plan.host
        url = f"http://{host}:{plan.port}"
        expected = {wid for wid, _, _ in plan.workers}
        # 4. wait for /ready
        deadline = time.monotonic() + args.ready_timeout
        last_note = 0.0
        why = "starting"
        with httpx.Client() as client:
            while True:
                if cluster.stop_reason:
                    cluster.say(f"tandem up: {cluster.stop_reason} during start-up; stopping")
                    return 0
                if cluster.something_died():
                    return 1
                ok, why = _ready(url, expected, client)
                if ok:
                    break
                now = time.monotonic()
                if now > deadline:
                    cluster.warn(f"tandem up: not ready after {args.ready_timeout:g}s ({why}); stopping")
                    return 1
                if now - last_note > 15:
                    if last_note:
                        cluster.say(f"tandem up: still starting ({why})")
                    last_note = now
                time.sleep(0.25)
        # 5. tell the person
        _announce(cluster, plan, url, nats_url)
        if args.ready_file:
            _write_ready_file(Path(args.ready_file), cluster, plan, url, nats_url)
        # 6. supervise
        while not cluster.stop_reason:
            if cluster.something_died():
                return 1
            time.sleep(0.2)
        cluster.say(f"tandem up: {cluster.stop_reason}; stopping")
        return 0
    except (UpError, NatsServerError, ValueError, OverflowError) as e:
        cluster.warn(f"tandem up: {e}")
        return 1 if isinstance(e, (UpError, NatsServerError)) else 2
    except OSError as e:  # e.g. a --host that does not resolve, or a port that cannot be bound
        cluster.warn(f"tandem up: {e}")
        return 1
    except (StreamConfigError, BusConnectError, asyncio.TimeoutError) as e:
        cluster.warn(f"tandem up: cannot prepare the NATS streams: {e}")
        return 1
    finally:
        cluster.stop()
        for s, h in previous.items():
            signal.signal(s, h)
        if args.ready_file:
            with contextlib.suppress(OSError):
                Path(args.ready_file).unlink()


async def _unless_stopped(cluster: Cluster, work: Coroutine[Any, Any, Any], timeout: float) -> bool:
    """Run ``work`` (deadline ``timeout``); False, abandoning it, as soon as Ctrl-C/SIGTERM arrives."""
    task = asyncio.ensure_future(work)
    deadline = time.monotonic() + timeout
    while not task.done():
        if cluster.stop_reason:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return False
        if time.monotonic() > deadline:
            task.cancel()
            raise asyncio.TimeoutError(f"not done within {timeout:g}s")
        await asyncio.wait({task}, timeout=0.2)
    task.result()
    return True


def _announce(cluster: Cluster, plan: Plan, url: str, nats_url: str) -> None:
    body = json.dumps({"model": plan.model_name,
                       "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    cluster.say(f"tandem is up: model {plan.model_name}")
    cluster.say(f"  OpenAI API  {url}/v1")
    cluster.say(f"  NATS        {nats_url}   (watch: nats sub '{plan.namespace}.>' -s {nats_url})")
    for c in cluster.children:
        where = f"metrics :{c.metrics_port}" if c.metrics_port else f"metrics {url}/metrics"
        place = plan.placements[c.name].describe() if c.name in plan.placements else "any core"
        cluster.say(f"  {c.name:<14} {c.role:<19} pid {c.pid:<8} {where:<14} {place}")
    cluster.say(f"  placement   {plan.placement_note}; NATS and the gateway are light and run on any core "
                f"({format_cpus(available_cpus())})")
    cluster.say("Try:")
    auth = " -H \"Authorization: Bearer $TANDEM_API_KEY\"" if os.environ.get("TANDEM_API_KEYS") else ""
    cluster.say(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'")
    if auth:
        cluster.say("  (API keys are on: set TANDEM_API_KEY to one of TANDEM_API_KEYS)")
    cluster.say("Ctrl-C stops everything.")


def _write_ready_file(path: Path, cluster: Cluster, plan: Plan, url: str, nats_url: str) -> None:
    info = {
        "url": url,
        "base_url": f"{url}/v1",
        "nats_url": nats_url,
        "model": plan.model_name,
        "namespace": plan.namespace,
        "pid": os.getpid(),
        "children": [{"name": c.name, "role": c.role, "pid": c.pid, "metrics_port": c.metrics_port,
                      "placement": plan.placements[c.name].describe() if c.name in plan.placements else ""}
                     for c in cluster.children],
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, path)


def main(args: argparse.Namespace) -> int:
    """``tandem up`` entry point."""
    return run_up(args)
