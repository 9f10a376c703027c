"""What ``tandem up`` starts, decided from its flags before any process runs: the workers, their ports and
cores, and each child's command line."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from gateway.server import SAMPLING_FLAGS, describe_defaults, sampling_default_args
from runtime.placement import WorkerPlacement, plan_layout
from runtime.processes import ChildProcess
from tandem.up import UpError
from tandem.up.autoscale import SCALED_ROLE, RolePolicy, parse_ranges, parse_role_numbers, policies
from tandem.up.ports import check_port, gateway_port, metrics_ports


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


def tandem_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "tandem.cli", *args]


def make_plan(args: argparse.Namespace, own_nats: bool, warn: Callable[[str], None]) -> Plan:
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
    scaling = autoscale_policies(args)
    decode = args.decode
    if scaling is not None:
        prefill = scaling["prefill"].max if "prefill" in scaling else 0 if args.aggregated else prefill
        decode = scaling["decode"].max if "decode" in scaling else decode
    check_port("--port", args.port)
    check_port("--nats-port", args.nats_port)
    check_port("--nats-monitor-port", args.nats_monitor_port)
    if args.nats_monitor_port and args.nats_url:
        raise UpError("--nats-monitor-port is for the embedded NATS; with --nats-url, use that server's monitoring")
    check_port("--metrics-port-base", args.metrics_port_base, decode + prefill + (scaling is not None))
    if args.default_max_tokens is not None and args.default_max_tokens < 0:
        raise UpError(f"--default-max-tokens must not be negative, got {args.default_max_tokens}")
    check_port("--autoscale-metrics-port", args.autoscale_metrics_port)
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
    port = gateway_port(args, warn)
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
    gateway_id = flag_value(gateway_extra, "--gateway-id") or f"gw-{uuid.uuid4().hex[:8]}"
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
    if args.kv_dtype:
        serve_args += ["--kv-dtype", args.kv_dtype]
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


def flag_value(words: list[str], flag: str) -> str | None:
    """The value ``words`` give ``flag`` (``--flag v`` or ``--flag=v``; the last one wins), or None."""
    value = None
    for i, w in enumerate(words):
        if w == flag and i + 1 < len(words):
            value = words[i + 1]
        elif w.startswith(flag + "="):
            value = w.split("=", 1)[1]
    return value


def autoscale_policies(args: argparse.Namespace) -> dict[str, RolePolicy] | None:
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
    cmd = tandem_command(*logging_args, "serve", "--pipeline-role", role, "--worker-id", worker_id,
                  "--nats-url", nats_url, "--metrics-port", str(metrics_port),
                  *(["--metrics-port-fallback"] if plan.metrics_fallback else []), *placement, *plan.serve_args)
    return ChildProcess(worker_id, cmd, env=dict(env), echo=echo, ready_marker=f" {worker_id} ready")


def gateway_child(plan: Plan, nats_url: str, logging_args: tuple[str, ...], env: dict[str, str],
                  echo: TextIO | None) -> ChildProcess:
    """The gateway process: its command line and environment."""
    cmd = tandem_command(*logging_args, "gateway", "--nats-url", nats_url, *plan.gateway_args)
    return ChildProcess("gateway", cmd, env=dict(env), echo=echo, ready_marker="tandem gateway ready")


def request_defaults(args: argparse.Namespace, plan: Plan, model_defaults: dict[str, Any]) -> str:
    """What the gateway gives a request that leaves max_tokens or a sampling field out, in words: the flags
    (``--gateway-args`` last, as the gateway reads them), then its environment, then the model's own."""
    from runtime.settings import default_max_tokens_from_env

    given = {name: getattr(args, f"default_{name}", None) for name in ("max_tokens", *(n for n, _ in SAMPLING_FLAGS))}
    for name in given:
        value = flag_value(plan.gateway_args, f"--default-{name.replace('_', '-')}")
        if value is not None:
            given[name] = value
    try:
        cap = int(given.pop("max_tokens")) if given.get("max_tokens") is not None else default_max_tokens_from_env()
        sampling = {**model_defaults, **{k: float(v) for k, v in given.items() if v is not None}}
    except ValueError:
        return "(see the gateway's line)"  # the gateway will refuse it with a better message
    return describe_defaults(cap, sampling)
