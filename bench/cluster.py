"""A real nats-server, real `tandem serve` workers and whole `tandem up` clusters, for tests and benchmarks."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import nats
import nats.errors

from bus.connection import connect
from bus.options import BusOptions
from bus.subjects import Subjects
from runtime.processes import ChildProcess

MODEL = "smollm2-135m-instruct"


def tandem_cmd(*args: str) -> list[str]:
    """The command line of ``tandem ARGS`` run from this checkout's Python."""
    return [sys.executable, "-m", "tandem.cli", *args]


class Worker:
    """One `tandem serve` process; its output goes to ``<log_dir>/<worker id>.log``."""

    def __init__(self, role: str, worker_id: str, nats_url: str, log_dir: Path, *extra: str,
                 env: dict[str, str] | None = None):
        self.role, self.worker_id = role, worker_id
        self.log_path = log_dir / f"{worker_id}.log"
        self.env = {**os.environ, "UCX_NET_DEVICES": "lo", "PYTHONUNBUFFERED": "1", **(env or {})}
        cmd = tandem_cmd("--log-level", "INFO", "serve", "--pipeline-role", role, "--worker-id", worker_id,
                         "--nats-url", nats_url, *extra)
        if "--num-blocks" not in extra:
            cmd += ["--num-blocks", "160"]
        if "--threads" not in extra:  # several workers share the host's cores: torch's default, every core each,
            cmd += ["--threads", "1"]  # oversubscribes them and each operation's barrier waits on a pushed-off thread
        self.child = ChildProcess(worker_id, cmd, env=self.env, log_path=self.log_path,
                                  ready_marker=f" {worker_id} ready")
        self.child.start()

    @property
    def proc(self) -> Any:
        """The running process (``pid``, ``poll()``)."""
        return self.child.proc

    def wait_ready(self, timeout: float = 240.0) -> None:
        self.child.wait_ready(timeout)

    def tail(self, n: int = 40) -> str:
        return self.child.last_lines(n)

    def stop(self, timeout: float = 20.0) -> int | None:
        return self.child.stop(timeout)

    def kill(self) -> None:
        self.child.kill()

    def restart(self, timeout: float = 240.0) -> None:
        """Start it again (same id, new incarnation) and wait until it is ready."""
        self.child.start()
        self.wait_ready(timeout)


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


class TandemUp:
    """`tandem up` as a child process on free ports, with a ready file (rewritten after each restart)."""

    def __init__(self, log_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.ready_file = log_dir / "ready.json"
        self.log_path = log_dir / "up.log"
        cmd = tandem_cmd("up", "--port", "0", "--nats-port", "0", "--metrics-port-base", "0",
                         "--ready-file", str(self.ready_file), *args)
        self.child = ChildProcess("tandem-up", cmd, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                  log_path=self.log_path, tail_lines=2000)

    def start(self, timeout: float = 300.0) -> TandemUp:
        """Start it and wait for its ready file (RuntimeError with its output if it exits first)."""
        self.child.start()
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.child.poll() is not None or time.monotonic() > deadline:
                self.child.kill()
                raise RuntimeError(f"tandem up did not become ready ({self.child!r}):\n{self.output()[-4000:]}")
            time.sleep(0.2)
        return self

    @property
    def info(self) -> dict[str, Any]:
        """The ready file now: url, base_url, nats_url, pid, nats_pid, children (name, role, pid, restarts)."""
        return json.loads(self.ready_file.read_text())

    @property
    def url(self) -> str:
        return self.info["url"]

    @property
    def base_url(self) -> str:
        return self.info["base_url"]

    def child_info(self, name: str) -> dict[str, Any]:
        """One child's entry of the ready file."""
        return next(c for c in self.info["children"] if c["name"] == name)

    def output(self) -> str:
        """Everything it and its children wrote so far."""
        return self.child.last_lines(2000)

    def interrupt(self) -> None:
        """Ctrl-C."""
        self.child.signal(signal.SIGINT)

    def stop(self, timeout: float = 90.0) -> int | None:
        """Ctrl-C and wait (SIGKILL after ``timeout``); its exit status."""
        if self.child.running:
            self.interrupt()
            if self.child.wait(timeout) is None:
                self.child.kill()
        return self.child.poll()


class Client:
    """What a gateway (or a person with the `nats` CLI) does: publish JSON, read the stream."""

    def __init__(self, nats_url: str, namespace: str = "tandem", model: str = MODEL):
        self.url = nats_url
        self.subjects = Subjects(model, namespace)
        self.namespace = namespace

    async def __aenter__(self) -> Client:
        # TANDEM_NATS_* log it in where the bus is closed (as the gateway user: it may send and read streams)
        self.nc = await connect(BusOptions.from_env(servers=self.url, connect_timeout=30.0), name="bench-client")
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

    async def wait_prefill_workers(self, worker_id: str, count: int, timeout: float = 60.0) -> None:
        """Until decode worker ``worker_id``'s load report counts ``count`` prefill workers alive
        (`WorkerStats.prefill_workers`): before that it prefills the prompts it could send them."""
        deadline = time.monotonic() + timeout
        while (seen := (await self.stats("decode_only", worker_id, timeout=timeout))["prefill_workers"]) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{worker_id} counts {seen} prefill workers alive after {timeout:g} s, not {count}")

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


def cpus_allowed(pid: int) -> set[str]:
    """``Cpus_allowed_list`` of every thread of process ``pid`` (what pinning left it)."""
    out: set[str] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= {line.split()[1] for line in (task / "status").read_text().splitlines()
                if line.startswith("Cpus_allowed_list:")}
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.cluster generate``: one greedy chat sent straight to a worker on the bus, as JSON.

    What tests on emulated hosts run on a host (logged in through TANDEM_NATS_*) to compare two workers'
    answers token for token, bypassing the gateway's routing.
    """
    import argparse
    import uuid

    from engine.model_files import load_text

    p = argparse.ArgumentParser(prog="python -m bench.cluster", description=main.__doc__)
    p.add_argument("command", choices=["generate"])
    p.add_argument("--nats-url", required=True)
    p.add_argument("--worker", default=None, help="the decode worker to send it to (default: the pool)")
    p.add_argument("--target-endpoint", default=None, help="the prefill worker it must use")
    p.add_argument("--message", default="What is the capital of France?")
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args(argv)
    text = load_text(MODEL)
    ids = text.tokenizer.encode(text.chat_template.render([{"role": "user", "content": args.message}]))

    async def go() -> dict:
        async with Client(args.nats_url) as c:
            kw = {"target_endpoint": args.target_endpoint} if args.target_endpoint else {}
            return await c.generate(uuid.uuid4().hex, ids, worker=args.worker, max_tokens=args.max_tokens,
                                    ignore_eos=True, **kw)

    print(json.dumps(asyncio.run(go())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
