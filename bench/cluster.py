"""A real nats-server, real `tandem serve` workers and whole `tandem up` clusters, for tests and benchmarks."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import nats
import nats.errors

from bus.subjects import Subjects

MODEL = "smollm2-135m-instruct"


class Worker:
    def __init__(self, role: str, worker_id: str, nats_url: str, log_dir: Path, *extra: str):
        self.role, self.worker_id = role, worker_id
        self.log_path = log_dir / f"{worker_id}.log"
        env = {**os.environ, "UCX_NET_DEVICES": "lo", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "tandem.cli", "--log-level", "INFO", "serve", "--pipeline-role", role,
               "--worker-id", worker_id, "--nats-url", nats_url, *extra]
        if "--num-blocks" not in extra:
            cmd += ["--num-blocks", "160"]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, env=env, text=True)
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            if "ready" in line:
                self.ready.set()

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {self.worker_id} not ready (exit {self.proc.poll()}):\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text().splitlines()[-n:])

    def stop(self, timeout: float = 20.0) -> int | None:
        stop_process(self.proc, signal.SIGTERM, timeout)
        self.log.close()
        return self.proc.returncode

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(5)


def start_workers(specs: list[tuple], nats_url: str, log_dir: Path) -> list[Worker]:
    workers = [Worker(role, wid, nats_url, log_dir, *extra) for role, wid, *extra in specs]
    try:
        for w in workers:
            w.wait_ready()
    except Exception:
        for w in workers:
            w.stop(5)
        raise
    return workers


class Client:
    """What a gateway (or a person with the `nats` CLI) does: publish JSON, read the stream."""

    def __init__(self, nats_url: str, namespace: str = "tandem", model: str = MODEL):
        self.url = nats_url
        self.subjects = Subjects(model, namespace)
        self.namespace = namespace

    async def __aenter__(self) -> Client:
        self.nc = await nats.connect(self.url)
        self.js = self.nc.jetstream()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.nc.close()

    def request_body(self, rid: str, prompt_ids: list[int], **sampling) -> dict:
        sampling.setdefault("max_tokens", 16)
        sampling.setdefault("temperature", 0.0)
        return {"kind": "generate_request", "request_id": rid, "prompt_ids": prompt_ids,
                "stream_subject": self.subjects.stream("gwtest", rid), "sampling": sampling,
                "deadline": time.time() + 120}

    async def start(self, rid: str, prompt_ids: list[int], worker: str | None = None, **kw):
        """Publish a request; returns the stream subscription."""
        target = kw.pop("target_endpoint", None)
        body = self.request_body(rid, prompt_ids, **kw)
        if target:
            body["target_endpoint"] = target
        sub = await self.nc.subscribe(body["stream_subject"])
        data = json.dumps(body).encode()
        if worker:
            await self.nc.publish(self.subjects.generate_worker(worker), data)
        else:
            await self.js.publish(self.subjects.generate_pool, data)
        return sub

    @staticmethod
    async def collect(sub, timeout: float = 120.0) -> dict:
        """Read a stream to its end: {'token_ids', 'text', 'finish' or 'error', 'messages'}."""
        out = {"token_ids": [], "text": "", "messages": []}
        deadline = time.monotonic() + timeout
        while True:
            msg = await sub.next_msg(timeout=max(0.1, deadline - time.monotonic()))
            d = json.loads(msg.data)
            out["messages"].append(d)
            if d["kind"] == "stream_tokens":
                out["token_ids"] += d["token_ids"]
                out["text"] += d["text"]
            else:
                out["finish" if d["kind"] == "stream_finish" else "error"] = d
                await sub.unsubscribe()
                return out

    async def generate(self, rid: str, prompt_ids: list[int], **kw) -> dict:
        return await self.collect(await self.start(rid, prompt_ids, **kw))

    async def stats(self, role: str, worker_id: str, timeout: float = 15.0) -> dict:
        """The worker's next load report (raises nats.errors.TimeoutError after ``timeout``)."""
        sub = await self.nc.subscribe(self.subjects.stats(role, worker_id))
        try:
            return json.loads((await sub.next_msg(timeout=timeout)).data)
        finally:
            await sub.unsubscribe()

    async def wait_all_free(self, workers: list[Worker], timeout: float = 30.0, stats_timeout: float = 15.0) -> None:
        """Until every worker reports all KV blocks free and nothing running.

        A report that is late (a busy machine) is waited for again, up to the overall ``timeout``.
        """
        deadline = time.monotonic() + timeout
        last: dict[str, dict | None] = {w.worker_id: None for w in workers}
        while True:
            ok = True
            for w in workers:
                left = deadline - time.monotonic()
                if left <= 0:
                    ok = False
                    break
                try:
                    st = await self.stats(w.role, w.worker_id, timeout=min(stats_timeout, left))
                except nats.errors.TimeoutError:
                    ok = False
                    continue
                last[w.worker_id] = st
                ok &= st["free_blocks"] == st["total_blocks"] and st["running"] == 0
            if ok:
                return
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.3)
        held = {k: (v["free_blocks"], v["total_blocks"], v["running"]) if v else "no report" for k, v in last.items()}
        raise AssertionError(f"blocks still held after {timeout:g}s: {held}")


class Up:
    """A `tandem up` child process started on free ports, known by its ready file."""

    def __init__(self, log_dir: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 300.0):
        self.log_path = log_dir / "up.log"
        ready = log_dir / "ready.json"
        cmd = [sys.executable, "-m", "tandem.cli", "up", "--port", "0", "--nats-port", "0", "--metrics-port-base",
               "0", "--ready-file", str(ready), "--quiet", *args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"tandem up {' '.join(args)} did not become ready:\n{self.log_tail()}")
            time.sleep(0.2)
        self.info = json.loads(ready.read_text())

    @property
    def url(self) -> str:
        return self.info["url"]

    def child(self, name: str) -> dict:
        """The ready file's entry of child ``name`` (pid, role, placement)."""
        return next(c for c in self.info["children"] if c["name"] == name)

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout: float = 60.0) -> None:
        """Ctrl-C, then SIGKILL after ``timeout``."""
        stop_process(self.proc, signal.SIGINT, timeout)


def stop_process(proc: subprocess.Popen, sig: int, timeout: float) -> None:
    """Send ``sig`` to a child still running; SIGKILL it if it has not exited within ``timeout``."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def cpus_allowed(pid: int) -> set[str]:
    """``Cpus_allowed_list`` of every thread of process ``pid`` (what pinning left it)."""
    out: set[str] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= {line.split()[1] for line in (task / "status").read_text().splitlines()
                if line.startswith("Cpus_allowed_list:")}
    return out
