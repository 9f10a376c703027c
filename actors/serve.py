"""`tandem serve`: build the actor for a pipeline role and run it until SIGTERM."""

from __future__ import annotations

import asyncio
import logging

from engine.loader import load_model
from tandem.settings import Settings

log = logging.getLogger(__name__)


def serve(settings: Settings) -> int:
    from actors.decode import DecodeActor
    from actors.prefill import PrefillActor
    from tandem.metrics import serve_metrics

    loaded = load_model(settings.model, settings.dtype)
    serve_metrics(settings.metrics_port)
    actor_cls = PrefillActor if settings.role == "prefill_only" else DecodeActor
    actor = actor_cls(settings, loaded)
    asyncio.run(actor.run())
    return 0 if actor.runner is None or actor.runner.failure is None else 1
