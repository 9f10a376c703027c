"""``tandem gateway``: run the OpenAI-compatible HTTP gateway with uvicorn, and drain it on SIGTERM.

Flags override ``TANDEM_*`` variables (see :class:`runtime.settings.GatewayConfig`). The
heavy imports (FastAPI, uvicorn, the tokenizer) happen only when the command runs, so
``tandem --help`` stays fast.

Shutdown (:func:`drain_then_exit`): the first SIGTERM/SIGINT makes the gateway refuse new
requests (503 with ``Retry-After``; ``/ready`` turns 503 so balancers move away) while the
listening socket stays open, lets running requests finish for up to ``--drain-timeout``
seconds, ends what is left with an OpenAI error (JSON, or an SSE error event and ``[DONE]``),
and only then lets uvicorn close the connections. A second signal ends the drain at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from types import FrameType
from typing import Any

log = logging.getLogger("tandem.gateway")

#: after the drain, how long the handlers get to write the errors of the requests it ended
ABORT_GRACE_S = 5.0


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``tandem gateway`` flags to ``p`` and make it run :func:`main`."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--model", default=None,
                   help="model alias, .gguf file or HF directory (TANDEM_MODEL; default smollm2-135m-instruct)")
    p.add_argument("--nats-url", default=None, help="NATS server URL(s), comma-separated (TANDEM_NATS_URL; default nats://127.0.0.1:4222)")
    p.add_argument("--namespace", default=None, help="subject namespace (TANDEM_NAMESPACE, default tandem)")
    p.add_argument("--gateway-id", default=None, help="id in stream subjects (default gw-<random>)")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="default request deadline in seconds (TANDEM_REQUEST_TIMEOUT, default 600)")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="a name the model answers to, the first one also in /v1/models (repeatable; default: "
                        "the model's own name)")
    p.add_argument("--queue-when-no-workers", action="store_true", default=None,
                   help="queue requests on the pool even when no worker is alive (scale from zero; "
                        "TANDEM_GATEWAY_QUEUE_WHEN_NO_WORKERS; default off: 503)")
    p.add_argument("--drain-timeout", type=float, default=None,
                   help="SIGTERM: seconds running requests get to finish before they end with an error "
                        "(TANDEM_GATEWAY_DRAIN_TIMEOUT, default 30)")
    p.add_argument("--max-queue-wait", type=float, default=None,
                   help="refuse a request at once (429, Retry-After) when its expected wait for a worker is "
                        "longer than this many seconds; 0: never (TANDEM_GATEWAY_MAX_QUEUE_WAIT, default 30)")
    p.add_argument("--migration-limit", type=int, default=None,
                   help="times a request may move to another decode worker when its worker dies after tokens "
                        "were sent (TANDEM_GATEWAY_MIGRATION_LIMIT, default 1; 0: never, it fails with 503)")
    p.add_argument("--worker-wait", type=float, default=None,
                   help="seconds a request whose worker died waits, when no other decode worker is alive, for "
                        "one to come (or the same one restarted) before it fails (TANDEM_GATEWAY_WORKER_WAIT, "
                        "default 15)")
    p.add_argument("--bus-lost-after", type=float, default=None,
                   help="seconds the gateway may be cut off from every NATS member before its open requests end "
                        "with 503 bus_unavailable; shorter outages lose no token (TANDEM_GATEWAY_BUS_LOST_AFTER, "
                        "default 20)")
    add_sampling_default_flags(p)
    p.set_defaults(func=main)
    return p


#: --default-<name> flags: the sampling a request gets when it leaves the field out
SAMPLING_FLAGS = (("temperature", float), ("top_p", float), ("top_k", int), ("repetition_penalty", float))


def add_sampling_default_flags(p: argparse.ArgumentParser) -> None:
    """``--default-max-tokens``, ``--default-temperature`` etc., shared by ``tandem gateway`` and ``tandem up``."""
    from runtime.settings import DEFAULT_MAX_TOKENS

    p.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                   help="max_tokens of a request that gives neither max_tokens nor max_completion_tokens, still cut "
                        "to what the context leaves; 0: up to the end of the context "
                        f"(TANDEM_GATEWAY_DEFAULT_MAX_TOKENS; default {DEFAULT_MAX_TOKENS})")
    for name, kind in SAMPLING_FLAGS:
        p.add_argument(f"--default-{name.replace('_', '-')}", type=kind, default=None,
                       help=f"{name} of a request that leaves it out (default: the model's own, from its "
                            "generation_config.json or, for the built-in model, its card)")


def sampling_default_args(args: argparse.Namespace) -> list[str]:
    """The ``--default-*`` flags given, as command-line words (``tandem up`` passes them to the gateway)."""
    out: list[str] = []
    for name in ("max_tokens", *(name for name, _ in SAMPLING_FLAGS)):
        value = getattr(args, f"default_{name}", None)
        if value is not None:
            out += [f"--default-{name.replace('_', '-')}", str(value)]
    return out


def describe_defaults(max_tokens: int, sampling: dict[str, Any]) -> str:
    """What a request that leaves these fields out gets, in words (the gateway's and ``tandem up``'s banners)."""
    cap = f"max_tokens {max_tokens}" if max_tokens else "max_tokens up to the context"
    return ", ".join([cap, *(f"{k} {v:g}" for k, v in sampling.items())])


def gateway_server(app: Any, config: Any, **uvicorn_kw: Any) -> Any:
    """A uvicorn server for ``app`` whose first SIGTERM/SIGINT drains the gateway instead of cutting it off."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def __init__(self) -> None:
            super().__init__(uvicorn.Config(app, **uvicorn_kw))
            self.loop: asyncio.AbstractEventLoop | None = None
            self.drain_task: asyncio.Task[None] | None = None

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            self.loop = asyncio.get_running_loop()
            if self.started:
                print(f"tandem gateway ready: {config.gateway_id}", file=sys.stderr, flush=True)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.loop is None or self.should_exit:
                self.should_exit = True
                return
            if self.drain_task is not None:  # a second signal: stop waiting
                self.loop.call_soon_threadsafe(self.drain_task.cancel)
                return
            self.loop.call_soon_threadsafe(self._start_drain)

        def _start_drain(self) -> None:
            self.drain_task = asyncio.ensure_future(drain_then_exit(app, config.drain_timeout, self))

    return DrainingServer()


