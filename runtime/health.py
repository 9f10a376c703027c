"""A worker's HTTP port: ``/metrics`` (Prometheus), ``/health`` (the process is up) and ``/ready``.

``/ready`` is 200 once the model is loaded, NATS is connected and the worker takes work, and 503 (with
what is missing) before that, while NATS is away and once it drains — what a Kubernetes
startup/readiness probe asks. The server starts before the model loads, so a busy port fails in a
moment (or, with ``--metrics-port-fallback``, as ``tandem up`` starts its workers, moves to a free one and
says so) and ``/health`` answers during the load; it runs on its own threads, never the model's.
"""

from __future__ import annotations

import errno
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from runtime.metrics import REGISTRY


@dataclass
class WorkerHealth:
    """What the worker tells its probes; written by the worker, read by the HTTP threads."""

    role: str = ""
    worker_id: str = ""
    phase: str = "starting"  # starting, loading model, connecting, ready, draining
    model_loaded: bool = False
    nats_connected: Callable[[], bool] = field(default=lambda: False)

    def readiness(self) -> tuple[bool, dict[str, object]]:
        """(ready, the JSON body of /ready)."""
        connected = self.nats_connected()
        ok = self.model_loaded and connected and self.phase == "ready"
        body: dict[str, object] = {"status": "ready" if ok else "not_ready", "phase": self.phase,
                                   "role": self.role, "worker_id": self.worker_id,
                                   "model_loaded": self.model_loaded, "nats_connected": connected}
        if not ok:
            body["reason"] = ("the model is loading" if not self.model_loaded else
                              "draining" if self.phase == "draining" else
                              "not connected to NATS" if not connected else f"still {self.phase}")
        return ok, body


#: what a worker with ``--metrics-port-fallback`` says at each start: where its metrics are (``tandem up`` reads it)
METRICS_AT = re.compile(r"^tandem serve \S+: metrics on port (\d+)")


def metrics_at_line(worker_id: str, asked: int, got: int) -> str:
    """The line :data:`METRICS_AT` matches: the port serving, and whether the one asked for was busy."""
    moved = f" (port {asked} is busy)" if got != asked else ""
    return f"tandem serve {worker_id}: metrics on port {got}{moved}"


def serve_worker_http(port: int, host: str, health: WorkerHealth,
                      any_port_if_busy: bool = False) -> ThreadingHTTPServer | None:
    """Serve /metrics, /health and /ready on ``host:port`` from a daemon thread (0: no server). A busy port
    raises OSError, or with ``any_port_if_busy`` takes a free one (``server.server_address[1]`` says which)."""
    if not port:
        return None

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server interface
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
            elif path == "/health":
                self._json(200, {"status": "ok", "phase": health.phase})
            elif path == "/ready":
                ok, body = health.readiness()
                self._json(200 if ok else 503, body)
            else:
                self._json(404, {"error": f"no such path {path}; try /metrics, /health or /ready"})

        def _json(self, status: int, body: dict[str, object]) -> None:
            self._send(status, json.dumps(body).encode(), "application/json")

        def _send(self, status: int, data: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # probes every few seconds: not logged
            return

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as e:
        if not (any_port_if_busy and e.errno == errno.EADDRINUSE):
            raise
        server = ThreadingHTTPServer((host, 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="worker-http", daemon=True).start()
    return server
