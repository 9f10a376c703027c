"""The children of one ``tandem up``: who they are, their supervision, and the order they stop in."""

from __future__ import annotations

import contextlib
import os
import select
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TextIO

from runtime.health import METRICS_AT
from runtime.processes import ChildProcess, stop_all
from runtime.supervisor import GiveUp, RestartPolicy, Supervisor
from tandem.local_run import LocalRun


class Wakeup:
    """What ``tandem up``'s loops sleep on instead of a fixed tick: a poke from a signal handler (Ctrl-C,
    SIGTERM, SIGCHLD when a child exits) or from a child's reader thread (it is ready, or its metrics moved)."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._closed = False

    def poke(self) -> None:
        """Wake the sleeper (from any thread or a signal handler; a full pipe is already a wake-up)."""
        if self._closed:  # a reader thread's last line after the run ended
            return
        with contextlib.suppress(OSError):
            os.write(self._write, b"\0")

    def fileno(self) -> int:
        return self._read

    def wait(self, timeout: float) -> bool:
        """Sleep until poked or ``timeout`` seconds; True when poked."""
        poked = bool(select.select([self._read], [], [], max(0.0, timeout))[0])
        if poked:
            self.clear()
        return poked

    def clear(self) -> None:
        """Forget the pokes so far."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read, 4096):
                continue

    def close(self) -> None:
        """Once the signal handlers that poke it are gone."""
        self._closed = True
        os.close(self._read)
        os.close(self._write)


@dataclass
class Member:
    """One child of the cluster: its process and what it is. ``wake`` is called when a line changes what
    the supervision loop knows: the child became ready, or says where its metrics are."""

    child: ChildProcess
    role: str  # a pipeline role, or "gateway"
    metrics_port: int | None = None
    wake: Callable[[], None] | None = None
    _was_ready: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.child.on_line = self._line

    def _line(self, line: str) -> None:
        at = METRICS_AT.match(line) if self.metrics_port else None
        if at:  # a worker says at each start where its metrics are (moved if the port was taken)
            self.metrics_port = int(at.group(1))
        if self.wake is not None and (at or self.child.ready_marker is not None and self.child.is_ready
                                      and not self._was_ready):
            self.wake()
        self._was_ready = self.child.is_ready

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
        self.wakeup = Wakeup()

    def add(self, child: ChildProcess, role: str, metrics_port: int | None = None) -> Member:
        """A new member (not yet started); its ready line and metrics line wake the supervision loop."""
        member = Member(child, role, metrics_port, wake=self.wakeup.poke)
        self.members.append(member)
        return member

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` or until something happens: a signal, a child's exit, ready line or metrics line."""
        self.wakeup.wait(seconds)

    def on_child_exit(self, signum: int, frame: FrameType | None) -> None:
        """SIGCHLD: the supervision loop wakes to see which child died."""
        self.wakeup.poke()

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
        self.wakeup.poke()

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


def snapshot(cluster: Cluster) -> list[tuple[int | None, int | None]]:
    """Every child's pid and metrics port (what the ready file says, rewritten when it changes)."""
    return [(m.child.pid, m.metrics_port) for m in cluster.members] + [
        (cluster.nats.pid if cluster.nats is not None else None, None)]
