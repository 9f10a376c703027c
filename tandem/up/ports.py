"""Ports for the gateway and the workers' metrics: the defaults while they are free, else free ones."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Callable

from tandem.up import UpError

DEFAULT_PORT = 8000
DEFAULT_METRICS_BASE = 9400


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


def bind_host(host: str) -> str:
    """The address to test a port on for a server that binds ``host`` (the IPv4 wildcard for any wildcard)."""
    return "0.0.0.0" if host in ("0.0.0.0", "::", "") else host


def metrics_ports(base: int | None, count: int, taken: set[int], host: str,
                  warn: Callable[[str], None]) -> list[int]:
    """``count`` metrics ports for servers on ``host``. ``base`` None: the default ones (from
    :data:`DEFAULT_METRICS_BASE` up), each one that is busy replaced by any free port, said in one warning;
    0: any free ports; else ``base`` and the ports after it, which must be free (UpError names a busy one)."""
    bind = bind_host(host)
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


def check_port(flag: str, port: int | None, count: int = 1) -> None:
    if port is not None and not (0 <= port and port + count - 1 <= 65535):
        raise UpError(f"{flag} must be 0 (any free port) to 65535, got {port}")


def gateway_port(args: argparse.Namespace, warn: Callable[[str], None]) -> int:
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
