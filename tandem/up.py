"""``tandem up``: a whole local cluster in one command, supervised.

It starts the embedded ``nats-server -js`` (unless ``--nats-url`` names one), creates the
work-queue streams, starts the workers (by default one ``prefill_only`` and one
``decode_only``; ``--aggregated`` runs ``prefill_and_decode`` workers instead) and the
gateway, each a ``tandem`` child process with its own metrics port, waits until the
gateway's ``/ready`` lists every worker (with a deadline), prints the URL and a curl line,
and then supervises: a child that dies (a worker, the gateway, the embedded NATS) is named in
one line and started again after a backoff (``--restart on-failure``, the default; 1 s, doubling,
at most ``--restart-max-delay``), while the rest keep serving. It stops everything only on
Ctrl-C / SIGTERM, when a child keeps dying at start-up (three times in a row, or once refusing
its configuration), or with ``--restart never`` when any child dies.

Stopping goes in order: gateway (it drains: ``--drain-timeout``), decode workers, prefill workers,
NATS; each child gets its drain time plus ``--stop-timeout`` after SIGTERM before SIGKILL.
Children run through :mod:`runtime.processes` (own session, parent-death signal), so killing
``tandem up`` itself leaves no orphans.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import json
import os
import shlex
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from bus.connection import BusOptions, connect
from bus.subjects import Subjects
from gateway.server import (
    SAMPLING_FLAGS,
    add_sampling_default_flags,
    describe_defaults,
    sampling_default_args,
)
from runtime.placement import WorkerPlacement, available_cpus, format_cpus, plan_layout
from runtime.processes import (
    ChildError,
    ChildProcess,
    GiveUp,
    RestartPolicy,
    Supervisor,
    describe_exit,
    stop_all,
)
from runtime.settings import KERNEL_CHOICES, KERNELS_HELP, SPECULATIVE_MODES
from tandem.autoscale import RolePolicy, parse_ranges, parse_role_numbers, policies
from tandem.local_run import OWNER, LocalRun

DEFAULT_PORT = 8000
DEFAULT_NATS_PORT = 4222
DEFAULT_METRICS_BASE = 9400
#: variables that log a process in to some NATS: our own embedded one gives each child its own instead
_NATS_LOGIN_ENV = ("TANDEM_NATS_USER", "TANDEM_NATS_PASSWORD", "TANDEM_NATS_TOKEN", "TANDEM_NATS_NKEY_SEED",
                   "TANDEM_NATS_CREDS", "TANDEM_NATS_INBOX_PREFIX", "TANDEM_NATS_TLS_CA", "TANDEM_NATS_TLS_CERT",
                   "TANDEM_NATS_TLS_KEY")
#: the role ``--autoscale`` sizes each pipeline role under
SCALED_ROLE = {"prefill_only": "prefill", "decode_only": "decode", "prefill_and_decode": "decode"}


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
                   help="run --decode prefill_and_decode workers and no prefill workers (default off: disaggregated)")
    p.add_argument("--nats-url", default=None, help="join this NATS instead of starting an embedded one (default: an embedded nats-server -js)")
    p.add_argument("--nats-port", type=int, default=DEFAULT_NATS_PORT,
                   help="embedded NATS client port (default 4222; a free one if busy; 0 = any)")
    p.add_argument("--nats-monitor-port", type=int, default=None,
                   help="embedded NATS: serve its monitoring (/varz, /jsz: what KEDA's JetStream scaler reads) "
                        "on this port (default: off)")
    p.add_argument("--namespace", default=None, help="subject namespace (TANDEM_NAMESPACE, default tandem)")
    p.add_argument("--metrics-port-base", type=int, default=None,
                   help=f"workers' metrics ports, one each from here up (default {DEFAULT_METRICS_BASE}, any free "
                        "port in place of a busy one; 0 = any free; a busy port given here is an error)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="activations and KV cache of the workers (TANDEM_DTYPE; default float32)")
    p.add_argument("--quantization", default=None, choices=["none", "fp16", "int8", "int4", "auto"],
                   help="how workers hold the weights (TANDEM_QUANTIZATION; default auto: the GGUF's own)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] for the workers (default cpu)")
    p.add_argument("--kernels", default=None, choices=list(KERNEL_CHOICES), help=f"how workers multiply int4/Q8_0 weights (TANDEM_KERNELS; default auto): {KERNELS_HELP}")
    p.add_argument("--speculative", default=None, choices=list(SPECULATIVE_MODES),
                   help="decode: draft tokens by prompt lookup (ngram) and verify them in one step, or off "
                        "(TANDEM_SPECULATIVE; default ngram)")
    p.add_argument("--prefill-cpus", default=None,
                   help="cores for the prefill workers, e.g. 0 or 0-3, split among them (default: see --no-pin)")
    p.add_argument("--decode-cpus", default=None,
                   help="cores for the decode (or --aggregated) workers, split among them (default: see --no-pin)")
    p.add_argument("--prefill-devices", default=None, help="GPUs for the prefill workers, e.g. cuda:0 (split; default: none, CPU)")
    p.add_argument("--decode-devices", default=None, help="GPUs for the decode workers, e.g. cuda:1 (split; default: none, CPU)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not give workers their own cores (default on a CPU host: prefill and decode "
                        "workers on disjoint cores when there are enough, one torch thread per core)")
    p.add_argument("--worker-args", default="", help="extra flags for every `tandem serve`, e.g. '--max-batch 8' (default: none)")
    p.add_argument("--gateway-args", default="", help="extra flags for `tandem gateway`, e.g. '--max-queue-wait 10' (default: none)")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for /ready (default 300)")
    p.add_argument("--restart", default="on-failure", choices=["on-failure", "never"],
                   help="restart a child that dies (default on-failure); never: any death stops everything")
    p.add_argument("--restart-delay", type=float, default=1.0,
                   help="seconds before the first restart of a child; doubles with each failure (default 1)")
    p.add_argument("--restart-max-delay", type=float, default=30.0,
                   help="the most seconds between restarts of a child (default 30)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds the gateway and each worker get to finish in-flight requests on Ctrl-C (default 30)")
    p.add_argument("--stop-timeout", type=float, default=10.0,
                   help="seconds a child gets beyond its drain time after SIGTERM before SIGKILL (default 10)")
    p.add_argument("--ready-file", default=None,
                   help="write the cluster's URLs and PIDs here as JSON once ready, again after each restart (default: none)")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="a name the model answers to, the first one also in /v1/models (repeatable; default: "
                        "the model's own name)")
    p.add_argument("--autoscale", default=None, metavar="prefill=MIN..MAX,decode=MIN..MAX",
                   help="start and drain workers on this host from each role's demand (bus/demand.py), e.g. "
                        "prefill=0..2,decode=1..2 (replaces --prefill/--decode; default: fixed counts)")
    p.add_argument("--autoscale-target", default="",
                   help="demand one worker should carry, per role, e.g. prefill=2,decode=4 (default: those)")
    p.add_argument("--autoscale-activation", default="",
                   help="a role with MIN 0 starts its first worker once its demand exceeds this, e.g. prefill=1 "
                        "(default prefill=1,decode=0)")
    p.add_argument("--autoscale-cooldown", type=float, default=30.0,
                   help="seconds a role must want fewer workers before one is drained (default 30)")
    p.add_argument("--autoscale-interval", type=float, default=1.0,
                   help="seconds between two readings of the demand (default 1)")
    p.add_argument("--autoscale-metrics-port", type=int, default=None,
                   help="port of the scaler's /metrics (tandem_autoscale_*; default the first free one after the "
                        "workers' metrics ports)")
    add_sampling_default_flags(p)
    p.add_argument("--quiet", action="store_true",
                   help="do not echo the children's output (default: echoed, start-up phases included)")
    p.set_defaults(func=main)
    return p


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


def free_ports(count: int, avoid: set[int], host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports the OS says are free on ``host``, none of them in ``avoid``."""
    out: list[int] = []
    while len(out) < count:
        p = free_port(host)
        if p not in avoid and p not in out:
            out.append(p)
    return out


