"""``tandem up`` from start to stop: the plan, NATS and its streams, the children, /ready, supervision."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TextIO

from bus.connection import connect
from bus.options import BusOptions
from bus.subjects import Subjects
from runtime.processes import ChildError
from runtime.supervisor import RestartPolicy
from tandem.local_run import OWNER, LocalRun
from tandem.up import UpError
from tandem.up.announce import announce, write_ready_file
from tandem.up.cluster import Cluster, snapshot
from tandem.up.plan import gateway_child, make_plan, request_defaults, worker_child
from tandem.up.ports import port_free
from tandem.up.scaler import Scaler

#: variables that log a process in to some NATS: our own embedded one gives each child its own instead
_NATS_LOGIN_ENV = ("TANDEM_NATS_USER", "TANDEM_NATS_PASSWORD", "TANDEM_NATS_TOKEN", "TANDEM_NATS_NKEY_SEED",
                   "TANDEM_NATS_CREDS", "TANDEM_NATS_INBOX_PREFIX", "TANDEM_NATS_TLS_CA", "TANDEM_NATS_TLS_CERT",
                   "TANDEM_NATS_TLS_KEY")
#: seconds between two asks of the gateway's /ready while starting (a signal or a child's exit wakes sooner)
READY_PROBE_S = 0.25
#: the longest the supervision loop sleeps with nothing due: a child's exit, a signal or a ready line wake it
IDLE_CHECK_S = 5.0


def run_up(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Start the cluster, wait for /ready, supervise; 0 after Ctrl-C, 1 when it had to give up."""
    import httpx

    from bus.options import BusConnectError
    from bus.server import EmbeddedNats, NatsServerError
    from bus.streams import StreamConfigError
    from engine.model_files import load_text

    cluster = Cluster(out, err, args.drain_timeout, args.stop_timeout)
    scaling: Scaler | None = None
    previous = {s: signal.signal(s, cluster.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, cluster.on_child_exit)
    echo = None if args.quiet else err
    log_level = getattr(args, "log_level", None) or "WARNING"
    logging_args = ("--log-level", log_level, "--log-format", getattr(args, "log_format", None) or "text")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("UCX_NET_DEVICES", "lo")  # every process is on this machine
    env.pop("TANDEM_RESTARTS", None)
    try:
        policy = RestartPolicy(mode=args.restart, delay=args.restart_delay, max_delay=args.restart_max_delay)
        own_nats = not args.nats_url
        plan = make_plan(args, own_nats, cluster.warn)
        # 0. the model, once: a bad one is one message here, not one per child
        text = load_text(plan.model)
        cluster.say(f"tandem up: model {plan.model_name} ({text.path}): {text.config.num_layers} layers, context "
                    f"{text.config.max_position}, vocabulary {text.config.vocab_size}")
        plan.defaults = request_defaults(args, plan, text.sampling_defaults)
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
        if not asyncio.run(unless_stopped(cluster, ensure_streams(bus, plan.model_name, plan.namespace, 15.0),
                                           30.0)):
            cluster.say(f"tandem up: {cluster.stop_reason} during start-up; stopping")
            return 0

        def login(name: str) -> dict[str, str]:
            return {**env, **(cluster.run.env(name) if cluster.run is not None else {})}

        # 2. workers, 3. gateway
        for wid, role, mport in plan.workers:
            cluster.add(worker_child(plan, wid, role, mport, nats_url, logging_args, login(wid), echo), role, mport)
        cluster.add(gateway_child(plan, nats_url, logging_args, login(plan.gateway_id), echo), "gateway")
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
                ok, why, workers = ready(url, expected, client)
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
                cluster.sleep(READY_PROBE_S)  # /ready is another process's answer: asked again after this
        # 5. the scaler, then tell the person
        if plan.autoscale is not None:
            scaling = Scaler(cluster, plan, lambda wid, role, mport: worker_child(
                plan, wid, role, mport, nats_url, logging_args, login(wid), echo), bus,
                args.autoscale_cooldown, args.autoscale_interval)
            scaling.start()
        announce(cluster, plan, url, nats_url, {w: str(info.get("kernels") or "") for w, info in workers.items()})
        ready_file = Path(args.ready_file) if args.ready_file else None
        if ready_file is not None:
            write_ready_file(ready_file, cluster, plan, url, nats_url)
        # 6. supervise (and scale)
        seen = snapshot(cluster)
        while not cluster.stop_reason:
            if not cluster.check():
                return 1
            if scaling is not None:
                scaling.step(time.monotonic())
            if ready_file is not None and snapshot(cluster) != seen:
                seen = snapshot(cluster)
                write_ready_file(ready_file, cluster, plan, url, nats_url)
            due = [time.monotonic() + IDLE_CHECK_S, cluster.supervisor.next_due(),
                   scaling.next_due() if scaling is not None else None]
            cluster.sleep(min(t for t in due if t is not None) - time.monotonic())
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
        cluster.wakeup.close()
        if args.ready_file:
            with contextlib.suppress(OSError):
                Path(args.ready_file).unlink()

def main(args: argparse.Namespace) -> int:
    """``tandem up`` entry point."""
    return run_up(args)


async def ensure_streams(bus: BusOptions, model_name: str, namespace: str, timeout: float) -> None:
    from bus.streams import ensure_streams
    from runtime.settings import Settings

    nc = await connect(dataclasses.replace(bus, connect_timeout=timeout), name="tandem-up")
    try:
        await ensure_streams(nc, Subjects(model_name, namespace), replicas=Settings.from_env().stream_replicas,
                             timeout=timeout)
    finally:
        await nc.close()


def ready(url: str, expected: set[str], client: Any) -> tuple[bool, str, dict[str, dict[str, Any]]]:
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


async def unless_stopped(cluster: Cluster, work: Coroutine[Any, Any, Any], timeout: float) -> bool:
    """Run ``work`` (deadline ``timeout``); False, abandoning it, as soon as Ctrl-C/SIGTERM arrives."""
    if cluster.stop_reason:
        work.close()  # never started: no "never awaited" warning
        return False
    loop = asyncio.get_running_loop()
    stopped = loop.create_future()

    def poked() -> None:
        cluster.wakeup.clear()
        if cluster.stop_reason and not stopped.done():
            stopped.set_result(cluster.stop_reason)

    task = asyncio.ensure_future(work)
    loop.add_reader(cluster.wakeup.fileno(), poked)
    try:
        await asyncio.wait({task, stopped}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        loop.remove_reader(cluster.wakeup.fileno())
    if task.done():
        task.result()
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    if stopped.done():
        return False
    raise asyncio.TimeoutError(f"not done within {timeout:g}s")
