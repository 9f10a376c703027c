"""Child processes: start one, keep its output tail, make it die with its parent, stop it TERM then KILL
(:mod:`runtime.supervisor` restarts the ones that die).

Why one module: ``tandem up``, the embedded ``nats-server`` (``bus/server.py``), ``bench/`` and the
test harnesses all start children and must all be able to say why one died (its exit status and
last lines), never leave an orphan behind, and stop it politely first. One :class:`ChildProcess`
does that for all of them.

Children run in their own session (a terminal's Ctrl-C reaches only the parent, which stops them
in its own order) and, on Linux, with ``PR_SET_PDEATHSIG`` = SIGTERM: the kernel tells the child
when the thread that started it dies, so a SIGKILLed parent leaves no orphan. libc is loaded in
the parent at import, so the forked child makes one system call before ``exec`` (no ``dlopen``
after ``fork``). The signal follows the *thread* that forked: start long-lived children from a
thread that outlives them (the main thread).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Protocol, TextIO

PR_SET_PDEATHSIG = 1


def _load_libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _load_libc()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """The kernel SIGTERMs this child when the thread that started it dies."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _interruptible() -> None:  # pragma: no cover - runs in the child between fork and exec
    """SIGINT at its default in the child, as from a terminal: a shell starts a background job (``cmd &``) with
    SIGINT ignored, which every child would inherit, and then a Ctrl-C sent to it (`ChildProcess.signal`) would do
    nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _child_setup(die_with_parent: bool) -> None:  # pragma: no cover - runs in the child between fork and exec
    _interruptible()
    if die_with_parent:
        _die_with_parent()


class ChildError(RuntimeError):
    """A child could not be started, or exited (or stayed silent) while we waited for it."""


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


class ChildProcess:
    """One child process with its stdout and stderr merged (or apart: ``stderr_apart``), read by threads.

    Every line is kept in a bounded tail (for "why did it die"), optionally echoed to ``echo``
    with ``prefix`` (default ``[name] ``), appended to ``log_path``, and passed to ``on_line``.
    ``ready_marker`` (a substring or a compiled pattern) is the line that says the child is up:
    :meth:`wait_ready` waits for it and :attr:`is_ready` tells whether it came. With
    ``stderr_apart`` stdout lines go to :attr:`tail` and stderr lines to :attr:`err_tail`
    (for tests of what a command prints where).
    """

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        echo: TextIO | None = None,
        prefix: str | None = None,
        log_path: str | os.PathLike[str] | None = None,
        ready_marker: str | re.Pattern[str] | None = None,
        on_line: Callable[[str], None] | None = None,
        die_with_parent: bool = True,
        tail_lines: int = 200,
        stderr_apart: bool = False,
    ) -> None:
        self.name = name
        self.cmd = list(cmd)
        self.env = env
        self.cwd = cwd
        self.echo = echo
        self.prefix = f"[{name}] " if prefix is None else prefix
        self.log_path = Path(log_path) if log_path is not None else None
        self.ready_marker = ready_marker
        self.on_line = on_line
        self.die_with_parent = die_with_parent
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.err_tail: collections.deque[str] | None = collections.deque(maxlen=tail_lines) if stderr_apart else None
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None
        self._ready = threading.Event()
        self._readers: list[threading.Thread] = []
        self._seen: list[tuple[str, threading.Event]] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ChildProcess({self.name}, pid={self.pid}, {describe_exit(self.poll())})"

    # ---- start -------------------------------------------------------------------------
    def start(self) -> ChildProcess:
        """Spawn it (its own session, parent-death signal); raises :class:`ChildError` if it cannot."""
        if self.running:
            raise ChildError(f"{self.name} is already running (pid {self.pid})")
        self.tail.clear()
        if self.err_tail is not None:
            self.err_tail.clear()
        self._ready.clear()
        try:
            self.proc = subprocess.Popen(
                self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE if self.err_tail is not None else subprocess.STDOUT,
                env=self.env, cwd=self.cwd, start_new_session=True,
                preexec_fn=functools.partial(_child_setup, self.die_with_parent),
            )
        except OSError as e:
            raise ChildError(f"cannot start {self.name} ({shlex.join(self.cmd)}): {e}") from e
        self.started_at = time.monotonic()
        log = open(self.log_path, "a", encoding="utf-8") if self.log_path is not None else None  # noqa: SIM115
        pipes = [(self.proc.stdout, self.tail)]
        if self.err_tail is not None:
            pipes.append((self.proc.stderr, self.err_tail))
        self._readers = [threading.Thread(target=self._read, args=(pipe, sink, log), name=f"out-{self.name}",
                                          daemon=True) for pipe, sink in pipes]
        for t in self._readers:
            t.start()
        return self

    def _read(self, pipe: IO[bytes], sink: collections.deque[str], log: TextIO | None) -> None:
        try:
            for raw in pipe:
                self._line(raw.decode("utf-8", "replace").rstrip("\r\n"), sink, log)
        finally:
            pipe.close()
            if log is not None and sink is self.tail:
                with self._lock:
                    log.close()

    def _line(self, line: str, sink: collections.deque[str], log: TextIO | None) -> None:
        sink.append(line)
        if self.echo is not None:
            with contextlib.suppress(OSError, ValueError):
                print(f"{self.prefix}{line}", file=self.echo, flush=True)
        if self.ready_marker is not None and not self._ready.is_set() and _matches(self.ready_marker, line):
            self._ready.set()
        with self._lock:
            if log is not None and not log.closed:
                log.write(line + "\n")
                log.flush()
            for needle, event in self._seen:
                if needle in line:
                    event.set()
        if self.on_line is not None:
            self.on_line(line)

    # ---- state -------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """Its process id once started."""
        return self.proc.pid if self.proc is not None else None

    def poll(self) -> int | None:
        """Its exit status (negative: the signal that killed it), or None while it runs."""
        return self.proc.poll() if self.proc is not None else None

    @property
    def running(self) -> bool:
        """Started and not exited."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def is_ready(self) -> bool:
        """Its ready marker was seen (always False without a marker)."""
        return self._ready.is_set()

    def last_lines(self, n: int = 20) -> str:
        """The last ``n`` lines it wrote (after its output ended, if it exited)."""
        if self.poll() is not None:
            self._join_readers()
        return "\n".join(list(self.tail)[-n:]) if n else ""

    def _join_readers(self) -> None:
        for t in self._readers:
            t.join(timeout=2.0)

    def why(self, n: int = 20) -> str:
        """``name (pid N) killed by SIGKILL``, then its last lines indented: what a person needs."""
        lines = self.last_lines(n).splitlines() or ["(no output)"]
        return f"{self.name} (pid {self.pid}) {describe_exit(self.poll())}; its last output:\n" + "\n".join(
            f"  | {line}" for line in lines)

    # ---- waiting -----------------------------------------------------------------------
    def wait_ready(self, timeout: float) -> None:
        """Until the ready marker; :class:`ChildError` (with its last lines) if it exits or ``timeout`` passes."""
        self._wait(self._ready, "its ready line", timeout)

    def wait_for(self, needle: str, timeout: float) -> None:
        """Until a line containing ``needle`` (also one written before this call that is still in the tail)."""
        event = threading.Event()
        with self._lock:
            if any(needle in line for line in (*self.tail, *(self.err_tail or ()))):
                return
            self._seen.append((needle, event))
        try:
            self._wait(event, repr(needle), timeout)
        finally:
            with self._lock:
                self._seen.remove((needle, event))

    def _wait(self, event: threading.Event, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not event.wait(0.05):
            if self.poll() is not None:
                self._join_readers()
                if event.is_set():
                    return
                raise ChildError(f"{self.name} exited before {what}: {self.why(40)}")
            if time.monotonic() > deadline:
                raise ChildError(f"{self.name} did not write {what} within {timeout:g}s; "
                                 f"last output:\n{self.last_lines(40)}")

    def wait(self, timeout: float | None = None) -> int | None:
        """Its exit status once it exits by itself; None if still running after ``timeout``."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    # ---- stopping ----------------------------------------------------------------------
    def signal(self, sig: int) -> None:
        """Send ``sig`` by PID (no-op once it exited)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def terminate(self) -> None:
        """SIGTERM (a tandem process drains, then exits)."""
        self.signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL and reap it."""
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL. Returns the exit status."""
        stop_all([self], timeout)
        return self.poll()


def _matches(marker: str | re.Pattern[str], line: str) -> bool:
    return marker in line if isinstance(marker, str) else marker.search(line) is not None


class Stoppable(Protocol):
    """What :func:`stop_all` needs of a child."""

    name: str

    @property
    def pid(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def stop_all(children: Iterable[Stoppable], timeout: float, force: Callable[[], bool] = lambda: False,
             log: Callable[[str], None] | None = None) -> None:
    """SIGTERM all of ``children`` at once, wait up to ``timeout`` (or until ``force()``), SIGKILL the rest."""
    alive = [c for c in children if c.poll() is None]
    for c in alive:
        c.terminate()
    deadline = time.monotonic() + timeout
    while any(c.poll() is None for c in alive) and time.monotonic() < deadline and not force():
        time.sleep(0.05)
    for c in alive:
        if c.poll() is None:
            if log is not None:
                log(f"{c.name} (pid {c.pid}) did not stop within {timeout:g}s of SIGTERM; killing it")
            c.kill()