def _bind_host(host: str) -> str:
    """The address to test a port on for a server that binds ``host`` (the IPv4 wildcard for any wildcard)."""
    return "0.0.0.0" if host in ("0.0.0.0", "::", "") else host


def metrics_ports(base: int | None, count: int, taken: set[int], host: str,
                  warn: Callable[[str], None]) -> list[int]:
    """``count`` metrics ports for servers on ``host``. ``base`` None: the default ones (from
    :data:`DEFAULT_METRICS_BASE` up), each one that is busy replaced by any free port, said in one warning;
    0: any free ports; else ``base`` and the ports after it, which must be free (UpError names a busy one)."""
    bind = _bind_host(host)
    if base == 0:
        return free_ports(count, taken)
    start = DEFAULT_METRICS_BASE if base is None else base
    wanted = range(start, start + count)
    out: list[int] = []
    moved: list[tuple[int, int]] = []
    for port in wanted:
        if port not in taken and port_free(port, bind):
            out.append(port)
            continue
        if base is not None:
            raise UpError(f"metrics port {port} (--metrics-port-base {base}, {count} port{'s' if count > 1 else ''}) "
                          "is busy; pass --metrics-port-base 0 for any free ports, or stop what listens there")
        free = free_ports(1, taken | set(out) | set(wanted), bind)[0]
        out.append(free)
        moved.append((port, free))
    if moved:
        busy, instead = (", ".join(str(p[i]) for p in moved) for i in (0, 1))
        warn(f"tandem up: metrics port {busy} is busy; the workers take {instead} instead" if len(moved) == 1 else
             f"tandem up: metrics ports {busy} are busy; the workers take {instead} instead")
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
    served_name: str = ""  # what clients call the model: the first --served-model-name, else model_name
    autoscale: dict[str, RolePolicy] | None = None  # scaled role -> its policy (--autoscale)
    slots: list[tuple[str, str, int]] = field(default_factory=list)  # every worker --autoscale may run, in order
    autoscale_metrics_port: int | None = None
    gateway_id: str = ""
    #: the metrics ports were ours to choose (not an explicit --metrics-port-base): one taken in the meantime
    #: moves to a free one (a worker's --metrics-port-fallback; the scaler's too)
    metrics_fallback: bool = True
    autoscale_port_picked: bool = True  # neither --autoscale-metrics-port nor --metrics-port-base chose it
    defaults: str = ""  # what a request that leaves max_tokens or sampling fields out gets, in words


