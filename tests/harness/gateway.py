"""A gateway app served in this process, and how its tests talk to it: request bodies, OpenAI errors, metrics."""

from __future__ import annotations

import socket
import threading
from typing import Any

import httpx
import uvicorn

from engine.model_files import DEFAULT_MODEL
from runtime.settings import GatewayConfig
from tests.harness.wait import wait_until


class ServerThread:
    """A uvicorn server for an ASGI app in a thread, on a socket bound here (no port race; lifespan included)."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()

        def started() -> bool:
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn exited during start-up")
            return self.server.started

        wait_until(started, timeout, "uvicorn to start", interval=0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def make_config(nats_url: str, **kw: Any) -> GatewayConfig:
    """The gateway's settings for a test on ``nats_url``: the default model, a short grace, ``kw`` on top."""
    kw.setdefault("deadline_grace", 0.5)
    # long enough that a loaded machine never declares a reporting worker lost; the tests of a
    # lost worker pass their own (short) value
    kw.setdefault("worker_lost_after", 10.0)
    return GatewayConfig(model=DEFAULT_MODEL, nats_url=nats_url, **kw)


def chat_body(content: str, **kw: Any) -> dict[str, Any]:
    """A chat completion request of one user turn, for the default model."""
    return {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": content}], **kw}


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """``r`` is an OpenAI error body with ``status`` (and ``param``, ``code`` where given); returns the error."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def dropped_counts(url: str) -> dict[str, float]:
    """tandem_gateway_stream_messages_dropped_total by reason, from the gateway's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == "tandem_gateway_stream_messages_dropped_total":
                out[s.labels["reason"]] = s.value
    return out
