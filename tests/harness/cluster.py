"""Clusters and processes the tests run: `tandem up` and NATS with `tandem serve` workers (one factory each, so a
module's shared cluster and a destructive test's own one start and stop alike), CLI children, and what a test reads
of a running cluster."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.cluster import Client, TandemUp, Worker, start_workers, tandem_cmd
from bus.server import EmbeddedNats
from runtime.processes import ChildProcess
from tests.harness.wait import wait_until

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def worker_cluster(logs: Path, specs: list[tuple]) -> Iterator[tuple[EmbeddedNats, dict[str, Worker]]]:
    """NATS (with a store of its own in ``logs``: a NATS restart keeps it) and the workers of ``specs``
    (``(role, worker id, *flags)``), ready; all stopped when the block ends."""
    srv = EmbeddedNats(store_dir=logs / "nats")
    srv.start()
    try:
        workers = start_workers(specs, srv.url, logs)
        try:
            yield srv, {w.worker_id: w for w in workers}
        finally:
            for w in workers:
                w.stop()
    finally:
        srv.stop()


async def know_prefill_workers(url: str, *decode_workers: tuple[str, str, int], timeout: float = 60.0) -> None:
    """Until each decode worker (``(namespace, worker id, how many)``) counts that many prefill workers alive
    (`bench.cluster.Client.wait_prefill_workers`)."""

    async def knows(namespace: str, worker_id: str, count: int) -> None:
        async with Client(url, namespace) as c:
            await c.wait_prefill_workers(worker_id, count, timeout)

    await asyncio.gather(*(knows(*w) for w in decode_workers))


@contextlib.contextmanager
def tandem_up(log_dir: Path, *args: str, env: dict[str, str] | None = None, start_timeout: float = 300.0,
              stop_timeout: float = 90.0) -> Iterator[TandemUp]:
    """`tandem up ARGS` on free ports with its logs in ``log_dir``, ready; stopped (Ctrl-C, then SIGKILL after
    ``stop_timeout``) when the block ends, whatever the test did to it.

    A module fixture shares one; a test that kills or stops part of it takes its own from a function-scoped
    fixture, so no test depends on running before or after another.
    """
    cluster = TandemUp(log_dir, *args, env=env).start(start_timeout)
    try:
        yield cluster
    finally:
        cluster.stop(stop_timeout)


def status_json(up: TandemUp, *flags: str) -> dict[str, Any]:
    """`tandem status --json FLAGS` against the cluster's NATS (fails on a non-zero exit)."""
    r = subprocess.run([*tandem_cmd("status", "--json", *flags), "--nats-url", up.info["nats_url"]],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def wait_restarted(up: TandemUp, name: str, restarts: int, timeout: float = 180.0) -> None:
    """Until ``name`` was restarted ``restarts`` times and reports on the bus again (fails at once if `tandem up`
    itself died)."""
    def back() -> bool:
        assert up.child.running, up.output()[-3000:]
        if up.child_info(name)["restarts"] < restarts:
            return False
        rows = {w["worker_id"]: w for w in status_json(up, "--wait", "1.5")["workers"]}
        return rows.get(name, {}).get("restarts", 0) >= restarts and rows[name]["stats_error"] is None

    wait_until(back, timeout, lambda: f"{name} restarted {restarts} times:\n{up.output()[-3000:]}", interval=0.5)


def busy_worker(up: TandemUp, role: str, timeout: float = 120.0) -> str:
    """A worker of ``role`` that reports work right now (waits for one)."""
    def busy() -> str | None:
        return next((w["worker_id"] for w in httpx.get(f"{up.url}/ready", timeout=10).json()["workers"]
                     if w["role"] == role and w["running"] > 0), None)

    return wait_until(busy, timeout, f"a busy {role} worker")


class Proc(ChildProcess):
    """A CLI child whose stdout and stderr lines are kept apart (what the CLI prints where matters)."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        super().__init__(cmd[3] if len(cmd) > 3 else "cli", cmd, cwd=ROOT, stderr_apart=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.start()

    @property
    def out(self) -> list[str]:
        return list(self.tail)

    @property
    def err(self) -> list[str]:
        return list(self.err_tail or ())

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; kills the process and fails if it runs past ``timeout``."""
        rc = super().wait(timeout)
        if rc is None:
            self.kill()
            raise AssertionError(f"still running after {timeout}s:\n{self.text()}")
        self.last_lines(0)  # its output is read to the end
        return rc

    def text(self) -> str:
        return "\n".join(["--- stdout", *self.out[-60:], "--- stderr", *self.err[-60:]])


def run_cli(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`tandem ARGS` run to its end from the checkout, its output captured."""
    return subprocess.run(tandem_cmd(*args), capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})