def _tandem(*args: str) -> list[str]:
    return [sys.executable, "-m", "tandem.cli", *args]


async def _ensure_streams(bus: BusOptions, model_name: str, namespace: str, timeout: float) -> None:
    from bus.streams import ensure_streams
    from runtime.settings import Settings

    nc = await connect(dataclasses.replace(bus, connect_timeout=timeout), name="tandem-up")
    try:
        await ensure_streams(nc, Subjects(model_name, namespace), replicas=Settings.from_env().stream_replicas,
                             timeout=timeout)
    finally:
        await nc.close()


def _ready(url: str, expected: set[str], client: Any) -> tuple[bool, str, dict[str, dict[str, Any]]]:
    """(every expected worker reported and /ready is 200, what is still missing, the workers /ready lists)."""
    import httpx

    try:
        r = client.get(f"{url}/ready", timeout=2.0)
    except httpx.HTTPError as e:
        return False, f"gateway not answering yet ({type(e).__name__})", {}
    try:
        body = r.json()
    except ValueError:
        return False, f"/ready answered {r.status_code} without JSON", {}
    workers = {w.get("worker_id"): w for w in body.get("workers", []) if w.get("age_s", 99) < 5}
    missing = sorted(expected - set(workers))
    if r.status_code == 200 and not missing:
        return True, "", workers
    return False, f"waiting for {', '.join(missing) or 'a decode worker'}", workers


@dataclass
class Member:
    """One child of the cluster: its process and what it is."""

    child: ChildProcess
    role: str  # a pipeline role, or "gateway"
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        if self.metrics_port:  # a worker says at each start where its metrics are (moved if the port was taken)
            self.child.on_line = self._line

    def _line(self, line: str) -> None:
        from runtime.health import METRICS_AT

        at = METRICS_AT.match(line)
        if at:
            self.metrics_port = int(at.group(1))

    @property
    def name(self) -> str:
        return self.child.name


class Cluster:
    """The children of one ``tandem up``, their supervisor, and the rules for stopping them."""

    def __init__(self, out: TextIO, err: TextIO, drain_timeout: float, stop_timeout: float) -> None:
        self.out = out
        self.err = err
        self.drain_timeout = drain_timeout
        self.stop_timeout = stop_timeout
        self.members: list[Member] = []
        self.nats: Any = None
        self.run: LocalRun | None = None  # our own NATS's credentials (None when joining one)
        self.supervisor: Supervisor | None = None
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

    def supervise(self, policy: RestartPolicy) -> None:
        """Watch every child (and the embedded NATS): NATS and the gateway are essential."""
        sup = Supervisor(policy, say=lambda line: self.warn(f"tandem up: {line}"), before_restart=_count_restart)
        if self.nats is not None:
            sup.add(self.nats, essential=True)
        for m in self.members:
            sup.add(m.child, essential=m.role == "gateway")
        self.supervisor = sup

    def check(self) -> bool:
        """One supervision step: restarts what died; False (having said why) when it gives up."""
        assert self.supervisor is not None
        try:
            self.supervisor.check()
        except GiveUp as e:
            self.warn(f"tandem up: {e}; stopping everything. Its last output:")
            for line in e.output.splitlines() or ["(no output)"]:
                self.warn(f"  | {line}")
            return False
        return True

    def restarts(self, name: str) -> int:
        """How many times ``name`` was restarted."""
        return self.supervisor.restarts(name) if self.supervisor is not None else 0

    def stop(self) -> None:
        """Gateway first (it drains), then decode, then prefill workers, then NATS."""
        order = [
            [m.child for m in self.members if m.role == "gateway"],
            [m.child for m in self.members if m.role in ("decode_only", "prefill_and_decode")],
            [m.child for m in self.members if m.role == "prefill_only"],
        ]
        for group in order:
            if group:
                stop_all(group, self.drain_timeout + self.stop_timeout, lambda: self.force, self.warn)
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        if self.run is not None:
            self.run.remove()
            self.run = None


