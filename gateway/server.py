"""``tandem gateway``: run the OpenAI-compatible HTTP gateway with uvicorn.

Flags override ``TANDEM_*`` variables (see :class:`runtime.settings.GatewayConfig`). The
heavy imports (FastAPI, uvicorn, the tokenizer) happen only when the command runs, so
``tandem --help`` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import sys

log = logging.getLogger("tandem.gateway")


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``tandem gateway`` flags to ``p`` and make it run :func:`main`."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--model", default=None, help="model alias, .gguf file or HF directory (TANDEM_MODEL)")
    p.add_argument("--nats-url", default=None, help="NATS server URL(s), comma-separated (TANDEM_NATS_URL)")
    p.add_argument("--namespace", default=None, help="subject namespace (TANDEM_NAMESPACE, default tandem)")
    p.add_argument("--gateway-id", default=None, help="id in stream subjects (default gw-<random>)")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="default request deadline in seconds (TANDEM_REQUEST_TIMEOUT, default 600)")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="another name the model answers to (repeatable)")
    p.add_argument("--queue-when-no-workers", action="store_true", default=None,
                   help="queue requests on the pool even when no worker is alive (scale from zero)")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    """Run the gateway until SIGINT/SIGTERM; 2 on a configuration error, 3 when start-up fails."""
    import uvicorn

    from engine.loader import ModelLoadError
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
        )
        text = load_text_model(config.model)
    except (ValueError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = create_app(config, text)
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    server = uvicorn.Server(uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=level if level in ("critical", "error", "warning", "info", "debug") else "warning",
        timeout_graceful_shutdown=5,
        access_log=False,
    ))
    print(f"tandem gateway {config.gateway_id}: http://{args.host}:{args.port}/v1 (model {text.name}, "
          f"NATS {config.nats_url})", file=sys.stderr, flush=True)
    server.run()
    if not server.started:
        print("error: the gateway failed to start (see the log above)", file=sys.stderr)
        return 3
    return 0