async def drain_then_exit(app: Any, timeout: float, server: Any) -> None:
    """Refuse new requests, wait up to ``timeout`` for running ones, end the rest with 503, then stop ``server``."""
    gw = getattr(app.state, "gateway", None)
    try:
        if gw is not None:
            gw.draining = True
            running = len(gw.runs)
            print(f"tandem gateway: draining ({running} request{'s' if running != 1 else ''} running; "
                  f"up to {timeout:g}s)", file=sys.stderr, flush=True)
            await gw.runs_ended(timeout)
    except asyncio.CancelledError:
        log.warning("second signal: ending the drain now")
    finally:
        if gw is not None and gw.runs:
            left = gw.abort_all(f"the gateway is shutting down (its drain time of {timeout:g}s passed); retry")
            log.warning("drain time over: ended %d running request(s) with 503", left)
            await gw.runs_ended(ABORT_GRACE_S)
        server.should_exit = True


def main(args: argparse.Namespace) -> int:
    """Run the gateway until SIGINT/SIGTERM; 2 on a configuration error, 3 when start-up fails."""
    from engine.model_text import ModelLoadError
    from gateway.app import create_app
    from gateway.textmodel import load_text_model
    from runtime.settings import GatewayConfig

    try:
        config = GatewayConfig.from_env(
            model=args.model,
            nats_url=args.nats_url,
            namespace=args.namespace,
            gateway_id=args.gateway_id,
            request_timeout=args.request_timeout,
            served_model_names=tuple(args.served_model_name) if args.served_model_name else None,
            queue_when_no_workers=args.queue_when_no_workers,
            drain_timeout=args.drain_timeout,
            max_queue_wait=args.max_queue_wait,
            migration_limit=args.migration_limit,
            worker_wait=args.worker_wait,
            bus_lost_after=args.bus_lost_after,
            default_max_tokens=args.default_max_tokens,
            **{f"default_{name}": getattr(args, f"default_{name}") for name, _ in SAMPLING_FLAGS},
        )
        text = load_text_model(config.model)
    except (ValueError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = create_app(config, text)
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    server = gateway_server(
        app, config, host=args.host, port=args.port,
        log_level=level if level in ("critical", "error", "warning", "info", "debug") else "warning",
        timeout_graceful_shutdown=5, access_log=False, http="httptools", loop="uvloop",
    )
    said = describe_defaults(config.default_max_tokens, {**text.sampling_defaults, **config.sampling_overrides()})
    print(f"tandem gateway {config.gateway_id}: http://{args.host}:{args.port}/v1 (model {text.name}, "
          f"NATS {config.nats_url}; defaults: {said})", file=sys.stderr, flush=True)
    server.run()
    if not server.started:
        print("error: the gateway failed to start (see the log above)", file=sys.stderr)
        return 3
    return 0