def _count_restart(unit: Any, restarts: int) -> None:
    """A restarted worker says in its service metadata how often it was restarted (``tandem status``)."""
    env = getattr(unit, "env", None)
    if env is not None:
        env["TANDEM_RESTARTS"] = str(restarts)


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
    from engine.model_files import DEFAULT_MODEL, model_name
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
    scaling = _autoscale_policies(args)
    decode = args.decode
    if scaling is not None:
        prefill = scaling["prefill"].max if "prefill" in scaling else 0 if args.aggregated else prefill
        decode = scaling["decode"].max if "decode" in scaling else decode
    _check_port("--port", args.port)
    _check_port("--nats-port", args.nats_port)
    _check_port("--nats-monitor-port", args.nats_monitor_port)
    if args.nats_monitor_port and args.nats_url:
        raise UpError("--nats-monitor-port is for the embedded NATS; with --nats-url, use that server's monitoring")
    _check_port("--metrics-port-base", args.metrics_port_base, decode + prefill + (scaling is not None))
    if args.default_max_tokens is not None and args.default_max_tokens < 0:
        raise UpError(f"--default-max-tokens must not be negative, got {args.default_max_tokens}")
    _check_port("--autoscale-metrics-port", args.autoscale_metrics_port)
    for flag, value in (("--drain-timeout", args.drain_timeout), ("--stop-timeout", args.stop_timeout)):
        if not value >= 0:
            raise UpError(f"{flag} must not be negative, got {value:g}")
    if args.ready_file:
        folder = Path(args.ready_file).resolve().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise UpError(f"--ready-file {args.ready_file}: {folder} is not a writable folder")
    suffix = "" if own_nats else f"-{uuid.uuid4().hex[:4]}"  # sharing a NATS: ids must not clash
    specs: list[tuple[str, str]] = []
    if args.aggregated:
        specs += [(f"worker-{i + 1}{suffix}", "prefill_and_decode") for i in range(decode)]
    else:
        specs += [(f"prefill-{i + 1}{suffix}", "prefill_only") for i in range(prefill)]
        specs += [(f"decode-{i + 1}{suffix}", "decode_only") for i in range(decode)]
    if args.device and (args.prefill_devices or args.decode_devices):
        raise UpError("--device applies to every worker; drop it or --prefill-devices/--decode-devices")
    layout = plan_layout(prefill, decode, prefill_cpus=args.prefill_cpus, decode_cpus=args.decode_cpus,
                         prefill_devices=args.prefill_devices, decode_devices=args.decode_devices,
                         gpu=bool(args.device and args.device.startswith("cuda")), pin=args.pin)
    placements = dict(zip([wid for wid, _ in specs], layout.prefill + layout.decode))
    port = _gateway_port(args, warn)
    ports = metrics_ports(args.metrics_port_base, len(specs) + (scaling is not None), {port}, args.host, warn)
    slots = [(wid, role, p) for (wid, role), p in zip(specs, ports)]
    workers = slots
    if scaling is not None:  # start at each role's minimum; the other slots wait for demand
        first = {SCALED_ROLE[r]: 0 for _, r, _ in slots}
        workers = []
        for slot in slots:
            role = SCALED_ROLE[slot[1]]
            if first[role] < (scaling[role].min if role in scaling else len(slots)):
                workers.append(slot)
            first[role] += 1
    gateway_extra = shlex.split(args.gateway_args)
    gateway_id = _flag_value(gateway_extra, "--gateway-id") or f"gw-{uuid.uuid4().hex[:8]}"
    serve_args = ["--model", model, "--namespace", namespace]
    if args.dtype:
        serve_args += ["--dtype", args.dtype]
    if args.quantization:
        serve_args += ["--quantization", args.quantization]
    if args.device:
        serve_args += ["--device", args.device]
    if args.kernels:
        serve_args += ["--kernels", args.kernels]
    if args.speculative:
        serve_args += ["--speculative", args.speculative]
    # workers' /metrics, /health and /ready listen where the gateway does (127.0.0.1 by default)
    serve_args += ["--metrics-host", args.host, "--drain-timeout", f"{args.drain_timeout:g}",
                   *shlex.split(args.worker_args)]
    return Plan(
        model=model,
        model_name=model_name(model),
        namespace=namespace,
        host=args.host,
        port=port,
        workers=workers,
        serve_args=serve_args,
        gateway_args=["--model", model, "--namespace", namespace, "--host", args.host, "--port", str(port),
                      "--drain-timeout", f"{args.drain_timeout:g}", "--gateway-id", gateway_id,
                      *[w for name in args.served_model_name or () for w in ("--served-model-name", name)],
                      *sampling_default_args(args), *gateway_extra],
        placements=placements,
        placement_note=layout.note,
        served_name=(args.served_model_name or [model_name(model)])[0],
        autoscale=scaling,
        slots=slots,
        autoscale_metrics_port=(args.autoscale_metrics_port or ports[-1]) if scaling is not None else None,
        gateway_id=gateway_id,
        metrics_fallback=not args.metrics_port_base,
        autoscale_port_picked=not (args.autoscale_metrics_port or args.metrics_port_base),
    )


def _flag_value(words: list[str], flag: str) -> str | None:
    """The value ``words`` give ``flag`` (``--flag v`` or ``--flag=v``; the last one wins), or None."""
    value = None
    for i, w in enumerate(words):
        if w == flag and i + 1 < len(words):
            value = words[i + 1]
        elif w.startswith(flag + "="):
            value = w.split("=", 1)[1]
    return value


def _autoscale_policies(args: argparse.Namespace) -> dict[str, RolePolicy] | None:
    """The roles ``--autoscale`` sizes and their policies (None without it); UpError names a bad flag."""
    if not args.autoscale:
        if args.autoscale_target or args.autoscale_activation:
            raise UpError("--autoscale-target and --autoscale-activation need --autoscale")
        return None
    if args.prefill is not None or args.decode != 1:
        raise UpError("--autoscale sets the worker counts; drop --prefill/--decode")
    try:
        ranges = parse_ranges(args.autoscale)
        targets = parse_role_numbers(args.autoscale_target, "--autoscale-target", True) if args.autoscale_target \
            else {}
        activations = parse_role_numbers(args.autoscale_activation, "--autoscale-activation", False) \
            if args.autoscale_activation else {}
    except ValueError as e:
        raise UpError(str(e)) from e
    if args.aggregated and ranges.get("prefill", (0, 0))[1]:
        raise UpError("--aggregated runs no prefill workers; --autoscale may size decode only")
    for flag, value in (("--autoscale-cooldown", args.autoscale_cooldown),
                        ("--autoscale-interval", args.autoscale_interval)):
        if not value > 0:
            raise UpError(f"{flag} must be positive, got {value:g}")
    return policies(ranges, targets, activations)


def worker_child(plan: Plan, worker_id: str, role: str, metrics_port: int, nats_url: str,
                 logging_args: tuple[str, ...], env: dict[str, str], echo: TextIO | None) -> ChildProcess:
    """The one place a worker process is described: its command line and environment."""
    placement = plan.placements[worker_id].serve_args() if worker_id in plan.placements else []
    cmd = _tandem(*logging_args, "serve", "--pipeline-role", role, "--worker-id", worker_id,
                  "--nats-url", nats_url, "--metrics-port", str(metrics_port),
                  *(["--metrics-port-fallback"] if plan.metrics_fallback else []), *placement, *plan.serve_args)
    return ChildProcess(worker_id, cmd, env=dict(env), echo=echo, ready_marker=f" {worker_id} ready")


def gateway_child(plan: Plan, nats_url: str, logging_args: tuple[str, ...], env: dict[str, str],
                  echo: TextIO | None) -> ChildProcess:
    """The gateway process: its command line and environment."""
    cmd = _tandem(*logging_args, "gateway", "--nats-url", nats_url, *plan.gateway_args)
    return ChildProcess("gateway", cmd, env=dict(env), echo=echo, ready_marker="tandem gateway ready")


def run_up(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Start the cluster, wait for /ready, supervise; 0 after Ctrl-C, 1 when it had to give up."""
    import httpx

    from bus.connection import BusConnectError
    from bus.server import EmbeddedNats, NatsServerError
    from bus.streams import StreamConfigError
    from engine.model_files import load_text

    cluster = Cluster(out, err, args.drain_timeout, args.stop_timeout)
    scaling: Autoscaling | None = None
    previous = {s: signal.signal(s, cluster.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    echo = None if args.quiet else err
    log_level = getattr(args, "log_level", None) or "WARNING"
    logging_args = ("--log-level", log_level, "--log-format", getattr(args, "log_format", None) or "text")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("UCX_NET_DEVICES", "lo")  # every process is on this machine
    env.pop("TANDEM_RESTARTS", None)
    try:
        policy = RestartPolicy(mode=args.restart, delay=args.restart_delay, max_delay=args.restart_max_delay)
        own_nats = not args.nats_url
        plan = _plan(args, own_nats, cluster.warn)
        # 0. the model, once: a bad one is one message here, not one per child
        text = load_text(plan.model)
        cluster.say(f"tandem up: model {plan.model_name} ({text.path}): {text.config.num_layers} layers, context "
                    f"{text.config.max_position}, vocabulary {text.config.vocab_size}")
        plan.defaults = _defaults(args, plan, text.sampling_defaults)
        # 1. NATS: our own admits only this run's processes, each with its own NKey and subjects
        if own_nats:
            for key in _NATS_LOGIN_ENV:  # they describe some other server
                env.pop(key, None)
            cluster.run = LocalRun.create(Subjects(plan.model_name, plan.namespace),
                                          [(wid, role) for wid, role, _ in plan.slots], plan.gateway_id)
            nport = args.nats_port
            if nport and not port_free(nport):
                cluster.warn(f"tandem up: port {nport} is busy; the embedded NATS takes a free port instead")
                nport = 0
            cluster.nats = EmbeddedNats(port=nport, die_with_parent=True, server_name="nats",
                                        monitor_port=args.nats_monitor_port, config=cluster.run.config)
            cluster.nats.start()
            nats_url = cluster.nats.url
            owner = cluster.run.credentials[OWNER]
            bus = BusOptions(servers=(nats_url,), nkey_seed=str(owner.seed_file), inbox_prefix=owner.inbox)
            cluster.run.announce(nats_url, plan.namespace)
        else:
            nats_url = args.nats_url
            bus = BusOptions.from_env(servers=nats_url)
            cluster.say(f"tandem up: joining NATS at {nats_url}")
        if not asyncio.run(_unless_stopped(cluster, _ensure_streams(bus, plan.model_name, plan.namespace, 15.0),
                                           30.0)):
            cluster.say(f"tandem up: {cluster.stop_reason} during start-up; stopping")
            return 0

        def login(name: str) -> dict[str, str]:
            return {**env, **(cluster.run.env(name) if cluster.run is not None else {})}

        # 2. workers, 3. gateway
        for wid, role, mport in plan.workers:
            cluster.members.append(Member(worker_child(plan, wid, role, mport, nats_url, logging_args, login(wid),
                                                       echo), role, mport))
        cluster.members.append(Member(gateway_child(plan, nats_url, logging_args, login(plan.gateway_id), echo),
                                      "gateway"))
        for m in cluster.members:
            m.child.start()
        cluster.supervise(policy)
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
                if not cluster.check():
                    return 1
                ok, why, workers = _ready(url, expected, client)
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
        # 5. the scaler, then tell the person
        if plan.autoscale is not None:
            scaling = Autoscaling(cluster, plan, lambda wid, role, mport: worker_child(
                plan, wid, role, mport, nats_url, logging_args, login(wid), echo), bus,
                args.autoscale_cooldown, args.autoscale_interval)
            scaling.start()
        _announce(cluster, plan, url, nats_url, {w: str(info.get("kernels") or "") for w, info in workers.items()})
        ready_file = Path(args.ready_file) if args.ready_file else None
        if ready_file is not None:
            _write_ready_file(ready_file, cluster, plan, url, nats_url)
        # 6. supervise (and scale)
        seen = _snapshot(cluster)
        while not cluster.stop_reason:
            if not cluster.check():
                return 1
            if scaling is not None:
                scaling.step(time.monotonic())
            if ready_file is not None and _snapshot(cluster) != seen:
                seen = _snapshot(cluster)
                _write_ready_file(ready_file, cluster, plan, url, nats_url)
            time.sleep(0.2)
        cluster.say(f"tandem up: {cluster.stop_reason}; stopping")
        return 0
    except (UpError, NatsServerError, ChildError, ValueError, OverflowError) as e:
        cluster.warn(f"tandem up: {e}")
        return 2 if isinstance(e, (ValueError, OverflowError)) else 1
    except OSError as e:  # e.g. a --host that does not resolve, or a port that cannot be bound
        cluster.warn(f"tandem up: {e}")
        return 1
    except (StreamConfigError, BusConnectError, asyncio.TimeoutError) as e:
        cluster.warn(f"tandem up: cannot prepare the NATS streams: {e}")
        return 1
    finally:
        if scaling is not None:
            scaling.close()
        cluster.stop()
        for s, h in previous.items():
            signal.signal(s, h)
        if args.ready_file:
            with contextlib.suppress(OSError):
                Path(args.ready_file).unlink()


class Autoscaling:
    """The local scaler of ``tandem up --autoscale``: reads demand (:class:`tandem.autoscale.DemandFeed`),
    decides (:class:`tandem.autoscale.Decider`) and starts or drains workers of the plan's slots."""

    def __init__(self, cluster: Cluster, plan: Plan, make_child: Callable[[str, str, int], ChildProcess],
                 bus: BusOptions, cooldown: float, interval: float) -> None:
        from runtime.metrics import AutoscaleMetrics
        from tandem.autoscale import Decider, DemandFeed

        assert plan.autoscale is not None
        self.cluster = cluster
        self.plan = plan
        self.make_child = make_child
        self.policies = plan.autoscale
        self.decider = Decider(self.policies, cooldown)
        self.feed = DemandFeed(bus, Subjects(plan.model_name, plan.namespace), interval)
        self.interval = interval
        self.metrics = AutoscaleMetrics()
        self.draining: dict[str, float] = {}  # worker id -> when to SIGKILL it
        self.last_action: dict[str, str] = {}
        self.next_check = 0.0
        self.stale_said = False
        self.started_at = 0.0
        self._server: Any = None

    def start(self) -> None:
        """Connect the feed and serve ``/metrics`` (raises UpError when either cannot)."""
        from prometheus_client import start_http_server

        self.started_at = time.monotonic()
        try:
            self.feed.start()
        except RuntimeError as e:
            raise UpError(str(e)) from e
        port = self.plan.autoscale_metrics_port
        try:
            try:
                self._server, _ = start_http_server(port or 0, addr=self.plan.host, registry=self.metrics.registry)
            except OSError as e:  # a port we picked, taken since: any free one
                if not (self.plan.autoscale_port_picked and e.errno == errno.EADDRINUSE):
                    raise
                self._server, _ = start_http_server(0, addr=self.plan.host, registry=self.metrics.registry)
                self.plan.autoscale_metrics_port = int(self._server.server_address[1])
        except OSError as e:
            self.feed.stop()
            raise UpError(f"--autoscale-metrics-port {port}: {e}") from e

    def close(self) -> None:
        """Stop the feed and the metrics server."""
        self.feed.stop()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _members(self, role: str) -> list[Member]:
        """Members of a scaled role that count: not draining, not retired by their supervisor."""
        sup = self.cluster.supervisor
        return [m for m in self.cluster.members if SCALED_ROLE.get(m.role) == role and m.name not in self.draining
                and (sup is None or m.name in sup.watches and not sup.watches[m.name].retired)]

    def step(self, now: float) -> None:
        """One supervision tick: reap drained workers; every ``interval`` seconds, decide and act."""
        self._reap(now)
        if now < self.next_check:
            return
        self.next_check = now + self.interval
        demand, measured = self.feed.demand()
        if not measured or now - measured > max(5.0, 3 * self.interval):
            if not self.stale_said and now - self.started_at > max(5.0, 3 * self.interval):
                self.cluster.warn("tandem up: autoscale: no fresh demand reading; holding the worker counts")
                self.stale_said = True
            return
        self.stale_said = False
        from tandem.autoscale import describe, plan_actions, state_message

        members = {role: self._members(role) for role in self.policies}
        for role, ms in members.items():
            if any(not m.child.is_ready for m in ms):  # the cool-down runs from when the new workers serve
                self.decider.did_change(role, now)
        actions = plan_actions(self.decider, demand, {r: len(ms) for r, ms in members.items()}, now)
        for a in actions:
            policy = self.policies[a.role]
            if a.target > a.actual:
                free = self._free_slots(a.role)[:a.target - a.actual]  # a draining worker holds its slot
                if free:
                    a.target = a.actual + len(free)
                    self._decided(a, "up", describe(a, policy, "starting", [self._start(slot) for slot in free]), now)
                else:
                    a.target = a.actual
            elif a.target < a.actual:
                victims = self._victims(members[a.role], a.actual - a.target)
                for m in victims:
                    self._drain(m, now)
                self._decided(a, "down", describe(a, policy, "draining", [m.name for m in victims]), now)
            m = self.metrics
            m.demand.labels(a.role).set(a.demand.total)
            m.desired.labels(a.role).set(a.desired)
            m.workers.labels(a.role).set(a.target)
            m.draining.labels(a.role).set(sum(1 for w in self.draining if self._role_of(w) == a.role))
        counts = {a.role: sum(1 for w in self.draining if self._role_of(w) == a.role) for a in actions}
        for a in actions:
            a.actual = a.target
        self.feed.state = state_message(f"tandem-up-{os.getpid()}", self.plan.model_name, actions, self.policies,
                                        counts, self.last_action)

    def _role_of(self, worker_id: str) -> str:
        return next(SCALED_ROLE[r] for w, r, _ in self.plan.slots if w == worker_id)

    def _decided(self, a: Any, action: str, line: str, now: float) -> None:
        self.cluster.say(f"tandem up: {line}")
        self.metrics.decisions.labels(a.role, action).inc()
        self.last_action[a.role] = f"{action} to {a.target} at {time.strftime('%H:%M:%S')}"
        self.decider.did_change(a.role, now)

    def _free_slots(self, role: str) -> list[tuple[str, str, int]]:
        taken = {m.name for m in self.cluster.members}
        return [slot for slot in self.plan.slots if SCALED_ROLE[slot[1]] == role and slot[0] not in taken]

    def _start(self, slot: tuple[str, str, int]) -> str:
        wid, prole, port = slot
        child = self.make_child(wid, prole, port)
        child.start()
        self.cluster.members.append(Member(child, prole, port))
        assert self.cluster.supervisor is not None
        self.cluster.supervisor.add(child)
        return wid

    def _victims(self, members: list[Member], n: int) -> list[Member]:
        """The ``n`` least loaded (by their last reports), the newest first among equals."""
        order = {w: i for i, (w, _, _) in enumerate(self.plan.slots)}
        return sorted(members, key=lambda m: (self.feed.load(m.name), -order[m.name]))[:n]

    def _drain(self, m: Member, now: float) -> None:
        assert self.cluster.supervisor is not None
        self.cluster.supervisor.remove(m.name)  # its exit is on purpose, not a failure to restart
        m.child.terminate()
        self.draining[m.name] = now + self.cluster.drain_timeout + self.cluster.stop_timeout

    def _reap(self, now: float) -> None:
        sup = self.cluster.supervisor
        for m in list(self.cluster.members):
            if sup is not None and m.name in sup.watches and sup.watches[m.name].retired:
                sup.remove(m.name)  # exited by itself (drained from outside): its slot is free again
                self.cluster.members.remove(m)
        for name, kill_at in list(self.draining.items()):
            m = next(x for x in self.cluster.members if x.name == name)
            code = m.child.poll()
            if code is None and now > kill_at:
                self.cluster.warn(f"tandem up: autoscale: {name} did not finish draining in time; killing it")
                m.child.kill()
                code = m.child.poll()
            if code is not None:
                self.cluster.say(f"tandem up: autoscale: {name} drained and stopped ({describe_exit(code)})")
                self.cluster.members.remove(m)
                del self.draining[name]


def _snapshot(cluster: Cluster) -> list[tuple[int | None, int | None]]:
    """Every child's pid and metrics port (what the ready file says, rewritten when it changes)."""
    return [(m.child.pid, m.metrics_port) for m in cluster.members] + [
        (cluster.nats.pid if cluster.nats is not None else None, None)]


def _defaults(args: argparse.Namespace, plan: Plan, model_defaults: dict[str, Any]) -> str:
    """What the gateway gives a request that leaves max_tokens or a sampling field out, in words: the flags
    (``--gateway-args`` last, as the gateway reads them), then its environment, then the model's own."""
    from runtime.settings import default_max_tokens_from_env

    given = {name: getattr(args, f"default_{name}", None) for name in ("max_tokens", *(n for n, _ in SAMPLING_FLAGS))}
    for name in given:
        value = _flag_value(plan.gateway_args, f"--default-{name.replace('_', '-')}")
        if value is not None:
            given[name] = value
    try:
        cap = int(given.pop("max_tokens")) if given.get("max_tokens") is not None else default_max_tokens_from_env()
        sampling = {**model_defaults, **{k: float(v) for k, v in given.items() if v is not None}}
    except ValueError:
        return "(see the gateway's line)"  # the gateway will refuse it with a better message
    return describe_defaults(cap, sampling)


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


def _describe_scaling(plan: Plan) -> str:
    assert plan.autoscale is not None
    return "; ".join(f"{role} {p.min}..{p.max} (target {p.target:g} per worker, activation {p.activation:g})"
                     for role, p in plan.autoscale.items())


def _announce(cluster: Cluster, plan: Plan, url: str, nats_url: str, kernels: dict[str, str]) -> None:
    """The ready table; `kernels`: each worker's matmul path (engine.native.kernel_path), as /ready lists it."""
    body = json.dumps({"model": plan.served_name,
                       "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    cluster.say(f"tandem is up: model {plan.served_name}")
    cluster.say(f"  page        {url}/   (chat in the browser, and a live view of the cluster)")
    cluster.say(f"  OpenAI API  {url}/v1")
    if cluster.run is not None:
        cluster.say(f"  NATS        {nats_url}   (every process logs in with its own NKey; strangers are refused)")
        cluster.say(f"  watch       {cluster.run.watch_command(nats_url, plan.namespace)}   (read-only; "
                    "tandem status / tandem tail use it too)")
    else:
        cluster.say(f"  NATS        {nats_url}   (watch: nats sub '{plan.namespace}.>' -s {nats_url})")
    if cluster.nats is not None and cluster.nats.monitor_url:
        cluster.say(f"  monitoring  {cluster.nats.monitor_url}/jsz?consumers=true   (what KEDA's scaler reads)")
    for m in cluster.members:
        where = f"metrics :{m.metrics_port}" if m.metrics_port else f"metrics {url}/metrics"
        place = plan.placements[m.name].describe() if m.name in plan.placements else "any core"
        if kernels.get(m.name):
            place += f", kernels {kernels[m.name]}"
        cluster.say(f"  {m.name:<14} {m.role:<19} pid {m.child.pid:<8} {where:<15} {place}")
    if plan.autoscale is not None:
        cluster.say(f"  autoscale   {_describe_scaling(plan)}; metrics "
                    f"{url.rsplit(':', 1)[0]}:{plan.autoscale_metrics_port}/metrics")
    cluster.say(f"  placement   {plan.placement_note}; NATS and the gateway are light and run on any core "
                f"({format_cpus(available_cpus())})")
    if plan.defaults:
        cluster.say(f"  defaults    {plan.defaults}   (a request's own values win; --default-max-tokens, "
                    "--default-temperature, ...)")
    cluster.say("Try:")
    auth = " -H \"Authorization: Bearer $TANDEM_API_KEY\"" if os.environ.get("TANDEM_API_KEYS") else ""
    cluster.say(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'")
    if auth:
        cluster.say("  (API keys are on: set TANDEM_API_KEY to one of TANDEM_API_KEYS)")
    cluster.say("A child that dies is restarted; Ctrl-C stops everything.")


def _write_ready_file(path: Path, cluster: Cluster, plan: Plan, url: str, nats_url: str) -> None:
    info = {
        "url": url,
        "base_url": f"{url}/v1",
        "nats_url": nats_url,
        "model": plan.served_name,
        "namespace": plan.namespace,
        "pid": os.getpid(),
        "nats_pid": cluster.nats.pid if cluster.nats is not None else None,
        "nats_store": cluster.nats.store_dir if cluster.nats is not None else None,
        # the read-only debug login of our own NATS (None when joining one): nats-py's nkeys_seed, inbox_prefix
        "nats_debug_seed": str(cluster.run.debug.seed_file) if cluster.run is not None else None,
        "nats_debug_inbox": cluster.run.debug.inbox if cluster.run is not None else None,
        "autoscale_metrics": (f"{url.rsplit(':', 1)[0]}:{plan.autoscale_metrics_port}/metrics"
                              if plan.autoscale is not None else None),
        "children": [{"name": m.name, "role": m.role, "pid": m.child.pid, "metrics_port": m.metrics_port,
                      "restarts": cluster.restarts(m.name),
                      "placement": plan.placements[m.name].describe() if m.name in plan.placements else ""}
                     for m in cluster.members],
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, path)


def main(args: argparse.Namespace) -> int:
    """``tandem up`` entry point."""
    return run_up(args)
